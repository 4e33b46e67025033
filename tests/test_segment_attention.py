"""Attention per segment in a packed row (sdpa on a CPU): the same values and gradients as the row's masked
sdpa call, and taken by the walk where it packs."""

from __future__ import annotations

import pytest
import torch
from conftest import dense_grads, grads_of, make_model, max_rel_diff
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import functional as F

from trl_dta import PrefixTrie, TreeExecutor
from trl_dta.walk import model as walk_model
from trl_dta.walk.costs import CallCost
from trl_dta.walk.inputs import PackedRow
from trl_dta.walk.packing import packed_mask
from trl_dta.walk.segment_attention import SegmentAttention, segment_keys

pytestmark = pytest.mark.usefixtures("fp64_exact")


@st.composite
def packed_rows(draw):
    """Segment lengths, each segment's parent in the row (-1: the past; parents come first), a past."""
    n = draw(st.integers(1, 6))
    lengths = draw(st.lists(st.integers(1, 7), min_size=n, max_size=n))
    parents = tuple(draw(st.integers(-1, k - 1)) for k in range(n))
    return lengths, parents, draw(st.integers(0, 5))


def row_of(lengths, parents, start):
    n = len(lengths)
    ancestor = torch.eye(n, dtype=torch.bool)
    for k, parent in enumerate(parents):
        if parent >= 0:
            ancestor[k] |= ancestor[parent]
    segment = torch.cat([torch.full((m,), k) for k, m in enumerate(lengths)])
    return PackedRow(torch.zeros_like(segment), segment, ancestor)


@settings(max_examples=60, deadline=None)
@given(row=packed_rows(), gqa=st.booleans())
def test_per_segment_equals_the_rows_masked_call(row, gqa):
    lengths, parents, start = row
    tokens = sum(lengths)
    gen = torch.Generator().manual_seed(tokens * 31 + start)
    q = torch.randn(1, 4, tokens, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    k, v = (
        torch.randn(
            1, 2 if gqa else 4, start + tokens, 8, dtype=torch.float64, generator=gen
        ).requires_grad_()
        for _ in range(2)
    )
    mask = packed_mask(row_of(lengths, parents, start), start, torch.float64)[..., : start + tokens]
    extra = {"enable_gqa": True} if gqa else {}
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **extra)
    ref = torch.autograd.grad(want.square().sum(), (q, k, v))
    with SegmentAttention(mask, segment_keys(lengths, parents, start)) as attend:
        got = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **extra)
    assert attend.calls == 1
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for a, b in zip(torch.autograd.grad(got.square().sum(), (q, k, v)), ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_keys_are_the_past_the_ancestors_and_the_segment():
    # segments 0 (on the past), 1 (child of 0), 2 (on the past): a past of 3 tokens
    keys = segment_keys([2, 3, 1], (-1, 0, -1), 3)
    assert [q for q, _ in keys] == [slice(0, 2), slice(2, 5), slice(5, 6)]
    assert keys[0][1] == slice(0, 5) and keys[1][1] == slice(0, 8)
    assert keys[2][1].tolist() == [0, 1, 2, 8]
    assert segment_keys([4], (-1,), 0) == [(slice(0, 4), slice(0, 4))]


def test_other_calls_run_as_given():
    q, k, v = (torch.randn(1, 2, 5, 4) for _ in range(3))
    mask = packed_mask(PackedRow.siblings([2, 3], 0, "cpu"), 0, torch.float32)
    with SegmentAttention(mask, segment_keys([2, 3], (-1, -1), 0)) as attend:
        causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        other = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.clone())
    assert attend.calls == 0
    torch.testing.assert_close(causal, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    torch.testing.assert_close(other, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


@pytest.mark.parametrize("attn,split", [("sdpa", True), ("eager", False)])
def test_the_walk_attends_per_segment_with_sdpa_on_a_cpu(monkeypatch, attn, split):
    seen = []

    class Spy(SegmentAttention):
        def __init__(self, *args):
            super().__init__(*args)
            seen.append(self)

    monkeypatch.setattr(walk_model, "SegmentAttention", Spy)
    model = make_model("qwen3", attn)
    seqs = [[5, 6, 7, 8, 9], [5, 6, 7, 3, 4, 2], [5, 6, 1, 1], [9, 8, 7], [9, 8, 2, 2, 2]]

    def loss_fn(i, logps, entropies):
        return (logps * torch.linspace(-1, 1, logps.numel(), dtype=logps.dtype)).sum()

    ref, _ = dense_grads(model, seqs, loss_fn, 1.0)
    executor = TreeExecutor(model, block_size=1000, pack_leaves=True)
    executor.call_cost = CallCost(fixed=1.0, per_token=0.0, per_pair=0.0)  # merge what the budgets allow
    model.zero_grad(set_to_none=True)
    executor.backward(PrefixTrie.from_sequences(seqs), loss_fn)
    assert max_rel_diff(grads_of(model), ref) < 1e-10
    assert executor.lm.per_segment is split
    assert bool(seen) is split and sum(s.calls for s in seen) == (len(model.model.layers) * len(seen))


def test_a_packed_row_is_priced_at_the_pairs_its_segments_see():
    config = make_model().config
    per_segment = CallCost.for_model(config, "cpu", per_segment=True)
    assert per_segment.row_pairs(3, 10, 40) == 40
    assert CallCost.for_model(config, "cpu").row_pairs(3, 10, 40) == 10 * 13


def test_a_row_is_split_where_that_computes_at_most_half_its_rectangle():
    config = make_model().config
    costs = CallCost.for_model(config, "cpu", per_segment=True)
    assert costs.row_pairs(3, 10, 65) == 65  # half of 10 x 13
    assert costs.row_pairs(3, 10, 66) == 130  # (the rectangle: not split)
