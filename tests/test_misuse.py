"""Misuse and bad input (issue 21): the walk gives the dense answer or a clear error, never a wrong gradient.

Each test is one case a careless user runs into; where a number comes out, it is checked against the model's
own dense computation.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
from conftest import VOCAB, dense_grads, dense_logps, grads_of, make_model, max_rel_diff
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    MixtralConfig,
    OPTConfig,
    OPTForCausalLM,
)

from trl_dta import PrefixTrie, TreeExecutor, UnsupportedModelError, lexicographic_partition
from trl_dta.walk.adapter.determinism import disable_randomness, stochastic_settings
from trl_dta.walk.plan import build_plan

pytestmark = pytest.mark.usefixtures("fp64_exact")  # HF's float32 casts kept in float64

SEQS = [[1, 2, 3, 4, 5], [1, 2, 3, 6], [1, 2, 7, 8, 9, 10]]
TIGHT = 1e-9


def loss_fn(i, logps, entropies):
    return -(logps * (i + 1)).sum()


def tiny_opt(**overrides):
    """OPT with its config's defaults for randomness (dropout 0.1, functional: no nn.Dropout module)."""
    sizes = dict(vocab_size=VOCAB, hidden_size=32, ffn_dim=48, num_hidden_layers=2, num_attention_heads=4,
                 word_embed_proj_dim=32, max_position_embeddings=64, init_std=0.2)  # fmt: skip
    config = OPTConfig(**{**sizes, **overrides})
    torch.manual_seed(0)
    return OPTForCausalLM(config).double()


def tiny_mixtral(**overrides):
    config = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                           num_experts_per_tok=2, initializer_range=0.2, sliding_window=None,
                           **overrides)  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(
        config, experts_implementation="eager"
    ).double()  # float64 experts


def walk_grads(executor, model, seqs, fn=loss_fn, **kwargs):
    model.zero_grad(set_to_none=True)
    executor.backward(PrefixTrie.from_sequences(seqs), fn, **kwargs)
    return grads_of(model)


# ------------------------------------------------------------------ 1. randomness that is not nn.Dropout
@pytest.mark.parametrize(
    ("build", "setting", "tol"),
    [
        (lambda: tiny_opt(), r"layers\.0\.dropout = 0\.1", TIGHT),  # functional dropout(p=config.dropout)
        (lambda: tiny_opt(dropout=0.0, layerdrop=0.3), r"layerdrop = 0\.3", TIGHT),
        # (Mixtral's RMSNorm computes in float32 even in a float64 model: walk and dense round differently,
        # ~1e-7 here, so fp32's parity bound; the jitter left on is off by far more)
        (lambda: tiny_mixtral(router_jitter_noise=0.5), r"jitter_noise = 0\.5", 1e-5),
    ],
    ids=["opt dropout", "opt layerdrop", "mixtral router jitter"],
)
def test_randomness_held_as_numbers_is_refused_then_turned_off(build, setting, tol):
    model = build().train()
    assert not any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules())  # TRL's check sees none
    executor = TreeExecutor(model)
    with pytest.raises(ValueError, match=setting):
        executor.backward(PrefixTrie.from_sequences(SEQS), loss_fn)
    changed = disable_randomness(model)
    assert changed and not stochastic_settings(model)
    ref, _ = dense_grads(model, SEQS, loss_fn)  # deterministic now: the dense reference is well defined
    assert max_rel_diff(walk_grads(executor, model, SEQS), ref) < tol


class NoisyActivation(nn.Module):
    """A stochastic layer no setting names: Gaussian noise in train mode."""

    def forward(self, x):
        return nn.functional.silu(x) + (0.01 * torch.randn_like(x) if self.training else 0)


def test_randomness_no_setting_names_is_caught_by_behaviour():
    model = make_model("llama", "sdpa")
    model.model.layers[1].mlp.act_fn = NoisyActivation()
    executor = TreeExecutor(model)  # eval mode: deterministic
    executor.logprobs(PrefixTrie.from_sequences(SEQS))
    model.train()
    state = torch.get_rng_state()
    with pytest.raises(ValueError, match="not deterministic in train mode.*no dropout or noise setting"):
        executor.backward(PrefixTrie.from_sequences(SEQS), loss_fn)
    assert torch.equal(torch.get_rng_state(), state)  # the check's draws leave the caller's RNG as it was


def test_a_model_random_in_eval_mode_is_refused_at_construction():
    model = make_model("llama", "sdpa")
    layer = model.model.layers[0].mlp
    layer.act_fn = NoisyActivation()
    layer.act_fn.eval = lambda: layer.act_fn  # stays in train mode, whatever the model's mode
    layer.act_fn.train = lambda mode=True: layer.act_fn
    with pytest.raises(UnsupportedModelError, match="not deterministic in eval mode"):
        TreeExecutor(model)


