"""Two-process TreeSFTTrainer (torchrun, gloo, CPU, DDP) against stock SFTTrainer on one process and on two:
the same optimizer-step gradients (num_items_in_batch counts every rank's tokens) and the same metrics
(gathered across ranks). The same under DeepSpeed ZeRO-2 and ZeRO-3 (prepared by accelerate itself, on gloo
processes: trl_dta/testing/cpu_distributed.py) against stock SFTTrainer on one process. And TreeSFTTrainer on
an FSDP2-sharded model against stock SFTTrainer unsharded."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from trl_dta.compare import relative_error
from trl_dta.testing.torchrun import run_workers

WORKER = Path(__file__).with_name("sft_dist_worker.py")
TOL = 1e-4


def run(out, model_dir, trainer, procs, mode="ddp", dense_fallback=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if dense_fallback is not None:
        env["DENSE_FALLBACK"] = dense_fallback
    cmd = [sys.executable, str(WORKER)]
    if procs > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(procs),
               str(WORKER)]  # fmt: skip
    result = run_workers(cmd + [str(out), model_dir, trainer, mode], env=env, timeout=600, cwd=out)
    assert result.returncode == 0, result.stderr[-4000:]
    name = trainer if mode == "ddp" else f"{trainer}-{mode}"
    return [torch.load(out / f"{name}{rank}.pt", weights_only=False) for rank in range(procs)]


@pytest.mark.slow
def test_two_process_sft_equals_stock(tmp_path, model_dir):
    tree = run(tmp_path, model_dir, "tree", 2)
    for procs in (1, 2):
        stock = run(tmp_path, model_dir, "stock", procs)
        for step in range(2):
            for rank in range(2):  # gradients are synchronised: every rank holds the global gradient
                error = relative_error(tree[rank]["grads"][step], stock[0]["grads"][step])
                assert error <= TOL, (procs, step)
        for got, ref in zip(tree[0]["logs"], stock[0]["logs"], strict=True):
            for key in ("entropy", "mean_token_accuracy", "num_tokens"):
                assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-6), (procs, key)


@pytest.mark.slow
def test_two_process_dense_fallback_equals_stock(tmp_path, model_dir):
    """``tree_dense_fallback="always"`` on two DDP processes: TRL's dense path, DDP reducing it."""
    tree = run(tmp_path, model_dir, "tree", 2, dense_fallback="always")
    stock = run(tmp_path, model_dir, "stock", 1)
    for step in range(2):
        for rank in range(2):
            assert relative_error(tree[rank]["grads"][step], stock[0]["grads"][step]) <= TOL, step
    for rank in tree:
        assert [log["tree/path"] for log in rank["logs"]] == [1.0, 1.0]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["zero2", "zero3"])
def test_two_process_sft_under_deepspeed_equals_stock(tmp_path, model_dir, mode):
    """SGD, 2 optimizer steps of 2 accumulated micro-batches per rank: the parameter updates equal stock
    SFTTrainer's on one process with the global batch, the metrics too, and the walk's budgets and retries
    are logged."""
    tree = run(tmp_path, model_dir, "tree", 2, mode)
    stock = run(tmp_path, model_dir, "stock", 1)[0]
    for rank in range(2):
        got = tree[rank]
        assert got["distributed_type"] == "DistributedType.DEEPSPEED" and got["engine"] == "DeepSpeedEngine"
        assert got["zero3_partitioned"] == (got["parameters"] if mode == "zero3" else 0)
        assert relative_error(got["initial"], stock["initial"]) == 0.0  # the same start
        updates = {n: got["final"][n] - got["initial"][n] for n in got["final"]}
        stock_updates = {n: stock["final"][n] - stock["initial"][n] for n in stock["final"]}
        assert relative_error(updates, stock_updates, tiny=1e-9) <= TOL, rank
    assert len(tree[0]["logs"]) == len(stock["logs"]) == 2
    for got, ref in zip(tree[0]["logs"], stock["logs"], strict=True):
        for key in ("entropy", "mean_token_accuracy", "num_tokens"):
            assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-6), key
        assert got["tree/block_size"] > 0 and got["tree/oom_retries"] == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["plain", "lora"])
def test_sharded_model_equals_stock(tmp_path, model_dir, variant):
    """FSDP2 (fully_shard per layer and root, one gloo rank, tests/sft_fsdp_worker.py): the walk gathers
    once and reduce-scatters once."""
    out = tmp_path / "grads.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(Path(__file__).with_name("sft_fsdp_worker.py")), str(out), model_dir, variant]
    result = run_workers(cmd, env=env, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    got = torch.load(out)
    assert got["sharded_parameters"] > 0  # the model really was sharded
    assert len(got["tree"]) == len(got["stock"]) == 2
    for tree, stock in zip(got["tree"], got["stock"], strict=True):
        assert tree.keys() == stock.keys()
        assert relative_error(tree, stock, tiny=1e-9) <= TOL
