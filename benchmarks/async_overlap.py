"""Overlap measured (issue 34): asynchronous tree RL against synchronous, on this CPU and on paper for GPUs.

On a CPU, generation and training share the cores, so the overlap that pays is with waits: τ²'s mock domain
with ``tool_latency`` seconds per tool call and user turn (a remote API's). Both sides train the same
LoRA adapter on the same warm-started SmolLM2-135M, tasks, seed and settings
(recipes/configs/ppo_tau2_async_mock_cpu.yaml, read by both), each for the same wall time:

* ``sync``: :class:`~trl_dta.TreePPOTrainer`, generation by vLLM in the training process (TRL's colocate
  mode, vLLM's CPU build; ``--generation hf``: ``transformers``' ``generate``), then the walk, then the next
  generation. TRL's synchronous tool loop runs a step's tool calls one after another.
* ``async``: recipes/ppo_tau2_async.py (:class:`~trl_dta.AsyncTreePPOTrainer`) against a real vLLM CPU
  server on 127.0.0.1 (started and stopped here, by its process id), the adapter synced by path after every
  step; TRL's rollout worker runs tools in a thread pool and keeps generating while the walk trains.
* ``async_split``: the same with the cores split as a GPU node's devices would be: the server's threads on
  core 0, the trainer (and TRL's rollout worker) on the others. Unsplit, the server keeps generating on every
  core while the walk trains and slows it many times over.

Each side reports optimizer steps per second over the wall time, held-out success of the final policy
(greedy rollouts of the 16 held-out tasks, τ²'s check, no latency), and the share of the trainer's time spent
waiting for rollouts: TRL's ``perf/rollout_wait_s`` (the async trainer blocked on an empty rollout queue)
summed over the run; for the synchronous trainer, the time inside ``_generate_and_score_completions``
(generation, tools, rewards), the time it cannot train. The clock starts at ``on_train_begin`` (after the
colocated engine or the server is up and TRL's rollout worker is spawned) and the run stops at the first
optimizer step past ``--wall_s``.

``paper`` sets the same question for a GPU node (N generation GPUs, M training GPUs) on paper, with the walk's
predicted speed from benchmarks/launch_model.py's JSON and the generation/training ratios read off the
AReaL-DTA paper's reported figures: docs/async.md ("Overlap").

    python benchmarks/async_overlap.py prepare                      # warm-started model, once (~4 min)
    .venv-vllm/bin/python benchmarks/async_overlap.py sync --wall_s 420
    python benchmarks/async_overlap.py heldout --side sync             # held-out success (~3 min idle)
    python benchmarks/async_overlap.py heldout --side async
    .venv-vllm/bin/python benchmarks/async_overlap.py async --wall_s 420   # (TRL's worker needs vLLM)
    .venv-vllm/bin/python benchmarks/async_overlap.py async_split --wall_s 420  # server: core 0
    python benchmarks/async_overlap.py paper --launch_json benchmarks/out/launch_model.json
    python benchmarks/async_overlap.py report                       # the table, from benchmarks/out/

Issue 40's sweeps run sides side by side, each pinned to one core (``--core``: this process and what it
starts, the colocated engine, the server, TRL's rollout worker; ``VLLM_CPU_OMP_THREADS_BIND`` and one torch
thread), ``--tool_latency`` overriding the config's, ``--tag`` naming the run (its JSON
``async_overlap_<side>_<tag>.json`` and its output folder), and for the staleness comparison
``--max_staleness`` and ``--decoupled`` (``use_decoupled_loss``). benchmarks/async_sweep_report.py prints
their tables:

    .venv-vllm/bin/python benchmarks/async_overlap.py sync --core 0 --tool_latency 1 --tag lat1 --wall_s 200 &
    .venv-vllm/bin/python benchmarks/async_overlap.py async --core 1 --tool_latency 1 --tag lat1 --wall_s 200
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "recipes"), str(Path(__file__).resolve().parent)]
from common import load_average  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

CONFIG = REPO / "recipes" / "configs" / "ppo_tau2_async_mock_cpu.yaml"
OUT = REPO / "benchmarks" / "out"
# AReaL-DTA (its paper): the walk made the training worker 8.31x faster than dense, end to end 1.28x
# (Qwen3-1.7B) and 2.28x (8B). Read with an asynchronous split that is training-bound before and generation-
# bound after, dense training took 1.28x (2.28x) the step's generation time on that split.
# vLLM's CPU engine dies ("CPU Generator does not use offset") when it splits the prefill of a seeded request
# across steps, and TRL's rollout worker seeds every request: a batch budget of max_num_seqs x max_model_len
# tokens never splits one.
NO_CHUNKED_PREFILL = ("--max-num-seqs", "16", "--max-num-batched-tokens", str(16 * 2048))
SIDES = ("sync", "async", "async_split")
SERVER_CORE = 0  # async_split: the server's core (the trainer gets the others)
# what the staleness comparison reads, per optimizer step (TRL's logs and async_ppo/metrics.py's)
PER_STEP = ("staleness/", "decoupled/", "clip_ratio/", "sample/", "perf/", "reward", "tree/", "tools/")
PAPER_TRAIN_OVER_GENERATION = {"Qwen3-1.7B": 1.28, "Qwen3-8B": 2.28}


def settings(work_dir: Path, *overrides: str, args=None):
    """The CPU config through the async recipe's parser: (script, AsyncTreePPOConfig, model arguments), the
    model being ``work_dir/warm_model``; its `env:` block is exported, as when the recipe runs. ``args``: the
    command line's overrides of the config (``--tool_latency``, ``--max_staleness``, ``--decoupled``,
    ``--dense_fallback``)."""
    import ppo_tau2_async

    model = ["--model_name_or_path", str(work_dir.resolve() / "warm_model")]
    extra = []
    if args is not None:
        for flag in ("tool_latency", "max_staleness"):
            if getattr(args, flag, None) is not None:
                extra += [f"--{flag}", str(getattr(args, flag))]
        if getattr(args, "decoupled", False):
            extra += ["--use_decoupled_loss", "true"]
        if getattr(args, "dense_fallback", None):
            extra += ["--tree_dense_fallback", args.dense_fallback]
    return ppo_tau2_async.make_parser().parse_args_and_config(
        ["--config", str(CONFIG), *model, *overrides, *extra]
    )


def run_name(args, side: str) -> str:
    """A run's name: its side, and ``_<tag>`` when tagged (its JSON and output folder are named so)."""
    return f"{side}_{args.tag}" if getattr(args, "tag", "") else side


