"""Offline fixtures for TRL's SFTTrainer (no Hub access): datasets built from the GRPO fixture's shop agent
(:mod:`trl_dta.testing.grpo`: its tokenizer with TRL's qwen3 template, tiny Qwen3, tools) and a CPU-friendly,
deterministic config.

* :func:`tool_conversations`: conversational tool-calling rows (``messages`` + ``tools``), one or two tool
  calls with their results, then a final answer; every row starts with the same system prompt and tools.
* :func:`per_turn_samples`: each conversation cut after each of its assistant turns (each sample a prefix
  of the next, as datasets that train each turn as its own sample are).
* :func:`prompt_completion`: prompt-completion rows (conversational), some sharing a prompt.

Typical use (a parity test between stock SFTTrainer and a subclass)::

    rec = GradRecorder()
    trainer = SFTTrainer(model=tiny_model(), args=make_sft_config(tmp_path),
                         train_dataset=tool_conversations(), processing_class=tiny_tokenizer(),
                         callbacks=[rec])
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import fields

from datasets import Dataset
from transformers.utils import get_json_schema
from trl import SFTConfig

from .grpo import SYSTEM_PROMPT, TOOLS, _order_id, _user_message, cancel_order, get_order_status


def _call(name: str, arguments: dict) -> dict:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}],
    }


def _conversation(i: int) -> list[dict]:
    oid = _order_id(i)
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": _user_message(i)}]
    messages += [
        _call("get_order_status", {"order_id": oid}),
        {"role": "tool", "name": "get_order_status", "content": get_order_status(oid)},
    ]
    if i % 2:
        reason = "changed my mind"
        result = cancel_order(oid, reason)
        messages += [
            _call("cancel_order", {"order_id": oid, "reason": reason}),
            {"role": "tool", "name": "cancel_order", "content": result},
        ]
    messages.append(
        {"role": "assistant", "content": f"Done for order {oid}. Note {i}: thank you for waiting."}
    )
    return messages


def _tools() -> str:
    return json.dumps([get_json_schema(t) for t in TOOLS])


def tool_conversations(num: int = 8, duplicates: int = 0) -> Dataset:
    """``num`` tool-calling conversations (``messages``, ``tools`` as a JSON string), then ``duplicates``
    copies of the first ones."""
    rows = [{"messages": _conversation(i), "tools": _tools()} for i in range(num)]
    rows += [dict(rows[k % num]) for k in range(duplicates)]
    return Dataset.from_list(rows)


def per_turn_samples(num: int = 3) -> Dataset:
    """Each of ``num`` conversations cut after each assistant turn, in order: every sample is a prefix of
    the next one of its conversation."""
    rows = []
    for i in range(num):
        messages = _conversation(i)
        for end, m in enumerate(messages):
            if m["role"] == "assistant":
                rows.append({"messages": messages[: end + 1], "tools": _tools()})
    return Dataset.from_list(rows)


def prompt_completion(num: int = 8) -> Dataset:
    """Conversational prompt-completion rows: pairs of rows share a prompt (system + user) and differ in the
    final answer."""
    rows = []
    for i in range(num):
        prompt = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": _user_message(i // 2)},
        ]
        answer = (
            f"Checking order {_order_id(i // 2)} in the shop system now. Note {i}: please keep your receipt."
        )
        rows.append({"prompt": prompt, "completion": [{"role": "assistant", "content": answer}]})
    return Dataset.from_list(rows)


def make_sft_config(output_dir=None, config_cls=SFTConfig, **overrides):
    """CPU-friendly, deterministic SFTConfig (or a subclass): fp32, plain SGD at a constant lr, no clipping
    (max_grad_norm=0, so a GradRecorder sees the raw accumulated gradient), 2 optimizer steps of 2
    micro-batches of 2 rows, samples in dataset order, no truncation; a tree config walks every step
    (``tree_dense_fallback="never"``). Keys the config class lacks are dropped
    unless given explicitly in `overrides`."""
    if output_dir is None:
        output_dir = tempfile.mkdtemp(prefix="trl_dta_sft_")
    kw = dict(
        output_dir=str(output_dir),
        bf16=False,  # SFTConfig defaults to bf16=True
        fp16=False,
        use_cpu=True,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=2,
        max_length=None,
        learning_rate=1e-1,
        optim="sgd",
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=0.0,
        seed=0,
        data_seed=0,
        shuffle_dataset=False,
        train_sampling_strategy="sequential",
        gradient_checkpointing=False,  # SFTConfig's default is True
        activation_checkpointing=False,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        logging_steps=1,
        report_to="none",
        tree_dense_fallback="never",  # (tree configs) every step walks: a test of the walk tests the walk
        save_strategy="no",
        disable_tqdm=True,
        dataset_num_proc=None,
    )
    kw.update(overrides)
    names = {f.name for f in fields(config_cls)}
    return config_cls(**{k: v for k, v in kw.items() if k in names or k in overrides})
