"""The peer benchmark: its smoke run (`python benchmarks/peers.py --quick`: every method runs, its gradients
equal dense's, the tables and plots are written; slow, ~1-2 minutes on 2 cores), the memory estimate of its
plan against what the first GPU run measured, the GPU suite's decisive table (a process per row: an OOM is a
row), and the profile's kernel classes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench_extra():
    pytest.importorskip("prefix_grouper", reason="the `bench` extra (prefix-grouper) is not installed")
    pytest.importorskip("matplotlib")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_peers_quick(tmp_path):
    _bench_extra()
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


def test_memory_plan_flags_the_first_gpu_runs_oom():
    """``peers.py --plan``'s estimate (benchmarks/peer_bench/memory_plan.py) on the configuration that ran out
    of memory in the first GPU run (shared/gpu-runs/2026-12-04: Qwen3-0.6B, grpo-4k-g16, 74,618 tokens, bf16,
    dense without checkpointing, one group of 16 rows per micro-batch) against a 141 GB card: OOM; the walk
    and the methods that ran fit, and their measured peaks above the weights are what the estimate says."""
    from peer_bench import memory_plan
    from peer_bench.workloads import MODELS, approx_params, shapes_for

    p, params = MODELS["qwen3-0.6b"], approx_params("qwen3-0.6b")
    wl = next(w for w in shapes_for("gpu", p["vocab_size"]) if w.name == "grpo-4k-g16")
    assert wl.stats()["tokens"] == 74_618
    est = {m: memory_plan.estimate(m, wl, p, 2, params) for m in ("dense", "dense_ckpt", "pg", "tree")}
    card = 141e9
    assert not est["dense"].fits(card) and est["dense"].total > 1.3 * card
    assert est["tree"].fits(card) and est["dense_ckpt"].fits(card) and est["pg"].fits(card)
    # peak_mib of rerun/peers_grpo-4k-g16.json: torch.cuda.max_memory_allocated above the weights
    for method, mib in {"dense_ckpt": 29_808, "pg": 76_652}.items():
        assert abs(est[method].step / (mib * 2**20) - 1) < 0.1, (method, est[method].step / 2**20)
    # the walk's defaults on that card (auto budgets: the whole group in one call), by the library's memory
    # model: more than the 2,048-token blocks measured then, at most half of PrefixGrouper's (issue 53's aim)
    assert 14_567 * 2**20 <= est["tree"].step <= est["pg"].step / 2
    # the decisive table's baseline, TRL's micro-batches of 2 rows, holds far less than a group at once
    assert (
        memory_plan.estimate("dense_ckpt", wl, p, 2, params, micro_batch=2).total
        < est["dense_ckpt"].total / 2
    )


def test_profile_kinds():
    """gpu_profile.py's classes of kernel (and CPU op) names, the LM head by the vocabulary in its shapes."""
    from gpu_profile import classify

    vocab = 151_936
    cases = {
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>": "attention",
        "fmha_cutlassF_bf16_aligned_64x128_rf_sm80": "attention",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "matmul",
        "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN": "matmul",
        "void at::native::vectorized_elementwise_kernel<4, at::native::direct_copy_kernel_cuda>": "copies",
        "Memcpy DtoD (Device -> Device)": "copies",
        "void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel>": "elementwise",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>": "elementwise",
        "aten::mm": "matmul",
        "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
    }
    for name, kind in cases.items():
        assert classify(name, [[4096, 1024], [1024, 3072]], vocab) == kind, name
    assert classify("sm90_xmma_gemm_bf16bf16", [[4096, 1024], [vocab, 1024]], vocab) == "LM head"
    assert classify("aten::_log_softmax", [[4096, vocab], [], []], vocab) == "LM head"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gpu_table_rows_are_processes(tmp_path):
    """The decisive table on a CPU at toy size: each row its own process; an injected OOM is a row that says
    so, and the rows after it still run."""
    _bench_extra()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_table.py"), "--out", str(tmp_path),
           "--device", "cpu", "--model", "tiny", "--scale", "0.03125", "--configs", "1", "--rounds", "1",
           "--methods", "tree,dense_ckpt", "--inject_oom", "dense", "--threads", "1"]  # fmt: skip
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.startswith("# Decisive table")
    rows = json.loads((tmp_path / "gpu_table.json").read_text())["rows"]
    assert [(r["method"], r["status"]) for r in rows] == [
        ("tree", "ok"), ("dense", "OOM (injected)"), ("dense_ckpt", "ok"),
    ]  # fmt: skip
    assert rows[0]["vs_ckpt"] > 0 and rows[0]["of_ideal"] == pytest.approx(
        rows[0]["vs_ckpt"] / rows[0]["dedup"]
    )
    assert (tmp_path / "gpu_table.md").read_text().count("\n| ") >= 3


