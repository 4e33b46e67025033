"""One model call of the walk, on the walk's path: a segment (:func:`forward`), or several rows at once
(:func:`forward_padded`: sibling leaves as a right-padded batch; :func:`forward_packed`: sibling leaves or a
packed subtree as one row). The last two return the hidden states per row, padding dropped, and (when the
walk reads router logits) each row's router logits per router layer.
"""

from __future__ import annotations

import torch

from .adapter.model import CausalLM, ForwardResult
from .plan import PackedSubtree, SiblingLeaves
from .state import Walk


def forward(lm: CausalLM, walk: Walk, ids: torch.Tensor, start: int, **packing) -> ForwardResult:
    """Forward ``ids`` [B, L] at cache position ``start`` on the walk's path (``packing``: the packed row's
    positions and attention mask, or the call's layout where it attends per segment)."""
    states = walk.states(ids.shape[0])
    walk.calls.forward += 1
    walk.calls.tokens += ids.numel()
    out = lm.forward(ids, start, walk.kv, states, router_logits=walk.router is not None, **packing)
    layout = packing.get("layout")
    walk.calls.attention[layout.ran if layout is not None else lm.kernel.name] += 1
    walk.lockstep.forward(out.caches)
    return out


def forward_padded(lm: CausalLM, walk: Walk, ids: list[torch.Tensor], start: int, layout=None):
    """Rows as a right-padded batch (causal attention keeps padding invisible to real tokens); ``layout``: a
    lone row's, where it attends per segment."""
    lengths = [t.numel() for t in ids]
    if len(ids) == 1 and layout is not None:
        hidden, _, routers = forward(lm, walk, ids[0][None], start, layout=layout)
        return [hidden[0]], [routers]
    width = max(lengths)
    if lm.has_states and walk.stack:  # never a one-token forward on a carried state: pad one more
        width = max(width, 2)
    batch = torch.zeros(len(ids), width, dtype=torch.long, device=lm.device)
    for row, t in enumerate(ids):
        batch[row, : lengths[row]] = t
    hidden, _, routers = forward(lm, walk, batch, start)
    per_row = [None] * len(ids)
    if routers is not None:  # each [B * width, E], row-major
        per_row = [[r.view(len(ids), width, -1)[row, :n] for r in routers] for row, n in enumerate(lengths)]
    return [hidden[row, :n] for row, n in enumerate(lengths)], per_row


def forward_packed(lm: CausalLM, walk: Walk, ids: list[torch.Tensor], start: int, step):
    """Sibling leaves, or the segments of a subtree, packed into one row: each token attends the shared past,
    the earlier tokens of its own segment and its segment's ancestors in the row (a tree-shaped causal mask),
    at its own position (restarting at ``start`` for every sibling leaf). No padding, and the past K/V is not
    replicated per row."""
    assert isinstance(step, SiblingLeaves | PackedSubtree)
    lengths = [t.numel() for t in ids]
    row = walk.inputs.row(step)  # (built on the host with the walk's other index tensors)
    layout = walk.inputs.layout(step)  # (attention per segment: no mask, segment_attention.py)
    mask = None if layout is not None else lm.kernel.row_mask(row, start, lm.lm_head.weight.dtype)
    hidden, _, routers = forward(
        lm,
        walk,
        torch.cat(ids)[None],
        start,
        positions=row.positions[None],
        attention_mask=mask,
        layout=layout,
    )
    per_row = [None] * len(ids)
    if routers is not None:  # each [total, E]
        per_row = [list(rows) for rows in zip(*(r.split(lengths) for r in routers), strict=True)]
    return list(hidden[0].split(lengths)), per_row
