"""Attention per segment through ``scaled_dot_product_attention``: the kernel of every device and dtype, the
reference the flash kernels are checked against (:mod:`trl_dta.walk.attention.check`).

A call with one segment (a push, a lone leaf) is one sdpa call on the path's K/V. A packed row of several is
attended segment by segment, each on its gathered keys (:meth:`~trl_dta.walk.attention.segment_layout.
SegmentLayout.gather`), where that computes at most half the row's rectangle (:func:`per_segment_pays`);
closer to the rectangle, copying each segment's keys costs about what the skipped pairs save, and the row is
attended at once with its tree-shaped mask. The gathered keys are kept for the backward (attention is a
larger share of a CPU's time than of a GPU's): :attr:`SdpaSegments.keeps_keys`, counted by the plan against a
call's budget. Under autocast it attends in autocast's dtype, as sdpa does there. CPU tests check it exactly
(fp64 against dense).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from .kernel import AttentionKernel
from .packing import packed_visible


def per_segment_pays(past: int, tokens: int, needed: int) -> bool:
    """Whether a packed row of ``tokens`` on a past of ``past``, the tree needing ``needed`` of its pairs, is
    attended segment by segment: where that computes at most half the row's rectangle."""
    return 2 * needed <= tokens * (past + tokens)


class SdpaSegments(AttentionKernel):
    """sdpa per segment, or a packed row at once with its mask where splitting does not pay (module
    docstring)."""

    name = "sdpa_segments"
    keeps_keys = True

    def attend(self, q, k, v, layout, scale: float, dtype) -> torch.Tensor:
        if layout.split:
            return sdpa_per_segment(*(t.to(dtype) for t in (q, *layout.gather(k, v))), layout, scale)
        query, key, value = (t.to(dtype).transpose(0, 1)[None] for t in (q, k, v))  # (views: [1, H, S, D])
        return sdpa_row(query, key, value, layout, scale)

    def pairs(self, past: int, tokens: int, needed: int) -> int:
        return needed if per_segment_pays(past, tokens, needed) else tokens * (past + tokens)


SDPA_SEGMENTS = SdpaSegments()


def sdpa_per_segment(q, k, v, layout, scale: float) -> torch.Tensor:
    """Each segment's queries ``q`` [T, H, D] against its gathered keys and values ``k``, ``v``
    [sum(k_lens), Hkv, D], causal aligned bottom-right, one sdpa call each."""
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


def sdpa_row(query, key, value, layout, scale: float) -> torch.Tensor:
    """A packed row at once (``query`` [1, H, T, D], ``key``/``value`` [1, Hkv, S, D]) with its tree-shaped
    mask (built once per call, shared by its layers) → [T, H, D]."""
    mask = getattr(layout, "_mask", None)
    if mask is None:
        mask = layout._mask = packed_visible(layout.row, layout.start)[None, None]
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scale, enable_gqa=query.shape[1] != key.shape[1]
    )  # [1, H, T, D]
    return out[0].transpose(0, 1)