def pin_to_core(core: int) -> None:
    """This process and every process it starts on one core: the colocated vLLM engine and the server bind
    their OpenMP threads to it, torch runs one thread."""
    import torch

    os.sched_setaffinity(0, {core})
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def heldout_rows(script, seed):
    from trl_dta.envs import load_tau2_dataset
    from trl_dta.envs.tau2.synthetic import add_mock_create_tasks

    train_ids, test_ids = add_mock_create_tasks(script.synthetic_tasks, script.synthetic_eval_tasks, seed)
    rows = functools.partial(load_tau2_dataset, "mock", seed=seed, policy=script.policy)
    return rows(task_ids=train_ids), rows(task_ids=test_ids)


def environment_factory(script, seed, latency=None):
    from trl_dta.envs.tau2.synthetic import synthetic_mock_environment

    return functools.partial(
        synthetic_mock_environment, script.synthetic_tasks, script.synthetic_eval_tasks, seed,
        max_user_turns=script.max_user_turns, shaping=script.shaping,
        tool_latency=script.tool_latency if latency is None else latency,
    )  # fmt: skip


def prepare(args) -> None:
    """SmolLM2-135M (offline GGUF) after the demo's warm start (one SFT step on 8 gold conversations)."""
    from recipe_utils.offline_model import OFFLINE_SMOLLM2, resolve_model_name
    from recipe_utils.warm_start import warm_start
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

    script, train, model_args = settings(args.work_dir, "--output_dir", str(args.work_dir))
    source, _ = resolve_model_name(OFFLINE_SMOLLM2)
    set_seed(train.seed)
    model = AutoModelForCausalLM.from_pretrained(source, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(source, padding_side="left")
    rows, _ = heldout_rows(script, train.seed)
    factory = environment_factory(script, train.seed, 0.0)
    log = warm_start(model, tokenizer, rows, factory, steps=1, learning_rate=1e-4, batch_size=8,
                     output_dir=str(args.work_dir), seed=train.seed)  # fmt: skip
    target = Path(model_args.model_name_or_path)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    print(f"warm-started model in {target}; SFT loss {[r['loss'] for r in log if 'loss' in r]}")


class WallClock(TrainerCallback):
    """Stops training at the first optimizer step that ends past ``wall_s`` seconds after ``on_train_begin``;
    records each step's end time (seconds after that)."""

    def __init__(self, wall_s: float):
        self.wall_s, self.begin, self.step_ends, self.loads = wall_s, None, [], []

    def on_train_begin(self, args, state, control, **kwargs):
        self.begin = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.step_ends.append(time.perf_counter() - self.begin)
        self.loads.append(load_average())  # (the machine is shared: the load each step saw)
        if self.step_ends[-1] >= self.wall_s:
            control.should_training_stop = True


def rates(side: dict, clock: WallClock, wait_s: float, args, script, a) -> dict:
    """The run's rates and settings (``script``, ``a``: as read from the config and the overrides)."""
    elapsed = clock.step_ends[-1]
    steps = len(clock.step_ends)
    return side | {"steps": steps, "elapsed_s": elapsed, "steps_per_s": steps / elapsed, "wait_s": wait_s,
                   "wait_share": wait_s / elapsed, "step_ends_s": clock.step_ends,
                   "load_average_at_steps": clock.loads, "core": args.core, "tag": args.tag,
                   "wall_s": args.wall_s, "tool_latency": script.tool_latency,
                   "max_staleness": a.max_staleness, "use_decoupled_loss": a.use_decoupled_loss,
                   "tree_dense_fallback": a.tree_dense_fallback, "seed": a.seed}  # fmt: skip


def success(model, tokenizer, script, train, rows) -> float:
    from recipe_utils.evaluation import greedy_success

    return greedy_success(model, tokenizer=tokenizer, rows=rows, environment_factory=environment_factory(
        script, train.seed, 0.0), max_tool_calls=train.max_tool_calling_iterations or 0,
        max_completion_length=train.max_completion_length)  # fmt: skip


def run_sync(args) -> dict:
    import torch
    from trl import get_peft_config

    from trl_dta import TreePPOConfig, TreePPOTrainer

    output = args.work_dir / run_name(args, "sync")
    script, a, model_args = settings(
        args.work_dir, "--output_dir", str(output), "--max_steps", "1000", args=args
    )
    shared = ("num_generations", "per_device_train_batch_size", "gradient_accumulation_steps",
              "max_completion_length", "max_tool_calling_iterations", "temperature", "learning_rate",
              "lr_scheduler_type", "epsilon", "max_steps", "seed", "tree_block_size", "tree_dense_fallback",
              "logging_steps", "save_strategy", "report_to", "dataloader_pin_memory", "bf16",
              "output_dir")  # fmt: skip
    kw = {k: getattr(a, k) for k in shared}
    if args.generation == "colocate":
        # vLLM's CPU engine sizes its KV cache from VLLM_CPU_KVCACHE_SPACE, not from the utilisation (whose
        # share of this machine is less than the process already holds): 2 GiB, as the async side's server
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        kw |= dict(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.05,
                   vllm_max_model_length=2048, vllm_enable_sleep_mode=False)  # fmt: skip
    config = TreePPOConfig(**kw, beta=0.0, loss_type="dapo", num_iterations=1, epsilon_high=a.epsilon_high,
                           model_init_kwargs={"dtype": torch.float32})  # fmt: skip
    rows, heldout = heldout_rows(script, a.seed)
    clock = WallClock(args.wall_s)
    trainer = TreePPOTrainer(model=model_args.model_name_or_path, args=config, train_dataset=rows,
                             environment_factory=environment_factory(script, a.seed),
                             peft_config=get_peft_config(model_args), callbacks=[clock])  # fmt: skip
    generation_s = []
    generate = trainer._generate_and_score_completions

    def timed_generation(*gen_args, **gen_kwargs):
        t0 = time.perf_counter()
        try:
            return generate(*gen_args, **gen_kwargs)
        finally:
            generation_s.append(time.perf_counter() - t0)

    trainer._generate_and_score_completions = timed_generation
    load = [load_average()]
    trainer.train()
    load.append(load_average())
    history = trainer.state.log_history
    side = {"side": "sync", "trainer": "TreePPOTrainer", "generation": args.generation, "load_average": load,
            "walk_s": sum(r["tree/time_s"] for r in history if "tree/time_s" in r),
            "engine_s": sum(r["perf/generation_s"] for r in history if "perf/generation_s" in r),
            "rewards": [r["reward"] for r in history if "reward" in r],
            "per_step": {k: [r.get(k) for r in history if "reward" in r] for k in ("tools/call_frequency",
                         "perf/generation_s", "tree/time_s")}}  # fmt: skip
    result = rates(side, clock, sum(generation_s), args, script, a)
    trainer.save_model(str(output))  # held-out success: the `heldout` part, from the saved adapter
    return result


def heldout(args) -> dict:
    """Held-out success of a side's saved policy (greedy, τ²'s check, no latency), added to its JSON."""
    from recipe_utils.evaluation import saved_policy

    name = run_name(args, args.side)
    script, a, model_args = settings(args.work_dir, "--output_dir", str(args.work_dir / name))
    _, rows = heldout_rows(script, a.seed)
    policy, tokenizer = saved_policy(model_args.model_name_or_path, a.output_dir, adapter=model_args.use_peft)
    path = OUT / f"async_overlap_{name}.json"
    result = json.loads(path.read_text()) if path.exists() else {"side": args.side, "note": "no run JSON"}
    result["heldout_success"] = success(policy, tokenizer, script, a, rows)
    result["heldout_tasks"] = len(rows)
    return result


def run_async(args, split: bool = False) -> dict:
    """``split``: the server's threads on core 0, the trainer's on core 1 (the CPU's N generation + M training
    devices); otherwise both share every core, as the synchronous side's phases do."""
    import ppo_tau2_async

    from trl_dta.testing.vllm_server import VLLMServer

    name = "async_split" if split else "async"
    output = str(args.work_dir / run_name(args, name))  # held-out success: the `heldout` part, as for sync
    script, a, model_args = settings(
        args.work_dir, "--output_dir", output, "--max_steps", "1000", "--greedy_eval", "0", args=args
    )
    server = VLLMServer(
        model_args.model_name_or_path, "--enable-lora", "--max-lora-rank", str(model_args.lora_r),
        "--max-loras", str(a.max_staleness + 2), "--max-model-len", "2048", *NO_CHUNKED_PREFILL,
        python=args.vllm_python,
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_CPU_KVCACHE_SPACE": "2"}
        | ({"VLLM_CPU_OMP_THREADS_BIND": str(SERVER_CORE)} if split else {}),
        startup_timeout=args.server_timeout, log_path=f"{output}_vllm_server.log",
    )  # fmt: skip
    clock = WallClock(args.wall_s)
    with server:
        if split:  # (once the server runs) this process and what it spawns (TRL's rollout worker): the others
            import torch

            os.sched_setaffinity(0, set(range(os.cpu_count())) - {SERVER_CORE})
            torch.set_num_threads(len(os.sched_getaffinity(0)))
        a.vllm_server_base_url = server.base_url
        load = [load_average()]
        summary = ppo_tau2_async.main(script, a, model_args, callbacks=[clock])
        load.append(load_average())
    state = json.loads((Path(a.output_dir) / "trainer_state.json").read_text())
    logs = [r for r in state["log_history"] if "perf/rollout_wait_s" in r]
    waits = [r["perf/rollout_wait_s"] for r in logs]
    after_first = clock.step_ends[-1] - clock.step_ends[0]
    side = {"side": name, "trainer": "AsyncTreePPOTrainer",
            "generation": "vLLM CPU server, LoRA by path" + (", server core 0, trainer core 1" * split),
            "wait_share_after_first_step": sum(waits[1:]) / after_first if after_first > 0 else None,
            "staleness_max": max((r.get("sample/staleness_max") or 0 for r in logs), default=None),
            "walk_s": sum(r.get("tree/time_s", 0.0) for r in logs), "load_average": load,
            "rewards": [r.get("reward") for r in logs], "summary": summary,
            "per_step": {key: [r.get(key) for r in logs] for key in sorted({k for r in logs for k in r})
                         if key.startswith(PER_STEP)}}  # fmt: skip
    return rates(side, clock, sum(waits), args, script, a)


def paper(args) -> dict:
    """Steps per second of a node of ``--gpus`` GPUs per unit of generation work: synchronous colocated
    (every GPU generates, then every GPU trains) against an asynchronous split of N generating and M training
    GPUs, dense training and the walk (launch_model.py's predicted speedup), for engine utilisations u of the
    synchronous generation phase (1: no idle engine; below: the step waits on its slowest rollouts and tools,
    which the asynchronous queue fills with other requests). The decoupled objective's proximal log-probs:
    free here (the walk's own, detached: async_ppo/loss.py); ``--proximal_pass`` prices the separate
    no-gradient forward AReaL runs for them (a share of the training work: 1/3, one forward of the three a
    forward and backward cost), the ``async_walk_proximal`` column."""
    if args.walk_speedup:  # launch_model.py's prediction, taken from where it was published
        launch = {"assumptions": {"source": args.walk_source}, "shapes": [{"scale": 1.0, "walk": [
            {"kernel": k, "memory": args.walk_source, "predicted_speedup": float(v)}
            for k, v in (item.split("=") for item in args.walk_speedup.split(","))]}]}  # fmt: skip
    else:
        launch = json.loads(Path(args.launch_json).read_text())
    walks = [w for s in launch["shapes"] if s.get("scale", 1) == 1 for w in s["walk"]]
    rows = []
    for model, r in PAPER_TRAIN_OVER_GENERATION.items():
        for walk in walks:
            s = walk["predicted_speedup"]
            for u in args.utilisation:
                g, t_dense, t_walk = 1.0, r, r / s  # GPU-seconds per step: generation, training
                sync_dense = g / (args.gpus * u) + t_dense / args.gpus
                sync_walk = g / (args.gpus * u) + t_walk / args.gpus
                step, n = min((max(g / n, t_walk / (args.gpus - n)), n) for n in range(1, args.gpus))
                t_prox = t_walk * (1 + args.proximal_pass)
                prox_step, prox_n = min(
                    (max(g / k, t_prox / (args.gpus - k)), k) for k in range(1, args.gpus)
                )
                dense_step, dense_n = min(
                    (max(g / k, t_dense / (args.gpus - k)), k) for k in range(1, args.gpus)
                )
                rows.append({"model": model, "train_over_generation": r, "kernel": walk["kernel"],
                             "memory": walk["memory"], "walk_speedup": s, "u_sync": u,
                             "sync_dense_steps_per_unit": 1 / sync_dense, "sync_walk": sync_dense / sync_walk,
                             "async_walk": sync_dense / step, "split": f"{n} gen + {args.gpus - n} train",
                             "proximal_pass": args.proximal_pass,
                             "async_walk_proximal": sync_dense / prox_step,
                             "proximal_split": f"{prox_n} gen + {args.gpus - prox_n} train",
                             "async_dense": sync_dense / dense_step,
                             "dense_split": f"{dense_n} gen + {args.gpus - dense_n} train",
                             "async_trainer_wait_share": 1 - (t_walk / (args.gpus - n)) / step,
                             "sync_walk_wait_share": (g / (args.gpus * u)) / sync_walk})  # fmt: skip
    return {"side": "paper", "gpus": args.gpus, "launch_assumptions": launch["assumptions"], "rows": rows}


def report(_args) -> None:
    parts = {p: json.loads((OUT / f"async_overlap_{p}.json").read_text()) for p in (*SIDES, "paper")
             if (OUT / f"async_overlap_{p}.json").exists()}  # fmt: skip
    for side in SIDES:
        if side in parts:
            r = parts[side]
            success = f"{r['heldout_success']:.0%}" if r.get("heldout_success") is not None else "-"
            print(f"| {r['trainer']} ({r['generation']}) | {r['steps']} in {r['elapsed_s']:.0f} s | "
                  f"{r['steps_per_s'] * 60:.2f} | {success} | {r['wait_share']:.0%} |")  # fmt: skip
    for r in parts.get("paper", {}).get("rows", []):
        print(f"| {r['model']} | {r['train_over_generation']} | {r['kernel']} {r['walk_speedup']:.2f}x | "
              f"{r['u_sync']} | {r['sync_walk']:.2f}x | {r['async_dense']:.2f}x ({r['dense_split']}) | "
              f"{r['async_walk']:.2f}x ({r['split']}) | "
              f"{r['async_walk_proximal']:.2f}x ({r['proximal_split']}) | "
              f"{r['sync_walk_wait_share']:.0%} | {r['async_trainer_wait_share']:.0%} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=("prepare", *SIDES, "heldout", "paper", "report"))
    parser.add_argument("--side", choices=SIDES, default="sync", help="heldout: whose policy")
    parser.add_argument("--work_dir", type=Path, default=REPO / "outputs" / "async_overlap")
    parser.add_argument("--wall_s", type=float, default=420.0, help="training wall time of each side")
    parser.add_argument("--generation", choices=("colocate", "hf"), default="colocate", help="sync side")
    parser.add_argument("--vllm_python", default=sys.executable, help="interpreter with vLLM (server)")
    parser.add_argument("--server_timeout", type=float, default=300.0)
    parser.add_argument("--launch_json", default=str(OUT / "launch_model.json"))
    parser.add_argument("--walk_speedup", default="", help="paper: KERNEL=X,... instead of --launch_json")
    parser.add_argument("--walk_source", default="", help="paper: where --walk_speedup was published")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--core", type=int, default=None, help="pin the run (what it starts too) to it")
    parser.add_argument("--tag", default="", help="the run's name: async_overlap_<side>_<tag>.json")
    parser.add_argument("--tool_latency", type=float, default=None, help="seconds per tool call, user turn")
    parser.add_argument("--max_staleness", type=int, default=None, help="the config's, unless given")
    parser.add_argument("--decoupled", action="store_true", help="use_decoupled_loss (async sides)")
    parser.add_argument("--dense_fallback", default=None, help="tree_dense_fallback (default: the config's)")
    parser.add_argument("--proximal_pass", type=float, default=1 / 3, help="paper: a proximal forward's cost")
    parser.add_argument("--utilisation", type=lambda v: [float(x) for x in v.split(",")], default=[1.0, 0.5])
    args = parser.parse_args()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.core is not None:
        pin_to_core(args.core)
    if args.part == "prepare":
        return prepare(args)
    if args.part == "report":
        return report(args)
    parts = {"sync": run_sync, "async": run_async, "async_split": functools.partial(run_async, split=True),
             "heldout": heldout, "paper": paper}  # fmt: skip
    result = parts[args.part](args)
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"async_overlap_{run_name(args, args.side if args.part == 'heldout' else args.part)}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({k: v for k, v in result.items() if k not in ("step_ends_s", "rows")}, default=str))
    print(f"-> {path}")


if __name__ == "__main__":
    main()
