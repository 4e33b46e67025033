# Copyright the trl-dta authors. Apache-2.0.
"""Asynchronous PPO-family RL on τ²-bench: TRL's asynchronous GRPO with trl-dta's tree walk
(`AsyncTreePPOTrainer`). Rollouts keep generating on a vLLM server while the walk trains.

The synchronous recipe (recipes/ppo_tau2.py) generates, then trains, then generates. Here TRL's rollout
worker (`trl.experimental.async_grpo`, a process of its own) keeps a vLLM server busy with τ² episodes: it
runs the environment's tools in a thread pool and queues scored rollouts. The trainer takes them from the
queue and walks each optimizer step's rollouts as one prefix trie, depth-first. After each step it syncs the
policy to the server: a LoRA adapter saved and loaded by path (`--use_peft` with a server started with
`--enable-lora`; no NCCL, works on a CPU), or the full weights over NCCL (GPU only: TRL's). Rollouts more than
`max_staleness` policy versions old are dropped; the others are trained on with their own behaviour
log-probs (TRL's loss).

Two processes, started in this order: the server, then the trainer. They must name the same model (the
server's `--model` is the trainer's `--model_name_or_path`). On GPUs
(recipes/configs/ppo_tau2_async_qwen3_gpu.yaml has the exact commands): GPU 0 serves, GPU 1 trains (more
training GPUs: DDP with `--num_processes N`):

    CUDA_VISIBLE_DEVICES=0 trl vllm-serve --model Qwen/Qwen3-1.7B --port 8000
    CUDA_VISIBLE_DEVICES=1 accelerate launch --config_file recipes/accelerate_configs/single_process.yaml \
        --num_processes 1 recipes/ppo_tau2_async.py --config recipes/configs/ppo_tau2_async_qwen3_gpu.yaml

On a CPU (recipes/configs/ppo_tau2_async_mock_cpu.yaml): `vllm serve` and `trl vllm-serve` do not start
with vLLM's CPU build, `python -m vllm.entrypoints.openai.api_server` does (the config's header).

Configured the TRL way (`TrlParser`: this file's `ScriptArguments`, `AsyncTreePPOConfig`, and TRL's
`ModelConfig`'s model, attention and LoRA fields; `--attn_implementation` is the walk's attention here,
another name for `--tree_attn_implementation`). The script arguments are recipes/ppo_tau2.py's (task, user,
reward, `--tool_latency`), less what needs the model in this process before training: `--warm_start_steps`
(the server already serves the model: warm-start with recipes/sft_tau2.py, then serve and train the result),
`--no_tree` (stock `AsyncGRPOTrainer` needs its FA3 kernel from a kernel hub) and `--greedy_eval_steps`
(held-out success is measured once, after training, with `--greedy_eval`). recipes/README.md ("Asynchronous
training") has the details; benchmarks/async_overlap.py measures what the overlap buys.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import torch
from trl import ModelConfig, TrlParser, get_peft_config

_REPO = Path(__file__).resolve().parent.parent
if (_REPO / "trl_dta").is_dir() and str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # recipe_utils, however this is run

from recipe_utils.arguments import Tau2Arguments, setup_logging  # noqa: E402
from recipe_utils.offline_model import OFFLINE_SMOLLM2  # noqa: E402

from trl_dta import AsyncTreePPOConfig  # noqa: E402
from trl_dta.walk.adapter.checks import SUPPORTED_ATTENTION  # noqa: E402

logger = logging.getLogger("ppo_tau2")


def _squeeze_target_modules(self):  # as ModelConfig: one name given on the command line is that name
    if hasattr(self.lora_target_modules, "__len__") and len(self.lora_target_modules) == 1:
        self.lora_target_modules = self.lora_target_modules[0]


# TRL's ModelConfig, less what AsyncTreePPOConfig owns or this recipe does not use: `dtype` (the config's own
# `--dtype` loads the model), quantisation. `--attn_implementation` is kept, as recipes/ppo_tau2.py has it,
# but names the walk's attention (`--tree_attn_implementation`: TRL's async trainer loads the model with its
# own kernel, which AsyncTreePPOTrainer replaces): `use_attention` maps it.
_ATTENTION = dataclasses.field(
    default=None,
    metadata={
        "help": "Attention of the policy, as in recipes/ppo_tau2.py: here another name for "
        f"--tree_attn_implementation, one of {SUPPORTED_ATTENTION} (unset: --tree_attn_implementation's)."
    },
)
_KEPT = ("model_name_or_path", "model_revision", "attn_implementation", "use_peft", "use_rslora", "use_dora")
ModelArguments = dataclasses.make_dataclass(
    "ModelArguments",
    [
        (f.name, f.type, _ATTENTION if f.name == "attn_implementation" else f)
        for f in dataclasses.fields(ModelConfig)
        if f.name in _KEPT or f.name.startswith("lora_")
    ],
    namespace={
        "__post_init__": _squeeze_target_modules,
        "__doc__": "TRL's ModelConfig: the model, its attention and LoRA.",
    },
)


@dataclass
class ScriptArguments(Tau2Arguments):
    """recipes/ppo_tau2.py's arguments; those that need the model before training are refused."""

    # (their help says so: inherited, it would describe what recipes/ppo_tau2.py does with them)
    warm_start_steps: int = field(
        default=0,
        metadata={"help": "Refused here: warm-start with recipes/sft_tau2.py, then serve the result."},
    )
    no_tree: bool = field(
        default=False,
        metadata={"help": "Refused here: stock AsyncGRPOTrainer needs its kernel-hub FA3 kernel."},
    )
    greedy_eval_steps: int = field(
        default=0,
        metadata={"help": "Refused here: --greedy_eval measures held-out success once, after training."},
    )

    def __post_init__(self):
        super().__post_init__()
        if self.warm_start_steps:
            raise ValueError(
                "--warm_start_steps: the vLLM server already serves the model, so it cannot be warm-started "
                "here. Warm-start with recipes/sft_tau2.py, then serve and train the saved model."
            )
        if self.no_tree:
            raise ValueError(
                "--no_tree: stock AsyncGRPOTrainer packs with an FA3 kernel fetched from a kernel hub at run "
                "time; run it from TRL's own scripts for an A/B."
            )
        if self.greedy_eval_steps:
            raise ValueError(
                "--greedy_eval_steps: evaluating during training would stall the trainer while the rollout "
                "worker keeps generating; --greedy_eval measures held-out success once, after training."
            )


