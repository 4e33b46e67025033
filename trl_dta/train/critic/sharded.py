"""The value model sharded as the policy is, under accelerate's FSDP2 (``fsdp_version: 2``).

accelerate prepares the Trainer's one model; the value model is a second one, so :func:`shard` prepares it
the same way, with accelerate's own ``fsdp2_prepare_model`` and the same plugin (its units: the embeddings,
each decoder layer, the norm and the head; ``reshard_after_forward``, mixed precision, CPU offload). It runs
when the Trainer builds its optimizers (the policy is prepared by then), before any walk of the value model:
its walks then gather its parameters and reduce its gradients as the policy's do, once per step or per
layer (:mod:`trl_dta.walk.distributed.sharding`), and its optimizer holds the local shards.

Checkpoints are whole, as the Trainer saves the policy's with ``FULL_STATE_DICT``: :func:`full_state` and
:func:`full_optimizer_state` gather them to the main process (every rank calls them: collectives), which
writes them (``save_pretrained``: a user loads the value model with ``AutoModelForTokenClassification``, or
its adapter with PEFT); on resume every rank reads the files and keeps its shards (:func:`load_state`,
:func:`load_optimizer_state`).
"""

from __future__ import annotations

import torch
from torch import nn


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` is sharded by FSDP2 (``fully_shard``)."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def shard(model: nn.Module, accelerator) -> nn.Module:
    """``model`` sharded as accelerate's FSDP2 shards the Trainer's model (module docstring), in place."""
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    return fsdp2_prepare_model(accelerator, model)


def _options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s whole state dict on the main process, on the CPU (other ranks: empty). A collective."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(cpu_offload=True))


def full_optimizer_state(model: nn.Module, optimizer) -> dict:
    """``optimizer``'s whole state dict on the main process (other ranks: empty). A collective."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=_options(cpu_offload=True))


def load_state(model: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """Whole tensors ``save_pretrained`` wrote (a PEFT model's adapter: its names without the adapter's)
    into ``model``'s shards; every name must be one of the model's."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    adapter = getattr(model, "active_adapter", None)
    names = {k.replace(f".{adapter}.", ".") if adapter else k: k for k in model.state_dict()}
    unknown = sorted(set(saved) - set(names))
    if unknown:
        raise KeyError(f"the value model's checkpoint holds tensors the model has not: {unknown[:3]}")
    state = {names[k]: v for k, v in saved.items()}
    set_model_state_dict(model, state, options=_options(strict=False))


def load_optimizer_state(model: nn.Module, optimizer, saved: dict) -> None:
    """A whole optimizer state dict (:func:`full_optimizer_state`'s) into ``optimizer``'s shards."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, saved, options=_options())
