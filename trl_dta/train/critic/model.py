"""The value model of :class:`~trl_dta.TreePPOTrainer` (its ``value_model``): loading it, building one from
the policy's weights (:func:`value_model_from`), and its training state beside the policy's (:class:`Critic`:
the module on the trainer's device, its own optimizer, scheduler, gradient clipping and checkpoint).

Policy and critic are two models with two optimizers, as AReaL keeps them (one engine each), not one module
with one optimizer as TRL's former ``PPOTrainer`` wrapped them: each is walked on the step's trie by its own
executor (its own budgets), its gradients are clipped on their own, and a critic can be larger or smaller
than the policy, or LoRA where the policy is not.

A value model is a ``*ForTokenClassification`` with ``num_labels=1`` (a d -> 1 head on every position), or a
PEFT model of one; a ``*ForSequenceClassification`` with a d -> 1 head walks the same way (its head applied
per token). Value ``t`` of a sequence is the head at position ``t``: the state before token ``t + 1``.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from ...walk.model import output_head

logger = logging.getLogger(__name__)

VALUE_MODEL_DIR = "value_model"  # beside the policy's files, in checkpoints and in output_dir
_OPTIMIZER, _SCHEDULER = "optimizer.pt", "scheduler.pt"


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
        with torch.no_grad():
            for p in head.parameters():
                p.zero_()
    return model


def value_model_from(policy: str | nn.Module, **kwargs) -> nn.Module:
    """A value model warm-started from a causal LM: its decoder's weights, a zero d -> 1 head.

    Example::

        from trl_dta import value_model_from

        trainer = TreePPOTrainer(model=policy, value_model=value_model_from(policy), ...)

    Args:
        policy: a Hub id or a path (then ``from_pretrained`` with ``kwargs``, as :func:`load_value_model`;
            passing the id as ``value_model=`` does the same), or a ``transformers`` causal LM (its decoder's
            weights copied, same dtype and device; ``kwargs`` go to ``from_config``).
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
    critic.to(dtype=policy.dtype, device=policy.device)
    critic.base_model.load_state_dict(policy.base_model.state_dict())
    head, _ = output_head(critic)
    with torch.no_grad():
        for p in head.parameters():
            p.zero_()
    return critic


class Critic:
    """The value model's training state: ``model`` (the module, on ``accelerator``'s device), its optimizer
    and scheduler (built by :meth:`create_optimizer` when the Trainer builds the policy's), one optimizer step
    (:meth:`step`) and its checkpoint (:meth:`save`, :meth:`load`).

    Args:
        model: the value model (checked by the walk when the trainer is built).
        args: the trainer's config (:class:`~trl_dta.train.critic.args.ValueArguments` and TRL's
            optimizer options).
        accelerator: the trainer's; with several processes the value model's weights are broadcast from
            process 0, so that every rank starts from the same ones.
    """

    def __init__(self, model: nn.Module, args, accelerator):
        self.model = model.to(accelerator.device).train()  # (trained: the mode the Trainer gives the policy)
        self.args = args
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler = None
        if accelerator.num_processes > 1:
            import torch.distributed as dist

            with torch.no_grad():
                for tensor in [*self.model.parameters(), *self.model.buffers()]:
                    dist.broadcast(tensor.data, src=0)
        lr, clip = args.value_learning_rate, args.value_max_grad_norm
        self.learning_rate = args.learning_rate if lr is None else lr
        self.max_grad_norm = args.max_grad_norm if clip is None else clip

    def create_optimizer(self, trainer, num_training_steps: int) -> None:
        """The optimizer ``trainer.args.optim`` names (its betas, epsilon, weight decay; its parameter groups
        as the Trainer makes them) at :attr:`learning_rate`, and the scheduler of ``lr_scheduler_type``."""
        from transformers import Trainer, get_scheduler

        if self.optimizer is not None:
            return
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
            args.lr_scheduler_type, optimizer=self.optimizer,
            num_warmup_steps=args.get_warmup_steps(num_training_steps), num_training_steps=num_training_steps,
            scheduler_specific_kwargs=args.lr_scheduler_kwargs,
        )  # fmt: skip

    def step(self) -> float:
        """One optimizer step on the gradients the step's walk left (averaged over processes): clipped to
        :attr:`max_grad_norm` (if > 0), the optimizer's and the scheduler's step, gradients cleared. Returns
        the gradient norm before clipping."""
        if self.optimizer is None:
            raise RuntimeError("the value model's optimizer is built with the policy's (Trainer.train()).")
        params = [p for p in self.model.parameters() if p.requires_grad]
        clip = self.max_grad_norm if self.max_grad_norm and self.max_grad_norm > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def save(self, output_dir: str, weights: bool = True, optimizer: bool = True) -> None:
        """In ``output_dir/value_model``: the value model's ``weights`` (``save_pretrained``: loadable by
        ``from_pretrained``; a PEFT model's adapter) and its ``optimizer``'s and scheduler's states."""
        directory = os.path.join(output_dir, VALUE_MODEL_DIR)
        if weights:
            self.model.save_pretrained(directory)
        if optimizer and self.optimizer is not None:
            os.makedirs(directory, exist_ok=True)
            torch.save(self.optimizer.state_dict(), os.path.join(directory, _OPTIMIZER))
            torch.save(self.scheduler.state_dict(), os.path.join(directory, _SCHEDULER))

    def load(self, checkpoint: str) -> None:
        """Restore what :meth:`save` wrote in ``checkpoint``: weights, then optimizer and scheduler states."""
        directory = os.path.join(checkpoint, VALUE_MODEL_DIR)
        if not os.path.isdir(directory):
            raise FileNotFoundError(
                f"{checkpoint} has no {VALUE_MODEL_DIR}/: it was not saved by a trainer with a value model."
            )
        _load_weights(self.model, directory)
        if self.optimizer is not None and os.path.exists(os.path.join(directory, _OPTIMIZER)):
            device = next(self.model.parameters()).device
            self.optimizer.load_state_dict(
                torch.load(os.path.join(directory, _OPTIMIZER), map_location=device, weights_only=True)
            )
            self.scheduler.load_state_dict(torch.load(os.path.join(directory, _SCHEDULER), weights_only=True))


def _load_weights(model: nn.Module, directory: str) -> None:
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
