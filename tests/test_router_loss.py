"""MoE load-balancing loss through the tree walk, against the dense computation TRL does: the model's own
forward of every sequence with its router logits, then Mixtral's ``load_balancing_loss_func`` over all of
them (float64, with HF's float32 RMSNorm cast kept in float64)."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, _rmsnorm_in_input_dtype, grads_of, max_rel_diff
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_executor import loss_fn_for, shared_prefix_sequences
from transformers import AutoModelForCausalLM, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
from transformers.models.qwen3_moe import modeling_qwen3_moe

from trl_dta import PrefixTrie, TreeExecutor
from trl_dta.train.load_balancing import load_balancing_loss, node_weights

pytestmark = pytest.mark.usefixtures("fp64_exact")  # HF's float32 casts kept in float64

COEF = 0.5  # large, so that the aux gradient is a visible part of the total


def moe_model(attn="sdpa", dtype=torch.float64):
    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=2,
        decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True, router_aux_loss_coef=0.001,
        max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.3, rms_norm_eps=1e-6,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, experts_implementation="eager")
    return model.to(dtype).eval()  # eager experts: the grouped-mm kernel has no float64


@pytest.fixture(autouse=True)
def moe_norm_in_fp64(monkeypatch):
    monkeypatch.setattr(modeling_qwen3_moe.Qwen3MoeRMSNorm, "forward", _rmsnorm_in_input_dtype)


def dense(model, seqs, loss_fn):
    """Gradients and value of sum_i loss_fn(i) + COEF * aux(all sequences), by per-sequence forwards."""
    model.zero_grad(set_to_none=True)
    losses, routers = [], []
    for i, seq in enumerate(seqs):
        ids = torch.as_tensor(seq)[None]
        out = model(input_ids=ids, output_router_logits=True)
        lsm = torch.log_softmax(out.logits[0, :-1], dim=-1)
        lp = lsm.gather(-1, ids[0, 1:, None]).squeeze(-1)
        losses.append(loss_fn(i, lp, -(lsm.exp() * lsm).sum(-1)))
        routers.append(out.router_logits)
    layers = tuple(torch.cat(per_layer) for per_layer in zip(*routers, strict=True))
    config = model.config
    aux = load_balancing_loss_func(layers, config.num_experts, config.num_experts_per_tok)
    (torch.stack(losses).sum() + COEF * aux).backward()
    return grads_of(model), aux.item()


def tree(executor, model, seqs, loss_fn):
    trie = PrefixTrie.from_sequences(seqs)
    stats = executor.router_stats(trie)
    aux, v = load_balancing_loss(stats, node_weights(trie, range(len(seqs))), model.config.num_experts)
    model.zero_grad(set_to_none=True)
    executor.backward(trie, loss_fn, entropies=True, router_grad={n: COEF * x for n, x in v.items()})
    return grads_of(model), float(aux)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seqs=shared_prefix_sequences(max_sequences=7, max_len=16),
    block_size=st.sampled_from([3, 1000]),
    pack=st.booleans(),
)
def test_aux_loss_gradients_equal_dense(seqs, block_size, pack):
    model = moe_model()
    loss_fn = loss_fn_for(seqs, use_entropy=True)
    ref, ref_aux = dense(model, seqs, loss_fn)
    executor = TreeExecutor(model, block_size=block_size, pack_leaves=pack)
    got, got_aux = tree(executor, model, seqs, loss_fn)
    # Mixtral's function sums router probabilities in float32 even for a float64 model (the walk does the
    # same, to match TRL, in another order), so the aux part is exact to float32 rounding only (seen: 2e-7
    # on its value, 3e-6 on the router weights, whose gradient is all aux): fp32's parity bound for the
    # value; a missing or miscounted aux term is off by 1e-3 or more
    assert got_aux == pytest.approx(ref_aux, rel=1e-5)
    assert max_rel_diff(got, ref) <= 2e-5
    # the aux term is really part of what was compared: the router weights get a gradient only from it
    routers = [n for n in ref if "mlp.gate.weight" in n]
    assert routers and all(ref[n].abs().max() > 0 for n in routers)


def test_without_router_grad_the_aux_term_is_absent():
    """Mutation check: the same walk without router_grad differs from the dense aux gradient."""
    seqs = [[1, 2, 3, 4, 5], [1, 2, 3, 9, 8, 7], [1, 2, 6]]
    model = moe_model()
    loss_fn = loss_fn_for(seqs, use_entropy=False)
    ref, _ = dense(model, seqs, loss_fn)
    model.zero_grad(set_to_none=True)
    TreeExecutor(model, block_size=4).backward(PrefixTrie.from_sequences(seqs), loss_fn)
    assert max_rel_diff(grads_of(model), ref) > 1e-3


def test_router_stats_refused_for_a_dense_model():
    from conftest import cached_model

    with pytest.raises(ValueError, match="no MoE router"):
        TreeExecutor(cached_model("qwen3", "sdpa")).router_stats(PrefixTrie.from_sequences([[1, 2, 3]]))


# ------------------------------------------------------------------------------------------------------------
# End to end: TreePPOTrainer against stock GRPOTrainer on a tiny Qwen3-MoE, aux loss on
# ------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from transformers import Qwen3MoeForCausalLM

    from trl_dta.testing.grpo import tiny_tokenizer

    tok = tiny_tokenizer()
    config = Qwen3MoeConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        initializer_range=0.2,
        rms_norm_eps=1e-6,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen3MoeForCausalLM(config)
    path = tmp_path_factory.mktemp("tiny_qwen3_moe")
    model.save_pretrained(path)
    return str(path)


def test_trainer_aux_loss_gradients_equal_stock_trl(tmp_path, moe_dir):
    from test_trainer import MOVING, assert_same_gradients

    # TRL turns the load-balancing loss on from the model's own coefficient; a large one makes it visible
    stock_logs, tree_logs = assert_same_gradients(tmp_path, moe_dir, router_aux_loss_coef=0.5, **MOVING)
    for step in range(2):
        assert tree_logs[step]["aux_loss"] == pytest.approx(stock_logs[step]["aux_loss"], rel=1e-5)
    assert stock_logs[0]["aux_loss"] > 0
