"""Peak resident memory of one step of the τ² recipe on retail (recipes/ppo_tau2.py, its retail CPU config):
TreePPOTrainer vs stock GRPOTrainer with and without gradient checkpointing, each in a fresh process.

    python benchmarks/demo_memory.py [--runs tree,grpo,grpo+ckpt] [--max_rss_gb 18] [-- RECIPE FLAGS...]

Each run is ``recipes/ppo_tau2.py --config recipes/configs/ppo_tau2_retail.yaml --max_steps 1`` (plus
``--no_tree`` and ``--gradient_checkpointing`` as the run says, and any flags after ``--``) in its own
process; its peak RSS is the kernel's high-water mark of that process (``ru_maxrss`` from ``wait4``): the
model, torch, TRL, τ² and generation included, so it is what the machine must have. ``step s`` and
``tree/time_s`` come from the run's ``trainer_state.json``.

``--max_rss_gb`` caps each run's address space (``RLIMIT_AS``): a run that needs more fails with an
allocation error, reported as ``> cap``, instead of waking the kernel's OOM killer on a shared machine (stock
TRL without checkpointing holds every layer's activations of the 4 x ~5.5k-token micro-batch at once).

Time on the project's 2-core CPU (recipes/README.md "Timing"): ~6.5 min for the tree run, ~18 min for
stock TRL with checkpointing, a few minutes for a run that stops at the cap (generation comes first).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = {  # name: extra recipe flags
    "tree": [],
    "grpo": ["--no_tree", "--gradient_checkpointing", "false"],
    "grpo+ckpt": ["--no_tree", "--gradient_checkpointing", "true"],
}


def run(name: str, extra: list[str], cap_gb: float | None) -> dict:
    out = tempfile.mkdtemp(prefix=f"demo_mem_{name.replace('+', '_')}_")
    cmd = [sys.executable, os.path.join(ROOT, "recipes", "ppo_tau2.py"),
           "--config", os.path.join(ROOT, "recipes", "configs", "ppo_tau2_retail.yaml"),
           "--max_steps", "1", "--output_dir", out, "--save_strategy", "no", "--no_plot",
           "--report_to", "none", "--disable_tqdm", "true", *RUNS[name], *extra]  # fmt: skip

    def limit():  # in the child, before exec
        if cap_gb:
            cap = int(cap_gb * 2**30)
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    started = time.perf_counter()
    with open(os.path.join(out, "log.txt"), "w") as log:
        child = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, preexec_fn=limit)
        _, status, usage = os.wait4(child.pid, 0)
    returncode = os.waitstatus_to_exitcode(status)
    result = {"name": name, "cmd": cmd, "returncode": returncode,
              "wall_s": time.perf_counter() - started, "peak_rss_mib": usage.ru_maxrss / 1024,
              "log": os.path.join(out, "log.txt")}  # fmt: skip
    state = os.path.join(out, "trainer_state.json")
    if returncode == 0 and os.path.exists(state):
        with open(state) as f:
            logs = [h for h in json.load(f)["log_history"] if "step_time" in h]
        if logs:
            keys = ("step_time", "tree/time_s", "tree/dedup_ratio", "loss")
            result.update({k: logs[0].get(k) for k in keys})
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default="tree,grpo,grpo+ckpt", help=f"comma-separated, of {sorted(RUNS)}")
    ap.add_argument("--max_rss_gb", type=float, help="cap each run's address space (RLIMIT_AS) at this")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "out", "demo-memory.json"))
    ap.add_argument("recipe_flags", nargs="*", help="after --: more flags for recipes/ppo_tau2.py")
    args = ap.parse_args()
    results = []
    for name in args.runs.split(","):
        r = run(name, args.recipe_flags, args.max_rss_gb)
        results.append(r)
        peak = f"{r['peak_rss_mib']:.0f} MiB"
        if r["returncode"] != 0:
            cap = f", cap {args.max_rss_gb} GiB" if args.max_rss_gb else ""
            peak += f" (failed, rc {r['returncode']}{cap})"
        print(f"{name:10s} peak RSS {peak}, wall {r['wall_s']:.0f} s, step_time {r.get('step_time')}, "
              f"tree/time_s {r.get('tree/time_s')}  log: {r['log']}", flush=True)  # fmt: skip
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"max_rss_gb": args.max_rss_gb, "load_avg_1min_after": os.getloadavg()[0],
                   "cpu_count": os.cpu_count(), "results": results}, f, indent=2)  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
