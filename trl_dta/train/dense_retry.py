"""A step on TRL's dense path that runs out of memory is walked instead (``tree_dense_fallback``).

The walk bounds its memory by its budgets and retries itself with halved ones
(:mod:`trl_dta.walk.memory.recovery`); TRL's dense path does neither. :class:`RetriesDenseSteps`, in front of
a tree trainer's bases, catches an out-of-memory error of a training micro-batch whose step took the dense
path, drops every gradient the step accumulated, and runs the same micro-batch again, now walking the step's
micro-batches from the first: the gradients of a walked step (:meth:`StepWalker.give_up_dense_step
<trl_dta.train.step.StepWalker.give_up_dense_step>`). Where gradients were held before the step, or on
several processes (whose dense backward reduces in lock-step), the error is raised as it is. Later steps that
need as much memory on the dense path walk (``tree/path_reason`` 3). The micro-batch's prepared inputs are
kept for the retry (TRL's ``_prepare_inputs`` would generate again at a generation batch's first
micro-batch). Logged as ``tree/dense_oom_retries`` and a warning.

The same way, a first try of the dense path (not measured yet: :mod:`trl_dta.train.dense_fallback`) is cut
short where its first micro-batch's forward alone takes longer than twice the walk's measured step: the
dense path is recorded that slow (its forward taken as a third of its micro-batch's step), and the step is
walked (``tree/dense_trials_cut``). An exploration of the dense path then costs one forward at most where
the dense path is far slower than predicted (TRL's own GRPO tests with tools: 50x).

Each trainer keeps its current step in ``_schedule`` (a :class:`~trl_dta.train.step_schedule.StepSchedule`):
whether the step is on the dense path, and how it turns to walking the step from its first micro-batch at
the current one (:meth:`~trl_dta.train.step_schedule.StepSchedule.walk_instead`), are the schedule's.
"""

from __future__ import annotations

import logging

from ..walk.errors import MEMORY_ERRORS
from ..walk.memory.recovery import free_memory

logger = logging.getLogger(__name__)


class DenseTrialTooSlow(Exception):
    """A first try of the dense path cut short (:meth:`StepWalker.dense_trial_too_slow
    <trl_dta.train.step.StepWalker.dense_trial_too_slow>`): the step is walked instead."""


class RetriesDenseSteps:
    """For ``class Trainer(RetriesDenseSteps, ..., TRLTrainer)`` with a ``_walker`` and a ``_schedule``
    (module docstring)."""

    _schedule = None  # the trainer's current StepSchedule

    _tree_prepared = None  # (the current training micro-batch as the Trainer gave it, and prepared)
    _tree_retrying = False

    def _prepare_inputs(self, inputs):
        if self._tree_retrying and self._tree_prepared is not None and inputs is self._tree_prepared[0]:
            _, prepared, keys = self._tree_prepared
            for key in [k for k in prepared if k not in keys]:  # (what the dense path added: SFT's use_cache)
                del prepared[key]
            return prepared  # (the same object: the trainers recognise their step's micro-batches by it)
        prepared = super()._prepare_inputs(inputs)
        if not self._tree_retrying:
            self._tree_prepared = (inputs, prepared, set(prepared)) if self.model.training else None
        return prepared

    def _dense_forward_done(self, started: float) -> None:
        """The trainers' dense path calls this after a micro-batch's forward (begun at ``started``,
        ``time.perf_counter``): a first try of the dense path far slower than the walk is cut short here
        (module docstring)."""
        if self._walker.dense_trial_too_slow(started):
            raise DenseTrialTooSlow(
                "the dense path's first micro-batch's forward took longer than a walked step"
            )

    def training_step(self, model, *args, **kwargs):
        try:
            return super().training_step(model, *args, **kwargs)
        except (*MEMORY_ERRORS, DenseTrialTooSlow) as error:
            slow = isinstance(error, DenseTrialTooSlow)
            if not (
                self._dense_step_running() and self._walker.give_up_dense_step(model, out_of_memory=not slow)
            ):
                raise
            what = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200]}"
            # (leaving this block drops the error and its traceback, which hold the dense pass's frames)
        free_memory(self.accelerator.device)
        if slow:
            logger.info("Trying the dense path: %s; the step is walked (tree/dense_trials_cut).", what)
        else:
            logger.warning(
                "The step's dense path ran out of memory (%s); its gradients are dropped and the step is "
                "walked (tree/dense_oom_retries). Later steps that need as much memory walk.",
                what,
            )
        self._metrics["train"]["tree/dense_trials_cut" if slow else "tree/dense_oom_retries"].append(1.0)
        self._tree_retrying = True
        try:
            self._walk_step_instead(model)
            return super().training_step(model, *args, **kwargs)
        finally:
            self._tree_retrying = False

    def _dense_step_running(self) -> bool:
        return self._schedule is not None and bool(self._schedule.dense)

    def _walk_step_instead(self, model) -> None:
        """The step's dense path failed at this micro-batch: the step's micro-batches are walked from its
        first, and this one and the later ones served from the walk."""
        self._schedule.walk_instead()
