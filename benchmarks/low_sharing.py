"""Benchmark (issue 41, "never slower"): the tree trainers against stock TRL, steps sharing almost nothing.

    python benchmarks/low_sharing.py [--case grpo-unique|sft-unique|async-single|all] [--repeats 5]
                                     [--steps 4] [--threads 1] [--processes 1]
                                     [--out benchmarks/out/low_sharing.json]

With ``tree_dense_fallback="auto"`` (the default) a step the cost model predicts cheaper on TRL's dense path
takes it: this measures whether that keeps each tree trainer at stock speed (the issue asks ≥ 0.97×), with
the walk forced (``"never"``) beside it to show what the fallback saves. Cases, each on the tiny Qwen3 of
``trl_dta.testing`` (4 layers, hidden 256, fp32, sdpa), plain SGD, no accumulation tricks:

* ``grpo-unique``: ``TreePPOTrainer`` against ``GRPOTrainer``, short unique prompts (no tools, no system
  prompt), 2 rollouts each that differ from their first completion token (scripted, 24-40 tokens), 8 rows a
  step.
* ``sft-unique``: ``TreeSFTTrainer`` against ``SFTTrainer``, tool conversations that share only the
  tokenizer's chat scaffolding (``trl_dta.testing.sft.tool_conversations``), 8 a step.
* ``async-single``: ``AsyncTreePPOTrainer`` against TRL's ``AsyncGRPOTrainer`` (its loss on a CPU through
  ``trl_dta.testing.async_grpo``), one sample per prompt, 8 a step, from a scripted queue.

``--processes N``: N DDP processes (this script relaunched by torchrun, gloo, ``--threads`` each), each
with the per-process batch above (N times the rows a step), stock and tree alike; rank 0 reports.

Runs alternate stock, tree (auto), tree (never), ... (``--sides``: which; ``tree-always`` too)
``--repeats`` times after one round of warm-up, each a fresh trainer of ``--steps`` optimizer steps, each
(unless ``--keep_cache``) with an empty cost cache: the tree trainer starts from the shipped constants, as
on a machine's first run. Timed: each optimizer step's wall time (from the end of the step before, the
fetch of its batch included: ``StepClock``), and their sum per run. Reported: the median step time and the
median run time of each side, the ratios stock / tree (speed relative to stock: ≥ 1 is as fast), the same
ratio paired by round (the median over rounds of each round's stock run over its tree run: the machine's
slow phases, which on two processes span whole runs, slow both), the dedup ratio (the walk's), and the share
of steps each tree side took TRL's dense path (``tree/path``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from common import environment, load_average  # noqa: E402
from transformers.trainer_callback import PrinterCallback, TrainerCallback  # noqa: E402

from trl_dta.testing.torchrun import exit_worker  # noqa: E402

WORLD = int(os.environ.get("WORLD_SIZE", 1))  # (under torchrun: --processes)
MODEL = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64)  # fmt: skip
ROWS = 8


class StepClock(TrainerCallback):
    """Wall time of each optimizer step (every case, stock and tree alike), from the end of the step before
    (the first: from the start of training) to its own end, as TRL's ``perf/step_s``: the Trainer fetches and
    collates a step's batch before ``on_step_begin`` (stock ``AsyncGRPOTrainer`` packs its rows there), and
    a step's speed includes it."""

    def __init__(self):
        self.seconds = []

    def on_train_begin(self, args, state, control, **kwargs):
        self._last = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        self.seconds.append(now - self._last)
        self._last = now


# ------------------------------------------------------------------------------------------------ grpo-unique
def _grpo_trainer(tree: bool, mode: str, steps: int, out_dir: str):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from trl_dta import TreePPOConfig, TreePPOTrainer
    from trl_dta.testing.grpo import _WORDS, ScriptedGenerationMixin, make_config, make_trainer, tiny_model

    class Unique(ScriptedGenerationMixin):
        scripted_record = False

        def _scripted_turn(self, input_ids, member, budget):  # differs from the first token on
            tok, h = self._tokenizer, sum(input_ids) * 31 + member * 977
            words = " ".join(_WORDS[(h + 13 * j + member) % len(_WORDS)] for j in range(40))
            ids = tok.encode(f"{member} {words}", add_special_tokens=False)[: 24 + h % 17]
            return ids[: max(budget - 1, 0)] + [tok.eos_token_id]

    base, config_cls = (TreePPOTrainer, TreePPOConfig) if tree else (GRPOTrainer, GRPOConfig)
    extra = dict(tree_dense_fallback=mode) if tree else {}
    config = make_config(out_dir, config_cls=config_cls, per_device_train_batch_size=ROWS, num_generations=2,
                         gradient_accumulation_steps=1, num_iterations=1, max_steps=steps,
                         max_completion_length=64, learning_rate=1e-3, **extra)  # fmt: skip
    prompts = [[{"role": "user", "content": f"Question {i}: {_WORDS[i % len(_WORDS)]}?"}]
               for i in range(64 * WORLD)]  # fmt: skip
    return make_trainer(type("Bench", (Unique, base), {}), config, model=tiny_model(seed=0, **MODEL),
                        tools=False, dataset=Dataset.from_dict({"prompt": prompts}))  # fmt: skip


