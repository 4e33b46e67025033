"""Attention per segment (trl_dta/walk/attention/segment_attention.py, segment_layout.py): each segment
against only the keys it sees.

Every kernel of it against the row's masked sdpa call (fp64, random rows, GQA or not): the sdpa kernel per
segment and per row, and the flash kernels with a stand-in of their functions (trl_dta/testing/varlen.py:
the CUDA path's layout, run on a CPU; torch 2.11's and 2.12's signatures, flash-attn's). Then whole walks
against dense per-sequence gradients on the flash kernels, and the probe's fallback for a model with its own
attention code.
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch
from conftest import dense_grads, grads_of, make_model, max_rel_diff
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_executor import loss_fn_for, shared_prefix_sequences
from torch.nn import functional as F

from trl_dta import PrefixTrie, TreeExecutor
from trl_dta.testing.varlen import (
    counted_varlen_attn,
    flash_attn_on_cpu,
    flash_on_cpu,
    reference_varlen_attn,
    reference_varlen_attn_gqa,
)
from trl_dta.walk.attention import check
from trl_dta.walk.attention import segment_attention as sa
from trl_dta.walk.attention.packing import PackedRow, packed_mask
from trl_dta.walk.attention.sdpa import SDPA_SEGMENTS
from trl_dta.walk.attention.segment_layout import SegmentLayout, key_ranges
from trl_dta.walk.attention.torch_varlen import TORCH_VARLEN, TorchVarlen
from trl_dta.walk.cost.costs import CallCost

pytestmark = pytest.mark.usefixtures("fp64_exact")
KERNELS = {
    "sdpa per segment": SDPA_SEGMENTS,
    "sdpa row": SDPA_SEGMENTS,
    "flash 2.11": flash_on_cpu(reference_varlen_attn),
    "flash 2.12": flash_on_cpu(reference_varlen_attn_gqa),
    "flash-attn": flash_attn_on_cpu(),
}
FLASH = ["flash 2.11", "flash 2.12", "flash-attn"]


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


def attend(kernel, layout, q, k, v):
    """The registered attention function on ``layout`` with the kernel named ``kernel``."""
    layout.split, layout.kernel = kernel != "sdpa row", KERNELS[kernel]
    with sa.attending(make_model().config, layout):
        out, weights = sa.attention(None, q, k, v, None, scaling=0.3)
    assert weights is None and layout.calls == 1 and layout.ran == KERNELS[kernel].name
    return out  # [1, T, H, D]


@pytest.mark.parametrize("kernel", KERNELS)
@settings(max_examples=40, deadline=None)
@given(row=packed_rows(), gqa=st.booleans())
def test_each_kernel_equals_the_rows_masked_call(kernel, row, gqa):
    lengths, parents, start = row
    tokens = sum(lengths)
    gen = torch.Generator().manual_seed(tokens * 31 + start)
    q = torch.randn(1, 4, tokens, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    buffer = torch.randn(2, 1, 2 if gqa else 4, start + tokens + 3, 8, dtype=torch.float64, generator=gen)
    k, v = (b[..., : start + tokens, :].requires_grad_() for b in buffer.clone().unbind())  # (strided)
    mask = packed_mask(row_of(lengths, parents, start), start, torch.float64)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=gqa)
    ref = torch.autograd.grad(want.square().sum(), (q, k, v))
    layout = SegmentLayout.build(lengths, parents, start, "cpu", row=row_of(lengths, parents, start))
    got = attend(kernel, layout, q, k, v)
    torch.testing.assert_close(got, want.transpose(1, 2), rtol=0, atol=1e-12)
    for a, b in zip(torch.autograd.grad(got.square().sum(), (q, k, v)), ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_keys_are_the_past_the_ancestors_and_the_segment():
    # segments 0 (on the past), 1 (child of 0), 2 (on the past): a past of 3 tokens
    assert key_ranges([2, 3, 1], (-1, 0, -1), 3) == [[(0, 5)], [(0, 8)], [(0, 3), (8, 9)]]
    q_cu, k_cu, index, k_lens, _ = SegmentLayout.host([2, 3, 1], (-1, 0, -1), 3)
    assert q_cu.tolist() == [0, 2, 5, 6] and k_lens == [5, 8, 4] and k_cu.tolist() == [0, 5, 13, 17]
    assert index.tolist() == [0, 1, 2, 3, 4] + list(range(8)) + [0, 1, 2, 8]
    q_cu, k_cu, index, _, split = SegmentLayout.host([4], (-1,), 6)  # a push reads the buffer in place
    assert index is None and k_cu.tolist() == [0, 10] and split


def test_a_row_is_split_where_that_computes_at_most_half_its_rectangle():
    assert SegmentLayout.host([1, 1, 1], (-1, -1, -1), 100)[4] is False  # each sees the past: whole row
    assert SegmentLayout.host([50, 50], (-1, -1), 0)[4] is True


def test_the_counted_kernel_is_the_reference_kernel_forward_and_backward():
    gen = torch.Generator().manual_seed(0)
    layout = SegmentLayout.build([3, 5, 2], (-1, 0, -1), 4, "cpu")
    q = torch.randn(10, 4, 8, dtype=torch.float64, generator=gen)
    k, v = (torch.randn(14, 2, 8, dtype=torch.float64, generator=gen) for _ in range(2))
    k, v = (t.index_select(0, layout.key_index) for t in (k, v))
    outs = []
    for kernel in (reference_varlen_attn, counted_varlen_attn):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        longest = max(layout.q_lens), max(layout.k_lens)
        out = kernel(*inputs, layout.q_cu, layout.k_cu, *longest, scale=0.4, window_size=(-1, 0))
        outs.append([out, *torch.autograd.grad(out.sin().sum(), inputs)])
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


# ---------------------------------------------------------------------- walks
@pytest.mark.parametrize("kernel", FLASH)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seqs=shared_prefix_sequences(),
    block_size=st.sampled_from([2, 5, 1000]),
    batch_tokens=st.sampled_from([0, 7, None]),
    merge_all=st.booleans(),
)
def test_the_flash_path_walks_exactly(kernel, seqs, block_size, batch_tokens, merge_all):
    """The CUDA path's layout (pushes, recomputed pops, lone leaves, packed leaves and subtrees), its kernel
    stood in for, against dense per-sequence gradients in float64."""
    model = make_model("qwen3", "sdpa")
    loss_fn = loss_fn_for(seqs, use_entropy=True)
    ref, _ = dense_grads(model, seqs, loss_fn)
    executor = TreeExecutor(
        model, block_size=block_size, batch_tokens=batch_tokens, attention_kernel=KERNELS[kernel]
    )
    if merge_all:  # only calls cost: leaves and subtrees merged as the budgets allow
        executor.call_cost = CallCost(fixed=1.0, per_token=0.0, per_pair=0.0)
    model.zero_grad(set_to_none=True)
    executor.backward(PrefixTrie.from_sequences(seqs), loss_fn, entropies=True)
    assert executor.lm.segment_attention and executor.lm.kernel is KERNELS[kernel]
    assert set(executor.calls.attention) == {KERNELS[kernel].name}  # (every call, by this kernel)
    assert max_rel_diff(grads_of(model), ref) < 1e-10


def test_every_call_of_a_walk_attends_per_segment(monkeypatch):
    seen = []
    original = sa.attention

    def spy(module, query, *args, **kwargs):
        seen.append(sa._ACTIVE.get())
        return original(module, query, *args, **kwargs)

    monkeypatch.setattr(sa, "attention", spy)
    sa.register()
    try:
        model = make_model("qwen3", "sdpa")
        seqs = [[5, 6, 7, 8, 9], [5, 6, 7, 3, 4, 2], [5, 6, 1, 1], [9, 8, 7], [9, 8, 2, 2, 2]]
        executor = TreeExecutor(model, block_size=1000)
        seen.clear()
        executor.backward(PrefixTrie.from_sequences(seqs), lambda i, lp, e: lp.sum())
    finally:
        monkeypatch.undo()
        sa.register()
    layers = model.config.num_hidden_layers
    assert len(seen) == executor.calls.forward * layers and all(layout is not None for layout in seen)


def test_a_model_with_its_own_attention_code_attends_with_a_mask(monkeypatch, caplog):
    """A model whose layers do not call transformers' attention functions: the probe finds that the walk's
    function is not called, and the walk runs the model's own attention with a mask, exactly."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.qwen3 import modeling_qwen3

    interface = modeling_qwen3.ALL_ATTENTION_FUNCTIONS
    monkeypatch.setattr(type(interface), "get_interface", lambda self, name, default: sdpa_attention_forward)
    model = make_model("qwen3", "sdpa")
    seqs = [[5, 6, 7, 8, 9], [5, 6, 7, 3, 4, 2], [5, 6, 1, 1]]
    loss_fn = loss_fn_for(seqs, use_entropy=False)
    ref, _ = dense_grads(model, seqs, loss_fn)
    with caplog.at_level(logging.INFO):
        executor = TreeExecutor(model, block_size=1000)
    assert not executor.lm.segment_attention and executor.lm.can_pack
    assert "per segment it fails" in caplog.text
    model.zero_grad(set_to_none=True)
    executor.backward(PrefixTrie.from_sequences(seqs), loss_fn)
    assert max_rel_diff(grads_of(model), ref) < 1e-10


