"""A kernel checked once before a walk uses it: on small calls in the path buffer's strides, its outputs and
gradients against sdpa per segment in float32 (:func:`passes`).

The calls: two segments gathered (one on a past) and a lone segment on a past read in place (strided K/V, as
a push hands them). Run once per kernel, device, dtype and head shape, when a walk's plan resolves the
kernel (:meth:`~trl_dta.walk.attention.kernel.AttentionKernel.resolve`); where the kernel fails or differs, a
warning says why and the walk attends with sdpa (:data:`VERDICTS` keeps the verdicts: the GPU suite reports
them).
"""

from __future__ import annotations

import logging

import torch

from ..errors import MEMORY_ERRORS
from .sdpa import sdpa_per_segment
from .segment_layout import SegmentLayout

logger = logging.getLogger(__name__)

VERDICTS: dict[tuple, bool] = {}  # (kernel, device, dtype, heads, kv heads, head dim): checked exact
TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 5e-2}  # largest relative error of outputs and gradients


def passes(kernel, device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int]) -> bool:
    """Whether ``kernel`` attends exactly in ``dtype`` on ``device`` for ``shape`` (heads, K/V heads, head
    dim), checked once (module docstring)."""
    key = (kernel, device, dtype, *shape)
    if key not in VERDICTS:
        VERDICTS[key] = _check(kernel, device, dtype, shape)
    return VERDICTS[key]


def _check(kernel, device, dtype, shape) -> bool:
    try:
        with torch.enable_grad(), torch.autocast(device.type, enabled=False):
            gen = torch.Generator(device=device).manual_seed(0)
            calls = (
                SegmentLayout.build([5, 3], (-1, 0), 4, device),
                SegmentLayout.build([8], (-1,), 4, device),
            )
            err = max(error(kernel, layout, shape, dtype, gen) for layout in calls)
    except MEMORY_ERRORS:
        raise
    except Exception as e:  # noqa: BLE001 - a kernel that refuses these shapes or this device
        reason = f"fails ({e!r})"
    else:
        if err <= TOLERANCE.get(dtype, 1e-5):
            return True
        reason = f"differs from sdpa by {err:.2e}"
    heads, kv_heads, head_dim = shape
    logger.warning(
        "The attention kernel %s %s for %s %s heads %d/%d x %d: the walk attends per segment with sdpa "
        "instead.",
        kernel.name,
        reason,
        device,
        dtype,
        heads,
        kv_heads,
        head_dim,
    )
    return False


def error(kernel, layout: SegmentLayout, shape, dtype, gen) -> float:
    """``kernel`` attending ``layout`` in ``dtype`` against sdpa per segment in float32 on the same random
    inputs: the largest relative error of the output and the gradients."""
    (heads, kv_heads, head_dim), device = shape, layout.q_cu.device
    tokens, scale = layout.start + layout.tokens, head_dim**-0.5
    q = torch.randn(1, heads, layout.tokens, head_dim, device=device, generator=gen)
    buffer = torch.randn(2, 1, kv_heads, tokens + 3, head_dim, device=device, generator=gen)
    grad = torch.randn(layout.tokens, heads, head_dim, device=device, generator=gen)
    outs = []
    for run, cast in ((kernel.attend, dtype), (_reference, torch.float32)):
        qq, kv = (t.detach().to(cast).requires_grad_() for t in (q, buffer))
        k, v = (b[0, :, :tokens].transpose(0, 1) for b in kv)  # (strided as the path's K/V)
        out = run(qq[0].transpose(0, 1), k, v, layout, scale, cast)
        out.float().backward(grad)
        outs.append([out.float(), qq.grad.float(), kv.grad.float()])
    return max(
        ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item() for a, b in zip(*outs, strict=True)
    )


def _reference(q, k, v, layout, scale, dtype):
    return sdpa_per_segment(q, *layout.gather(k, v), layout, scale)
