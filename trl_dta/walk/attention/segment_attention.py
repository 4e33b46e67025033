"""Attention per segment: each segment of a model call attends only the keys it sees, one kernel per layer.

A call of the walk forwards one segment on its path (a push, a lone leaf) or several in one row (sibling
leaves, a packed subtree: :mod:`trl_dta.walk.attention.packing`). Each segment's queries see the call's past
(cache positions ``[0, start)``), the tokens of its ancestors in the row, and its own tokens causally: over
its keys, a causal mask aligned bottom-right. A :class:`SegmentLayout` holds this for one call: per segment
its queries (a run of the row) and its keys (position ranges of the path's K/V), as the cumulative lengths and
key index a variable-length kernel takes, and the kernel that attends them (:mod:`trl_dta.walk.attention.
kernel`, resolved at the walk's plan: sdpa per segment on a CPU, a flash varlen kernel on CUDA). No mask, no
rectangle: only the pairs the tree needs. Under autocast the kernels attend in autocast's dtype, as sdpa does
there (under bf16 mixed precision over float32 weights, queries and keys leave their norms and RoPE in
float32).

The hook: :func:`attention` is registered in transformers' ``AttentionInterface`` as :data:`ATTENTION`
(as TRL's asynchronous trainer hooks in its tree attention), so every decoder whose attention layers call
transformers' attention functions walks with it. :func:`attending` switches a model's config to it for the
time of one call and hands it the call's layout; with no mask function registered under that name,
transformers builds no mask. A model whose layers do not call it once each (their own attention code) is
caught by :meth:`SegmentLayout.check_used`; the construction probe (:mod:`trl_dta.walk.adapter.probe`)
compares the whole path with the model's dense forward before the walk uses it, and falls back to the model's
own attention with a mask where it differs.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging

import torch

from ..errors import UnsupportedModelError
from .sdpa import SDPA_SEGMENTS
from .segment_layout import ATTENTION, SegmentLayout

__all__ = ["attending", "attention", "register"]

logger = logging.getLogger(__name__)
_ACTIVE: contextvars.ContextVar[SegmentLayout | None] = contextvars.ContextVar("trl_dta_layout", default=None)


@contextlib.contextmanager
def attending(config, layout: SegmentLayout):
    """Within: the attention layers of the model of ``config`` (its text config, which its layers read)
    call :func:`attention` with ``layout`` (module docstring)."""
    token = _ACTIVE.set(layout)
    previous = config._attn_implementation
    _set_implementation(config, ATTENTION)
    layout.calls = 0
    try:
        yield
    finally:
        _set_implementation(config, previous)
        _ACTIVE.reset(token)


def _set_implementation(config, name) -> None:
    # (the internal attribute: the property's setter also rewrites sub-configs, which the walk does not read)
    if hasattr(config, "_attn_implementation_internal"):
        config._attn_implementation_internal = name
    else:  # pragma: no cover - other transformers layouts
        config._attn_implementation = name


_REFUSED = ("sliding_window", "softcap", "s_aux")  # attention variants the layout does not apply


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function interface: ``query`` [1, H, T, D], ``key`` / ``value`` [1, Hkv,
    start + T, D] (the path's K/V and the call's, from :class:`~trl_dta.walk.adapter.cache.PathLayer`), the
    mask (None; ignored) → the output [1, T, H, D] and no weights."""
    layout = _ACTIVE.get()
    if layout is None:
        raise RuntimeError(f"internal: the attention function {ATTENTION!r} was called outside a walk's call")
    for name in _REFUSED:
        if kwargs.get(name) is not None:
            raise UnsupportedModelError(f"attention with {name} is not attended per segment")
    if dropout:
        raise UnsupportedModelError("attention dropout is not attended per segment")
    if (
        query.shape[0] != 1
        or key.shape[-2] != layout.start + layout.tokens
        or query.shape[-2] != layout.tokens
    ):
        raise RuntimeError(
            f"internal: attention per segment got queries {tuple(query.shape)} and keys {tuple(key.shape)} "
            f"for a call of {layout.tokens} tokens on a past of {layout.start}"
        )
    layout.calls += 1
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q = query.squeeze(0).transpose(0, 1)  # [T, H, D] (views: no copy, none in backward)
    k, v = key.squeeze(0).transpose(0, 1), value.squeeze(0).transpose(0, 1)  # [S, Hkv, D]
    dtype = _autocast_dtype(q) or q.dtype  # (as sdpa under autocast: attention in autocast's dtype)
    kernel = layout.kernel
    if not kernel.takes(q, dtype):  # (resolved for another device or dtype than this call's)
        _warn_untaken(kernel, q, dtype)
        kernel = SDPA_SEGMENTS
    layout.ran = kernel.name
    return kernel.attend(q, k, v, layout, scale, dtype).unsqueeze(0), None


_UNTAKEN: set = set()


def _warn_untaken(kernel, q, dtype) -> None:
    if kernel.name not in _UNTAKEN:
        _UNTAKEN.add(kernel.name)
        logger.warning(
            "A walk's call attends in %s on %s, not what its kernel %s was resolved for (the plan reads the "
            "weights' dtype or autocast's): it attends with sdpa per segment (tree/attention_calls/%s).",
            dtype,
            q.device,
            kernel.name,
            SDPA_SEGMENTS.name,
        )


def _autocast_dtype(q) -> torch.dtype | None:
    """Autocast's dtype where it is on for ``q``'s device (sdpa runs in it there: so does this function;
    under bf16 mixed precision over float32 weights, queries and keys leave their norms and RoPE in float32),
    else None."""
    if not torch.is_autocast_enabled(q.device.type):
        return None
    return torch.get_autocast_dtype(q.device.type)


def register() -> None:
    """Register :func:`attention` in transformers' ``AttentionInterface`` (and no mask function: transformers
    builds no mask for it)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, attention)


register()
