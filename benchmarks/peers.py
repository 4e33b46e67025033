"""Benchmark: the prefix-trie walk against the peers, same model, same loss, same gradients.

    python benchmarks/peers.py                 # CPU, full: tables, JSON, plots under docs/ (~25 min, 2 cores)
    python benchmarks/peers.py --quick         # CI-sized smoke run (tiny model and shapes, ~1 min)
    python benchmarks/peers.py --profile gpu   # the GPU shapes, one process (bf16; an OOM starves the rest)
    python benchmarks/peers.py --profile gpu --plan --micro_batch 2   # shapes; each method's peak vs the card
    python benchmarks/peers.py --parity        # fp32 gradient parity of every method on the device, no timing

benchmarks/gpu.sh runs ``--plan`` and ``--parity``; its timed table is benchmarks/gpu_table.py, a process per
(configuration, method), so that an out-of-memory error stays one row.
    python benchmarks/peers.py --replot docs/peers.json --plots docs   # redraw the plots of a result file

Methods (each accumulates into ``.grad`` the gradient of the same loss: on-policy GRPO surrogate per
rollout, ``-advantage x mean log-prob of its completion tokens / rows``, log-softmax in fp32):

* ``dense``       TRL-style padded batch: one GRPO group per micro-batch (per_device_train_batch_size =
                  num_generations), or ``--micro_batch`` rows, prompts left-padded + right-padded
                  completions, ``logits_to_keep`` = completion width + 1 (LM head on completion positions
                  only), as in TRL's ``GRPOTrainer._get_per_token_logps_and_entropies``.
* ``dense_ckpt``  the same with gradient checkpointing (non-reentrant), TRL's default.
* ``pg``          PrefixGrouper (PyPI ``prefix-grouper``), integrated as its README describes: one packed row
                  per group (prompt, c1..cG) from ``PrefixGrouper.from_ungrouped_masks`` + ``concat_input``,
                  position ids restarting at the prompt length for every completion, the model run with its
                  registered ``prefix_grouper_attention`` and ``split_output(logits, include_prefix_last=1)``.
                  Its attention kernel must apply bottom-right-aligned causal masking over (prompt K/V
                  repeated + own completion K/V); flash-attn does, transformers' sdpa function does not (with
                  a mask it drops the causal flag and errors for G > 1), so where flash-attn is absent the
                  kernel is ``bottom_right_sdpa`` (in peer_bench/prefix_grouping.py): the same masking,
                  written with torch sdpa. Logits are computed for every position of the packed row (prompt
                  included), as PrefixGrouper does.
* ``pg_lmhead``   PrefixGrouper with the LM head on completion positions only: ``split_output`` on the hidden
                  states, then the head (what verl later did).
* ``tree_mask``   packed tree attention (AReaL's and TRL AsyncGRPO's idea, written here from the idea): all
                  unique tokens of the step's trie in one row, in DFS order, RoPE position = depth, and a 4-D
                  boolean mask (token i sees token j iff j is an ancestor-or-self of i) through sdpa; one
                  forward and one backward; LM head on the positions that score completion tokens only.
* ``trl_packing`` (only where TRL imports; not in the default list) TRL 1.16's own per-segment packing:
                  ``trl.experimental.async_grpo``'s ``TreeRow`` layout, attended per segment through sdpa
                  (peer_bench/trl_packing.py).
* ``tree``        ``TreeExecutor(model, block_size=...).backward(PrefixTrie.from_sequences(rows), loss,
                  score_from=prompt lengths - 1)`` (LM head on completion positions only, as the trainer)
                  on the step's trie (every group), LM head on every unique token (it has no completion-only
                  option).

Dense and PrefixGrouper work one group at a time (accumulating); the two tree methods take the whole step,
so on multi-group shapes they also share what groups share (the system prompt). ``dedup`` = tokens / unique
tokens of the step's trie is the speedup to expect if cost were linear in tokens; ``pg dedup`` = tokens /
tokens PrefixGrouper forwards is its own ideal.

Protocol: every method first runs once, metered (autograd-saved activations via ``SavedTensorMeter``; peak
RSS increase on CPU, ``torch.cuda.max_memory_allocated`` increase on CUDA), and its gradients are compared
with dense's (``max over tensors of max|g - g_dense| / max|g_dense|``); a method whose gradients differ
(> 1e-4 in fp32, > 1e-1 in bf16) is reported as a mismatch, not timed, and the script exits non-zero. Then
``--repeats`` rounds of all methods in alternation; times are medians. A method that runs out of memory is
reported as OOM. Extra parts: peak memory against the number of leaves (one group, growing G), and the time
breakdown of TreePPOTrainer steps (trl_dta/testing/grpo.py's offline fixture; needs TRL; CPU profiles only).
``--methods ...,tree_mask_fullhead`` adds a diagnostic: the tree mask with the LM head on every unique
token, as the walk computes it.

Code: this file is the command line and the run loop; the pieces are in ``benchmarks/peer_bench/``:
``workloads.py`` (models and shapes), ``context.py`` (what the methods share: model, loss), ``methods.py``
(dense, the walk, the registry), ``prefix_grouping.py``, ``tree_mask.py``, ``trl_packing.py``, ``measure.py``
(metered run, gradient check, timed rounds), ``memory_plan.py`` (``--plan``'s peak memory per method),
``trainer_step.py`` (the breakdown), ``report.py`` (tables, files, plots). The GPU suite's decisive table runs
each (configuration, method) in its own process instead: ``benchmarks/gpu_table.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's trl_dta
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # common.py, peer_bench/
import common  # noqa: E402
from peer_bench import memory_plan  # noqa: E402
from peer_bench.context import Context  # noqa: E402
from peer_bench.measure import TOLERANCE, measure  # noqa: E402
from peer_bench.methods import METHODS, RUNNERS, run_tree  # noqa: E402
from peer_bench.report import COLUMNS, SWEEP_COLUMNS, draw_plots, write_results  # noqa: E402
from peer_bench.trainer_step import trainer_breakdown  # noqa: E402
from peer_bench.workloads import MODELS, approx_params, leaves_sweep, make_model, shapes_for  # noqa: E402

from trl_dta import TreeExecutor  # noqa: E402

PROFILES = {  # defaults per profile; flags override
    "quick": {
        "models": "tiny",
        "attn": "sdpa",
        "dtype": "float32",
        "device": "cpu",
        "repeats": 1,
        "block_size": 256,
        "breakdown_steps": 4,
    },
    "cpu": {
        "models": "cpu",
        "attn": "sdpa",
        "dtype": "float32",
        "device": "cpu",
        "repeats": 3,
        "block_size": 2048,
        "breakdown_steps": 8,
    },
    "gpu": {
        "models": "qwen3-0.6b,qwen3-1.7b",
        "attn": "sdpa,flash_attention_2",
        "dtype": "bfloat16",
        "device": "cuda",
        "repeats": 2,
        "block_size": 2048,
        "breakdown_steps": 0,
    },
}


def plan(args) -> list[tuple[str, str]]:
    """(model, attention) configurations to run; flash-attn only where it imports."""
    attns = args.attn.split(",")
    if "flash_attention_2" in attns:
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            attns = [a for a in attns if a != "flash_attention_2"]
            print("flash-attn not installed: skipping attn=flash_attention_2")
    return [(m, a) for m in args.models.split(",") for a in attns]


PLAN_COLUMNS = [  # (header, key, format)
    ("shape", "shape", "{}"), ("rows", "rows", "{}"), ("tokens", "tokens", "{:,}"),
    ("unique", "unique", "{:,}"), ("dedup", "dedup", "{:.2f}x"), ("pg dedup", "pg_dedup", "{:.2f}x"),
    ("longest", "longest", "{:,}"), ("tree mask MiB", "mask_mib", "{:.0f}"), ("positions", "positions", "{}"),
]  # fmt: skip
MEMORY_COLUMNS = [  # (header, key, format)
    ("shape", "shape", "{}"), ("method", "method", "{}"), ("held tokens", "held_tokens", "{:,}"),
    ("activations GB", "activations_gb", "{:.1f}"), ("logits GB", "logits_gb", "{:.1f}"),
    ("extra GB", "extra_gb", "{:.1f}"), ("predicted GB", "predicted_gb", "{:.1f}"),
    ("card GB", "card_gb", "{:.0f}"), ("fits", "fits", "{}"),
]  # fmt: skip


def card_bytes(args) -> float:
    """The memory the plan's estimates are held against: --card_gb, else the CUDA device's, else an H200's."""
    if args.card_gb:
        return args.card_gb * 1e9
    if args.device.startswith("cuda") and torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(0).total_memory)
    return 150.1e9  # an H200 as torch reports it (139.8 GiB; sold as 141 GB)


