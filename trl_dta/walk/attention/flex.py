"""Flex attention with a block-sparse mask: the kernel of a model loaded with
``attn_implementation="flex_attention"`` (CUDA only: torch's flex attention has no CPU backward).

Every call takes a ``BlockMask`` (:mod:`~trl_dta.walk.attention.packing`: a packed row's tree-shaped one, a
lone row's causal one built by the walk, so that transformers compiles none per shape), and computes only the
128 x 128 tiles that hold a visible pair: about the pairs the tree needs plus a tile's width per query. It
keeps nothing for the backward beyond its tokens' activations.
"""

from __future__ import annotations

from .kernel import AttentionKernel
from .packing import causal_block_mask, packed_block_mask

TILE = 128  # flex attention's default block size: a block-sparse row computes up to a tile past what it needs


class FlexTiles(AttentionKernel):
    """Flex attention's tiles (module docstring)."""

    name = "flex_tiles"
    per_segment = False

    def pairs(self, past: int, tokens: int, needed: int) -> int:
        return min(needed + tokens * TILE, tokens * (past + tokens))

    def row_mask(self, row, start: int, dtype):
        return packed_block_mask(row, start)

    def causal_mask(self, tokens: int, start: int, device):
        return causal_block_mask(tokens, start, device)


FLEX_TILES = FlexTiles()
