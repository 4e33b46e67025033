"""TreePPOTrainer against stock GRPOTrainer: same initial weights, same scripted batches (prompt and a first
tool-call turn shared within each group), same gradients at every optimizer step, in float32."""

from __future__ import annotations

import pytest
import torch
from conftest import max_rel_diff
from transformers import MixtralConfig, MixtralForCausalLM, OPTConfig, OPTForCausalLM
from trl import GRPOConfig

from trl_dta import PrefixTrie, TreePPOConfig, TreePPOTrainer
from trl_dta.testing.grpo import (
    GradRecorder,
    ScriptedGenerationMixin,
    ScriptedGRPOTrainer,
    make_config,
    make_trainer,
    tiny_model,
    tiny_tokenizer,
)
from trl_dta.train.ppo.losses import LOSS_TYPES
from trl_dta.train.ppo.rows import batch_rows

TreeScripted = type("TreeScripted", (ScriptedGenerationMixin, TreePPOTrainer), {})
TOL = 1e-4  # per tensor max|diff| / max|reference|, fp32


def train(trainer_cls, config_cls, model, tmp_path, peft_config=None, num_prompts=2, **overrides):
    recorder = GradRecorder()
    config = make_config(tmp_path / trainer_cls.__name__, config_cls=config_cls, **overrides)
    trainer = make_trainer(trainer_cls, config, model=model, callbacks=[recorder], peft_config=peft_config,
                           num_prompts=num_prompts)  # fmt: skip
    trainer.train()
    return trainer, recorder.grads


def assert_same_gradients(tmp_path, model, peft_config=None, **overrides):
    stock, ref = train(ScriptedGRPOTrainer, GRPOConfig, model, tmp_path, peft_config, **overrides)
    tree, got = train(TreeScripted, TreePPOConfig, model, tmp_path, peft_config, **overrides)
    assert tree._schedule is None or not tree._schedule._walked  # every walked micro-batch was served
    assert len(ref) == len(got) == overrides.get("max_steps", 2)
    for step, (g, r) in enumerate(zip(got, ref, strict=True)):
        if overrides.get("loss_type") == "vespo" and step > 0:
            # VESPO's weights shrink later steps' gradients (here ~30x, ratios moved by lr 2.0) into sums of
            # terms that nearly cancel: their fp32 rounding is measured against the first step's scale
            assert all((g[n] - r[n]).abs().max() <= TOL * ref[0][n].abs().max() for n in r), f"step {step}"
            continue
        assert max_rel_diff(g, r) <= TOL, f"step {step}"
    return stock.state.log_history, tree.state.log_history


# lr large enough that the second step's ratios move and get clipped
MOVING = dict(learning_rate=2.0, max_steps=2, num_iterations=2)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_gradients_equal_stock_trl_for_each_loss_type(tmp_path, model_dir, loss_type):
    stock_logs, tree_logs = assert_same_gradients(tmp_path, model_dir, loss_type=loss_type, **MOVING)
    if loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        assert stock_logs[1]["clip_ratio/region_mean"] > 0  # clipping is really exercised at step 2
    for key in ("loss", "entropy", "reward"):
        assert tree_logs[0][key] == pytest.approx(stock_logs[0][key], rel=1e-4, abs=1e-6)
    assert tree_logs[0]["tree/dedup_ratio"] > 2.0
    assert (
        1.0 < tree_logs[0]["tree/flop_ratio"] and tree_logs[0]["tree/calls"] >= 2
    )  # a forward and a backward
    assert tree_logs[0]["tree/tokens_per_call"] > 1.0
    kernels = {k: v for k, v in tree_logs[0].items() if k.startswith("tree/attention_calls/")}
    assert list(kernels) == ["tree/attention_calls/sdpa_segments"] and kernels[next(iter(kernels))] >= 2


@pytest.mark.parametrize(
    "options",
    [
        dict(beta=0.04),
        dict(beta=0.04, use_bias_correction_kl=True, importance_sampling_level="sequence"),
        dict(top_entropy_quantile=0.5, loss_type="bnpo"),
        dict(entropy_coef=0.01, off_policy_mask_threshold=0.01, delta=1.5, epsilon_high=0.3),
        dict(mask_truncated_completions=True, temperature=0.7),
    ],
    ids=[
        "kl",
        "kl-bias-sequence",
        "entropy-quantile",
        "entropy-bonus-opsm-delta",
        "mask-truncated-temperature",
    ],
)
def test_gradients_equal_stock_trl_for_options(tmp_path, model_dir, options):
    stock_logs, _ = assert_same_gradients(tmp_path, model_dir, **{**MOVING, **options})
    if options.get("beta"):
        assert stock_logs[1]["kl"] > 0  # the KL term has a gradient at step 2


