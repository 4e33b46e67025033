"""The walk on a model sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``; accelerate's
``fsdp_version: 2``).

FSDP2 gathers a unit's parameters before each of its forward and backward calls and reduce-scatters its
gradients after each backward. The walk makes many calls per step (a push, a leaf batch, a pop each), and
each rank walks its own trie, so left alone FSDP would communicate per call and ranks would make different
numbers of collectives; and the walk calls the decoder and the LM head, not the root module whose hooks
gather the embeddings and the LM head. :func:`gathered` takes over for one walk, in one of two modes.

**Gather once** (default):

* every unit is gathered before the walk (``unshard``) and stays gathered through it
  (``reshard_after_forward`` and ``reshard_after_backward`` off); gradients accumulate unsharded and
  unreduced on each rank (``set_requires_gradient_sync(False)``), so no call of the walk communicates;
* after a gradient walk, one zero-weight backward of a two-token input through the model, with gradient
  sync back on, makes FSDP2 reduce-scatter every unit's accumulated gradient once (plus zeros), with its
  own averaging over ranks and its own mixed-precision reduce dtype, into the sharded ``.grad`` the
  optimizer steps: the gradient DDP would give;
* every unit is resharded and FSDP's flags are restored.

Per unit and per walk: one all-gather, and (gradient walks) one reduce-scatter, whatever the trie. While
walking, a rank holds every parameter gathered and an unsharded gradient accumulator.

Before anything is reduced, the ranks agree on how their walks ended
(:func:`~trl_dta.walk.distributed.ranks.agree_on_outcome`, one
all-reduce of a flag per walk, across ranks only): if one rank's walk failed, no rank reduces, the
unreduced gradients are dropped on every rank, and every rank raises, the others
:class:`~trl_dta.walk.errors.PeerOutOfMemoryError` where it ran out of memory, so that out-of-memory
recovery (:mod:`trl_dta.walk.memory.recovery`) walks again on every rank or on none.

**Per layer** (``per_layer=True``, for models whose gathered parameters and accumulator do not fit): the
*root's set* (the root unit, and the units accelerate makes of the embeddings, final norm and LM head: every
unit outside the decoder layers) stays gathered and accumulates its gradients unreduced, as in the
gather-once mode, and is reduce-scattered once at the walk's end; each decoder layer is gathered for each
forward and backward call through it and resharded after, and its gradients are reduce-scattered after each
backward call (sums of averages: exact). Those collectives run inside the calls, so
:class:`~trl_dta.walk.distributed.lockstep.Lockstep` keeps every rank's calls in step (dummy calls where a
rank's step has none) and gathers a layer whose gradients arrive through its K/V or states. Per layer: one
all-gather per forward and per backward call (dummies included), and one reduce-scatter per backward call; per
unit of the root's set: one all-gather and one reduce-scatter per walk.

A model sharded as one unit (TRL's ``prepare_fsdp`` shards the reference model so) has no layer to gather
on its own: its no-gradient walks gather it whole in either mode, as its own forward does in stock TRL.

Parameters no rank used in a walk (MoE experts no token picked) are reduce-scattered as zeros, so ranks
never disagree on what to reduce; their ``.grad`` is zero, not None. A walk inside a walk of the same model
(a loss that walks another trie) runs inside the outer one's gather (gather-once mode only), and its
gradients are reduced with the outer walk's.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..errors import UnsupportedModelError
from . import deepspeed as zero
from .lockstep import Lockstep
from .ranks import agree_on_outcome, world_size

try:  # torch >= 2.6
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover - no FSDP2: nothing is sharded by it
    FSDPModule = None

_ACTIVE: dict[int, tuple[bool, bool]] = {}  # root unit of each walk now running -> (per layer, grad)


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The FSDP2 units of ``model`` (modules ``fully_shard`` was applied to), outermost first; [] if none."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)] if FSDPModule else []


def is_fsdp1(model: nn.Module) -> bool:
    """Whether ``model`` is wrapped by the first FSDP (``FullyShardedDataParallel``): not supported."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def _groups(unit):
    state = unit._get_fsdp_state()  # FSDP2 keeps its flags per parameter group (one group in older torch)
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        groups = [g for g in [getattr(state, "_fsdp_param_group", None)] if g is not None]
    return groups