# ------------------------------------------------------------------------------------------------ sft-unique
def _sft_trainer(tree: bool, mode: str, steps: int, out_dir: str):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from trl_dta import TreeSFTConfig, TreeSFTTrainer
    from trl_dta.testing.grpo import _WORDS, tiny_model, tiny_tokenizer
    from trl_dta.testing.sft import make_sft_config

    base, config_cls = (TreeSFTTrainer, TreeSFTConfig) if tree else (SFTTrainer, SFTConfig)
    extra = dict(tree_dense_fallback=mode) if tree else {}
    config = make_sft_config(out_dir, config_cls=config_cls, per_device_train_batch_size=ROWS,
                             gradient_accumulation_steps=1, max_steps=steps, **extra)  # fmt: skip
    rows = []
    for i in range(ROWS * steps * WORLD):  # unique from the user's first word; answers of 40-70 words
        words = lambda n, k: " ".join(_WORDS[(k * 7 + 13 * j) % len(_WORDS)] for j in range(n))  # noqa: E731
        user, answer = f"{i} {words(8 + i % 5, i)}?", words(40 + 3 * (i % 11), i + 1)
        rows.append({"messages": [{"role": "user", "content": user},
                                  {"role": "assistant", "content": answer}]})  # fmt: skip
    return base(model=tiny_model(seed=0, **MODEL), args=config, processing_class=tiny_tokenizer(),
                train_dataset=Dataset.from_list(rows))  # fmt: skip


# ----------------------------------------------------------------------------------------------- async-single
def _async_trainer(tree: bool, mode: str, steps: int, out_dir: str):
    from trl.experimental.async_grpo import AsyncGRPOTrainer, async_grpo_trainer

    from trl_dta import AsyncTreePPOConfig, AsyncTreePPOTrainer
    from trl_dta.testing.async_grpo import (
        NoWeightTransfer,
        QueueWorker,
        register_cpu_tree_attention,
        synthetic_rollouts,
    )  # fmt: skip
    from trl_dta.testing.grpo import make_dataset, tiny_model, tiny_tokenizer
    from trl_dta.train.async_ppo.trainer import _peak_flops_off_cuda

    model_dir = os.path.join(tempfile.gettempdir(), "low_sharing_async_model")
    if not os.path.isdir(model_dir):
        tiny_model(seed=0, **MODEL).save_pretrained(model_dir)
    groups = ROWS * (steps + 1) * WORLD  # unique prompts of 24-60 tokens, one rollout each
    samples = synthetic_rollouts(0, tiny_model(seed=0, **MODEL), groups=groups, per_group=1,
                                 prompt=[24 + (7 * g) % 37 for g in range(groups)])  # fmt: skip
    extra = dict(tree_dense_fallback=mode) if tree else {}
    config = AsyncTreePPOConfig(
        output_dir=out_dir, per_device_train_batch_size=ROWS, gradient_accumulation_steps=1, max_steps=steps,
        bf16=False, use_cpu=True, optim="sgd", learning_rate=1e-3, max_grad_norm=0.0, report_to=[],
        save_strategy="no", logging_steps=1, max_staleness=100, token_budget=0, **extra,
    )  # fmt: skip
    cls = AsyncTreePPOTrainer if tree else AsyncGRPOTrainer
    trl_register, async_grpo_trainer.register_tree_attention = (
        async_grpo_trainer.register_tree_attention,
        register_cpu_tree_attention,
    )  # stock TRL's packed attention (FA3 on a GPU) in PyTorch, registered where its __init__ registers it
    try:
        with _peak_flops_off_cuda():  # (TRL asks CUDA for the device's peak FLOP rate)
            return cls(model_dir, args=config, processing_class=tiny_tokenizer(),
                       train_dataset=make_dataset(2), rollout_worker=QueueWorker(samples),
                       weight_transfer=NoWeightTransfer())  # fmt: skip
    finally:
        async_grpo_trainer.register_tree_attention = trl_register


