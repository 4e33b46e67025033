"""Hybrid and state-space models (conv / recurrent states carried through the walk) against dense
per-sequence computation in float64, on random tries: chunked blocks, sibling batches, prefixes of other
sequences, duplicates, one-token trie nodes (forwarded with their children, never alone), LoRA.

transformers' state kernels (chunked gated delta rule, Mamba2 scan) cast to float32 even in a float64
model, where two exact computations then differ like float32 ones (seen: gradients 2e-5 relative, and 9e-3
on the decay gates' tiny gradients, sums of cancelling terms). The executor tests therefore run with those
casts kept in float64 (``fp64_state_kernels``, test-only, as conftest's ``fp64_exact`` does for RMSNorm). A
state not carried, or carried from the wrong segment, changes log-probs by >= 1e-3."""

from __future__ import annotations

import importlib
import types
from types import SimpleNamespace

import pytest
import torch
import transformers
from conftest import VOCAB, dense_grads, dense_logps, grads_of, max_rel_diff
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_executor import loss_fn_for, shared_prefix_sequences

from trl_dta import PrefixTrie, TreeExecutor, UnsupportedModelError
from trl_dta.compare import relative_error
from trl_dta.walk.adapter.cache import HAS_STATE_API, STATE_API_VERSION

# Before transformers 5.21 (the floor CI job runs 5.17) models read carried states from the cache's layers:
# refused by the probe, naming the version (test_old_transformers_names_the_version)
needs_state_api = pytest.mark.skipif(
    not HAS_STATE_API, reason=f"carried states need transformers >= {STATE_API_VERSION}"
)

# relative; a few .float() casts remain (decay gates, Mamba2's logits: log-probs ~1e-7 apart here), whose
# rounding walk and dense do in other orders: fp32's parity bound for both
LOGP_TOL, GRAD_TOL = 1e-5, 1e-5

_ATTN = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48)
_GDN = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"])  # fmt: skip
_MAMBA = dict(mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_n_groups=1,
              mamba_chunk_size=4, mamba_d_conv=4)  # fmt: skip
CONFIGS = {  # family -> (config class, settings): 2 layers, hidden 32
    "qwen3_5": ("Qwen3_5TextConfig", {**_ATTN, **_GDN}),
    "qwen3_next": ("Qwen3NextConfig", {**_ATTN, **_GDN, "mlp_only_layers": [0, 1]}),
    "lfm2": ("Lfm2Config", {**_ATTN, "layer_types": ["conv", "full_attention"]}),
    "falcon_h1": ("FalconH1Config", {**_ATTN, **_MAMBA}),
    "mamba2": (
        "Mamba2Config",
        dict(num_heads=8, head_dim=8, state_size=8, n_groups=1, chunk_size=4, expand=2, conv_kernel=4),
    ),  # fmt: skip
}


def hybrid_model(family: str, seed: int = 0, dtype=torch.float64):
    name, settings_ = CONFIGS[family]
    config = getattr(transformers, name)(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, tie_word_embeddings=False,
        initializer_range=0.2, pad_token_id=None, **settings_,  # no zero padding embedding: all tokens train
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()


class _Float32IsFloat64(types.ModuleType):
    """``torch`` as seen by a modeling module, with ``torch.float32`` meaning float64."""

    def __getattr__(self, name):
        return torch.float64 if name == "float32" else getattr(torch, name)


@pytest.fixture
def fp64_state_kernels(monkeypatch):
    """Test-only: the state kernels of the families below keep float64 where they cast to float32."""
    proxy = _Float32IsFloat64("torch")
    for family in CONFIGS:
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        monkeypatch.setattr(module, "torch", proxy)


_MODELS: dict[str, torch.nn.Module] = {}
# one-token nodes with children ([7], [8], [12]); sequences end at two of them ([7], [12])
ONE_TOKEN_NODES = [
    [5, 6, 7, 8, 9],
    [5, 6, 7, 8, 10, 11],
    [5, 6, 7],
    [5, 6, 7, 12],
    [5, 6, 7, 12, 13, 14],
    [5, 6, 20],
]


def cached(family):
    if family not in _MODELS:
        _MODELS[family] = hybrid_model(family)
    return _MODELS[family]


@needs_state_api
@pytest.mark.parametrize("family", list(CONFIGS))
def test_states_are_carried(family):
    executor = TreeExecutor(cached(family))
    assert executor.lm.has_states
    assert not executor.pack_leaves  # one leaf's state would run into the next leaf of a packed row


@needs_state_api
@pytest.mark.usefixtures("fp64_state_kernels")
@pytest.mark.parametrize("family", list(CONFIGS))
@settings(
    max_examples=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],  # an idempotent patch
)
@given(
    seqs=shared_prefix_sequences(max_sequences=7, max_len=18),
    block_size=st.sampled_from([2, 3, 5, 1000]),
    batch_tokens=st.sampled_from([0, 7, None]),
    use_entropy=st.booleans(),
)
def test_backward_and_logprobs_match_dense(family, seqs, block_size, batch_tokens, use_entropy):
    model = cached(family)
    loss_fn = loss_fn_for(seqs, use_entropy)
    ref, ref_total = dense_grads(model, seqs, loss_fn)
    executor = TreeExecutor(model, block_size=block_size, batch_tokens=batch_tokens)
    trie = PrefixTrie.from_sequences(seqs)
    logps = executor.logprobs(trie)
    with torch.no_grad():
        for lp, seq in zip(logps, seqs, strict=True):
            assert relative_error(lp, dense_logps(model, seq)[0]) <= LOGP_TOL
    model.zero_grad(set_to_none=True)
    total = executor.backward(trie, loss_fn, entropies=use_entropy)
    assert max_rel_diff(grads_of(model), ref) <= GRAD_TOL
    assert total == pytest.approx(ref_total, rel=1e-5)  # Mamba2 returns float32 logits to the dense sum


