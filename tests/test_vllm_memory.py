"""Memory next to a colocated vLLM engine (trl_dta/vllm/memory.py): which share ``tree_memory_budget="auto"``
leaves to the engine, and that TreePPOTrainer's executors get it. No vLLM needed (the default venv runs it);
the GPU side is measured by benchmarks/gpu.sh (benchmarks/vllm_memory.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from trl_dta.vllm.memory import colocated_reserved_bytes
from trl_dta.walk.memory.budgets import auto_memory_bytes

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")
GB = 10**9


def _args(**kw):
    base = dict(
        use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=True, vllm_gpu_memory_utilization=0.4
    )
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize(
    ("overrides", "device", "expected"),
    [
        ({}, CUDA, int(0.4 * 80 * GB)),  # sleeps during training, claims its share back to generate
        ({"vllm_gpu_memory_utilization": 0.9}, CUDA, int(0.9 * 80 * GB)),
        ({"vllm_enable_sleep_mode": False}, CUDA, 0),  # awake: its memory is measured as used
        ({"vllm_mode": "server"}, CUDA, 0),  # another process (or machine)
        ({"use_vllm": False}, CUDA, 0),
        ({}, CPU, 0),  # a CPU's budgets are fixed ("auto" measures nothing there)
    ],
)
def test_colocated_reserved_bytes(overrides, device, expected):
    assert colocated_reserved_bytes(_args(**overrides), device, total_memory=80 * GB) == expected


def test_auto_budget_leaves_the_engine_its_share():
    """With the engine asleep, the free memory measured at the first walk includes its share: "auto" takes
    it off before taking its fraction."""
    free, later = 60 * GB, 5 * GB  # (80 GB card: 20 GB of training state, the engine's 32 GB asleep)
    reserved = colocated_reserved_bytes(_args(), CUDA, total_memory=80 * GB)
    assert auto_memory_bytes(free, later, reserved) == pytest.approx(0.9 * (60 - 32) * GB - later)
    assert auto_memory_bytes(free, later, reserved) < auto_memory_bytes(free, later)


def test_trainer_executors_reserve_the_engines_share(monkeypatch):
    """The trainer hands its step walker the engine's share at construction; every executor reserves it."""
    from trl_dta import TreePPOConfig, TreePPOTrainer
    from trl_dta.testing.grpo import ScriptedGenerationMixin, make_config, make_trainer

    trainer_cls = type("Scripted", (ScriptedGenerationMixin, TreePPOTrainer), {})
    trainer = make_trainer(trainer_cls, make_config(config_cls=TreePPOConfig, max_steps=1))
    assert trainer.vllm_reserved_bytes() == 0  # no engine
    assert trainer._executor(trainer.model).budgets.reserved_bytes == 0
    monkeypatch.setattr(trainer_cls, "vllm_reserved_bytes", lambda self: 7 * GB)
    trainer = make_trainer(trainer_cls, make_config(config_cls=TreePPOConfig, max_steps=1))
    assert trainer._executor(trainer.model).budgets.reserved_bytes == 7 * GB
