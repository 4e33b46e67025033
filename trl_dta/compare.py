"""How trl-dta compares two computations of the same tensors (the probe, ``tree_check_gradients``, the tests
and the benchmarks all use this one measure)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

Tensors = torch.Tensor | Sequence[torch.Tensor] | Mapping[str, torch.Tensor]


def relative_error(got: Tensors, ref: Tensors, tiny: float = 1e-9) -> float:
    """``max |got - ref| / max |ref|`` per tensor, the largest over tensors (one tensor, a sequence, or a
    mapping with the same keys). A tensor whose reference is at most ``tiny`` times the largest reference
    entry of all (a gradient that is zero up to rounding, e.g. q/k projections when every query sees one
    key) is measured against that largest entry instead. All-zero references: 0 if ``got`` is zero too,
    else infinity."""
    if isinstance(ref, Mapping):
        if got.keys() != ref.keys():
            raise ValueError(f"different tensors: {sorted(got.keys() ^ ref.keys())}")
        got, ref = [got[k] for k in ref], list(ref.values())
    elif isinstance(ref, torch.Tensor):
        got, ref = [got], [ref]
    if len(got) != len(ref):
        raise ValueError(f"{len(got)} tensors against {len(ref)}")
    scales = [r.detach().abs().max().item() if r.numel() else 0.0 for r in ref]
    overall = max(scales, default=0.0)
    worst = 0.0
    for g, r, scale in zip(got, ref, scales, strict=True):
        if not r.numel():
            continue
        diff = (g.detach() - r.detach()).abs().max().item()
        if math.isnan(diff):
            return math.inf
        denominator = scale if scale > tiny * overall else overall
        worst = max(worst, diff / denominator if denominator > 0 else (0.0 if diff == 0 else float("inf")))
    return worst