def test_lora_gradients_equal_stock_trl(tmp_path, model_dir):
    from peft import LoraConfig

    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
    )
    assert_same_gradients(tmp_path, model_dir, peft_config=lora, beta=0.04, **MOVING)


def test_dense_logprob_path_never_called(tmp_path, model_dir, monkeypatch):
    from trl import GRPOTrainer

    def forbidden(*args, **kwargs):
        raise AssertionError("the dense log-prob path was called")

    monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", forbidden)
    train(TreeScripted, TreePPOConfig, model_dir, tmp_path, beta=0.04, **MOVING)


def test_gradient_self_check_passes_and_gradient_checkpointing_is_handled(tmp_path, model_dir):
    tree, got = train(TreeScripted, TreePPOConfig, model_dir, tmp_path, tree_check_gradients=True,
                      gradient_checkpointing=True, **MOVING)  # fmt: skip
    _, ref = train(ScriptedGRPOTrainer, GRPOConfig, model_dir, tmp_path, **MOVING)
    for g, r in zip(got, ref, strict=True):
        assert max_rel_diff(g, r) <= TOL
    assert tree.model.is_gradient_checkpointing  # on during training, suspended only inside the walk
    checks = [h["tree/check_error"] for h in tree.state.log_history if "tree/check_error" in h]
    assert len(checks) == 1 and checks[0] <= TOL  # the self-check ran, once, and passed


def test_bad_settings_are_refused(tmp_path, model_dir):
    with pytest.raises(ValueError, match="tree_block_size"):
        make_config(tmp_path, config_cls=TreePPOConfig, tree_block_size=0)
    config = make_config(tmp_path, config_cls=TreePPOConfig, disable_dropout=False)
    model = tiny_model(seed=0, attention_dropout=0.1)
    with pytest.raises(ValueError, match="randomness is on in train mode"):  # (when built)
        make_trainer(TreeScripted, config, model=model)


def _opt(**overrides):
    """OPT with its config's default dropout (0.1), applied by nn.functional.dropout: TRL's disable_dropout
    (nn.Dropout modules only) leaves it on."""
    tokenizer = tiny_tokenizer()
    config = OPTConfig(vocab_size=len(tokenizer), hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                       num_attention_heads=4, word_embed_proj_dim=32, max_position_embeddings=2048,
                       init_std=0.2, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                       bos_token_id=tokenizer.eos_token_id, **overrides)  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return OPTForCausalLM(config)


def _mixtral_with_jitter():
    tokenizer = tiny_tokenizer()
    config = MixtralConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                           num_local_experts=4, num_experts_per_tok=2, initializer_range=0.2,
                           sliding_window=None, router_jitter_noise=0.5, pad_token_id=tokenizer.pad_token_id,
                           eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return MixtralForCausalLM(config)


@pytest.mark.parametrize("build", [_opt, _mixtral_with_jitter], ids=["opt dropout", "mixtral router jitter"])
def test_randomness_held_as_numbers_is_turned_off_by_disable_dropout(tmp_path, build):
    """disable_dropout=True also zeroes what TRL's does not see (OPT's functional dropout, Mixtral's router
    jitter); the walk's gradients then equal the dense ones (the self-check). Without it: a clear refusal."""
    model = build()
    trainer, _ = train(TreeScripted, TreePPOConfig, model, tmp_path, tree_check_gradients=True, max_steps=1)
    checks = [h["tree/check_error"] for h in trainer.state.log_history if "tree/check_error" in h]
    assert len(checks) == 1 and checks[0] <= TOL
    config = make_config(tmp_path / "kept", config_cls=TreePPOConfig, disable_dropout=False, max_steps=1)
    with pytest.raises(
        ValueError, match="randomness is on in train mode.*(dropout = 0.1|jitter_noise = 0.5)"
    ):
        make_trainer(TreeScripted, config, model=build())  # (refused when built)


def test_resume_from_checkpoint_continues_with_same_gradients(tmp_path, model_dir):
    steps = dict(learning_rate=0.5, num_iterations=2, max_steps=4, save_strategy="steps", save_steps=2)
    _, full = train(TreeScripted, TreePPOConfig, model_dir, tmp_path / "full", **steps)
    recorder = GradRecorder()
    config = make_config(tmp_path / "resumed", config_cls=TreePPOConfig, **steps)
    first = make_trainer(TreeScripted, config, model=model_dir)
    first.args.max_steps = 2
    first.train()
    config = make_config(tmp_path / "resumed", config_cls=TreePPOConfig, **steps)
    second = make_trainer(TreeScripted, config, model=model_dir, callbacks=[recorder])
    second.train(resume_from_checkpoint=str(tmp_path / "resumed" / "checkpoint-2"))
    assert len(recorder.grads) == 2
    for g, r in zip(recorder.grads, full[2:], strict=True):
        assert max_rel_diff(g, r) <= TOL


