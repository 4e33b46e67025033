"""``tree_check_gradients``: an optimizer step's gradients by TRL's dense path, compared with the walk's.

:class:`GradientCheck` backpropagates a trainer's ``dense_loss`` (:meth:`TreePPOTrainer.dense_loss`,
:meth:`TreeSFTTrainer.dense_loss`: stock TRL's loss and dense forward, which leave the trainer's metrics and
state alone) for each micro-batch of the step, keeps those gradients, and clears ``.grad`` so that the walk
that follows writes its gradients alone. :meth:`GradientCheck.finish` then compares them
(:func:`trl_dta.compare.relative_error`), puts back the gradients that were there before, and raises on a
mismatch. The step seam (:class:`~trl_dta.train.step.StepWalker`) runs it around the first gradient step.
"""

from __future__ import annotations

import torch

from ..compare import relative_error

# a parameter whose dense gradient is at most this fraction of the largest entry of all (zero up to rounding)
# is measured against that largest entry
TINY = 1e-6


class GradientCheck:
    """The dense gradients of a step's ``batches`` (``dense_loss(model, inputs)`` of each, computed at
    construction), to compare with the walk's by :meth:`finish`. Measure:
    :func:`~trl_dta.compare.relative_error` with ``tiny=TINY``, the one the tests use; a parameter whose dense
    gradient is zero up to rounding is measured against the largest gradient entry, not against its own
    rounding noise (before this measure was shared, such a tensor was measured against 1e-6 of the largest
    entry: fp32 rounding there could trip the check)."""

    def __init__(self, dense_loss, model, batches: list[dict], tolerance: float):
        self.tolerance = tolerance
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.saved = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        for inputs in batches:
            dense_loss(model, inputs).backward()
        self.dense = [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in self.params]
        for p in self.params:
            p.grad = None

    def finish(self) -> float:
        """Compare the walk's gradients (now in ``.grad``) with the dense ones; restore the earlier ones."""
        tree = [torch.zeros_like(p) if p.grad is None else p.grad for p in self.params]
        worst = relative_error(tree, self.dense, tiny=TINY)
        for p, grad, before in zip(self.params, tree, self.saved, strict=True):
            if before is not None:
                p.grad = grad + before
        if worst > self.tolerance:
            raise RuntimeError(
                "tree_check_gradients: the tree walk's gradients differ from the dense path's by "
                f"{worst:.3e} (relative, worst tensor; tolerance {self.tolerance}). Please report this model."
            )
        return worst
