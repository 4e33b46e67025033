"""Out-of-memory recovery: a walk that runs out of memory is walked again, whole, with halved budgets.

The walk's peak memory follows its token budgets (``block_size``, ``batch_tokens``, ``subtree_tokens``: given
by hand, or derived from a memory budget for each trie, :mod:`trl_dta.walk.memory.budgets`) and the shape of
the trie, which changes at every call: budgets that fit one step's trie can fail on the next one's.
:class:`OOMRecovery` (a :class:`~trl_dta.walk.executor.TreeExecutor`'s ``oom_recovery``) runs each
``backward``, ``logprobs`` and ``router_stats`` walk; when one raises ``torch.OutOfMemoryError`` or
``MemoryError``:

1. what the failed walk added to the trainable parameters' ``.grad`` is discarded: before a gradient walk
   the gradients already there are set aside (:class:`_SetAside`, no copy) and the walk accumulates into
   fresh ones; a failed walk's are dropped, a finished walk's are added to those set aside (a walk that
   fails otherwise, a refusal or a ``loss_fn`` that raises, also leaves the gradients as they were);
2. the failed walk's buffers are freed (its exception, whose traceback holds its frames, is dropped; then
   ``gc.collect()`` and, on CUDA, ``torch.cuda.empty_cache()``);
3. every budget the failed walk used is halved (``block_size`` down to 1, the others down to 0) by the
   executor's :class:`~trl_dta.walk.memory.budgets.Budgets` (``budgets.halve``: they replace the derived and
   given ones), and the same trie is walked again, up to ``retries`` times per walk.
   Then :class:`~trl_dta.walk.errors.WalkOutOfMemoryError` names the budgets tried, the trie's longest
   path and what was being allocated (the last error's message), with the gradients as they were before
   the walk.

The smaller budgets stay for later walks. After ``grow_after`` gradient walks (optimizer steps, in the
trainer) without running out, they double back (``budgets.grow``), one halving at a time, never above those
of the walk that first ran out; grown back all the way, the executor's own settings return (budgets derived
from its memory budget for each trie again, where they were). Budgets given by hand in between
(``budgets.set_given``) replace them all. This object decides when; the budgets live in ``Budgets`` alone.
A walk's result does not depend on its budgets beyond float rounding (every plan is exact), so a retried
walk equals an uninterrupted one to rounding.

Across ranks. On a model sharded with FSDP2 (gather once), the ranks agree before the walk's final
reduce-scatter (:func:`trl_dta.walk.distributed.sharding.gathered`): if any rank ran out of memory, no rank
reduces, the ranks whose walk succeeded raise :class:`~trl_dta.walk.errors.PeerOutOfMemoryError`, and every
rank walks again with halved budgets (or all give up together); under DeepSpeed ZeRO-2/3 every walk ends with
the same agreement (:mod:`trl_dta.walk.distributed.deepspeed`). Under DDP the walk makes no collective (the
trainer all-reduces the gradients after the walk), so a rank retries on its own and nothing is reduced
before its walk has succeeded. With ``gather_per_layer`` across ranks the walk's calls are in lock-step with
the other ranks' (:mod:`trl_dta.walk.distributed.lockstep`) and a rank cannot leave and re-join it: the error
is raised as it is, and the launcher ends the other ranks.

Not recovered: running out of memory outside a walk (the optimizer step, generation, TRL's own passes), in
the construction probe (raised as it is), and a failed CPU allocation inside torch, which raises a plain
``RuntimeError`` (not recognisable by type). Gradients a ``loss_fn`` sends to tensors outside the model are
not rolled back, and a ``loss_fn`` is called again for each sequence of a retried walk, so it must not
accumulate anything it cannot overwrite (the trainers' step seam keeps its values by sequence:
``trl_dta.train.step.SequenceResults``).
"""

from __future__ import annotations

import gc
import logging
import traceback
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

from ..adapter.checks import check_count
from ..distributed.deepspeed import assign_grad
from ..distributed.ranks import world_size
from ..distributed.sharding import fsdp_units
from ..errors import MEMORY_ERRORS, WalkOutOfMemoryError
from .budgets import TokenBudgets

logger = logging.getLogger(__name__)

T = TypeVar("T")

RETRIES = 3  # halvings per walk before giving up: budgets down to 1/8
GROW_AFTER = 100  # gradient walks without running out before the budgets double back, one halving at a time


def _str(budgets: TokenBudgets) -> str:
    return ", ".join(f"{k}={v}" for k, v in vars(budgets).items())


