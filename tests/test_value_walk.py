"""A value model (a critic: ``*ForTokenClassification`` with ``num_labels=1``) walked by TreeExecutor against
per-sequence dense forwards of the same model: values and value-loss gradients, float64, random tries."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import VOCAB, grads_of, make_model, max_rel_diff
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_executor import shared_prefix_sequences
from torch import nn
from transformers import Qwen3Config, Qwen3ForSequenceClassification, Qwen3ForTokenClassification

from trl_dta import PrefixTrie, TreeExecutor, UnsupportedModelError
from trl_dta.walk.cost.costs import CallCost
from trl_dta.walk.cost.flops import per_token_costs
from trl_dta.walk.memory.budgets import token_budgets

pytestmark = pytest.mark.usefixtures("fp64_exact")  # HF's float32 casts kept in float64

TIGHT = 1e-10  # gradients (relative, as tests/test_executor.py)
VALUES = 1e-12  # values (absolute)


def make_critic(attn="sdpa", num_labels=1, cls=Qwen3ForTokenClassification, seed=0):
    """A 2-layer Qwen3 value model (tests/conftest.py's sizes), its head non-trivially scaled, no dropout."""
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=1024, initializer_range=0.2,
        rms_norm_eps=1e-6, num_labels=num_labels, classifier_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(seed)
    return cls._from_config(config, attn_implementation=attn).to(torch.float64).eval()


def _lora(model, kind):
    import peft

    torch.manual_seed(1)
    if kind == "all-linear":  # LoRA on every linear layer, the value head included
        config = peft.LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)
    else:  # PEFT's token-classification task: LoRA on attention, the head trained whole (modules_to_save)
        config = peft.LoraConfig(
            task_type="TOKEN_CLS", r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False
        )
    return peft.get_peft_model(model, config).to(torch.float64).eval()


@functools.cache
def critic(attn, lora=None):
    model = make_critic(attn)
    return _lora(model, lora) if lora else model


def dense_values(model, seq, first):
    """Values ``v[t]`` (the head at position ``t``, the state before token ``t + 1``) for ``t`` in
    ``[first, len(seq) - 1)``, by the model's own dense forward."""
    return model(input_ids=torch.as_tensor(seq)[None]).logits[0, first:-1, 0]


def value_loss_for(seqs, seed=0):
    """sum_k w_k (v_k - target)^2 with per-token weights and one target per sequence, plus a coupling term."""
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.rand(len(s) - 1, generator=gen, dtype=torch.float64) for s in seqs]
    targets = torch.randn(len(seqs), generator=gen, dtype=torch.float64)

    def loss_fn(i, values, entropies):
        assert entropies is None
        w = weights[i][len(weights[i]) - values.numel() :]  # (values from the sequence's score_from on)
        return (w * (values - targets[i]) ** 2).sum() + 0.3 * values.sum() ** 2

    return loss_fn


CASES = [("sdpa", None), ("eager", None), ("sdpa", "all-linear"), ("eager", "token")]


@pytest.mark.parametrize("attn,lora", CASES)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seqs=shared_prefix_sequences(max_sequences=7, max_len=16),
    block_size=st.sampled_from([2, 3, 5, 1000]),
    batch_tokens=st.sampled_from([0, 7, None]),
    pack=st.booleans(),
    merge_all=st.booleans(),
    data=st.data(),
)
def test_values_and_gradients_match_dense(attn, lora, seqs, block_size, batch_tokens, pack, merge_all, data):
    if lora:
        pytest.importorskip("peft")
    model = critic(attn, lora)
    froms = [data.draw(st.integers(0, len(s) - 2)) for s in seqs] if data.draw(st.booleans()) else None
    starts = froms or [0] * len(seqs)
    loss_fn = value_loss_for(seqs)
    # the dense reference: one forward/backward per sequence
    model.zero_grad(set_to_none=True)
    ref_values, ref_total = [], 0.0
    for i, seq in enumerate(seqs):
        values = dense_values(model, seq, starts[i])
        ref_values.append(values.detach())
        loss = loss_fn(i, values, None)
        loss.backward()
        ref_total += loss.item()
    ref = grads_of(model)
    executor = TreeExecutor(model, block_size=block_size, batch_tokens=batch_tokens, pack_leaves=pack)
    if merge_all:  # only calls cost: leaves and subtrees merged as far as the budgets allow
        executor.call_cost = CallCost(fixed=1.0, per_token=0.0, per_pair=0.0)
    trie = PrefixTrie.from_sequences(seqs)
    got_values = executor.logprobs(trie, score_from=froms)
    for got, want in zip(got_values, ref_values, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=VALUES)
    model.zero_grad(set_to_none=True)
    total = executor.backward(trie, loss_fn, score_from=froms)
    assert max_rel_diff(grads_of(model), ref) < TIGHT
    assert total == pytest.approx(ref_total, rel=1e-10, abs=1e-10)


