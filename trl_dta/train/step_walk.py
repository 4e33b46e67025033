"""One step's walk: :class:`StepWalk`, the passes over one optimizer step's trie that
:meth:`StepWalker.step <trl_dta.train.step.StepWalker.step>` hands a trainer (the step seam's module docstring
has an example).

A step is walked in *passes*, each over the whole trie, in an order every rank keeps: no-gradient passes
first (:meth:`StepWalk.logprobs`, the MoE router counts of :meth:`StepWalk.router_loss`), then the gradient
pass (:meth:`StepWalk.backward`) or, in evaluation, :meth:`StepWalk.score`. On a normal exit the step's
``tree/*`` metrics are appended to the caller's metrics: the trie's tokens, dedup and FLOP ratios, model
calls, time, the budgets in use, out-of-memory retries and the walk's peak memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from ..trie import PrefixTrie
from ..walk.executor import TreeExecutor
from .load_balancing import step_router_grad
from .step_results import SequenceResults

LossFn = Callable[[int, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


class StepWalk(AbstractContextManager):
    """The passes over one step's trie (built from the sequences at construction; None when there are none,
    and then each pass is an idle walk where the other ranks need one). ``results``: the
    :class:`SequenceResults` of the last :meth:`backward` or :meth:`score`. ``walker``: the
    :class:`~trl_dta.train.step.StepWalker` that made it (not imported here: step.py imports this module)."""

    def __init__(self, walker, model, sequences, training: bool, metrics, check, prefix="tree/"):
        self.walker, self.model, self.training, self.metrics = walker, model, training, metrics
        self.prefix = prefix
        self._check = check() if check is not None else None  # (the dense pass, before the walk's time)
        self._started = time.perf_counter()
        self.sequences = list(sequences)
        for k, s in enumerate(self.sequences):
            if len(s.tokens) < 2:
                raise ValueError(f"sequence {k} has {len(s.tokens)} token(s); the walk needs two or more.")
        self.trie = PrefixTrie.from_sequences([s.tokens for s in self.sequences]) if self.sequences else None
        self.score_from = [s.score_from for s in self.sequences]
        self.results = SequenceResults(len(self.sequences))
        self.router_grad = None
        self.peak_memory: int | None = None
        self.time_s: float | None = None  # (set on exit)
        self._calls = None

    @property
    def executor(self) -> TreeExecutor:
        return self.walker.executor(self.model)  # (cached per model: StepWalker.executor)

    def __enter__(self) -> StepWalk:
        if self.trie is not None:
            calls = self.executor.calls
            self._calls = (calls.forward, calls.backward, calls.tokens, calls.attention.copy())
        return self

    def __exit__(self, kind, *exc):
        self.time_s = time.perf_counter() - self._started
        if kind is None and self._check is not None and self.metrics is not None:
            self.metrics[f"{self.prefix}check_error"].append(self._check.finish())
        if kind is None and self.trie is not None and self.metrics is not None:
            self._log(self.metrics)
        return False

    # ------------------------------------------------------------------ passes
    def logprobs(self, temperature: float = 1.0, entropies: bool = False):
        """A no-gradient pass: per sequence its log-probs from ``score_from`` on (and entropies), as
        :meth:`TreeExecutor.logprobs` returns them (empty lists on an empty step)."""
        if self.trie is None:
            self._idle()
            return ([], []) if entropies else []
        with torch.no_grad(), self.walker.accelerator.autocast():
            out = self.executor.logprobs(
                self.trie, temperature, entropies=entropies, score_from=self.score_from
            )
        self._measured()
        return out

    def router_loss(self, coef: float, num_batches: int) -> tuple[list, list[float]]:
        """MoE models: each micro-batch's load-balancing loss over its sequences (TRL's, from a no-gradient
        count of the router's choices, :mod:`trl_dta.train.load_balancing`) and its value times ``coef``; the
        gradient of ``coef`` times their sum is added to :meth:`backward`'s. Micro-batches with no sequence
        get None and 0.0."""
        auxes, terms = [None] * num_batches, [0.0] * num_batches
        if self.trie is None:
            self._idle()
            return auxes, terms
        with self.walker.accelerator.autocast():
            self.router_grad = step_router_grad(self.executor, self.trie, self.sequences, coef, auxes, terms)
        self._measured()
        return auxes, terms

    def backward(
        self, loss_fn: LossFn, temperature: float = 1.0, entropies: bool = True, entropy_grad: bool = True
    ) -> None:
        """The gradient pass: ``.grad`` of the model's trainable parameters gets the gradient of the sum of
        ``loss_fn(k, logps_k, entropies_k)`` over the sequences (plus :meth:`router_loss`'s), exactly; each
        sequence's values are recorded in :attr:`results`. ``entropy_grad=False``: the loss reads the
        entropies as values only (less memory)."""
        flow = self.walker.flow
        if self.trie is None:
            if self.walker.needs_idle_walks(self.model):
                with flow.gradient_walk(self.model), self.walker.accelerator.autocast():
                    self.executor.backward(_idle_trie(), lambda i, logps, ents: logps.sum() * 0.0)
            return
        with flow.gradient_walk(self.model), self.walker.accelerator.autocast():
            self.executor.backward(
                self.trie,
                self._recorded(loss_fn),
                temperature,
                entropies=entropies,
                router_grad=self.router_grad,
                score_from=self.score_from,
                entropy_grad=entropy_grad,
            )
        self._measured()

    def score(self, loss_fn: LossFn, temperature: float = 1.0, entropies: bool = True) -> None:
        """Evaluation's counterpart of :meth:`backward`: each sequence's values and loss, no gradient."""
        out = self.logprobs(temperature, entropies=entropies)
        lps, ents = out if entropies else (out, [None] * len(out))
        record = self._recorded(loss_fn)
        for k, (lp, ent) in enumerate(zip(lps, ents, strict=True)):
            record(k, lp, ent)

    def include(self, other: StepWalk) -> None:
        """Another model's walk of this step, run inside this one (a value model's): its peak memory counts
        toward this step's (``tree/peak_memory_gib`` is the larger of the two walks), its time is not this
        walk's (each logs its own ``time_s``)."""
        if other.peak_memory is not None:
            self.peak_memory = max(other.peak_memory, self.peak_memory or 0)
        self._started += other.time_s or 0.0

    # ------------------------------------------------------------------ helpers
    def _recorded(self, loss_fn: LossFn) -> LossFn:
        def on_sequence(k, logps, entropies):
            loss = loss_fn(k, logps, entropies)
            self.results.record(k, logps, entropies, loss)
            return loss

        return on_sequence

    def _idle(self) -> None:
        """A no-gradient idle walk, where the other ranks' walks need this rank's (collectives)."""
        if self.walker.needs_idle_walks(self.model):
            with self.walker.accelerator.autocast():
                self.executor.logprobs(_idle_trie())

    def _measured(self) -> None:
        peak = self.executor.peak_memory
        if peak is not None:
            self.peak_memory = max(peak, self.peak_memory or 0)

    def _log(self, metrics) -> None:
        """The step's ``tree/*`` metrics, named with :attr:`prefix` (docs/options.md, "Metrics")."""
        trie, executor, p = self.trie, self.executor, self.prefix
        metrics[f"{p}tokens"].append(float(trie.num_tokens))
        metrics[f"{p}unique_tokens"].append(float(trie.num_unique_tokens))
        metrics[f"{p}dedup_ratio"].append(trie.dedup_ratio)
        dense, walk = executor.flops(trie, self.score_from)
        metrics[f"{p}flop_ratio"].append(dense / walk)
        forward, backward = executor.calls.forward - self._calls[0], executor.calls.backward - self._calls[1]
        metrics[f"{p}calls"].append(float(forward + backward))
        metrics[f"{p}tokens_per_call"].append((executor.calls.tokens - self._calls[2]) / max(forward, 1))
        for kernel, n in (executor.calls.attention - self._calls[3]).items():  # (by kernel)
            metrics[f"{p}attention_calls/{kernel}"].append(float(n))
        metrics[f"{p}time_s"].append(self.time_s)
        for name, value in executor.budgets.metrics().items():  # the budgets in use (derived or given)
            metrics[f"{p}{name}"].append(float(value))
        metrics[f"{p}oom_retries"].append(float(executor.take_oom_retries()))  # (this model's walks only)
        if self.peak_memory is not None:
            metrics[f"{p}peak_memory_gib"].append(self.peak_memory / 2**30)
        if executor.cost_model is not None:  # the constants in use, the last measured gradient walk
            for name, value in executor.cost_model.metrics().items():
                metrics[p + name.removeprefix("tree/")].append(value)


def _idle_trie() -> PrefixTrie:
    """What a rank with nothing to walk walks, with a zero loss: two tokens."""
    return PrefixTrie.from_sequences([[0, 1]])
