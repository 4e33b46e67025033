"""Every refusal that depends only on the model, its tokenizer and the arguments is raised when a trainer is
built, by its ``__init__``, before any generation or step (trl_dta/train/refusals.py,
trl_dta/walk/adapter/preflight.py): one test per refusal, in each trainer it applies to. A trainer that is
built fine with the same model and settings made right shows the refusal is the setting's, not the
fixture's."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface, GPT2Config, GPT2LMHeadModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from trl_dta import (
    AsyncTreePPOConfig,
    AsyncTreePPOTrainer,
    TreePPOConfig,
    TreePPOTrainer,
    TreeSFTConfig,
    TreeSFTTrainer,
    UnsupportedModelError,
)
from trl_dta.testing.async_grpo import NoWeightTransfer, QueueWorker
from trl_dta.testing.grpo import make_config, make_dataset, reward_fn, tiny_model, tiny_tokenizer
from trl_dta.testing.sft import make_sft_config, tool_conversations

SLIDING = dict(sliding_window=16, use_sliding_window=True, max_window_layers=0,
               layer_types=["sliding_attention", "sliding_attention"])  # fmt: skip


def ppo(tmp_path, model, tokenizer=None, **overrides):
    config = make_config(tmp_path, config_cls=TreePPOConfig, max_steps=1, **overrides)
    return TreePPOTrainer(
        model=model, reward_funcs=reward_fn, args=config, train_dataset=make_dataset(2),
        processing_class=tokenizer or tiny_tokenizer(),
    )  # fmt: skip


def sft(tmp_path, model, tokenizer=None, **overrides):
    config = make_sft_config(tmp_path, config_cls=TreeSFTConfig, **overrides)
    return TreeSFTTrainer(
        model=model, args=config, train_dataset=tool_conversations(2),
        processing_class=tokenizer or tiny_tokenizer(),
    )  # fmt: skip


def async_ppo(tmp_path, model, tokenizer=None, **overrides):
    """The asynchronous trainer loads its policy by path: ``model`` is saved first."""
    path = tmp_path / "policy"
    model.save_pretrained(path)
    kw = dict(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1, bf16=False,
              use_cpu=True, report_to=[], save_strategy="no", max_completion_length=32)  # fmt: skip
    kw.update(overrides)
    return AsyncTreePPOTrainer(
        str(path), reward_funcs=reward_fn, args=AsyncTreePPOConfig(**kw),
        processing_class=tokenizer or tiny_tokenizer(), train_dataset=make_dataset(2),
        rollout_worker=QueueWorker([]), weight_transfer=NoWeightTransfer(),
    )  # fmt: skip


TRAINERS = {"ppo": ppo, "sft": sft, "async": async_ppo}
# each trainer's option that bounds its sequences' length
LENGTH = {"ppo": "max_completion_length", "sft": "max_length", "async": "max_completion_length"}


@pytest.fixture
def custom_attention():
    """An attention registered through transformers' AttentionInterface (sdpa under another name)."""
    AttentionInterface.register("my_attention", sdpa_attention_forward)
    yield "my_attention"
    AttentionInterface._global_mapping.pop("my_attention", None)


@pytest.mark.parametrize("kind", ["ppo", "sft"])
def test_an_attention_backend_the_walk_does_not_run(tmp_path, kind, custom_attention):
    with pytest.raises(
        UnsupportedModelError, match="attention implementation 'my_attention' is not supported"
    ):
        TRAINERS[kind](tmp_path, tiny_model(attn=custom_attention))


def test_an_attention_backend_the_walk_does_not_run_async(tmp_path, custom_attention):
    """The asynchronous trainer loads its model itself; its attention is the config's (checked there)."""
    with pytest.raises(ValueError, match="tree_attn_implementation='my_attention' is not supported"):
        async_ppo(tmp_path, tiny_model(), tree_attn_implementation=custom_attention)


@pytest.mark.parametrize("kind", ["ppo", "sft", "async"])
def test_a_sliding_window_shorter_than_the_sequences(tmp_path, kind):
    """PPO: max_completion_length after a prompt of one token or more; SFT: the longest tokenized sample
    (each of the SFT fixture's samples is longer than the 16-token window; max_length truncates them)."""
    length = {LENGTH[kind]: 128}
    with pytest.raises(UnsupportedModelError, match=rf"sliding window \(16 tokens\).*Lower {LENGTH[kind]}"):
        TRAINERS[kind](tmp_path, tiny_model(**SLIDING), **length)
    TRAINERS[kind](tmp_path / "fits", tiny_model(**SLIDING), **{LENGTH[kind]: 12})


def test_sft_samples_shorter_than_a_window_train_whatever_max_length_allows(tmp_path):
    """SFT knows its samples when it is built: a window longer than every tokenized sample is fine, even
    where max_length (TRL's default 1024) would allow longer ones."""
    window = dict(SLIDING, sliding_window=600)  # (the longest sample: 578 tokens)
    trainer = sft(tmp_path, tiny_model(**window), max_length=1024)
    assert trainer.args.max_length == 1024


@pytest.mark.parametrize("kind", ["ppo", "sft", "async"])
def test_dropout_left_on(tmp_path, kind):
    with pytest.raises(ValueError, match=r"randomness is on in train mode \(.*attention_dropout"):
        TRAINERS[kind](tmp_path, tiny_model(attention_dropout=0.1), disable_dropout=False)
    trainer = TRAINERS[kind](tmp_path / "disabled", tiny_model(attention_dropout=0.1), disable_dropout=True)
    assert trainer.model.config.attention_dropout == 0


