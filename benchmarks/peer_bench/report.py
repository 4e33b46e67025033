"""The peer benchmark's output: aligned and markdown tables (``COLUMNS``, docs/benchmarks.md's pivot
table), the result files (``<name>.json``, ``<name>.md``) and the plots (``<name>_speedup.png``,
``<name>_memory.png``, ``<name>_trainer_step.png``)."""

from __future__ import annotations

import json
import os

import common
import torch

from .methods import LABELS, METHODS

COLUMNS = [  # (header, key, format)
    ("model", "model", "{}"),
    ("attn", "attn", "{}"),
    ("shape", "shape", "{}"),
    ("rows", "rows", "{}"),
    ("tokens", "tokens", "{:,}"),
    ("dedup", "dedup", "{:.2f}x"),
    ("pg dedup", "pg_dedup", "{:.2f}x"),
    ("method", "method", "{}"),
    ("status", "status", "{}"),
    ("s", "time_s", "{:.3f}"),
    ("vs dense", "vs_dense", "{:.2f}x"),
    ("vs ckpt", "vs_dense_ckpt", "{:.2f}x"),
    ("saved MiB", "saved_mib", "{:.0f}"),
    ("peak MiB", "peak_mib", "{:.0f}"),
    ("grad err", "grad_err", "{:.1e}"),
]
SWEEP_COLUMNS = [
    ("model", "model", "{}"),
    ("leaves", "leaves", "{}"),
    ("tokens", "tokens", "{:,}"),
    ("dedup", "dedup", "{:.2f}x"),
    ("method", "method", "{}"),
    ("status", "status", "{}"),
    ("saved MiB", "saved_mib", "{:.0f}"),
    ("peak MiB", "peak_mib", "{:.0f}"),
    ("grad err", "grad_err", "{:.1e}"),
]


