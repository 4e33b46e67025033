"""Where one step's time goes on the device (``benchmarks/gpu.sh`` runs it after the decisive table): one walk
(TreeExecutor's defaults) and one dense + gradient checkpointing step (micro-batches of ``--micro_batch``
rows), each after a warm-up step, timed, then profiled.

    python benchmarks/gpu_profile.py --out OUT_DIR                # CUDA: Qwen3-0.6B, grpo-4k-g16 x1/4, bf16
    python benchmarks/gpu_profile.py --device cpu --model tiny --scale 0.03125 --threads 1 --out OUT_DIR

Per method:

* **host time per decoder-layer call**: one step with timers on the model's calls, no profiler: every
  decoder layer's forward (module hooks) and every ``torch.autograd.backward`` call (the backward calls
  through the model, the walk's and dense's; checkpointing's recompute runs inside them and is not counted
  twice). Host time per layer call = (their total host time) / (layer forwards + backward calls x layers),
  the forward and backward parts also apart. On CUDA the host only queues kernels (unless something
  synchronises), so this is what a call costs the host whatever its size; on a CPU it is the compute.
* **GPU busy vs idle**: one step under ``torch.profiler``; busy = the union of the device's kernel, copy and
  memset intervals within the step, idle = the step's wall time less busy.
* **GPU time by kind** (``classify``, the first rule that matches; the 12 longest kernels are in the JSON to
  check the rules against):
  1. ``LM head``: launched by an op that has an input with a dimension of the vocabulary's size (the head's
     matmuls forward and backward, the logits' casts, log-softmax, gather);
  2. ``attention``: a name with flash, fmha, attention, attn, sdpa or varlen;
  3. ``matmul``: gemm, matmul, cublas, cutlass, xmma, nvjet, wgmma, or the ops mm, addmm, bmm, linear;
  4. ``copies``: memcpy, memset, copy, cat, index, gather, scatter, fill, clone, pad, stack, where;
  5. ``elementwise``: elementwise, vectorized, reduce, norm, softmax, silu, mul, add, sub, div, exp, pow,
     rsqrt, mean, sum, neg, sigmoid, cos, sin;
  6. ``other``: the rest.
  On a CPU (the dry run) the same rules sort the aten ops' self CPU time, and "busy" is the time inside aten
  ops (the rest of the step: Python, the autograd engine, the walk's own code).

Outputs in ``--out``: ``gpu_profile.md`` and ``gpu_profile.json`` (written after each method).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's trl_dta
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # common.py, peer_bench/
import common  # noqa: E402
from peer_bench.context import Context  # noqa: E402
from peer_bench.methods import RUNNERS  # noqa: E402
from peer_bench.workloads import MODELS, make_model, shapes_for  # noqa: E402

KINDS = ("LM head", "attention", "matmul", "copies", "elementwise", "other")
RULES = (  # (kind, substrings of the lower-cased kernel or op name), after the LM head's shape rule
    ("attention", ("flash", "fmha", "attention", "attn", "sdpa", "varlen")),
    ("matmul", ("gemm", "matmul", "cublas", "cutlass", "xmma", "nvjet", "wgmma", "aten::mm", "aten::addmm",
                "aten::bmm", "aten::linear")),
    ("copies", ("memcpy", "memset", "copy", "cat", "index", "gather", "scatter", "fill", "clone", "pad",
                "stack", "where")),
    ("elementwise", ("elementwise", "vectorized", "reduce", "norm", "softmax", "silu", "mul", "add", "sub",
                     "div", "exp", "pow", "rsqrt", "mean", "sum", "neg", "sigmoid", "cos", "sin")),
)  # fmt: skip
METHODS = {"tree": "walk", "dense_ckpt": "dense + ckpt"}
STEP = "profiled step"


def classify(name: str, shapes, vocab: int) -> str:
    """The kind of a kernel (or, on a CPU, an op) by the module docstring's rules."""
    if any(vocab in s for s in shapes or () if isinstance(s, list | tuple)):
        return "LM head"
    low = name.lower()
    return next((kind for kind, words in RULES if any(w in low for w in words)), "other")