def _row(method, status="ok", **figures):
    return dict({"method": method, "status": status, "card_gib": 79.2}, **figures)


def test_gpu_table_targets_are_stated_per_card():
    """benchmarks/gpu_table.py's targets: where PrefixGrouper runs out of memory (an 80 GB H100) the speed and
    memory target is "not measurable on this card" with the walk's figures, and the full tau2 step's
    PrefixGrouper OOM is the one its plan predicts; where it fits (an H200), the walk's budget row decides."""
    import gpu_table

    def groups(first, full):
        second = [
            _row("tree", time_s=1.0, peak_gib=20, of_ideal=0.9, vs_ckpt=3.0),
            _row("dense_ckpt", time_s=3.0),
        ]
        return list(zip(gpu_table.CONFIGS, [first, second, full], strict=True))

    full = [_row("pg", "OOM", predicted_gib=215.0), _row("tree", time_s=9.0, peak_gib=40), _row("dense_ckpt")]
    first = [_row("pg", "OOM"), _row("tree", time_s=1.0, peak_gib=35, vs_ckpt=3.3, of_ideal=0.6),
             _row("tree_budget", "n/a (PrefixGrouper OOM)"), _row("dense_ckpt", time_s=3.3)]  # fmt: skip
    h100 = gpu_table.targets(groups(first, full))
    assert h100[0].endswith(
        "not measurable on this card (PrefixGrouper ran out of memory on 79 GiB); the walk: 1.000 s, "
        "3.30x dense + ckpt, peak 35 GiB"
    )
    assert "NOT met (0.60, 0.90)" in h100[1]
    assert (
        "met (walk ok, dense + ckpt ok); PrefixGrouper out of memory on 79 GiB, as its plan predicts"
        in h100[2]
    )
    h200 = [_row("pg", time_s=0.7, peak_gib=76.0), _row("tree", time_s=1.0, peak_gib=37.0),
            _row("tree_budget", time_s=0.65, peak_gib=30.0, memory_budget_gib=28.0)]  # fmt: skip
    assert (
        ": met: at a budget of 28 GiB the walk ran 1.08x its speed at 0.39 of its peak"
        in gpu_table.targets(groups(h200, full))[0]
    )
    h200[2]["peak_gib"] = 39.0  # (over half PrefixGrouper's 76 GiB)
    assert ": NOT met: " in gpu_table.targets(groups(h200, full))[0]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gpu_suite_cut_short_still_writes_its_table_and_exits_0(tmp_path):
    """benchmarks/gpu.sh --dry-run under a deadline that cuts it short: the bf16 parity and the decisive
    table run, the steps that no longer fit are rows of the summary, what was written reaches $OUT, and it
    exits 0."""
    _bench_extra()
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, PYTHON=sys.executable, DEADLINE_S="60", OUT=str(out))
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu.sh"), "--dry-run", str(tmp_path / "suite")],
                          check=False, capture_output=True, text=True, env=env, timeout=280)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = (out / "summary.md").read_text()
    assert "| bf16 parity (flash kernel vs sdpa vs dense, each vs fp32) | exactness | ok |" in summary
    assert "| decisive table | table | ok |" in summary and "# Decisive table" in summary
    assert "skipped (deadline" in summary
    assert {p.name for p in out.iterdir()} >= {
        "summary.md",
        "gpu_table.md",
        "flash_parity_bf16.json",
        "suite.tgz",
    }
