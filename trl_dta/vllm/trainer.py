"""What a GRPOTrainer subclass adds around TRL's vLLM generation (``use_vllm=True``): the CPU engine's
narrow path (:mod:`trl_dta.vllm.cpu`), and the generation's time per step as a metric.

``TreePPOTrainer`` includes :class:`VLLMMixin`; put it in front of stock ``GRPOTrainer`` to run TRL's own
trainer on a CPU engine (``class Trainer(VLLMMixin, GRPOTrainer)``), as the tests' reference does.
"""

from __future__ import annotations

import contextlib
import time

from . import cpu
from .memory import colocated_reserved_bytes


def _cpu_engine() -> bool:
    from trl.import_utils import is_vllm_available

    return is_vllm_available() and cpu.is_cpu_engine()


class VLLMMixin:
    """For ``class T(VLLMMixin, GRPOTrainer)``. With ``use_vllm=True`` and ``vllm_mode="colocate"`` on vLLM's
    CPU backend (and only there): the engine runs in the policy's dtype and eagerly, and weight syncs go
    through :func:`trl_dta.vllm.cpu.sync_weights`; on CUDA, TRL's own engine settings and sync are kept.
    Every mode and backend: logs ``perf/generation_s``, the seconds spent in TRL's ``_generate`` (the weight
    sync, the generation, the tool calls and their turns), beside TRL's ``step_time``. On a GPU with a
    colocated engine in sleep mode, :meth:`vllm_reserved_bytes` is the memory the walk's budgets leave to
    the engine (:mod:`trl_dta.vllm.memory`)."""

    def __init__(self, *args, **kwargs):
        on_cpu = _cpu_engine()
        settings = cpu.cpu_engine_settings(self._vllm_cpu_engine_kwargs) if on_cpu else None
        with settings or contextlib.nullcontext():
            super().__init__(*args, **kwargs)
        generation = getattr(self, "vllm_generation", None)
        if on_cpu and generation is not None and self.vllm_mode == "colocate":
            cpu.use_cpu_weight_sync(generation)

    def _vllm_cpu_engine_kwargs(self) -> dict:
        """``vllm.LLM`` keywords for a colocated CPU engine (called while TRL builds it; override to change):
        the policy's dtype (TRL passes none, and vLLM would run a float32 model in bfloat16) and eager mode
        (no ``torch.compile`` at start-up)."""
        return {"dtype": cpu.engine_dtype(self.model), "enforce_eager": True}

    def vllm_reserved_bytes(self) -> int:
        """Bytes of this process's device a colocated vLLM engine claims back while the walks run or right
        after them (:func:`~trl_dta.vllm.memory.colocated_reserved_bytes`); 0 where none does."""
        return colocated_reserved_bytes(self.args, self.accelerator.device)

    def _generate(self, prompts):
        """TRL's generation, timed (``perf/generation_s``): a generation that raises is not timed, so that
        nothing done after it can replace the error on its way out."""
        started = time.perf_counter()
        result = super()._generate(prompts)
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["perf/generation_s"].append(time.perf_counter() - started)
        return result
