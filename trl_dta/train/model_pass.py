"""A model pass: a second model walked on the policy step's trie, beside the policy.

PPO's value model (:class:`~trl_dta.train.critic.value_model.ValueModel`) is one; a teacher for on-policy
distillation is the next. A pass is an object the trainers call with explicit inputs, not a mixin: it has its
own module, executor (its budgets, its ``*_tree/`` metrics, its out-of-memory retries: ``walker.step(...,
prefix=...)``) and, where it trains, its own optimizer; the policy's trainer owns what the pass gives its
loss (PPO's advantages). These protocols are the contract a type checker and the tests read
(``tests/test_layout.py``: a folder of ``train/`` without a ``trainer.py`` is a model pass, and holds a class
that meets one); docs/development.md says how to write one.

* :class:`ModelPass`: built with the trainer (``for_trainer``: it checks its module as the policy's is
  checked, ``walker.check_models``, before any generation); its no-gradient walk of the step's sequences is
  its own (a value model's values, a teacher's outputs).
* :class:`TrainedPass`: a pass that trains with the policy (``walker.train_together``: the memory budget
  leaves room for both): its training walk inside the policy's step (``backward``, which the step includes:
  its peak memory is the step's), its optimizer's step after the step's last micro-batch
  (``micro_batch_done``), its optimizer built with the policy's and its checkpoint saved and loaded with the
  policy's (the Trainer's hooks carry them to it: :class:`~trl_dta.train.critic.value_model.
  ValueModelCheckpoints`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class ModelPass(Protocol):
    """A second model walked on the policy step's trie (module docstring)."""

    @classmethod
    def for_trainer(cls, module, trainer, length: int | None = None) -> ModelPass:
        """The pass of ``trainer`` (after its policy's checks) for ``module`` (a Hub id, a path or a module);
        ``length``: the longest sequence the trainer's arguments allow."""


@runtime_checkable
class TrainedPass(ModelPass, Protocol):
    """A model pass that trains beside the policy (module docstring)."""

    def backward(self, sequences: Sequence, targets: Sequence, metrics):
        """Its training walk on the step's ``sequences`` (each with its ``targets``), gradients in its
        ``.grad``; returns the walk, which the policy's step includes."""

    def micro_batch_done(self, metrics) -> None:
        """After each training micro-batch: after the step's last, its optimizer's step."""

    def create_optimizer(self, trainer, num_training_steps: int) -> None:
        """Its optimizer and scheduler, built when the policy's are."""

    def save(self, output_dir: str, weights: bool = True, optimizer: bool = True) -> None:
        """Its weights and optimizer state, in a folder of its own under ``output_dir``."""

    def load(self, checkpoint: str) -> None:
        """Restore what :meth:`save` wrote in ``checkpoint``."""
