"""One optimizer step's micro-batches as a trainer serves them (:class:`StepSchedule`).

The Trainer hands ``compute_loss`` one micro-batch at a time, but the walk wants the whole step at once (one
trie of every micro-batch's sequences: the sharing between micro-batches is the point). Every tree trainer
keeps one schedule per optimizer step: made when the step's micro-batches are known (the Trainer's
``get_batch_samples``; TRL's buffered micro-batches for :class:`~trl_dta.TreePPOTrainer`), asked at each
``compute_loss`` whether its micro-batch is the step's next (:meth:`~StepSchedule.expects`), then either
the dense path's decision, made once at the step's first micro-batch (:meth:`~StepSchedule.takes_dense_path`),
or the walk's share of the micro-batch, the step walked at the first micro-batch that needs it
(:meth:`~StepSchedule.serve`). A micro-batch the schedule does not expect (``compute_loss`` called
directly, a custom ``_prepare_inputs``) is walked on its own by the trainer: the same gradient, less
sharing.

Where the step's dense path failed at a micro-batch (out of memory, or a first try far slower than the
walk: :class:`~trl_dta.train.dense_retry.RetriesDenseSteps`), :meth:`~StepSchedule.walk_instead` turns the
step to the walk: the next :meth:`~StepSchedule.serve` walks every micro-batch of the step from its first
(their gradients were dropped) and serves the failed one and the later ones.

Example (a trainer's ``compute_loss``, in outline)::

    schedule = self._schedule
    if schedule is not None and schedule.expects(inputs):
        if schedule.takes_dense_path(lambda: self._walker.prefer_dense(...)):
            return dense_loss(inputs)
        share = schedule.serve(inputs, lambda batches: self._walk(model, batches))
    else:
        share = self._walk(model, [inputs])[0]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class StepSchedule:
    """An optimizer step's micro-batches, which is served next, the dense-or-walk decision and the walk's
    shares (module docstring).

    Args:
        batches: the step's micro-batches as the Trainer will pass them to ``compute_loss`` (or raw, with
            ``prepare``).
        same: ``same(batch, inputs)``: whether ``inputs`` is the micro-batch ``batch`` (default: the same
            object).
        prepare: a raw micro-batch to what ``compute_loss`` gets (the Trainer's ``_prepare_inputs``); None:
            ``batches`` are prepared already.
        key: what ``compute_loss`` gets beside each of the step's micro-batches and must be the step's own
            (SFT's ``num_items_in_batch``), compared by identity; None: nothing.
        check: this is the step ``tree_check_gradients`` checks (:meth:`StepWalker.take_check
            <trl_dta.train.step.StepWalker.take_check>`): it walks, and its walk is compared with TRL's dense
            path.
    """

    def __init__(
        self,
        batches: Sequence,
        same: Callable | None = None,
        prepare: Callable | None = None,
        key=None,
        check: bool = False,
    ):
        self.batches = list(batches)
        self.served = 0  # micro-batches served so far (by the dense path or the walk)
        self.dense: bool | None = None  # the step takes the dense path (None: not decided yet)
        self.key = key
        self.check = check
        self._same = same or (lambda batch, inputs: batch is inputs)
        self._prepare = prepare
        self._ready: list | None = None  # the micro-batches prepared (each at most once)
        self._walked: dict[int, object] = {}  # the walk's shares not served yet, by position
        self._from_first = False  # the next walk covers the step from its first micro-batch (walk_instead)

    @property
    def done(self) -> bool:
        """Every micro-batch of the schedule served."""
        return self.served >= len(self.batches)

    def expects(self, inputs, key=None) -> bool:
        """Whether ``inputs`` (with ``key``) is the step's next micro-batch."""
        return not self.done and key is self.key and self._same(self.batches[self.served], inputs)

    def prepared(self, inputs) -> list:
        """The step's micro-batches as ``compute_loss`` gets them, ``inputs`` (the next one) among them:
        each prepared once (for the dense path's decision and the walk alike)."""
        if self._ready is None:
            self._ready = [None] * len(self.batches)
        self._ready[self.served] = inputs
        for k, batch in enumerate(self.batches):
            if self._ready[k] is None:
                self._ready[k] = batch if self._prepare is None else self._prepare(batch)
        return self._ready

    def extend(self, batches: Sequence) -> None:
        """More micro-batches of the same step (TRL's next generation batch, where an optimizer step runs past
        the end of one): served after these, walked when the first of them is served."""
        self.batches.extend(batches)
        if self._ready is not None:
            self._ready.extend([None] * len(batches))

    def takes_dense_path(self, decide: Callable[[], bool]) -> bool:
        """For the step's next micro-batch: whether it takes the dense path. ``decide()`` decides for the
        whole step, once, at its first micro-batch (a schedule first served by the walk walks, and so does the
        checked step); a micro-batch that takes the dense path counts as served."""
        if self.dense is None:
            self.dense = self.served == 0 and not self.check and decide()
        if self.dense:
            self.served += 1
        return self.dense

    def serve(self, inputs, walk: Callable[[list], list]):
        """The walk's share of the step's next micro-batch ``inputs``. Where the walk has not reached it yet,
        ``walk(batches)`` walks the step's micro-batches from this one on (from the step's first after
        :meth:`walk_instead`) and returns one share each."""
        k = self.served
        if k not in self._walked:
            start = 0 if self._from_first else k
            batches = self.prepared(inputs)[start:]
            shares = walk(batches)
            self._walked = {j: share for j, share in enumerate(shares, start) if j >= k}
            self._from_first = False
        self.served += 1
        return self._walked.pop(k)

    def walk_instead(self) -> None:
        """The step's dense path failed at the micro-batch just served: the step walks from here, its next
        :meth:`serve` (that micro-batch again) walking every micro-batch of the step from the first."""
        self.dense, self.served, self._walked, self._from_first = False, self.served - 1, {}, True


def same_micro_batch(batch: dict, inputs: dict) -> bool:
    """Whether ``inputs`` (as ``compute_loss`` gets it: on the device, keys added) holds the micro-batch
    ``batch`` (as the dataloader gave it): equal ``input_ids``, and ``lengths`` where ``batch`` has them (the
    asynchronous trainer's samples per row)."""
    for key in ("input_ids", "lengths"):
        a, b = batch.get(key), inputs.get(key)
        if a is None and key != "input_ids":
            continue
        if a is None or b is None or a.shape != b.shape or not torch.equal(a.to(b.device), b):
            return False
    return True


def checked(schedule: StepSchedule | None, training: bool) -> bool:
    """Whether a trainer's walk is in the step ``tree_check_gradients`` checks: a training walk while the
    current optimizer step's ``schedule`` has ``check`` (its scheduled walk, or a micro-batch of it walked
    alone)."""
    return training and schedule is not None and schedule.check