class _SetAside:
    """The trainable parameters' ``.grad`` before a gradient walk, set aside (``.grad`` None during the walk,
    no copy): :meth:`drop` discards what the walk accumulated, :meth:`merge` adds it to what was there
    (into the same tensors), :meth:`restore` puts the old ones back."""

    def __init__(self, model: nn.Module):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.saved = [p.grad for p in self.params]
        self.drop()

    def drop(self) -> None:
        for p in self.params:
            p.grad = None

    def restore(self) -> None:
        for p, saved in zip(self.params, self.saved, strict=True):
            assign_grad(p, saved)  # (p.grad = saved; a ZeRO-3 parameter's is full-size)

    def merge(self) -> None:
        for p, saved in zip(self.params, self.saved, strict=True):
            if saved is not None:
                if p.grad is not None:
                    saved.add_(p.grad)
                assign_grad(p, saved)


def free_memory(device: torch.device) -> None:
    """Free what a failed walk left: unreachable frames (reference cycles), and CUDA's cached blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _what(error: BaseException) -> str:
    """The error's type and first line (what was being allocated), and where in the walk it was raised (the
    walk's functions from its loop inward)."""
    names = [f.name for f in traceback.extract_tb(error.__traceback__) if "trl_dta/walk/" in f.filename]
    names = names[names.index("_walk") + 1 :] if "_walk" in names else names[-3:]
    message = (str(error).strip().splitlines() or ["(no message)"])[0][:300]
    return f"{type(error).__name__}: {message}" + (f" (in {' > '.join(names)})" if names else "")


class OOMRecovery:
    """Walk again with halved budgets when a walk runs out of memory (module docstring).

    Args:
        retries: halvings per walk before :class:`~trl_dta.walk.errors.WalkOutOfMemoryError` (0: none).
        grow_after: gradient walks without running out before the budgets double back one halving (0: never).
    """

    def __init__(self, retries: int = RETRIES, grow_after: int = GROW_AFTER):
        self.retries = check_count("oom_retries", retries)
        self.grow_after = check_count("grow_after", grow_after)
        self.retried = 0  # walks run again so far
        self._taken = 0  # of which take_retries() has returned
        self._clean = 0  # gradient walks since the last halving or growth

    def run(self, executor, walk: Callable[[], T], trie, grad: bool, entropy_grad: bool = False) -> T:
        """``walk()`` (one walk of ``trie`` on ``executor``; ``grad``: it accumulates gradients;
        ``entropy_grad``: as the walk's, for the budgets it uses), walked again with halved budgets while it
        runs out of memory."""
        budgets = executor.budgets
        if executor.gather_per_layer and world_size() > 1 and fsdp_units(executor.lm.model):
            return walk()  # the ranks' lock-step cannot be left and re-joined (module docstring)
        aside = _SetAside(executor.lm.model) if grad else None
        tried = []
        for attempt in range(self.retries + 1):
            try:
                result = walk()
            except MEMORY_ERRORS as e:
                if aside is not None:
                    aside.drop()
                used = executor.token_budgets(trie, entropy_grad)  # (the failed walk's)
                tried.append(used)
                smaller = budgets.halve(used) if attempt < self.retries else None
                if smaller is None:
                    if aside is not None:
                        aside.restore()
                    raise self._give_up(trie, e, tried) from e
                failure = _what(e)
                # leaving this block drops the error and its traceback, which hold the failed walk's frames
            except BaseException:
                if aside is not None:  # any other failure: the gradients as they were before the walk
                    aside.restore()
                raise
            else:
                if aside is not None:
                    aside.merge()
                if grad and attempt == 0:  # (a walk that ran out does not count)
                    self._grow(budgets)
                return result
            free_memory(executor.device)
            self.retried += 1
            self._clean = 0
            logger.warning(
                "The tree walk ran out of memory (%s); its gradients are discarded and it is walked again "
                "with halved budgets: %s -> %s (tree/oom_retries).",
                failure,
                _str(used),
                _str(smaller),
            )
        raise AssertionError("unreachable")  # pragma: no cover

    def take_retries(self) -> int:
        """Walks run again since the last call (for a caller that logs each once: the trainer's
        ``tree/oom_retries``)."""
        new, self._taken = self.retried - self._taken, self.retried
        return new

    def _grow(self, budgets) -> None:
        self._clean += 1
        if budgets.halvings and self.grow_after and self._clean >= self.grow_after:
            self._clean = 0
            budgets.grow()

    def _give_up(self, trie, error: BaseException, tried: list[TokenBudgets]) -> WalkOutOfMemoryError:
        return WalkOutOfMemoryError(
            f"The tree walk ran out of memory at budgets {_str(tried[-1])} after {len(tried) - 1} halving(s) "
            f"in this walk (budgets tried: {'; '.join(map(_str, tried))}; {self.retries} halvings per walk "
            f"at most, oom_retries / tree_oom_retries). Longest path of the trie: {trie.max_depth} tokens "
            f"({trie.num_unique_tokens} unique tokens in {len(trie)} sequences). Last error: {_what(error)}. "
            "The gradients are as they were before the walk. Shorter rollouts (max_completion_length), "
            "fewer rows per optimizer step, a smaller tree_memory_budget or a sharded model (FSDP2) need "
            "less memory; docs/memory.md."
        )
