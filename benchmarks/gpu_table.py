"""The GPU suite's decisive table (``benchmarks/gpu.sh`` prints it first): per configuration, each method's
step time, its ratio to dense + gradient checkpointing, its peak memory beside the plan's estimate, and the
walk's share of its ideal.

    python benchmarks/gpu_table.py --out OUT_DIR [--budget 300]          # on the GPU machine (gpu.sh)
    python benchmarks/gpu_table.py --out OUT_DIR --device cpu --model tiny --scale 0.03125 --configs 1 \\
        --inject_oom dense                                                 # the dry run's (gpu.sh --dry-run)

Configurations (``CONFIGS``), the most decisive first: Qwen3-0.6B on grpo-4k-g16 (one prompt of 4,096 tokens,
16 completions of 256-768), Qwen3-1.7B on tau2-2x8-10k at 1/8 length, Qwen3-0.6B on the full tau2-2x8-10k
(``peers.py``'s GPU shapes, random weights from the published configs, bf16, sdpa). Methods (``peers.py``
describes each): ``tree``, the walk with TreeExecutor's defaults (``memory_budget="auto"``); ``pg``,
PrefixGrouper; ``dense_ckpt``, dense with gradient checkpointing in micro-batches of ``--micro_batch`` rows
(TRL's ``per_device_train_batch_size``, default 2), gradients accumulating; ``trl_packing``, TRL's own
per-segment packing, only where TRL imports (the GPU machine has none: the row says "n/a (no TRL)"). On the
first configuration a second walk row, ``tree_budget``, runs the walk at an activation budget meant for the
memory target: under half PrefixGrouper's peak measured just before (``budget_bytes``; "n/a" where
PrefixGrouper has no peak, e.g. it ran out of memory). Every row's process gets
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (``ALLOC_CONF``; ``--alloc_conf`` or the environment
overrides it) and the row records the allocator's retries.

Every (configuration, method) runs in its own process (``benchmarks/gpu_table_row.py``: a warm-up step, then
the median of ``rounds`` timed steps) under a timeout. An out-of-memory error is that row's "OOM", and the
memory goes with its process: it cannot reach the rows after it, as on 2026-12-04, when one OOM in a shared
process failed every later configuration. A process that crashes or runs out of time is a row too ("error:
...", "timeout"). A row starts only if what is left of ``--budget`` covers its estimate (``Config.est_s``:
seconds per process on an H200, from the 2026-12-04 timings plus ~10 s of start-up and model build), else it
says "skipped (deadline)"; it runs under a timeout of 3x its estimate (at least 45 s), or what is left.

Columns: ``s``, the median step; ``vs ckpt``, dense + checkpointing's time over the method's; ``peak GiB``,
the process's ``torch.cuda.max_memory_allocated`` (weights included; a CPU: peak RSS); ``predicted GiB``, the
plan's estimate of a training step (``peer_bench/memory_plan.py``, AdamW states included); ``of ideal``, the
speedup over dense + checkpointing divided by the token dedup ratio (the walk, TRL's packing) or by
PrefixGrouper's own dedup ratio (``pg``); ``retries``, the caching allocator's ``num_alloc_retries``. The
summary gives the walk per configuration, the flash kernel's checks (loud where one failed) and the GPU
targets per card (:func:`targets`): where a peer runs out of memory on the card, its target is "not
measurable on this card" with the walk's own figures; the full τ² step's PrefixGrouper row is an OOM as its
plan predicts (or says that it fit). The process exits 0 once the table is written, whatever its rows say,
except where a walk row crashed (an error, not an OOM or a timeout): 1.

Outputs in ``--out``: ``gpu_table.md``, ``gpu_table.json``, and per row ``gpu_table_rows/<n>_<method>.json``
and ``.log`` (the process's output).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # this checkout's trl_dta
sys.path.insert(0, HERE)  # peer_bench/
from peer_bench import memory_plan  # noqa: E402
from peer_bench.workloads import MODELS, approx_params, shapes_for  # noqa: E402


@dataclass(frozen=True)
class Config:
    model: str
    shape: str
    scale: float
    rounds: int  # timed steps after the warm-up
    est_s: dict = field(hash=False)  # seconds one row's process takes on an H200, per method

    def label(self) -> str:
        length = "" if self.scale == 1 else f" x{self.scale:g}"
        return f"{self.model} {self.shape}{length}"


CONFIGS = (
    # 2026-12-04 (H200): walk ~1.0 s (first 5.2 s), pg 0.7 s, dense + ckpt 3.2 s a step
    Config("qwen3-0.6b", "grpo-4k-g16", 1.0, 3, {"tree": 20, "pg": 15, "dense_ckpt": 25, "trl_packing": 20}),
    # walk 1.1 s, dense without checkpointing 0.85-1.15 s
    Config(
        "qwen3-1.7b", "tau2-2x8-10k", 0.125, 3, {"tree": 20, "pg": 15, "dense_ckpt": 20, "trl_packing": 20}
    ),
    # the walk's first (metered) step 10.3 s; PrefixGrouper and dense + ckpt never ran (OOM after the walk)
    Config("qwen3-0.6b", "tau2-2x8-10k", 1.0, 2, {"tree": 35, "pg": 25, "dense_ckpt": 45, "trl_packing": 35}),
)
# PrefixGrouper first: the walk's memory row ("tree_budget", the first configuration) needs its peak
METHODS = ("pg", "tree", "dense_ckpt", "trl_packing")
MIN_TIMEOUT_S = 45
# The walk's memory row: an activation budget that keeps its peak under half PrefixGrouper's measured one,
# with a margin for what the budget does not cover (the allocator's rounding, the LM head's chunk).
BUDGET_SHARE, BUDGET_MARGIN = 0.5, 0.85
# Every row's process gets the same allocator, with expandable segments: the walk's calls change shape
# call by call and the dense methods' micro-batches are large, so each fragments the caching allocator,
# and a run that retries less measures the method rather than the allocator (the retries are a column).
ALLOC_CONF = "expandable_segments:True"
COLUMNS = ("configuration", "method", "status", "s", "vs ckpt", "peak GiB", "predicted GiB", "of ideal",
           "retries")  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=300, help="seconds for the whole table")
    ap.add_argument("--configs", help="comma-separated 1-based indices of CONFIGS (default: all)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--model", help="run every configuration on this model instead (the dry run: tiny)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every configuration's lengths")
    ap.add_argument("--rounds", type=int, help="timed steps per row (default: the configuration's)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--micro_batch", type=int, default=2, help="rows per dense + checkpointing micro-batch")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads of each row's process")
    ap.add_argument(
        "--alloc_conf", default=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF),
        help=f"PYTORCH_CUDA_ALLOC_CONF of every row's process (default: {ALLOC_CONF})",
    )  # fmt: skip
    ap.add_argument(
        "--inject_oom", metavar="METHOD",
        help="add a row of METHOD to the first configuration, second, that raises torch.OutOfMemoryError",
    )  # fmt: skip
    return ap.parse_args(argv)


@dataclass
class Table:
    """The rows run so far, and where they go."""

    args: argparse.Namespace
    start: float = field(default_factory=time.perf_counter)
    rows: list[dict] = field(default_factory=list)

    def left(self) -> float:
        return self.args.budget - (time.perf_counter() - self.start)


def row_plan(args) -> list[tuple[Config, list[tuple[str, bool]]]]:
    """The configurations, each with its (method, inject an OOM) rows, in the order they run."""
    picked = [CONFIGS[int(i) - 1] for i in args.configs.split(",")] if args.configs else list(CONFIGS)
    plan = [
        (Config(args.model or c.model, c.shape, c.scale * args.scale, args.rounds or c.rounds, c.est_s),
         [(m, False) for m in args.methods.split(",")])
        for c in picked
    ]  # fmt: skip
    first = plan[0][1] if plan and plan[0][0].shape == "grpo-4k-g16" else []
    names = [m for m, _ in first]
    if "pg" in names and "tree" in names:  # (the memory row, after both: it needs PrefixGrouper's peak)
        first.insert(max(names.index("pg"), names.index("tree")) + 1, ("tree_budget", False))
    if args.inject_oom:
        plan[0][1].insert(1, (args.inject_oom, True))
    return plan


def budget_bytes(rows: list[dict], config: Config, dtype: str) -> tuple[float | None, str]:
    """The walk's memory row's activation budget: what keeps its peak under half PrefixGrouper's measured
    peak (``BUDGET_SHARE``, with ``BUDGET_MARGIN``) once its weights and gradients are counted; else None and
    why (PrefixGrouper has no peak here: it ran out of memory, or did not run; or nothing would be left)."""
    pg = next((r for r in rows if r["method"] == "pg" and not r.get("injected_oom")), {})
    if pg.get("status") != "ok" or not pg.get("peak_gib"):
        return None, f"n/a (PrefixGrouper {pg.get('status', 'not run')})"
    weights = approx_params(config.model) * (2 if dtype in ("bfloat16", "float16") else 4)
    budget = BUDGET_SHARE * BUDGET_MARGIN * pg["peak_gib"] * 2**30 - 2 * weights  # (weights and gradients)
    if budget < 2**28:
        return None, "n/a (half PrefixGrouper's peak leaves no room)"
    return budget, ""


def run_row(table: Table, config: Config, method: str, inject: bool, n: int, before: list[dict]) -> dict:
    """One row: not run (n/a, deadline), or its process's result; ``before``: the configuration's rows so
    far (the walk's memory row reads PrefixGrouper's peak there)."""
    args = table.args
    row = {"model": config.model, "shape": config.shape, "scale": config.scale, "method": method,
           "injected_oom": inject}  # fmt: skip
    est = config.est_s.get("tree" if method == "tree_budget" else method, 30)
    if method == "trl_packing" and importlib.util.find_spec("trl") is None:
        return dict(row, status="n/a (no TRL)")
    budget = None
    if method == "tree_budget":
        budget, why = budget_bytes(before, config, args.dtype)
        if budget is None:
            return dict(row, status=why)
        row["memory_budget_gib"] = budget / 2**30
    if table.left() < max(est, MIN_TIMEOUT_S):  # (a row's process takes ~15 s to start: none cut mid-way)
        return dict(row, status="skipped (deadline)", left_s=table.left())
    timeout = int(min(max(MIN_TIMEOUT_S, 3 * est), table.left()))
    folder = os.path.join(args.out, "gpu_table_rows")
    os.makedirs(folder, exist_ok=True)
    out, log = (os.path.join(folder, f"{n:02d}_{method}{ext}") for ext in (".json", ".log"))
    cmd = [sys.executable, os.path.join(HERE, "gpu_table_row.py"), "--model", config.model,
           "--shape", config.shape, "--scale", str(config.scale), "--method", method.replace("_budget", ""),
           "--device", args.device,
           "--dtype", args.dtype, "--attn", args.attn, "--rounds", str(config.rounds),
           "--micro_batch", str(args.micro_batch), "--threads", str(args.threads), "--out", out]  # fmt: skip
    cmd += ["--inject_oom"] if inject else []
    cmd += ["--memory_budget", str(budget)] if budget is not None else []
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=args.alloc_conf)
    if os.path.exists(out):
        os.remove(out)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            code = subprocess.run(
                cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, check=False, env=env
            ).returncode
        except subprocess.TimeoutExpired:  # (the process is killed: its memory goes with it)
            code = None
    row["process_s"] = time.perf_counter() - t0
    if os.path.exists(out):
        with open(out) as f:
            row.update({k: v for k, v in json.load(f).items() if k != "method"})
        if inject and row["status"] == "OOM":
            row["status"] = "OOM (injected)"
    elif code is None:
        row["status"] = f"timeout ({timeout} s)"
    else:
        row.update(status="error", error=f"exit {code}: {_last_line(log)}")
    if row["status"] == "error":
        row["status"] = f"error: {row.get('error', '')[:70]}"
    return row


def _last_line(path: str) -> str:
    with open(path, errors="replace") as f:
        lines = [line.strip() for line in f if line.strip()]
    return lines[-1][:200] if lines else "(no output)"


def fill_config(rows: list[dict], config: Config, args) -> None:
    """Ratios, shares of the ideal and the memory estimate of one configuration's rows."""
    p = MODELS[config.model]
    wl = next(w for w in shapes_for("gpu", p["vocab_size"], config.scale) if w.name == config.shape)
    stats = wl.stats()
    ckpt = next((r.get("time_s") for r in rows if r["method"] == "dense_ckpt" and r["status"] == "ok"), None)
    b = 2 if args.dtype in ("bfloat16", "float16") else 4
    for r in rows:
        r.setdefault("tokens", stats["tokens"])
        r.setdefault("dedup", stats["dedup"])
        r.setdefault("pg_dedup", stats["pg_dedup"])
        method = r["method"].replace("_budget", "")
        if method in memory_plan.METHODS and r["method"] != "tree_budget":
            micro = args.micro_batch if method.startswith("dense") else None
            e = memory_plan.estimate(method, wl, p, b, approx_params(config.model), micro)
            r["predicted_gib"] = e.total / 2**30
            r["predicted_floor_gib"] = None if e.floor is None else e.floor / 2**30
        if r["status"] == "ok" and ckpt and r.get("time_s"):
            r["vs_ckpt"] = ckpt / r["time_s"]
            ideal = {"tree": stats["dedup"], "tree_budget": stats["dedup"], "trl_packing": stats["dedup"],
                     "pg": stats["pg_dedup"]}  # fmt: skip
            if r["method"] in ideal:
                r["of_ideal"] = r["vs_ckpt"] / ideal[r["method"]]


