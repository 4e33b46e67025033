"""TreeSFTTrainer against stock trl.SFTTrainer: the same gradients at every optimizer step (fp32, SGD, 2 steps
of 2 accumulated micro-batches, <= 1e-4 per tensor) and the same logged metrics, on tool-calling
conversations (assistant_only_loss), prompt-completion data (completion_only_loss), nll and dft, LoRA,
padding-free and packed batches (walked as their original samples), per-turn samples, duplicates, a hybrid
model; and the settings that are refused."""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset
from trl import SFTConfig, SFTTrainer

from trl_dta import TreeSFTConfig, TreeSFTTrainer
from trl_dta.compare import relative_error
from trl_dta.testing.grpo import GradRecorder, tiny_model, tiny_tokenizer
from trl_dta.testing.sft import make_sft_config, per_turn_samples, prompt_completion, tool_conversations
from trl_dta.walk.adapter.cache import HAS_STATE_API, STATE_API_VERSION

TOL = 1e-4
METRICS = ("loss", "entropy", "mean_token_accuracy", "num_tokens")


def train(cls, tmp_path, dataset, model=None, **overrides):
    """Train ``cls`` (stock or tree) on ``dataset``; return its per-step gradients, log history, trainer."""
    config_cls = TreeSFTConfig if cls is TreeSFTTrainer else SFTConfig
    rec = GradRecorder()
    config = make_sft_config(tmp_path / cls.__name__, config_cls=config_cls, **overrides)
    trainer = cls(model=model if model is not None else tiny_model(), args=config, train_dataset=dataset,
                  processing_class=tiny_tokenizer(), callbacks=[rec])  # fmt: skip
    trainer.train()
    return rec.grads, [h for h in trainer.state.log_history if "loss" in h], trainer


def assert_parity(tmp_path, dataset, model_fn=tiny_model, peft_config=None, tol=TOL, **overrides):
    runs = []
    for cls in (SFTTrainer, TreeSFTTrainer):
        config_cls = TreeSFTConfig if cls is TreeSFTTrainer else SFTConfig
        rec = GradRecorder()
        config = make_sft_config(tmp_path / cls.__name__, config_cls=config_cls, **overrides)
        trainer = cls(model=model_fn(), args=config, train_dataset=dataset, processing_class=tiny_tokenizer(),
                      callbacks=[rec], peft_config=peft_config)  # fmt: skip
        trainer.train()
        runs.append((rec.grads, [h for h in trainer.state.log_history if "loss" in h], trainer))
    (stock, stock_log, _), (tree, tree_log, trainer) = runs
    assert len(stock) == len(tree) == 2
    for step in range(2):
        assert stock[step].keys() == tree[step].keys() and stock[step]
        assert relative_error(tree[step], stock[step]) <= tol, step
    for ref, got in zip(stock_log, tree_log, strict=True):
        for key in METRICS:
            assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-6), key
        if "aux_loss" in ref:  # MoE models
            assert got["aux_loss"] == pytest.approx(ref["aux_loss"], rel=1e-5), "aux_loss"
    return trainer, tree_log


@pytest.mark.parametrize("loss_type", ["nll", "dft"])
def test_tool_conversations_assistant_only(tmp_path, loss_type):
    trainer, log = assert_parity(
        tmp_path, tool_conversations(), assistant_only_loss=True, loss_type=loss_type
    )
    assert log[0]["tree/dedup_ratio"] > 2  # 4 conversations per step share the system turn and tools


def test_prompt_completion_completion_only(tmp_path):
    trainer, log = assert_parity(tmp_path, prompt_completion(), completion_only_loss=True)
    assert trainer.completion_only_loss


def test_full_sequence_loss_without_num_items(tmp_path):
    """The loss on every token, normalised per micro-batch and by the accumulation steps (the Trainer's path
    when the model takes no loss kwargs: num_items_in_batch is None)."""

    def model_without_loss_kwargs():
        model = tiny_model()
        model.accepts_loss_kwargs = False
        return model

    assert_parity(tmp_path, tool_conversations(), model_fn=model_without_loss_kwargs)


