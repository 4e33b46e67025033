"""``tree_dense_fallback``: a step whose rollouts share too little to pay for the tree takes TRL's dense path.

Before a step, the fitted cost model (:mod:`trl_dta.walk.cost_model`) predicts two times for the same rows:

* the walk's: its plan for the step's trie, by the constants in use (:meth:`CostModel.predict`), plus a
  third of it per no-gradient pass the trainer walks before (a forward costs about a third of a forward +
  backward);
* TRL's dense path's: one forward + backward call per micro-batch, its rows right-padded to the longest
  (``rows x width`` tokens, ``rows x width^2`` attention pairs: a dense causal kernel's rectangle, as the
  cost model counts a dense mask), the LM head on the scored positions; a third more compute with gradient
  checkpointing (its recomputed forward). Summed, or the larger of launches and compute where they overlap.

The step goes dense where ``dense x (1 + margin) < walk``. The dense side is priced with the walk's own
constants, whose fixed cost per call also holds the walk's bookkeeping (its K/V buffers, its loss per
sequence): a dense call costs at most that, so the comparison leans toward the walk, and the margin leans
further. Each decided step is timed (:class:`StepClock`: from the decision to the optimizer step), and the
dense side's predictions are scaled by how far the measured dense steps were off, relative to the walked
ones. Gradients are the same either way (TRL's own loss and backward), so exactness does not depend on the
choice. Modes: "auto" (decide per step, from the first, by the constants in use: the shipped ones, a cached
fit or this run's; a step that walks is timed and refines them), "never" (always walk), "always" (always
dense).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from transformers import TrainerCallback

from ..trie import PrefixTrie
from ..walk.cost_model import CostModel, plan_terms
from ..walk.scoring import scored_from

MODES = ("auto", "never", "always")
NO_GRAD_SHARE = 1 / 3  # a forward's share of a forward + backward call
RECOMPUTE = 4 / 3  # gradient checkpointing: each call forwards twice


class Prediction(NamedTuple):
    """A step's predicted seconds: its gradient walk, every pass of the walk, TRL's dense path; the choice;
    and the step's two prices by the constants in use when called (``price_step``: every pass of the walk;
    ``price_dense``: the dense path, unscaled), which :class:`StepClock` compares measured steps with."""

    walk_s: float
    step_s: float
    dense_s: float
    dense: bool
    price_step: Callable[[], float]
    price_dense: Callable[[], float]


def checked_mode(mode: str, walk_only: bool) -> str:
    """``tree_dense_fallback`` as the step seam takes it: "always" is refused where every step must walk
    (``walk_only``: DeepSpeed or FSDP, whose steps the walk reduces and steps)."""
    if walk_only:
        refuse_always(mode, "under DeepSpeed or FSDP (the walk reduces the step's gradients and steps the "
                      "engine itself)")  # fmt: skip
    return mode


def refuse_always(mode: str, where: str) -> None:
    """Refuse ``tree_dense_fallback="always"`` ``where`` every step walks (a trainer's setting that needs the
    step's walk), rather than walk where the user asked for the dense path."""
    if mode == "always":
        raise ValueError(
            f'tree_dense_fallback="always" is not supported {where}: there every step walks. Use "auto" or '
            '"never".'
        )


Shapes = Sequence[tuple[int, int]] | None  # per micro-batch, (rows, width) of TRL's dense forward's tensors


def dense_terms(sequences: Sequence, checkpointing: bool = False,
                shapes: Shapes = None) -> tuple[float, float, float, float]:  # fmt: skip
    """``(calls, tokens, pairs, scored)`` of TRL's dense path over ``sequences`` (each with ``tokens``,
    ``batch`` and ``score_from``): one call per micro-batch of right-padded rows. ``shapes``: per micro-batch,
    the ``(rows, width)`` of the tensors TRL's dense forward takes (padding rows and columns counted, and a
    micro-batch with no sequence still a call); else each micro-batch's sequences, padded to the longest."""
    batches: dict[int, list] = {}
    for s in sequences:
        batches.setdefault(s.batch, []).append(s)
    sizes = {b: (len(rows), max(len(s.tokens) for s in rows)) for b, rows in batches.items()}
    sizes.update(enumerate(shapes or ()))
    share = RECOMPUTE if checkpointing else 1.0
    calls = tokens = pairs = 0.0
    for rows, width in sizes.values():
        calls += share
        tokens += share * rows * width
        pairs += share * rows * width * width
    return calls, tokens, pairs, float(sum(len(s.tokens) - s.score_from for s in sequences))


class StepClock:
    """Times each step the fallback decides, dense or walked, from the decision (the step's first
    micro-batch) to its optimizer step (:class:`StepClockCallback`). On a CPU by the monotonic clock; on
    CUDA by two events read once the device has passed them (at a later decision: no host sync).

    A measured step covers more than its prediction on either path (the trainer's work between micro-batches,
    the loss's bookkeeping, TRL's LM head over every position on the dense path), so only the two paths'
    ratios compare: :attr:`scale` is the geometric mean of measured over predicted seconds of the last
    ``WINDOW`` dense steps over that of the last ``WINDOW`` walked steps, 1 until both paths have been
    measured. It multiplies the dense side's next predictions. Each step keeps its price (a function of the
    constants in use), not a number: once the fit adopts other constants, every measured step is compared
    with what they predict for it. (Ratios of predictions made by older constants would compare a path
    priced by a fit since replaced with one priced by the new fit: a run whose fit changed after its walked
    steps could go on taking a dense path measured slower than the walk, never walking again to correct it.)
    """

    WINDOW = 8

    def __init__(self):
        # by dense: (measured seconds, price: the step's predicted seconds by the constants in use)
        self.measured = {True: deque(maxlen=self.WINDOW), False: deque(maxlen=self.WINDOW)}
        self.last_dense_s: float | None = None  # the latest measured dense step
        self._running: tuple | None = None  # (dense, price, start: a time or a CUDA event)
        self._pending: list[tuple] = []  # CUDA: (dense, price, start event, end event)

    def ratios(self, dense: bool) -> list[float]:
        """Measured over predicted seconds of the last measured steps of a path, by the constants in use."""
        self._collect()
        priced = ((seconds, price()) for seconds, price in self.measured[dense])
        return [seconds / predicted for seconds, predicted in priced if predicted > 0]

    @property
    def scale(self) -> float:
        ratios = {dense: self.ratios(dense) for dense in (True, False)}
        if not (ratios[True] and ratios[False]):
            return 1.0
        mean = {k: sum(map(math.log, r)) / len(r) for k, r in ratios.items()}
        return math.exp(mean[True] - mean[False])

    def start(self, dense: bool, price: Callable[[], float], device: torch.device) -> None:
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._running = (dense, price, event)
        else:
            self._running = (dense, price, time.perf_counter())

    def cancel(self) -> None:
        """Forget a step that ended without an optimizer step (an evaluation, an interrupted step)."""
        self._running = None

    def stop(self) -> None:
        """At the optimizer step (nothing running: a step the fallback did not decide)."""
        if self._running is None:
            return
        dense, price, start = self._running
        self._running = None
        if isinstance(start, float):
            self._add(dense, price, time.perf_counter() - start)
        else:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((dense, price, start, end))

    def _collect(self) -> None:
        while self._pending and self._pending[0][3].query():
            dense, price, start, end = self._pending.pop(0)
            self._add(dense, price, start.elapsed_time(end) / 1e3)

    def _add(self, dense: bool, price: Callable[[], float], seconds: float) -> None:
        if dense:
            self.last_dense_s = seconds
        if seconds > 0:
            self.measured[dense].append((seconds, price))


class StepClockCallback(TrainerCallback):
    """Stops a trainer's :class:`StepClock` at each optimizer step (after gradient clipping, before the
    optimizer's update)."""

    def __init__(self, clock: StepClock):
        self.clock = clock

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.clock.stop()


def predict(executor, trie, sequences: Sequence, no_grad_passes: float = 0.0, checkpointing: bool = False,
            margin: float = 0.1, dense_scale: float = 1.0, shapes: Shapes = None) -> Prediction:  # fmt: skip
    """The walk's and the dense path's predicted seconds for a step (module docstring), by ``executor``'s
    cost model (a :class:`~trl_dta.walk.executor.TreeExecutor` with one; ``shapes``: :func:`dense_terms`)."""
    model: CostModel = executor.cost_model
    executor.fitted_costs()  # (the model's prior and cached fit, at the first use)
    plan = executor.plan(trie, record=False)
    _, node_from = scored_from(trie, [s.score_from for s in sequences])
    walk_terms = plan_terms(plan, model.template, executor.pack_leaves, node_from)
    dense_t = dense_terms(sequences, checkpointing, shapes)

    def price_walk() -> float:  # (by the constants in use when called)
        return model.seconds(walk_terms) + model.overhead_s

    def price_step() -> float:  # (every pass of the walk)
        return price_walk() * (1 + NO_GRAD_SHARE * no_grad_passes)

    def price_dense() -> float:
        return model.seconds(dense_t)

    walk, step, dense = price_walk(), price_step(), price_dense() * dense_scale
    return Prediction(walk, step, dense, _dense_wins(dense, step, margin), price_step, price_dense)


def _dense_wins(dense_s: float, step_s: float, margin: float) -> bool:
    """The rule of "auto": the dense step, ``margin`` added, is predicted faster than the walked one."""
    return dense_s * (1 + margin) < step_s


def decide(
    executor, sequences: Sequence, mode: str, margin: float, walk_only: bool,
    no_grad_passes: float = 0.0, checkpointing: bool = False, metrics=None, clock: StepClock | None = None,
    agree: Callable[[list[float]], list[float]] | None = None, shapes: Shapes = None,
) -> tuple[Prediction | None, bool]:  # fmt: skip
    """The prediction for a step of ``sequences`` (None without a cost model or sequences) and whether it
    takes the dense path: ``mode`` "always" and "never" say so; "auto" says dense where the prediction
    does (by ``executor``'s constants in use, calibrated or not), unless ``walk_only`` (DeepSpeed or FSDP:
    the walk reduces the step's gradients and steps the engine itself, where TRL's dense backward would not
    reach them). ``agree``: on several processes, the elementwise largest of a list of floats over ranks
    (:func:`~trl_dta.train.multi_process.max_over_ranks`; every rank calls ``decide`` at the same point):
    "auto" then compares the slowest rank's predicted walk with the slowest rank's predicted dense step (the
    ranks wait for each other at the gradients' all-reduce), so that every rank takes the same path (DDP's
    dense backward reduces in lock-step). ``shapes``: the dense forward's tensors (:func:`dense_terms`).
    ``no_grad_passes``:
    walks the trainer makes before the gradient walk (an accuracy pass); ``checkpointing``: the dense path
    recomputes its forward. Logs ``tree/path`` (1: dense, 0: the walk), ``tree/predicted_s`` and
    ``tree/predicted_dense_s`` into ``metrics``; for a dense step also the trie's ``tree/tokens``,
    ``tree/unique_tokens`` and ``tree/dedup_ratio`` (a walked step's walk logs them). ``clock``: times the
    step, and scales the dense predictions (:class:`StepClock`; its latest measured dense step and its scale
    logged as ``tree/dense_s`` and ``tree/dense_scale``)."""
    prediction, dense, trie = None, mode == "always", None
    if clock is not None:
        clock.cancel()  # (a step that ended without an optimizer step is not timed)
    scale = clock.scale if clock is not None else 1.0
    auto = mode == "auto" and not walk_only and executor.cost_model is not None
    if sequences and executor.cost_model is not None:
        trie = PrefixTrie.from_sequences([s.tokens for s in sequences])
        prediction = predict(executor, trie, sequences, no_grad_passes, checkpointing, margin, scale, shapes)
    if auto and agree is not None:  # (a rank without sequences still takes part: zeros)
        step_s, dense_s = agree([prediction.step_s, prediction.dense_s] if prediction else [0.0, 0.0])
        dense = _dense_wins(dense_s, step_s, margin)
        if prediction is not None:  # (the ranks' choice)
            prediction = prediction._replace(dense=dense)
    elif auto and prediction is not None:
        dense = prediction.dense
    if prediction is not None and clock is not None:  # (a dense step's price before scaling)
        clock.start(dense, prediction.price_dense if dense else prediction.price_step, executor.device)
    if metrics is not None:
        metrics["tree/path"].append(float(dense))
        if clock is not None and clock.last_dense_s is not None:
            metrics["tree/dense_s"].append(clock.last_dense_s)
            metrics["tree/dense_scale"].append(scale)
        if prediction is not None:
            metrics["tree/predicted_s"].append(prediction.walk_s)
            metrics["tree/predicted_dense_s"].append(prediction.dense_s)
        if dense and trie is not None:  # (a walked step logs them itself): how much the step shared
            metrics["tree/tokens"].append(float(trie.num_tokens))
            metrics["tree/unique_tokens"].append(float(trie.num_unique_tokens))
            metrics["tree/dedup_ratio"].append(trie.dedup_ratio)
    return prediction, dense
