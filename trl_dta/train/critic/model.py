"""A value model's module (``value_model=`` of both PPO trainers): loading it (:func:`load_value_model`),
building one from the policy's weights (:func:`value_model_from`), loading its saved weights back
(:func:`load_weights`). Its training beside the policy: :mod:`trl_dta.train.critic.value_model`.

Policy and critic are two models with two optimizers, as AReaL keeps them (one engine each), not one module
with one optimizer as TRL's former ``PPOTrainer`` wrapped them: each is walked on the step's trie by its own
executor (its own budgets), its gradients are clipped on their own, and a critic can be larger or smaller
than the policy, or LoRA where the policy is not.

A value model is a ``*ForTokenClassification`` with ``num_labels=1`` (a d -> 1 head on every position), or a
PEFT model of one; a ``*ForSequenceClassification`` with a d -> 1 head walks the same way (its head applied
per token). Value ``t`` of a sequence is the head at position ``t``: the state before token ``t + 1``.
"""

from __future__ import annotations

import contextlib
import json
import os

import torch
from torch import nn

from ...walk.adapter.model import output_head

VALUE_MODEL_DIR = "value_model"  # beside the policy's files, in checkpoints and in output_dir


def load_value_model(name: str, **kwargs) -> nn.Module:
    """``*ForTokenClassification.from_pretrained(name, num_labels=1, **kwargs)``; a head the checkpoint lacks
    (a causal LM's checkpoint: the warm start from the policy's weights) starts at zero, so every rank holds
    the same values and the first values are 0 (no random bias in the first advantages)."""
    from transformers import AutoModelForTokenClassification

    dtype = kwargs.get("dtype")
    if isinstance(dtype, str) and dtype in ("bfloat16", "float16", "float32"):
        kwargs["dtype"] = getattr(torch, dtype)
    model, info = AutoModelForTokenClassification.from_pretrained(
        name, num_labels=1, output_loading_info=True, **kwargs
    )
    head, _ = output_head(model)
    names = [n for n, p in model.named_parameters() if any(p is q for q in head.parameters())]
    if any(n in info["missing_keys"] for n in names):
        _zero_head(model)
    return model


def value_model_from(policy: str | nn.Module, **kwargs) -> nn.Module:
    """A value model warm-started from a causal LM: its decoder's weights, a zero d -> 1 head.

    Example::

        from trl_dta import value_model_from

        trainer = TreePPOTrainer(model=policy, value_model=value_model_from(policy), ...)

    Args:
        policy: a Hub id or a path (then ``from_pretrained`` with ``kwargs``, as :func:`load_value_model`;
            passing the id as ``value_model=`` does the same), or a ``transformers`` causal LM (its decoder's
            weights copied, same dtype and device; ``kwargs`` go to ``from_config``). Under a DeepSpeed ZeRO-3
            config the two models' parameters are partitioned (``zero.Init``): they are gathered to copy.
    """
    if isinstance(policy, str):
        return load_value_model(policy, **kwargs)
    from transformers import AutoModelForTokenClassification

    if hasattr(policy, "get_base_model"):
        raise ValueError("value_model_from: pass the causal LM, not a PEFT model (merge its adapter first).")
    config = type(policy.config).from_dict(policy.config.to_dict())
    config.num_labels = 1
    kwargs.setdefault("attn_implementation", policy.config._attn_implementation)
    critic = AutoModelForTokenClassification.from_config(config, **kwargs)
    if not _partitioned(critic.parameters()):  # (ZeRO-3's zero.Init placed its partitions already)
        critic.to(dtype=policy.dtype, device=policy.device)
    with _whole(policy.base_model.parameters()):
        state = {k: v.detach().clone() for k, v in policy.base_model.state_dict().items()}
    with _whole(critic.base_model.parameters(), write=True):
        critic.base_model.load_state_dict(state)
    _zero_head(critic)
    return critic


def _partitioned(params) -> bool:
    """Whether parameters are partitioned by DeepSpeed ZeRO-3 (built under ``zero.Init``: a model loaded
    after a ZeRO-3 config was created)."""
    return any(hasattr(p, "ds_id") for p in params)


def _whole(params, write: bool = False):
    """Within: ``params`` whole (ZeRO-3: gathered; ``write``: what the main process writes is kept)."""
    params = list(params)
    if not _partitioned(params):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=0 if write else None)


def _zero_head(model: nn.Module) -> None:
    head, _ = output_head(model)
    with torch.no_grad(), _whole(head.parameters(), write=True):
        for p in head.parameters():
            p.zero_()


def saved_weights(directory: str, model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors ``save_pretrained`` wrote in ``directory`` for ``model`` (a PEFT model: its adapter's),
    whole, on the CPU."""
    from safetensors.torch import load_file

    if hasattr(model, "get_base_model"):
        return load_file(os.path.join(directory, "adapter_model.safetensors"))
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return {k: v for name in files for k, v in load_file(os.path.join(directory, name)).items()}
    return load_file(os.path.join(directory, "model.safetensors"))


def load_weights(model: nn.Module, directory: str) -> None:
    """The weights ``save_pretrained`` wrote in ``directory``, into ``model`` (a PEFT model: its adapter)."""
    from safetensors.torch import load_file

    if hasattr(model, "get_base_model"):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(os.path.join(directory, "adapter_model.safetensors")))
        return
    if os.path.exists(os.path.join(directory, "model.safetensors.index.json")):
        from transformers.modeling_utils import load_sharded_checkpoint

        load_sharded_checkpoint(model, directory, strict=True)
        return
    model.load_state_dict(load_file(os.path.join(directory, "model.safetensors")), strict=True)
