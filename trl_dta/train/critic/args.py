"""The options of PPO with a value model, shared by the PPO configs: a dataclass mixin listed before the TRL
parent (``class TreePPOConfig(TreeArguments, ValueArguments, GRPOConfig)``), like
:class:`~trl_dta.train.tree_args.TreeArguments`. They are read only when the trainer is given a
``value_model``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ...walk.errors import ArgumentTypeError
from ..tree_args import check_flag


@dataclass
class ValueArguments:
    """PPO with a value model (the trainer's ``value_model``; without one these are not read). The names are
    those of TRL's former ``PPOConfig`` and of AReaL's critic.

    Args:
        gamma (`float`, defaults to `1.0`):
            Discount per policy token in generalised advantage estimation. 1: a task's reward comes at its
            end, and discounting per token would pay a long tool trajectory less than a short one for the
            same outcome.
        lam (`float`, defaults to `1.0`):
            GAE's λ. 1: each token's advantage is the rollout's reward less the token's value (Monte-Carlo),
            which does not rely on the critic's later values; with λ < 1 an untrained critic's values stand
            in for the terminal reward, and the early tokens of a long tool trajectory (its first tool calls)
            learn from the critic's noise rather than from the outcome. Lower it once the critic has learnt
            (explained variance `value/explained_variance` well above 0).
        cliprange_value (`float` or `None`, defaults to `0.2`):
            The value loss is clipped around the old values, as PPO clips the policy's ratio: a value moves
            at most this far from the one the rollout was scored with before the larger of the two errors
            applies. `None`: the plain squared error. 0.2 is TRL's former and AReaL's default.
        whiten_advantages (`bool`, defaults to `True`):
            Advantages less their mean, over their standard deviation, over every policy token of the
            generation batch (of every process), as TRL's former PPO did: the policy loss's scale stays the
            same whatever the rewards' scale.
        value_learning_rate (`float` or `None`, defaults to `None`):
            The value model's learning rate; `None`: `learning_rate`. The value model has its own optimizer
            (the class `optim` names, with the same betas, epsilon and weight decay) and scheduler
            (`lr_scheduler_type`, the same warmup).
        value_max_grad_norm (`float` or `None`, defaults to `None`):
            The value model's gradients are clipped on their own, to this norm; `None`: `max_grad_norm`
            (0 does not clip).
    """

    gamma: float = field(default=1.0, metadata={"help": "value_model: GAE's discount per policy token."})
    lam: float = field(default=1.0, metadata={"help": "value_model: GAE's lambda (1: Monte-Carlo)."})
    cliprange_value: float | None = field(
        default=0.2,
        metadata={"help": "value_model: clip the value loss around the old values (None: not clipped)."},
    )
    whiten_advantages: bool = field(
        default=True,
        metadata={"help": "value_model: whiten advantages over the generation batch's policy tokens."},
    )
    value_learning_rate: float | None = field(
        default=None, metadata={"help": "value_model: its learning rate (None: learning_rate)."}
    )
    value_max_grad_norm: float | None = field(
        default=None,
        metadata={"help": "value_model: clip its gradients to this norm (None: max_grad_norm; 0: off)."},
    )

    def __post_init__(self):
        super().__post_init__()
        for name in ("gamma", "lam"):
            _check_number(name, getattr(self, name), 0.0, 1.0)
        for name in ("cliprange_value", "value_learning_rate", "value_max_grad_norm"):
            if getattr(self, name) is not None:
                _check_number(name, getattr(self, name), 0.0, math.inf)
        check_flag("whiten_advantages", self.whiten_advantages)


def _check_number(name: str, value, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ArgumentTypeError(f"{name} must be a number, got {value!r}")
    if not low <= value <= high:  # (NaN fails too)
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
