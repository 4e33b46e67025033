"""What the executor refuses (clear errors, never a wrong gradient) and the settings it works around."""

from __future__ import annotations

import pytest
import torch
from conftest import dense_grads, grads_of, make_model, max_rel_diff

from trl_dta import PrefixTrie, TreeExecutor, UnsupportedModelError

pytestmark = pytest.mark.usefixtures("fp64_exact")  # HF's float32 casts kept in float64

SEQS = [[1, 2, 3, 4, 5], [1, 2, 3, 6], [1, 2, 7, 8, 9, 10]]


def loss_fn(i, logps, entropies):
    return -(logps * (i + 1)).sum()


def test_active_dropout_is_refused():
    model = make_model("qwen3", "sdpa", attention_dropout=0.1).train()
    executor = TreeExecutor(model)  # construction probes in eval mode and restores train mode
    assert model.training
    with pytest.raises(ValueError, match="randomness is on in train mode"):
        executor.backward(PrefixTrie.from_sequences(SEQS), loss_fn)
    model.eval()
    executor.backward(PrefixTrie.from_sequences(SEQS), loss_fn)  # fine without dropout


def test_dropout_module_is_refused_in_train_mode():
    model = make_model("llama", "sdpa")
    model.model.layers[0].mlp.act_fn = torch.nn.Sequential(torch.nn.SiLU(), torch.nn.Dropout(0.2))
    executor = TreeExecutor(model.train())
    with pytest.raises(ValueError, match="layers.0.mlp.act_fn.1"):
        executor.logprobs(PrefixTrie.from_sequences(SEQS))


def test_gradient_checkpointing_is_suspended_and_restored():
    model = make_model("qwen3", "sdpa").train()
    model.gradient_checkpointing_enable()
    ref, _ = dense_grads(model, SEQS, loss_fn)
    executor = TreeExecutor(model, block_size=2)
    model.zero_grad(set_to_none=True)
    executor.backward(PrefixTrie.from_sequences(SEQS), loss_fn)
    assert max_rel_diff(grads_of(model), ref) < 1e-10
    assert all(layer.gradient_checkpointing for layer in model.model.layers)


def test_unsupported_attention_implementation():
    model = make_model("qwen3", "sdpa")
    model.config._attn_implementation = "sdpa_paged"
    with pytest.raises(UnsupportedModelError, match="attention implementation 'sdpa_paged'"):
        TreeExecutor(model)
    model.config._attn_implementation = "flex_attention"  # supported on CUDA only (no flex backward on CPU)
    with pytest.raises(UnsupportedModelError, match="flex_attention.*CUDA only"):
        TreeExecutor(model)


def test_router_grad_is_refused_for_a_dense_model():
    """MoE router losses are supported (tests/test_router_loss.py); a dense model has no router to read."""
    with pytest.raises(ValueError, match="no MoE router"):
        TreeExecutor(make_model("qwen3", "sdpa")).backward(
            PrefixTrie.from_sequences(SEQS), loss_fn, router_grad={}
        )


def test_sequences_longer_than_sliding_window_are_refused():
    model = make_model("qwen3", "sdpa", use_sliding_window=True, sliding_window=5, max_window_layers=0)
    executor = TreeExecutor(model)
    with pytest.raises(UnsupportedModelError, match="sliding window"):
        executor.backward(PrefixTrie.from_sequences(SEQS), loss_fn)
    executor.logprobs(PrefixTrie.from_sequences([[1, 2, 3], [1, 2, 4, 5]]))  # within the window: fine


def test_model_without_lm_head_is_refused():
    model = make_model("qwen3", "sdpa").model  # the bare decoder
    with pytest.raises(UnsupportedModelError, match="not a decoder"):
        TreeExecutor(model)


def test_bad_arguments():
    model = make_model("qwen3", "sdpa")
    with pytest.raises(ValueError, match="block_size"):
        TreeExecutor(model, block_size=0)
    executor = TreeExecutor(model)
    trie = PrefixTrie.from_sequences(SEQS)
    with pytest.raises(ValueError, match="temperature"):
        executor.logprobs(trie, temperature=0.0)
    with pytest.raises(ValueError, match="scalar"):
        executor.backward(trie, lambda i, lp, ent: lp)


def test_probe_catches_a_logit_transform_not_reproduced():
    """The executor applies the config's soft-capping; a model that does not is caught by the probe."""
    model = make_model("qwen3", "sdpa")
    executor = TreeExecutor(model)
    model.config.final_logit_softcapping = 2.0  # the model itself does not apply it: the probe must object
    with pytest.raises(UnsupportedModelError, match="dense forward"):
        TreeExecutor(model)
    executor.lm.probe()  # the executor made before the change still matches the model


def test_a_model_failing_on_a_given_cache_is_refused_by_type(monkeypatch):
    """Whatever a model raises on the walk's cache becomes an UnsupportedModelError naming the failure; the
    walk's own refusals pass through unchanged (told apart by type, not by where they were raised)."""
    from trl_dta.walk.adapter.model import CausalLM

    forward = CausalLM.forward

    def failing(self, input_ids, start, *args, **kwargs):
        if start:  # only a forward on a cached prefix fails
            raise IndexError("index 7 is out of bounds")
        return forward(self, input_ids, start, *args, **kwargs)

    monkeypatch.setattr(CausalLM, "forward", failing)
    with pytest.raises(UnsupportedModelError, match="fails when run on a given KV cache .IndexError"):
        TreeExecutor(make_model("qwen3", "sdpa"))

    def refusing(self, input_ids, start, *args, **kwargs):
        raise UnsupportedModelError("a refusal of the walk's own")

    monkeypatch.setattr(CausalLM, "forward", refusing)
    with pytest.raises(UnsupportedModelError, match="^a refusal of the walk's own$"):
        TreeExecutor(make_model("qwen3", "sdpa"))
