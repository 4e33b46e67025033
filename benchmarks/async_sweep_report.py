"""Issue 40's tables from benchmarks/async_overlap.py's tagged runs
(benchmarks/out/async_overlap_<side>_<tag>.json): the latency sweep (synchronous against asynchronous, one
core each, per tool latency) and the staleness comparison (decoupled against coupled objective, per
``max_staleness``); ``--write`` gathers the runs' JSON into docs/ (docs/async-latency-sweep-cpu.json,
docs/async-staleness-cpu.json).

    python benchmarks/async_sweep_report.py latency --tags lat0.2,lat1,lat3
    python benchmarks/async_sweep_report.py staleness --tags stale1_coupled,stale1_decoupled,... --write
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "benchmarks" / "out"
DOCS = {"latency": REPO / "docs" / "async-latency-sweep-cpu.json",
        "staleness": REPO / "docs" / "async-staleness-cpu.json"}  # fmt: skip


def load(side: str, tag: str) -> dict | None:
    path = OUT / f"async_overlap_{side}_{tag}.json"
    return json.loads(path.read_text()) if path.exists() else None


def held_out(run: dict) -> str:
    if run.get("heldout_success") is None:
        return "not run"
    return f"{round(run['heldout_success'] * run['heldout_tasks'])}/{run['heldout_tasks']}"


def loads(run: dict) -> str:
    seen = [x for x in [*run.get("load_average", []), *run.get("load_average_at_steps", [])] if x is not None]
    return f"{min(seen):.1f}-{max(seen):.1f}" if seen else "-"


def column(run: dict, key: str) -> list[float]:
    return [v for v in run.get("per_step", {}).get(key, []) if v is not None and not math.isnan(v)]


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def pct(value: float) -> str:
    """A share as a percentage; "-" where there was nothing to count (no stale token in the run)."""
    return "-" if math.isnan(value) else f"{value:.1%}"


def latency(tags: list[str]) -> tuple[list[dict], list[str]]:
    runs, lines, ratios = [], [], []
    for tag in tags:
        sync, asyn = load("sync", tag), load("async", tag)
        for run in (sync, asyn):
            if run is None:
                continue
            runs.append(run)
            ends = run["step_ends_s"]
            steps = f"{run['steps']} in {run['elapsed_s']:.0f} s"
            later = f"{(ends[-1] - ends[0]) / (len(ends) - 1):.0f} s" if len(ends) > 1 else "-"
            lines.append(
                f"| {run['tool_latency']} s | {run['trainer']} | {steps} | {run['steps_per_s'] * 60:.2f} | "
                f"{ends[0]:.0f} s | {later} | {held_out(run)} | {run['wait_share']:.0%} | {loads(run)} |"
            )
        if sync and asyn:
            ratios.append((sync["tool_latency"], asyn["steps_per_s"] / sync["steps_per_s"]))
    for (l0, r0), (l1, r1) in zip(ratios, ratios[1:], strict=False):  # where async / sync crosses 1
        if (r0 - 1) * (r1 - 1) <= 0 and r0 != r1:
            cross = l0 + (1 - r0) * (l1 - l0) / (r1 - r0)
            lines.append(f"crossing (linear in latency between the two points): {cross:.2f} s")
    lines.append("async / sync steps per minute: " + ", ".join(f"{lat} s: {r:.2f}" for lat, r in ratios))
    return runs, lines


def staleness(tags: list[str]) -> tuple[list[dict], list[str]]:
    runs, lines = [], []
    for tag in tags:
        run = load("async", tag)
        if run is None:
            continue
        runs.append(run)
        objective = "decoupled" if run["use_decoupled_loss"] else "coupled"
        train_max = column(run, "staleness/train_max")
        capped = column(run, "staleness/stale_capped_ratio")
        weight_max = column(run, "decoupled/imp_weight_max")
        weights = (
            f"{mean(column(run, 'decoupled/imp_weight_mean')):.3f} / {max(weight_max):.2f}"
            if weight_max
            else "-"
        )
        steps = f"{run['steps']} in {run['elapsed_s']:.0f} s"
        lines.append(
            f"| {run['max_staleness']} | {objective} | {steps} | {held_out(run)} | "
            f"{max(train_max, default=math.nan):.0f} / {mean(column(run, 'staleness/train_mean')):.2f} | "
            f"{pct(mean(column(run, 'staleness/stale_token_share')))} | "
            f"{pct(mean(column(run, 'staleness/stale_clip_ratio')))} | {pct(mean(capped))} | "
            f"{pct(mean(column(run, 'staleness/stale_kept_ratio')))} | "
            f"{weights} | "
            f"{pct(mean(column(run, 'clip_ratio/region_mean')))} | {loads(run)} |"
        )
    lines.append("(means over the run's optimizer steps; staleness/train_max: the largest over the run)")
    return runs, lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=("latency", "staleness"))
    parser.add_argument("--tags", type=lambda v: v.split(","), required=True)
    parser.add_argument("--write", action="store_true", help="gather the runs' JSON into docs/")
    args = parser.parse_args()
    runs, lines = (latency if args.part == "latency" else staleness)(args.tags)
    print("\n".join(lines))
    if args.write:
        DOCS[args.part].write_text(json.dumps({"runs": runs, "table": lines}, indent=1, default=str) + "\n")
        print(f"-> {DOCS[args.part]}")


if __name__ == "__main__":
    main()
