"""Benchmark: TreeSFTTrainer vs stock TRL SFTTrainer on τ² gold conversations, in one run.

    python benchmarks/sft.py [--case retail|per-turn|warm-start] [--layers 4] [--conversations 4]
                             [--repeats 3] [--threads 2]

Cases (the data are τ²'s gold conversations, :mod:`trl_dta.envs.tau2.gold`; loss on the assistant's tokens,
``assistant_only_loss``; per-device batch ``--conversations / 2``, gradient accumulation 2, so one optimizer
step trains ``--conversations`` samples):

* ``retail``: τ² retail tasks with the domain policy in the system prompt: every conversation shares the
  ~5.4k-token system turn (policy + tool schemas), then its own tool calls and results (6-12k tokens each
  with SmolLM2's tokenizer).
* ``per-turn``: the demo's synthetic mock tasks (``policy=false``: a 0.9k-token system turn), each
  conversation cut into per-turn samples (:func:`~trl_dta.envs.tau2.gold.per_turn`: each a prefix of the
  next), in order (``train_sampling_strategy="sequential"``: a step holds consecutive turns of a few
  conversations, as a dataset of per-turn samples stored in order and not shuffled does).
* ``warm-start``: the demo's warm-start phase as ``make demo`` runs it (recipes/recipe_utils/warm_start.py:
  full SmolLM2, 8 mock conversations, one AdamW step), the whole phase timed (dataset, trainer, step), once
  per trainer.

Variants, in turn, ``--repeats`` times (each a fresh trainer, same initial weights, an empty cost cache):
stock ``SFTTrainer`` ± gradient checkpointing, ± ``padding_free``; ``TreeSFTTrainer`` (± ``padding_free``,
walked as the same samples; ``tree``: the default ``tree_dense_fallback="auto"``, which may take TRL's dense
path; ``tree+walk``: always walked; ``tree+block-16k``: ``tree_block_size=16384``, no chunked backward on
these paths). Measured per
run: the wall time of one optimizer step (the walk's one-time construction probe runs before it, outside the
timing), the peak memory it adds (CPU: resident set, ``PeakMemory``
of benchmarks/common.py; CUDA: allocated bytes); reported as medians, with the step's dedup ratio (tokens /
unique tokens of its trie) and TRL's loss of that step (equal for all variants up to float rounding).

Model: ``smollm2-offline`` (recipes/recipe_utils/offline_model.py's checkpoint), cut to its first
``--layers`` decoder layers (0: all 30) so that the dense variants finish on a 2-core CPU; fp32, sdpa.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import PeakMemory, environment, markdown_table, warn_if_busy
from transformers import TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes"))  # the offline SmolLM2

VARIANTS = {  # name -> (tree, gradient checkpointing, padding_free, tree options)
    "stock": (False, False, False, {}),
    "stock+gc": (False, True, False, {}),
    "stock+padding-free": (False, False, True, {}),
    "stock+gc+padding-free": (False, True, True, {}),
    "tree": (True, False, False, {}),  # tree_dense_fallback "auto": a step predicted faster dense goes dense
    "tree+walk": (True, False, False, {"tree_dense_fallback": "never"}),  # every step walked
    "tree+padding-free": (True, False, True, {}),
    # paths longer than the CPU default block (2048) walked without chunked backward's recompute
    "tree+block-16k": (True, False, False, {"tree_block_size": 16384}),
}


class StepTimer(TrainerCallback):
    """Wall time and peak memory of each optimizer step."""

    def __init__(self, device):
        self.device, self.seconds, self.peaks, self._meter = device, [], [], None

    def on_step_begin(self, args, state, control, **kwargs):
        self._meter = PeakMemory(self.device).__enter__()
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self._t0)
        self._meter.__exit__(None, None, None)
        self.peaks.append(self._meter.peak)


def conversations(case: str, count: int) -> list[dict]:
    from trl_dta.envs import Tau2Environment, load_tau2_dataset
    from trl_dta.envs.tau2.gold import gold_conversation, per_turn
    from trl_dta.envs.tau2.synthetic import add_mock_create_tasks

    if case == "retail":
        rows = load_tau2_dataset(domain="retail", split="train", policy=True, max_tasks=4 * count)
        env = functools.partial(Tau2Environment, domain="retail")
    else:
        train_ids, _ = add_mock_create_tasks(32, 16, seed=2)  # the demo's tasks
        rows = load_tau2_dataset(domain="mock", task_ids=train_ids, policy=False)
        env = functools.partial(Tau2Environment, domain="mock", max_user_turns=1)
    out = []
    for row in rows:
        try:
            out.append(gold_conversation(dict(row), env()))
        except ValueError:  # a task whose gold replay fails τ²'s check: not a gold conversation
            continue
    if case == "per-turn":
        return [sample for c in out for sample in per_turn(c)][:count]
    return out[:count]


def load_model(path: str, layers: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    if layers:
        model.model.layers = model.model.layers[:layers]
        model.config.num_hidden_layers = layers
    return model


def run_variant(name, data, model_path, tokenizer, args, device):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from trl_dta import TreeSFTConfig, TreeSFTTrainer

    tree, checkpointing, padding_free, options = VARIANTS[name]
    config_cls, trainer_cls = (TreeSFTConfig, TreeSFTTrainer) if tree else (SFTConfig, SFTTrainer)
    batch = max(len(data) // 2, 1)
    config = config_cls(
        output_dir=tempfile.mkdtemp(prefix="sft_bench_"), max_steps=1, per_device_train_batch_size=batch,
        gradient_accumulation_steps=2, learning_rate=1e-5, optim="sgd", lr_scheduler_type="constant",
        assistant_only_loss=True, max_length=None, padding_free=padding_free, bf16=False,
        use_cpu=device == "cpu",
        gradient_checkpointing=checkpointing, activation_checkpointing=checkpointing, logging_steps=1,
        save_strategy="no", report_to="none", seed=0, disable_tqdm=True, shuffle_dataset=False,
        train_sampling_strategy="sequential", dataloader_num_workers=0, **options,
    )  # fmt: skip
    timer = StepTimer(device)
    os.environ["TRL_DTA_CACHE_DIR"] = tempfile.mkdtemp(prefix="sft_bench_costs_")  # (a first run's constants)
    trainer = trainer_cls(model=load_model(model_path, args.layers), args=config,
                          train_dataset=Dataset.from_list(data), processing_class=tokenizer,
                          callbacks=[timer])  # fmt: skip
    if tree:  # the walk's one-time construction probe, outside the timed step
        trainer._executor(trainer.model)
    trainer.train()
    (log,) = [h for h in trainer.state.log_history if "loss" in h]
    return {"step_s": timer.seconds[0], "peak_mib": (timer.peaks[0] or 0) / 2**20, "loss": log["loss"],
            "dedup": log.get("tree/dedup_ratio"), "tokens": log.get("tree/tokens"),
            "dense_path": log.get("tree/path")}  # fmt: skip


def warm_start_phase(model_path, tokenizer, tree: bool, out_dir: str) -> float:
    """The demo's warm start, timed whole (recipes/recipe_utils/warm_start.py)."""
    from recipe_utils.warm_start import warm_start
    from transformers import AutoModelForCausalLM

    from trl_dta.envs import Tau2Environment, load_tau2_dataset
    from trl_dta.envs.tau2.synthetic import add_mock_create_tasks

    train_ids, _ = add_mock_create_tasks(32, 16, seed=2)
    rows = load_tau2_dataset(domain="mock", task_ids=train_ids, policy=False, seed=2)
    env = functools.partial(Tau2Environment, domain="mock", max_user_turns=1)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    started = time.perf_counter()
    log = warm_start(model, tokenizer, rows, env, steps=1, learning_rate=1e-4, batch_size=8,
                     output_dir=out_dir, seed=2, tree=tree)  # fmt: skip
    seconds = time.perf_counter() - started
    print(f"warm start ({'TreeSFTTrainer' if tree else 'SFTTrainer'}): {seconds:.1f} s, loss "
          f"{[round(h['loss'], 4) for h in log if 'loss' in h]}")  # fmt: skip
    return seconds


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", default="retail", choices=["retail", "per-turn", "warm-start"])
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of SmolLM2 kept (0: all)")
    ap.add_argument("--conversations", type=int, default=4, help="samples per optimizer step")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default="benchmarks/out")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from recipe_utils.offline_model import OFFLINE_SMOLLM2, resolve_model_name
    from transformers import AutoTokenizer

    load = warn_if_busy(args.threads)
    started = time.perf_counter()
    model_path, _ = resolve_model_name(OFFLINE_SMOLLM2)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    os.makedirs(args.out, exist_ok=True)
    if args.case == "warm-start":
        phase = functools.partial(warm_start_phase, model_path, tokenizer, out_dir=tempfile.mkdtemp())
        rows = [
            {"variant": "stock", "phase_s": phase(tree=False)},
            {"variant": "tree", "phase_s": phase(tree=True)},
        ]
        columns = [("variant", "variant", "{}"), ("warm-start phase s", "phase_s", "{:.1f}")]
    else:
        data = conversations(args.case, args.conversations)
        names = args.variants.split(",")
        runs = {name: [] for name in names}
        for _ in range(args.repeats):  # variants in turn, so that load changes hit all of them
            for name in names:
                runs[name].append(run_variant(name, data, model_path, tokenizer, args, device))
                print(name, runs[name][-1], flush=True)
        base = statistics.median(r["step_s"] for r in runs[names[0]])
        rows = []
        for name in names:
            step = statistics.median(r["step_s"] for r in runs[name])
            rows.append({"variant": name, "step_s": step, "speedup": base / step,
                         "peak_mib": statistics.median(r["peak_mib"] for r in runs[name]),
                         "loss": runs[name][0]["loss"], "dedup": runs[name][0]["dedup"],
                         "dense_path": runs[name][0]["dense_path"]})  # fmt: skip
        columns = [("variant", "variant", "{}"), ("step s (median)", "step_s", "{:.2f}"),
                   (f"x {names[0]}", "speedup", "{:.2f}"), ("peak MiB", "peak_mib", "{:.0f}"),
                   ("loss", "loss", "{:.4f}"), ("dedup", "dedup", "{:.2f}")]  # fmt: skip
    table = markdown_table(rows, columns)
    print(table)
    wall = time.perf_counter() - started
    result = {"case": args.case, "args": vars(args), "rows": rows,
              "environment": environment(load, wall, device=device)}  # fmt: skip
    path = Path(args.out) / f"sft-{args.case}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
