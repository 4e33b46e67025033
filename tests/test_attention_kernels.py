"""The attention-kernel interface (trl_dta/walk/attention/kernel.py): one object the dispatch, the plan, the
memory model and the cost model all ask, chosen by the model's attn_implementation or given to the executor.

A kernel added as one class walks exactly (fp64 against dense per-sequence gradients) and is what the plan
prices and the metrics name; each attn_implementation gets its kernel; a model loaded with
flash_attention_2 attends per segment (flash-attn's kernel, stood in for on a CPU) with packed rows; the
kernel a walk resolves is the one its calls run.
"""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import dense_grads, grads_of, make_model, max_rel_diff
from hypothesis import HealthCheck, given, settings
from test_executor import loss_fn_for, shared_prefix_sequences

from trl_dta import PrefixTrie, TreeExecutor
from trl_dta.testing.varlen import flash_attn_on_cpu
from trl_dta.walk.attention.flash_attn_varlen import FlashAttnVarlen
from trl_dta.walk.attention.kernel import AttentionKernel
from trl_dta.walk.attention.kernels import model_kernel, named
from trl_dta.walk.attention.masked import ModelAttention
from trl_dta.walk.attention.sdpa import SDPA_SEGMENTS
from trl_dta.walk.attention.torch_varlen import TORCH_VARLEN
from trl_dta.walk.cost.costs import CallCost, needed_pairs
from trl_dta.walk.memory.memory_model import activation_bytes, plan_peak
from trl_dta.walk.scoring import scored_from

pytestmark = pytest.mark.usefixtures("fp64_exact")
SEQS = [[5, 6, 7, 8, 9, 3], [5, 6, 7, 3, 4, 2, 2], [5, 6, 1, 1], [5, 6, 1, 2, 9], [9, 8, 7]]


# ---------------------------------------------------------------------- a kernel added as one class
class EinsumSegments(AttentionKernel):
    """What adding a kernel takes (docs/development.md, "Add a kernel"): a name, how it attends each segment
    of a call (here: scores written out, causal aligned bottom-right), the pairs it computes (the default:
    those the tree needs) and what it keeps (the default: nothing beyond its tokens')."""

    name = "einsum_segments"

    def attend(self, q, k, v, layout, scale, dtype):
        k, v = layout.gather(k, v)
        groups = q.shape[1] // k.shape[1]
        out, q0, k0 = [], 0, 0
        for n, m in zip(layout.q_lens, layout.k_lens, strict=True):
            kk, vv = (t[k0 : k0 + m].repeat_interleave(groups, dim=1) for t in (k, v))
            scores = torch.einsum("nhd,mhd->hnm", q[q0 : q0 + n], kk) * scale
            visible = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n)
            out.append(torch.einsum("hnm,mhd->nhd", scores.masked_fill(~visible, -torch.inf).softmax(-1), vv))
            q0, k0 = q0 + n, k0 + m
        return torch.cat(out)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seqs=shared_prefix_sequences())
def test_a_kernel_added_as_one_class_walks_exactly_and_is_what_the_walk_names(seqs):
    model = make_model("qwen3", "sdpa")
    loss_fn = loss_fn_for(seqs, use_entropy=True)
    ref, _ = dense_grads(model, seqs, loss_fn)
    kernel = EinsumSegments()
    executor = TreeExecutor(model, block_size=5, batch_tokens=12, attention_kernel=kernel)
    model.zero_grad(set_to_none=True)
    executor.backward(PrefixTrie.from_sequences(seqs), loss_fn, entropies=True)
    assert executor.lm.kernel is kernel and executor.lm.walk_kernel() is kernel
    assert set(executor.calls.attention) == {"einsum_segments"}  # (every call: the layout's kernel ran)
    assert max_rel_diff(grads_of(model), ref) < 1e-10


def test_the_plan_and_the_memory_model_price_the_kernel_the_calls_run():
    config, trie = make_model().config, PrefixTrie.from_sequences(SEQS)
    nodes = [n for n in trie.nodes() if n.num_tokens]
    past, tokens = 4, 12
    needed = needed_pairs(nodes)
    for kernel, pairs in ((EinsumSegments(), needed), (ModelAttention("eager"), tokens * (past + tokens))):
        assert CallCost.for_model(config, "cpu", kernel).row_pairs(past, tokens, needed) == pairs
    executor = TreeExecutor(make_model("qwen3", "sdpa"), block_size=1000, batch_tokens=1000)
    plan = executor.plan(trie, kernel=SDPA_SEGMENTS)
    per = activation_bytes(config, torch.float64)
    froms = scored_from(trie, None)[1]
    kept = plan_peak(plan, config, per, froms, SDPA_SEGMENTS).graphs  # (a packed row's gathered keys kept)
    assert kept > plan_peak(plan, config, per, froms, EinsumSegments()).graphs