def memory_rows(
    name: str, wl, methods: list[str], dtype: torch.dtype, micro_batch, card: float
) -> list[dict]:
    """The estimate of every method on one shape (benchmarks/peer_bench/memory_plan.py), against ``card``."""
    rows = []
    for m in methods:
        if m not in memory_plan.METHODS:
            continue
        e = memory_plan.estimate(m, wl, MODELS[name], dtype.itemsize, approx_params(name), micro_batch)
        fits = (
            "yes"
            if e.total <= memory_plan.USABLE * card
            else "yes (auto budgets)"
            if e.fits(card)
            else "NO: OOM"
        )
        if e.floor is not None and e.floor < e.total:
            fits += f", floor {e.floor / 1e9:.1f}"
        rows.append({
            "shape": wl.name, "method": m, "held_tokens": e.held_tokens,
            "activations_gb": e.activations / 1e9, "logits_gb": e.logits / 1e9, "extra_gb": e.extra / 1e9,
            "predicted_gb": e.total / 1e9, "card_gb": card / 1e9, "fits": fits,
        })  # fmt: skip
    return rows


def show_plan(args) -> int:
    """Print what a run would do (configurations, shapes and their sizes), check the shapes fit the models'
    position range, and estimate every method's peak memory against the card's (memory_plan.py); no model is
    built. Returns 1 if a shape does not fit the position range (a predicted OOM is a prediction, not an
    error: the run reports it as a row)."""
    configs = plan(args)
    dtype = getattr(torch, args.dtype)
    card = card_bytes(args)
    print(
        f"profile {args.profile}: {args.dtype} on {args.device}, repeats {args.repeats}, "
        f"block_size {args.block_size}, dense micro-batch {args.micro_batch or 'one group'} rows"
    )
    print("configurations: " + ", ".join(f"{m}/{a}" for m, a in configs))
    bad = 0
    for name in dict.fromkeys(m for m, _ in configs):
        print(f"model {name}: ~{approx_params(name) / 1e6:.0f}M parameters")
        rows, memory = [], []
        shapes = shapes_for(args.profile, MODELS[name]["vocab_size"], args.scale)
        if not args.no_sweep:
            shapes += leaves_sweep(args.profile, MODELS[name]["vocab_size"], args.scale)
        for wl in shapes:
            s = wl.stats()
            s["mask_mib"] = s["unique"] ** 2 / 2**20  # the packed tree mask, bool
            s["positions"] = "ok" if s["longest"] <= 40_960 else "NO"
            bad += s["positions"] != "ok"
            rows.append(s)
            memory += memory_rows(name, wl, args.methods.split(","), dtype, args.micro_batch or None, card)
        print(common.format_table(rows, PLAN_COLUMNS))
        print(
            f"peak memory per method (memory_plan.py: weights, gradients and AdamW states + activations + "
            f"logits; fits: within {memory_plan.USABLE:.0%} of the card)"
        )
        print(common.format_table(memory, MEMORY_COLUMNS))
    return 1 if bad else 0