def test_eager_models_attend_with_a_mask():
    assert not TreeExecutor(make_model("qwen3", "eager")).lm.segment_attention
    assert TreeExecutor(make_model("qwen3", "sdpa")).lm.segment_attention


def test_a_flash_kernel_that_differs_is_not_used(caplog):
    def top_left_causal(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=None):
        # (aligned top-left: wrong for a segment on a past)
        n = query.shape[0]
        return reference_varlen_attn(
            query, key[:n], value[:n], cu_seq_q, cu_seq_q, max_q, max_q, scale=scale, window_size=window_size
        )

    cpu = torch.device("cpu")
    assert check.passes(TorchVarlen(reference_varlen_attn), cpu, torch.bfloat16, (4, 2, 8))
    broken = TorchVarlen(top_left_causal, devices=("cpu",))  # (checked as on CUDA)
    with caplog.at_level(logging.WARNING):
        assert broken.resolve(cpu, torch.bfloat16, (4, 2, 8)) is SDPA_SEGMENTS
    assert "sdpa instead" in caplog.text
    assert broken.resolve(cpu, torch.float32, (4, 2, 8)) is SDPA_SEGMENTS  # (fp32: sdpa, not a flash kernel)
    assert TORCH_VARLEN.resolve(cpu, torch.bfloat16, (4, 2, 8)) is SDPA_SEGMENTS  # (torch's: CUDA only)


