"""Two-process TreeSFTTrainer (torchrun, gloo, CPU, DDP) against stock SFTTrainer on one process and on two:
the same optimizer-step gradients (num_items_in_batch counts every rank's tokens) and the same metrics
(gathered across ranks). And TreeSFTTrainer on an FSDP2-sharded model against stock SFTTrainer unsharded."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trl_dta.compare import relative_error

WORKER = Path(__file__).with_name("sft_dist_worker.py")
TOL = 1e-4


def run(out, model_dir, trainer, procs):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, str(WORKER)]
    if procs > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(procs),
               str(WORKER)]  # fmt: skip
    result = subprocess.run(cmd + [str(out), model_dir, trainer], env=env, capture_output=True, text=True,
                            timeout=300, cwd=out)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    return [torch.load(out / f"{trainer}{rank}.pt") for rank in range(procs)]


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
@pytest.mark.parametrize("variant", ["plain", "lora"])
def test_sharded_model_equals_stock(tmp_path, model_dir, variant):
    """FSDP2 (fully_shard per layer and root, one gloo rank, tests/sft_fsdp_worker.py): the walk gathers
    once and reduce-scatters once."""
    out = tmp_path / "grads.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(Path(__file__).with_name("sft_fsdp_worker.py")), str(out), model_dir, variant]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    got = torch.load(out)
    assert got["sharded_parameters"] > 0  # the model really was sharded
    assert len(got["tree"]) == len(got["stock"]) == 2
    for tree, stock in zip(got["tree"], got["stock"], strict=True):
        assert tree.keys() == stock.keys()
        assert relative_error(tree, stock, tiny=1e-9) <= TOL
