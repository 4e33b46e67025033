"""TreePPOConfig: TRL's GRPOConfig plus the tree walk's options (the shared ones in ``tree_args.py``) and
those of PPO with a value model (``critic/args.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig

from ..critic.args import ValueArguments
from ..tree_args import TreeArguments, check_flag


@dataclass
class TreePPOConfig(TreeArguments, ValueArguments, GRPOConfig):
    """Configuration for :class:`~trl_dta.TreePPOTrainer`: every ``GRPOConfig`` field, plus:

    Args:
        tree_memory_budget, tree_block_size, tree_batch_tokens, tree_subtree_tokens, tree_oom_retries,
        tree_check_gradients, tree_check_tolerance:
            The walk's memory and token budgets, its out-of-memory retries and its gradient check, shared with
            :class:`~trl_dta.TreeSFTConfig`: :class:`~trl_dta.train.tree_args.TreeArguments` documents them.
        gamma, lam, cliprange_value, whiten_advantages, value_learning_rate, value_max_grad_norm:
            PPO with a value model (the trainer's `value_model`; not read without one):
            :class:`~trl_dta.train.critic.args.ValueArguments` documents them (docs/ppo-critic.md).
        tree_lexicographic_steps (`bool`, defaults to `False`):
            Opt-in. Instead of TRL's random shuffle, order each generation batch lexicographically (rows that
            share a prefix become neighbours) and cut it into micro-batches in that order, so each optimizer
            step gets a contiguous run: GRPO groups and shared turns stay in one step's trie. This changes
            which rows form each mini-batch (whole groups per step, rather than a random mix) and each
            micro-batch; with `steps_per_generation == gradient_accumulation_steps` (TRL's default) every
            optimizer step already walks the whole generation batch, and only micro-batch statistics
            (bnpo, `top_entropy_quantile`, the entropy bonus) are affected.
        tree_gather_per_layer (`bool`, defaults to `False`):
            FSDP2 only. By default each walk gathers every sharded unit once and reduce-scatters once at its
            end (the whole model gathered on every GPU while walking). With `True`, each decoder layer is
            gathered only for its own calls and its gradients are reduce-scattered after each backward
            call, all ranks' calls kept in lock-step: one layer's parameters and gradients at a time, for
            models that do not fit otherwise, at the cost of a gather per layer and call (README, "Multi-GPU
            and sharded training").

    ``disable_dropout`` and ``gradient_checkpointing`` default to what the walk needs (True, False):
    :class:`~trl_dta.train.tree_args.TreeArguments` says why.
    """

    tree_lexicographic_steps: bool = field(
        default=False,
        metadata={
            "help": "Cut each generation batch into micro-batches in lexicographic order instead of TRL's "
            "shuffle: each optimizer step gets whole groups (matters when steps_per_generation > "
            "gradient_accumulation_steps)."
        },
    )
    tree_gather_per_layer: bool = field(
        default=False,
        metadata={
            "help": "FSDP2: gather each decoder layer for its own calls (less memory, more gathers) instead "
            "of the whole model once per walk."
        },
    )

    def __post_init__(self):
        super().__post_init__()  # (TreeArguments checks the shared options)
        check_flag("tree_lexicographic_steps", self.tree_lexicographic_steps)
        check_flag("tree_gather_per_layer", self.tree_gather_per_layer)
