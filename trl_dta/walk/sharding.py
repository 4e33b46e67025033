"""The walk on a model sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``; accelerate's
``fsdp_version: 2``): one parameter gather and one gradient reduction per walk.

FSDP2 gathers a unit's parameters before each of its forward and backward calls and reduce-scatters its
gradients after each backward. The walk makes many calls per step (a push, a leaf batch, a pop each), so
left alone FSDP would gather and reduce per call; each rank walks its own trie, so ranks would make
different numbers of collectives; and the walk calls the decoder and the LM head, not the root module whose
hooks gather the embeddings and the LM head. :func:`gathered` takes over for one walk:

* every unit is gathered before the walk (``unshard``) and stays gathered through it
  (``reshard_after_forward`` and ``reshard_after_backward`` off); gradients accumulate unsharded and
  unreduced on each rank (``set_requires_gradient_sync(False)``), so no call of the walk communicates;
* after a gradient walk, one zero-weight backward of a two-token input through the model, with gradient
  sync back on, makes FSDP2 reduce-scatter every unit's accumulated gradient once (plus zeros), with its
  own averaging over ranks and its own mixed-precision reduce dtype, into the sharded ``.grad`` the
  optimizer steps: the gradient DDP would give;
* every unit is resharded and FSDP's flags are restored.

Per unit and per walk: one all-gather, and (gradient walks) one reduce-scatter, whatever the trie. Every
rank makes them in the same order, so ranks may walk different tries. Parameters no rank used in the walk
(MoE experts no token picked) are reduce-scattered as zeros, so ranks never disagree on what to reduce;
their ``.grad`` is zero, not None. A walk inside a walk of the same model (a loss that walks another trie)
runs inside the outer one's gather, and its gradients are reduced with the outer walk's.

Memory: while walking, a rank holds every parameter gathered (in FSDP's ``param_dtype``) and an unsharded
gradient accumulator (in its ``reduce_dtype``); the README's memory model gives the sizes. FSDP's own
per-layer schedule is not used: its collectives run inside each call, and the walk's calls differ from rank
to rank; it also sends gradients into K/V in the middle of a layer, where FSDP2's pre-backward hook (on
layer outputs) would not gather the layer again.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

try:  # torch >= 2.6
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover - no FSDP2: nothing is sharded by it
    FSDPModule = None

_ACTIVE: set[int] = set()  # root units gathered by a walk now running


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The FSDP2 units of ``model`` (modules ``fully_shard`` was applied to), outermost first; [] if none."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)] if FSDPModule else []


def is_fsdp1(model: nn.Module) -> bool:
    """Whether ``model`` is wrapped by the first FSDP (``FullyShardedDataParallel``): not supported."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def _groups(unit):
    return unit._get_fsdp_state()._fsdp_param_groups  # FSDP2 keeps its flags per parameter group


def _flags(unit) -> list[tuple]:
    return [(g.post_forward_mesh_info, g.reshard_after_backward, g.reduce_grads, g.all_reduce_grads,
             getattr(g, "reduce_scatter_unused_params", None)) for g in _groups(unit)]  # fmt: skip


def _restore(unit, flags: list[tuple]) -> None:
    for g, (mesh, after_backward, reduce, all_reduce, unused) in zip(_groups(unit), flags, strict=True):
        g.post_forward_mesh_info, g.reshard_after_backward = mesh, after_backward
        g.reduce_grads, g.all_reduce_grads = reduce, all_reduce
        if unused is not None:
            g.reduce_scatter_unused_params = unused


@contextlib.contextmanager
def gathered(model: nn.Module, grad: bool):
    """Run one walk of ``model`` with its FSDP2 units gathered once (module docstring); ``grad``: reduce the
    gradients once at the end. A model without FSDP2 units passes through."""
    units = fsdp_units(model)
    if not units or id(units[0]) in _ACTIVE:
        yield
        return
    top = units[0]
    # FSDP2 makes the first unit to run forward the root; the walk forwards decoder layers directly, so the
    # real root must claim it first
    top._get_fsdp_state()._lazy_init()
    saved = [(u, _flags(u)) for u in units]
    for u in units:
        u.set_reshard_after_forward(False, recurse=False)
        u.set_reshard_after_backward(False, recurse=False)
        u.set_requires_gradient_sync(False, recurse=False)
        if hasattr(u, "set_reduce_scatter_unused_params"):  # (older torch: ranks must use the same params)
            u.set_reduce_scatter_unused_params(True, recurse=False)
    for u in units:
        u.unshard()
    _ACTIVE.add(id(top))
    try:
        yield
        if grad:
            _reduce(units, model)
    finally:
        _ACTIVE.discard(id(top))
        for u, flags in saved:
            _restore(u, flags)
        for u in units:
            u.reshard()


def _reduce(units: list[nn.Module], model: nn.Module) -> None:
    """One zero-weight backward through ``model`` with gradient sync on: FSDP2 reduce-scatters each unit's
    accumulated gradient (plus zeros) into its sharded ``.grad``. Nothing reshards in this forward, so
    nothing is gathered again."""
    for u in units:
        u.set_requires_gradient_sync(True, recurse=False)
    device = next(p.device for p in model.parameters())
    with torch.enable_grad():
        out = model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=device), use_cache=False)
        (out.logits.float().sum() * 0.0).backward()