def parity(args, log) -> int:
    """fp32 gradients of every method (and of the executor's chunked and unpacked paths) against dense on the
    device, on the quick shapes and the tiny model; no timing. flash-attn has no fp32 kernels: with it, bf16
    and bf16's tolerance. Returns the number of failures."""
    failures = 0
    rows = []
    for _, attn in plan(args):
        dtype = torch.bfloat16 if attn.startswith("flash") else torch.float32
        model = make_model("tiny", args.device, dtype, attn)
        ctx = Context(model, args.device, attn, block_size=256)
        extra = {
            "tree_chunked": TreeExecutor(model, block_size=40),  # chunked backward: blocks recomputed at pop
            "tree_unpacked": TreeExecutor(model, block_size=256, pack_leaves=False),  # padded sibling leaves
        }
        runners = RUNNERS | {name: lambda c, w, ex=ex: run_tree(c, w, ex) for name, ex in extra.items()}
        methods = [m for m in METHODS if not (attn == "flash_attention_2" and m == "tree_mask")] + list(extra)
        for wl in shapes_for("quick", MODELS["tiny"]["vocab_size"]):
            log(f"[parity {attn}] {wl.name}")
            for r in measure(ctx, wl, methods, 0, TOLERANCE[dtype], log, runners):
                r.update(model="tiny", attn=attn, dtype=str(dtype))
                rows.append(r)
                failures += r["status"] != "ok"
        del ctx, model
    print(
        common.format_table(rows, [c for c in COLUMNS if c[1] not in ("time_s", "vs_dense", "vs_dense_ckpt")])
    )
    with open(os.path.join(args.out, "parity.json"), "w") as f:
        json.dump(rows, f, indent=2, default=str)
    tolerances = f"fp32 {TOLERANCE[torch.float32]:g}, bf16 {TOLERANCE[torch.bfloat16]:g}"
    print(f"parity: {len(rows) - failures}/{len(rows)} ok (relative tolerance: {tolerances})")
    return failures


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, then the profile's defaults for those not given."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", choices=list(PROFILES), default="cpu")
    ap.add_argument("--quick", action="store_true", help="= --profile quick (CI smoke run)")
    ap.add_argument("--parity", action="store_true", help="fp32 gradient parity of every method only")
    ap.add_argument("--models", help=f"comma-separated, of {list(MODELS)}")
    ap.add_argument("--attn", help="comma-separated attention implementations (sdpa, flash_attention_2)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float64"])
    ap.add_argument("--device")
    ap.add_argument("--shapes", help="comma-separated shape names of the profile (default: all)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--repeats", type=int, help="timed rounds after the metered run")
    ap.add_argument("--block_size", type=int, help="TreeExecutor block_size")
    ap.add_argument(
        "--micro_batch", type=int, default=0,
        help="rows per dense / dense_ckpt forward-backward (TRL's per_device_train_batch_size); 0: one group",
    )  # fmt: skip
    ap.add_argument(
        "--card_gb", type=float, help="--plan: the card's memory (default: the device's, else an H200)"
    )
    ap.add_argument("--no_sweep", action="store_true", help="skip peak memory vs number of leaves")
    ap.add_argument(
        "--sweep_leaves", help="comma-separated group sizes of the memory sweep (default: profile's)"
    )
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every sequence length (dry runs)")
    ap.add_argument("--plan", action="store_true", help="print the configurations and shapes, run nothing")
    ap.add_argument(
        "--replot", metavar="JSON", help="redraw the plots of a result file into --plots, run nothing"
    )
    ap.add_argument("--breakdown_steps", type=int, help="TreePPOTrainer steps for the breakdown (0: skip)")
    ap.add_argument(
        "--time_budget", type=float, default=0, help="seconds; stop starting new configs after it"
    )
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "out"), help="JSON and tables")
    ap.add_argument("--plots", help="plot folder (default: docs/ for --profile cpu, else --out)")
    args = ap.parse_args(argv)
    if args.quick:
        args.profile = "quick"
    for k, v in PROFILES[args.profile].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.plots = args.plots or (os.path.join(ROOT, "docs") if args.profile == "cpu" else args.out)
    return args


