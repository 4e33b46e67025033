"""The layout of one call's segments for attention per segment (:class:`SegmentLayout`: per segment its
queries and the cache positions of its keys, as a variable-length kernel takes them), and the plain sdpa
kernels on it (:func:`sdpa_per_segment`, :func:`sdpa_row`). :mod:`trl_dta.walk.attention.segment_attention`
attends with them, or with torch's flash kernel (:mod:`trl_dta.walk.attention.flash`, checked against
:func:`sdpa_per_segment`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F

from ..cost.costs import per_segment_pays
from ..errors import UnsupportedModelError
from .packing import PackedRow, packed_visible

ATTENTION = "trl_dta_segments"  # the attention function's name in transformers' AttentionInterface


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
        """Refuse a call whose model did not attend through the registered function
        (:func:`~trl_dta.walk.attention.segment_attention.attention`) once per attention layer."""
        if self.calls != layers:
            raise UnsupportedModelError(
                f"{name}: {self.calls} of its {layers} attention layers called transformers' attention "
                f"function {ATTENTION!r}; a model with its own attention code cannot attend per segment."
            )


def sdpa_per_segment(q, k, v, layout: SegmentLayout, scale: float) -> torch.Tensor:
    """Each segment's queries ``q`` [T, H, D] against its gathered keys and values ``k``, ``v``
    [sum(k_lens), Hkv, D] (:meth:`SegmentLayout.gather`), causal aligned bottom-right, through sdpa: the CPU
    path, and the reference the flash kernel is checked against."""
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


def sdpa_row(query, key, value, layout: SegmentLayout, scale: float) -> torch.Tensor:
    """A packed row at once, with its tree-shaped mask (built once per call, shared by its layers)."""
    mask = getattr(layout, "_mask", None)
    if mask is None:
        mask = layout._mask = packed_visible(layout.row, layout.start)[None, None]
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scale, enable_gqa=query.shape[1] != key.shape[1]
    )  # [1, H, T, D]
    return out[0].transpose(0, 1)
