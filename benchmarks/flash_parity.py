"""The flash path's bf16 exactness at a real shape, the GPU suite's first step (``benchmarks/gpu.sh``).

On Qwen3-0.6B's dimensions (28 layers, 16/8 heads of 128, random bf16 weights), three scenarios (a GRPO group,
a τ² slice, one-query segments: :mod:`trl_dta.testing.flash_parity`) are walked with the flash kernel and with
attention per segment through sdpa, and run dense, all on the same weights, each against an fp32 reference:
the flash path's gradient error must stay within 1.5x the sdpa path's + 2e-3, every kind of kernel call must
occur (packed rows, a lone segment read in place, the checkpointed recompute, long rows, one-query segments,
GQA, the chunked backward's recomputed pops) and each call's output must match the fp32 kernel on the same
inputs. The JSON is written after each scenario (a cut keeps what ran). Exit 1 if anything failed.

    python benchmarks/flash_parity.py --out OUT_DIR                       # CUDA: torch's varlen kernel
    python benchmarks/flash_parity.py --out OUT_DIR --device cpu --dims tiny --scale 0.25   # the stand-in
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's trl_dta
from trl_dta.testing import flash_parity  # noqa: E402

DIMS = {"qwen3-0.6b": flash_parity.QWEN3_0_6B, "tiny": flash_parity.TINY}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dims", default="qwen3-0.6b", choices=list(DIMS))
    ap.add_argument("--layers", type=int, help="decoder layers (default: the dims')")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the scenarios' lengths")
    ap.add_argument(
        "--long_tokens", type=int, help="a call of this many queries is 'long' (default 1024 x scale)"
    )
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # (the fp32 reference)
    dims = dict(DIMS[args.dims], **({"num_hidden_layers": args.layers} if args.layers else {}))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "flash_parity_bf16.json")
    long_tokens = args.long_tokens or max(16, int(1024 * args.scale))
    start = time.perf_counter()

    def write(report: dict) -> None:
        report["wall_s"] = time.perf_counter() - start
        with open(path, "w") as f:
            json.dump(report, f, indent=1, default=str)

    def progress(report: dict) -> None:
        print(flash_parity.lines(report)[len(report["scenarios"]) - 1], flush=True)
        write(report)

    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu, the stand-in kernel"
    layers = dims["num_hidden_layers"]
    print(f"bf16 parity on {where}: {args.dims} dims, {layers} layers, lengths x{args.scale:g}")
    report = flash_parity.run(dims, args.device, args.scale, long_tokens, on_scenario=progress)
    report.update(torch=torch.__version__, where=where)
    write(report)
    if report.get("flash_usable") is False:
        print(f"FAILED: torch's flash kernel failed its check {report['flash_checks']}: the walk used sdpa")
    print("\n".join(flash_parity.lines(report)[len(report["scenarios"]) :]))
    print(f"bf16 parity: {'ok' if report['ok'] else 'FAILED'} ({report['wall_s']:.0f} s; {path})")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
