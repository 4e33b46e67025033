"""Benchmark: TreePPOTrainer's step time on 2 CPU processes under DDP, FSDP2 (gather-once and per-layer),
DeepSpeed ZeRO-2 and ZeRO-3, each prepared by accelerate itself (trl_dta/testing/cpu_distributed.py, a test
device: gloo on CPU).

    torchrun --nproc_per_node 2 benchmarks/distributed_trainer.py --mode zero3 [--case tau2-ga4] [--steps 4]

One trainer per run, ``benchmarks/trainer.py``'s model (a 4-layer Qwen3, hidden 256, fp32, sdpa) and scripted
batches of ``--case`` per rank (so the global batch is twice the case's), SGD, clipping on. Rank 0 prints one
JSON line: TRL's logged ``step_time`` (one ``training_step``) and the walk's ``tree/time_s`` per optimizer
step, medians over the steps after the first (which also generates and compiles nothing, but allocates), and
the wall time of ``trainer.train()``. Results go to ``--out`` (benchmarks/out/) as well.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's trl_dta
from trainer import CASES, MODEL, TRAINERS, long_prompt_dataset  # noqa: E402  (benchmarks/trainer.py)
from transformers.trainer_callback import PrinterCallback  # noqa: E402

from trl_dta import TreePPOConfig  # noqa: E402
from trl_dta.testing.cpu_distributed import MODES, process_state, trainer_settings  # noqa: E402
from trl_dta.testing.grpo import make_config, make_trainer, tiny_model  # noqa: E402
from trl_dta.testing.torchrun import exit_worker  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=MODES, required=True)
    ap.add_argument("--case", choices=sorted(CASES), default="tau2-ga4")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "out"))
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    process_state(args.mode)
    batch, accumulation, prompts, tools = CASES[args.case]
    config = make_config(tempfile.mkdtemp(prefix="bench_dist_"), config_cls=TreePPOConfig,
                         per_device_train_batch_size=batch, num_generations=8,
                         gradient_accumulation_steps=accumulation, num_iterations=2, max_steps=args.steps,
                         learning_rate=1e-4, max_grad_norm=1.0, disable_tqdm=True,
                         **trainer_settings(args.mode))  # fmt: skip
    dataset = long_prompt_dataset(prompts, 600) if not tools else None
    trainer_cls = TRAINERS["c: TreePPO"][0]
    trainer = make_trainer(trainer_cls, config, model=tiny_model(seed=0, **MODEL), num_prompts=prompts * 2,
                           tools=tools, dataset=dataset)  # fmt: skip
    trainer.remove_callback(PrinterCallback)
    trainer.bench = {"fwd_bwd": [], "logp": [], "padded": []}
    started = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - started
    logs = [h for h in trainer.state.log_history if "step_time" in h]
    later = logs[1:] or logs
    result = {
        "mode": args.mode, "case": args.case, "world": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type), "steps": args.steps,
        "step_s": statistics.median(h["step_time"] for h in later),
        "tree_time_s": statistics.median(h["tree/time_s"] for h in later if "tree/time_s" in h),
        "train_s": train_s, "threads": args.threads,
    }  # fmt: skip
    if int(os.environ.get("RANK", 0)) == 0:
        print(json.dumps(result))
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"distributed_trainer_{args.mode}_{args.case}.json"), "w") as f:
            json.dump(result, f, indent=1)
    exit_worker()  # (trl_dta/testing/torchrun.py)


if __name__ == "__main__":
    main()