def test_the_determinism_check_leaves_a_deterministic_walk_and_the_rng_alone():
    model = make_model("qwen3", "sdpa").train()
    ref, _ = dense_grads(model, SEQS, loss_fn)
    executor = TreeExecutor(model)
    state = torch.get_rng_state()
    assert max_rel_diff(walk_grads(executor, model, SEQS), ref) < TIGHT
    assert torch.equal(torch.get_rng_state(), state)


# ------------------------------------------------------------------ 2. backward without autograd
@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_backward_without_autograd_is_refused(context):
    model = make_model("qwen3", "sdpa")
    executor = TreeExecutor(model)
    with context(), pytest.raises(RuntimeError, match=f"called under torch.{context.__name__}"):
        executor.backward(PrefixTrie.from_sequences(SEQS), loss_fn)
    assert all(p.grad is None for p in model.parameters())


def test_backward_of_a_frozen_model_is_refused():
    model = make_model("qwen3", "sdpa").requires_grad_(False)
    with pytest.raises(ValueError, match="no parameter that requires grad"):
        TreeExecutor(model).backward(PrefixTrie.from_sequences(SEQS), loss_fn)


# ------------------------------------------------------------------ 3. a replaced LM head
def test_resized_embeddings_after_construction_are_used():
    model = make_model("qwen3", "sdpa")
    executor = TreeExecutor(model)
    executor.logprobs(PrefixTrie.from_sequences(SEQS))
    model.resize_token_embeddings(VOCAB + 40)
    seqs = SEQS + [[1, 2, VOCAB + 30, 4, VOCAB + 39]]  # new ids
    with torch.no_grad():
        got = executor.logprobs(PrefixTrie.from_sequences(seqs))
        for lp, seq in zip(got, seqs, strict=True):
            torch.testing.assert_close(lp, dense_logps(model, seq)[0], rtol=0, atol=1e-12)
    ref, _ = dense_grads(model, seqs, loss_fn)
    got = walk_grads(executor, model, seqs)
    assert got["lm_head.weight"].shape[0] == VOCAB + 40
    assert max_rel_diff(got, ref) < TIGHT


def test_an_attention_backend_changed_after_construction_is_checked_again():
    model = make_model("qwen3", "sdpa")
    executor = TreeExecutor(model)
    assert executor.pack_leaves
    model.config._attn_implementation = "sdpa_paged"
    with pytest.raises(UnsupportedModelError, match="attention implementation 'sdpa_paged'"):
        executor.logprobs(PrefixTrie.from_sequences(SEQS))
    model.config._attn_implementation = "eager"  # another supported one: probed again, and exact
    ref, _ = dense_grads(model, SEQS, loss_fn)
    assert max_rel_diff(walk_grads(executor, model, SEQS), ref) < TIGHT


