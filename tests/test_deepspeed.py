"""The walk's DeepSpeed side (trl_dta/walk/distributed/deepspeed.py) on one process, with a stand-in engine
that records what the walk asks of it: one coalesced reduction per walk or per step, never two before
``engine.step()``, nested walks, state after a failed walk, and what is refused. The real engines, on 2
processes against stock TRL, are in tests/test_accelerate_sharded.py."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from conftest import make_model, max_rel_diff

from trl_dta import PrefixTrie, TreeExecutor, UnsupportedModelError
from trl_dta.testing.torchrun import run_workers
from trl_dta.walk.distributed import deepspeed as zero

SEQS = [[1, 5, 9, 4, 7], [1, 5, 9, 8], [1, 5, 2, 2, 6, 3]]


class StandInEngine:
    """What the walk uses of a ``deepspeed.DeepSpeedEngine``; the coalesced block records its flushes (the
    gradients present when it closes)."""

    def __init__(self, module, stage=2, fp16=False, offload=None):
        self.module, self.stage, self.fp16, self.offload = module, stage, fp16, offload
        self.global_steps = 0
        self.flushes: list[dict] = []
        self.open = False

    def zero_optimization_stage(self):
        return self.stage

    def fp16_enabled(self):
        return self.fp16

    def zero_offload_param(self):
        return self.offload

    def zero_offload_optimizer(self):
        return None

    @contextlib.contextmanager
    def coalesce_grad_reduction(self):
        assert not self.open
        self.open = True
        try:
            yield
        finally:
            self.open = False
            self.flushes.append({n: p.grad for n, p in self.module.named_parameters() if p.grad is not None})


def loss(i, lp, ent):
    return -(lp * (1.0 + 0.1 * i)).sum()


@pytest.fixture
def engine():
    model = make_model("qwen3", dtype=torch.float64).train()
    engine = StandInEngine(model)
    zero.register_engine(engine)
    return engine


def test_a_walk_on_its_own_flushes_once_and_a_second_before_the_step_is_refused(engine):
    model = engine.module
    plain = make_model("qwen3", dtype=torch.float64).train()
    TreeExecutor(plain).backward(PrefixTrie.from_sequences(SEQS), loss)
    executor = TreeExecutor(model)
    executor.logprobs(PrefixTrie.from_sequences(SEQS))  # a no-gradient walk reduces nothing
    assert engine.flushes == []
    executor.backward(PrefixTrie.from_sequences(SEQS), loss)
    assert len(engine.flushes) == 1 and not engine.open
    flushed = engine.flushes[0]
    assert flushed.keys() == {n for n, p in model.named_parameters() if p.requires_grad}
    # (the same walk of the same trie: the same arithmetic, HF's float32 casts included)
    assert max_rel_diff(flushed, {n: p.grad for n, p in plain.named_parameters()}) <= 1e-12
    with pytest.raises(RuntimeError, match="second DeepSpeed gradient reduction before engine.step"):
        executor.backward(PrefixTrie.from_sequences(SEQS), loss)
    engine.global_steps += 1  # engine.step()
    executor.backward(PrefixTrie.from_sequences(SEQS), loss)
    assert len(engine.flushes) == 2


def test_walks_inside_a_step_reduction_share_its_one_flush(engine):
    executor = TreeExecutor(engine.module)
    with zero.step_reduction(engine):
        executor.backward(PrefixTrie.from_sequences(SEQS[:2]), loss)
        executor.backward(PrefixTrie.from_sequences(SEQS[2:]), lambda i, lp, ent: loss(i + 2, lp, ent))
        assert engine.flushes == [] and engine.open
    assert len(engine.flushes) == 1
    plain = make_model("qwen3", dtype=torch.float64).train()
    TreeExecutor(plain).backward(PrefixTrie.from_sequences(SEQS), loss)
    # (two tries against one: HF's float32 casts in RMSNorm round differently, ~2e-7 here; the fp32 parity
    # bound, as their rounding may differ on another CPU; a lost or doubled walk is off by O(1))
    assert max_rel_diff(engine.flushes[0], {n: p.grad for n, p in plain.named_parameters()}) <= 1e-5


def test_unused_parameters_get_zero_gradients_so_every_rank_reduces_the_same_tensors(engine):
    model = engine.module
    extra = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    model.register_parameter("unused", extra)  # trainable, never reached by the walk
    TreeExecutor(model).backward(PrefixTrie.from_sequences(SEQS), loss)
    assert torch.equal(engine.flushes[0]["unused"], torch.zeros(3, dtype=torch.float64))


def test_a_failed_walk_drops_its_gradients_and_leaves_no_state(engine):
    executor = TreeExecutor(engine.module)

    def failing(i, lp, ent):
        if i == 1:
            raise KeyError("boom")
        return loss(i, lp, ent)

    with pytest.raises(KeyError, match="boom"):
        executor.backward(PrefixTrie.from_sequences(SEQS), failing)
    assert engine.flushes == [{}] and not engine.open  # closed, with nothing to reduce
    assert all(p.grad is None for p in engine.module.parameters())
    assert not zero._ACTIVE and not zero._OPEN
    executor.backward(PrefixTrie.from_sequences(SEQS), loss)  # the same step can still be walked
    assert len(engine.flushes) == 2 and engine.flushes[1]


def test_a_gradient_walk_inside_a_no_gradient_walk_is_refused(engine):
    with zero.gathered(engine.module, grad=False):
        with pytest.raises(RuntimeError, match="inside another walk"):
            with zero.gathered(engine.module, grad=True):
                pass
        with zero.gathered(engine.module, grad=False):  # (runs inside the outer one's gather)
            pass
    assert not zero._ACTIVE


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"stage": 1}, "ZeRO stages 2 and 3, not 1"),
        ({"fp16": True}, "fp16"),
        ({"offload": SimpleNamespace(device="cpu")}, "offload_param \\(device cpu\\)"),
    ],
)
def test_unsupported_engines_are_refused(settings, message):
    engine = StandInEngine(make_model("qwen3", dtype=torch.float64).train(), **settings)
    zero.register_engine(engine)
    with pytest.raises(UnsupportedModelError, match=message):
        TreeExecutor(engine.module).backward(PrefixTrie.from_sequences(SEQS), loss)


def test_zero3_without_an_engine_and_per_layer_under_zero3_are_refused():
    model = make_model("qwen3", dtype=torch.float64).train()
    for i, p in enumerate(model.parameters()):
        p.ds_id = i  # what ZeRO-3 marks its parameters with
    with pytest.raises(UnsupportedModelError, match="needs its engine.*register_engine"):
        with zero.gathered(model, grad=True):
            pass
    with pytest.raises(
        UnsupportedModelError, match="gather_per_layer is not supported under DeepSpeed ZeRO-3"
    ):
        with zero.gathered(model, grad=False, per_layer=True):
            pass


@pytest.mark.slow
def test_deepspeed_executor_two_processes(tmp_path):
    """Real ZeRO-2 and ZeRO-3 engines (deepspeed.initialize) on 2 gloo processes, ranks walking different
    tries (one rank idle in two cases), two walks per step in one step_reduction
    (tests/deepspeed_worker.py)."""
    import json
    import os
    import sys
    from pathlib import Path

    out = tmp_path / "deepspeed.json"
    cases = [
        "zero2",
        "zero3",
        "zero3-lora",
        "zero2-idle-rank",
        "zero3-idle-rank",
        "zero2-oom-rank0",
        "zero3-oom-rank0",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    worker = Path(__file__).with_name("deepspeed_worker.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(worker), str(out), *cases]  # fmt: skip
    result = run_workers(cmd, env=env, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    got = json.loads(out.read_text())
    assert got["world"] == 2
    for case in cases:
        run = got["cases"][case]
        zero3 = case.startswith("zero3")
        oom = case.endswith("oom-rank0")
        for step in run["steps"]:
            assert not step["missing"] and step["grad_error"] <= 1e-5, (case, step)  # fp32, as for FSDP2
            # rank 0 runs out of memory in the second walk: every rank walks it again (the others told by
            # the outcome agreement), and the step's gradients are those of an uninterrupted step
            assert step["retries"] == ([1, 1] if oom else [0, 0]), (case, step)
            if oom:
                assert step["walks"][1] == (
                    {"all_gather_into_tensor": 2 * run["parameters"]} if zero3 else {}
                )
                assert sum(step["flush"].values()) == 1
                continue
            for walk in step["walks"]:  # nothing reduced inside a walk; ZeRO-3: every parameter gathered once
                assert walk == ({"all_gather_into_tensor": run["parameters"]} if zero3 else {}), (case, step)
            assert step["logprobs"] == ({"all_gather_into_tensor": run["parameters"]} if zero3 else {})
            assert sum(step["flush"].values()) == 1, (case, step)  # one flush: one bucket, the tiny model
        if case.endswith("idle-rank"):
            assert run["steps"][0]["sequences"] > 0  # (rank 0 walks; the last rank walks the idle trie)


def test_the_workers_build_deepspeed_ops_in_their_own_directory_where_a_killed_builds_lock_is_removed(
    tmp_path, monkeypatch
):
    """DeepSpeed's workers build their CPU collective where a lock left by a killed build cannot hang them
    (trl_dta/testing/torchrun.py): a directory per venv and torch version, a stale lock removed, a fresh one
    (a build under way) kept."""
    import os
    import sys
    import time

    from trl_dta.testing import torchrun

    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    root = torchrun.extensions_dir()
    assert root.parent == tmp_path / "torch_extensions" and torch.__version__ in root.name
    stale, fresh = root / "deepspeed_shm_comm" / "lock", root / "other_op" / "lock"
    for lock in (stale, fresh):
        lock.parent.mkdir(parents=True)
        lock.touch()
    old = time.time() - torchrun.STALE_LOCK_S - 60
    os.utime(stale, (old, old))
    assert torchrun.extensions_dir() == root
    assert not stale.exists() and fresh.exists()

    env = {"PATH": os.environ["PATH"]}
    shown = run_workers(
        [sys.executable, "-c", "import os; print(os.environ['TORCH_EXTENSIONS_DIR'])"], env=env
    )
    assert shown.stdout.strip() == str(root)
    kept = run_workers(
        [sys.executable, "-c", "import os; print(os.environ['TORCH_EXTENSIONS_DIR'])"],
        env={**env, "TORCH_EXTENSIONS_DIR": "/elsewhere"},
    )
    assert kept.stdout.strip() == "/elsewhere"
