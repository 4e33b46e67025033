"""Torch's flash kernel for variable-length batches: the CUDA side of attention per segment.

:mod:`trl_dta.walk.attention.segment_attention` lays a call out as runs of queries, each with its own keys; on
CUDA in bf16/fp16 that layout runs ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.11: causal as
``window_size=(-1, 0)``; grouped-query attention as it is in 2.11, with ``enable_gqa`` from 2.12; the
signature is read at run time), one kernel per layer forward and one backward:

* :func:`usable`: whether a call runs it: CUDA, bf16/fp16 (the activations', or autocast's), and the kernel
  checked once per device, dtype and head shape (:func:`_check`: a small call of two segments, one on a
  past, in the path buffer's strides, outputs and gradients against the sdpa path in float32; where it fails
  or differs, a warning and the sdpa path);
* :func:`attend`: the kernel on the call's gathered keys, the gather checkpointed: segments that share a past
  each get a copy of its K/V for the kernel, not kept for the backward but gathered again there with the
  kernel's forward (one more attention forward per packed call; a lone segment reads the buffer in place);
* :func:`use_flash`: off for a block (benchmarks compare it with the sdpa path); :func:`expected`: whether a
  walk will take it (its memory model counts no kept keys then).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging

import torch
from torch.utils.checkpoint import checkpoint

from ..errors import MEMORY_ERRORS
from .segment_layout import SegmentLayout, sdpa_per_segment

logger = logging.getLogger(__name__)

try:  # torch >= 2.10 (the causal switch: ``is_causal`` in 2.10, ``window_size=(-1, 0)`` from 2.11)
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - torch < 2.10
    varlen_attn = None

_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_VERDICTS: dict[tuple, bool] = {}  # (device, dtype, heads, kv heads, head dim): the kernel checked exact
_CHECK_TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 5e-2}


def _flash_kwargs(gqa: bool, kernel=None) -> dict | None:
    """The keyword arguments of this torch's ``varlen_attn`` (or ``kernel``) for causal attention with a
    scale; None where it has no scale or causal switch (torch 2.10: not used)."""
    kernel = kernel or varlen_attn
    if kernel is None:
        return None
    params = _parameters(kernel)
    if "scale" not in params or "window_size" not in params:
        return None
    kwargs = {"window_size": (-1, 0)}  # causal, aligned bottom-right
    if "enable_gqa" in params:  # (torch >= 2.12; 2.11's kernel takes fewer K/V heads as they are)
        kwargs["enable_gqa"] = gqa
    return kwargs


def attend(q, k, v, layout, scale: float, dtype) -> torch.Tensor:
    """The flash kernel on the gathered keys, the gather recomputed in the backward (checkpointed): what is
    kept is the path buffer's views, not a copy of the past for every segment that shares it."""

    kernel = varlen_attn  # (the recomputation runs the kernel of the forward)

    def attend(q, k, v):
        return _flash(*(t.to(dtype) for t in (q, *layout.gather(k, v))), layout, scale, kernel)

    if layout.key_index is None or not torch.is_grad_enabled():  # (a lone segment reads the buffer in place)
        return attend(q, k, v)
    return checkpoint(attend, q, k, v, use_reentrant=False, preserve_rng_state=False)


@functools.lru_cache(maxsize=8)
def _parameters(kernel) -> frozenset:
    return frozenset(inspect.signature(kernel).parameters)


def _flash(q, k, v, layout, scale: float, kernel=None) -> torch.Tensor:
    kernel = kernel or varlen_attn
    _check_covered(q, k, v, layout)
    kwargs = _flash_kwargs(q.shape[1] != k.shape[1], kernel)
    max_q, max_k = max(layout.q_lens), max(layout.k_lens)
    return kernel(q, k, v, layout.q_cu, layout.k_cu, max_q, max_k, scale=scale, **kwargs)


def _check_call(layout, shapes, dtype, scale: float, gen) -> float:
    """One call of :func:`_check`: the flash kernel in ``dtype`` against sdpa per segment in float32 on the
    same inputs, the largest relative error of the output and the gradients."""
    (heads, kv_heads, head_dim), device = shapes, layout.q_cu.device
    tokens = layout.start + layout.tokens
    q = torch.randn(1, heads, layout.tokens, head_dim, device=device, generator=gen)
    buffer = torch.randn(2, 1, kv_heads, tokens + 3, head_dim, device=device, generator=gen)
    grad = torch.randn(layout.tokens, heads, head_dim, device=device, generator=gen)
    outs = []
    for run, cast in ((_flash, dtype), (sdpa_per_segment, torch.float32)):
        qq, kv = (t.detach().to(cast).requires_grad_() for t in (q, buffer))
        k, v = (b[0, :, :tokens].transpose(0, 1) for b in kv)  # (strided as the path's K/V)
        out = run(qq[0].transpose(0, 1), *layout.gather(k, v), layout, scale)
        out.float().backward(grad)
        outs.append([out.float(), qq.grad.float(), kv.grad.float()])
    return max(
        ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item() for a, b in zip(*outs, strict=True)
    )