def pivot_markdown(results: list[dict]) -> str:
    """One row per (model, attention, shape): time of dense, every method's speedup over it, and the saved
    activations of every method (the table in docs/benchmarks.md)."""
    methods = [m for m in METHODS if any(r["method"] == m for r in results)]
    short = {"dense": "dense", "dense_ckpt": "ckpt", "pg": "PG", "pg_lmhead": "PG head",
             "tree_mask": "tree mask", "tree": "walk"}  # fmt: skip
    head = ["shape", "tokens", "dedup", "PG dedup", "dense s"] + [f"{short[m]} ×" for m in methods[1:]]
    head += ["saved MiB: " + " / ".join(short[m] for m in methods)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    keys = list(dict.fromkeys((r["model"], r["attn"], r["shape"]) for r in results))
    for key in keys:
        rs = {r["method"]: r for r in results if (r["model"], r["attn"], r["shape"]) == key}
        first = next(iter(rs.values()))

        def speed(m, rs=rs):
            r = rs.get(m)
            if r is None:
                return "-"
            return f"{r['vs_dense']:.2f}×" if r["status"] == "ok" and r.get("vs_dense") else r["status"]

        dense = rs.get("dense", {})
        row = [key[2], f"{first['tokens']:,}", f"{first['dedup']:.2f}", f"{first['pg_dedup']:.2f}"]
        row += [f"{dense['time_s']:.2f}" if dense.get("time_s") else dense.get("status", "-")]
        row += [speed(m) for m in methods[1:]]
        row += [
            " / ".join(
                f"{rs[m]['saved_mib']:.0f}" if rs.get(m, {}).get("saved_mib") else "-" for m in methods
            )
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot_speedup(results: list[dict], path: str, title: str) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 5))
    ok = [r for r in results if r["status"] == "ok" and r.get("vs_dense")]
    top = max([r["dedup"] for r in ok] + [r["vs_dense"] for r in ok] + [2.0]) * 1.1
    ax.plot([1, top], [1, top], "k--", lw=1, label="speedup = dedup ratio (linear in tokens)")
    ax.axhline(1.0, color="grey", lw=0.8)
    markers = {"dense_ckpt": "v", "pg": "s", "pg_lmhead": "D", "tree_mask": "^", "tree": "o"}
    for m in METHODS[1:]:
        pts = [r for r in ok if r["method"] == m]
        if pts:
            ax.scatter(
                [r["dedup"] for r in pts],
                [r["vs_dense"] for r in pts],
                marker=markers[m],
                s=55,
                label=LABELS[m],
                zorder=3,
            )
            if m == "tree":
                for r in pts:
                    ax.annotate(
                        r["shape"],
                        (r["dedup"], r["vs_dense"]),
                        textcoords="offset points",
                        xytext=(6, -4),
                        fontsize=8,
                    )
    ax.set(
        xlabel="dedup ratio of the step's trie (tokens / unique tokens)",
        ylabel="speedup over dense padded (same run)",
        title=title,
        xlim=(1, top),
        ylim=(0, top),
    )
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_memory(sweep: list[dict], path: str, title: str, device_kind: str) -> None:
    plt = common.pyplot()
    second = "peak_mib"
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    for ax, key, label in (
        (axes[0], "saved_mib", "autograd-saved activations, MiB (peak)"),
        (
            axes[1],
            second,
            ("CUDA max_memory_allocated" if device_kind == "cuda" else "peak RSS") + " increase, MiB",
        ),
    ):
        for m in METHODS:
            pts = [r for r in sweep if r["method"] == m and r.get(key) is not None and r["status"] == "ok"]
            if pts:
                ax.plot([r["leaves"] for r in pts], [r[key] for r in pts], marker="o", label=LABELS[m])
        ax.set(xlabel="leaves (completions in the group)", ylabel=label, xscale="log", yscale="log")
        ax.set_xticks(sorted({r["leaves"] for r in sweep}))
        ax.get_xaxis().set_major_formatter(plt.matplotlib.ticker.ScalarFormatter())
        ax.get_xaxis().set_minor_formatter(plt.matplotlib.ticker.NullFormatter())
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_breakdown(breakdown: dict, path: str) -> None:
    plt = common.pyplot()
    parts = breakdown["parts_s"]
    fig, ax = plt.subplots(figsize=(8, 2.8))
    left = 0.0
    for name, value in parts.items():
        value = max(value, 0.0)
        ax.barh([0], [value], left=left, label=f"{name.replace('_', ' ')}: {value:.3f} s")
        left += value
    n, dedup = breakdown.get("steps_averaged", breakdown["steps"]), breakdown.get("dedup_ratio") or 0
    ax.set(
        yticks=[],
        xlabel=f"seconds per optimizer step (mean of the last {n} steps; a generation every 2nd step)",
        title=f"One TreePPOTrainer step: {breakdown['step_s']:.2f} s (offline fixture, scripted generation, "
        f"dedup {dedup:.1f})",
    )
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def draw_plots(data: dict, folder: str, name: str) -> None:
    """The three plots from a result file's content (``--replot`` redraws them from the JSON alone)."""
    env = data["env"]
    where = (
        env.get("gpu")
        or f"{env['cpu_count']}-core {env['processor']}, load {env['load_avg_1min_before']:.1f}"
    )
    where += f", {env['dtype']}"
    if data["results"]:
        plot_speedup(
            data["results"], os.path.join(folder, f"{name}_speedup.png"), f"Speedup vs dedup ({where})"
        )
    if data["sweep"]:
        title = f"Peak memory vs leaves: one group ({where})"
        kind = torch.device(env["device"]).type
        plot_memory(data["sweep"], os.path.join(folder, f"{name}_memory.png"), title, kind)
    if data.get("breakdown"):
        plot_breakdown(data["breakdown"], os.path.join(folder, f"{name}_trainer_step.png"))


def write_results(folder: str, name: str, data: dict) -> None:
    """``<name>.json`` (everything: args, env, results, sweep, breakdown) and ``<name>.md`` (the pivot table,
    then every result, then the memory sweep)."""
    with open(os.path.join(folder, f"{name}.json"), "w") as f:
        json.dump(data, f, indent=2, default=str)
    results, sweep = data["results"], data["sweep"]
    with open(os.path.join(folder, f"{name}.md"), "w") as f:
        if results:
            f.write(pivot_markdown(results) + "\n\n")
        f.write(common.markdown_table(results, COLUMNS) + "\n\n")
        if sweep:
            f.write(common.markdown_table(sweep, SWEEP_COLUMNS) + "\n")
