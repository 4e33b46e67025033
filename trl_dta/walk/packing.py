"""Positions and attention mask of a packed row: several segments in one forward on a shared past.

Sibling leaves (children of the same node) are packed side by side, each seeing the past and itself; a packed
subtree puts a trie node and all its descendants in one row, each segment seeing its ancestors in the row (a
tree-shaped causal mask). Only for attention backends that take a custom 4-D additive mask (eager, sdpa) and
models the construction probe finds exact when packed (:mod:`trl_dta.walk.probe`).
"""

from __future__ import annotations

import torch


def packed_inputs(
    lengths: list[int], start: int, dtype, device, parents=None, starts=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [1, T] and additive 4-D mask [1, 1, T, start + T] that pack segments of the given lengths
    into one row on a shared past of ``start`` tokens: each token sees the past, the earlier tokens of its
    own segment and every token of the segment's ancestors. Sibling leaves (``parents`` None): no ancestors,
    positions restart at ``start`` for every leaf. A packed subtree: ``parents[k]`` is segment ``k``'s parent
    index (-1: none in the row; parents come first) and ``starts[k]`` its first position."""
    n = len(lengths)
    segment = torch.repeat_interleave(torch.arange(n, device=device), torch.tensor(lengths, device=device))
    offsets = torch.cat([torch.arange(k, device=device) for k in lengths])
    index = torch.arange(segment.numel(), device=device)
    ancestor = torch.eye(n, dtype=torch.bool, device=device)  # [k, j]: j is k or an ancestor of k
    for k, parent in enumerate(parents or ()):
        if parent >= 0:
            ancestor[k] |= ancestor[parent]
    visible = ancestor[segment][:, segment] & (index[None, :] <= index[:, None])  # ancestors come first
    visible = torch.cat([visible.new_ones(segment.numel(), start), visible], dim=1)
    mask = torch.zeros(visible.shape, dtype=dtype, device=device)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    first = torch.tensor(starts if starts is not None else [start] * n, device=device)
    return (first[segment] + offsets)[None], mask[None, None]
