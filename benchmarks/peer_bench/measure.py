"""How the peer benchmark measures one workload: every method once, metered (autograd-saved activations,
peak memory) and its gradients compared with the first method's; then ``repeats`` rounds of all methods in
alternation, timed. An OOM or a failing method is a result, not a crash."""

from __future__ import annotations

import gc
import math
import statistics

import common
import torch

from trl_dta.compare import relative_error
from trl_dta.testing.memory import SavedTensorMeter

from .context import Context
from .methods import RUNNERS
from .workloads import Workload

# Gradient tolerance (relative_error against the first method). bf16: two exact methods already differ by
# ~1e-2 (measured, tiny model); a wrong mask or position is O(1). The strict check of the GPU kernels is
# --parity, in fp32.
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-10, torch.bfloat16: 1e-1, torch.float16: 1e-1}


def grads_of(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def grad_error(got: dict, ref: dict) -> float:
    """``relative_error`` of two gradient dicts; infinite if different parameters got gradients."""
    return relative_error(got, ref) if got.keys() == ref.keys() else math.inf


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def _release(model, device) -> None:
    model.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _failed(res: dict, exc: BaseException) -> None:
    res["status"] = "OOM" if _is_oom(exc) else "error"
    res["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"


def measure(
    ctx: Context, wl: Workload, methods: list[str], repeats: int, tolerance: float, log, runners=RUNNERS
) -> list[dict]:
    """One metered run per method (gradients compared with the first method that ran), then ``repeats``
    alternating timed rounds. Returns one result dict per method. ``runners``: method name -> run(ctx, wl)."""
    stats = wl.stats()
    res = {m: dict(stats, method=m, status="ok") for m in methods}
    _metered_runs(ctx, wl, methods, tolerance, log, runners, res)
    _timed_rounds(ctx, wl, methods, repeats, runners, res)
    return [res[m] for m in methods]


def _metered_runs(ctx: Context, wl: Workload, methods, tolerance: float, log, runners, res: dict) -> None:
    model, device = ctx.model, ctx.device
    ref, ref_name = None, None
    for m in methods:
        model.zero_grad(set_to_none=True)
        try:
            with common.PeakMemory(device) as peak, SavedTensorMeter(model) as saved:
                seconds = common.timed(lambda m=m: runners[m](ctx, wl), device)
        except Exception as exc:  # noqa: BLE001 - an OOM or a failing peer is a result, not a crash
            _failed(res[m], exc)
        if res[m]["status"] != "ok":  # outside the except block: its traceback no longer pins the tensors
            _release(model, device)
            log(f"  {m:10s} {res[m]['status']}: {res[m]['error'][:160]}")
            continue
        res[m].update(
            first_s=seconds,
            saved_mib=saved.peak / 2**20,
            peak_mib=None if peak.peak is None else peak.peak / 2**20,
        )
        got = grads_of(model)
        if ref is None:
            ref, ref_name = got, m
            res[m]["grad_err"] = 0.0
        else:
            res[m]["grad_err"] = grad_error(got, ref)
            if not res[m]["grad_err"] <= tolerance:
                res[m]["status"] = "grad mismatch"
        res[m]["grad_ref"] = ref_name
        log(
            f"  {m:10s} first run {seconds:7.2f} s, saved {res[m]['saved_mib']:8.0f} MiB, "
            f"grad err vs {ref_name} {res[m]['grad_err']:.1e}"
            + ("" if res[m]["status"] == "ok" else "  MISMATCH")
        )


def _timed_rounds(ctx: Context, wl: Workload, methods, repeats: int, runners, res: dict) -> None:
    """``repeats`` rounds of the methods that passed the metered run; times are medians, and ``vs_dense`` /
    ``vs_dense_ckpt`` the speedups over those two."""
    model, device = ctx.model, ctx.device
    timed_methods = [m for m in methods if res[m]["status"] == "ok"]
    runs = {m: [] for m in timed_methods}
    for _ in range(repeats):
        for m in timed_methods:
            if res[m]["status"] != "ok":
                continue
            model.zero_grad(set_to_none=True)
            try:
                runs[m].append(common.timed(lambda m=m: runners[m](ctx, wl), device))
            except Exception as exc:  # noqa: BLE001 - e.g. an OOM from fragmentation in a later round
                _failed(res[m], exc)
            if res[m]["status"] != "ok":
                _release(model, device)
    timed_methods = [m for m in timed_methods if res[m]["status"] == "ok"]
    model.zero_grad(set_to_none=True)
    for m in timed_methods:
        res[m]["runs_s"] = runs[m]
        res[m]["time_s"] = statistics.median(runs[m]) if runs[m] else res[m]["first_s"]
    for base in ("dense", "dense_ckpt"):
        b = res.get(base, {}).get("time_s")
        for m in timed_methods:
            res[m][f"vs_{base}"] = b / res[m]["time_s"] if b else None
