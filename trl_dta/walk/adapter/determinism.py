"""Randomness in a model: found, turned off, or refused.

The walk forwards a shared prefix once for all the sequences through it, so whatever a forward draws at
random (a dropout mask, a dropped layer, router jitter) is drawn once and shared by all of them, where a
dense pass draws it per sequence. Gradients would be silently wrong. Randomness comes in three shapes:

* ``nn.Dropout`` modules (and the other ``torch.nn`` dropout classes): TRL's ``disable_dropout`` zeroes them;
* probabilities held as plain numbers, on modules (OPT's ``self.dropout = config.dropout`` passed to
  ``nn.functional.dropout``, its ``layerdrop``, Mixtral's ``jitter_noise``) or read from the config at each
  forward (Falcon's ``config.attention_dropout``): TRL does not see them;
* anything else that draws random numbers in a forward (a custom noise layer).

:func:`stochastic_settings` lists the first two kinds where they are on; :func:`disable_randomness` turns
every setting it can find off (``TreePPOTrainer`` does, with ``disable_dropout=True``); and
:func:`check_deterministic` is the test by behaviour that catches the third kind: it forwards the same input
twice and requires the same output.
"""

from __future__ import annotations

import functools
import re

import torch
from torch import nn

from ...compare import relative_error
from ..distributed.sharding import gathered_for_check

# names of settings that hold a probability or a noise scale (a key of a config or an attribute of a module)
STOCHASTIC_NAME = re.compile(r"dropout|pdrop|layerdrop|jitter", re.IGNORECASE)
# config keys refused by the setting itself, not only by behaviour: rare randomness (a whole layer dropped, a
# small jitter), where two forwards can agree by chance, and attention dropout, which some models read from
# the config at each forward. (Other dropout keys often only size nn.Dropout modules, which TRL's
# disable_dropout zeroes while the config keeps its value, as GPT-2's resid_pdrop.)
_CONFIG_REFUSED = re.compile(r"layerdrop|jitter|^attention_dropout$", re.IGNORECASE)

# two forwards of the same input, in the same mode: deterministic kernels agree bit for bit; GPU atomics
# (scatter in MoE layers) may differ in the last bits. A dropout mask or jitter moves outputs by >= 1e-3.
DETERMINISM_TOLERANCE = {
    torch.float64: 1e-12,
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
}


def _is_rate(key: str, value) -> bool:
    """A setting named like a probability or noise scale, with a positive number."""
    if key.startswith("_") or not STOCHASTIC_NAME.search(key) or isinstance(value, bool):
        return False
    return isinstance(value, int | float) and value > 0


@functools.lru_cache(maxsize=1024)
def _named_like_rates(keys: tuple[str, ...]) -> tuple[str, ...]:
    """Of a module's attribute names, those named like a probability (a module class's names are looked at
    once: the walk checks every module at every call)."""
    return tuple(k for k in keys if not k.startswith("_") and STOCHASTIC_NAME.search(k))


def _configs(model: nn.Module) -> list:
    """The model's config and its sub-configs (text, vision, ...), each once."""
    out, todo = [], [getattr(model, "config", None)]
    while todo:
        config = todo.pop()
        if config is None or any(config is c for c in out) or not hasattr(config, "to_dict"):
            continue
        out.append(config)
        todo.extend(v for v in vars(config).values() if hasattr(v, "to_dict") and hasattr(v, "model_type"))
    return out


def config_rates(model: nn.Module, refused_only: bool = False) -> list[str]:
    """``config.key = value`` for each positive probability-like key of the model's configs."""
    found = []
    for config in _configs(model):
        prefix = "config" if config is getattr(model, "config", None) else f"config ({config.model_type})"
        for key, value in vars(config).items():
            if _is_rate(key, value) and (not refused_only or _CONFIG_REFUSED.search(key)):
                found.append(f"{prefix}.{key} = {value}")
    return found