def test_the_attention_function_refuses_what_it_does_not_apply():
    layout = SegmentLayout.build([3], (-1,), 0, "cpu")
    q = k = v = torch.randn(1, 2, 3, 4)
    with sa.attending(make_model().config, layout):
        with pytest.raises(sa.UnsupportedModelError, match="sliding_window"):
            sa.attention(None, q, k, v, None, sliding_window=2)
        with pytest.raises(sa.UnsupportedModelError, match="dropout"):
            sa.attention(None, q, k, v, None, dropout=0.1)
    with pytest.raises(RuntimeError, match="outside a walk"):
        sa.attention(None, q, k, v, None)


def test_a_packed_row_is_priced_at_the_pairs_its_segments_see():
    config = make_model().config
    cpu = CallCost.for_model(config, "cpu", SDPA_SEGMENTS)
    assert cpu.row_pairs(3, 10, 65) == 65  # half of 10 x 13: split
    assert cpu.row_pairs(3, 10, 66) == 130  # (the rectangle: not split on a CPU)
    assert CallCost.for_model(config, "cuda", TORCH_VARLEN).row_pairs(3, 10, 66) == 66  # (varlen)
    assert CallCost.for_model(config, "cpu").row_pairs(3, 10, 40) == 10 * 13  # (no kernel: the rectangle)


def test_under_autocast_over_float32_weights_the_flash_path_attends_in_autocasts_dtype():
    """TRL's bf16 mixed precision: float32 weights under autocast, where queries and keys leave their norms
    and RoPE in float32. The function attends in autocast's dtype, as sdpa does under autocast, so the flash
    kernel runs (it takes bf16/fp16 only), and the walk agrees with the sdpa path to bf16 rounding."""
    seen = []

    @functools.wraps(reference_varlen_attn)
    def kernel(query, key, value, *args, **kwargs):
        seen.append((query.dtype, key.dtype, value.dtype))
        return reference_varlen_attn(query, key, value, *args, **kwargs)

    model = make_model("qwen3", "sdpa", dtype=torch.float32)
    seqs = [[5, 6, 7, 8, 9, 3, 3], [5, 6, 7, 3, 4, 2], [5, 6, 1, 1, 2], [9, 8, 7, 6]]
    trie = PrefixTrie.from_sequences(seqs)
    grads, flash_calls = [], []
    for flash in (True, False):
        executor = TreeExecutor(
            model, block_size=1000, attention_kernel=flash_on_cpu(kernel) if flash else None
        )
        seen.clear()  # (the probe runs in float32, autocast off)
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            executor.backward(trie, lambda i, lp, e: lp.float().sum())
        grads.append(grads_of(model))
        flash_calls = flash_calls if not flash else list(seen)
    assert not seen  # (the sdpa path ran last)
    assert flash_calls and set(flash_calls) == {(torch.bfloat16,) * 3}
    assert max_rel_diff(*grads) < 3e-2
