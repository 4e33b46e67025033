"""A short soak (benchmarks/soak.py): 40 optimizer steps of TreePPOTrainer on the offline fixture, a trie of
another shape at each step and an out-of-memory error injected into step 25's walk (walked again with
halved budgets); the resident memory after step 40 minus after step 10 stays under ``BOUND_MIB``.

The bound: docs/memory.md's 200-step soak grows by a few MiB after warm-up (allocator and Python noise, and
TRL's per-step log lists); a walk's buffers kept alive each step (a leaked stack, a failed walk held by its
traceback) would add more than that within 30 steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BOUND_MIB = 16.0


@pytest.mark.slow
def test_rss_does_not_grow_after_warm_up(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--steps", "40", "--every", "10",
           "--warmup", "10", "--oom_at", "25", "--out", str(tmp_path)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((tmp_path / "soak_trainer.json").read_text())
    rss = {s["step"]: s["rss_mib"] for s in result["samples"]}
    assert sorted(rss) == [10, 20, 30, 40]
    assert rss[40] - rss[10] <= BOUND_MIB, rss
    assert result["samples"][-1]["retries"] == 1 and result["oom_retries_logged"] == pytest.approx(1.0)
    assert len(set(result["unique_tokens"])) >= 3  # the tries really change shape
