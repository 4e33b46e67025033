"""The tree walk's options shared by :class:`~trl_dta.TreePPOConfig`, :class:`~trl_dta.AsyncTreePPOConfig` and
:class:`~trl_dta.TreeSFTConfig`.

:class:`TreeArguments` is a dataclass mixin: a config lists it *before* its TRL parent
(``class TreePPOConfig(TreeArguments, GRPOConfig)``) so that TRL's fields keep their order (``output_dir``
stays the first positional argument) and the ``tree_*`` fields follow them. :data:`PAPER` is the method's
paper, which both trainers name as their ``_paper`` (TRL's model cards cite it).
"""

from __future__ import annotations

import math
import os
import textwrap
from dataclasses import dataclass, field

from ..walk.adapter.checks import check_count
from ..walk.errors import ArgumentTypeError
from ..walk.memory.budgets import Budgets
from ..walk.memory.memory_budget import parse_memory_budget

COST_FITS = ("auto", "reset", "frozen", "off")  # tree_cost_fit (trl_dta.walk.cost.cost_model)
DENSE_FALLBACKS = ("auto", "never", "always")  # tree_dense_fallback (trl_dta.train.dense_fallback)
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
    """The walk's memory and token budgets, its out-of-memory retries, its gradient check, its fitted call
    costs and the dense fallback.

    Args:
        tree_memory_budget (`float`, `str` or `None`, defaults to `"auto"`):
            Bytes of activation memory the walk may use; its token budgets (the three below, unless given) are
            derived from it for each step's trie (`trl_dta.walk.memory.budgets`): first the graph of the
            trie's longest path, so that nothing is forwarded twice, then the largest calls that fit.
            `"auto"`: on CUDA, 90% of the free memory at the first walk less what the first optimizer step
            will still allocate (gradients, two Adam states) and what a colocated vLLM engine will claim; on
            CPU, the fixed budgets measured fastest on a 2-core machine (block 2048, leaf batch 2048, subtree
            512). `None`: those fixed budgets everywhere. Accepted as typed in Python, a YAML file or on the
            command line (strings case-insensitive, a space before the unit allowed): `"auto"`; `None`,
            `"none"` or `"null"`; a number of bytes (`6e10`, `"8000000000"`); bytes with a decimal unit
            (`"8GB"`, `"1.5TB"`, `"512MB"`: powers of 1000) or a binary one (`"8GiB"`, `"512MiB"`: powers of
            1024); or a percentage (`"80%"`, at most 100): `"auto"` with that share of the free memory instead
            of 90% (on CUDA: the device memory free at the first walk, less the same; off CUDA, as `"auto"`,
            the fixed budgets: give bytes to derive the budgets from a CPU's memory). Read by
            :func:`~trl_dta.walk.memory.memory_budget.parse_memory_budget`: bytes are kept as a float, a
            percentage as its string (`"80%"`). docs/memory.md has the memory model.
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
            which calls to merge (`trl_dta.walk.cost.costs`). `None`: derived from `tree_memory_budget`; 0
            turns it off.
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
            `tree_check_tolerance`). Costs one dense forward/backward of a step, once. That step walks
            whatever `tree_dense_fallback` says.
        tree_check_tolerance (`float`, defaults to 1e-3):
            Largest allowed per-tensor ``max|tree - dense| / max|dense|`` for `tree_check_gradients` (a finite
            number >= 0).
        tree_cost_fit (`str`, defaults to `"auto"`):
            The call-cost constants the plan merges calls by and the dense fallback compares with
            (docs/cost-model.md). `"auto"`: the gradient walks time their calls, the constants are fitted to
            them online and kept in the cache (`tree_cost_cache`) for this device and model, where the next
            run starts (on CUDA a first run whose walks leave the launch cost undetermined plans one walk
            unmerged to measure it); `"reset"`: as `"auto"`, the cached fit forgotten first; `"frozen"`: the
            cached fit (or the shipped constants) pinned, nothing timed or written; `"off"`: the shipped
            constants.
        tree_cost_cache (`str` or `None`, defaults to `None`):
            Directory of the fitted constants. `None`: `$TRL_DTA_CACHE_DIR`, else `$XDG_CACHE_HOME/trl_dta`,
            else `~/.cache/trl_dta`.
        tree_dense_fallback (`str`, defaults to `"auto"`):
            `"auto"`: before each step, predict the walk's time and TRL's dense path's for the same rows by
            the constants in use (shipped, cached or fitted in this run), from the first step, and take TRL's
            own dense path where it is faster by `tree_dense_margin`; `"never"`: always walk; `"always"`:
            always TRL's dense path (for comparison). The gradients are the same either way. Each step is
            timed, and each path's measured over predicted seconds scale its next predictions; a path not
            measured yet is explored once first, and again when the other's scale drifts past 2x
            (`tree/path_reason`); a step whose dense path would not fit the free CUDA memory walks. One
            process or several under DDP (every rank takes the path the slowest rank's predictions choose:
            one all-reduce a step); under DeepSpeed or FSDP every step walks. All three trainers, not with a
            value model or `check_staleness_at_training`. Where every step walks, `"always"` is refused
            when the trainer is built.
        tree_dense_margin (`float`, defaults to 0.1):
            The dense path is taken where its predicted time x (1 + margin) is below the walk's.

    Defaults of TRL's own fields that differ (in every tree config):

    * ``disable_dropout=True``: a shared prefix shares one dropout mask, so the walk equals the dense loss
      only without randomness. Besides TRL's zeroing of ``nn.Dropout`` modules, the probabilities models hold
      as numbers (OPT's functional dropout and layer drop, Mixtral's router jitter, ...) are set to 0, on the
      modules and in the model's config (a saved config has them at 0); then two forwards of the same input
      in train mode must agree, or the trainer refuses the model, naming the settings. With `False`, a model
      that still has randomness in train mode is refused when the trainer is built. (``SFTConfig`` and
      ``AsyncGRPOConfig`` have no such field, or keep the model's dropout: the field is the tree configs'.)
    * ``gradient_checkpointing=False``: the walk bounds activation memory itself; if turned on, the walk
      switches it off for its own forwards and restores it after (TRL's generation is unchanged).
    """

    tree_memory_budget: float | str | None = field(
        default="auto",
        metadata={
            "help": 'Activation memory of the walk: "auto" (90%% of the free CUDA memory at the first walk; '
            "on CPU the fixed token budgets), None (the fixed budgets), bytes (6e10, 8GB, 8GiB, 512MiB) or a "
            'share of the free CUDA memory ("80%%", as "auto").'
        },
    )
    tree_block_size: int | None = field(
        default=None,
        metadata={
            "help": "Most tokens with a kept autograd graph on the walk's stack, and longest forwarded "
            "segment; wins over tree_memory_budget (unset: derived from it)."
        },
    )
    tree_batch_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Most tokens of sibling leaves forwarded together (0: one leaf per call; unset: derived "
            "from tree_memory_budget, or tree_block_size's when that is given and no memory budget applies)."
        },
    )
    tree_subtree_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Most tokens of a subtree forwarded whole in one call with a tree-shaped mask, on "
            "eager/sdpa (0: off; unset: derived from tree_memory_budget)."
        },
    )
    tree_oom_retries: int = field(
        default=3,
        metadata={"help": "Out of memory: walk the step again, budgets halved, this many times (0: off)."},
    )
    tree_check_gradients: bool = field(
        default=False,
        metadata={
            "help": "On the first optimizer step, also compute its gradients densely (no tree) and raise if "
            "the walk's differ by more than tree_check_tolerance."
        },
    )
    tree_check_tolerance: float = field(
        default=1e-3,
        metadata={"help": "tree_check_gradients: largest max|tree - dense| / max|dense| of any tensor."},
    )

    tree_cost_fit: str = field(
        default="auto",
        metadata={
            "help": 'Call-cost constants: "auto" (fitted online on this device, cached), "reset" (the cache '
            'forgotten first), "frozen" (the cached fit pinned, nothing timed) or "off" (shipped constants).'
        },
    )
    tree_cost_cache: str | None = field(
        default=None,
        metadata={
            "help": "Directory of the fitted call costs (unset: $TRL_DTA_CACHE_DIR or ~/.cache/trl_dta)."
        },
    )
    tree_dense_fallback: str = field(
        default="auto",
        metadata={
            "help": 'Take TRL\'s dense path where it is predicted faster: "auto" (per step, by the fitted '
            'costs and tree_dense_margin), "never" or "always".'
        },
    )
    tree_dense_margin: float = field(
        default=0.1,
        metadata={
            "help": "tree_dense_fallback: dense is taken where its predicted time x (1 + margin) wins."
        },
    )

    # TRL's own fields, with the defaults the walk needs (the same in every tree config)
    disable_dropout: bool = field(
        default=True, metadata={"help": "Disable dropout (required for exactness)."}
    )
    gradient_checkpointing: bool = field(
        default=False,
        metadata={"help": "Not needed by the tree walk; if on, it is suspended during the walk."},
    )

    def __post_init__(self):
        super().__post_init__()
        self.tree_memory_budget = parse_memory_budget(self.tree_memory_budget, "tree_memory_budget")
        Budgets(  # (validates them: the walk's budgets are checked in one place)
            self.tree_memory_budget,
            self.tree_block_size,
            self.tree_batch_tokens,
            self.tree_subtree_tokens,
            prefix="tree_",
        )
        check_count("tree_oom_retries", self.tree_oom_retries)
        check_flag("tree_check_gradients", self.tree_check_gradients)
        tolerance = self.tree_check_tolerance
        if isinstance(tolerance, bool) or not isinstance(tolerance, int | float):
            raise ArgumentTypeError(f"tree_check_tolerance must be a number >= 0 (1e-3), got {tolerance!r}")
        if not 0 <= tolerance < math.inf:  # (NaN fails too)
            raise ValueError(f"tree_check_tolerance must be a finite number >= 0 (1e-3), got {tolerance}")
        check_choice("tree_cost_fit", self.tree_cost_fit, COST_FITS)
        check_choice("tree_dense_fallback", self.tree_dense_fallback, DENSE_FALLBACKS)
        margin = self.tree_dense_margin
        if isinstance(margin, bool) or not isinstance(margin, int | float) or not 0 <= margin < math.inf:
            raise ValueError(f"tree_dense_margin must be a finite number >= 0 (0.1), got {margin!r}")
        if self.tree_cost_cache is not None and not isinstance(self.tree_cost_cache, str | os.PathLike):
            raise ArgumentTypeError(f"tree_cost_cache must be a directory path, got {self.tree_cost_cache!r}")


def check_choice(name: str, value, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


def check_flag(name: str, value) -> None:
    """A ``tree_*`` switch must be a bool (``--name``, ``--name false`` on the command line): a string such as
    ``"false"`` given in Python would read as true."""
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
