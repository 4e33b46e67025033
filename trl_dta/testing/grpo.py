"""Offline, deterministic fixture for TRL's GRPOTrainer (no Hub access): a byte-level BPE tokenizer trained
on the fly with TRL's qwen3 chat template, a tiny Qwen3 model built from a config, a conversational dataset,
two tools, a reward function, scripted (non-sampled) generation, CPU-friendly configs, a gradient recorder.

Typical use (a parity test between stock GRPOTrainer and a subclass)::

    from trl_dta.testing.grpo import GradRecorder, ScriptedGRPOTrainer, make_config, make_trainer

    rec = GradRecorder()
    trainer = make_trainer(ScriptedGRPOTrainer, make_config(tmp_path), callbacks=[rec])
    trainer.train()
    rec.grads  # one {name: grad} dict per optimizer step, taken just before optimizer.step()

Generation is scripted: `ScriptedGenerationMixin._generate_single_turn` returns token ids that depend only on
the input token ids (prompt, plus earlier turns), on the row's index among identical inputs in the call
(= its index within the group) and on the turn number; never on model weights or random state. With tools,
every member of a group emits the same tool call in turn 0 (so TRL executes the tool and appends the same tool
response), then a different final answer in turn 1. Without tools, the members share a first chunk, then
diverge.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections import Counter
from dataclasses import fields

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from .shop import (  # noqa: F401  (re-exported: the fixture's names in one place)
    _WORDS,
    SPECIAL_TOKENS,
    SYSTEM_PROMPT,
    TOOLS,
    VOCAB_SIZE,
    _crc,
    _order_id,
    _user_message,
    cancel_order,
    get_order_status,
    make_dataset,
    reward_fn,
    tiny_tokenizer,
)


def tiny_model(tokenizer=None, seed: int = 0, dtype=torch.float32, attn: str = "sdpa", **overrides):
    """2-layer Qwen3ForCausalLM from a config: hidden 32, 4 query / 2 KV heads (GQA), head_dim 8, untied
    embeddings, initializer_range 0.2, no dropout. Same seed -> bit-identical weights; the global RNG is left
    untouched. `overrides` go to Qwen3Config."""
    tokenizer = tokenizer or tiny_tokenizer()
    kw = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        initializer_range=0.2,
        rms_norm_eps=1e-6,
        attention_dropout=0.0,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    kw.update(overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(Qwen3Config(**kw))
    model.config._attn_implementation = attn
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.to(dtype)


# ------------------------------------------------------------------------------------------------------------
# Scripted generation
# ------------------------------------------------------------------------------------------------------------
class ScriptedGenerationMixin:
    """Put in front of GRPOTrainer (or a subclass): `class T(ScriptedGenerationMixin, GRPOTrainer)`.

    Overrides `_generate_single_turn` (the only method that calls `model.generate`); TRL's `_generate`,
    tool-call parsing and execution (`_tool_call_loop`), rewards, advantages, old logps and logging run
    unchanged. Returns `(completion_ids: list[list[int]], None)` like TRL's transformers path (no logprobs).
    With `scripted_fit_budget` (default), every scripted turn ends with EOS and fits the remaining
    `max_completion_length` budget (nothing is truncated). Set it False to emulate `generate` with
    max_new_tokens=max_completion_length: a turn longer than that is cut without EOS, and TRL itself drops
    overlong tool results and trims post-tool turns (for `mask_truncated_completions` tests).

    If `scripted_fixed_shuffle`, `_prepare_inputs` runs under a forked CPU RNG seeded with
    `args.seed + self._step`, so TRL's row shuffle (`shuffle_sequence_dict`) does not depend on how much
    global random state the trainer class consumed before (two trainer classes see the same micro-batches).

    If `scripted_record`, keeps `self.generation_batches` (the unshuffled dicts returned by
    `_generate_and_score_completions`; rows of a group are consecutive) and `self.step_inputs` (the
    micro-batch `_prepare_inputs` served to each training step), tensors cloned.
    """

    scripted_fit_budget = True
    scripted_fixed_shuffle = True
    scripted_record = True

    def _scripted_turn(self, input_ids: list[int], member: int, budget: int) -> list[int]:
        tok = self._tokenizer
        turn = input_ids.count(tok.convert_tokens_to_ids("<tool_response>"))
        text = tok.decode(input_ids, skip_special_tokens=False)
        found = re.findall(r"\b([A-H]\d{2,})\b", text)
        oid = found[-1] if found else f"Z{_crc(input_ids) % 90 + 10}"
        h = _crc(input_ids)
        if turn == 0 and self.tools:
            # Same for every member of the group: a short content line and a well-formed qwen3 tool call.
            if "cancel my order" in text:
                call = {"name": "cancel_order", "arguments": {"order_id": oid, "reason": "changed my mind"}}
                say = f"I will cancel order {oid}."
            else:
                call = {"name": "get_order_status", "arguments": {"order_id": oid}}
                say = f"Let me check order {oid}."
            body = f"{say}\n<tool_call>\n{json.dumps(call)}\n</tool_call>"
            ids = tok.encode(body, add_special_tokens=False)
        else:
            # Final answer (turn >= 1), or the whole completion without tools: a part shared by the group,
            # then a member-specific tail; each member's answer is 3 tokens longer than the previous one's.
            shared = f"Done for order {oid}." if turn else f"Checking order {oid} in the shop system now."
            tail = " ".join(_WORDS[(h + 7 * member + j) % len(_WORDS)] for j in range(40))
            tail_ids = tok.encode(f" Note {member}: {tail}", add_special_tokens=False)
            ids = tok.encode(shared, add_special_tokens=False) + tail_ids[: 4 + h % 3 + 3 * member]
        if self.scripted_fit_budget:
            return ids[: max(budget - 1, 0)] + [tok.eos_token_id]
        return (ids + [tok.eos_token_id])[: self.max_completion_length]

    def _generate_single_turn(
        self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False
    ):
        if images is not None and any(images):
            raise NotImplementedError("scripted generation is text-only")
        if not hasattr(self, "_scripted_prompts"):
            self._scripted_prompts = set()
        response_id = self._tokenizer.convert_tokens_to_ids("<tool_response>")
        seen = Counter()
        out = []
        for ids in prompt_ids:
            ids = list(ids.tolist() if torch.is_tensor(ids) else ids)
            key = tuple(ids)
            member = seen[key]  # index among identical inputs in this call = index within the group
            seen[key] += 1
            if response_id not in ids:  # first turn: the input is the prompt
                self._scripted_prompts.add(key)
                used = 0
            else:  # later turn: the budget already used is everything after the original prompt
                plen = max((len(p) for p in self._scripted_prompts if key[: len(p)] == p), default=0)
                used = len(ids) - plen
            out.append(self._scripted_turn(ids, member, self.max_completion_length - used))
        return out, None

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.scripted_record:
            self.generation_batches = getattr(self, "generation_batches", [])
            self.generation_batches.append(_clone(output))
        return output

    def _prepare_inputs(self, generation_batch):
        if self.scripted_fixed_shuffle and self.model.training:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.args.seed + self._step)
                inputs = super()._prepare_inputs(generation_batch)
        else:
            inputs = super()._prepare_inputs(generation_batch)
        if self.scripted_record and self.model.training:
            self.step_inputs = getattr(self, "step_inputs", [])
            self.step_inputs.append(_clone(inputs))
        return inputs


def _clone(d: dict) -> dict:
    return {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in d.items()}


ScriptedGRPOTrainer = type("ScriptedGRPOTrainer", (ScriptedGenerationMixin, GRPOTrainer), {})


# ------------------------------------------------------------------------------------------------------------
# Config, trainer
# ------------------------------------------------------------------------------------------------------------
def make_config(output_dir=None, config_cls=GRPOConfig, **overrides):
    """CPU-friendly, deterministic GRPOConfig (or a subclass). Defaults: one generation of 4 rows (1
    prompt x 4) used for 2 optimizer steps (num_iterations=2, so old logps are computed and ratios move),
    plain SGD, a constant lr, no clipping (max_grad_norm=0), no KL (beta=0); a tree config walks every step
    (``tree_dense_fallback="never"``: the cost model would send a tiny model's steps to TRL's dense path).
    Keys the config class lacks are dropped unless given explicitly in `overrides`. `output_dir=None` makes
    a temporary directory."""
    if output_dir is None:
        output_dir = tempfile.mkdtemp(prefix="trl_dta_grpo_")
    kw = dict(
        output_dir=str(output_dir),
        bf16=False,  # GRPOConfig defaults to bf16=True
        fp16=False,
        use_cpu=True,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=128,
        num_iterations=2,
        max_steps=2,
        beta=0.0,
        learning_rate=1e-2,
        optim="sgd",
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=0.0,  # Trainer clips only if > 0: GradRecorder sees the raw accumulated gradient
        seed=0,
        data_seed=0,
        shuffle_dataset=False,  # prompts in dataset order (RepeatSampler is seeded anyway)
        disable_dropout=True,
        gradient_checkpointing=False,  # TRL's default is True
        activation_checkpointing=False,  # its new name in transformers 5.2x (the old one warns)
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        log_completions=False,
        disable_tqdm=True,
        tree_dense_fallback="never",  # (tree configs) every step walks: a test of the walk tests the walk
    )
    if "gradient_checkpointing" in overrides and "activation_checkpointing" not in overrides:
        kw["activation_checkpointing"] = overrides["gradient_checkpointing"]
    kw.update(overrides)
    names = {f.name for f in fields(config_cls)}
    return config_cls(**{k: v for k, v in kw.items() if k in names or k in overrides})


def make_trainer(
    trainer_cls=None,
    config=None,
    model=None,
    tools=True,
    peft_config=None,
    callbacks=None,
    num_prompts: int = 2,
    dataset=None,
    reward_funcs=None,
    seed: int = 0,
    **trainer_kwargs,
):
    """Build `trainer_cls` (default ScriptedGRPOTrainer; it should include ScriptedGenerationMixin) on the
    tiny model (`tiny_model(seed=seed)` unless `model` is given), the tiny tokenizer,
    `make_dataset(num_prompts)`, `reward_fn` and, if `tools` is True, TOOLS (or a list of callables;
    False/None: no tools, single turn)."""
    trainer_cls = trainer_cls or ScriptedGRPOTrainer
    config = config if config is not None else make_config()
    tokenizer = tiny_tokenizer()
    if model is None:
        model = tiny_model(tokenizer, seed=seed)
    if tools is True:
        tools = list(TOOLS)
    return trainer_cls(
        model=model,
        reward_funcs=reward_funcs if reward_funcs is not None else reward_fn,
        args=config,
        train_dataset=dataset if dataset is not None else make_dataset(num_prompts),
        processing_class=tokenizer,
        callbacks=callbacks,
        peft_config=peft_config,
        tools=tools or None,
        **trainer_kwargs,
    )


# ------------------------------------------------------------------------------------------------------------
# Gradient recording
# ------------------------------------------------------------------------------------------------------------
class GradRecorder(TrainerCallback):
    """Records, at every optimizer step, a copy of each trainable parameter's `.grad` (accumulated over the
    step's micro-batches) in `on_pre_optimizer_step`, i.e. just before `optimizer.step()` (whole tensors, also
    for FSDP2-sharded parameters). Transformers clips
    *before* this hook, so keep max_grad_norm=0 (make_config's default) to record unclipped gradients."""

    def __init__(self):
        self.grads: list[dict[str, torch.Tensor]] = []
        self.steps: list[int] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append(state.global_step)
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
        # a sharded (FSDP2) gradient is a DTensor: record the whole tensor
        self.grads.append(
            {n: getattr(g, "full_tensor", g.detach)().detach().clone() for n, g in grads.items()}
        )
