"""The stale samples' metrics of :mod:`trl_dta.train.async_ppo.metrics` (``staleness/stale_*``): counted by
hand on samples whose ratios sit on both sides of the clipping range and of the weight's cap, and the share
of stale tokens "kept" equal to the tokens whose gradient the loss in use actually leaves non-zero."""

from __future__ import annotations

import math

import pytest
import torch

from trl_dta.train.async_ppo.loss import AsyncSample, ClippedSurrogate, Decoupled
from trl_dta.train.async_ppo.metrics import MicroBatchWalk, micro_batch_metrics

EPS_LOW, EPS_HIGH, VERSION, CAP = 0.2, 0.28, 3, 2.0


class OneProcess:
    """The accelerator's collectives on one process."""

    def reduce(self, tensor, reduction="sum"):
        return tensor

    def gather(self, tensor):
        return tensor


def sample(old: list[float], advantage: float, version: int) -> AsyncSample:
    n = len(old)
    return AsyncSample(tokens=list(range(n + 1)), batch=0, score_from=0, positions=torch.arange(n),
                       old_logps=torch.tensor(old), advantage=advantage, version=version)  # fmt: skip


# every policy log-prob is 0, so each ratio π_θ / π_behav (and weight π_prox / π_behav) is exp(-old)
SAMPLES = [
    sample([0.0, 0.0], 1.0, VERSION),  # fresh: not stale, whatever its ratios
    sample([-1.0, 0.0, -0.1, -1.0], 1.0, VERSION - 1),  # ratios e, 1, 1.105, e: 2 clipped (high), 2 over CAP
    sample([1.0, 0.5], -1.0, 0),  # ratios 0.37, 0.61 with A < 0: both clipped (low), none over CAP
    sample([-3.0], 1.0, -1),  # version unknown: not counted stale
]
STALE = [1, 2]


def walked() -> MicroBatchWalk:
    logps = [torch.zeros(len(s.old_logps)) for s in SAMPLES]
    return MicroBatchWalk(SAMPLES, logps, [torch.ones_like(lp) for lp in logps], 0.0)


def metrics(decoupled):
    return micro_batch_metrics(walked(), OneProcess(), EPS_LOW, EPS_HIGH, decoupled, "cpu", version=VERSION)


def tokens_with_gradient(decoupled) -> int:
    """Stale tokens whose gradient the loss in use leaves non-zero (every advantage here is non-zero)."""
    loss = ClippedSurrogate(SAMPLES, [1.0], EPS_LOW, EPS_HIGH, 1, decoupled)
    kept = 0
    for k in STALE:
        logps = torch.zeros(len(SAMPLES[k].old_logps), dtype=torch.float64, requires_grad=True)
        loss(k, logps).backward()
        kept += int((logps.grad != 0).sum())
    return kept


@pytest.mark.parametrize("decoupled", [None, Decoupled(CAP, "mask"), Decoupled(CAP, "truncate")])
def test_stale_samples_metrics_counted_by_hand(decoupled):
    out = metrics(decoupled)
    assert out["staleness/stale_token_share"] == pytest.approx(6 / 9)
    assert out["staleness/stale_clip_ratio"] == pytest.approx(4 / 6)  # TRL's region clip, stale tokens only
    if decoupled is None:
        assert "staleness/stale_capped_ratio" not in out
        assert out["staleness/stale_kept_ratio"] == pytest.approx(2 / 6)
    else:
        assert out["staleness/stale_capped_ratio"] == pytest.approx(2 / 6)
        expected = 4 / 6 if decoupled.mode == "mask" else 1.0
        assert out["staleness/stale_kept_ratio"] == pytest.approx(expected)
    assert out["staleness/stale_kept_ratio"] * 6 == pytest.approx(tokens_with_gradient(decoupled))


def test_no_stale_sample_no_share():
    fresh = MicroBatchWalk(SAMPLES[:1], [torch.zeros(2)], [torch.ones(2)], 0.0)
    out = micro_batch_metrics(fresh, OneProcess(), EPS_LOW, EPS_HIGH, None, "cpu", version=VERSION)
    assert out["staleness/stale_token_share"] == 0.0
    assert math.isnan(out["staleness/stale_clip_ratio"]) and math.isnan(out["staleness/stale_kept_ratio"])
    assert not any(k.startswith("staleness/") for k in metrics_without_version())


def metrics_without_version():
    return micro_batch_metrics(walked(), OneProcess(), EPS_LOW, EPS_HIGH, None, "cpu")


class Ranks:
    """The accelerator of rank 0 of several ranks whose gathered values are ``others`` (each rank's local
    vector, as :func:`micro_batch_metrics` hands it to ``gather``); ``gather`` records what it is given."""

    def __init__(self, others=()):
        self.others, self.local = list(others), None

    def gather(self, tensor):
        self.local = tensor
        return torch.cat([tensor, *self.others])


def part(indices) -> MicroBatchWalk:
    whole = walked()
    return MicroBatchWalk([whole.samples[k] for k in indices], [whole.logps[k] for k in indices],
                          [whole.entropies[k] for k in indices], 0.0)  # fmt: skip


@pytest.mark.parametrize("decoupled", [None, Decoupled(CAP, "mask")])
@pytest.mark.parametrize("split", [[[0, 2], [1, 3]], [[2], [], [0, 1, 3]]])
def test_ranks_metrics_equal_one_process(decoupled, split):
    """A micro-batch's samples split over ranks (one with none) give the metrics of one process with them
    all: each rank's sums and extremes travel in one gathered vector."""
    locals_ = []
    for indices in split[1:]:
        capture = Ranks()
        micro_batch_metrics(part(indices), capture, EPS_LOW, EPS_HIGH, decoupled, "cpu", version=VERSION)
        locals_.append(capture.local)
    out = micro_batch_metrics(part(split[0]), Ranks(locals_), EPS_LOW, EPS_HIGH, decoupled, "cpu",
                              version=VERSION)  # fmt: skip
    expected = metrics(decoupled)
    assert out.keys() == expected.keys()
    for name, value in expected.items():
        assert out[name] == pytest.approx(value, rel=1e-12, nan_ok=True), name  # (sums in float64)
