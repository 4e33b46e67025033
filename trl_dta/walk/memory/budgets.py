"""The walk's token budgets, derived from the memory it may use.

A walk holds, at its peak, the autograd graph of the tokens on its stack (at most ``block_size`` of them)
plus the graph of the call it is running (a leaf batch or a packed subtree, at most ``batch_tokens`` /
``subtree_tokens``), and the path's K/V with a float32 gradient buffer beside it. Each of these is a number
of tokens times a number of bytes per token, which depends only on the model's shapes and dtype
(:func:`~trl_dta.walk.memory.memory_model.activation_bytes`, an analytic count of what autograd saves in a
pre-norm decoder layer, checked in ``tests/test_budgets.py`` against the bytes measured on CPU; the memory
model is :mod:`trl_dta.walk.memory.memory_model`). So a memory budget gives token budgets
(:func:`token_budgets`), in this order of priority:

1. no recompute: the stack keeps the graph of the longest path (the tokens above a leaf), if that leaves
   room for a call of at least ``MIN_CALL_TOKENS`` tokens; otherwise the memory is split 2:1 between the
   stack and the call (the paper's "larger backward block": the recompute falls as the block grows);
2. the largest calls that fit in the rest, capped where larger calls no longer pay on the device kind
   (:data:`~trl_dta.walk.cost.costs.DEVICE_COSTS`; the plan then decides, call by call, whether merging pays:
   :mod:`.costs`).

:class:`Budgets` is the one object that owns them for an executor: built once from the options (the only
place they are validated), it resolves the memory budget, derives the budgets of each walk, halves them when
a walk runs out of memory and grows them back (:mod:`trl_dta.walk.memory.recovery` decides when), keeps their
history and reports them (``in_use``, ``metrics()``).
"""

from __future__ import annotations

import copy
import logging
import math
from collections import deque
from typing import NamedTuple

import torch

from ..adapter.checks import check_count
from ..errors import ArgumentTypeError
from ..heads import default_head
from .memory_budget import (
    AUTO_FRACTION,
    auto_memory_bytes,
    measure_free_memory,
    memory_share,
    parse_memory_budget,
)
from .memory_model import (  # noqa: F401 - (also imported from here)
    FIXED,
    MIN_CALL_TOKENS,
    ActivationBytes,
    TokenBudgets,
    activation_bytes,
    activation_dtype,
    autocast_copies,
    token_budgets,
)

logger = logging.getLogger(__name__)

HISTORY = 1000  # changes of the budgets in use that Budgets.history keeps (the latest)


class BudgetChange(NamedTuple):
    """An entry of :attr:`Budgets.history`: ``event`` is "walk" (a walk used other budgets than the walk
    before it), "halved" (a walk ran out of memory: the next ones use ``budgets``), "grown" (one halving
    back: ``budgets``, or None where the options' own budgets apply again) or "set" (given by hand:
    ``budgets`` None)."""

    event: str
    budgets: TokenBudgets | None


def _count_or_none(name: str, value, minimum: int = 0) -> int | None:
    return None if value is None else check_count(name, value, minimum=minimum)