# ------------------------------------------------------------------ 4. deep tries: no recursion on depth
def test_a_thousand_nested_prefixes_are_exact():
    """Each sequence a prefix of the next (the per-turn samples of one long conversation): a trie 1,000
    nodes deep. Dense reference: by causality every prefix's log-probs are a slice of the longest one's."""
    model = make_model("qwen3", "sdpa")
    full = [(7 * t + 3) % VOCAB for t in range(1001)]
    seqs = [full[:n] for n in range(2, 1002)]

    def weighted(i, logps, entropies):
        return -(logps * math.cos(i)).sum() / 100

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)  # Python's default: a recursion on depth would hit it
    try:
        trie = PrefixTrie.from_sequences(seqs)
        assert lexicographic_partition(trie, 4)  # the partition of a deep trie
        executor = TreeExecutor(model)
        got = walk_grads(executor, model, seqs, weighted)
        with torch.no_grad():
            logps = executor.logprobs(trie)
    finally:
        sys.setrecursionlimit(limit)
    model.zero_grad(set_to_none=True)
    lp_full, _ = dense_logps(model, full)
    sum(weighted(i, lp_full[: len(s) - 1], None) for i, s in enumerate(seqs)).backward()
    assert max_rel_diff(got, grads_of(model)) < TIGHT
    torch.testing.assert_close(torch.cat(logps[-1:]), lp_full.detach(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("packed", [False, True])
def test_plans_of_deep_tries_need_no_recursion(packed):
    seqs = [[1] * n + [2] for n in range(1, 3001)]  # 3,000 nested branch points
    plan = build_plan(PrefixTrie.from_sequences(seqs), block_size=64, batch_tokens=64, packed=packed,
                      subtree_tokens=16 if packed else 0)  # fmt: skip
    assert len(plan) > 3000


# ------------------------------------------------------------------ 5. up-front validation of ids and lengths
def test_token_ids_outside_the_vocabulary_are_refused_by_sequence():
    executor = TreeExecutor(make_model("qwen3", "sdpa"))
    trie = PrefixTrie.from_sequences([[1, 2, 3], [1, 2, VOCAB + 5, 4]])
    with pytest.raises(ValueError, match=f"sequence 1 has token id {VOCAB + 5}.* {VOCAB} ids"):
        executor.logprobs(trie)


@pytest.mark.parametrize("family", ["gpt2", "opt"])
def test_sequences_longer_than_learned_positions_are_refused_by_sequence(family):
    """GPT-2's ``wpe`` has ``n_positions`` rows; OPT's table has 2 more, used as an offset."""
    torch.manual_seed(0)
    if family == "gpt2":
        config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=16, bos_token_id=1,
                            eos_token_id=2)  # fmt: skip
        model = GPT2LMHeadModel(config).double().eval()
    else:
        model = tiny_opt(max_position_embeddings=16, dropout=0.0).eval()
    executor = TreeExecutor(model)
    at_limit = [list(range(1, 17)), [1, 2, 3, 9]]
    with torch.no_grad():
        got = executor.logprobs(PrefixTrie.from_sequences(at_limit))
        torch.testing.assert_close(got[0], dense_logps(model, at_limit[0])[0], rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match="sequence 1 has 17 tokens.* cover 16 positions"):
        executor.logprobs(PrefixTrie.from_sequences([[1, 2, 3], list(range(1, 18))]))


# ------------------------------------------------------------------ 7. clear type errors
def test_a_loss_fn_that_returns_no_tensor_is_refused():
    executor = TreeExecutor(make_model("qwen3", "sdpa"))
    trie = PrefixTrie.from_sequences(SEQS)
    for value in (1.5, None):
        with pytest.raises(TypeError, match=f"got {type(value).__name__} for sequence \\d"):
            executor.backward(trie, lambda i, lp, ent, v=value: v)


def test_bad_settings_and_arguments_get_clear_errors():
    model = make_model("qwen3", "sdpa")
    for value in (2.5, "8"):  # (None: derived from memory_budget)
        with pytest.raises(TypeError, match="block_size must be an int"):
            TreeExecutor(model, block_size=value)
    for value in (0, -1.0, "lots", True):
        with pytest.raises(ValueError, match="memory_budget must be"):
            TreeExecutor(model, memory_budget=value)
    with pytest.raises(TypeError, match="batch_tokens must be an int"):
        TreeExecutor(model, batch_tokens=1.0)
    with pytest.raises(ValueError, match="block_size must be an int"):  # a bad setting, as HF's checks raise
        TreeExecutor(model, block_size=2.5)
    executor = TreeExecutor(model)
    trie = PrefixTrie.from_sequences(SEQS)
    with pytest.raises(TypeError, match=r"score_from\[1\] must be an int"):
        executor.logprobs(trie, score_from=[0, 1.0, 2])
    for bad in (math.nan, math.inf, -1.0):
        with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
            executor.logprobs(trie, temperature=bad)
    with pytest.raises(TypeError, match="expected a PrefixTrie"):
        executor.logprobs(SEQS)
    # a score_from given as a tensor is read as ints
    got = executor.logprobs(trie, score_from=torch.tensor([1, 0, 2]))
    assert [len(x) for x in got] == [3, 3, 3]


def test_a_model_on_the_meta_device_is_refused():
    with torch.device("meta"):
        model = make_model("qwen3", "sdpa")
    with pytest.raises(ValueError, match="meta device"):
        TreeExecutor(model)


def test_a_failing_generation_raises_its_own_error():
    """``VLLMMixin`` times TRL's ``_generate``: a generation that raises does so with its own error, whatever
    the timing's metric write would do (it once replaced a ``ValueError`` in flight with a ``KeyError``)."""
    from types import SimpleNamespace

    from trl_dta.vllm.trainer import VLLMMixin

    class Generates:
        def _generate(self, prompts):
            if prompts is None:
                raise ValueError("the generation's own error")
            return ["done"]

    class Trainer(VLLMMixin, Generates):
        pass

    trainer = Trainer.__new__(Trainer)  # (no TRL trainer built: only _generate runs)
    trainer.model, trainer._metrics = SimpleNamespace(training=True), {}  # (a metric write would raise)
    with pytest.raises(ValueError, match="the generation's own error"):
        trainer._generate(None)
    trainer._metrics = {"train": {"perf/generation_s": []}}
    assert trainer._generate([]) == ["done"] and len(trainer._metrics["train"]["perf/generation_s"]) == 1