@needs_state_api
@pytest.mark.usefixtures("fp64_state_kernels")
@pytest.mark.parametrize("family", ["qwen3_5", "mamba2"])
@pytest.mark.parametrize("block_size", [2, 1000])
def test_one_token_nodes_are_forwarded_with_their_children(family, block_size, monkeypatch):
    """One-token trie nodes (shared first answer token, a sequence ending there) on a carried state: never
    forwarded alone (the model's decode kernels may differ), exact."""
    from trl_dta.walk.adapter.model import CausalLM

    model = cached(family)
    seqs = ONE_TOKEN_NODES
    lengths = []
    forward = CausalLM.forward

    def spy(self, input_ids, start, kv, states=None, *args, **kwargs):
        lengths.append((input_ids.shape[1], bool(states)))
        return forward(self, input_ids, start, kv, states, *args, **kwargs)

    monkeypatch.setattr(CausalLM, "forward", spy)
    loss_fn = loss_fn_for(seqs, use_entropy=True)
    ref, _ = dense_grads(model, seqs, loss_fn)
    executor = TreeExecutor(model, block_size=block_size, batch_tokens=0)
    lengths.clear()
    model.zero_grad(set_to_none=True)
    executor.backward(PrefixTrie.from_sequences(seqs), loss_fn, entropies=True)
    assert max_rel_diff(grads_of(model), ref) <= GRAD_TOL
    assert all(n > 1 for n, on_path in lengths if on_path)


@needs_state_api
@pytest.mark.usefixtures("fp64_state_kernels")
def test_lora_backward_matches_dense():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        hybrid_model("qwen3_5", seed=1),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["in_proj_qkv", "out_proj", "q_proj", "down_proj"],
                        init_lora_weights=False),
    )  # fmt: skip
    seqs = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 11], [5, 6, 7, 8, 11], [5, 6, 12, 13, 14, 15, 16], [5, 6, 7]]
    loss_fn = loss_fn_for(seqs, use_entropy=True)
    ref, _ = dense_grads(model, seqs, loss_fn)
    assert ref and all("lora_" in name for name in ref)
    for block_size in (3, 1000):
        model.zero_grad(set_to_none=True)
        TreeExecutor(model, block_size=block_size).backward(
            PrefixTrie.from_sequences(seqs), loss_fn, entropies=True
        )
        assert max_rel_diff(grads_of(model), ref) <= GRAD_TOL


@needs_state_api
def test_state_not_carried_is_refused():
    """Mamba-1 layers restart their multi-token scan from zero: the probe sees the prefix's state ignored."""
    config = transformers.MambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=8)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float64).eval()
    with pytest.raises(UnsupportedModelError, match="does not start from the given state"):
        TreeExecutor(model)


def test_unknown_state_layer_kind_is_refused():
    from trl_dta.walk.adapter.checks import check_stateful_layers

    config = SimpleNamespace(num_hidden_layers=2, layer_types=["rwkv", "full_attention"])
    with pytest.raises(UnsupportedModelError, match="rwkv"):
        check_stateful_layers(config, "Model")