def make_parser() -> TrlParser:
    parser = TrlParser((ScriptArguments, AsyncTreePPOConfig, ModelArguments))
    parser.set_defaults_with_config(
        model_name_or_path=OFFLINE_SMOLLM2,
        bf16=torch.cuda.is_available(),
        report_to="tensorboard" if importlib.util.find_spec("tensorboard") else "none",
        output_dir="outputs/ppo_tau2_async",
    )
    return parser


def check_settings(script_args: ScriptArguments, training_args, model_args: ModelArguments) -> None:
    """Settings that the dataclasses accept alone but not together, refused before anything is loaded."""
    url = urlparse(training_args.vllm_server_base_url)
    if url.scheme not in ("http", "https") or not url.netloc:
        raise ValueError(
            f"--vllm_server_base_url {training_args.vllm_server_base_url!r}: give the server's http(s) "
            "address, e.g. http://127.0.0.1:8000 (without /v1)."
        )
    if training_args.max_staleness < 0:
        raise ValueError(f"--max_staleness must be >= 0, got {training_args.max_staleness}.")
    if model_args.use_peft and model_args.lora_target_modules and "lm_head" in model_args.lora_target_modules:
        raise ValueError("--lora_target_modules: TRL's async trainer refuses a LoRA adapter on lm_head.")
    if not model_args.use_peft and not torch.cuda.is_available():
        raise ValueError(
            "Full-weight sync to the vLLM server is NCCL (GPU only, TRL's). On a CPU train a LoRA adapter "
            "(--use_peft), synced by path to a server started with --enable-lora."
        )


def use_attention(training_args, model_args: ModelArguments) -> None:
    """``--attn_implementation``, given, is the walk's attention: it sets ``tree_attn_implementation``
    (refused if that names another one: give one of the two)."""
    attention = model_args.attn_implementation
    if attention is None:
        return
    if attention not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"--attn_implementation {attention!r} is not supported by the tree walk; use one of "
            f"{SUPPORTED_ATTENTION}."
        )
    default = AsyncTreePPOConfig.tree_attn_implementation
    if training_args.tree_attn_implementation not in (default, attention):
        raise ValueError(
            f"--attn_implementation {attention} and --tree_attn_implementation "
            f"{training_args.tree_attn_implementation}: both name the walk's attention here; give one."
        )
    training_args.tree_attn_implementation = attention


