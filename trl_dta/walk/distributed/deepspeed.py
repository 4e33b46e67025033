"""The walk on a model trained with DeepSpeed ZeRO-2 or ZeRO-3 (accelerate's ``distributed_type: DEEPSPEED``):
the counterpart of :mod:`trl_dta.walk.distributed.sharding`'s gather-once mode.

DeepSpeed reduces gradients from hooks on the parameters, as each backward produces them, and ZeRO-3 gathers
a module's parameters from hooks on the modules, for each forward and backward call. The walk makes many
calls per step and each rank walks its own trie, so left alone DeepSpeed would communicate per call and the
ranks' collectives would not match (``engine.no_sync()`` is refused under ZeRO-2/3, and
``set_gradient_accumulation_boundary(False)`` still reduces per backward). :func:`gathered` takes over for
one walk:

* **Reductions: one flush per optimizer step.** Gradient walks run inside
  ``engine.coalesce_grad_reduction()``: every backward call leaves its gradients on the parameters, and the
  block's exit reduces them once (one collective per bucket, with DeepSpeed's averaging over ranks) into
  what ``engine.step()`` applies. Two such blocks before one ``engine.step()`` would not add up (the second
  flush overwrites the first), so a trainer holds one :func:`step_reduction` open across all the walks of
  an optimizer step and closes it just before ``engine.step()``; a gradient walk outside one opens its own,
  and a second one before ``engine.step()`` is refused.
* **ZeRO-3 parameters: gathered once per walk.** The engine's module hooks are suspended for the walk and
  every parameter is gathered once (``deepspeed.zero.GatheredParameters``), then released and the hooks put
  back; no call of the walk communicates. (With the hooks left on, DeepSpeed would gather per module and
  call, and refuse to release parameters it still counts as in use.)
* **No-gradient walks** (old-policy and reference log-probs) gather once (ZeRO-3) and reduce nothing.

As under FSDP2: parameters a rank did not use in a gradient walk (MoE experts no token picked) get zero
gradients, so every rank reduces the same tensors; a walk inside a walk of the same model runs inside the
outer one's gather (a gradient walk inside a no-gradient one is refused); across ranks every walk ends with
the ranks agreeing on its outcome (:func:`~trl_dta.walk.distributed.ranks.agree_on_outcome`: if one rank ran
out of memory, every rank raises and :mod:`trl_dta.walk.memory.recovery` walks again on all of them); a failed
walk restores the hooks, releases the parameters and drops its gradients, and the trainer makes a rank with
nothing to walk take part in the others' collectives.

Per walk and rank: ZeRO-3, one all-gather per parameter tensor, all issued by one ``GatheredParameters``
(coalesced into one launch where the backend supports it; one call each on gloo), and nothing else; ZeRO-2,
nothing. Per optimizer step: one flush, one reduction (ZeRO-2) or reduce-scatter (ZeRO-3) per gradient
bucket (``reduce_bucket_size``). (Besides, across ranks every walk makes two all-reduces of one number: the
sequence check before it and the outcome after it.)

Not supported (refused with a reason): ZeRO stages 0 and 1 (untested), fp16 (loss scaling), parameter or
optimizer offload (untested), and ``gather_per_layer`` under ZeRO-3 (DeepSpeed has no public
per-module gather/release that the per-layer lock-step could drive). The walk knows the engine from
:func:`register_engine` (the trainer registers it; a user of :class:`~trl_dta.TreeExecutor` under DeepSpeed
calls it with ``deepspeed.initialize``'s engine before walking).
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn

from ..errors import UnsupportedModelError
from .lockstep import Lockstep
from .ranks import agree_on_outcome, world_size

_ENGINES: dict[int, weakref.ref] = {}  # id(engine.module) -> the engine
_ACTIVE: dict[int, bool] = {}  # id(module) of each walk now running -> whether it computes gradients
_OPEN: dict[int, object] = {}  # id(engine) -> its open step_reduction
_FLUSHED: dict[int, int] = {}  # id(engine) -> engine.global_steps at its last flush


def register_engine(engine) -> None:
    """Let walks of ``engine.module`` (a ``deepspeed.DeepSpeedEngine``'s model) find the engine."""
    _ENGINES[id(engine.module)] = weakref.ref(engine)


def engine_of(model: nn.Module):
    """The registered DeepSpeed engine whose module is ``model``, or None."""
    ref = _ENGINES.get(id(model))
    engine = ref() if ref is not None else None
    return engine if engine is not None and engine.module is model else None


def is_zero3(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are partitioned by ZeRO-3 (``deepspeed.zero.Init``, a ZeRO-3 engine)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def is_deepspeed(model: nn.Module) -> bool:
    """Whether walks of ``model`` go through this module: a registered engine's model, ZeRO-3 parameters."""
    return engine_of(model) is not None or is_zero3(model)


def check_engine(engine) -> None:
    """Refuse the DeepSpeed settings a gradient walk does not support (module docstring)."""
    stage = int(engine.zero_optimization_stage())
    if stage not in (2, 3):
        raise UnsupportedModelError(
            f"the tree walk under DeepSpeed supports ZeRO stages 2 and 3, not {stage} (set "
            "zero_optimization.stage to 2 or 3, as in recipes/accelerate_configs/deepspeed_zero2.yaml)."
        )
    if engine.fp16_enabled():
        raise UnsupportedModelError(
            "DeepSpeed fp16 (dynamic loss scaling) is not supported by the tree walk; use bf16."
        )
    for kind, config in (
        ("param", engine.zero_offload_param()),
        ("optimizer", engine.zero_offload_optimizer()),
    ):
        device = str(getattr(getattr(config, "device", None), "value", getattr(config, "device", "none")))
        if config is not None and device not in ("none", "None"):
            raise UnsupportedModelError(
                f"DeepSpeed offload_{kind} (device {device}) is not supported by the tree walk (untested); "
                f"remove zero_optimization.offload_{kind}."
            )


class step_reduction(contextlib.AbstractContextManager):
    """Gradient reductions of ``engine`` deferred to one flush at this block's exit: hold it open across
    every gradient walk of one optimizer step, exit it just before ``engine.step()``. ``abort()`` instead
    drops the gradients gathered so far (after a failed walk) and closes the block without reducing them."""

    def __init__(self, engine):
        check_engine(engine)
        if _FLUSHED.get(id(engine)) == engine.global_steps:
            raise RuntimeError(
                "a second DeepSpeed gradient reduction before engine.step(): its flush would overwrite "
                "the first one's gradients. Walk once per optimizer step, or hold one "
                "step_reduction(engine) open across the step's walks."
            )
        if id(engine) in _OPEN:
            raise RuntimeError("a step_reduction of this engine is already open.")
        self.engine = engine
        self._block = engine.coalesce_grad_reduction()

    def __enter__(self):
        self._block.__enter__()
        _OPEN[id(self.engine)] = self
        return self

    def __exit__(self, *exc):
        if exc[0] is not None:
            _drop_gradients(self.engine.module)
        else:
            _zero_unused(self.engine.module)
        try:
            self._block.__exit__(None, None, None)  # the flush (of nothing if the gradients were dropped)
        finally:
            _OPEN.pop(id(self.engine), None)
            if exc[0] is None:  # (an aborted block reduced nothing: another may follow before the step)
                _FLUSHED[id(self.engine)] = self.engine.global_steps
        return False

    def abort(self) -> None:
        self.__exit__(RuntimeError, None, None)


def open_reduction(engine) -> step_reduction | None:
    """The step_reduction now open for ``engine``, if any."""
    return _OPEN.get(id(engine))


@contextlib.contextmanager
def gathered(model: nn.Module, grad: bool, per_layer: bool = False):
    """Run one walk of a DeepSpeed model (module docstring); ``grad``: the walk computes gradients. Yields an
    inactive :class:`~trl_dta.walk.distributed.lockstep.Lockstep` (nothing is gathered per call)."""
    outer = _ACTIVE.get(id(model))
    if outer is not None:
        if grad and not outer:
            raise RuntimeError(
                "a walk inside another walk of the same DeepSpeed model (a loss_fn that walks another trie) "
                "must not compute gradients the outer walk does not reduce."
            )
        yield Lockstep()
        return
    engine = engine_of(model)
    zero3 = is_zero3(model)
    if per_layer and zero3:
        raise UnsupportedModelError(
            "gather_per_layer is not supported under DeepSpeed ZeRO-3: DeepSpeed has no public per-module "
            "gather and release the walk could keep in lock-step across ranks. Use the default gather-once "
            "mode, or FSDP2 (fsdp_version: 2) for per-layer gathering."
        )
    if grad and engine is None:
        raise UnsupportedModelError(
            "a gradient walk of a DeepSpeed model needs its engine: call "
            "trl_dta.walk.distributed.deepspeed.register_engine(engine) with deepspeed.initialize's engine "
            "first."
        )
    _ACTIVE[id(model)] = grad
    try:
        with contextlib.ExitStack() as stack:
            if grad and open_reduction(engine) is None:  # a walk on its own: its own flush at the end
                stack.enter_context(step_reduction(engine))
            if zero3:
                stack.enter_context(_hooks_suspended(engine))
                stack.enter_context(_gathered_parameters(model))
            agree = world_size() > 1  # the ranks agree on how the walk ended (OOM recovery walks again)
            try:
                yield Lockstep()
            except BaseException as e:
                if agree:
                    agree_on_outcome(model, e)  # (raises: this rank's error, or the peer's)
                raise
            if agree:
                agree_on_outcome(model, None)
            if grad:  # (while gathered: full-size zeros)
                _zero_unused(model)
    except BaseException:
        if grad:
            _drop_gradients(model)
        raise
    finally:
        _ACTIVE.pop(id(model), None)


def gathered_for_check(model: nn.Module):
    """For a check's own forwards (the probe, the determinism check): the ZeRO-3 parameters gathered once, or
    as the walk running now has them."""
    if id(model) in _ACTIVE or not is_zero3(model):
        return contextlib.nullcontext()
    return gathered(model, grad=False)


def _gathered_parameters(model: nn.Module):
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None)


def _offload(engine):
    """ZeRO-3's parameter coordinator (``DeepSpeedZeRoOffload``), which owns the module hooks."""
    optimizer = engine.optimizer
    return optimizer.parameter_offload if hasattr(optimizer, "parameter_offload") else optimizer


@contextlib.contextmanager
def _hooks_suspended(engine):
    """ZeRO-3's per-module gather/release hooks removed for the walk and registered again after it (None: no
    engine yet, so no module hooks, e.g. a model built under ``deepspeed.zero.Init``)."""
    offload = _offload(engine) if engine is not None else None
    if offload is None or not hasattr(offload, "forward_hooks"):
        yield
        return
    for p in offload.module.parameters():
        p.ds_active_sub_modules.clear()  # (else releasing them raises: "still active")
    for hook in [*offload.forward_hooks, *offload.backward_hooks]:
        hook.remove()
    offload.forward_hooks, offload.backward_hooks = [], []
    try:
        yield
    finally:
        coordinator = offload.get_param_coordinator() if hasattr(offload, "get_param_coordinator") else None
        if coordinator is not None and not coordinator.is_invalid_trace():
            coordinator._invalidate_trace()  # the walk's calls are not the forward it recorded
        offload._register_deepspeed_module(offload.module)


def assign_grad(param: nn.Parameter, grad: torch.Tensor | None) -> None:
    """``param.grad = grad``, also for a ZeRO-3 parameter outside a walk's gather: it is partitioned there
    (``param.data`` holds none of it), while the gradient a walk left on it until the step's flush is
    full-size, which torch's ``.grad`` setter refuses. Its data is swapped for a zero-stride view of the full
    shape (no allocation) for the assignment."""
    if grad is None or grad.shape == param.shape:
        param.grad = grad
        return
    data = param.data
    param.data = torch.empty((), dtype=param.dtype, device=param.device).expand(grad.shape)
    try:
        param.grad = grad
    finally:
        param.data = data


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _zero_unused(model: nn.Module) -> None:
    """Zero gradients for trainable parameters without one, so every rank's flush reduces the same tensors
    (the flush skips a parameter without a gradient). Full size: a ZeRO-3 parameter's is ``ds_shape``."""
    for p in _trainable(model):
        if p.grad is None:
            shape = p.ds_shape if hasattr(p, "ds_shape") else p.shape
            p.grad = torch.zeros(shape, dtype=p.dtype, device=p.device)


def _drop_gradients(model: nn.Module) -> None:
    for p in _trainable(model):
        p.grad = None
