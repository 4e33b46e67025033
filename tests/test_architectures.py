"""Every causal-LM architecture of transformers is exact under the tree walk or refused with its cause.

The quick subset of ``benchmarks/arch_sweep.py`` runs here (the tiny models of
``trl_dta.testing.architectures``, the check of ``trl_dta.testing.exactness``): one model type per behaviour
the walk must get right (attention windows of each kind, chunked attention, ALiBi, index-sliced local
attention, learned positions, length-dependent RoPE, MLA, hybrids with carried states, encoders). Each
compares log-probs and gradients of the walk (chunked and packed) with the model's own dense
forward/backward, and checks what happens to sequences longer than the model's window. The full sweep
(every model type, fp64/fp32 x eager/sdpa, LoRA) is the slow test at the end; the table in
docs/supported-models.md is its output (``benchmarks/arch_sweep.py --table docs/supported-models.md``).
"""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

from trl_dta import PrefixTrie, TreeExecutor
from trl_dta.testing import architectures, exactness
from trl_dta.walk.adapter.cache import HAS_STATE_API, STATE_API_VERSION
from trl_dta.walk.adapter.model import CausalLM

# case -> (verdict, what happens to sequences longer than the window, sibling leaves packed, reason)
EXACT, WINDOWED, PADDED, REFUSED = "exact", "refused", False, "refused"
EXPECTED = {
    "llama": (EXACT, "exact", True, ""),
    "mistral": (EXACT, WINDOWED, PADDED, "sliding window"),
    "starcoder2": (EXACT, WINDOWED, PADDED, "sliding window"),
    "phi3": (EXACT, WINDOWED, PADDED, "sliding window"),
    "mixtral": (EXACT, WINDOWED, PADDED, "sliding window"),
    "qwen2 (sliding window)": (EXACT, WINDOWED, PADDED, "sliding window"),
    "gemma2": (EXACT, WINDOWED, PADDED, "sliding window"),
    "gpt_neo": (EXACT, WINDOWED, PADDED, "local attention"),
    "llama4_text": (EXACT, WINDOWED, PADDED, "chunked attention"),
    "mpt": (EXACT, "exact", PADDED, ""),  # ALiBi from key indices: the probe sees packing differ
    "bloom": (EXACT, "exact", PADDED, ""),  # ALiBi from the 2-D mask: packing fails, the probe sees it
    "falcon (alibi)": (EXACT, "exact", PADDED, ""),
    "bart": (EXACT, "exact", PADDED, ""),  # learned positions from the past length, not position_ids
    "gpt2": (EXACT, "exact", True, ""),
    "deepseek_v3": (EXACT, "exact", True, ""),
    "llama (dynamic RoPE)": (EXACT, WINDOWED, True, "RoPE"),
    "phi3 (longrope)": (EXACT, WINDOWED, True, "RoPE"),
    "qwen3_5_text": (EXACT, "exact", PADDED, "")  # linear-attention states carried; never packed
    if HAS_STATE_API
    else (REFUSED, "", None, f"upgrade transformers to >= {STATE_API_VERSION}"),  # (the floor job's 5.17)
    "lfm2 (conv layers)": (EXACT, "exact", PADDED, ""),  # convolution states carried
    "bert": (REFUSED, "", None, "is not causal"),
}


def test_quick_subset_is_listed():
    assert set(EXPECTED) == set(architectures.QUICK)


@pytest.mark.parametrize("label", architectures.QUICK)
def test_quick_sweep(label):
    verdict, long, packed, reason = EXPECTED[label]
    model_type, overrides = architectures.cases([label])[label]
    results = [r for r in exactness.run_case(label, model_type, overrides, quick=True) if r.verdict != "n/a"]
    assert results, f"{label}: no variant ran"
    for r in results:
        where = f"{label} {r.variant}: {r.verdict} {r.detail} long={r.long}"
        assert r.verdict == verdict, where
        if verdict == REFUSED:
            assert reason in r.detail, where
            continue
        dtype = torch.float64 if r.dtype == "fp64" else torch.float32
        lp_tol, grad_tol = exactness.tolerance(dtype, r.extra["states"])
        assert r.logp_err <= lp_tol and r.grad_err <= grad_tol, where
        assert r.extra["packed"] is packed, where
        assert r.long.startswith(long), where
        if long == WINDOWED:
            assert reason in r.long, where


@pytest.mark.parametrize(
    "label,window",
    [
        ("mistral", 16), ("mixtral", 16), ("starcoder2", 16), ("phi3", 16), ("gemma2", 16), ("gpt_neo", 16),
        ("llama4_text", 16), ("qwen2 (sliding window)", 16), ("qwen2", None), ("llama", None),
    ],
)  # fmt: skip
def test_attention_window_is_detected(label, window):
    """``sliding_window`` alone windows every layer (Mistral style); Qwen2 only with use_sliding_window."""
    model_type, overrides = architectures.cases([label])[label]
    lm = CausalLM(architectures.build(model_type, torch.float64, "eager", **overrides), probe=False)
    assert lm.attention_window == window


def test_probe_does_not_refuse_fp64_eager_for_hf_fp32_casts():
    """HF computes eager softmax and RMSNorm in float32 inside a float64 model (~1e-7 between two exact
    methods); the probe must not mistake that for an ignored cache."""
    model = architectures.build("mpt", torch.float64, "eager")
    assert not TreeExecutor(model).pack_leaves  # and it is not refused


def test_packing_fallback_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="trl_dta.walk.adapter.probe"):
        TreeExecutor(architectures.build("mpt", torch.float32, "eager"))
    assert "padded batch" in caplog.text


def test_gradient_checkpointing_warning_once(caplog):
    model = architectures.build("llama", torch.float64, "sdpa").train()
    model.gradient_checkpointing_enable()
    executor = TreeExecutor(model)
    trie = PrefixTrie.from_sequences([[3, 4, 5], [3, 4, 6, 7]])
    with caplog.at_level(logging.WARNING, logger="trl_dta.walk.adapter.model"):
        for _ in range(3):
            executor.backward(trie, lambda i, lp, ent: lp.sum())
    assert sum("Gradient checkpointing is on" in r.message for r in caplog.records) == 1


@pytest.mark.slow
def test_full_sweep(tmp_path):
    """Every model type of the auto mapping: exact or refused, never a wrong answer or a crash. The sweep is
    single-threaded: its two halves run at once, one here and one in a subprocess (on 2 cores, 444 s in one
    process, 280 s in two)."""
    import arch_sweep  # benchmarks/arch_sweep.py, on pytest's pythonpath

    half = [sys.executable, arch_sweep.__file__, "--shard", "1/2", "--json", str(tmp_path / "sweep1.json")]
    other = subprocess.Popen(half, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        here = arch_sweep.main(["--shard", "0/2", "--json", str(tmp_path / "sweep0.json")])
        out, _ = other.communicate(timeout=1800)
    finally:
        if other.poll() is None:
            other.kill()
            other.wait()
    assert here == 0, "the first half of the sweep found a wrong answer or a crash"
    assert other.returncode == 0, out[-4000:]
