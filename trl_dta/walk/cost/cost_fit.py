"""The call-cost constants fitted to measured times, by non-negative least squares.

The cost model (:mod:`trl_dta.walk.cost.costs`) prices a forward + backward call as ``fixed + per_token x
tokens + per_pair x pairs``; the LM head adds ``per_scored`` per scored position (the same however calls are
cut, so the plan leaves it out, but a measured call pays it, and leaving it out of the fit would bias
``per_token``). An :class:`Observation` is what was measured: one call, or a whole walk, as its summed terms
and seconds.

* Summed costs (a CPU: the host computes): ``seconds = calls x fixed + tokens x per_token + pairs x
  per_pair + scored x per_scored``, linear in the constants.
* Overlapping costs (a GPU: the device computes while the host launches): ``seconds = max(calls x fixed,
  compute)``. Each observation is launch-bound or compute-bound; :func:`fit_constants` assigns them by the
  current estimate, solves, and repeats until the assignment stops changing, from several starting
  assignments (a wrong prior must not decide it), keeping the fit with the smallest residual.

The unknowns are the ratios of the constants to a prior (the shipped ones, or the last fit): each
observation's residual is relative (a 2 ms call weighs as much as a 2 s walk), and ``prior_weight`` pulls
each ratio toward 1, so that directions the data do not determine (no attention pairs measured yet, every
walk of the same shape) keep the prior. Solver: ``scipy.optimize.nnls`` (the constants are >= 0).

:func:`fixed_uncertainty` says how well the observations determine ``fixed``: calls of thousands of tokens
pay it as a few per cent of their time, below the clock's noise, so a fit from merged calls alone cannot
recover it (the cost model then explores: :mod:`trl_dta.walk.cost.cost_model`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

# the squared weight of each ratio's pull toward the prior, against one observation's relative residual:
# enough to hold a direction no observation determines, too little to slow a fit away from a wrong prior
PRIOR_WEIGHT = 1e-4
NOISE_FLOOR = 0.02  # the relative noise of a measured call assumed at least (fixed_uncertainty)


class Constants(NamedTuple):
    """Seconds per forward + backward call (all decoder layers), per token forwarded, per attention pair
    computed, per position scored by the LM head."""

    fixed: float
    per_token: float
    per_pair: float
    per_scored: float

    def seconds(self, terms: Sequence[float], overlap: bool) -> float:
        """Seconds of ``terms`` ``(calls, tokens, pairs, scored)``: summed, or the larger of the launches and
        the compute where they overlap."""
        calls, tokens, pairs, scored = terms
        compute = tokens * self.per_token + pairs * self.per_pair + scored * self.per_scored
        launch = calls * self.fixed
        return max(launch, compute) if overlap else launch + compute

    def ratio(self, other: Constants) -> float:
        """The largest relative difference of any constant from ``other``'s."""
        return max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(self, other, strict=True))


class Observation(NamedTuple):
    """A measured call or walk: its summed terms (as :meth:`Constants.seconds` takes them) and seconds."""

    calls: float
    tokens: float
    pairs: float
    scored: float
    seconds: float

    @property
    def terms(self) -> tuple[float, float, float, float]:
        return self.calls, self.tokens, self.pairs, self.scored


def fit_constants(
    observations: Sequence[Observation],
    prior: Constants,
    overlap: bool,
    prior_weight: float = PRIOR_WEIGHT,
    scale: Constants | None = None,
) -> tuple[Constants, float]:
    """The constants that best explain ``observations`` (module docstring), and their root-mean-square
    relative residual. Observations with no time or no terms are left out; with none, the prior.
    ``scale``: the shipped constants, where ``prior`` is an earlier fit (online): a constant fitted to 0 once
    is pulled in units of 1% of its shipped value, so that it can grow back."""
    rows = [o for o in observations if o.seconds > 0 and any(t > 0 for t in o.terms)]
    if not rows:
        return prior, 0.0
    # the ratios' unit: the prior, unless it is near 0 against ``scale`` (a constant fitted to 0 grows back)
    scale = np.array(scale or prior, dtype=np.float64)
    base = np.maximum(np.maximum(np.array(prior, dtype=np.float64), 1e-2 * scale), 1e-30)
    target = np.array(prior, dtype=np.float64) / base
    terms = np.array([o.terms for o in rows], dtype=np.float64)
    seconds = np.array([o.seconds for o in rows], dtype=np.float64)
    a = terms * base / seconds[:, None]  # relative: each row's target is 1
    if not overlap:
        ratios = _solve(a, prior_weight, target)
        return _constants(ratios, base), _residual(a, ratios)
    best = None
    for launch_bound in _starts(a, prior_weight, target):
        for _ in range(20):  # (assignments settle in a few rounds; a cycle ends here)
            ratios = _solve(_masked(a, launch_bound), prior_weight, target)
            again = a[:, 0] * ratios[0] > a[:, 1:] @ ratios[1:]
            if np.array_equal(again, launch_bound):
                break
            launch_bound = again
        predicted = np.maximum(a[:, 0] * ratios[0], a[:, 1:] @ ratios[1:])
        residual = float(np.sqrt(np.mean((predicted - 1) ** 2)))
        if best is None or residual < best[1]:
            best = (ratios, residual)
    return _constants(best[0], base), best[1]