def cells(r: dict, first: bool, config: Config) -> list[str]:
    def num(key, fmt):
        return fmt.format(r[key]) if r.get(key) is not None else "-"

    label = f"{config.label()} ({r['tokens']:,} tokens, dedup {r['dedup']:.2f})" if first else ""
    return [label, r["method"], r["status"], num("time_s", "{:.3f}"), num("vs_ckpt", "{:.2f}x"),
            num("peak_gib", "{:.3g}"), num("predicted_gib", "{:.3g}"), num("of_ideal", "{:.2f}"),
            num("alloc_retries", "{:d}")]  # fmt: skip


def markdown_rows(rows: list[dict], config: Config) -> list[str]:
    return ["| " + " | ".join(cells(r, i == 0, config)) + " |" for i, r in enumerate(rows)]


def summary(groups: list[tuple[Config, list[dict]]]) -> list[str]:
    """The walk against PrefixGrouper and its ideal, per configuration, the flash kernel's checks, and the
    GPU targets (:func:`targets`)."""
    lines = []
    for config, rows in groups:
        by = {r["method"]: r for r in rows if not r.get("injected_oom")}
        walk, pg = by.get("tree", {}), by.get("pg", {})
        if walk.get("status") != "ok":
            lines.append(f"- {config.label()}: walk {walk.get('status', 'not run')}")
            continue
        text = f"- {config.label()}: walk {walk['time_s']:.3f} s, peak {walk['peak_gib']:.3g} GiB"
        how = walk.get("walk") or {}
        if how:  # (its calls per step, and the kernels that attended them: trl_dta/walk/attention/kernel.py)
            ran = ", ".join(f"{k} {n:g}" for k, n in (how.get("attention_calls") or {}).items()) or "-"
            text += f" ({how['calls_per_step']['forward']:g} calls per step; all rounds by kernel: {ran})"
        if walk.get("of_ideal") is not None:
            text += f", {walk['vs_ckpt']:.2f}x dense + ckpt = {walk['of_ideal']:.2f} of its dedup ratio"
        if pg.get("status") == "ok" and walk.get("peak_gib") and pg.get("peak_gib"):
            text += (f"; {pg['time_s'] / walk['time_s']:.2f}x PrefixGrouper's speed at "
                     f"{walk['peak_gib'] / pg['peak_gib']:.2f} of its peak")  # fmt: skip
        elif str(pg.get("status", "")).startswith("OOM"):
            text += "; PrefixGrouper ran out of memory on this card"
        lines.append(text)
    lines += flash_lines([r for _, rows in groups for r in rows])
    lines += targets(groups)
    return lines


