"""TreePPOTrainer under accelerate's own multi-process preparation, on CPU: DeepSpeed ZeRO-2 and ZeRO-3, FSDP2
gather-once and per-layer, on 2 processes against stock GRPOTrainer on 1 process with the same global batch.

The worker (tests/accelerate_worker.py) creates a gloo process state before the trainer, a test device that
lets accelerate prepare DeepSpeed and FSDP2 without GPUs (its docstring says how); the preparation, TRL's
reference model, saving and checkpointing are then accelerate's, TRL's and DeepSpeed's own. Each run: SGD, 2
optimizer steps, gradient accumulation 2, clipping on (max_grad_norm 1.0, which the second step's norm
exceeds), ranks walking different tries (re-partitioned rollouts). Checked per variant:

* the parameter updates of the 2 steps and the logged gradient norms against stock TRL (relative 1e-4);
  variants: plain, KL to a reference model (beta 0.1, the reference model prepared by TRL too), LoRA;
* ``save_model()`` writes the trained weights (FSDP2 full state dict, ZeRO-3 16-bit gather);
* resuming from the step-1 checkpoint (SGD with momentum: the optimizer state must be restored) gives the
  uninterrupted run's parameters;
* the collectives: under DeepSpeed no walk reduces anything, one flush per optimizer step reduces (one
  collective: the tiny model fits one bucket), a ZeRO-3 walk gathers each parameter once and ZeRO-2 walks
  gather nothing; under FSDP2 accelerate's real units (embeddings, layers, norm, LM head) are in place.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from trl_dta.compare import relative_error
from trl_dta.testing.torchrun import run_workers

WORKER = Path(__file__).with_name("accelerate_worker.py")
TOL = 1e-4
VARIANTS = ["plain", "kl", "lora", "save", "resume"]
REDUCTIONS = (
    "deepspeed.all_reduce",
    "deepspeed.reduce",
    "deepspeed.reduce_scatter_tensor",
    "deepspeed.reduce_scatter",
    "deepspeed.all_reduce_coalesced",
    "reduce_scatter_single",
)


def launch(out: Path, model_dir: str, mode: str, variants: list[str]) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, str(WORKER)]
    if mode != "stock":
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(WORKER),
        ]
    result = run_workers(cmd + [str(out), model_dir, mode, *variants], env=env, timeout=900, cwd=out)
    assert result.returncode == 0, result.stderr[-4000:]
    return {v: torch.load(out / f"{mode}-{v}.pt", weights_only=False) for v in variants}


@pytest.fixture(scope="module")
def stock(tmp_path_factory, model_dir):
    out = tmp_path_factory.mktemp("stock")
    return launch(out, model_dir, "stock", ["plain", "kl", "lora", "resume"])


def updates(run: dict) -> dict:
    return {n: run["final"][n] - run["initial"][n] for n in run["final"]}


def check_parity(tree: dict, reference: dict, clipped: bool) -> None:
    assert tree["world"] == 2 and reference["world"] == 1
    assert tree["initial"].keys() == reference["initial"].keys()
    assert relative_error(tree["initial"], reference["initial"]) == 0.0  # the same start
    assert relative_error(updates(tree), updates(reference), tiny=1e-9) <= TOL
    norms, stock_norms = tree["grad_norms"], reference["grad_norms"]
    assert len(norms) == len(stock_norms) == 2
    assert max(stock_norms) > 1.0 or not clipped  # (clipping did clip a step)
    assert all(abs(a - b) <= TOL * b for a, b in zip(norms, stock_norms, strict=True))


def check_collectives(mode: str, run: dict) -> None:
    parameters = run["sharded"]["parameters"]
    reductions = []
    for step in run["collectives"]:
        walks = [(phase, counts) for phase, counts in step["phases"] if phase.startswith("walk")]
        assert walks
        for phase, counts in walks:
            reduced = sum(counts.get(k, 0) for k in REDUCTIONS)
            if mode.startswith("zero") or phase == "walk-no-grad":
                assert reduced == 0, step  # DeepSpeed: nothing is reduced inside a walk
            if mode == "fsdp2" and phase == "walk-grad":
                reductions.append(reduced)
            if mode.startswith("zero"):
                gathers = counts.get("deepspeed.all_gather_into_tensor", 0)
                assert gathers == (parameters if mode == "zero3" else 0), step  # ZeRO-3: each parameter once
        if mode.startswith("zero"):
            flushes = [counts for phase, counts in step["phases"] if phase == "flush"]
            assert len(flushes) == 1 and sum(flushes[0].values()) == 1, step  # one bucket, once per step
    # FSDP2 gather-once: a gradient walk reduce-scatters once per unit, the same whatever the trie
    assert len(set(reductions)) <= 1 and all(0 < r <= len(run["sharded"]["fsdp_units"]) for r in reductions)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["zero2", "zero3", "fsdp2", "fsdp2-per-layer"])
def test_trainer_under_accelerate_equals_stock_trl(tmp_path, model_dir, stock, mode):
    runs = launch(tmp_path, model_dir, mode, VARIANTS)
    for variant, run in runs.items():
        reference = stock["plain" if variant == "save" else variant]
        check_parity(run, reference, clipped=variant != "resume")
        check_collectives(mode, run)
        sharded = run["sharded"]
        if mode.startswith("zero"):
            assert (
                run["distributed_type"] == "DistributedType.DEEPSPEED"
                and sharded["engine"] == "DeepSpeedEngine"
            )
            assert sharded["zero3_partitioned"] == (sharded["parameters"] if mode == "zero3" else 0)
        else:  # accelerate's own FSDP2 units: the root, the embeddings, each layer, the norm, the LM head
            assert (
                run["distributed_type"] == "DistributedType.FSDP"
                and sharded["dtensors"] == sharded["parameters"]
            )
            assert {"FSDPEmbedding", "FSDPQwen3DecoderLayer", "FSDPLinear"} <= set(sharded["fsdp_units"])
        if variant == "kl":  # TRL prepared the reference model as well (ZeRO-2: a stage-0 engine, unsharded)
            assert sharded["ref_engine"] in ("DeepSpeedEngine", "FSDPQwen3ForCausalLM")
            if mode == "zero3":
                assert sharded["ref_partitioned"] > 0
            if mode.startswith("fsdp2"):
                assert sharded["ref_dtensors"] > 0
    saved = runs["save"]
    assert relative_error({n: saved["saved"][n] for n in saved["final"]}, saved["final"]) == 0.0
    resumed = runs["resume"]
    assert relative_error(resumed["resumed"], resumed["final"]) == 0.0
