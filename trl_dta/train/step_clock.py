"""Each step the dense fallback decides, timed (:class:`StepClock`), and what those times say of each path's
predictions (:meth:`StepClock.scale`) and of what to explore (:meth:`StepClock.explore`); the trainers stop
it at each optimizer step (:class:`StepClockCallback`). :mod:`trl_dta.train.dense_fallback` decides with it.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

import torch
from transformers import TrainerCallback

DRIFT = 2.0  # the chosen path's ratio moving this far since the other was measured: measure the other again


class StepClock:
    """Times each step the fallback decides, dense or walked, from the decision (the step's first
    micro-batch) to its optimizer step (:class:`StepClockCallback`). On a CPU by the monotonic clock; on
    CUDA by two events read once the device has passed them (at a later decision: no host sync).

    A measured step covers more than its prediction on either path (the trainer's work between micro-batches,
    the loss's bookkeeping, TRL's LM head over every position on the dense path): :meth:`scale` gives a
    path's geometric mean of measured over predicted seconds over its last ``WINDOW`` steps (None before its
    first), which multiplies that path's next predictions, so that the two compare measured with measured.
    Each step keeps its price (a function of the constants in use), not a number: once the fit adopts other
    constants, every measured step is compared with what they predict for it. (Ratios of predictions made by
    older constants would compare a path priced by a fit since replaced with one priced by the new fit.)
    :meth:`explore` says which path a decision must measure first (module docstring)."""

    WINDOW = 8

    def __init__(self):
        # by dense: (measured seconds, price: the step's predicted seconds by the constants in use)
        self.measured = {True: deque(maxlen=self.WINDOW), False: deque(maxlen=self.WINDOW)}
        self.last_dense_s: float | None = None  # the latest measured dense step
        self.explored = {True: 0, False: 0}  # explorations of each path since it was last measured
        self.dense_ceiling = math.inf  # the least predicted bytes of a dense step that ran out of memory
        # by path: the other path's measurements when this one was last measured (its drift is measured from)
        self._anchor: dict[bool, list] = {True: [], False: []}
        self._running: tuple | None = None  # (dense, price, start: a time or a CUDA event)
        self._pending: list[tuple] = []  # CUDA: (dense, price, start event, end event)

    def ratios(self, dense: bool) -> list[float]:
        """Measured over predicted seconds of the last measured steps of a path, by the constants in use."""
        self._collect()
        return _ratios(self.measured[dense])

    def scale(self, dense: bool) -> float | None:
        """A path's measured over predicted seconds (:meth:`ratios`' geometric mean); None unmeasured."""
        return _mean(self.ratios(dense))

    def explore(self, chosen: bool, other_within: bool) -> bool:
        """Whether the step must take the path other than ``chosen`` (dense: True) to measure it: ``chosen``
        has been measured (the predicted-faster path goes first) and the other has not (explored once at
        most, while ``other_within``: predicted within reach), or ``chosen``'s ratio drifted past
        :data:`DRIFT` since the other path was last measured."""
        other = not chosen
        if not self.ratios(chosen):
            return False
        if not self.ratios(other):
            return other_within and self.explored[other] < 1
        if not self._anchor[other]:  # (the other path was measured before this one: from its first steps)
            self._anchor[other] = list(self.measured[chosen])
        then, now = _mean(_ratios(self._anchor[other])), self.scale(chosen)
        return then is not None and now is not None and max(now / then, then / now) > DRIFT

    def start(
        self, dense: bool, price: Callable[[], float], device: torch.device, explored: bool = False
    ) -> None:
        if explored:
            self.explored[dense] += 1
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

    def record(self, dense: bool, price: Callable[[], float], seconds: float) -> None:
        """A path's step measured otherwise (a first try of the dense path cut short: its estimate)."""
        self._add(dense, price, seconds)

    def _add(self, dense: bool, price: Callable[[], float], seconds: float) -> None:
        if dense:
            self.last_dense_s = seconds
        if seconds > 0:
            self.measured[dense].append((seconds, price))
            self.explored[dense] = 0
            self._anchor[dense] = list(self.measured[not dense])


def _ratios(measured) -> list[float]:
    priced = ((seconds, price()) for seconds, price in measured)
    return [seconds / predicted for seconds, predicted in priced if predicted > 0]


def _mean(ratios: list[float]) -> float | None:
    return math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None


class StepClockCallback(TrainerCallback):
    """Stops a trainer's :class:`StepClock` at each optimizer step (after gradient clipping, before the
    optimizer's update)."""

    def __init__(self, clock: StepClock):
        self.clock = clock

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.clock.stop()