def flash_lines(rows: list[dict]) -> list[str]:
    """The flash kernel's checks in the walk's rows, loud where one failed (the walk then attended per segment
    through sdpa: exact, but not the kernel the table means to measure)."""
    checks = {}
    for r in rows:
        checks.update((r.get("walk") or {}).get("flash_checks") or {})
    failed = [key for key, ok in checks.items() if not ok]
    if failed:
        return [f"- FLASH CHECK FAILED for {', '.join(failed)}: those walks attended per segment with sdpa "
                "(see the rows' logs for the kernel's error)"]  # fmt: skip
    return [f"- flash kernel: checked exact and used ({', '.join(checks)})"] if checks else []


def _card(rows: list[dict]) -> str:
    card = next((r.get("card_gib") for r in rows if r.get("card_gib")), None)
    return f"{card:.0f} GiB" if card else "this device"


def targets(groups: list[tuple[Config, list[dict]]]) -> list[str]:
    """The GPU targets, per card (the first configuration is grpo-4k-g16, the second tau2 x1/8, the third the
    full tau2 step; other selections say nothing). Where a peer runs out of memory the target is "not
    measurable on this card", with the walk's own figures, never "NOT met"."""
    if [(c.shape, c.scale) for c, _ in groups[:3]] != [(c.shape, c.scale) for c in CONFIGS]:
        return []
    by = [{r["method"]: r for r in rows if not r.get("injected_oom")} for _, rows in groups[:3]]
    card = _card([r for _, rows in groups for r in rows])
    return [_pg_target(by[0], card), _ideal_target(by[:2]), _full_target(by[2], card)]