def _check_covered(q, k, v, layout) -> None:
    """Refuse a call whose ``q``, ``k`` or ``v`` is not exactly as long as its last cumulative length: torch's
    varlen backward returns NaN without an error where a tensor is longer (pytorch issue 176793, no check up
    to torch 2.13), and reads past a shorter one. The lengths are the layout's host ones (no device sync).
    The walk's calls meet it by construction: the attention function checks the call's keys against
    ``start + tokens`` and a lone segment's keys are that view of the path buffer, whatever its capacity."""
    queries, keys = layout.tokens, sum(layout.k_lens)
    if q.shape[0] != queries or k.shape[0] != keys or v.shape[0] != keys:
        raise RuntimeError(
            f"internal: the flash kernel would get {q.shape[0]} queries and {k.shape[0]}/{v.shape[0]} keys/"
            f"values for runs of {queries} and {keys} (its backward returns NaN where a tensor is longer)"
        )


def usable(q, k, dtype, scale: float) -> bool:
    """Whether torch's flash kernel runs this call (attention in ``dtype``): CUDA, bf16/fp16, and checked
    exact once for its shapes."""
    if not q.is_cuda or dtype not in _FLASH_DTYPES or not enabled():
        return False
    key = (q.device, dtype, q.shape[1], k.shape[1], q.shape[-1])
    if key not in _VERDICTS:
        _VERDICTS[key] = _check(q.device, dtype, q.shape[1], k.shape[1], q.shape[-1], scale)
    return _VERDICTS[key]


def _check(device, dtype, heads: int, kv_heads: int, head_dim: int, scale: float) -> bool:
    """Run the flash kernel on two small calls in the path buffer's strides, two segments gathered (one on a
    past) and a lone segment on a past read in place (strided K/V, as a push hands them), and compare its
    outputs and gradients with the sdpa path's in float32; warn and return False where it fails or differs."""
    if _flash_kwargs(heads != kv_heads) is None:
        return False
    try:
        with torch.enable_grad(), torch.autocast(device.type, enabled=False):
            gen = torch.Generator(device=device).manual_seed(0)
            shapes = (heads, kv_heads, head_dim)
            calls = (
                SegmentLayout.build([5, 3], (-1, 0), 4, device),
                SegmentLayout.build([8], (-1,), 4, device),
            )
            err = max(_check_call(layout, shapes, dtype, scale, gen) for layout in calls)
    except MEMORY_ERRORS:
        raise
    except Exception as e:  # noqa: BLE001 - a kernel that refuses these shapes or this device
        reason = f"fails ({e!r})"
    else:
        if err <= _CHECK_TOLERANCE[dtype]:
            return True
        reason = f"differs from sdpa by {err:.2e}"
    logger.warning(
        "torch's flash varlen kernel %s for %s %s heads %d/%d x %d: the walk attends per segment with sdpa "
        "instead.",
        reason,
        device,
        dtype,
        heads,
        kv_heads,
        head_dim,
    )
    return False


_ON = True  # calls on CUDA may use torch's flash kernel (use_flash)


def expected(lm) -> bool:
    """Whether a walk through ``lm`` (a :class:`~trl_dta.walk.adapter.model.CausalLM` attending per segment)
    is expected to attend with the flash kernel: CUDA, activations in bf16/fp16 (its weights', or autocast's),
    the kernel on (its check, at the first call, may still refuse it)."""
    if lm.device.type != "cuda" or not enabled() or varlen_attn is None:
        return False
    on = torch.is_autocast_enabled("cuda")
    return (torch.get_autocast_dtype("cuda") if on else lm.lm_head.weight.dtype) in _FLASH_DTYPES


def enabled() -> bool:
    """Whether calls on CUDA may use torch's flash kernel (:func:`use_flash`)."""
    return _ON


@contextlib.contextmanager
def use_flash(on: bool):
    """Within: calls on CUDA use torch's flash kernel (``on``) or the sdpa path (benchmarks compare them)."""
    global _ON
    previous, _ON = _ON, on
    try:
        yield
    finally:
        _ON = previous