# ---------------------------------------------------------------------- each model's kernel
def test_each_attn_implementation_gets_its_kernel():
    assert model_kernel("sdpa") is TORCH_VARLEN
    assert model_kernel("flash_attention_2").name == "flash_attn_varlen"
    assert model_kernel("flash_attention_3").name == "flash_attn3_varlen"
    assert (
        model_kernel("flex_attention").name == "flex_tiles" and not model_kernel("flex_attention").per_segment
    )
    assert model_kernel("eager").name == "eager_masked" and not model_kernel("eager").per_segment
    for name in ("sdpa_segments", "torch_flash_varlen", "flash_attn_varlen", "eager_masked", "flex_tiles"):
        assert named(name).name == name
    with pytest.raises(ValueError, match="no attention kernel"):
        named("paged")
    cpu = torch.device("cpu")
    assert TORCH_VARLEN.resolve(cpu, torch.bfloat16, (4, 2, 8)) is SDPA_SEGMENTS  # (CUDA only)


@pytest.mark.parametrize(("attn", "ran"), [("sdpa", "sdpa_segments"), ("eager", "eager_masked")])
def test_a_walk_says_which_kernel_attended_its_calls(attn, ran):
    executor = TreeExecutor(make_model("qwen3", attn), block_size=1000)
    executor.backward(PrefixTrie.from_sequences(SEQS), lambda i, lp, e: lp.sum())
    assert dict(executor.calls.attention) == {ran: executor.calls.forward}


def test_a_given_kernel_the_model_cannot_attend_per_segment_with_is_refused():
    model = make_model("qwen3", "sdpa", sliding_window=3, use_sliding_window=True, max_window_layers=0)
    assert not TreeExecutor(model).lm.segment_attention  # (its own kernel: the model's attention, a mask)
    with pytest.raises(Exception, match="cannot attend per segment with the kernel einsum_segments"):
        TreeExecutor(model, attention_kernel=EinsumSegments())


# ---------------------------------------------------------------------- flash_attention_2
def _bottom_right_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """flash-attn's dense function stood in for on a CPU: causal aligned bottom-right without a mask (on a
    cached prefix, as FA2 computes), sdpa's arithmetic."""
    n, m = query.shape[-2], key.shape[-2]
    mask = torch.ones(n, m, dtype=torch.bool, device=query.device).tril(m - n)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1]
    )
    return out.transpose(1, 2).contiguous(), None


@pytest.fixture
def flash_attention_2_model(monkeypatch):
    """A model as ``attn_implementation="flash_attention_2"`` loads it, its dense attention stood in for."""
    from transformers import AttentionInterface

    monkeypatch.setitem(AttentionInterface._global_mapping, "flash_attention_2", _bottom_right_sdpa)
    model = make_model("qwen3", "sdpa")
    model.config._attn_implementation_internal = "flash_attention_2"
    return model


def test_a_model_loaded_with_flash_attention_2_attends_per_segment(flash_attention_2_model):
    model = flash_attention_2_model
    loss_fn = loss_fn_for(SEQS, use_entropy=False)
    ref, _ = dense_grads(model, SEQS, loss_fn)
    executor = TreeExecutor(model, block_size=1000)
    lm = executor.lm
    assert isinstance(lm.kernel, FlashAttnVarlen) and lm.segment_attention and lm.can_pack  # (rows packed)
    assert lm.walk_kernel() is SDPA_SEGMENTS  # (on a CPU: flash-attn's kernel runs on CUDA only)
    for kernel in (None, flash_attn_on_cpu()):  # (its own; flash-attn's, stood in for)
        walker = executor if kernel is None else TreeExecutor(model, block_size=1000, attention_kernel=kernel)
        model.zero_grad(set_to_none=True)
        walker.backward(PrefixTrie.from_sequences(SEQS), loss_fn)
        assert max_rel_diff(grads_of(model), ref) < 1e-10
        assert set(walker.calls.attention) == {(kernel or SDPA_SEGMENTS).name}
    assert flash_attn_on_cpu(module="flash_attn_interface").name == "flash_attn3_varlen"


def test_flash_attns_kernel_without_its_package_runs_torchs_saying_so(caplog):
    kernel = FlashAttnVarlen("trl_dta_no_such_package", devices=("cpu",))  # (resolved as on CUDA)
    with caplog.at_level(logging.WARNING):
        assert kernel.resolve(torch.device("cpu"), torch.bfloat16, (4, 2, 8)) is SDPA_SEGMENTS
    assert "needs the trl_dta_no_such_package package" in caplog.text