CASES = {"grpo-unique": _grpo_trainer, "sft-unique": _sft_trainer, "async-single": _async_trainer}


def run(case: str, side: str, steps: int, keep_cache: bool) -> dict:
    tree, mode = side != "stock", side.removeprefix("tree-") if side != "stock" else ""
    if not keep_cache:  # each run starts from the shipped constants, as a first run on a machine does
        os.environ["TRL_DTA_CACHE_DIR"] = tempfile.mkdtemp(prefix="low_sharing_cache_")
    trainer = CASES[case](tree, mode, steps, tempfile.mkdtemp(prefix="low_sharing_"))
    trainer.remove_callback(PrinterCallback)
    clock = StepClock()
    trainer.add_callback(clock)
    trainer.train()
    logs = trainer.state.log_history
    paths = [h["tree/path"] for h in logs if "tree/path" in h]
    dedup = [h["tree/dedup_ratio"] for h in logs if "tree/dedup_ratio" in h]
    return {"step_s": clock.seconds, "train_s": sum(clock.seconds), "paths": paths, "dedup": dedup}


def paired(stock: list[dict], tree: list[dict]) -> float:
    """The median over rounds of stock's median step over the tree side's, each round's two runs adjacent in
    time: a slow phase of the machine that spans a round slows both sides of it."""
    pairs = zip(stock, tree, strict=True)
    ratios = [statistics.median(a["step_s"]) / statistics.median(b["step_s"]) for a, b in pairs]
    return statistics.median(ratios)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", default="all", choices=[*CASES, "all"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--processes", type=int, default=1, help="DDP processes (torchrun, gloo)")
    ap.add_argument("--sides", default="stock,tree-auto,tree-never",
                    help="stock first, then tree-auto, tree-never, tree-always")  # fmt: skip
    ap.add_argument("--keep_cache", action="store_true", help="reuse fitted constants across runs")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "out", "low_sharing.json"))
    args = ap.parse_args()
    if args.processes > 1 and "WORLD_SIZE" not in os.environ:  # relaunch: one process per rank
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               str(args.processes), os.path.abspath(__file__), *sys.argv[1:]]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        raise SystemExit(subprocess.run(cmd, env=env).returncode)
    main_rank = int(os.environ.get("RANK", 0)) == 0
    torch.set_num_threads(args.threads)
    load, started = load_average(), time.perf_counter()
    cases = list(CASES) if args.case == "all" else [args.case]
    sides = tuple(args.sides.split(","))
    if sides[0] != "stock" or not set(sides[1:]) <= {"tree-auto", "tree-never", "tree-always"}:
        ap.error("--sides: stock first, then some of tree-auto, tree-never, tree-always")
    results = {}
    for case in cases:
        runs = {side: [] for side in sides}
        for repeat in range(args.repeats + 1):  # the first round warms up (imports, allocator), not counted
            for side in sides:
                out = run(case, side, args.steps, args.keep_cache)
                if repeat:
                    runs[side].append(out)
        med = {s: statistics.median(t for r in runs[s] for t in r["step_s"]) for s in sides}
        train = {s: statistics.median(r["train_s"] for r in runs[s]) for s in sides}
        results[case] = {
            "median_step_s": med,
            "median_train_s": train,
            "speed_vs_stock": {s: med["stock"] / med[s] for s in sides[1:]},
            "train_speed_vs_stock": {s: train["stock"] / train[s] for s in sides[1:]},
            "paired_speed_vs_stock": {s: paired(runs["stock"], runs[s]) for s in sides[1:]},
            "dense_share": {s: statistics.mean(p for r in runs[s] for p in r["paths"]) for s in sides[1:]},
            "dedup_ratio": statistics.median(d for s in sides[1:] for r in runs[s] for d in r["dedup"]),
            "runs": runs,
        }
        r = results[case]
        if main_rank:
            print(f"{case}: median step s {({k: round(v, 4) for k, v in med.items()})}, speed vs stock "
                  f"{({k: round(v, 3) for k, v in r['speed_vs_stock'].items()})}, paired "
                  f"{({k: round(v, 3) for k, v in r['paired_speed_vs_stock'].items()})}, dense share "
                  f"{({k: round(v, 2) for k, v in r['dense_share'].items()})}, dedup "
                  f"{r['dedup_ratio']:.2f}")  # fmt: skip
    if not main_rank:
        return
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        env = environment(load, time.perf_counter() - started, threads=args.threads)
        json.dump({"environment": env, "steps": args.steps, "repeats": args.repeats, "processes": WORLD,
                   "results": results}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
    exit_worker()  # (a rank's process group would outlive the interpreter: trl_dta/testing/torchrun.py)
