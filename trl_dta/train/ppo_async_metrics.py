""":class:`~trl_dta.AsyncTreePPOTrainer`'s per-micro-batch metrics, from the walk's values: TRL's (ratio, kl,
entropy, clip ratios, as its ``compute_loss`` logs them) and, with the decoupled objective, the importance
weights'. Each is over every rank's samples of the micro-batch."""

from __future__ import annotations

from math import nan

import torch
from trl.trainer.utils import nanmax, nanmin

from .ppo_async_loss import Decoupled, importance_sums, surrogate_sums

TRL_MEANS = (
    "ratio",
    "kl",
    "entropy",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
)


class MicroBatchWalk:
    """One micro-batch's share of a step's walk: its samples, their log-probs and entropies at their trained
    tokens (detached) and the sum of their losses."""

    def __init__(self, samples, logps, entropies, loss: float):
        self.samples, self.logps, self.entropies, self.loss = samples, logps, entropies, loss


def micro_batch_metrics(walked: MicroBatchWalk, accelerator, epsilon_low: float, epsilon_high: float,
                        decoupled: Decoupled | None, device) -> dict[str, float]:  # fmt: skip
    """The micro-batch's metrics by name (collectives over ranks: every rank calls this for each
    micro-batch, with or without samples)."""
    per_sample = [
        surrogate_sums(lp, s.old_logps, s.advantage, ent, epsilon_low, epsilon_high).to(device)
        for s, lp, ent in zip(walked.samples, walked.logps, walked.entropies, strict=True)
    ]  # (each row: ratio, kl, entropy, low-, high-, region-clipped, count sums)
    per_sample = torch.stack(per_sample) if per_sample else torch.zeros(0, 7, device=device).double()
    sums = accelerator.reduce(per_sample.sum(0), reduction="sum")
    count = float(sums[6])
    out = {name: v / count if count else nan for name, v in zip(TRL_MEANS, sums[:6].tolist(), strict=True)}
    extremes = torch.full((2,), nan, dtype=torch.float64, device=device)  # (a rank may have no sample)
    if len(per_sample):  # per sample, its share of low-clipped (high-clipped) tokens; then over ranks
        extremes = torch.stack([
            (per_sample[:, 3] / per_sample[:, 6]).min(), (per_sample[:, 4] / per_sample[:, 6]).max()
        ])  # fmt: skip
    extremes = accelerator.gather(extremes).reshape(-1, 2)  # (ranks, 2)
    out["clip_ratio/low_min"] = nanmin(extremes[:, 0]).item()
    out["clip_ratio/high_max"] = nanmax(extremes[:, 1]).item()
    if decoupled is not None:  # the walk's log-probs are the proximal policy's (ppo_async_loss.py)
        out.update(importance_weights(walked, accelerator, decoupled, count, device))
    return out


def importance_weights(walked: MicroBatchWalk, accelerator, decoupled: Decoupled, count: float, device):
    """The decoupled objective's importance weights π_prox / π_behav over the micro-batch's trained tokens
    (every rank): their mean and largest value before capping, and the share over the cap. (The clip
    fraction against the proximal policy is 0 by construction, one update per walked step: not logged;
    TRL's ``clip_ratio/*`` still measure the ratio against the behaviour policy.)"""
    rows = [importance_sums(lp, s.old_logps, decoupled).to(device)
            for s, lp in zip(walked.samples, walked.logps, strict=True)]  # fmt: skip
    sums = torch.stack(rows) if rows else torch.zeros(0, 3, dtype=torch.float64, device=device)
    total = accelerator.reduce(sums[:, :2].sum(0), reduction="sum")
    local = sums[:, 2].max() if rows else torch.tensor(-torch.inf, dtype=torch.float64, device=device)
    largest = accelerator.gather(local.reshape(1)).max()  # (one value per rank, -inf if none)
    return {
        "decoupled/imp_weight_mean": float(total[0]) / count if count else nan,
        "decoupled/imp_weight_max": float(largest) if count else nan,
        "decoupled/capped_ratio": float(total[1]) / count if count else nan,
    }