def _walk_figures(walk: dict) -> str:
    if walk.get("status") != "ok":
        return f"the walk: {walk.get('status', 'not run')}"
    ratio = f", {walk['vs_ckpt']:.2f}x dense + ckpt" if walk.get("vs_ckpt") else ""
    return f"the walk: {walk['time_s']:.3f} s{ratio}, peak {walk['peak_gib']:.3g} GiB"


def _pg_target(by: dict, card: str) -> str:
    head = "- target: walk >= PrefixGrouper's speed at <= half its peak, grpo-4k-g16: "
    walk, pg, low = by.get("tree", {}), by.get("pg", {}), by.get("tree_budget", {})
    if str(pg.get("status", "")).startswith("OOM"):
        oom = f"PrefixGrouper ran out of memory on {card}"
        return head + f"not measurable on this card ({oom}); {_walk_figures(walk)}"
    if pg.get("status") != "ok" or walk.get("status") != "ok":
        return head + f"not measured (PrefixGrouper: {pg.get('status', 'not run')}; {_walk_figures(walk)})"
    speed, share = pg["time_s"] / walk["time_s"], walk["peak_gib"] / pg["peak_gib"]
    default = f"the default walk {speed:.2f}x its speed at {share:.2f} of its peak ({pg['peak_gib']:.3g} GiB)"
    if low.get("status") != "ok":
        return head + f"not measured (the walk at a budget: {low.get('status', 'not run')}); {default}"
    speed, share = pg["time_s"] / low["time_s"], low["peak_gib"] / pg["peak_gib"]
    met = speed >= 1.0 and share <= BUDGET_SHARE
    budget = f"at a budget of {low['memory_budget_gib']:.3g} GiB the walk ran {speed:.2f}x its speed"
    return head + f"{'met' if met else 'NOT met'}: {budget} at {share:.2f} of its peak; {default}"