def _flags(unit) -> list[tuple]:
    return [
        (
            g.post_forward_mesh_info,
            g.reshard_after_backward,
            g.reduce_grads,
            g.all_reduce_grads,
            getattr(g, "reduce_scatter_unused_params", None),
        )
        for g in _groups(unit)
    ]


def _restore(unit, flags: list[tuple]) -> None:
    for g, (mesh, after_backward, reduce, all_reduce, unused) in zip(_groups(unit), flags, strict=True):
        g.post_forward_mesh_info, g.reshard_after_backward = mesh, after_backward
        g.reduce_grads, g.all_reduce_grads = reduce, all_reduce
        if unused is not None:
            g.reduce_scatter_unused_params = unused


def _decoder_layers(decoder: nn.Module, num_layers: int) -> list[nn.Module]:
    for m in decoder.modules():
        if isinstance(m, nn.ModuleList) and len(m) == num_layers:
            return list(m)
    return []


def _layer_units(decoder: nn.Module, num_layers: int) -> list:
    """The FSDP2 unit of each decoder layer (the layer, or the first unit inside it; None if it has none)."""
    layers = _decoder_layers(decoder, num_layers)
    return [next((u for u in layer.modules() if isinstance(u, FSDPModule)), None) for layer in layers]


def _check_per_layer(units: list, layers: list, decoder_layers: list) -> None:
    """The per-layer mode's lock-step gathers one unit per decoder layer per call; units outside the layers
    (the root, and the embeddings, final norm or LM head that accelerate shards on their own) are the root's
    set, gathered through the walk. A unit nested inside a layer's unit is not supported."""
    if not any(layers):
        raise UnsupportedModelError(
            "gather_per_layer needs the decoder layers sharded as FSDP2 units of their own "
            "(fully_shard per layer, as accelerate's transformer-based wrap does)."
        )
    inside = {id(m) for layer in decoder_layers for m in layer.modules()}
    nested = [type(u).__name__ for u in units if u not in layers and id(u) in inside]
    if nested:
        raise UnsupportedModelError(
            f"gather_per_layer supports one FSDP2 unit per decoder layer; this model also has units {nested} "
            "inside its layers. Shard each layer as one unit, or use the default gather-once mode."
        )
    if not hasattr(units[0], "set_reduce_scatter_unused_params") and world_size() > 1:
        raise UnsupportedModelError(
            "gather_per_layer across ranks needs a torch with FSDP2's "
            "set_reduce_scatter_unused_params (2.10 or later)."
        )


