"""The tree walk's options shared by :class:`~trl_dta.TreePPOConfig` and :class:`~trl_dta.TreeSFTConfig`.

:class:`TreeArguments` is a dataclass mixin: a config lists it *before* its TRL parent
(``class TreePPOConfig(TreeArguments, GRPOConfig)``) so that TRL's fields keep their order (``output_dir``
stays the first positional argument) and the ``tree_*`` fields follow them. :data:`PAPER` is the method's
paper, which both trainers name as their ``_paper`` (TRL's model cards cite it).
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

from ..walk.budgets import Budgets
from ..walk.checks import check_count

_TITLE = "AReaL-DTA: Dynamic Tree Attention for Efficient Reinforcement Learning of Large Language Models"
PAPER = {
    "title": _TITLE,
    "id": "2602.00482",
    "citation": textwrap.dedent(f"""\
        @article{{zhang2026arealdta,
            title        = {{{{{_TITLE}}}}},
            author       = {{Jiarui Zhang and Yuchen Yang and Ran Yan and Zhiyu Mei and Liyuan Zhang
                            and Daifeng Li and Wei Fu and Jiaxuan Gao and Shusheng Xu and Yi Wu
                            and Binhang Yuan}},
            year         = 2026,
            eprint       = {{arXiv:2602.00482}},
        }}"""),
}


@dataclass
class TreeArguments:
    """The walk's memory and token budgets, its out-of-memory retries, and its gradient check.

    Args:
        tree_memory_budget (`float`, `str` or `None`, defaults to `"auto"`):
            Bytes of activation memory the walk may use; its token budgets (the three below, unless given) are
            derived from it for each step's trie (`trl_dta.walk.budgets`): first the graph of the trie's
            longest path, so that nothing is forwarded twice, then the largest calls that fit. `"auto"`: on
            CUDA, 90% of the free memory at the first walk less what the first optimizer step will still
            allocate (gradients, two Adam states); on CPU, the fixed budgets measured fastest on a 2-core
            machine (block 2048, leaf batch 2048, subtree 512). `None`: those fixed budgets everywhere.
            docs/memory.md has the memory model.
        tree_block_size (`int` or `None`, defaults to `None`):
            Most tokens forwarded with an autograd graph kept on the walk's stack, and longest forwarded
            segment; given, it wins over `tree_memory_budget`. Longer paths use chunked backward (blocks
            forwarded without a graph are recomputed when popped). Each token on the stack costs one token's
            activations (~2.2 MB for SmolLM2-135M in fp32, ~32x what gradient checkpointing keeps per
            token); docs/memory.md has measurements.
        tree_batch_tokens (`int` or `None`, defaults to `None`):
            Most tokens of sibling leaves forwarded together on their shared prefix: their total tokens (they
            are packed into one row with a block-diagonal causal mask on eager/sdpa attention), or rows x
            longest row where they are padded into a batch. `None`: derived from `tree_memory_budget`, or
            `tree_block_size` when that is given without a memory budget; 0 forwards one leaf per call.
        tree_subtree_tokens (`int` or `None`, defaults to `None`):
            Where sibling leaves are packed (eager/sdpa attention), most tokens of a subtree (a trie node and
            all its descendants, or several sibling subtrees) forwarded whole in one row with a tree-shaped
            causal mask and backpropagated in one call. Within the budget a cost model of the device decides
            which calls to merge (`trl_dta.walk.costs`). `None`: derived from `tree_memory_budget`; 0 turns
            it off.
        tree_oom_retries (`int`, defaults to 3):
            A walk that runs out of memory (`torch.OutOfMemoryError`) discards the gradients it added, halves
            the token budgets it used (given, or derived from `tree_memory_budget`) and walks the step's trie
            again, up to this many times; then it raises, naming the budgets and the step's longest path.
            The smaller budgets stay, and double back after 100 optimizer steps without running out (then
            derived from `tree_memory_budget` again, where they were). Retries are logged as
            `tree/oom_retries`. 0 turns it off (docs/memory.md, "Running out of memory").
        tree_check_gradients (`bool`, defaults to `False`):
            On the first optimizer step, also compute its gradients the dense TRL way (each of its
            micro-batches) and raise if the tree walk's gradients differ (relative tolerance
            `tree_check_tolerance`). Costs one dense forward/backward of a step, once.
        tree_check_tolerance (`float`, defaults to 1e-3):
            Largest allowed per-tensor ``max|tree - dense| / max|dense|`` for `tree_check_gradients`.
    """

    tree_memory_budget: float | str | None = field(
        default="auto",
        metadata={"help": 'Walk memory, bytes ("auto": from free CUDA memory; None: fixed).'},
    )
    tree_block_size: int | None = field(
        default=None, metadata={"help": "Tokens with a kept graph on the walk's stack (None: from memory)."}
    )
    tree_batch_tokens: int | None = field(
        default=None, metadata={"help": "Token budget for batching sibling leaves (None: from memory)."}
    )
    tree_subtree_tokens: int | None = field(
        default=None, metadata={"help": "Pack subtrees of at most this many tokens into one call (0: off)."}
    )
    tree_oom_retries: int = field(
        default=3, metadata={"help": "Out of memory: walk again, budgets halved, this many times (0: off)."}
    )
    tree_check_gradients: bool = field(
        default=False,
        metadata={"help": "Compare the first step's gradients with the dense path; raise if off."},
    )
    tree_check_tolerance: float = field(default=1e-3, metadata={"help": "Tolerance of tree_check_gradients."})

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.tree_memory_budget, str) and self.tree_memory_budget != "auto":
            self.tree_memory_budget = float(self.tree_memory_budget)  # from the command line, e.g. "6e10"
        Budgets(  # (validates them: the walk's budgets are checked in one place)
            self.tree_memory_budget,
            self.tree_block_size,
            self.tree_batch_tokens,
            self.tree_subtree_tokens,
            prefix="tree_",
        )
        check_count("tree_oom_retries", self.tree_oom_retries)
