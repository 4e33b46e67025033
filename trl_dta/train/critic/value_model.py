"""PPO's value model beside a policy trainer (``value_model=`` of both PPO trainers), as one object the
trainers call with explicit inputs (:class:`ValueModel`).

A trainer hands it the walk's sequences (:class:`~trl_dta.train.step_results.StepSequence`), each with the
positions of its trained tokens among its scored values (the policy's own tokens: tool responses and padding
left out), and gets back:

* :meth:`~ValueModel.values`: the value model's values at those positions (one no-gradient walk);
* :meth:`~ValueModel.targets`: per sequence, GAE's advantages and returns from those values and the rollout's
  reward (:mod:`trl_dta.train.critic.gae`: the reward on the last trained token, whitened over every
  process), and the generation's ``value/*`` metrics. A rollout no reward function scored (a NaN reward)
  gets zeros and stays out of the whitening;
* :meth:`~ValueModel.backward`: its walk on the step's sequences with each one's clipped value loss
  (:class:`ValueTarget`: the old values and returns the loss reads, its normaliser), gradients in its
  ``.grad``, ``value/loss`` and ``value/clip_ratio`` logged;
* :meth:`~ValueModel.micro_batch_done`: after each training micro-batch; after the step's last, its gradients
  averaged over processes and its own optimizer step (``value/grad_norm``).

The trainer owns its advantages: it decides when the targets are computed (the synchronous trainer at
generation, with the values of the model that generated; the asynchronous one at training time) and where
they go (TRL's ``advantages`` field, or each sample's). Policy and value model are two models with two
optimizers, as AReaL keeps them: each is walked by its own executor (its own budgets and metrics), its
gradients clipped on their own; a value model can be larger or smaller than the policy, or LoRA where the
policy is not. :class:`ValueModelCheckpoints` carries the Trainer's own hooks (the optimizer, checkpoints) to
it. Adding another model pass on the tree (a teacher for distillation) copies this shape: docs/development.md.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import NamedTuple

import torch
from accelerate.utils import DistributedType
from torch import nn

from ...walk.distributed.deepspeed import is_zero3
from ..dense_fallback import refuse_always
from ..step_results import StepSequence
from . import engine as deepspeed_engine
from . import sharded
from .gae import Targets, clipped_value_loss, sequence_targets
from .model import VALUE_MODEL_DIR, load_value_model, load_weights, saved_weights

_OPTIMIZER, _SCHEDULER = "optimizer.pt", "scheduler.pt"


class ValueTarget(NamedTuple):
    """What a sequence's value loss reads: its trained ``positions`` among its scored values, their
    ``old_values`` and ``returns``, its ``weight`` (0: an unscorable rollout) and ``norm`` (the loss is summed
    over its tokens and divided by it: the step's trained tokens per process, with the accumulation steps)."""

    positions: torch.Tensor
    old_values: torch.Tensor
    returns: torch.Tensor
    weight: float
    norm: float


class ValueLosses:
    """The value model's walk loss (``(k, values, _) -> scalar``): sequence ``k``'s clipped value loss at its
    :class:`ValueTarget`'s positions; ``clipped(k, values)``: its tokens whose clipped term was the larger."""

    def __init__(self, targets: Sequence[ValueTarget], cliprange_value: float | None):
        self.targets, self.cliprange_value = targets, cliprange_value

    def _terms(self, k: int, values: torch.Tensor):
        t = self.targets[k]
        v = values[t.positions.to(values.device)]
        old, returns = t.old_values.to(v.device, v.dtype), t.returns.to(v.device, v.dtype)
        return clipped_value_loss(v, old, returns, self.cliprange_value)

    def __call__(self, k: int, values: torch.Tensor, _=None) -> torch.Tensor:
        t = self.targets[k]
        loss, _clipped = self._terms(k, values)
        return loss.sum() / t.norm * t.weight

    def clipped(self, k: int, values: torch.Tensor) -> float:
        return float(self._terms(k, values)[1].sum()) * bool(self.targets[k].weight)


class ValueModel:
    """A value model trained beside a policy (module docstring).

    Args:
        value_model: a Hub id or path (a ``*ForTokenClassification`` with ``num_labels=1`` loaded with the
            config's ``model_init_kwargs``, the policy's dtype and attention; a causal LM's checkpoint gets a
            zero head), or a module (a ``*ForTokenClassification``, or a PEFT model of one).
        args: the trainer's config (:class:`~trl_dta.train.critic.args.ValueArguments`, TRL's optimizer
            options, ``disable_dropout``).
        accelerator: the trainer's; with several processes the weights are broadcast from process 0.
        walker: the trainer's :class:`~trl_dta.train.step.StepWalker` (the value model gets its own executor).
        policy: the trainer's model (its dtype and attention for a loaded value model; both trained together).
        tokenizer, length: what the walk checks the value model against, as the policy.
    """

    def __init__(self, value_model, args, accelerator, walker, policy, tokenizer=None, length=None):
        check_value_model(value_model, accelerator)
        refuse_always(walker.dense_fallback, "with a value model (its walk shares the policy's trie)")
        if isinstance(value_model, str):
            kwargs = dict(args.model_init_kwargs or {})
            kwargs.setdefault("dtype", accelerator.unwrap_model(policy).dtype)
            kwargs.setdefault("attn_implementation", policy.config._attn_implementation)
            kwargs.setdefault("trust_remote_code", args.trust_remote_code)
            kwargs["device_map"] = None  # (placed on the trainer's device below)
            value_model = load_value_model(value_model, **kwargs)
        if not is_zero3(value_model):  # (ZeRO-3: placed by zero.Init)
            value_model = value_model.to(accelerator.device)
        self.model = value_model.train()  # (the mode the Trainer gives the policy)
        self.args, self.accelerator, self.walker = args, accelerator, walker
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler = None
        self.engine = None  # DeepSpeed: the value model's own engine (critic/engine.py)
        if accelerator.num_processes > 1:  # (every rank starts from the same weights)
            import torch.distributed as dist

            with torch.no_grad():  # (ZeRO-3 partitions: each rank's own, as loaded: not broadcast)
                for tensor in [*self.model.parameters(), *self.model.buffers()]:
                    if not hasattr(tensor, "ds_id"):
                        dist.broadcast(tensor.data, src=0)
        lr, clip = args.value_learning_rate, args.value_max_grad_norm
        self.learning_rate = args.learning_rate if lr is None else lr
        self.max_grad_norm = args.max_grad_norm if clip is None else clip
        walker.train_together(policy, self.model)
        walker.check_models(
            self.model,
            tokenizer=tokenizer,
            length=length,  # (it trains: dropout off)
            disable_dropout=args.disable_dropout,
        )

    @classmethod
    def for_trainer(cls, value_model, trainer, length=None) -> ValueModel:
        """The value model of a tree trainer (after its policy's checks): its config, accelerator, step walker
        (``_walker``), policy and tokenizer; ``length``: the longest rollout its arguments allow."""
        return cls(
            value_model,
            trainer.args,
            trainer.accelerator,
            trainer._walker,
            trainer.model,
            tokenizer=trainer.processing_class,
            length=length,
        )

    # ------------------------------------------------------------------ the walks
    def values(self, sequences: Sequence[StepSequence], positions: Sequence[torch.Tensor]) -> list:
        """Each sequence's values (a 1-D tensor) at its ``positions`` (indices among its scored values: from
        its ``score_from`` on), by one no-gradient walk."""
        with self.walker.step(self.model, sequences, training=False) as step:
            values = step.logprobs()
        return [v[p.to(v.device)] for v, p in zip(values, positions, strict=True)]

    def targets(self, values: Sequence[torch.Tensor], rewards: Sequence[float]) -> Targets:
        """GAE per sequence from its values at its trained tokens and its reward
        (:func:`~trl_dta.train.critic.gae.sequence_targets`, with this config's ``gamma``, ``lam`` and
        ``whiten_advantages``, whitened over every process)."""
        a, accelerator = self.args, self.accelerator
        reduce = (lambda t: accelerator.reduce(t, "sum")) if accelerator.num_processes > 1 else None
        return sequence_targets(
            values,
            rewards,
            gamma=a.gamma,
            lam=a.lam,
            whiten_advantages=a.whiten_advantages,
            sum_over_processes=reduce,
        )

    def backward(self, sequences: Sequence[StepSequence], targets: Sequence[ValueTarget], metrics):
        """The value model's training walk on the step's ``sequences``, each with its clipped value loss
        (gradients in its ``.grad``); logs ``value/loss`` (over every process) and ``value/clip_ratio``, and
        its walk's ``value_tree/*``. Returns the walk (:class:`~trl_dta.train.step_walk.StepWalk`): the
        policy's step includes it (its peak memory is the step's too)."""
        losses = ValueLosses(targets, self.args.cliprange_value)
        with self.walker.step(self.model, sequences, metrics=metrics, prefix="value_tree/") as step:
            step.backward(losses, entropies=False)
        loss = clipped = tokens = 0.0
        for k, t in enumerate(targets):
            values = step.results.logps[k]
            if values is None or not t.weight:
                continue
            loss += float(step.results.losses[k])
            clipped += losses.clipped(k, values)
            tokens += t.positions.numel()
        totals = torch.tensor([loss, clipped, tokens], dtype=torch.float64, device=self.accelerator.device)
        loss, clipped, tokens = self.accelerator.reduce(totals, "sum").tolist()
        metrics["value/loss"].append(loss / self.accelerator.num_processes)
        metrics["value/clip_ratio"].append(clipped / max(tokens, 1.0))
        return step

    def micro_batch_done(self, metrics) -> None:
        """After each training micro-batch: after the step's last one, the value model's gradients averaged
        over processes (DDP), then its optimizer step (``value/grad_norm``)."""
        self.walker.micro_batch_done(self.model)
        if self.accelerator.sync_gradients:
            metrics["value/grad_norm"].append(self.step())

    # ------------------------------------------------------------------ optimizer and checkpoint
    def create_optimizer(self, trainer, num_training_steps: int) -> None:
        """The optimizer ``args.optim`` names (its betas, epsilon, weight decay; its parameter groups as the
        Trainer makes them) at :attr:`learning_rate`, and the scheduler of ``lr_scheduler_type``. Under FSDP2
        the value model is sharded first, as the policy is (:mod:`~trl_dta.train.critic.sharded`); under
        DeepSpeed they become an engine of its own (:mod:`~trl_dta.train.critic.engine`)."""
        from transformers import Trainer, get_scheduler

        if self.optimizer is not None:
            return
        if self.accelerator.distributed_type == DistributedType.FSDP and not sharded.is_sharded(self.model):
            self.model = sharded.shard(self.model, self.accelerator)
        args = self.args
        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, self.model)
        kwargs = {**kwargs, "lr": self.learning_rate}
        decay = set(trainer.get_decay_parameter_names(self.model))
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]
        self.optimizer = cls([g for g in groups if g["params"]], **kwargs)
        self.scheduler = get_scheduler(
            args.lr_scheduler_type,
            optimizer=self.optimizer,
            num_warmup_steps=args.get_warmup_steps(num_training_steps),
            num_training_steps=num_training_steps,
            scheduler_specific_kwargs=args.lr_scheduler_kwargs,
        )
        if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            self.engine, self.optimizer, self.scheduler = deepspeed_engine.initialize(
                self.model, self.optimizer, self.scheduler, self.accelerator, self.max_grad_norm
            )

    def step(self) -> float:
        """One optimizer step on the gradients the step's walk left (averaged over processes): clipped to
        :attr:`max_grad_norm` (if > 0), the optimizer's and the scheduler's step, gradients cleared. Returns
        the gradient norm before clipping."""
        if self.optimizer is None:
            raise RuntimeError("the value model's optimizer is built with the policy's (Trainer.train()).")
        if self.engine is not None:  # (its walk flushed the reduction: the engine clips and steps)
            return deepspeed_engine.step(self.engine)
        params = [p for p in self.model.parameters() if p.requires_grad]
        clip = self.max_grad_norm if self.max_grad_norm and self.max_grad_norm > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, clip)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # (FSDP2: a DTensor)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def save(self, output_dir: str, weights: bool = True, optimizer: bool = True, write: bool = True) -> None:
        """In ``output_dir/value_model``: the value model's ``weights`` (``save_pretrained``: loadable by
        ``from_pretrained``; a PEFT model's adapter) and its ``optimizer``'s and scheduler's states, whole.
        Every process calls it (a sharded model's are gathered); those with ``write`` write."""
        directory, is_sharded = os.path.join(output_dir, VALUE_MODEL_DIR), sharded.is_sharded(self.model)
        if weights:
            state = sharded.full_state(self.model) if is_sharded else None
            if self.engine is not None:
                state = deepspeed_engine.full_state(self.model)
            if write:
                self.model.save_pretrained(directory, state_dict=state)
        if optimizer and self.engine is not None:  # (every rank its partitions)
            deepspeed_engine.save_states(self.engine, directory)
        elif optimizer and self.optimizer is not None:
            state = self.optimizer.state_dict()
            if is_sharded:
                state = sharded.full_optimizer_state(self.model, self.optimizer)
            if write:
                os.makedirs(directory, exist_ok=True)
                torch.save(state, os.path.join(directory, _OPTIMIZER))
                torch.save(self.scheduler.state_dict(), os.path.join(directory, _SCHEDULER))

    def load(self, checkpoint: str) -> None:
        """Restore what :meth:`save` wrote in ``checkpoint``: weights, then optimizer and scheduler states
        (every process reads them; a sharded model keeps its shards)."""
        directory = os.path.join(checkpoint, VALUE_MODEL_DIR)
        if not os.path.isdir(directory):
            raise FileNotFoundError(
                f"{checkpoint} has no {VALUE_MODEL_DIR}/: it was not saved by a trainer with a value model."
            )
        if self.engine is not None:  # (weights, optimizer partitions, scheduler)
            deepspeed_engine.load_states(self.engine, directory)
            return
        is_sharded = sharded.is_sharded(self.model)
        if is_sharded:
            sharded.load_state(self.model, saved_weights(directory, self.model))
        else:
            load_weights(self.model, directory)
        if self.optimizer is not None and os.path.exists(os.path.join(directory, _OPTIMIZER)):
            device = "cpu" if is_sharded else next(self.model.parameters()).device
            state = torch.load(os.path.join(directory, _OPTIMIZER), map_location=device, weights_only=True)
            if is_sharded:
                sharded.load_optimizer_state(self.model, self.optimizer, state)
            else:
                self.optimizer.load_state_dict(state)
            self.scheduler.load_state_dict(torch.load(os.path.join(directory, _SCHEDULER), weights_only=True))


