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


def run(out, model_dir, loss_type, trainer, procs, accumulation=1, value_model=False, dense_fallback=""):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "REFERENCE_WORLD": "2", "PYTHONUNBUFFERED": "1",
           "GRAD_ACCUM": str(accumulation), "VALUE_MODEL": str(int(value_model)),
           "DENSE_FALLBACK": dense_fallback}  # fmt: skip
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


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_two_process_value_model_equals_one_process(tmp_path, model_dir, loss_type):
    """PPO with a value model under DDP: the re-partitioned rollouts, advantages whitened over both ranks,
    the value loss averaged over both: the policy's and the value model's gradients equal one process with
    the whole batch."""
    two = run(tmp_path, model_dir, loss_type, "tree", 2, value_model=True)
    (tmp_path / "one").mkdir()
    (one,) = run(tmp_path / "one", model_dir, loss_type, "tree", 1, value_model=True)
    for step in range(2):
        for rank in range(2):
            assert max_rel_diff(two[rank]["grads"][step], one["grads"][step]) <= TOL
            assert max_rel_diff(two[rank]["value_grads"][step], one["value_grads"][step]) <= TOL


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