def stochastic_settings(model: nn.Module, as_training: bool = False) -> list[str]:
    """Where ``model`` draws random numbers by its settings when it trains: dropout modules with ``p > 0``,
    module attributes named like a probability (``dropout``, ``layerdrop``, ``jitter_noise``, ...) with a
    positive value, on modules in train mode (``as_training``: on every module, as ``model.train()`` would
    put them), and the config's layer-drop, jitter and attention-dropout keys. Empty if none is on."""
    found = []
    for name, module in model.named_modules():
        if not (module.training or as_training):  # (a submodule the caller put in eval mode draws nothing)
            continue
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            found.append(f"{name or 'model'} ({type(module).__name__}, p={module.p})")
        settings = vars(module)
        for key in _named_like_rates(tuple(settings)):
            if _is_rate(key, settings[key]):
                found.append(f"{name or 'model'}.{key} = {settings[key]}")
    return found + config_rates(model, refused_only=True)


def disable_randomness(model: nn.Module) -> list[str]:
    """Turn off every randomness setting of ``model`` that :func:`stochastic_settings` finds, and every
    probability-like key of its configs (models that read ``config.attention_dropout`` at each forward): set
    to 0. Returns what was changed (``name = old value``). The configs are changed in place, so a saved
    checkpoint has these keys at 0."""
    changed = []
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            changed.append(f"{name}.p = {module.p}")
            module.p = 0.0
        for key, value in list(vars(module).items()):
            if _is_rate(key, value):
                changed.append(f"{name}.{key} = {value}")
                setattr(module, key, type(value)(0))
    for config in _configs(model):
        for key, value in list(vars(config).items()):
            if _is_rate(key, value):
                changed.append(f"config ({config.model_type}).{key} = {value}")
                setattr(config, key, type(value)(0))
    return changed


def _fork_rng(device: torch.device):
    """Draws inside leave the global random state (and so the trainer's sampling) as they were."""
    devices = [device] if device.type not in ("cpu", "meta") else []
    device_type = device.type if device.type not in ("cpu", "meta") else "cuda"
    return torch.random.fork_rng(devices=devices, device_type=device_type)


@torch.no_grad()
def forward_differs(model: nn.Module, base: nn.Module, device: torch.device) -> float | None:
    """Forward the same 13 tokens twice through ``base`` (the ``transformers`` model under ``model``) in the
    current mode; the relative difference of the logits if it is above the dtype's tolerance, else None."""
    embeddings = base.get_input_embeddings()
    if embeddings is not None:  # (a ZeRO-3 parameter is partitioned here: its full shape is ds_shape)
        vocab = getattr(embeddings.weight, "ds_shape", embeddings.weight.shape)[0]
    else:
        vocab = base.config.get_text_config().vocab_size
    ids = ((torch.arange(13, device=device) * 7919 + 11) % vocab)[None]
    with _fork_rng(device), gathered_for_check(model):
        # the class's own forward: accelerate and TRL patch the instance's (autocast, fused LM head)
        first, second = (type(base).forward(base, input_ids=ids, use_cache=False).logits for _ in range(2))
    tolerance = DETERMINISM_TOLERANCE.get(first.dtype, 1.6e-2)
    err = relative_error(second.double(), first.double())
    return err if not err <= tolerance else None


def check_deterministic(model: nn.Module, base: nn.Module, device: torch.device, name: str, exc=ValueError):
    """Raise ``exc`` if two forwards of the same input differ in ``model``'s current mode, naming the settings
    that may cause it."""
    err = forward_differs(model, base, device)
    if err is None:
        return
    mode = "train" if model.training else "eval"
    causes = (stochastic_settings(model) if model.training else []) + config_rates(model)
    hint = (
        f"settings that draw random numbers: {', '.join(dict.fromkeys(causes))}"
        if causes
        else "no dropout or noise setting was found, so some layer draws random numbers in its forward"
    )
    raise exc(
        f"{name} is not deterministic in {mode} mode: two forwards of the same input differ by {err:.2e} "
        f"({hint}). A shared prefix would share one random draw among all the sequences through it, so the "
        "tree walk would not equal the dense computation. Set these to 0 (TreePPOTrainer does with "
        "disable_dropout=True) or put the model in eval mode."
    )