def fixed_uncertainty(observations: Sequence[Observation], constants: Constants, overlap: bool) -> float:
    """The relative standard error of ``fixed`` that ``observations`` give about ``constants`` (a fit of
    them): ``sigma x sqrt([(A^T A)^-1]_00)`` of the fit's relative design ``A``, ``sigma`` its residual, at
    least ``NOISE_FLOOR`` (a clock is never exact: a noiseless fit would call any design determined). Where
    costs overlap, only launch-bound observations measure ``fixed``. Infinite where none does."""
    rows = [o for o in observations if o.seconds > 0 and any(t > 0 for t in o.terms)]
    base = np.maximum(np.array(constants, dtype=np.float64), 1e-30)
    if not rows or constants.fixed <= 0:
        return float("inf")
    terms = np.array([o.terms for o in rows], dtype=np.float64)
    a = terms * base / np.array([o.seconds for o in rows])[:, None]  # (ratios of 1: these constants)
    if overlap:
        a = _masked(a, a[:, 0] > a[:, 1:].sum(axis=1))
    if not a[:, 0].any():
        return float("inf")
    a = a[:, a.any(axis=0)]  # (a constant no observation pays is not the question; ``fixed`` stays first)
    sigma = max(_residual(a, np.ones(a.shape[1])), NOISE_FLOOR)
    # ``fixed``'s variance is 1 / what of its column the other constants' columns do not explain (so
    # collinear other columns, scored positions that are all the tokens say, do not matter)
    fixed, others = a[:, 0], a[:, 1:]
    if others.shape[1]:
        fixed = fixed - others @ np.linalg.lstsq(others, fixed, rcond=None)[0]
    unexplained = float(fixed @ fixed)
    if unexplained <= 1e-12 * float(a[:, 0] @ a[:, 0]):  # (no more observations than the others explain)
        return float("inf")
    return sigma / np.sqrt(unexplained)


def _starts(a: np.ndarray, prior_weight: float, target: np.ndarray) -> list[np.ndarray]:
    """Starting assignments for the overlapping fit: by the prior; all launch-bound; all compute-bound; and
    by each observation's share of launches in the summed fit (the larger half launch-bound)."""
    prior = a[:, 0] * target[0] > a[:, 1:] @ target[1:]
    summed = _solve(a, prior_weight, target)
    share = a[:, 0] * summed[0] / np.maximum(a @ summed, 1e-30)
    n = len(a)
    return [prior, np.ones(n, bool), np.zeros(n, bool), share >= np.median(share)]


def _masked(a: np.ndarray, launch_bound: np.ndarray) -> np.ndarray:
    """A launch-bound row measures ``fixed`` alone, a compute-bound row the compute constants alone."""
    out = a.copy()
    out[launch_bound, 1:] = 0
    out[~launch_bound, 0] = 0
    return out


def _solve(a: np.ndarray, prior_weight: float, target: np.ndarray) -> np.ndarray:
    """Least squares of ``a @ r = 1`` with each ``r_j`` pulled toward ``target_j``, ``r >= 0``."""
    from scipy.optimize import nnls  # (here: importing the walk stays cheap)

    k = a.shape[1]
    weight = np.sqrt(prior_weight)
    ratios, _ = nnls(np.vstack([a, weight * np.eye(k)]), np.concatenate([np.ones(len(a)), weight * target]))
    return ratios


def _residual(a: np.ndarray, ratios: np.ndarray) -> float:
    return float(np.sqrt(np.mean((a @ ratios - 1) ** 2)))


def _constants(ratios: np.ndarray, base: np.ndarray) -> Constants:
    return Constants(*(float(r * b) for r, b in zip(ratios, base, strict=True)))
