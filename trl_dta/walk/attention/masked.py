"""The model's own attention, given the walk's masks: the kernel of an ``eager`` model, of an sdpa model
whose calls the construction probe did not find exact per segment, and of a flash-attention model likewise.

A packed row takes a 4-D additive mask (:func:`~trl_dta.walk.attention.packing.packed_mask`) and computes
every pair of its ``tokens x (past + tokens)`` rectangle, masked or not. What it keeps for the backward
beyond its tokens' activations (measured on a GPU, docs/memory.md): sdpa with a mask repeats the K/V heads for
grouped-query attention (``2 q`` values per key position and layer) and keeps the mask (a packed row's in the
activations' dtype, a lone segment's causal mask as bools). A flash-attention model (``takes_masks`` False)
takes no mask: its sibling leaves are forwarded as right-padded rows, never packed, and it keeps nothing
more.
"""

from __future__ import annotations

from .kernel import AttentionKernel
from .packing import packed_mask


class ModelAttention(AttentionKernel):
    """The model's own attention ``implementation`` (module docstring)."""

    per_segment = False

    def __init__(self, implementation: str):
        self.implementation = implementation
        self.takes_masks = implementation in ("eager", "sdpa")
        self.name = f"{implementation}_masked" if self.takes_masks else implementation

    def pairs(self, past: int, tokens: int, needed: int) -> int:
        return tokens * (past + tokens)

    def kept_bytes(self, segments, row: bool, per, config) -> float:
        if not self.takes_masks:
            return 0.0
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        q, kv = heads * head_dim, (getattr(config, "num_key_value_heads", None) or heads) * head_dim
        layers = config.num_hidden_layers
        element = per.key / max(1, 2 * layers * kv)  # (bytes of one value)
        tokens = sum(s.num_tokens for s in segments)
        keys = segments[0].start + tokens
        return (keys * 2 * q * element * layers if q != kv else 0) + tokens * keys * (element if row else 1)

    def row_mask(self, row, start: int, dtype):
        return packed_mask(row, start, dtype)