@contextlib.contextmanager
def host_timers(model):
    """Host seconds and counts of the decoder layers' forwards (outside backward calls) and of the outermost
    ``torch.autograd.backward`` calls, while the block runs."""
    layers = model.get_decoder().layers
    t = {"layer_forwards": 0, "forward_s": 0.0, "backward_calls": 0, "backward_s": 0.0, "depth": 0}
    starts = []

    def pre(module, args):
        starts.append(time.perf_counter())

    def post(module, args, output):
        elapsed = time.perf_counter() - starts.pop()
        if t["depth"] == 0:  # (a recompute inside a backward call is that call's time)
            t["layer_forwards"] += 1
            t["forward_s"] += elapsed

    backward = torch.autograd.backward

    def timed_backward(*args, **kwargs):
        t["depth"] += 1
        start = time.perf_counter()
        try:
            return backward(*args, **kwargs)
        finally:
            t["depth"] -= 1
            if t["depth"] == 0:
                t["backward_calls"] += 1
                t["backward_s"] += time.perf_counter() - start

    hooks = [
        h
        for layer in layers
        for h in (layer.register_forward_pre_hook(pre), layer.register_forward_hook(post))
    ]
    torch.autograd.backward = timed_backward  # (Tensor.backward calls it through the module too)
    try:
        yield t
    finally:
        torch.autograd.backward = backward
        for h in hooks:
            h.remove()
        t["layers"] = len(layers)


def host_summary(t: dict) -> dict:
    layers = t["layers"]
    calls = t["layer_forwards"] + t["backward_calls"] * layers
    return {
        "layer_forwards": t["layer_forwards"], "backward_calls": t["backward_calls"], "layers": layers,
        "forward_host_s": t["forward_s"], "backward_host_s": t["backward_s"],
        "ms_per_layer_call": 1e3 * (t["forward_s"] + t["backward_s"]) / max(calls, 1),
        "forward_ms_per_layer_call": 1e3 * t["forward_s"] / max(t["layer_forwards"], 1),
        "backward_ms_per_layer_call": 1e3 * t["backward_s"] / max(t["backward_calls"] * layers, 1),
    }  # fmt: skip


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -float("inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def device_summary(events, vocab: int, on_cuda: bool) -> dict:
    """Busy and idle time of the profiled step, and the time by kind (seconds), from the profiler's events."""
    step = next(e for e in events if e.name == STEP and e.device_type == DeviceType.CPU)
    lo, hi = step.time_range.start, step.time_range.end
    by_kind, kernels = dict.fromkeys(KINDS, 0.0), {}
    if on_cuda:
        # the ops that launch kernels: the CPU events linked to no other (a kernel's linked id is its op's)
        ops = {e.id: e for e in events if e.device_type == DeviceType.CPU and not _linked(e)}
        work = [e for e in events if e.device_type == DeviceType.CUDA]
        linked = 0
        spans = [(max(e.time_range.start, lo), min(e.time_range.end, hi)) for e in work]
        busy = _union([s for s in spans if s[1] > s[0]]) / 1e6
        for e in work:
            op = ops.get(_linked(e))
            linked += op is not None
            kind = classify(e.name, op.input_shapes if op is not None else (), vocab)
            seconds = (e.time_range.end - e.time_range.start) / 1e6
            _add(by_kind, kernels, kind, e.name, seconds)
    else:
        work = [e for e in events if e.device_type == DeviceType.CPU and e.name.startswith("aten::")]
        for e in work:
            _add(
                by_kind, kernels, classify(e.name, e.input_shapes, vocab), e.name, e.self_cpu_time_total / 1e6
            )
        busy, linked = sum(by_kind.values()), len(work)
    wall = (hi - lo) / 1e6
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:12]
    return {
        "profiled_step_s": wall, "busy_s": busy, "idle_s": max(wall - busy, 0.0), "busy_share": busy / wall,
        "by_kind_s": by_kind, "events": len(work), "linked_to_an_op": linked / max(len(work), 1),
        "top": [{"name": n[:120], "kind": k, "s": s, "count": c} for n, (k, s, c) in top],
    }  # fmt: skip


def _linked(event) -> int:
    return getattr(event, "linked_correlation_id", 0)


def _add(by_kind: dict, kernels: dict, kind: str, name: str, seconds: float) -> None:
    by_kind[kind] += seconds
    _, s, c = kernels.get(name, (kind, 0.0, 0))
    kernels[name] = (kind, s + seconds, c + 1)


