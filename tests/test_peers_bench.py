"""The peer benchmark's smoke run (`python benchmarks/peers.py --quick`): every method runs, its gradients
equal dense's, and the tables and plots are written. Slow: ~1-2 minutes on 2 cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("prefix_grouper", reason="the `bench` extra (prefix-grouper) is not installed")
pytest.importorskip("matplotlib")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_peers_quick(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "peers.py"),
        "--quick",
        "--threads",
        "1",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=390)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "peers_quick.json").read_text())
    methods = {"dense", "dense_ckpt", "pg", "pg_lmhead", "tree_mask", "tree"}
    for rows in (data["results"], data["sweep"]):
        assert {r["method"] for r in rows} == methods
        for r in rows:
            assert r["status"] == "ok", r
            assert r["grad_err"] < 1e-4, r
    assert data["env"]["complete"] and data["breakdown"]["step_s"] > 0
    for png in ("speedup", "memory", "trainer_step"):
        assert (tmp_path / f"peers_quick_{png}.png").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_packed_tree_layout():
    """The packed tree-mask baseline's layout: unique tokens in DFS order, ancestors visible, depths right."""
    from peer_bench.tree_mask import packed_tree  # benchmarks/peer_bench/, on pytest's pythonpath

    from trl_dta import PrefixTrie

    seqs = [[1, 2, 3, 4], [1, 2, 5], [1, 2, 3], [7, 8], [1, 2, 5, 6, 9]]
    tokens, depth, end, paths = packed_tree(seqs)
    assert len(tokens) == PrefixTrie.from_sequences(seqs).num_unique_tokens
    for s, path in zip(seqs, paths, strict=True):
        assert [tokens[i] for i in path] == s and [depth[i] for i in path] == list(range(len(s)))
    for i in range(len(tokens)):  # token i sees j iff j is on a path through i, at or before i
        path = next(p.tolist() for p in paths if i in p.tolist())
        assert {j for j in range(len(tokens)) if j <= i <= end[j]} == set(path[: path.index(i) + 1])
