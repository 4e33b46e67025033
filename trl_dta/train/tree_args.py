"""The tree walk's options shared by :class:`~trl_dta.TreePPOConfig` and :class:`~trl_dta.TreeSFTConfig`.

:class:`TreeArguments` is a dataclass mixin: a config lists it *before* its TRL parent
(``class TreePPOConfig(TreeArguments, GRPOConfig)``) so that TRL's fields keep their order (``output_dir``
stays the first positional argument) and the ``tree_*`` fields follow them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..walk.checks import check_count


@dataclass
class TreeArguments:
    """The walk's budgets and its gradient check.

    Args:
        tree_block_size (`int`, defaults to 2048):
            Most tokens forwarded with an autograd graph kept on the walk's stack, and longest forwarded
            segment. Longer paths use chunked backward (blocks forwarded without a graph are recomputed
            when popped). The walk's memory knob: at its peak the walk keeps the graph of up to about twice
            this many tokens (the stack's, plus a block recomputed at pop or a leaf batch of up to
            `tree_batch_tokens`), each costing one token's activations (~2.2 MB for SmolLM2-135M in fp32,
            ~32x what gradient checkpointing keeps per token). Larger is faster on paths longer than it;
            docs/memory.md has measurements.
        tree_batch_tokens (`int` or `None`, defaults to `None`):
            Budget for forwarding sibling leaves together on their shared prefix: their total tokens (they
            are packed into one row with a block-diagonal causal mask on eager/sdpa attention), or rows x
            longest row where they are padded into a batch. `None` uses `tree_block_size`; 0 forwards one
            leaf per call.
        tree_subtree_tokens (`int`, defaults to 512):
            Where sibling leaves are packed (eager/sdpa attention), a subtree of at most this many tokens (a
            trie node and all its descendants) is forwarded whole in one row with a tree-shaped causal mask
            and backpropagated in one call: fewer, larger model calls. The mask's attention covers the whole
            row, so a larger budget trades per-call overhead for attention work. 0 turns it off.
        tree_check_gradients (`bool`, defaults to `False`):
            On the first optimizer step, also compute its gradients the dense TRL way (each of its
            micro-batches) and raise if the tree walk's gradients differ (relative tolerance
            `tree_check_tolerance`). Costs one dense forward/backward of a step, once.
        tree_check_tolerance (`float`, defaults to 1e-3):
            Largest allowed per-tensor ``max|tree - dense| / max|dense|`` for `tree_check_gradients`.
    """

    tree_block_size: int = field(
        default=2048, metadata={"help": "Tokens with a kept graph on the walk's stack."}
    )
    tree_batch_tokens: int | None = field(
        default=None, metadata={"help": "Token budget for batching sibling leaves (None: tree_block_size)."}
    )
    tree_subtree_tokens: int = field(
        default=512, metadata={"help": "Pack subtrees of at most this many tokens into one call (0: off)."}
    )
    tree_check_gradients: bool = field(
        default=False,
        metadata={"help": "Compare the first step's gradients with the dense path; raise if off."},
    )
    tree_check_tolerance: float = field(default=1e-3, metadata={"help": "Tolerance of tree_check_gradients."})

    def __post_init__(self):
        super().__post_init__()
        check_count("tree_block_size", self.tree_block_size, minimum=1)
        if self.tree_batch_tokens is not None:
            check_count("tree_batch_tokens", self.tree_batch_tokens)
        check_count("tree_subtree_tokens", self.tree_subtree_tokens)

    def executor_options(self) -> dict:
        """The :class:`~trl_dta.TreeExecutor` keyword arguments these options set."""
        return {
            "block_size": self.tree_block_size,
            "batch_tokens": self.tree_batch_tokens,
            "subtree_tokens": self.tree_subtree_tokens,
        }
