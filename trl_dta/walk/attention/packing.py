"""The attention mask of a packed row: several segments in one forward on a shared past.

Sibling leaves (children of the same node) are packed side by side, each seeing the past and itself; a packed
subtree puts trie nodes and all their descendants in one row, each segment seeing its ancestors in the row (a
tree-shaped causal mask). Built on the device from the row's index tensors (:class:`PackedRow`, made for a
whole walk by :class:`~trl_dta.walk.inputs.WalkInputs`), with shapes known to the host (no
synchronisation): a 4-D additive mask for eager and sdpa attention, which compute every pair of the row's
rectangle (sdpa on a CPU attends per segment instead: :mod:`~trl_dta.walk.attention.segment_attention`), or a
block-sparse ``BlockMask`` for flex attention, which computes only the tiles holding a visible pair. Only for
models the construction probe finds exact when packed (:mod:`trl_dta.walk.adapter.probe`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedRow:
    """A packed row's index tensors on the device: ``positions`` [T], ``segment`` [T] (each token's segment
    in the row) and ``ancestor`` [n, n] (bool: ``[k, j]`` when segment ``j`` is ``k`` or an ancestor of
    ``k`` in the row)."""

    positions: torch.Tensor
    segment: torch.Tensor
    ancestor: torch.Tensor

    @classmethod
    def siblings(cls, lengths: list[int], start: int, device) -> PackedRow:
        """Sibling leaves of the given lengths on a past of ``start`` tokens, built here (the probe's row)."""
        positions = torch.cat([torch.arange(start, start + n) for n in lengths])
        segment = torch.cat([torch.full((n,), k) for k, n in enumerate(lengths)])
        ancestor = torch.eye(len(lengths), dtype=torch.bool)
        return cls(positions.to(device), segment.to(device), ancestor.to(device))


def packed_visible(row: PackedRow, start: int) -> torch.Tensor:
    """Which keys each token of a packed row on a shared past of ``start`` tokens sees, [T, start + T] (bool):
    the past, the earlier tokens of its own segment and every token of the segment's ancestors (which come
    before it in the row)."""
    segment = row.segment
    index = torch.arange(segment.numel(), device=segment.device)
    visible = row.ancestor[segment][:, segment] & (index[None, :] <= index[:, None])
    return torch.cat([visible.new_ones(segment.numel(), start), visible], dim=1)


def packed_mask(row: PackedRow, start: int, dtype) -> torch.Tensor:
    """The same as an additive 4-D mask [1, 1, T, start + T] in ``dtype``, for the model's own attention."""
    visible = packed_visible(row, start)
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[None, None]


def packed_block_mask(row: PackedRow, start: int):
    """The same mask as a flex attention ``BlockMask`` (``attn_implementation="flex_attention"``): its
    ``mask_mod`` reads the row's index tensors, and flex attention computes only the 128 x 128 tiles that
    hold a visible pair, about the pairs the tree needs instead of the row's whole rectangle."""
    segment, ancestor = row.segment, row.ancestor
    past = _scalar(start, segment.device)

    def mask_mod(batch, head, q, kv):
        k = (kv - past).clamp(min=0)  # the key's index in the row (the past: any, masked below)
        return (kv < past) | (ancestor[segment[q], segment[k]] & (k <= q))

    return _block_mask(mask_mod, segment.numel(), start, segment.device)


def causal_block_mask(tokens: int, start: int, device):
    """Flex attention's mask of one row (or right-padded rows) of ``tokens`` on a past of ``start``: each
    token sees the past and the tokens before it. The walk passes its own, so that transformers builds none
    (its builder compiles, once per shape)."""

    past = _scalar(start, device)

    def mask_mod(batch, head, q, kv):
        return kv <= q + past

    return _block_mask(mask_mod, tokens, start, device)


def _scalar(value: int, device) -> torch.Tensor:
    """``value`` as a 0-d device tensor (a fill kernel, no copy): a ``mask_mod`` that captured a Python int
    would make flex attention's compiled kernel recompile for every value."""
    return torch.full((), value, dtype=torch.long, device=device)


def _block_mask(mask_mod, tokens: int, start: int, device):
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(mask_mod, None, None, tokens, start + tokens, device=device)