@contextlib.contextmanager
def gathered(model: nn.Module, grad: bool, per_layer: bool = False, decoder=None, num_layers: int = 0):
    """Run one walk of ``model`` with its FSDP2 units gathered once (module docstring), or with the decoder
    layers gathered per call (``per_layer``; ``decoder`` and its ``num_layers`` locate them); ``grad``:
    reduce the gradients. Yields the walk's :class:`~trl_dta.walk.distributed.lockstep.Lockstep`. A model
    without FSDP2 units passes through."""
    units = fsdp_units(model)
    outer = _ACTIVE.get(id(units[0])) if units else None  # (per_layer, grad) of a walk running now
    if outer is not None and (outer[0] or (grad and not outer[1])):
        raise RuntimeError(
            "a walk inside another walk of the same sharded model (a loss_fn that walks another trie) must "
            "not compute gradients the outer walk does not reduce, nor run inside a gather_per_layer walk "
            "(its calls would be out of the ranks' lock-step)."
        )
    if not units or outer is not None:
        yield Lockstep()
        return
    top = units[0]
    # FSDP2 makes the first unit to run forward the root; the walk forwards decoder layers directly, so the
    # real root must claim it first
    top._get_fsdp_state()._lazy_init()
    layers = _layer_units(decoder, num_layers) if per_layer else []
    if per_layer and not grad and not any(layers):  # sharded as one unit, as TRL shards its reference model:
        per_layer = False  # gathered whole for a no-gradient walk, as its own forward would gather it
    if per_layer:
        _check_per_layer(units, layers, _decoder_layers(decoder, num_layers))
    saved = [(u, _flags(u), list(u._get_fsdp_state()._states_to_backward_prefetch)) for u in units]
    _ACTIVE[id(top)] = (per_layer, grad)
    failed = True
    try:
        for u in units:
            per_call = u in layers
            u.set_reshard_after_forward(per_call, recurse=False)
            u.set_reshard_after_backward(per_call, recurse=False)
            u.set_requires_gradient_sync(per_call, recurse=False)  # (the root's set: reduced at the end)
            if hasattr(u, "set_reduce_scatter_unused_params"):
                u.set_reduce_scatter_unused_params(True, recurse=False)
            if per_layer:  # no implicit backward prefetch: its target depends on each rank's own call history
                u.set_modules_to_backward_prefetch([u])  # (itself: a no-op, it is gathered already)
        for u in units:
            if u not in layers:  # gathered through the walk
                u.unshard()
        lockstep = Lockstep()
        if per_layer:
            device = next(p.device for p in model.parameters())
            roots = [u for u in units if u not in layers]
            lockstep = Lockstep(decoder, layers, device, pad=world_size() > 1, roots=roots)
        agree = not per_layer and world_size() > 1  # (per layer: the lock-step's collectives cannot wait)
        try:
            yield lockstep
        except BaseException as e:
            if agree:
                agree_on_outcome(model, e)  # (raises)
            raise
        if agree:
            agree_on_outcome(model, None)
        if grad and not per_layer:
            _reduce(units, model)
        failed = False
    finally:
        _ACTIVE.pop(id(top), None)
        for u, flags, prefetch in saved:
            _restore(u, flags)
            u._get_fsdp_state()._states_to_backward_prefetch = prefetch
        if failed:  # a failed walk's unreduced gradients are dropped
            _drop_unreduced(units)
            if hasattr(top, "reset_iter_state"):
                top.reset_iter_state()
        for u in units:
            u.reshard()


def agree_on(check, trie, model: nn.Module) -> None:
    """Run ``check(trie)``; on a model sharded across ranks (FSDP2, DeepSpeed), every rank raises if any
    rank's check fails (the others would otherwise wait for it in the walk's first collective)."""
    try:
        check(trie)
        error = None
    except Exception as e:  # noqa: BLE001 - re-raised below, on this rank and the others
        error = e
    if (fsdp_units(model) or zero.is_deepspeed(model)) and world_size() > 1:
        agree_on_outcome(model, error, "refused its sequences (its error says why); no rank walks")
    if error is not None:
        raise error


def _drop_unreduced(units: list[nn.Module]) -> None:
    """The unsharded gradients FSDP2 accumulated for a walk that failed before reducing them (FSDP2's
    ``reset_iter_state`` leaves them on the unsharded parameters, where the next walk would add to them)."""
    for u in units:
        for group in _groups(u):
            for param in group.fsdp_params:
                if hasattr(param, "_unsharded_param"):
                    param._unsharded_param.grad = None
                param.unsharded_accumulated_grad = None


def gathered_for_check(model: nn.Module):
    """For a check's own forwards (the probe, the determinism check): the model gathered once, or as the walk
    running now has it (its preamble, the same on every rank). DeepSpeed:
    :mod:`trl_dta.walk.distributed.deepspeed`."""
    if zero.is_deepspeed(model):
        return zero.gathered_for_check(model)
    units = fsdp_units(model)
    if units and id(units[0]) in _ACTIVE:
        return contextlib.nullcontext()
    return gathered(model, grad=False)


def _reduce(units: list[nn.Module], model: nn.Module) -> None:
    """One zero backward through ``model`` with gradient sync on: FSDP2 reduce-scatters each unit's
    accumulated gradient (plus zeros) into its sharded ``.grad``. Nothing reshards in this forward, so
    nothing is gathered again. On a torch without ``set_reduce_scatter_unused_params``, parameters this rank
    did not use get a zero gradient first, so every rank reduces the same tensors."""
    for u in units:
        u.set_requires_gradient_sync(True, recurse=False)
    if not hasattr(units[0], "set_reduce_scatter_unused_params"):
        for p in model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    device = next(p.device for p in model.parameters())
    with torch.enable_grad():
        logits = model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=device), use_cache=False).logits
        torch.autograd.backward(logits, torch.zeros_like(logits))  # (not 0 * logits: inf would give NaN)