@pytest.mark.parametrize("loss_kwargs", [True, False], ids=["num-items", "no-num-items"])
def test_epoch_end_with_fewer_micro_batches(tmp_path, loss_kwargs):
    """6 rows, 2 per micro-batch, accumulation 2: the epoch's second step has one micro-batch (the Trainer's
    current_gradient_accumulation_steps is 1 there)."""

    def model():
        m = tiny_model()
        m.accepts_loss_kwargs = loss_kwargs
        return m

    assert_parity(tmp_path, tool_conversations(6), model_fn=model, max_steps=-1, num_train_epochs=1,
                  assistant_only_loss=True)  # fmt: skip


def test_lora(tmp_path):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    assert_parity(tmp_path, tool_conversations(), peft_config=lora, assistant_only_loss=True)


@pytest.mark.parametrize(
    "options",
    [
        dict(padding_free=True),
        dict(packing=True, max_length=512),
        dict(packing=True, max_length=256, packing_strategy="wrapped"),
    ],  # fmt: skip
    ids=["padding-free", "packing-bfd", "packing-wrapped"],
)
def test_packed_batches_walk_their_samples(tmp_path, options):
    """Padding-free and bfd-packed rows are walked as their samples (each run of position_ids), wrapped rows
    (attended as one sequence by TRL) as rows: TRL's loss either way."""
    trainer, log = assert_parity(tmp_path, tool_conversations(12), **options)
    if options.get("packing_strategy") != "wrapped":
        assert log[0]["tree/dedup_ratio"] > 1.5  # the samples of a packed row share their prompt


def test_per_turn_samples(tmp_path):
    """Each sample a prefix of the next: the trie holds each conversation once."""
    dataset = per_turn_samples(2)  # 2 + 3 assistant turns
    trainer, log = assert_parity(tmp_path, dataset, assistant_only_loss=True, per_device_train_batch_size=1,
                                 gradient_accumulation_steps=2)  # fmt: skip
    assert log[0]["tree/unique_tokens"] < log[0]["tree/tokens"]


def test_duplicates(tmp_path):
    assert_parity(tmp_path, tool_conversations(2, duplicates=6), assistant_only_loss=True)


@pytest.mark.skipif(not HAS_STATE_API, reason=f"carried states need transformers >= {STATE_API_VERSION}")
def test_hybrid_model(tmp_path):
    """Qwen3.5 (Gated DeltaNet + attention): the walk carries the linear-attention states."""
    import transformers

    tok = tiny_tokenizer()

    def qwen3_5():
        config = transformers.Qwen3_5TextConfig(
            vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, tie_word_embeddings=False,
            initializer_range=0.2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            intermediate_size=48,
            linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"],
            pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        )  # fmt: skip
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(config)

    assert_parity(tmp_path, tool_conversations(4), model_fn=qwen3_5, assistant_only_loss=True)


def _qwen3_moe(**overrides):
    import transformers

    tok = tiny_tokenizer()
    config = transformers.Qwen3MoeConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
        num_experts_per_tok=2, max_position_embeddings=2048, tie_word_embeddings=False, initializer_range=0.2,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None, **overrides,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def _gpt_oss(**overrides):
    import transformers

    tok = tiny_tokenizer()
    config = transformers.GptOssConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=1024,
        max_position_embeddings=2048, tie_word_embeddings=False, initializer_range=0.2,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None, **overrides,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize(
    "model_fn,options",
    [(_qwen3_moe, {}), (_qwen3_moe, dict(padding_free=True)), (_gpt_oss, {})],
    ids=["qwen3-moe", "qwen3-moe-padding-free", "gpt-oss"],
)
def test_moe_router_loss_at_trl_default_coefficient(tmp_path, model_fn, options):
    """TRL turns the MoE load-balancing loss on from the model's own coefficient (0.001 for both): the walk
    adds it exactly, each micro-batch's over every token of its rows (prompt and untrained tokens too).
    (gpt-oss padding-free is not compared: stock's eager attention there attends across the samples of a
    flattened row, 1.03 away from stock's padded run, which the walk equals to 2e-6.)"""
    assert model_fn().config.router_aux_loss_coef == 0.001
    trainer, log = assert_parity(tmp_path, tool_conversations(), model_fn=model_fn, assistant_only_loss=True,
                                 **options)  # fmt: skip
    assert trainer.aux_loss_enabled and trainer.router_aux_loss_coef == 0.001
    assert all(h["aux_loss"] > 0 for h in log)  # (compared with stock's in assert_parity)


