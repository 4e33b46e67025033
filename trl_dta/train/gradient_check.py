"""``tree_check_gradients``: an optimizer step's gradients by TRL's dense path, compared with the walk's.

:class:`GradientCheck` runs TRL's own ``_compute_loss`` (dense log-prob passes) on the micro-batches of the
step and backpropagates them, keeps those gradients, and leaves ``.grad`` and TRL's state as it found them
except that ``.grad`` is cleared, so that the walk that follows writes its gradients alone. :meth:`finish`
then compares per tensor, puts back the gradients that were there before, and raises on a mismatch.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from trl import GRPOTrainer


class GradientCheck:
    def __init__(self, trainer, model, batches: list[dict], tolerance: float):
        self.tolerance = tolerance
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.saved = [p.grad for p in self.params]
        state = (
            trainer._metrics,
            trainer.entropy_coef,
            trainer._entropy_window_stats,
            trainer._last_world_entropy,
        )
        trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        trainer._tree_dense_passes = True  # TRL's own log-prob passes, with their graph
        try:
            for p in self.params:
                p.grad = None
            for inputs in batches:
                GRPOTrainer._compute_loss(trainer, model, inputs).backward()
            self.dense = [
                torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in self.params
            ]
        finally:
            trainer._tree_dense_passes = False
            (
                trainer._metrics,
                trainer.entropy_coef,
                trainer._entropy_window_stats,
                trainer._last_world_entropy,
            ) = state
        for p in self.params:
            p.grad = None

    def finish(self) -> float:
        """Compare the walk's gradients (now in ``.grad``) with the dense ones; restore the earlier ones."""
        overall = max((d.abs().max().item() for d in self.dense), default=0.0)
        worst = 0.0
        for p, ref, before in zip(self.params, self.dense, self.saved, strict=True):
            tree = p.grad if p.grad is not None else torch.zeros_like(p)
            scale = max(ref.abs().max().item(), 1e-6 * overall, 1e-30)
            worst = max(worst, (tree - ref).abs().max().item() / scale)
            if before is not None:
                p.grad = tree + before
        if worst > self.tolerance:
            raise RuntimeError(
                "tree_check_gradients: the tree walk's gradients differ from the dense path's by "
                f"{worst:.3e} "
                f"(relative, worst tensor; tolerance {self.tolerance}). Please report this model."
            )
        return worst
