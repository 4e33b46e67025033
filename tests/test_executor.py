"""TreeExecutor against dense per-sequence computation: float64 parity on random tries, for every path."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, cached_model, dense_grads, dense_logps, grads_of, make_model, max_rel_diff
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trl_dta import PrefixTrie, TreeExecutor, UnsupportedModelError
from trl_dta.walk.adapter.cache import PathLayer
from trl_dta.walk.cost.costs import CallCost
from trl_dta.walk.path_kv import PathKV

pytestmark = pytest.mark.usefixtures("fp64_exact")  # HF's float32 casts kept in float64

FAMILIES = [("qwen3", "sdpa"), ("qwen3", "eager"), ("llama", "sdpa"), ("llama", "eager")]
TIGHT = 1e-10


@st.composite
def shared_prefix_sequences(draw, max_sequences=9, max_len=24):
    """Sequences built by extending prefixes of earlier ones: deep tries with duplicates and with
    sequences that are prefixes of others."""
    alphabet = st.integers(0, VOCAB - 1)
    seqs = [draw(st.lists(alphabet, min_size=2, max_size=max_len))]
    for _ in range(draw(st.integers(1, max_sequences - 1))):
        base = draw(st.sampled_from(seqs))
        cut = draw(st.integers(0, len(base)))
        tail = draw(st.lists(alphabet, min_size=0, max_size=max_len - cut))
        seq = base[:cut] + tail
        if len(seq) < 2:
            seq = seq + [1, 2]
        seqs.append(seq)
    return seqs


def loss_fn_for(seqs, use_entropy, seed=0):
    """A sequence-level loss touching every token: weighted token sum, a squared sequence mean (couples
    tokens), and optionally an entropy term."""
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(len(s) - 1, generator=gen, dtype=torch.float64) for s in seqs]

    def loss_fn(i, logps, entropies):
        w = weights[i].to(logps.dtype)
        loss = (w * logps).sum() + 0.3 * logps.mean() ** 2
        if use_entropy:
            loss = loss - 0.1 * (entropies * w.abs()).sum()
        return loss

    return loss_fn


def tree_grads(executor, model, trie, loss_fn, temperature, entropies):
    model.zero_grad(set_to_none=True)
    total = executor.backward(trie, loss_fn, temperature=temperature, entropies=entropies)
    return grads_of(model), total


@pytest.mark.parametrize("family,attn", FAMILIES)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seqs=shared_prefix_sequences(),
    block_size=st.sampled_from([2, 3, 5, 1000]),
    batch_tokens=st.sampled_from([0, 7, None]),
    temperature=st.sampled_from([1.0, 0.7]),
    use_entropy=st.booleans(),
    pack=st.booleans(),
    merge_all=st.booleans(),
)
def test_backward_matches_dense(
    family, attn, seqs, block_size, batch_tokens, temperature, use_entropy, pack, merge_all
):
    model = cached_model(family, attn)
    loss_fn = loss_fn_for(seqs, use_entropy)
    ref, ref_total = dense_grads(model, seqs, loss_fn, temperature)
    executor = TreeExecutor(model, block_size=block_size, batch_tokens=batch_tokens, pack_leaves=pack)
    if merge_all:  # a cost model where only calls cost: leaves and subtrees merged as the budgets allow
        executor.call_cost = CallCost(fixed=1.0, per_token=0.0, per_pair=0.0)
    got, total = tree_grads(
        executor, model, PrefixTrie.from_sequences(seqs), loss_fn, temperature, use_entropy
    )
    assert max_rel_diff(got, ref) < TIGHT
    assert total == pytest.approx(ref_total, rel=1e-10, abs=1e-10)


@pytest.mark.parametrize("family,attn", FAMILIES)
@settings(max_examples=25, deadline=None)
@given(
    seqs=shared_prefix_sequences(),
    block_size=st.sampled_from([2, 5, 1000]),
    batch_tokens=st.sampled_from([0, None]),
    temperature=st.sampled_from([1.0, 1.3]),
    pack=st.booleans(),
)
def test_logprobs_match_dense(family, attn, seqs, block_size, batch_tokens, temperature, pack):
    model = cached_model(family, attn)
    executor = TreeExecutor(model, block_size=block_size, batch_tokens=batch_tokens, pack_leaves=pack)
    logps, ents = executor.logprobs(PrefixTrie.from_sequences(seqs), temperature=temperature, entropies=True)
    plain = executor.logprobs(PrefixTrie.from_sequences(seqs), temperature=temperature)
    with torch.no_grad():
        for i, seq in enumerate(seqs):
            lp, ent = dense_logps(model, seq, temperature)
            assert logps[i].shape == (len(seq) - 1,)
            torch.testing.assert_close(logps[i], lp, rtol=0, atol=1e-12)
            torch.testing.assert_close(ents[i], ent, rtol=0, atol=1e-12)
            torch.testing.assert_close(plain[i], lp, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "block_size,batch_tokens,pack", [(1000, None, True), (1000, None, False), (3, 0, True), (4, 9, True)]
)
def test_lora_backward_matches_dense(block_size, batch_tokens, pack):
    peft = pytest.importorskip("peft")
    model = make_model("qwen3", "sdpa", seed=1)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
    )
    model = peft.get_peft_model(model, config)
    seqs = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 11], [5, 6, 7, 8, 11], [5, 6, 12, 13, 14, 15, 16], [5, 6, 7]]
    loss_fn = loss_fn_for(seqs, use_entropy=True)
    ref, _ = dense_grads(model, seqs, loss_fn)
    assert ref and all("lora_" in name for name in ref)  # only adapters train, and they get gradients
    executor = TreeExecutor(model, block_size=block_size, batch_tokens=batch_tokens, pack_leaves=pack)
    got, _ = tree_grads(executor, model, PrefixTrie.from_sequences(seqs), loss_fn, 1.0, True)
    assert max_rel_diff(got, ref) < TIGHT


def test_cached_forward_equals_dense_forward():
    """The cache keyword is honoured: a forward on a cached prefix equals the dense forward."""
    model = cached_model("qwen3", "sdpa")
    executor = TreeExecutor(model)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])
    with torch.no_grad():
        full = model.model(input_ids=ids).last_hidden_state
        kv = PathKV(capacity=ids.shape[1])  # the path's K/V, as the walk keeps them
        h1, _, _ = executor.lm.forward(ids[:, :4], 0, kv)
        h2, _, _ = executor.lm.forward(ids[:, 4:], 4, kv)
    torch.testing.assert_close(torch.cat([h1, h2], dim=1), full, rtol=0, atol=1e-12)


@pytest.mark.parametrize("pack", [True, False])
def test_path_kv_is_not_copied_per_forward(monkeypatch, pack):
    """A one-row forward attends to a view of the walk's per-layer K/V buffer, not to a copy of the path's
    K/V (the parity tests above show the gradients stay exact); rows of a padded batch get one joined copy."""
    seen = []  # per attention call on a past: (rows, keys are a view of the layer's buffer)
    update = PathLayer.update

    def spy(self, key_states, value_states, *args, **kwargs):
        keys, values = update(self, key_states, value_states, *args, **kwargs)
        if self.past_length:
            buffer = self.kv.buffers[self.index][0].untyped_storage().data_ptr()
            seen.append((key_states.shape[0], keys.untyped_storage().data_ptr() == buffer))
        return keys, values

    monkeypatch.setattr(PathLayer, "update", spy)
    seqs = [[5, 6, 7, 8, 9, 10, 11, 12], [5, 6, 7, 8, 9, 13, 14], [5, 6, 7, 15, 16, 17], [5, 6, 7, 15, 18]]
    executor = TreeExecutor(make_model(), block_size=3, batch_tokens=8, subtree_tokens=0, pack_leaves=pack)
    executor.backward(PrefixTrie.from_sequences(seqs), lambda i, lp, e: lp.sum())
    one_row = [in_buffer for rows, in_buffer in seen if rows == 1]
    assert len(one_row) >= 10 and all(one_row)
    assert all(not in_buffer for rows, in_buffer in seen if rows > 1)
    assert pack or any(rows > 1 for rows, _ in seen)


def test_path_kv_layer_run_only_without_gradients():
    """A cache layer a model only runs under no_grad (HRM's inner cycles use their own cache slots) has no
    gradient buffer: popping its segment takes no K/V gradient for it, and does not fail."""
    kv = PathKV(capacity=4)
    keys = torch.randn(1, 2, 3, 8)
    with torch.no_grad():
        kv.join(0, keys, keys, 0)
    assert kv.take_grad(0, 0, 3) == [None, None] and not kv.has_grad(0)


def test_probe_rejects_an_ignored_cache(monkeypatch):
    """A model that swallows the cache keyword (as transformers 5.17 does with `cache=`) is refused."""
    from trl_dta.walk.adapter.model import CausalLM

    model = make_model("qwen3", "sdpa")
    monkeypatch.setattr(CausalLM, "_cache_keyword", lambda self: "unused_cache_keyword")
    with pytest.raises(UnsupportedModelError, match="ignores the passed KV cache"):
        TreeExecutor(model)


@pytest.mark.parametrize("family,attn", FAMILIES[:2])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seqs=shared_prefix_sequences(),
    block_size=st.sampled_from([2, 5, 1000]),
    batch_tokens=st.sampled_from([0, None]),
    pack=st.booleans(),
    data=st.data(),
)
def test_score_from_matches_dense(family, attn, seqs, block_size, batch_tokens, pack, data):
    """Scoring each sequence from its own first index (a prompt length) gives the dense log-probs and
    gradients of the loss on that part, on every path."""
    froms = [data.draw(st.integers(0, len(s) - 2)) for s in seqs]
    model = cached_model(family, attn)
    full = loss_fn_for(seqs, use_entropy=True)

    def loss_fn(i, lp, ent):  # the loss reads positions from froms[i] on only
        pad = lp.new_zeros(froms[i])
        return full(i, torch.cat([pad, lp]), torch.cat([pad, ent]))

    def dense_loss(i, lp, ent):
        return loss_fn(i, lp[froms[i] :], ent[froms[i] :])

    ref, _ = dense_grads(model, seqs, dense_loss)
    executor = TreeExecutor(model, block_size=block_size, batch_tokens=batch_tokens, pack_leaves=pack)
    trie = PrefixTrie.from_sequences(seqs)
    model.zero_grad(set_to_none=True)
    executor.backward(trie, loss_fn, entropies=True, score_from=froms)
    assert max_rel_diff(grads_of(model), ref) < TIGHT
    logps = executor.logprobs(trie, score_from=froms)
    with torch.no_grad():
        for i, seq in enumerate(seqs):
            torch.testing.assert_close(logps[i], dense_logps(model, seq)[0][froms[i] :], rtol=0, atol=1e-12)


@pytest.mark.parametrize("inner", ["logprobs", "backward"])
def test_a_loss_that_walks_another_trie_on_the_same_executor(inner):
    """Each call keeps its walk state to itself: a loss_fn that walks another trie on the same executor (with
    or without gradients) leaves the outer walk exact, and the inner walk is exact too."""
    model = cached_model("qwen3", "sdpa")
    seqs = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 9, 10, 11], [1, 2, 3, 4, 12]]
    others = [[5, 6, 7, 8], [5, 6, 9], [13, 6, 7]]
    outer, inner_fn = loss_fn_for(seqs, use_entropy=True), loss_fn_for(others, use_entropy=False, seed=1)
    executor = TreeExecutor(model, block_size=3, batch_tokens=4)
    inner_logps = []

    def loss_fn(i, logps, entropies):
        other = PrefixTrie.from_sequences(others)
        if inner == "logprobs":
            inner_logps.append(executor.logprobs(other))
        else:
            executor.backward(other, inner_fn)
        return outer(i, logps, entropies)

    ref, _ = dense_grads(model, seqs, outer)
    if inner == "backward":  # the inner walks' gradients, once per outer sequence, land in .grad as well
        extra, _ = dense_grads(model, others, inner_fn)
        ref = {k: v + len(seqs) * extra[k] for k, v in ref.items()}
    got, _ = tree_grads(executor, model, PrefixTrie.from_sequences(seqs), loss_fn, 1.0, True)
    assert max_rel_diff(got, ref) < TIGHT
    with torch.no_grad():
        dense_inner = [dense_logps(model, s)[0] for s in others]
    for logps in inner_logps:
        for lp, ref_lp in zip(logps, dense_inner, strict=True):
            torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-12)
