"""What every tree trainer adds to its TRL trainer, written once: :class:`TreeTrainer`, first in its bases.

A method's trainer (``train/<method>/trainer.py``) is ``class XTrainer(TreeTrainer, ..., TRLTrainer)``: after
TRL's ``__init__`` it calls :meth:`TreeTrainer._start_walking` (its :class:`~trl_dta.train.step.StepWalker`,
the step clock's callback, and what the first walk would refuse, refused now), keeps one
:class:`~trl_dta.train.step_schedule.StepSchedule` per optimizer step in ``_schedule``, and walks its steps
in its own ``compute_loss`` (docs/development.md: adding a method). A step on TRL's dense path that runs out
of memory, or a first try of it far slower than the walk, is walked instead
(:class:`~trl_dta.train.dense_retry.RetriesDenseSteps`).
"""

from __future__ import annotations

from .dense_retry import RetriesDenseSteps
from .step import StepWalker
from .step_clock import StepClockCallback


class TreeTrainer(RetriesDenseSteps):
    """In front of a TRL trainer's bases (module docstring)."""

    _walker: StepWalker | None = None

    def _start_walking(self, length, *models, disable_dropout: bool, reserved_bytes: float = 0.0) -> None:
        """After TRL's ``__init__``: the step walker of this trainer's model (its options, executors, budgets
        and multi-process flow), the callback that times its steps, the room a colocated engine keeps
        (``reserved_bytes``), and the checks of the policy and ``models`` (a reference model; None is
        skipped) against the tokenizer and ``length`` (the longest sequence the arguments allow), before
        any generation or step."""
        self._walker = StepWalker(self.args, self.accelerator, self.model)
        self.add_callback(StepClockCallback(self._walker.step_clock))  # (times the decided steps)
        self._walker.reserve(reserved_bytes)
        self._schedule = None  # the current optimizer step's micro-batches (a StepSchedule)
        self._walker.check_models(
            self.model,
            *models,
            tokenizer=self.processing_class,
            length=length,
            disable_dropout=disable_dropout,
        )

    def _executor(self, model):
        """The walk's executor of ``model`` (the step seam's)."""
        return self._walker.executor(model)
