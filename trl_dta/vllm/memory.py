"""Memory next to a colocated vLLM engine (TRL's ``vllm_mode="colocate"``) on a GPU.

The engine takes ``vllm_gpu_memory_utilization`` of the device's memory for its weights, activations and KV
cache. Awake all the time, it holds that memory while the trainer trains, and the walk's
``memory_budget="auto"`` (:class:`~trl_dta.walk.memory.budgets.Budgets`) measures it as used. With
``vllm_enable_sleep_mode`` it releases it after generating (sleep level 2: weights and KV cache) and takes it
back before the next generation: measured at the first walk it looks free, though the engine claims it
right after the step. :func:`colocated_reserved_bytes` is that share, which ``"auto"`` then leaves alone
(``Budgets.reserve``), so the walk never plans with memory vLLM needs on waking. What the walk freed stays
in PyTorch's cache until TRL empties the cache, which it does before waking the engine
(``VLLMGeneration.sync_weights``); within the budget, that cache never holds vLLM's share.
"""

from __future__ import annotations

import torch


def colocated_reserved_bytes(args, device: torch.device, total_memory: int | None = None) -> int:
    """Bytes a colocated vLLM engine claims back while the walks run or right after them: on a CUDA device
    with sleep mode, ``vllm_gpu_memory_utilization`` x the device's memory (``total_memory``, default the
    device's); 0 otherwise (no engine, a server, an engine awake all the time, a CPU)."""
    colocated = getattr(args, "use_vllm", False) and getattr(args, "vllm_mode", None) == "colocate"
    if not (colocated and getattr(args, "vllm_enable_sleep_mode", False)) or device.type != "cuda":
        return 0
    if total_memory is None:
        total_memory = torch.cuda.get_device_properties(device).total_memory
    return int(args.vllm_gpu_memory_utilization * total_memory)