def main(script_args: ScriptArguments, training_args, model_args: ModelArguments, callbacks=None) -> dict:
    """Train; return a summary. ``callbacks``: more ``TrainerCallback``s (benchmarks/async_overlap.py's)."""
    from recipe_utils.evaluation import greedy_success, saved_policy
    from recipe_utils.offline_model import resolve_model_name
    from recipe_utils.rewards import reward_functions

    from trl_dta import AsyncTreePPOTrainer
    from trl_dta.envs import LLMUser, Tau2Environment, load_tau2_dataset
    from trl_dta.envs.tau2.synthetic import add_mock_create_tasks, synthetic_mock_environment

    check_settings(script_args, training_args, model_args)
    use_attention(training_args, model_args)
    setup_logging(training_args)
    started = time.perf_counter()

    # ---- setup: the model, a path or Hub id; the server must serve the same one (its --model)
    model_id, how = resolve_model_name(model_args.model_name_or_path, script_args.model_cache_dir)
    training_args.model_init_kwargs = {
        "revision": model_args.model_revision,
        **(training_args.model_init_kwargs or {}),
    }
    logger.info(
        "model %s: the vLLM server at %s must serve %s", how, training_args.vllm_server_base_url, model_id
    )

    # ---- setup: the simulated user (scripted, or an LLM behind an OpenAI-compatible API)
    user = None
    if script_args.user_base_url:
        api_key = script_args.user_api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
        user = functools.partial(
            LLMUser, base_url=script_args.user_base_url, model=script_args.user_model, api_key=api_key
        )

    # ---- setup: the tasks and the environment (built by the rollout worker, a spawned process: the factory
    # must be picklable and bring the synthetic tasks along)
    env_kwargs = dict(user=user, max_user_turns=script_args.max_user_turns, shaping=script_args.shaping,
                      tool_latency=script_args.tool_latency)  # fmt: skip
    tasks = functools.partial(
        load_tau2_dataset, domain=script_args.domain, write_only=script_args.write_only,
        seed=training_args.seed, policy=script_args.policy,
    )  # fmt: skip
    heldout = None
    if script_args.synthetic_tasks:
        synthetic = (script_args.synthetic_tasks, script_args.synthetic_eval_tasks, training_args.seed)
        train_ids, test_ids = add_mock_create_tasks(*synthetic)
        dataset, heldout = tasks(task_ids=train_ids), tasks(task_ids=test_ids)
        environment_factory = functools.partial(synthetic_mock_environment, *synthetic, **env_kwargs)
    else:
        dataset = tasks(split="train", max_tasks=script_args.max_tasks)
        if script_args.greedy_eval:
            heldout = tasks(split="test", max_tasks=script_args.max_eval_tasks)
        environment_factory = functools.partial(Tau2Environment, domain=script_args.domain, **env_kwargs)
    if heldout is not None and len(heldout) == 0:
        raise ValueError(f"--greedy_eval is on, but τ²'s {script_args.domain} test split has no task.")

    trainer = AsyncTreePPOTrainer(
        model=model_id,
        args=training_args,
        train_dataset=dataset,
        reward_funcs=reward_functions(script_args.reward_funcs, training_args.max_completion_length) or None,
        environment_factory=environment_factory,  # TRL adds the environment's get_reward as a reward
        peft_config=get_peft_config(model_args),
        callbacks=callbacks,
    )
    logger.info(
        "trainer: AsyncTreePPOTrainer | domain %s, %d train tasks | user: %s | tool latency %.2f s | "
        "max_staleness %d | setup %.1f s",
        script_args.domain, len(dataset), f"LLM {script_args.user_model}" if user else "scripted (offline)",
        script_args.tool_latency, training_args.max_staleness, time.perf_counter() - started,
    )  # fmt: skip

    # ---- train (the rollout worker starts at the first step and stops with training)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)

    # ---- save, and held-out success of the final policy
    output_dir = training_args.output_dir
    trainer.save_model(output_dir)
    summary = {"output_dir": output_dir, "model": how, "trainer": "AsyncTreePPOTrainer"}
    if trainer.accelerator.is_main_process:
        trainer.state.save_to_json(os.path.join(output_dir, "trainer_state.json"))
        if script_args.greedy_eval:  # the saved policy (an adapter on the served model with --use_peft)
            policy, tokenizer = saved_policy(model_id, output_dir, adapter=model_args.use_peft)
            summary["heldout_success"] = greedy_success(
                policy, tokenizer=tokenizer, rows=heldout,
                environment_factory=functools.partial(environment_factory, tool_latency=0.0),
                max_tool_calls=training_args.max_tool_calling_iterations or 0,
                max_completion_length=training_args.max_completion_length,
            )  # fmt: skip
            logger.info("held-out success (greedy, τ²'s check, %d tasks): %.3f", len(heldout),
                        summary["heldout_success"])  # fmt: skip
        if script_args.plot:
            from recipe_utils.plotting import plot_rewards

            summary["plot"] = plot_rewards(
                trainer.state.log_history, os.path.join(output_dir, "reward_curve.png")
            )
        steps = [r for r in trainer.state.log_history if "perf/rollout_wait_s" in r]
        if steps:
            watched = ("step", "reward", "perf/step_s", "perf/rollout_wait_s", "sample/staleness_max")
            summary["last_step"] = {
                k: v for k, v in steps[-1].items() if k in watched or k.startswith("tree/")
            }
        summary["wall_s"] = round(time.perf_counter() - started, 1)
        logger.info("done: %s", json.dumps(summary, default=str))
    # finish the trackers, destroy the process group (what Trainer.end does, transformers >= 5.18 only)
    trainer.accelerator.end_training()
    return summary


if __name__ == "__main__":
    script_args, training_args, model_args = make_parser().parse_args_and_config()
    main(script_args, training_args, model_args)