def _reserved(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ArgumentTypeError(f"{name} must be a number of bytes, got {value!r} ({type(value).__name__})")
    if not 0 <= value < math.inf:  # (NaN fails too)
        raise ValueError(f"{name} must be a finite number of bytes >= 0, got {value}")
    return value


class Budgets:
    """The token budgets of an executor's walks: the options, validated here and nowhere else; the budgets
    each walk uses; their halving and growth after running out of memory; their history and metrics.

    Args:
        memory_budget: bytes of activation memory a walk may use (the budgets not given are derived from it
            for each trie, :func:`token_budgets`); "auto": on CUDA, ``AUTO_FRACTION`` of the free memory
            measured at the first walk, less ``reserved_bytes`` and the first optimizer step's gradients and
            Adam states; a percentage ("80%"): as "auto" with that share instead; elsewhere, and with None,
            the fixed budgets :data:`FIXED`. Given as users type it (``"8GiB"``, ``"6e10"``, ``"none"``: every
            form :func:`~trl_dta.walk.memory.memory_budget.parse_memory_budget` reads); kept canonical in
            :attr:`memory_budget`.
        block_size, batch_tokens, subtree_tokens: budgets given by hand (None: derived), as
            :class:`~trl_dta.walk.executor.TreeExecutor` documents them. A block given without a memory
            budget that applies also sets the leaf batch, as before memory budgets.
        reserved_bytes: bytes another user of the device will claim while the walks run or right after them
            (a colocated vLLM engine that sleeps during training: ``vllm_gpu_memory_utilization`` x the
            device's memory); "auto" and a percentage take them off the free memory they measure. Ignored by
            a memory budget given in bytes. :meth:`reserve` changes them later.
        prefix: how the caller spells the options in error messages ("tree_" for the trainers' configs).

    Invalid options raise a ``ValueError`` (a wrong type: :class:`~trl_dta.walk.errors.ArgumentTypeError`,
    a ``TypeError`` too) naming the option.
    """

    def __init__(
        self,
        memory_budget: float | str | None = "auto",
        block_size: int | None = None,
        batch_tokens: int | None = None,
        subtree_tokens: int | None = None,
        reserved_bytes: float = 0,
        *,
        prefix: str = "",
    ):
        self._prefix = prefix
        self.memory_budget = parse_memory_budget(memory_budget, f"{prefix}memory_budget")  # (canonical)
        self._given = self._check_given(block_size, batch_tokens, subtree_tokens)
        self._start(reserved_bytes)

    def fresh(self, reserved_bytes: float = 0) -> Budgets:
        """New budgets with these options (validated once, when this object was made), ``reserved_bytes``
        reserved, and none of this object's state (budgets in use, halvings, measured memory): one for each
        executor of a trainer."""
        out = copy.copy(self)
        out._start(reserved_bytes)
        return out

    def _start(self, reserved_bytes: float) -> None:
        """The state of budgets not used yet."""
        self.trained_with: tuple[torch.nn.Module, ...] = ()  # other models of the same steps: train_with()
        self.reserved_bytes = _reserved(f"{self._prefix}reserved_bytes", reserved_bytes)
        self.in_use: TokenBudgets | None = None  # those of the last walk
        self.memory: float | None = None  # the memory budget in bytes, once known ("auto": at the first walk)
        self.halvings = 0  # halvings in effect after running out of memory
        self._measured: tuple[float, float] | None = None  # "auto" on CUDA: free bytes, the first step's
        self._ceiling: TokenBudgets | None = None  # the budgets of the walk that first ran out of memory
        self._halved: TokenBudgets | None = None  # the budgets in effect while halved
        self._history: deque[BudgetChange] = deque(maxlen=HISTORY)

    def _check_given(self, block_size, batch_tokens, subtree_tokens) -> tuple:
        p = self._prefix
        return (
            _count_or_none(f"{p}block_size", block_size, minimum=1),
            _count_or_none(f"{p}batch_tokens", batch_tokens),
            _count_or_none(f"{p}subtree_tokens", subtree_tokens),
        )

    # ------------------------------------------------------------------ the options
    @property
    def given(self) -> tuple[int | None, int | None, int | None]:
        """The budgets given by hand, ``(block_size, batch_tokens, subtree_tokens)``; None: derived."""
        return self._given

    @property
    def halved(self) -> TokenBudgets | None:
        """The halved budgets in effect after a walk ran out of memory (None: the options' own)."""
        return self._halved

    def set_given(self, block_size: int | None, batch_tokens: int | None, subtree_tokens: int | None) -> None:
        """Give the budgets by hand from now on (None: derived). They replace halved ones, and become the
        ceiling a later halving grows back to."""
        self._given = self._check_given(block_size, batch_tokens, subtree_tokens)
        self.halvings, self._ceiling, self._halved = 0, None, None
        self._history.append(BudgetChange("set", None))

    def train_with(self, *others: torch.nn.Module) -> None:
        """Models trained in the same optimizer steps as this walk's (a policy and its value model): "auto"
        also leaves room for their first optimizer step's gradients and Adam states."""
        self.trained_with = others

    def reserve(self, reserved_bytes: float) -> None:
        """Set :attr:`reserved_bytes` (for the walks from now on)."""
        self.reserved_bytes = _reserved(f"{self._prefix}reserved_bytes", reserved_bytes)

    # ------------------------------------------------------------------ a walk's budgets
    def memory_bytes(self, model: torch.nn.Module, device: torch.device) -> float | None:
        """The memory budget in bytes for a walk of ``model`` on ``device`` (None: the fixed budgets)."""
        if self.memory_budget is None:
            return None
        share = AUTO_FRACTION if self.memory_budget == "auto" else memory_share(self.memory_budget)
        if share is None:
            self.memory = float(self.memory_budget)
        else:
            if self._measured is None:  # (once: later, the walks' own memory is in use)
                self._measured = measure_free_memory(model, device, self.trained_with)
            measured, reserved = self._measured, self.reserved_bytes
            self.memory = None if measured is None else auto_memory_bytes(*measured, reserved, share)
        return self.memory

    def derive(self, trie, lm, entropy_grad: bool = True, head=None) -> TokenBudgets:
        """The budgets a walk of ``trie`` through ``lm`` (a :class:`~trl_dta.walk.adapter.model.CausalLM`)
        uses: the halved ones after running out of memory; else those given by hand, the others derived from
        the memory budget for the trie's longest path (:func:`token_budgets`), or :data:`FIXED` where no
        memory budget applies. ``entropy_grad``: the walk's entropies carry a gradient; ``head``: the walk's
        (:mod:`trl_dta.walk.heads`; default: ``lm``'s)."""
        if self._halved is not None:
            return self._halved
        memory = self.memory_bytes(lm.model, lm.device)
        derived = FIXED
        if memory is not None:
            path = max((n.start for n in trie.nodes() if n.is_leaf), default=0)
            dtype, (autocast, copies) = activation_dtype(lm), autocast_copies(lm)
            head = head or default_head(lm)
            derived = token_budgets(
                lm.config, dtype, memory, lm.device.type, path, entropy_grad, None, autocast, copies, head
            )
        block, batch, subtree = self._given
        block = derived.block_size if block is None else block
        if batch is None:  # a block given by hand: the leaf batch follows it, as before memory budgets
            batch = block if self._given[0] is not None and memory is None else derived.batch_tokens
        return TokenBudgets(block, batch, derived.subtree_tokens if subtree is None else subtree)

    def key_weight(self, lm, entropy_grad: bool = True, head=None) -> float:
        """A gathered key position of a call through ``lm``, in tokens of its budget
        (:meth:`ActivationBytes.key_weight`)."""
        autocast, _ = autocast_copies(lm)
        per = activation_bytes(
            lm.config, activation_dtype(lm), entropy_grad, None, autocast, head or default_head(lm)
        )
        return per.key_weight()

    def use(self, budgets: TokenBudgets, name: str = "") -> None:
        """Record ``budgets`` as those of the walk now starting (:attr:`in_use`)."""
        if budgets != self.in_use:
            logger.info("%s: tree walk budgets %s", name or "model", budgets)
            self._history.append(BudgetChange("walk", budgets))
        self.in_use = budgets

    # ------------------------------------------------------------------ out of memory
    def halve(self, used: TokenBudgets) -> TokenBudgets | None:
        """A walk at ``used`` ran out of memory: each budget halved (the block at least 1 token) is in effect
        from now on, and returned; None where halving changes nothing (nothing is changed)."""
        smaller = used.halved()
        if smaller == used:
            return None
        if self.halvings == 0:
            self._ceiling = used
        self.halvings += 1
        self._halved = smaller
        self._history.append(BudgetChange("halved", smaller))
        return smaller

    def grow(self) -> None:
        """Grow back one halving: never above the budgets of the walk that first ran out; grown back all the
        way, the options' own budgets apply again (derived for each trie where they were)."""
        if not self.halvings:
            return
        self.halvings -= 1
        self._halved = None
        if self.halvings:
            self._halved = self._ceiling
            for _ in range(self.halvings):
                self._halved = self._halved.halved()
        self._history.append(BudgetChange("grown", self._halved))
        logger.info("The tree walk's budgets grow back one halving: %s.", self._halved or "the options' own")

    # ------------------------------------------------------------------ reports
    @property
    def history(self) -> list[BudgetChange]:
        """How the budgets changed, oldest first (the latest ``HISTORY`` changes)."""
        return list(self._history)

    def metrics(self) -> dict[str, float]:
        """The budgets in use, by name (``block_size``, ``batch_tokens``, ``subtree_tokens``): the trainers
        log them as ``tree/<name>``. Empty before the first walk."""
        return {} if self.in_use is None else {k: float(v) for k, v in vars(self.in_use).items()}
