"""What a call of the executor refuses, before it walks: its arguments (a trie, a temperature), what a
value model cannot give (entropies, a temperature), and a gradient walk that could compute nothing (autograd
off, no trainable parameter) or not exactly (an MoE router loss with FSDP2's per-layer gather). The model
itself is checked when the executor is built (:mod:`trl_dta.walk.adapter.checks`,
:mod:`trl_dta.walk.adapter.probe`)."""

from __future__ import annotations

import math
import numbers

import torch

from ..trie import PrefixTrie
from .distributed.sharding import fsdp_units
from .errors import ArgumentTypeError, UnsupportedModelError
from .heads import HiddenStates


def check_walk_call(lm, trie, temperature, entropies: bool, head=None) -> None:
    """Any walk of ``lm`` (a :class:`~trl_dta.walk.adapter.model.CausalLM`): ``trie`` a
    :class:`~trl_dta.PrefixTrie`, ``temperature`` a finite number > 0; a value model, or a head of hidden
    states (``head``), walked at 1.0 without entropies."""
    if not isinstance(trie, PrefixTrie):
        raise ArgumentTypeError(
            f"expected a PrefixTrie (PrefixTrie.from_sequences(...)), got {type(trie).__name__}"
        )
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise ArgumentTypeError(f"temperature must be a number, got {type(temperature).__name__}")
    if not 0 < temperature < math.inf:  # NaN fails too
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    if isinstance(head, HiddenStates) and (entropies or temperature != 1.0):
        raise ValueError(
            "the walk scores hidden states (head=HiddenStates()): the loss applies the output head itself "
            "(TreeExecutor.head_logits, with its own temperature); walk with entropies=False and "
            "temperature=1.0."
        )
    if lm.value_head and (entropies or temperature != 1.0):
        raise ValueError(
            f"{lm.name} is a value model: its walk gives values, which have no "
            f"{'entropies' if entropies else 'temperature'}; walk it with entropies=False and "
            "temperature=1.0."
        )


def check_backward_call(lm, router_grad, gather_per_layer: bool) -> None:
    """A gradient walk of ``lm``: a ``router_grad`` only for an MoE model, and not with FSDP2's per-layer
    gather; autograd on; a trainable parameter."""
    if router_grad is not None and not lm.is_moe:
        raise ValueError(f"router_grad given, but {lm.name} has no MoE router.")
    if router_grad is not None and gather_per_layer and fsdp_units(lm.model):
        raise UnsupportedModelError(
            "gather_per_layer with an MoE router loss is not supported: a gradient that reaches a layer "
            "through its router logits alone would find the layer resharded. Use the default gather-once "
            "mode."
        )
    if torch.is_inference_mode_enabled() or not torch.is_grad_enabled():
        mode = "torch.inference_mode()" if torch.is_inference_mode_enabled() else "torch.no_grad()"
        raise RuntimeError(
            f"TreeExecutor.backward was called under {mode}: it computes gradients, so it needs autograd "
            "on. Call it outside that context (logprobs() is the no-gradient walk)."
        )
    if not any(p.requires_grad for p in lm.model.parameters()):
        raise ValueError(f"{lm.name} has no parameter that requires grad: backward has nothing to do.")


def check_loss(loss, index: int):
    """What a gradient walk's ``loss_fn`` returned for sequence ``index``: a scalar tensor (returned)."""
    if not isinstance(loss, torch.Tensor):
        raise ArgumentTypeError(
            f"loss_fn must return a scalar tensor, got {type(loss).__name__} for sequence {index}"
        )
    if loss.dim() != 0:
        raise ValueError(
            f"loss_fn must return a scalar tensor, got shape {tuple(loss.shape)} for sequence {index}"
        )
    return loss
