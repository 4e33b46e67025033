"""The flash path's bf16 parity item (trl_dta/testing/flash_parity.py, the GPU suite's first step) on a CPU
with the stand-in kernel: it passes, and it fails with a kernel that aligns causal masking top-left or with
a flash path that drops the gather's recompute. And no call hands torch's varlen kernel a tensor longer than
its last cumulative length (its backward returns NaN then, without an error: pytorch issue 176793)."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

from trl_dta import PrefixTrie, TreeExecutor
from trl_dta.testing import flash_parity
from trl_dta.testing.varlen import flash_on_cpu, reference_varlen_attn
from trl_dta.walk.attention import check
from trl_dta.walk.attention.sdpa import SDPA_SEGMENTS
from trl_dta.walk.attention.segment_layout import SegmentLayout
from trl_dta.walk.attention.torch_varlen import TorchVarlen
from trl_dta.walk.attention.varlen import _check_covered

SCALE = 0.0625  # (the scenarios' lengths: 32-100 tokens a sequence on the tiny model)


# ---------------------------------------------------------------------- the flash path broken on purpose
def _top_left(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1), **kwargs
):
    """The stand-in with causal masking aligned top-left: a segment's query j sees its first j + 1 keys (its
    past's, where it has one), not the last."""
    q_cu, k_cu = cu_seq_q.tolist(), cu_seq_k.tolist()
    outs = []
    for a, b, c in zip(q_cu, q_cu[1:], k_cu, strict=False):
        n = b - a
        runs = torch.tensor([0, n], dtype=torch.int32, device=query.device)
        outs.append(
            reference_varlen_attn(
                query[a:b],
                key[c : c + n],
                value[c : c + n],
                runs,
                runs,
                n,
                n,
                scale=scale,
                window_size=window_size,
            )
        )
    return torch.cat(outs)


class _NoRecompute(TorchVarlen):
    """The flash kernel with a packed call's gathered keys and values detached: nothing recomputes them in
    the backward, so no gradient reaches them."""

    def attend(self, q, k, v, layout, scale, dtype):
        if layout.key_index is None:
            return super().attend(q, k, v, layout, scale, dtype)
        keys = (t.detach().to(dtype) for t in layout.gather(k, v))
        return self.run(q.to(dtype), *keys, layout, scale)


@contextlib.contextmanager
def mutation(name: str):
    """Within: the flash path broken on purpose: ``"top-left"`` (its function aligns causal masking
    top-left) or ``"no-recompute"`` (:class:`_NoRecompute`). Yields what to pass to ``flash_parity.run``:
    the function (or None) and the kernel's class."""
    if name not in ("top-left", "no-recompute"):
        raise ValueError(name)
    yield (_top_left, TorchVarlen) if name == "top-left" else (None, _NoRecompute)


def run(kernel=None, kind=TorchVarlen) -> dict:
    torch.manual_seed(0)
    return flash_parity.run(flash_parity.TINY, "cpu", SCALE, long_tokens=64, kernel=kernel, kind=kind)


def test_the_bf16_parity_item_passes_with_the_stand_in_kernel():
    report = run()
    assert report["ok"], "\n".join(flash_parity.lines(report))
    assert report["missing_kinds"] == [] and all(report["calls"][k] > 0 for k in flash_parity.KINDS)
    for scenario in report["scenarios"]:
        errors = scenario["errors"]
        assert scenario["flash_calls"] > 0
        assert 0 < errors["flash"] <= scenario["bound"]  # (bf16: never exact, never far)
        assert errors["sdpa"] < 0.05 and errors["dense"] < 0.05
    assert report["scenarios"][1]["recomputed_tokens"] > 0  # (τ²: the chunked backward recomputes pops)


@pytest.mark.parametrize("name", ["top-left", "no-recompute"])
def test_the_bf16_parity_item_fails_with_a_broken_flash_path(name):
    with mutation(name) as (kernel, kind):
        report = run(kernel, kind)
    assert not report["ok"]
    for scenario in report["scenarios"]:  # (every scenario has segments on a past and packed calls)
        assert scenario["errors"]["flash"] > 3 * scenario["bound"], scenario
        assert scenario["errors"]["sdpa"] <= scenario["bound"]  # (the sdpa path is untouched)
    if name == "no-recompute":
        assert report["missing_kinds"] == ["recompute"]
    else:
        assert report["loose_kinds"]  # (each call's output against the fp32 kernel, too)