@dataclass
class Run:
    """What one benchmark run has measured so far, and where it writes it."""

    args: argparse.Namespace
    name: str  # of the result files: peers.json / .md / _*.png for the cpu profile, else peers_<profile>
    load_before: float
    wall: float = field(default_factory=time.perf_counter)
    results: list[dict] = field(default_factory=list)
    sweep: list[dict] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    breakdown: dict | None = None

    def elapsed(self) -> float:
        return time.perf_counter() - self.wall

    def out_of_time(self, what: str) -> bool:
        """Whether --time_budget is spent; if so ``what`` is recorded as skipped."""
        if self.args.time_budget and self.elapsed() > self.args.time_budget:
            self.skipped.append(what)
            return True
        return False

    def save(self, final: bool = False) -> None:
        """JSON and markdown tables after every shape (a run killed by a timeout keeps what it measured);
        the plots at the end."""
        a = self.args
        env = common.environment(
            self.load_before, self.elapsed(), profile=a.profile, dtype=a.dtype, device=a.device,
            repeats=a.repeats, skipped=self.skipped, complete=final,
        )  # fmt: skip
        data = {
            "args": vars(a),
            "env": env,
            "results": self.results,
            "sweep": self.sweep,
            "breakdown": self.breakdown,
        }
        write_results(a.out, self.name, data)
        if final:
            draw_plots(data, a.plots, self.name)


def run_shapes(run: Run, ctx: Context, model_name: str, methods: list[str], tolerance: float, log) -> None:
    """The profile's shapes (or --shapes) on one (model, attention) configuration, timed."""
    args = run.args
    wanted = set(args.shapes.split(",")) if args.shapes else None
    for wl in shapes_for(args.profile, MODELS[model_name]["vocab_size"], args.scale):
        if wanted and wl.name not in wanted:
            continue
        if run.out_of_time(f"{model_name}/{ctx.attn}/{wl.name}"):
            continue
        s = wl.stats()
        log(
            f"[{wl.name}] rows {s['rows']}, tokens {s['tokens']:,}, unique {s['unique']:,}, "
            f"dedup {s['dedup']:.2f}, "
            f"pg dedup {s['pg_dedup']:.2f}, load {common.load_average():.2f}"
        )
        for r in measure(ctx, wl, methods, args.repeats, tolerance, log):
            run.results.append(dict(r, model=model_name, attn=ctx.attn, load=common.load_average()))
        run.save()