@pytest.mark.parametrize("kind", ["ppo", "sft", "async"])
def test_a_tokenizer_larger_than_the_vocabulary(tmp_path, kind):
    tokenizer = tiny_tokenizer()
    small = tiny_model(tokenizer, vocab_size=len(tokenizer) - 3)
    with pytest.raises(
        ValueError, match=rf"the tokenizer has {len(tokenizer)} ids, but the model's vocabulary"
    ):
        TRAINERS[kind](tmp_path, small, tokenizer)


def gpt2(tokenizer, positions: int):
    config = GPT2Config(
        vocab_size=len(tokenizer), n_positions=positions, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(config)
    model.config._attn_implementation = "sdpa"
    return model


@pytest.mark.parametrize("kind", ["ppo", "sft", "async"])
def test_sequences_longer_than_learned_positions(tmp_path, kind):
    tokenizer = tiny_tokenizer()
    with pytest.raises(ValueError, match=rf"learned position embeddings cover; lower {LENGTH[kind]}"):
        TRAINERS[kind](tmp_path, gpt2(tokenizer, positions=16), tokenizer, **{LENGTH[kind]: 100})


@pytest.mark.parametrize("kind", ["ppo", "sft", "async"])
def test_dynamic_rope_past_its_original_context(tmp_path, kind):
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    model = tiny_model(rope_parameters=rope, max_position_embeddings=16)
    with pytest.raises(UnsupportedModelError, match=r"original context \(16\) with 'dynamic' RoPE"):
        TRAINERS[kind](tmp_path, model, **{LENGTH[kind]: 100})


@pytest.mark.parametrize("kind", ["ppo", "sft"])
def test_flex_attention_on_cpu(tmp_path, kind):
    with pytest.raises(UnsupportedModelError, match="flex_attention' is supported on CUDA only"):
        TRAINERS[kind](tmp_path, tiny_model(attn="flex_attention"))


def test_a_layer_state_the_walk_does_not_carry(tmp_path):
    """Layer types whose cache the walk does not manage (here a sparse-attention indexer's) are refused from
    the config, in each trainer that takes a model object."""
    model = tiny_model()
    model.config.layer_types = ["full_attention", "indexed_attention"]
    for kind in ("ppo", "sft"):
        with pytest.raises(UnsupportedModelError, match="indexed_attention"):
            TRAINERS[kind](tmp_path / kind, model)


def test_a_model_that_ignores_the_cache_is_refused_by_the_probe_at_construction(tmp_path, monkeypatch):
    """The probe's forwards run when the trainer is built: a decoder that drops the passed cache."""
    model = tiny_model()
    decoder = model.model
    original = type(decoder).forward

    def forward(self, input_ids=None, cache=None, past_key_values=None, **kwargs):
        return original(self, input_ids, **kwargs)  # (the passed cache dropped)

    monkeypatch.setattr(decoder, "forward", forward.__get__(decoder))
    for kind in ("ppo", "sft"):
        with pytest.raises(UnsupportedModelError, match="ignores the passed KV cache"):
            TRAINERS[kind](tmp_path / kind, model)


def test_a_reference_model_is_checked_too(tmp_path, model_dir, custom_attention, monkeypatch):
    """With beta > 0 TRL loads a reference model from the policy's path; the walk computes its log-probs,
    so it is checked when the trainer is built, like the policy (here its attention is one the walk does
    not run)."""
    import trl.trainer.grpo_trainer as grpo
    from transformers import AutoModelForCausalLM

    load = grpo.create_model_from_path

    def reference(*args, **kwargs):
        model = load(*args, **kwargs)
        model.config._attn_implementation = custom_attention
        return model

    monkeypatch.setattr(grpo, "create_model_from_path", reference)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
    with pytest.raises(UnsupportedModelError, match="my_attention"):
        ppo(tmp_path, policy, beta=0.1)


def test_a_model_not_yet_on_its_device_is_checked_without_forwards():
    """Under DeepSpeed or FSDP a model loaded on the CPU reaches its GPU only when the Trainer prepares it:
    its structure is checked when built, the probe's forwards wait for the first walk, on the device."""
    from trl_dta.walk.adapter.preflight import preflight

    preflight(tiny_model(attn="flex_attention"), probe=False)  # (flex attention runs on CUDA)
    with pytest.raises(UnsupportedModelError, match="my_attention"):
        model = tiny_model()
        model.config._attn_implementation = "my_attention"
        preflight(model, probe=False)


def test_the_first_walk_takes_the_verdict_of_the_construction_probe(monkeypatch):
    """A trainer probes its models when it is built; the executor built at its first step takes that verdict
    instead of probing again, once, and probes again where the model changed in between (cast, another
    attention backend, modules added)."""
    import trl_dta.walk.adapter.model as walk_model
    from trl_dta import TreeExecutor
    from trl_dta.walk.adapter.preflight import preflight

    probes = []
    real = walk_model.run_probe
    monkeypatch.setattr(walk_model, "run_probe", lambda lm, **tries: probes.append(1) or real(lm, **tries))
    model = tiny_model()
    preflight(model)
    assert len(probes) == 1
    lm = TreeExecutor(model).lm
    assert lm.can_pack and lm.segment_attention and len(probes) == 1  # (the verdict taken)
    assert TreeExecutor(model).lm.can_pack and len(probes) == 2  # (taken once)
    preflight(model)
    model.double()
    TreeExecutor(model)
    assert len(probes) == 4  # (cast since: probed again)
    preflight(model)
    model.set_attn_implementation("eager")
    TreeExecutor(model)
    assert len(probes) == 6  # (another attention backend: probed again)
    preflight(model)
    model.model.layers[0].mlp.added = torch.nn.Identity()  # (as an adapter injected in place would)
    TreeExecutor(model)
    assert len(probes) == 8  # (modules added: probed again)