def test_sequence_classification_value_model():
    """A sequence-classification model with a d -> 1 head, its head applied per token: values and gradients
    equal its decoder's dense forward through the head (its own forward pools one value per sequence)."""
    model = make_critic(cls=Qwen3ForSequenceClassification)
    seqs = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 11], [5, 6, 12, 13, 14, 15, 16], [5, 6, 7]]
    loss_fn = value_loss_for(seqs)
    model.zero_grad(set_to_none=True)
    refs = []
    for i, seq in enumerate(seqs):
        values = model.score(model.model(input_ids=torch.tensor(seq)[None]).last_hidden_state)[0, :-1, 0]
        refs.append(values.detach())
        loss_fn(i, values, None).backward()
    ref = grads_of(model)
    executor = TreeExecutor(model, block_size=3)
    assert executor.lm.value_head and executor.pack_leaves
    trie = PrefixTrie.from_sequences(seqs)
    for got, want in zip(executor.logprobs(trie), refs, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=VALUES)
    model.zero_grad(set_to_none=True)
    executor.backward(trie, loss_fn)
    assert max_rel_diff(grads_of(model), ref) < TIGHT


@pytest.mark.parametrize("cls", [Qwen3ForTokenClassification, Qwen3ForSequenceClassification])
def test_classification_head_with_two_outputs_refused(cls):
    with pytest.raises(UnsupportedModelError, match="2 outputs"):
        TreeExecutor(make_critic(num_labels=2, cls=cls))


def test_value_walk_refuses_entropies_and_temperature():
    executor = TreeExecutor(critic("sdpa"))
    trie = PrefixTrie.from_sequences([[1, 2, 3], [1, 2, 4]])
    with pytest.raises(ValueError, match="entropies"):
        executor.logprobs(trie, entropies=True)
    with pytest.raises(ValueError, match="temperature"):
        executor.logprobs(trie, temperature=0.7)
    with pytest.raises(ValueError, match="entropies"):
        executor.backward(trie, lambda i, v, e: v.sum(), entropies=True)


def test_value_model_bounds_and_budgets():
    """Token ids are bounded by the embeddings alone (the head has one output); memory budgets count a head
    of width 1, not the vocabulary."""
    model = critic("sdpa")
    executor = TreeExecutor(model, memory_budget=2e6)
    assert executor.lm.vocab_size == VOCAB
    with pytest.raises(ValueError, match="token id 61"):
        executor.logprobs(PrefixTrie.from_sequences([[1, 2, VOCAB]]))
    trie = PrefixTrie.from_sequences([[1, 2, 3, 4, 5], [1, 2, 3, 6]])
    expected = token_budgets(model.config, torch.float64, 2e6, "cpu", path_tokens=3, outputs=1)
    assert executor.token_budgets(trie) == expected
    assert expected != token_budgets(model.config, torch.float64, 2e6, "cpu", path_tokens=3)
    _, _, head = per_token_costs(executor.lm)
    assert head == 2 * model.config.hidden_size  # the LM head's cost: d x 1


def test_causal_lm_unchanged():
    executor = TreeExecutor(make_model("qwen3", "sdpa"))
    assert not executor.lm.value_head
    assert executor.lm.vocab_size == VOCAB


def test_head_dropout_refused_in_training_until_disabled():
    """A token-classification model's dropout before its head (0.1 by default) would differ between a shared
    prefix and dense forwards: refused in train mode, exact once switched off."""
    from trl_dta.walk.adapter.determinism import disable_randomness

    model = make_critic()
    model.dropout.p = 0.1  # (transformers' default where the config sets none)
    model.train()
    trie = PrefixTrie.from_sequences([[1, 2, 3, 4], [1, 2, 5]])
    executor = TreeExecutor(model)
    with pytest.raises(ValueError, match="randomness"):
        executor.backward(trie, lambda i, v, e: v.sum())
    disable_randomness(model)
    executor.backward(trie, lambda i, v, e: v.sum())


def test_value_head_in_float32():
    """lm_head_fp32 runs a float32-or-lower model's value head in float32, as it does an LM head."""
    model = make_critic().to(torch.bfloat16)
    seqs = [[1, 2, 3, 4, 5], [1, 2, 3, 6]]
    values = TreeExecutor(model, lm_head_fp32=True).logprobs(PrefixTrie.from_sequences(seqs))
    with torch.no_grad():
        for got, seq in zip(values, seqs, strict=True):
            hidden = model.model(input_ids=torch.tensor(seq)[None]).last_hidden_state[0, :-1]
            want = nn.functional.linear(hidden.float(), model.score.weight.float(), model.score.bias.float())
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, want[:, 0], rtol=0, atol=1e-2)


class _ScaledValues(Qwen3ForTokenClassification):
    """A value model whose forward transforms its head's outputs (what the walk would not reproduce)."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = 2 * out.logits
        return out


class _ScaledPooled(Qwen3ForSequenceClassification):
    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = 2 * out.logits
        return out


@pytest.mark.parametrize("cls", [_ScaledValues, _ScaledPooled])
def test_probe_refuses_values_the_walk_does_not_reproduce(cls):
    with pytest.raises(UnsupportedModelError, match=rf"^{cls.__name__}: its decoder \+ value head differs"):
        TreeExecutor(make_critic(cls=cls))