def test_moe_router_loss_is_part_of_the_gradient(tmp_path):
    """Mutation check for the test above: at a large coefficient the aux term moves the gradient far beyond
    the parity tolerance (so a walk without it would fail), and the walk still equals stock."""
    assert_parity(tmp_path / "large", tool_conversations(), model_fn=_qwen3_moe, assistant_only_loss=True,
                  router_aux_loss_coef=0.5)  # fmt: skip
    with_aux, _, _ = train(SFTTrainer, tmp_path / "with", tool_conversations(), model=_qwen3_moe(),
                           assistant_only_loss=True, router_aux_loss_coef=0.5)  # fmt: skip
    without, _, _ = train(SFTTrainer, tmp_path / "without", tool_conversations(), model=_qwen3_moe(),
                          assistant_only_loss=True, router_aux_loss_coef=0.0)  # fmt: skip
    assert relative_error(without[0], with_aux[0]) > 100 * TOL


def _greedy_dataset(model, tok) -> Dataset:
    """Token rows half of whose tokens are the model's greedy continuation (label = top-1 token), so that
    mean_token_accuracy is neither 0 nor 1."""
    rows = []
    for i in range(4):
        prompt = tok.encode(f"Hi, where is my order A{17 + i}?", add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0].tolist()
        rows.append({"input_ids": out + prompt[: 3 + i]})
    return Dataset.from_list(rows)


def test_token_accuracy_equals_trl(tmp_path):
    tok = tiny_tokenizer()
    dataset = _greedy_dataset(tiny_model(), tok)
    trainer, log = assert_parity(tmp_path, dataset, learning_rate=1e-3)
    assert all(0 < h["mean_token_accuracy"] < 1 for h in log)


def test_tree_check_gradients(tmp_path):
    config = make_sft_config(tmp_path, config_cls=TreeSFTConfig, tree_check_gradients=True, max_steps=1,
                             assistant_only_loss=True)  # fmt: skip
    trainer = TreeSFTTrainer(model=tiny_model(), args=config, train_dataset=tool_conversations(4),
                             processing_class=tiny_tokenizer())  # fmt: skip
    trainer.train()
    error = next(h["tree/check_error"] for h in trainer.state.log_history if "tree/check_error" in h)
    assert 0 <= error <= 1e-5


def test_accuracy_off(tmp_path):
    _, log, _ = train(TreeSFTTrainer, tmp_path, tool_conversations(4), tree_token_accuracy=False)
    assert "mean_token_accuracy" not in log[0] and math.isfinite(log[0]["loss"])


@pytest.mark.parametrize(
    "options,match",
    [
        (dict(label_smoothing_factor=0.1), "label_smoothing_factor"),
        (dict(tree_block_size=0), "tree_block_size"),
    ],
    ids=["label-smoothing", "bad-budget"],
)
def test_refused_settings(tmp_path, options, match):
    with pytest.raises(ValueError, match=match):
        config = make_sft_config(tmp_path, config_cls=TreeSFTConfig, **options)
        TreeSFTTrainer(model=tiny_model(), args=config, train_dataset=tool_conversations(2),
                       processing_class=tiny_tokenizer())  # fmt: skip


def test_refuses_compute_loss_func(tmp_path):
    config = make_sft_config(tmp_path, config_cls=TreeSFTConfig)
    with pytest.raises(ValueError, match="compute_loss_func"):
        TreeSFTTrainer(model=tiny_model(), args=config, train_dataset=tool_conversations(2),
                       processing_class=tiny_tokenizer(), compute_loss_func=lambda *a, **k: 0)  # fmt: skip


def test_logs_budgets_retries_and_peak_memory(tmp_path):
    """The walk's budgets in use, its out-of-memory retries (the retried case: tests/test_oom.py) and its
    peak memory (on CPU the process's resident set, sampled in the walk), as TreePPOTrainer logs them."""
    import resource

    budgets = dict(tree_block_size=64, tree_batch_tokens=96, tree_subtree_tokens=0)
    _, log, _ = train(TreeSFTTrainer, tmp_path, tool_conversations(4), **budgets)
    high_water = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # (Linux: KiB)
    for h in log:
        assert (h["tree/block_size"], h["tree/batch_tokens"], h["tree/subtree_tokens"]) == (64, 96, 0)
        assert h["tree/oom_retries"] == 0.0
        # torch alone is resident beyond 50 MB; statm's pages and ru_maxrss's count differ slightly
        assert 50e6 / 2**30 < h["tree/peak_memory_gib"] <= 1.05 * high_water / 2**30