# ---------------------------------------------------------------------- pytorch issue 176793
@pytest.mark.parametrize("longer", ["q", "k", "v"])
def test_a_call_with_a_tensor_longer_than_its_runs_is_refused_before_the_kernel(longer):
    layout = SegmentLayout.build([5, 3], (-1, -1), 4, "cpu")
    q, k, v = (
        torch.randn(8, 4, 16),
        torch.randn(sum(layout.k_lens), 2, 16),
        torch.randn(sum(layout.k_lens), 2, 16),
    )
    tensors = {"q": q, "k": k, "v": v}
    tensors[longer] = torch.cat([tensors[longer], tensors[longer][:1]])
    with pytest.raises(RuntimeError, match="NaN"):
        _check_covered(*tensors.values(), layout)
    called = []
    kernel = flash_on_cpu(lambda *a, scale=None, window_size=None: called.append(1))
    lone = SegmentLayout.build([6], (-1,), 4, "cpu")  # a lone segment: the path's keys, read in place
    buffer = torch.randn(16, 2, 16)  # (a path buffer with room to grow: only its view is passed)
    with pytest.raises(RuntimeError, match="NaN"):
        kernel.attend(torch.randn(6, 4, 16), buffer, buffer, lone, 0.25, torch.float32)
    assert not called


def test_every_call_of_a_walk_covers_its_tensors_exactly():
    """A walk on the flash path (pushes on a past read in place from the path buffer, packed leaves, a chunked
    backward): every call's q, k and v are exactly as long as their last cumulative lengths."""
    from conftest import make_model

    model = make_model("qwen3", dtype=torch.float32).train()
    seen = []

    @functools.wraps(reference_varlen_attn)
    def kernel(query, key, value, cu_seq_q, cu_seq_k, *args, **kwargs):
        seen.append((query.shape[0], key.shape[0], value.shape[0], int(cu_seq_q[-1]), int(cu_seq_k[-1])))
        return reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, *args, **kwargs)

    prompt = list(range(3, 40))  # (the tiny model's 61 ids)
    seqs = [prompt + [40 + i] * (1 + i) for i in range(5)] + [prompt[:10] + list(range(30, 60))]
    executor = TreeExecutor(model, block_size=8, batch_tokens=16, attention_kernel=flash_on_cpu(kernel))
    seen.clear()  # (the construction probe's calls)
    executor.backward(PrefixTrie.from_sequences(seqs), lambda i, lp, _: -lp.sum())
    assert len(seen) > 10 and any(k > q for q, k, *_ in seen)  # (calls on a past among them)
    assert all(q == cq and k == v == ck for q, k, v, cq, ck in seen)


def test_the_kernels_one_time_check_covers_a_lone_segment_read_in_place(caplog):
    """The kernel's one-time check (trl_dta/walk/attention/check.py: once per kernel, device, dtype and head
    shape, before the walk uses it) on the stand-in, checked as on CUDA: passes for the right kernel; a kernel
    aligned top-left fails it, with a warning, on both of its calls (two segments gathered, and a lone segment
    on a past read in place from the strided path buffer)."""
    cpu, shape = torch.device("cpu"), (4, 2, 16)
    assert (
        TorchVarlen(reference_varlen_attn, devices=("cpu",)).resolve(cpu, torch.bfloat16, shape)
        != SDPA_SEGMENTS
    )
    top_left = TorchVarlen(_top_left, devices=("cpu",))
    assert top_left.resolve(cpu, torch.bfloat16, shape) is SDPA_SEGMENTS
    lone = SegmentLayout.build([8], (-1,), 4, "cpu")
    gen = torch.Generator().manual_seed(0)
    assert check.error(top_left, lone, shape, torch.bfloat16, gen) > 0.1  # (the lone call alone)
    assert "differs from sdpa" in caplog.text
