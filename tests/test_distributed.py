"""Two-process TreePPOTrainer (torchrun, gloo, CPU) against stock GRPOTrainer: same optimizer-step gradients.

Ranks get the DFS partition of the global batch, with unequal row counts (one prompt is much longer).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from conftest import max_rel_diff

from trl_dta.testing.torchrun import run_workers

WORKER = Path(__file__).with_name("dist_worker.py")
TOL = 1e-4


def run(out, model_dir, loss_type, trainer, procs, accumulation=1, value_model=False, dense_fallback="",
        mode="ddp", resume=False, value_lora=False, final=False):  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "REFERENCE_WORLD": "2", "PYTHONUNBUFFERED": "1",
           "GRAD_ACCUM": str(accumulation), "VALUE_MODEL": str(int(value_model)),
           "DENSE_FALLBACK": dense_fallback, "MODE": mode, "RESUME": str(int(resume)),
           "VALUE_LORA": str(int(value_lora)), "FINAL": str(int(final))}  # fmt: skip
    if procs == 1:
        cmd = [sys.executable, str(WORKER)]
    else:
        # --standalone: a free port per launch (a fixed one can still be held by the previous test's run)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(procs),
               str(WORKER)]  # fmt: skip
    result = run_workers(cmd + [str(out), model_dir, loss_type, trainer], env=env, timeout=300, cwd=out)
    assert result.returncode == 0, result.stderr[-4000:]
    return [torch.load(out / f"{trainer}{rank}.pt") for rank in range(procs)]


@pytest.mark.parametrize(
    "loss_type,reference_procs,accumulation",
    [("dapo", 1, 1), ("grpo", 1, 1), ("bnpo", 2, 1), ("grpo", 1, 2)],
    ids=["dapo-global-normaliser", "grpo-rows-normaliser", "bnpo-per-rank-batches", "grpo-accumulation-2"],
)
def test_two_process_gradients_equal_stock_trl(tmp_path, model_dir, loss_type, reference_procs, accumulation):
    tree = run(tmp_path, model_dir, loss_type, "tree", 2, accumulation)
    stock = run(tmp_path, model_dir, loss_type, "stock", reference_procs, accumulation)
    for step in range(2):
        for rank in range(2):  # gradients are synchronised: every rank holds the global gradient
            assert max_rel_diff(tree[rank]["grads"][step], stock[0]["grads"][step]) <= TOL
    if loss_type != "bnpo":  # re-partitioned: the long prompt's group gets a rank to itself
        assert sorted(r["rows"][0] for r in tree) == [4, 12]
    else:  # per-micro-batch statistics: TRL's per-rank batches are kept
        assert [r["rows"][0] for r in tree] == [8, 8]


@pytest.mark.parametrize(
    "loss_type,mode,accumulation",
    [
        ("grpo", "ddp", 1),
        ("dapo", "ddp", 1),
        pytest.param("grpo", "fsdp2", 2, marks=pytest.mark.slow),
        pytest.param("dapo", "fsdp2-per-layer", 2, marks=pytest.mark.slow),
        pytest.param("grpo", "fsdp2-lora", 2, marks=pytest.mark.slow),
    ],
)
def test_two_process_value_model_equals_one_process(tmp_path, model_dir, loss_type, mode, accumulation):
    """PPO with a value model under DDP, and with both models sharded by accelerate's FSDP2 (gathered once per
    step, or per layer): the re-partitioned rollouts, advantages whitened over both ranks, the value loss
    averaged over both: the policy's and the value model's gradients equal one process with the whole
    batch."""
    lora, mode = mode.endswith("-lora"), mode.removesuffix("-lora")  # (a LoRA value model)
    two = run(tmp_path, model_dir, loss_type, "tree", 2, accumulation, True, mode=mode, value_lora=lora)
    (tmp_path / "one").mkdir()
    (one,) = run(tmp_path / "one", model_dir, loss_type, "tree", 1, accumulation, True, value_lora=lora)
    for step in range(2):
        for rank in range(2):
            assert max_rel_diff(two[rank]["grads"][step], one["grads"][step]) <= TOL
            assert max_rel_diff(two[rank]["value_grads"][step], one["value_grads"][step]) <= TOL
    if mode.startswith("fsdp2"):  # the value model sharded as the policy: every parameter a DTensor
        for r in two:
            assert r["value_dtensors"] == r["value_parameters"] and r["value_units"] >= 3
            no_grad = [p for p in r["value_phases"] if not p[0]]
            grad = [p for p in r["value_phases"] if p[0]]
            assert no_grad and grad and all(reduced == 0 for _, _, reduced in no_grad)  # (values: none)
            if mode == "fsdp2":  # gathered once per walk, reduced once per step: one per unit at most
                assert all(0 < gathers <= r["value_units"] for _, gathers, _ in r["value_phases"])
                assert len({reduced for _, _, reduced in grad}) == 1
                assert all(0 < reduced <= r["value_units"] for _, _, reduced in grad)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["zero2", "zero3"])
def test_a_value_model_under_deepspeed_trains_as_on_one_process(tmp_path, model_dir, mode):
    """DeepSpeed ZeRO-2 and ZeRO-3 (the policy accelerate's engine, the value model an engine of its own): two
    processes update both models as one process does with the whole batch (gradient accumulation 2)."""
    two = run(tmp_path, model_dir, "grpo", "tree", 2, 2, True, mode=mode, final=True)
    (tmp_path / "one").mkdir()
    (one,) = run(tmp_path / "one", model_dir, "grpo", "tree", 1, 2, True, final=True)
    for r in two:
        assert r["value_engine"] == "DeepSpeedEngine" and (r["value_zero3"] > 0) == (mode == "zero3")
        # its collectives per walk: ZeRO-3 gathers each parameter once (ZeRO-2 none); its gradient walk
        # flushes once (the tiny model: one bucket, one reduction), its no-gradient walk reduces nothing
        params = r["value_zero3"]
        assert all(gathers == params for _, gathers, _ in r["value_phases"])
        assert sorted({(grad, reduced) for grad, _, reduced in r["value_phases"]}) == [(False, 0), (True, 1)]
        value = {n: u for n, u in r["updates"].items() if n.startswith("value.")}
        assert value and max(u.abs().max() for u in value.values()) > 0  # (the value model trained)
        assert max_rel_diff(r["updates"], one["updates"]) <= TOL


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fsdp2", "zero3"])
def test_a_sharded_run_with_a_value_model_resumes_to_the_same_parameters(tmp_path, model_dir, mode):
    """Both models sharded (FSDP2; ZeRO-3, the value model's own engine): the step-1 checkpoint holds the
    value model's weights whole and its optimizer's state (momentum SGD: whole under FSDP2, the engine's
    partitions under ZeRO-3), and a new trainer resumed from it ends where the run did."""
    for r in run(tmp_path, model_dir, "grpo", "tree", 2, 2, value_model=True, mode=mode, resume=True):
        assert r["final"].keys() == r["resumed"].keys() and any(k.startswith("value.") for k in r["final"])
        assert max_rel_diff(r["resumed"], r["final"]) == 0.0
    saved = tmp_path / "run" / "checkpoint-1" / "value_model"
    from transformers import AutoModelForTokenClassification

    loaded = AutoModelForTokenClassification.from_pretrained(saved)  # (whole: a user loads it as it is)
    at_step_1 = {f"value.{n}": p.detach() for n, p in loaded.named_parameters()}
    final = {k: v for k, v in r["final"].items() if k.startswith("value.")}
    assert at_step_1.keys() == final.keys() and max_rel_diff(final, at_step_1) > 1e-3  # (step 2 moved it)


@pytest.mark.parametrize("mode", ["always", pytest.param("auto", marks=pytest.mark.slow)])
def test_two_process_dense_fallback_equals_stock_trl(tmp_path, model_dir, mode):
    """``tree_dense_fallback`` on two DDP processes: the dense path is TRL's own, DDP reducing it, on the
    re-partitioned rows (rank rows 4 and 12, the short run padded with zero-weight rows that TRL's row
    normaliser counts: the loss is rescaled). "auto": every rank takes the path the slowest rank's
    predictions choose (one all-reduce), whatever its own prediction says."""
    tree = run(tmp_path, model_dir, "grpo", "tree", 2, accumulation=2, dense_fallback=mode)
    stock = run(tmp_path, model_dir, "grpo", "stock", 1, accumulation=2)
    for step in range(2):
        for rank in range(2):
            assert max_rel_diff(tree[rank]["grads"][step], stock[0]["grads"][step]) <= TOL
    assert sorted(r["rows"][0] for r in tree) == [4, 12]
    decisions = [r["decisions"] for r in tree]
    assert len(decisions[0]) == len(decisions[1]) == 2  # (one per optimizer step)
    for (mine, dense), (theirs, other) in zip(*decisions, strict=True):
        assert dense == other
        if mode == "always":
            assert dense, decisions
        else:
            walk_s, dense_s = max(mine[0], theirs[0]), max(mine[1], theirs[1])
            assert dense == (dense_s * 1.1 < walk_s)  # (tree_dense_margin 0.1)