def run_sweep(run: Run, ctx: Context, model_name: str, methods: list[str], tolerance: float, log) -> None:
    """Peak memory against the number of leaves (one group, growing), metered only."""
    args = run.args
    sizes = [int(n) for n in args.sweep_leaves.split(",")] if args.sweep_leaves else None
    for wl in leaves_sweep(args.profile, MODELS[model_name]["vocab_size"], args.scale, sizes):
        if run.out_of_time(f"sweep/{wl.name}"):
            continue
        log(f"[sweep {wl.name}]")
        for r in measure(ctx, wl, methods, 0, tolerance, log):
            run.sweep.append(dict(r, model=model_name, attn=ctx.attn))
        run.save()


def benchmark(args, log) -> int:
    """Every configuration of the plan: its shapes, the memory sweep on the first one, then the trainer
    breakdown; result files after every shape. Returns 1 on a gradient mismatch or an error."""
    dtype = getattr(torch, args.dtype)
    tolerance = TOLERANCE[dtype]
    methods = args.methods.split(",")
    load_before = common.warn_if_busy(args.threads)
    run = Run(args, "peers" if args.profile == "cpu" else f"peers_{args.profile}", load_before)
    configs = plan(args)
    for model_name, attn in configs:
        if run.out_of_time(f"{model_name}/{attn}"):
            continue
        log(f"== model {model_name}, attn {attn}, {args.dtype}, {args.device}")
        model = make_model(model_name, args.device, dtype, attn)
        ctx = Context(model, args.device, attn, args.block_size, args.micro_batch or None)
        ms = [m for m in methods if not (m == "tree_mask" and attn not in ("sdpa", "eager"))]
        run_shapes(run, ctx, model_name, ms, tolerance, log)
        if not args.no_sweep and (model_name, attn) == configs[0]:
            run_sweep(run, ctx, model_name, ms, tolerance, log)
        del ctx, model
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    if args.breakdown_steps:
        log(f"[trainer breakdown] {args.breakdown_steps} TreePPOTrainer steps")
        run.breakdown = trainer_breakdown(args.breakdown_steps, args.profile == "quick")
        log("  " + ", ".join(f"{k} {v:.3f} s" for k, v in run.breakdown["parts_s"].items()))
    run.save(final=True)
    return report(run)


def report(run: Run) -> int:
    """The tables and a summary on stdout; 1 on a gradient mismatch or an error."""
    args, results, sweep = run.args, run.results, run.sweep
    print("\n" + common.format_table(results, COLUMNS))
    if sweep:
        print("\n" + common.format_table(sweep, SWEEP_COLUMNS))
    print(
        f"\nmedian of {args.repeats} alternating run(s); {torch.get_num_threads()} threads; load before "
        f"{run.load_before:.2f}, after {common.load_average():.2f}; wall {run.elapsed():.0f} s"
        + (f"; skipped (time budget): {run.skipped}" if run.skipped else "")
    )
    print(f"wrote {args.out}/{run.name}.json, {run.name}.md and plots under {args.plots}")
    bad = [r for r in results + sweep if r["status"] == "grad mismatch"]
    if bad:
        print(f"GRADIENT MISMATCH: {[(r['shape'], r['method'], r['grad_err']) for r in bad]}")
        return 1
    errors = [r for r in results + sweep if r["status"] == "error"]
    if errors:
        print(f"ERRORS: {[(r['shape'], r['method'], r['error']) for r in errors]}")
        return 1
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.plots, exist_ok=True)
    sys.stdout.reconfigure(line_buffering=True)
    torch.set_num_threads(args.threads)
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity means fp32
        torch.backends.cudnn.allow_tf32 = False

    def log(msg):
        print(msg, flush=True)

    if args.replot:
        with open(args.replot) as f:
            draw_plots(json.load(f), args.plots, os.path.basename(args.replot).removesuffix(".json"))
        return 0
    if args.plan:
        return show_plan(args)
    if args.parity:
        return 1 if parity(args, log) else 0
    return benchmark(args, log)


if __name__ == "__main__":
    sys.exit(main())