def test_save_and_reload_round_trips(tmp_path, model_dir):
    from transformers import AutoModelForCausalLM

    trainer, _ = train(TreeScripted, TreePPOConfig, model_dir, tmp_path, **MOVING)
    trainer.save_model(str(tmp_path / "final"))
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"))
    for (name, p), (_, q) in zip(trainer.model.named_parameters(), reloaded.named_parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q, rtol=0, atol=0, msg=name)


def test_logs_budgets_retries_and_peak_memory(tmp_path, model_dir):
    """Once per optimizer step: the budgets in use, out-of-memory retries (the retried case:
    tests/test_oom.py) and the walk's peak memory (on CPU the process's resident set, sampled in the walk)."""
    import resource

    trainer, _ = train(TreeScripted, TreePPOConfig, model_dir, tmp_path, tree_block_size=64,
                       tree_batch_tokens=96, tree_subtree_tokens=0, **MOVING)  # fmt: skip
    high_water = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # (Linux: KiB)
    logs = [h for h in trainer.state.log_history if "tree/time_s" in h]
    assert len(logs) == 2
    for h in logs:
        assert (h["tree/block_size"], h["tree/batch_tokens"], h["tree/subtree_tokens"]) == (64, 96, 0)
        assert h["tree/oom_retries"] == 0.0
        # torch alone is resident beyond 50 MB; statm's pages and ru_maxrss's count differ slightly
        assert 50e6 / 2**30 < h["tree/peak_memory_gib"] <= 1.05 * high_water / 2**30


def test_refuses_peft_prompt_learning_at_construction(tmp_path, model_dir):
    from peft import PromptTuningConfig

    from trl_dta import UnsupportedModelError

    config = make_config(tmp_path, config_cls=TreePPOConfig)
    prompt_tuning = PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    with pytest.raises(UnsupportedModelError, match="prompt learning"):
        make_trainer(TreeScripted, config, model=model_dir, peft_config=prompt_tuning)


def test_multimodal_batch_is_refused(tmp_path, model_dir):
    """Images in a training batch must not be dropped silently (TRL passes them to the dense forward)."""
    trainer = make_trainer(TreeScripted, make_config(tmp_path, config_cls=TreePPOConfig), model=model_dir)
    inputs = {"pixel_values": torch.zeros(1, 3, 4, 4), "prompt_ids": torch.ones(1, 3, dtype=torch.long)}
    with pytest.raises(ValueError, match="multimodal inputs \\(pixel_values\\)"):
        trainer.compute_loss(trainer.model, inputs)


# ------------------------------------------------------------------------------------------------------------
# Gradient accumulation: one trie per optimizer step, across TRL's shuffled micro-batches
# ------------------------------------------------------------------------------------------------------------
GA4 = dict(per_device_train_batch_size=2, gradient_accumulation_steps=4)  # a group of 4 over 4 micro-batches


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_step_walk_with_gradient_accumulation_equals_stock_trl(tmp_path, model_dir, loss_type):
    stock_logs, tree_logs = assert_same_gradients(tmp_path, model_dir, loss_type=loss_type, **MOVING, **GA4)
    if loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        assert stock_logs[1]["clip_ratio/region_mean"] > 0
    for key in ("loss", "entropy", "reward"):
        assert tree_logs[0][key] == pytest.approx(stock_logs[0][key], rel=1e-4, abs=1e-6)


@pytest.mark.parametrize(
    "options",
    [
        dict(top_entropy_quantile=0.5, loss_type="bnpo"),
        dict(entropy_coef=0.01, use_adaptive_entropy=True, entropy_target=0.1),
        dict(steps_per_generation=8, max_steps=3, num_prompts=4),  # 2 optimizer steps per generation
    ],
    ids=["bnpo-entropy-quantile", "adaptive-entropy-bonus", "steps-per-generation-8"],
)
def test_step_walk_options_equal_stock_trl(tmp_path, model_dir, options):
    assert_same_gradients(tmp_path, model_dir, **{**MOVING, **GA4, **options})


def test_step_walk_lora_kl_equals_stock_trl(tmp_path, model_dir):
    from peft import LoraConfig

    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
    )
    assert_same_gradients(tmp_path, model_dir, peft_config=lora, beta=0.04, **MOVING, **GA4)