class ValueModelCheckpoints:
    """The Trainer's own hooks, which it calls on itself, carried to a trainer's :class:`ValueModel`
    (``self._critic``; None: passed through): its optimizer built with the policy's, its weights and states
    saved beside the policy's (``value_model/`` in each checkpoint and in ``output_dir``) and restored on
    resume. ``class Trainer(ValueModelCheckpoints, ..., TRLTrainer)``."""

    _critic: ValueModel | None = None

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        if self._critic is not None:  # (built with the policy's: the Trainer knows the step count now)
            self._critic.create_optimizer(self, num_training_steps)
        return scheduler

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        super().save_model(output_dir, _internal_call)
        if self._critic is not None:  # (every process: a sharded value model is gathered)
            directory = output_dir or self.args.output_dir
            self._critic.save(directory, optimizer=False, write=self.args.should_save)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        if self._critic is not None:  # (save_model wrote its weights)
            self._critic.save(output_dir, weights=False, write=self.args.should_save)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if self._critic is not None and checkpoint is not None:
            self._critic.load(checkpoint)


def check_value_model(value_model, accelerator) -> None:
    """A value model (``value_model=``) is a Hub id or path, or a module; it trains on one process, under DDP,
    under FSDP2 (sharded as the policy: :mod:`~trl_dta.train.critic.sharded`) and under DeepSpeed ZeRO-2/3
    (an engine of its own: :mod:`~trl_dta.train.critic.engine`); FSDP1 is refused as for the policy."""
    if not isinstance(value_model, str | nn.Module):
        raise TypeError(
            f"value_model must be a Hub id or a path, or a *ForTokenClassification module (num_labels=1), "
            f"got {type(value_model).__name__}."
        )
    if isinstance(value_model, nn.Module):
        from ...walk.adapter.model import _base_model, output_head

        _, is_value_head = output_head(_base_model(value_model))
        if not is_value_head:
            raise ValueError(
                f"value_model is a {type(value_model).__name__}, not a value model (a "
                "*ForTokenClassification with num_labels=1, or a PEFT model of one): build one from the "
                "policy with trl_dta.value_model_from(policy), or pass the policy's path (a zero value head "
                "is added)."
            )
    kind = accelerator.distributed_type
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if kind == DistributedType.FSDP and getattr(plugin, "fsdp_version", 1) != 2:
        raise ValueError(
            "a value model under FSDP needs FSDP2 (accelerate: fsdp_version: 2), as the policy's walk does."
        )
