"""Attention per segment inside a packed row, for sdpa on a CPU.

A packed row's 4-D mask (:func:`~trl_dta.walk.packing.packed_mask`) makes sdpa compute every query-key pair
of the row's rectangle, though each segment sees only the shared past, its ancestors in the row and itself.
On a CPU that rectangle is the walk's cost where a step shares little: eight unrelated samples packed in one
row of ~390 tokens took ~33 ms of attention a step where TRL's packing, which attends per segment, took ~12
ms (docs/cost-model.md). While the walk forwards such a row, :class:`SegmentAttention` computes each sdpa
call that takes the row's mask one segment at a time: the segment's queries against only the keys it may
see, with the same mask's entries for them. The keys it leaves out are masked for every query of the
segment, so the result is the same attention (up to the kernel's summation order). A row is split where
that computes at most half its rectangle (:func:`~trl_dta.walk.costs.per_segment_pays`, which the cost model
prices by too): each segment's keys other than its own are copied, which costs about what a few skipped pairs
save.

The walk matches the call by its mask (the same storage, the row's shape), so a model that builds another
mask from it, or attends without sdpa, computes the rectangle as before: exact either way. Used on a CPU
only: on a GPU a call per segment and layer costs a kernel launch each, and flex attention
(:func:`~trl_dta.walk.packing.packed_block_mask`) computes only the tiles that hold a visible pair.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode


def segment_keys(lengths: list[int], parents: tuple[int, ...], start: int) -> list[tuple[slice, object]]:
    """For each segment of a packed row of ``lengths`` (``parents[k]``: the index of segment ``k``'s parent in
    the row, -1 for the shared past; parents come first) on a past of ``start`` tokens: its queries (a slice
    of the row) and the keys it sees (the past, its ancestors' tokens and its own, as a slice of the row's
    keys where they are contiguous, else an index tensor)."""
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    out = []
    for k in range(len(lengths)):
        chain, j = [], k
        while j >= 0:
            chain.append(j)
            j = parents[j]
        ranges: list[list[int]] = [[0, start]] if start else []
        for j in reversed(chain):  # in row order: ancestors come before their descendants
            lo, hi = start + offsets[j], start + offsets[j + 1]
            if ranges and ranges[-1][1] == lo:
                ranges[-1][1] = hi
            else:
                ranges.append([lo, hi])
        if len(ranges) == 1:
            keys = slice(*ranges[0])
        else:
            keys = torch.cat([torch.arange(lo, hi) for lo, hi in ranges])
        out.append((slice(offsets[k], offsets[k + 1]), keys))
    return out


class SegmentAttention(TorchFunctionMode):
    """Within ``with SegmentAttention(mask, keys):``, an sdpa call whose ``attn_mask`` is ``mask`` (the row's
    [1, 1, T, start + T] additive mask, or a view of it) runs once per segment of ``keys``
    (:func:`segment_keys`); any other call runs as given. ``calls``: how many calls it split."""

    def __init__(self, mask: torch.Tensor, keys: list[tuple[slice, object]]):
        super().__init__()
        self._mask = mask  # (held: its storage identifies the row's sdpa calls)
        self._shape = tuple(mask.shape[-2:])
        self._keys = [(q, k.to(mask.device) if isinstance(k, torch.Tensor) else k) for q, k in keys]
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is not F.scaled_dot_product_attention or len(args) < 3:
            return func(*args, **kwargs)
        query, key, value, *rest = args
        mask = rest.pop(0) if rest else kwargs.pop("attn_mask", None)
        if not self._is_row(mask, query, key):
            return func(query, key, value, mask, *rest, **kwargs)
        self.calls += 1
        out = []
        for q, k in self._keys:
            if isinstance(k, slice):
                part = (key[..., k, :], value[..., k, :], mask[..., q, k])
            else:
                part = (
                    key.index_select(-2, k),
                    value.index_select(-2, k),
                    mask[..., q, :].index_select(-1, k),
                )
            out.append(func(query[..., q, :], part[0], part[1], part[2], *rest, **kwargs))
        return torch.cat(out, dim=-2)

    def _is_row(self, mask, query: torch.Tensor, key: torch.Tensor) -> bool:
        return (
            isinstance(mask, torch.Tensor)
            and mask.data_ptr() == self._mask.data_ptr()  # (the row's mask or a slice of it from its start)
            and mask.untyped_storage().data_ptr() == self._mask.untyped_storage().data_ptr()
            and mask.stride()[-2:] == self._mask.stride()[-2:]
            and tuple(mask.shape[-2:]) == self._shape
            and (query.shape[-2], key.shape[-2]) == self._shape
        )
