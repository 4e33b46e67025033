"""What each multi-process setup needs around the walk (:class:`~trl_dta.train.step.StepWalker` uses it for
both trainers): the checks at construction (:func:`check_distributed`) and the step flow (:class:`StepFlow`).

* **DDP** (multi-GPU / multi-CPU): the walk runs on the unwrapped module (no DDP hooks, which would reduce per
  call), and the gradients accumulated over the step are averaged once, after the step's last micro-batch
  (:func:`all_reduce_gradients`).
* **FSDP2**: the walk gathers and reduce-scatters by itself (:mod:`trl_dta.walk.distributed.sharding`); only
parameters
  left out of every FSDP2 unit are averaged here.
* **DeepSpeed ZeRO-2 / ZeRO-3** (:mod:`trl_dta.walk.distributed.deepspeed`): the step's gradient walks run
inside one
  :class:`~trl_dta.walk.distributed.deepspeed.step_reduction` of the engine, opened at the step's first
  gradient walk. The Trainer's ``accelerator.backward`` is routed to :meth:`StepFlow.backward`: after the
  step's last micro-batch it closes the block (one flush: DeepSpeed reduces the gradients, averaged over
  ranks) and runs ``engine.step()`` (clipping to ``gradient_clipping``, which accelerate sets from
  ``max_grad_norm``, the optimizer step, the scheduler step, zeroing), as accelerate's
  ``DeepSpeedEngineWrapper.backward`` does after ``engine.backward``. ``engine.backward`` itself is never
  called: the loss the trainer hands back has no path to the parameters (the gradients are in place already),
  which ZeRO-2 rejects with an IndexError.
* Under FSDP2 and DeepSpeed a rank with nothing to walk (every row masked) makes the walks the other ranks
  make, on a two-token trie with a zero loss (:meth:`StepFlow.needs_idle_walks`), so that their collectives
  match.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from accelerate.utils import DistributedType
from torch.distributed.tensor import DTensor

from ..walk.distributed import deepspeed as zero
from ..walk.distributed.sharding import fsdp_units
from ..walk.errors import UnsupportedModelError

UNUSED_EXPERTS = (
    "for an MoE model under DDP without find_unused_parameters (set ddp_find_unused_parameters=True: an "
    "expert no token of a rank reached would leave DDP's reduction of the dense backward unfinished)"
)


def check_distributed(accelerator, per_layer: bool = False) -> None:
    """Single process, DDP (multi-GPU / multi-CPU), FSDP2 and DeepSpeed ZeRO-2/3 are supported; FSDP1, FSDP
    activation checkpointing and the DeepSpeed settings :mod:`trl_dta.walk.distributed.deepspeed` lists are
    refused."""
    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP:
        plugin = accelerator.state.fsdp_plugin
        version = getattr(plugin, "fsdp_version", 1)
        if version != 2:
            raise ValueError(
                f"FSDP version {version} is not supported by the tree walk: use FSDP2 (fsdp_version: 2 in "
                "the accelerate config, as in recipes/accelerate_configs/fsdp2.yaml), under which the walk "
                "gathers the parameters once per step and reduces the gradients once."
            )
        if getattr(plugin, "activation_checkpointing", False):
            raise ValueError(
                "FSDP activation_checkpointing wraps the decoder layers in a checkpoint wrapper that "
                "recomputes them in backward, rewriting the walk's cached K/V; turn it off (the walk bounds "
                "activation memory itself with tree_block_size)."
            )
    elif kind == DistributedType.DEEPSPEED:
        _check_deepspeed_config(accelerator.state.deepspeed_plugin.deepspeed_config, per_layer)
    elif not (kind == DistributedType.NO or str(kind.value).startswith("MULTI_")):  # DDP on any device
        raise ValueError(
            f"{kind} is not supported by the tree walk. Use DDP (multi-GPU / multi-CPU), FSDP2 "
            "(recipes/accelerate_configs/fsdp2.yaml) or DeepSpeed ZeRO-2/3 "
            "(recipes/accelerate_configs/deepspeed_zero2.yaml, deepspeed_zero3.yaml)."
        )


def _check_deepspeed_config(config: dict, per_layer: bool) -> None:
    zero_config = config.get("zero_optimization", {})
    stage = zero_config.get("stage", 0)
    if stage not in (2, 3):
        raise ValueError(
            f"DeepSpeed ZeRO stage {stage} is not supported by the tree walk: use stage 2 or 3 "
            "(recipes/accelerate_configs/deepspeed_zero2.yaml, deepspeed_zero3.yaml)."
        )
    if _enabled(config.get("fp16", {})):
        raise ValueError("DeepSpeed fp16 (dynamic loss scaling) is not supported by the tree walk; use bf16.")
    for kind in ("param", "optimizer"):
        device = str(zero_config.get(f"offload_{kind}", {}).get("device", "none")).lower()
        if device != "none":
            raise ValueError(
                f"DeepSpeed offload_{kind} (device {device}) is not supported by the tree walk (untested); "
                f"remove zero_optimization.offload_{kind}."
            )
    if per_layer and stage == 3:
        raise ValueError(
            "tree_gather_per_layer is not supported under DeepSpeed ZeRO-3 (DeepSpeed has no public "
            "per-module gather and release to keep in lock-step across ranks): use the default gather-once "
            "mode, or FSDP2 for per-layer gathering."
        )


def _enabled(section: dict) -> bool:
    value = section.get("enabled", False)
    return value is True or str(value).lower() == "true"  # ("auto" follows TrainingArguments.fp16: refused)


def check_trainable(model) -> None:
    """Refuse PEFT prompt learning (virtual tokens the walk's sequences do not have) in a model or a PEFT
    config (None passes)."""
    config = getattr(model, "active_peft_config", model)
    if getattr(config, "is_prompt_learning", False):
        raise UnsupportedModelError(
            f"PEFT prompt learning ({type(config).__name__}) adds virtual tokens and is not supported by the "
            "tree walk; use LoRA (or another adapter method)."
        )


class StepFlow:
    """A trainer's steps around the walk, per multi-process setup (module docstring)."""

    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.multi_process = accelerator.num_processes > 1
        self.deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
        self._reduction = None  # DeepSpeed: the step_reduction open across this step's walks
        if self.deepspeed:
            accelerator.backward = self.backward  # (an instance attribute: this trainer's accelerator only)

    def register(self, model) -> None:
        """Let the walk find the DeepSpeed engines (the policy's, and ``model`` if it is one: the reference
        model's)."""
        if not self.deepspeed:
            return
        from deepspeed import DeepSpeedEngine

        wrapped = self.accelerator.deepspeed_engine_wrapped  # (None until the Trainer prepares the model)
        for m in (None if wrapped is None else wrapped.engine, model):
            if isinstance(m, DeepSpeedEngine):
                zero.register_engine(m)

    def agreement(self, timed: bool):
        """What makes every rank take the same path at a step's decision (``agree`` of
        :func:`~trl_dta.train.dense_fallback.decide`): on several processes, for a training step, the largest
        predictions over ranks (:func:`max_over_ranks`); else None (a no-gradient pass has no collective)."""
        if not (self.multi_process and timed):
            return None
        return lambda values: max_over_ranks(values, self.accelerator.device)

    def dense_backward_ok(self, lm) -> bool:
        """Whether TRL's dense backward of ``lm`` (a :class:`~trl_dta.walk.adapter.model.CausalLM`) completes
        under DDP: an MoE model's expert that no token of a rank reached has no gradient there, which DDP's
        reduction waits for unless its wrapper has ``find_unused_parameters`` (transformers turns it off under
        activation checkpointing). The walk reduces by itself: only the dense path needs it."""
        if not (self.multi_process and lm.is_moe) or self.deepspeed:
            return True
        for wrapper in getattr(self.accelerator, "_models", []):  # (the models accelerate prepared)
            if getattr(wrapper, "module", None) is lm.model and hasattr(wrapper, "find_unused_parameters"):
                return bool(wrapper.find_unused_parameters)
        return True

    def needs_idle_walks(self, module) -> bool:
        """Whether a rank with nothing to walk must walk anyway (its walks take part in collectives)."""
        return self.multi_process and bool(fsdp_units(module) or zero.is_deepspeed(module))

    @contextlib.contextmanager
    def gradient_walk(self, model):
        """Around a gradient walk of the policy: under DeepSpeed, inside the step's reduction (opened at the
        step's first walk, aborted if a walk fails)."""
        if not self.deepspeed:
            yield
            return
        self.register(model)
        if self._reduction is None:
            self._reduction = zero.step_reduction(self._engine()).__enter__()
        try:
            yield
        except BaseException:
            self._reduction, reduction = None, self._reduction
            reduction.abort()
            raise

    def after_micro_batch(self, model) -> None:
        """DDP: after the step's last micro-batch, average the accumulated gradients (FSDP2: only parameters
        outside every unit; DeepSpeed: nothing, :meth:`backward` flushes)."""
        if self.deepspeed or not (self.multi_process and self.accelerator.sync_gradients):
            return
        plain = [p for p in model.parameters() if p.requires_grad and not isinstance(p, DTensor)]
        if plain:
            all_reduce_gradients(plain)

    def backward(self, loss, **kwargs) -> None:
        """DeepSpeed's part of the Trainer's ``accelerator.backward(loss)``: the walk has put the gradients in
        place, so after the step's last micro-batch flush the step's reduction and run ``engine.step()``."""
        if not self.accelerator.sync_gradients:
            return
        engine = self._engine()
        reduction, self._reduction = self._reduction, None
        if reduction is None:  # no gradient walk this step (nothing to train on): reduce zeros
            reduction = zero.step_reduction(engine).__enter__()
        reduction.__exit__(None, None, None)
        engine.set_gradient_accumulation_boundary(True)
        engine.step()

    def _engine(self):
        wrapped = self.accelerator.deepspeed_engine_wrapped
        if wrapped is None:
            raise RuntimeError("under DeepSpeed the trainer's accelerator should have prepared an engine.")
        return wrapped.engine


def all_reduce_gradients(params: list[torch.nn.Parameter]) -> None:
    """Average ``.grad`` over ranks (what DDP does), once per optimizer step: one flat all-reduce per
    dtype/device, after which each ``.grad`` is a view of the averaged buffer (as DDP's
    ``gradient_as_bucket_view``: no copy back). A parameter without a gradient on this rank contributes
    zeros."""
    world = dist.get_world_size()
    groups: dict[tuple, list[torch.nn.Parameter]] = {}
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        groups.setdefault((p.grad.dtype, p.grad.device), []).append(p)
    for group in groups.values():
        flat = torch.cat([p.grad.reshape(-1) for p in group])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat.div_(world)
        for p, chunk in zip(group, flat.split([p.numel() for p in group]), strict=True):
            p.grad = chunk.view_as(p)


def max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    """The elementwise largest of ``values`` over ranks (one small all-reduce on ``device``; every rank must
    call it at the same point): the slowest rank's times, which the step waits for."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()