def test_one_walk_per_optimizer_step_forwards_each_unique_token_once(tmp_path, model_dir):
    """With gradient accumulation 4, the step's tokens through the embeddings are the unique tokens of ONE
    trie over all 4 micro-batches (a trie per micro-batch would forward the shared prompt 4 times), and the
    LM head scores only completion positions, each (context, target) pair once."""
    config = make_config(tmp_path, config_cls=TreePPOConfig, num_iterations=1, max_steps=1, **GA4)
    trainer = make_trainer(TreeScripted, config, model=model_dir)
    model = trainer.model
    executor = trainer._executor(model)  # built (and probed) before counting
    model.train()
    executor.lm.check_call(PrefixTrie.from_sequences([[1, 2]]))  # and its train-mode determinism check run
    embedded, head_rows = [], []
    hooks = [
        model.get_input_embeddings().register_forward_hook(lambda m, a, o: embedded.append(a[0].numel())),
        model.get_output_embeddings().register_forward_hook(
            lambda m, a, o: head_rows.append(a[0].shape[:-1].numel())
        ),
    ]
    trainer.train()
    for h in hooks:
        h.remove()
    rows = [r for b in trainer.step_inputs for r in batch_rows(b) if r.completion_length]
    step_trie = PrefixTrie.from_sequences([r.tokens for r in rows])
    per_micro_batch = sum(
        PrefixTrie.from_sequences([r.tokens for r in batch_rows(b) if r.completion_length]).num_unique_tokens
        for b in trainer.step_inputs
    )
    assert len(trainer.step_inputs) == 4
    assert sum(embedded) == step_trie.num_unique_tokens < per_micro_batch
    scored = {tuple(r.tokens[: t + 2]) for r in rows for t in range(r.prompt_length - 1, len(r.tokens) - 1)}
    assert sum(head_rows) == len(scored)
    assert trainer.state.log_history[0]["tree/unique_tokens"] == step_trie.num_unique_tokens


def test_lexicographic_steps_keep_groups_in_one_optimizer_step(tmp_path, model_dir):
    """Opt-in: with 2 optimizer steps per generation, each step gets whole groups (2 of the 4 prompts), and
    its gradients are still exactly TRL's dense loss on those micro-batches (the self-check, at 1e-4)."""
    options = dict(steps_per_generation=8, tree_lexicographic_steps=True, tree_check_gradients=True,
                   tree_check_tolerance=1e-4, **MOVING, **GA4)  # fmt: skip
    trainer, _ = train(TreeScripted, TreePPOConfig, model_dir, tmp_path, num_prompts=4, **options)
    prompts = [{tuple(r.tolist()) for r in b["prompt_ids"]} for b in trainer.step_inputs]
    assert len(prompts[0] | prompts[1] | prompts[2] | prompts[3]) == 2  # step 1: two whole groups
    assert len(prompts[4] | prompts[5] | prompts[6] | prompts[7]) == 2
    assert trainer.state.log_history[0]["tree/check_error"] <= 1e-4


def test_compute_loss_on_a_micro_batch_of_its_own_equals_stock_trl(tmp_path, model_dir):
    """compute_loss called directly (not on TRL's buffered micro-batch) walks that micro-batch alone."""
    stock = make_trainer(ScriptedGRPOTrainer, make_config(tmp_path / "s"), model=model_dir)
    tree = make_trainer(TreeScripted, make_config(tmp_path / "t", config_cls=TreePPOConfig), model=model_dir)
    grads = []
    for trainer in (stock, tree):
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop
        batch = trainer._generate_and_score_completions(trainer.train_dataset.to_list()[:1] * 4)
        loss = trainer.compute_loss(trainer.model, batch)
        trainer.accelerator.backward(loss)
        grads.append({n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None})
    assert max_rel_diff(grads[1], grads[0]) <= TOL


def test_a_step_on_the_dense_path_equals_stock_trl(tmp_path, model_dir):
    """``tree_dense_fallback="always"``: every step takes TRL's own dense loss and backward (what "auto"
    does where the cost model predicts the walk slower): stock TRL's gradients, and ``tree/path`` says so."""
    stock, ref = train(ScriptedGRPOTrainer, GRPOConfig, model_dir, tmp_path, **MOVING, **GA4)
    recorder = GradRecorder()
    config = make_config(tmp_path / "dense", config_cls=TreePPOConfig, tree_dense_fallback="always",
                         **MOVING, **GA4)  # fmt: skip
    trainer = make_trainer(TreeScripted, config, model=model_dir, callbacks=[recorder])
    trainer.train()
    assert len(recorder.grads) == len(ref) == 2
    for g, r in zip(recorder.grads, ref, strict=True):
        assert max_rel_diff(g, r) <= TOL
    paths = [log["tree/path"] for log in trainer.state.log_history if "tree/path" in log]
    assert paths == [1.0, 1.0]
    assert not any("tree/time_s" in log for log in trainer.state.log_history)  # nothing walked
    timed = [log["tree/dense_s"] for log in trainer.state.log_history if "tree/dense_s" in log]
    assert len(timed) == 1 and timed[0] > 0  # (the first dense step, measured; logged at the next decision)
