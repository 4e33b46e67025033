"""Shared test helpers: tiny causal LMs built from configs (no Hub access), dense references, and a
test-only patch that keeps HF's float32 casts (RMSNorm, eager softmax) in float64."""

from __future__ import annotations

import functools
import os

# No network in tests: TRL's trainers send usage telemetry to the Hub from rank 0 unless CI or this variable
# is set. huggingface_hub reads it when imported, so it is set before any import below; workers inherit it.
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402
from transformers.models.qwen3 import modeling_qwen3  # noqa: E402

from trl_dta.compare import relative_error  # noqa: E402

VOCAB = 61
# Tiny models: one thread is faster, and it keeps the tests' many small ops from stalling when another
# process shares the cores (with 2 threads each op waits for the second thread to be scheduled).
torch.set_num_threads(1)


def make_model(family: str = "qwen3", attn: str = "sdpa", dtype=torch.float64, seed: int = 0, **overrides):
    """A 2-layer causal LM with GQA and untied, non-trivially scaled random weights."""
    common = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=1024, tie_word_embeddings=False,
        initializer_range=0.2, rms_norm_eps=1e-6,
    )  # fmt: skip
    common.update(overrides)
    config = (Qwen3Config if family == "qwen3" else LlamaConfig)(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    return model.to(dtype).eval()


@functools.cache
def cached_model(family: str, attn: str, dtype=torch.float64):
    return make_model(family, attn, dtype)


def dense_logps(model, seq, temperature=1.0):
    """Per-token log-probs and entropies of one sequence by the model's own dense forward."""
    ids = torch.as_tensor(seq, dtype=torch.long)[None]
    logits = model(input_ids=ids).logits[0, :-1]
    logits = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32) / temperature
    lsm = torch.log_softmax(logits, dim=-1)
    return lsm.gather(-1, ids[0, 1:, None]).squeeze(-1), -(lsm.exp() * lsm).sum(-1)


def dense_grads(model, seqs, loss_fn, temperature=1.0):
    """Gradients of sum_i loss_fn(i, logps_i, entropies_i), one dense forward/backward per sequence."""
    model.zero_grad(set_to_none=True)
    total = 0.0
    for i, seq in enumerate(seqs):
        lp, ent = dense_logps(model, seq, temperature)
        loss = loss_fn(i, lp, ent)
        loss.backward()
        total += loss.item()
    return grads_of(model), total


def grads_of(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def max_rel_diff(a: dict, b: dict) -> float:
    """max over tensors of max|a - b| / max|b| (``trl_dta.compare.relative_error``); a tensor whose reference
    gradient is zero up to rounding (e.g. q/k projections when every query sees one key) is measured against
    the largest gradient instead. An all-zero reference fails: the comparison would prove nothing."""
    overall = max((v.abs().max().item() for v in b.values() if v.numel()), default=0.0)
    assert overall > 0, "the reference gradients are all zero: the comparison would prove nothing"
    return relative_error(a, b, tiny=1e-9)


def _rmsnorm_in_input_dtype(self, hidden_states):
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _eager_in_input_dtype(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    key = modeling_llama.repeat_kv(key, module.num_key_value_groups)
    value = modeling_llama.repeat_kv(value, module.num_key_value_groups)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = nn.functional.softmax(weights, dim=-1)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


@pytest.fixture(autouse=True)
def _cost_cache(tmp_path_factory, monkeypatch):
    """Each test keeps fitted call costs in a directory of its own (trl_dta/walk/cost/cost_cache.py): none is
    read from the user's cache or left there, and no test starts from another's fit."""
    monkeypatch.setenv("TRL_DTA_CACHE_DIR", str(tmp_path_factory.mktemp("cost_cache")))


@pytest.fixture(scope="module")
def fp64_exact():
    """Keep HF's float32 casts in float64 (test-only), so two exact methods agree to ~1e-15 in float64.
    Float32 models are unaffected: the patched code computes in the input dtype, as HF does for them.
    Opt-in per module (``pytestmark = pytest.mark.usefixtures("fp64_exact")``): the trainer parity tests
    must see HF's code as users run it."""
    mp = pytest.MonkeyPatch()
    for mod, norm in ((modeling_llama, "LlamaRMSNorm"), (modeling_qwen3, "Qwen3RMSNorm")):
        mp.setattr(getattr(mod, norm), "forward", _rmsnorm_in_input_dtype)
        mp.setattr(mod, "eager_attention_forward", _eager_in_input_dtype)
    yield
    mp.undo()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """The trainer tests' tiny Qwen3 (trl_dta/testing/grpo.py) saved once: trainers, TRL's reference model
    (for beta > 0) and subprocess workers load it by path."""
    from trl_dta.testing.grpo import tiny_model

    path = tmp_path_factory.mktemp("tiny_qwen3")
    tiny_model(seed=0).save_pretrained(path)
    return str(path)
