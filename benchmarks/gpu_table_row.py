"""One row of the GPU suite's decisive table (``benchmarks/gpu_table.py`` runs a process per row): one model,
shape and method in this process, a warm-up step, then ``--rounds`` timed steps; the row as JSON in ``--out``.

    python benchmarks/gpu_table_row.py --model qwen3-0.6b --shape grpo-4k-g16 --method tree --out ROW.json

A step is the method's forward and backward of the whole optimizer step's rollouts into ``.grad`` (peers.py
lists the methods); times are medians (CUDA synchronised around each step). The peak is the process's
``torch.cuda.max_memory_allocated`` (weights, gradients and activations; the process starts with none), on a
CPU its peak resident set. An out-of-memory error is the row's result: status "OOM", exit code 3, and the
memory goes with the process, so the next row starts on an empty device. Any other exception: status "error",
exit code 1. ``--inject_oom`` makes the method raise ``torch.OutOfMemoryError`` after its first step (the dry
run shows with it that such a row says OOM and that the rows after it still run).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import sys
import time
import traceback

T0 = time.perf_counter()

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's trl_dta
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # common.py, peer_bench/
import common  # noqa: E402
from peer_bench.context import Context  # noqa: E402
from peer_bench.methods import RUNNERS  # noqa: E402
from peer_bench.workloads import MODELS, make_model, shapes_for  # noqa: E402

from trl_dta.walk.attention import check  # noqa: E402

OOM_EXIT = 3


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, choices=list(MODELS))
    ap.add_argument("--shape", required=True, help="a shape of peers.py's gpu profile (workloads.shapes_for)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every sequence length")
    ap.add_argument("--method", required=True, choices=list(RUNNERS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--rounds", type=int, default=3, help="timed steps after the warm-up step")
    ap.add_argument("--micro_batch", type=int, default=2, help="rows per dense forward/backward (0: a group)")
    ap.add_argument(
        "--inject_oom", action="store_true", help="raise torch.OutOfMemoryError after the warm-up"
    )
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument(
        "--memory_budget", type=float, help="the walk's activation budget in bytes (default: 'auto')"
    )
    ap.add_argument("--out", required=True, help="the row's JSON file")
    return ap.parse_args(argv)


def peak_gib(device: torch.device) -> float | None:
    """The process's peak so far: CUDA's max allocated (the walks' own resets of it accounted), else the
    peak resident set (Linux: KiB)."""
    if device.type == "cuda":
        from trl_dta.walk.memory import peak as walk_peak

        return walk_peak.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run(args, row: dict) -> None:
    """Build, warm up, time; fills ``row`` as it goes (what it got before an OOM stays)."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cuda":
        row["device_name"] = torch.cuda.get_device_name(device)
        row["card_gib"] = torch.cuda.get_device_properties(device).total_memory / 2**30
    else:
        row["device_name"] = common.processor_name()
    wl = next(
        w for w in shapes_for("gpu", MODELS[args.model]["vocab_size"], args.scale) if w.name == args.shape
    )
    row.update({k: v for k, v in wl.stats().items() if k != "shape"})
    model = make_model(args.model, device, dtype, args.attn)
    if device.type == "cuda":
        row["model_gib"] = torch.cuda.memory_allocated(device) / 2**30
    budget = "auto" if args.memory_budget is None else args.memory_budget
    ctx = Context(model, device, args.attn, None, args.micro_batch or None, memory_budget=budget)
    runner = RUNNERS[args.method]
    row["build_s"] = time.perf_counter() - T0

    def step():
        model.zero_grad(set_to_none=True)
        runner(ctx, wl)

    row["first_s"] = common.timed(step, device)  # the warm-up: kernels chosen, the walk's probe, caches
    if args.inject_oom:
        raise torch.OutOfMemoryError("injected by --inject_oom (benchmarks/gpu_table_row.py)")
    runs = [common.timed(step, device) for _ in range(args.rounds)]
    row.update(runs_s=runs, time_s=statistics.median(runs) if runs else row["first_s"])
    norms = [p.grad.float().norm() ** 2 for p in model.parameters() if p.grad is not None]
    row["grad_norm"] = math.sqrt(float(sum(norms))) if norms else None  # (one step's; methods agree to bf16)
    if args.method == "tree":
        ex = ctx.executor
        row["walk"] = {
            "calls_per_step": {"forward": ex.calls.forward / (1 + args.rounds),
                               "backward": ex.calls.backward / (1 + args.rounds)},
            "budgets": ex.budgets.metrics(),
            "oom_halvings": sum(c.event == "halved" for c in ex.budgets.history),
            "peak_memory_gib": None if ex.peak_memory is None else ex.peak_memory / 2**30,
            # the model calls each attention kernel attended (trl_dta/walk/attention/kernel.py), and each
            # kernel's check per (kernel, device, dtype, heads, kv heads, head dim): False means it fell
            # back to sdpa per segment
            "attention_calls": dict(ex.calls.attention),
            "attention": ex.lm.kernel.name,
            "flash_checks": {str(k): v for k, v in check.VERDICTS.items()},
        }  # fmt: skip


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    row = {"model": args.model, "shape": args.shape, "scale": args.scale, "method": args.method,
           "dtype": args.dtype, "attn": args.attn, "device": args.device, "rounds": args.rounds,
           "micro_batch": args.micro_batch if args.method.startswith("dense") else None,
           "memory_budget": args.memory_budget, "torch": torch.__version__, "status": "ok"}  # fmt: skip
    code = 0
    try:
        run(args, row)
    except torch.OutOfMemoryError as exc:  # the row's result; the process's end frees the memory
        row.update(status="OOM", error=f"{type(exc).__name__}: {str(exc)[:300]}")
        code = OOM_EXIT
    except Exception as exc:  # noqa: BLE001 - a failing method is a row, said as such
        traceback.print_exc()
        row.update(status="error", error=f"{type(exc).__name__}: {str(exc)[:300]}")
        code = 1
    row["peak_gib"] = peak_gib(torch.device(args.device))
    if args.device.startswith("cuda"):  # (the caching allocator's retries: frees and retries after a miss)
        stats = torch.cuda.memory_stats()
        row.update(alloc_retries=stats.get("num_alloc_retries"), alloc_ooms=stats.get("num_ooms"))
    row["alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    row["peak_kind"] = "cuda max_memory_allocated" if args.device.startswith("cuda") else "cpu peak RSS"
    row["wall_s"] = time.perf_counter() - T0
    with open(args.out, "w") as f:
        json.dump(row, f, indent=1, default=str)
    print(
        json.dumps({k: row.get(k) for k in ("method", "status", "time_s", "peak_gib", "error") if k in row})
    )
    return code


if __name__ == "__main__":
    sys.exit(main())