def _ideal_target(by: list[dict]) -> str:
    head = "- target: walk >= 0.85 of its dedup ratio vs dense + ckpt on grpo-4k-g16 and tau2 x1/8: "
    ckpt = [str(b.get("dense_ckpt", {}).get("status", "not run")) for b in by]
    ideal = [b.get("tree", {}).get("of_ideal") for b in by]
    shown = ", ".join("-" if v is None else f"{v:.2f}" for v in ideal)
    if any(c.startswith("OOM") for c in ckpt):
        return head + f"not measurable on this card (dense + ckpt: {', '.join(ckpt)}; the walk: {shown})"
    return head + ("met" if all(v is not None and v >= 0.85 for v in ideal) else "NOT met") + f" ({shown})"


def _full_target(by: dict, card: str) -> str:
    walk, ckpt, pg = (by.get(m, {}) for m in ("tree", "dense_ckpt", "pg"))
    met = walk.get("status") == ckpt.get("status") == "ok"
    statuses = f"walk {walk.get('status', 'not run')}, dense + ckpt {ckpt.get('status', 'not run')}"
    text = f"- target: the full tau2 step runs, the walk and dense + ckpt: {'met' if met else 'NOT met'}"
    text += f" ({statuses})"
    planned = pg.get("predicted_gib")
    if not str(pg.get("status", "")).startswith("OOM"):
        return text + f"; PrefixGrouper {pg.get('status', 'not run')}"
    if planned is None:
        return text + f"; PrefixGrouper out of memory on {card}"
    predicted = "as its plan predicts" if planned > (pg.get("card_gib") or 0) else "though its plan fits"
    return text + f"; PrefixGrouper out of memory on {card}, {predicted} ({planned:.0f} GiB planned)"


