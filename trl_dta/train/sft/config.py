"""TreeSFTConfig: TRL's SFTConfig plus the tree walk's options (those shared with TreePPOConfig in
``tree_args.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import SFTConfig

from ..tree_args import TreeArguments, check_flag


@dataclass
class TreeSFTConfig(TreeArguments, SFTConfig):
    """Configuration for :class:`~trl_dta.TreeSFTTrainer`: every ``SFTConfig`` field, plus:

    Args:
        tree_memory_budget, tree_block_size, tree_batch_tokens, tree_subtree_tokens, tree_oom_retries,
        tree_check_gradients, tree_check_tolerance:
            The walk's memory and token budgets, its out-of-memory retries and its gradient check, as in
            :class:`~trl_dta.TreePPOConfig`: :class:`~trl_dta.train.tree_args.TreeArguments` documents them.
        tree_token_accuracy (`bool`, defaults to `True`):
            Log TRL's `mean_token_accuracy` (is each label token the model's top-1 token?). The walk scores a
            sequence by its labels' log-probs and entropies only, so the top-1 test costs one more forward of
            the step's trie without a graph (at a temperature of 1e-6, where a label's log-prob is near 0 if
            it is the top-1 token and hugely negative otherwise): about a quarter of the step's time. `False`
            skips it and logs no `mean_token_accuracy`.

    ``disable_dropout`` (the name and meaning of ``GRPOConfig``'s option; ``SFTConfig`` has none) and
    ``gradient_checkpointing`` default to what the walk needs (True, False):
    :class:`~trl_dta.train.tree_args.TreeArguments` says why.
    """

    tree_token_accuracy: bool = field(
        default=True,
        metadata={
            "help": "Log mean_token_accuracy: one more forward of the trie, without a graph "
            "(--no_tree_token_accuracy skips it)."
        },
    )

    def __post_init__(self):
        super().__post_init__()  # (TreeArguments checks the shared options)
        check_flag("tree_token_accuracy", self.tree_token_accuracy)