def test_refuses_peft_prompt_learning_at_construction(tmp_path):
    from peft import PromptTuningConfig

    from trl_dta import UnsupportedModelError

    config = make_sft_config(tmp_path, config_cls=TreeSFTConfig)
    prompt_tuning = PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    with pytest.raises(UnsupportedModelError, match="prompt learning"):
        TreeSFTTrainer(model=tiny_model(), args=config, train_dataset=tool_conversations(2),
                       processing_class=tiny_tokenizer(), peft_config=prompt_tuning)  # fmt: skip


class _Noise(torch.nn.Module):
    """A layer that draws random numbers in train mode, under no name a setting check would find."""

    def forward(self, x):
        return x + 0.1 * torch.randn_like(x) if self.training else x


def test_randomness_no_setting_names_is_refused_at_construction(tmp_path):
    """The behavioural determinism check (two forwards of the same input in train mode), as in
    TreePPOTrainer: a model that draws random numbers is refused before training."""
    model = tiny_model()
    model.model.norm = torch.nn.Sequential(model.model.norm, _Noise())
    config = make_sft_config(tmp_path, config_cls=TreeSFTConfig)
    with pytest.raises(ValueError, match="not deterministic in train mode"):
        TreeSFTTrainer(model=model, args=config, train_dataset=tool_conversations(2),
                       processing_class=tiny_tokenizer())  # fmt: skip


def test_refuses_unknown_model_inputs():
    from trl_dta.train.sft.samples import batch_samples

    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match="token_type_ids"):
        batch_samples(
            [{"input_ids": ids, "labels": ids, "attention_mask": ids * 0 + 1, "token_type_ids": ids}]
        )


def test_refuses_labels_that_are_not_the_tokens(tmp_path):
    dataset = Dataset.from_list([{"input_ids": [5, 6, 7, 8], "labels": [-100, 6, 9, 8]}] * 4)
    with pytest.raises(ValueError, match="differ from its input_ids"):
        train(TreeSFTTrainer, tmp_path, dataset)


def test_bf16_autocast_as_close_to_fp32_as_stock(tmp_path):
    """bf16 autocast over fp32 weights: the walk and the dense pass round in different places, so each is
    measured against stock fp32, and the walk's bf16 error must be no larger than stock TRL's own (x 1.5,
    as tests/test_mixed_precision.py asks of TreePPOTrainer)."""
    runs = {}
    for name, cls, bf16 in (
        ("fp32", SFTTrainer, False),
        ("stock", SFTTrainer, True),
        ("tree", TreeSFTTrainer, True),
    ):
        config_cls = TreeSFTConfig if cls is TreeSFTTrainer else SFTConfig
        rec = GradRecorder()
        config = make_sft_config(tmp_path / name, config_cls=config_cls, bf16=bf16, learning_rate=1e-2,
                                 assistant_only_loss=True)  # fmt: skip
        trainer = cls(model=tiny_model(), args=config, train_dataset=tool_conversations(4),
                      processing_class=tiny_tokenizer(), callbacks=[rec])  # fmt: skip
        trainer.train()
        runs[name] = rec.grads
    for step in range(2):
        stock_err = relative_error(runs["stock"][step], runs["fp32"][step])
        tree_err = relative_error(runs["tree"][step], runs["fp32"][step])
        assert stock_err > 1e-4, "bf16 was not used: the comparison would prove nothing"
        assert tree_err <= 1.5 * stock_err, f"step {step}: tree {tree_err:.3g} vs stock {stock_err:.3g}"


def test_evaluation_is_trl_dense_loss(tmp_path):
    losses = []
    for cls in (SFTTrainer, TreeSFTTrainer):
        config_cls = TreeSFTConfig if cls is TreeSFTTrainer else SFTConfig
        config = make_sft_config(tmp_path / cls.__name__, config_cls=config_cls, assistant_only_loss=True)
        trainer = cls(model=tiny_model(), args=config, train_dataset=tool_conversations(4),
                      eval_dataset=tool_conversations(2), processing_class=tiny_tokenizer())  # fmt: skip
        losses.append(trainer.evaluate()["eval_loss"])
    assert losses[1] == losses[0]  # TRL's compute_loss, the same batches and weights: the same arithmetic
