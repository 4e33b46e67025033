"""The attention mask of a packed row: several segments in one forward on a shared past.

Sibling leaves (children of the same node) are packed side by side, each seeing the past and itself; a packed
subtree puts trie nodes and all their descendants in one row, each segment seeing its ancestors in the row (a
tree-shaped causal mask). Built on the device from the row's index tensors
(:class:`~trl_dta.walk.inputs.PackedRow`), with shapes known to the host (no synchronisation). Only for
attention backends that take a custom 4-D additive mask (eager, sdpa) and models the construction probe finds
exact when packed (:mod:`trl_dta.walk.probe`).
"""

from __future__ import annotations

import torch

from .inputs import PackedRow


def packed_mask(row: PackedRow, start: int, dtype) -> torch.Tensor:
    """Additive 4-D mask [1, 1, T, start + T] of a packed row on a shared past of ``start`` tokens: each token
    sees the past, the earlier tokens of its own segment and every token of the segment's ancestors (which
    come before it in the row)."""
    segment = row.segment
    index = torch.arange(segment.numel(), device=segment.device)
    visible = row.ancestor[segment][:, segment] & (index[None, :] <= index[:, None])
    visible = torch.cat([visible.new_ones(segment.numel(), start), visible], dim=1)
    mask = torch.zeros(visible.shape, dtype=dtype, device=segment.device)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[None, None]
