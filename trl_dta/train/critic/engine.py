"""The value model under DeepSpeed ZeRO-2 and ZeRO-3: a DeepSpeed engine of its own.

accelerate prepares one DeepSpeed engine, the Trainer's model's; the value model gets its own
(:func:`initialize`: ``deepspeed.initialize`` with the policy's ZeRO stage, precision and bucket settings,
the value model's optimizer and scheduler, its ``gradient_clipping``, one accumulation step: it is walked
once per optimizer step). Its walks find the engine (registered: :mod:`trl_dta.walk.distributed.deepspeed`):
ZeRO-3 gathers its parameters once per walk, and its gradient walk flushes its reductions once, at its end;
then :func:`step` runs ``engine.step()`` (clipping, the optimizer's and the scheduler's steps, zeroing) as
the policy's step does.

Checkpoints: the weights whole on the main process (``save_pretrained``: loadable with
``AutoModelForTokenClassification``; ZeRO-3 gathered), and the engine's own checkpoint (its optimizer's
partitions, per rank) for resuming (:func:`save_states`, :func:`load_states`).
"""

from __future__ import annotations

import copy
import os

import torch
from torch import nn

from ...walk.distributed.deepspeed import is_zero3, register_engine

_TAG = "value_model"  # the engine checkpoint's tag


def config_for(accelerator, max_grad_norm: float) -> dict:
    """The policy's DeepSpeed config (its "auto" values filled by the Trainer) for the value model's engine:
    no optimizer or scheduler of DeepSpeed's (the value model's own), one accumulation step, its clipping."""
    config = copy.deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config)
    for key in ("optimizer", "scheduler", "train_batch_size"):
        config.pop(key, None)
    micro = config.get("train_micro_batch_size_per_gpu")
    config["train_micro_batch_size_per_gpu"] = micro if isinstance(micro, int) else 1
    config["gradient_accumulation_steps"] = 1
    config["gradient_clipping"] = float(max_grad_norm or 0.0)
    config["zero_allow_untested_optimizer"] = True  # (the value model's optimizer is args.optim's, as TRL's)
    left = [k for k, v in config.items() if v == "auto"]
    if left:
        raise ValueError(
            f"the DeepSpeed config has 'auto' values for {left} when the value model's engine is built; "
            "set them in the config."
        )
    return config


def initialize(model: nn.Module, optimizer, scheduler, accelerator, max_grad_norm: float):
    """The value model's engine (module docstring); returns ``(engine, optimizer, scheduler)`` as DeepSpeed
    wraps them. ``engine.module`` is ``model``."""
    import deepspeed

    config = config_for(accelerator, max_grad_norm)
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config
    )
    register_engine(engine)
    return engine, optimizer, scheduler


def step(engine) -> float:
    """The value model's optimizer step on the gradients its walk flushed; their norm before clipping."""
    engine.set_gradient_accumulation_boundary(True)
    engine.step()
    norm = engine.get_global_grad_norm()
    return float(norm if norm is not None else 0.0)


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s whole state dict (ZeRO-3: gathered; a collective), on the CPU."""
    if not is_zero3(model):
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def save_states(engine, directory: str) -> None:
    """The engine's checkpoint in ``directory`` (every rank writes its partitions: a collective)."""
    engine.save_checkpoint(os.path.join(directory, "deepspeed"), tag=_TAG)


def load_states(engine, directory: str) -> None:
    """Restore :func:`save_states`'s checkpoint: weights, optimizer partitions, scheduler."""
    path = os.path.join(directory, "deepspeed")
    loaded, _ = engine.load_checkpoint(
        path, tag=_TAG, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    if loaded is None:
        raise FileNotFoundError(f"{path} holds no DeepSpeed checkpoint of the value model.")