@needs_state_api
@pytest.mark.parametrize("accumulation,lora", [(1, False), (4, False), (2, True)])
def test_trainer_gradients_equal_stock_trl_on_qwen3_5(tmp_path, monkeypatch, accumulation, lora):
    """TreePPOTrainer on a tiny Qwen3.5 (Gated DeltaNet + attention) against stock GRPOTrainer: fp32, SGD,
    two optimizer steps with moving, clipped ratios and KL. Tolerance 3e-4 instead of attention models' 1e-4:
    the decay gates' gradients (in_proj_a, A_log, dt_bias) pass through exp(cumsum) in the float32 kernel and
    differ by up to 1.4e-4 between the two exact computations (every other tensor <= 1e-4). lr 0.1, not the
    attention tests' 2.0: with a third of the tokens clipped at step 2, that rounding flips clip decisions
    (seen 9e-4 at lr 0.5, 7e-5 at lr 0.1)."""
    import test_trainer
    from test_trainer import MOVING, assert_same_gradients

    from trl_dta.testing.grpo import tiny_tokenizer

    monkeypatch.setattr(test_trainer, "TOL", 3e-4)

    tokenizer = tiny_tokenizer()
    name, settings_ = CONFIGS["qwen3_5"]
    config = getattr(transformers, name)(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, tie_word_embeddings=False,
        initializer_range=0.2, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None, **settings_,
    )  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path / "qwen3_5"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    batch = dict(per_device_train_batch_size=8 // accumulation, gradient_accumulation_steps=accumulation)
    if lora:
        from peft import LoraConfig

        batch["peft_config"] = LoraConfig(
            r=4, lora_alpha=8, target_modules=["in_proj_qkv", "out_proj", "q_proj"], init_lora_weights=False
        )
    stock_logs, _ = assert_same_gradients(
        tmp_path, str(path), beta=0.04, **batch, **{**MOVING, "learning_rate": 0.1}
    )
    assert stock_logs[1]["clip_ratio/region_mean"] > 0


@needs_state_api
@pytest.mark.usefixtures("fp64_state_kernels")
@pytest.mark.parametrize("block_size", [2, 1000])
def test_moe_aux_loss_with_one_token_nodes(block_size):
    """Qwen3-Next (MoE + Gated DeltaNet): the load-balancing loss's gradient and value through the walk, with
    one-token nodes whose token each child forwards again (its router term is taken once)."""
    from test_router_loss import dense, tree

    name, settings_ = CONFIGS["qwen3_next"]
    config = getattr(transformers, name)(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, tie_word_embeddings=False,
        initializer_range=0.3, pad_token_id=None, **{**settings_, "mlp_only_layers": []}, num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, router_aux_loss_coef=0.001,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="eager")
    model = model.to(torch.float64).eval()
    seqs = ONE_TOKEN_NODES
    loss_fn = loss_fn_for(seqs, use_entropy=True)
    ref, ref_aux = dense(model, seqs, loss_fn)
    got, got_aux = tree(TreeExecutor(model, block_size=block_size, batch_tokens=0), model, seqs, loss_fn)
    # (router probabilities summed in float32 in another order, as in test_router_loss.py: fp32's bound)
    assert got_aux == pytest.approx(ref_aux, rel=1e-5)
    assert max_rel_diff(got, ref) <= GRAD_TOL


@needs_state_api
@pytest.mark.parametrize("family", ["qwen3_5", "mamba2"])
def test_bf16_autocast_error_is_that_of_dense(family):
    """Under bf16 autocast the walk (states handed on in float32) is as close to the float32 gradients as
    the dense bf16 computation is."""
    model = hybrid_model(family, dtype=torch.float32)
    seqs = [[5, 6, 7, 8, 9, 10, 11, 12], [5, 6, 7, 8, 9, 13], [5, 6, 7, 14, 15, 16, 17, 18, 19], [5, 6, 7]]
    loss_fn = loss_fn_for(seqs, use_entropy=False)
    ref, _ = dense_grads(model, seqs, loss_fn)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        dense_bf16, _ = dense_grads(model, seqs, loss_fn)
        model.zero_grad(set_to_none=True)
        TreeExecutor(model, block_size=3).backward(PrefixTrie.from_sequences(seqs), loss_fn)
    tree_bf16 = grads_of(model)
    dense_err, tree_err = max_rel_diff(dense_bf16, ref), max_rel_diff(tree_bf16, ref)
    assert 0 < dense_err < 0.2  # bf16 really ran
    assert tree_err <= 2 * dense_err


@pytest.mark.skipif(HAS_STATE_API, reason="this transformers has the cache state API")
def test_old_transformers_names_the_version():
    """On transformers < 5.21, a model that reads a carried state is refused, naming the version it needs."""
    with pytest.raises(UnsupportedModelError, match=f"upgrade transformers to >= {STATE_API_VERSION}"):
        TreeExecutor(hybrid_model("qwen3_5"))
