"""Attention per segment: each segment of a model call attends only the keys it sees, one kernel per layer.

A call of the walk forwards one segment on its path (a push, a lone leaf) or several in one row (sibling
leaves, a packed subtree: :mod:`trl_dta.walk.packing`). Each segment's queries see the call's past (cache
positions ``[0, start)``), the tokens of its ancestors in the row, and its own tokens causally: over its
keys, a causal mask aligned bottom-right. A :class:`SegmentLayout` holds this for one call: per segment its
queries (a run of the row) and its keys (position ranges of the path's K/V), as the cumulative lengths and
key index a variable-length kernel takes. No mask, no rectangle: only the pairs the tree needs.

The kernels, chosen per call (:func:`attention`):

* on CUDA in bf16/fp16: torch's flash kernel for variable-length batches (:mod:`trl_dta.walk.flash`), one
  kernel per layer forward and one backward, on every segment's keys gathered into one tensor
  (``index_select``: segments that share a past each get a copy, recomputed in the backward rather than
  kept); a call with one segment (a push) reads the path's buffer in place;
* elsewhere (a CPU, float32/64, a head size the flash kernel refuses, a kernel that failed its check): the
  same layout through ``scaled_dot_product_attention``, once per segment; or, for a packed row whose segments
  see most of its rectangle (:func:`~trl_dta.walk.costs.per_segment_pays`), once for the row with its
  tree-shaped mask (copying every segment's keys then costs about what the skipped pairs save). Here the
  gathered keys are kept for the backward (attention is a larger share of a CPU's time;
  :func:`~trl_dta.walk.memory_model.activation_bytes` counts them). CPU tests check this path exactly (fp64
  against dense), and the flash kernel is checked against it.

Under autocast both attend in autocast's dtype, as sdpa does there (under bf16 mixed precision over float32
weights, queries and keys leave their norms and RoPE in float32).

The hook: :func:`attention` is registered in transformers' ``AttentionInterface`` as :data:`ATTENTION`
(as TRL's asynchronous trainer hooks in its tree attention), so every decoder whose attention layers call
transformers' attention functions walks with it. :func:`attending` switches a model's config to it for the
time of one call and hands it the call's layout; with no mask function registered under that name,
transformers builds no mask. A model whose layers do not call it once each (their own attention code) is
caught by :meth:`SegmentLayout.check_used`; the construction probe (:mod:`trl_dta.walk.probe`) compares the
whole path with the model's dense forward before the walk uses it, and falls back to the model's own
attention with a mask where it differs.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.nn import functional as F

from . import flash
from .costs import per_segment_pays
from .errors import UnsupportedModelError

if TYPE_CHECKING:
    from .inputs import PackedRow

logger = logging.getLogger(__name__)

ATTENTION = "trl_dta_segments"  # the name in transformers' AttentionInterface
_ACTIVE: contextvars.ContextVar[SegmentLayout | None] = contextvars.ContextVar("trl_dta_layout", default=None)


def key_ranges(lengths: list[int], parents: tuple[int, ...], start: int) -> list[list[tuple[int, int]]]:
    """For each segment of a row of ``lengths`` (``parents[k]``: the index of segment ``k``'s parent in the
    row, -1 for the past; parents come first) on a past of ``start`` tokens: the cache positions it sees (the
    past, its ancestors' tokens, its own), as ascending ``[begin, end)`` ranges, adjacent ones merged."""
    offsets = np.concatenate([[0], np.cumsum(lengths)]) + start
    out = []
    for k in range(len(lengths)):
        chain, j = [], k
        while j >= 0:
            chain.append(j)
            j = parents[j]
        ranges = [[0, start]] if start else []
        for j in reversed(chain):  # in row order: ancestors come before their descendants
            lo, hi = int(offsets[j]), int(offsets[j + 1])
            if ranges and ranges[-1][1] == lo:
                ranges[-1][1] = hi
            else:
                ranges.append([lo, hi])
        out.append([(lo, hi) for lo, hi in ranges])
    return out


@dataclass(eq=False)
class SegmentLayout:
    """One call's segments (module docstring): host lengths, and the kernel's index tensors on the device.

    ``q_cu`` / ``k_cu``: cumulative query / key lengths [n + 1] (int32); ``key_index``: the cache positions
    of every segment's keys, concatenated [sum(k_lens)] (None: one segment that sees ``[0, start + tokens)``,
    read in place); ``row``: a packed row's index tensors (its mask, where the row is attended whole);
    ``split``: the sdpa path attends per segment (else the row at once)."""

    start: int
    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]
    q_cu: torch.Tensor
    k_cu: torch.Tensor
    key_index: torch.Tensor | None
    row: PackedRow | None
    split: bool
    calls: int = 0  # attention calls made with it since the call began

    @property
    def tokens(self) -> int:
        return sum(self.q_lens)

    @staticmethod
    def host(lengths: list[int], parents: tuple[int, ...], start: int):
        """The layout's host arrays: ``(q_cu, k_cu, key_index or None, k_lens, split)``."""
        ranges = key_ranges(lengths, parents, start)
        k_lens = [sum(hi - lo for lo, hi in r) for r in ranges]
        q_cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        k_cu = np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int32)
        index = None
        if len(lengths) > 1:
            index = np.concatenate([np.arange(lo, hi) for r in ranges for lo, hi in r]).astype(np.int64)
        tokens = sum(lengths)
        needed = sum(q * k - q * (q - 1) // 2 for q, k in zip(lengths, k_lens, strict=True))
        split = len(lengths) == 1 or per_segment_pays(start, tokens, needed)
        return q_cu, k_cu, index, k_lens, split

    @classmethod
    def build(
        cls, lengths: list[int], parents: tuple[int, ...], start: int, device, row=None
    ) -> SegmentLayout:
        """A layout built here, with its own host-to-device copies (the probe's, tests'); a walk builds its
        calls' layouts at once (:class:`~trl_dta.walk.inputs.WalkInputs`)."""
        q_cu, k_cu, index, k_lens, split = cls.host(lengths, parents, start)
        return cls(
            start,
            tuple(lengths),
            tuple(k_lens),
            torch.from_numpy(q_cu).to(device),
            torch.from_numpy(k_cu).to(device),
            None if index is None else torch.from_numpy(index).to(device),
            row,
            split,
        )

    def gather(self, k, v):
        """Every segment's keys and values, one after another [sum(k_lens), Hkv, D], from the call's
        [start + tokens, Hkv, D] (a lone segment's: as they are)."""
        if self.key_index is None:
            return k, v
        return k.index_select(0, self.key_index), v.index_select(0, self.key_index)

    def check_used(self, layers: int, name: str) -> None:
        """Refuse a call whose model did not attend through :func:`attention` once per attention layer."""
        if self.calls != layers:
            raise UnsupportedModelError(
                f"{name}: {self.calls} of its {layers} attention layers called transformers' attention "
                f"function {ATTENTION!r}; a model with its own attention code cannot attend per segment."
            )


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
    start + T, D] (the path's K/V and the call's, from :class:`~trl_dta.walk.cache.PathLayer`), the mask
    (None; ignored) → the output [1, T, H, D] and no weights."""
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
    if flash.usable(q, k, dtype, scale):
        out = flash.attend(q, k, v, layout, scale, dtype)
    elif layout.split:
        out = _sdpa_per_segment(*_cast(dtype, q, *layout.gather(k, v)), layout, scale)
    else:
        out = _sdpa_row(*_cast(dtype, query, key, value), layout, scale)
    return out.unsqueeze(0), None


def _cast(dtype, *tensors):
    return [t.to(dtype) for t in tensors]  # (no copy where it is that dtype)


def _autocast_dtype(q) -> torch.dtype | None:
    """Autocast's dtype where it is on for ``q``'s device (sdpa runs in it there: so does this function;
    under bf16 mixed precision over float32 weights, queries and keys leave their norms and RoPE in float32),
    else None."""
    if not torch.is_autocast_enabled(q.device.type):
        return None
    return torch.get_autocast_dtype(q.device.type)


# ---------------------------------------------------------------------- the sdpa path
def _sdpa_per_segment(q, k, v, layout: SegmentLayout, scale: float) -> torch.Tensor:
    gqa = q.shape[1] != k.shape[1]
    outs, q0, k0 = [], 0, 0
    for n, m in zip(layout.q_lens, layout.k_lens, strict=True):
        # [1, heads, n or m, D]: sdpa's fused CPU kernels take 4-D inputs only
        qs, ks, vs = (t.transpose(0, 1)[None] for t in (q[q0 : q0 + n], k[k0 : k0 + m], v[k0 : k0 + m]))
        mask = None if n == m else torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n)
        o = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, is_causal=n == m, scale=scale, enable_gqa=gqa
        )
        outs.append(o[0].transpose(0, 1))
        q0, k0 = q0 + n, k0 + m
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def _sdpa_row(query, key, value, layout: SegmentLayout, scale: float) -> torch.Tensor:
    """A packed row at once, with its tree-shaped mask (built once per call, shared by its layers)."""
    mask = getattr(layout, "_mask", None)
    if mask is None:
        from .packing import packed_visible

        mask = layout._mask = packed_visible(layout.row, layout.start)[None, None]
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scale, enable_gqa=query.shape[1] != key.shape[1]
    )  # [1, H, T, D]
    return out[0].transpose(0, 1)


def register() -> None:
    """Register :func:`attention` in transformers' ``AttentionInterface`` (and no mask function: transformers
    builds no mask for it)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, attention)


register()