def write(table: Table, groups: list[tuple[Config, list[dict]]], env: dict, final: bool) -> list[str]:
    """gpu_table.md and gpu_table.json (after every configuration: a killed run keeps what it has)."""
    lines = [f"# Decisive table: {env['where']}, {env['dtype']}, {env['attn']}, {env['date']}", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]  # fmt: skip
    for config, rows in groups:
        lines += markdown_rows(rows, config)
    notes = summary(groups) if final else ["- (incomplete: the table was still running)"]
    lines += ["", *notes]
    with open(os.path.join(table.args.out, "gpu_table.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    data = {"args": vars(table.args), "env": env, "complete": final, "rows": table.rows, "summary": notes,
            "configs": [vars(c) for c, _ in groups]}  # fmt: skip
    with open(os.path.join(table.args.out, "gpu_table.json"), "w") as f:
        json.dump(data, f, indent=1, default=str)
    return notes


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    table = Table(args)
    env = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "device": args.device,
           "where": args.device, "dtype": args.dtype, "attn": args.attn, "budget_s": args.budget,
           "micro_batch": args.micro_batch, "python": sys.version.split()[0]}  # fmt: skip
    print(
        f"# Decisive table ({args.dtype}, {args.attn}, {args.device}; a process per row; {args.budget:.0f} s)"
    )
    print("| " + " | ".join(COLUMNS) + " |\n" + "|" + "---|" * len(COLUMNS), flush=True)
    groups: list[tuple[Config, list[dict]]] = []
    for config, methods in row_plan(args):
        rows = []
        for method, inject in methods:
            rows.append(run_row(table, config, method, inject, len(table.rows), rows))
            table.rows.append(rows[-1])
            env["where"] = rows[-1].get("device_name") or env["where"]
        fill_config(rows, config, args)
        groups.append((config, rows))
        print("\n".join(markdown_rows(rows, config)), flush=True)
        write(table, groups, env, final=False)
    notes = write(table, groups, env, final=True)
    print("\n".join(["", *notes]))
    times = [r["process_s"] for r in table.rows if "process_s" in r]
    median = statistics.median(times) if times else 0.0
    print(f"(table: {time.perf_counter() - table.start:.0f} s, {len(times)} processes, median {median:.1f} s "
          f"each; {args.out}/gpu_table.md, gpu_table.json)")  # fmt: skip
    # the table is complete: its rows may be OOM, timeouts or skipped; a crash of the walk itself fails it
    return (
        1
        if any(r["method"].startswith("tree") and r["status"].startswith("error") for r in table.rows)
        else 0
    )


if __name__ == "__main__":
    sys.exit(main())