def profile_method(ctx: Context, wl, method: str, device: torch.device, vocab: int) -> dict:
    model, runner = ctx.model, RUNNERS[method]

    def step():
        model.zero_grad(set_to_none=True)
        runner(ctx, wl)

    first = common.timed(step, device)  # warm-up: kernels chosen, the walk's probe, caches
    calls_before = (ctx.executor.calls.forward, ctx.executor.calls.backward) if method == "tree" else None
    with host_timers(model) as t:
        seconds = common.timed(step, device)
    out = {
        "method": method,
        "label": METHODS[method],
        "first_s": first,
        "step_s": seconds,
        "host": host_summary(t),
    }
    if calls_before is not None:
        ex = ctx.executor
        out["model_calls"] = {"forward": ex.calls.forward - calls_before[0],
                              "backward": ex.calls.backward - calls_before[1]}  # fmt: skip
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as prof:
        with record_function(STEP):
            step()
            common.synchronize(device)
    try:
        out.update(device_summary(prof.events(), vocab, device.type == "cuda"))
    except Exception as exc:  # noqa: BLE001 - the host timings above still stand
        out["profile_error"] = f"{type(exc).__name__}: {exc}"
    return out


COLUMNS = ["method", "step s", "busy", "idle", *KINDS, "host ms / layer call (fwd, bwd)", "calls (fwd + bwd)"]


def markdown(results: list[dict], on_cuda: bool) -> str:
    unit = "GPU" if on_cuda else "CPU (aten ops)"
    lines = [f"| {' | '.join(COLUMNS)} |", "|" + "---|" * len(COLUMNS)]
    for r in results:
        if "profile_error" in r:
            r = {**r, "by_kind_s": dict.fromkeys(KINDS, 0.0), "busy_s": 0.0, "busy_share": 0.0, "idle_s": 0.0}
        h, kinds = r["host"], r["by_kind_s"]
        share = {k: f"{v:.3f} s ({v / max(r['busy_s'], 1e-12):.0%})" for k, v in kinds.items()}
        calls = f"{h['layer_forwards'] // h['layers']} + {h['backward_calls']}"
        host = f"{h['forward_ms_per_layer_call']:.3f}, {h['backward_ms_per_layer_call']:.3f}"
        busy = f"{r['busy_s']:.3f} s ({r['busy_share']:.0%})"
        cells = [r["label"], f"{r['step_s']:.3f}", busy, f"{r['idle_s']:.3f} s", *(share[k] for k in KINDS),
                 f"{h['ms_per_layer_call']:.3f} ({host})", calls]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return (
        "\n".join(lines) + f"\n\nbusy, idle and kinds: {unit} time within the profiled step (its wall time)."
    )


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b", choices=list(MODELS))
    ap.add_argument("--shape", default="grpo-4k-g16")
    ap.add_argument("--scale", type=float, default=0.25, help="multiply every sequence length")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--micro_batch", type=int, default=2, help="rows per dense + checkpointing micro-batch")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    device, p = torch.device(args.device), MODELS[args.model]
    wl = next(w for w in shapes_for("gpu", p["vocab_size"], args.scale) if w.name == args.shape)
    model = make_model(args.model, device, getattr(torch, args.dtype), args.attn)
    ctx = Context(model, device, args.attn, block_size=None, micro_batch=args.micro_batch)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else common.processor_name()
    s = wl.stats()
    head = (f"# Profile: {args.model} {args.shape} x{args.scale:g} ({s['tokens']:,} tokens, dedup "
            f"{s['dedup']:.2f}), {args.dtype}, {args.attn}, {where}, torch {torch.__version__}")  # fmt: skip
    results = []
    for method in args.methods.split(","):
        results.append(profile_method(ctx, wl, method, device, p["vocab_size"]))
        table = markdown(results, device.type == "cuda")
        with open(os.path.join(args.out, "gpu_profile.md"), "w") as f:
            f.write(f"{head}\n\n{table}\n")
        with open(os.path.join(args.out, "gpu_profile.json"), "w") as f:
            json.dump({"args": vars(args), "where": where, "stats": s, "results": results}, f, indent=1)
    print(f"{head}\n\n{table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
