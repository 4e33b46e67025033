"""The arithmetic of PPO with a value model (:class:`~trl_dta.TreePPOTrainer`'s ``value_model``): the
terminal reward on each rollout's last policy token, generalised advantage estimation per rollout, advantage
whitening, the clipped value loss; the targets of sequences of different lengths (:func:`sequence_targets`).

All three work on padded ``(B, T)`` completion tensors with a ``mask`` of the tokens the policy produced
(TRL's :func:`~trl_dta.train.ppo.losses.loss_mask`: completion tokens, less the tool-response tokens of a
multi-turn rollout). Masked-out positions are *holes*, not steps: a tool's response is the environment's
move, so GAE runs over the policy's own tokens only, each one's next state being the policy's next token
(AReaL skips them the same way). The value of the token after the last one is 0: a rollout ends there.

The names are those of TRL's former ``PPOTrainer`` (``gamma``, ``lam``, ``cliprange_value``). Exactness is
checked against loops written independently in ``tests/test_ppo_values.py`` (fp64, random holes).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch


def terminal_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` per-token rewards: each row's reward ``rewards[b]`` on its last policy token (the last 1 of
    ``mask``, a ``(B, T)`` mask of the tokens the policy produced), 0 elsewhere; a row without a policy token
    gets nothing. NaN rewards (TRL's unscorable rollouts) count as 0."""
    out = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
    on = mask.bool()
    last = (on.long() * torch.arange(1, mask.shape[1] + 1, device=mask.device)).argmax(dim=1)  # (B,)
    has = on.any(dim=1)
    rows = torch.arange(mask.shape[0], device=mask.device)[has]
    out[rows, last[has]] = torch.nan_to_num(rewards.double(), nan=0.0).to(mask.device)[has]
    return out


def gae(
    values: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns of each rollout (row), by generalised advantage estimation.

    Over the policy's tokens ``k = 0..K-1`` of a row (the masked positions, in order), with ``V_K = 0``::

        delta_k = r_k + gamma * V_{k+1} - V_k
        A_k = delta_k + gamma * lam * A_{k+1}      (A_K = 0)
        R_k = A_k + V_k

    Args:
        values: ``(B, T)`` the old values ``V`` (the critic's, before the step's updates).
        rewards: ``(B, T)`` per-token rewards, 0 where ``mask`` is 0 (a terminal reward on the row's last
            policy token, a per-token KL penalty, ...).
        mask: ``(B, T)`` 1 on the tokens the policy produced, 0 on holes and padding.
        gamma: discount per policy token. lam: GAE's λ (1: Monte-Carlo returns less the value; 0: one-step
            TD errors).

    Returns:
        ``(advantages, returns)``, each ``(B, T)``, 0 where ``mask`` is 0. Computed in ``values``' dtype.
    """
    if values.shape != rewards.shape or values.shape != mask.shape or values.dim() != 2:
        raise ValueError(
            f"gae: values, rewards and mask must be (B, T) alike; got {tuple(values.shape)}, "
            f"{tuple(rewards.shape)}, {tuple(mask.shape)}"
        )
    for name, value in (("gamma", gamma), ("lam", lam)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}")
    on = mask.bool()
    if bool((rewards[~on] != 0).any()):
        raise ValueError("gae: rewards must be 0 where mask is 0 (a tool response or padding is not a step)")
    rewards = rewards.to(values.dtype)
    advantages = torch.zeros_like(values)
    next_value = values.new_zeros(values.shape[0])  # V of the next policy token (0 after the last)
    next_advantage = values.new_zeros(values.shape[0])
    for t in reversed(range(values.shape[1])):  # (T steps of B-wide vector work; T is a completion's length)
        here = on[:, t]
        advantage = rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * next_advantage
        advantages[:, t] = torch.where(here, advantage, 0.0)
        next_value = torch.where(here, values[:, t], next_value)  # a hole passes the next step through
        next_advantage = torch.where(here, advantage, next_advantage)
    returns = torch.where(on, advantages + values, 0.0)
    return advantages, returns


def whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    sum_over_processes: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``x`` less its mean, over its standard deviation, both over the tokens ``mask`` selects (of every
    process, where ``sum_over_processes`` sums a tensor across them, e.g. ``lambda t:
    accelerator.reduce(t, "sum")``); 0 where ``mask`` is 0. Two passes (the mean, then the squared
    deviations from it: no cancellation), in float64; the variance is the population's. A set of equal
    values gives ~0 (their rounding over 1e-8), not NaN."""
    on = mask.bool()
    reduce = sum_over_processes or (lambda t: t)
    total, count = reduce(torch.stack([x[on].double().sum(), on.sum().double()])).tolist()
    if count == 0:
        return torch.zeros_like(x)
    mean = total / count
    squares = float(reduce(((x[on].double() - mean) ** 2).sum().reshape(1)))
    std = (squares / count) ** 0.5
    return torch.where(on, (x - mean) / (std + 1e-8), 0.0)


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, cliprange_value: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token value loss, clipped around the old values as PPO clips the policy's ratio::

        clipped = old + clamp(v - old, -c, c)
        loss = 0.5 * max((v - R)^2, (clipped - R)^2)

    Returns ``(loss, clipped)``: the per-token loss (same shape as ``values``; the caller masks and
    normalises it, as its policy loss) and where the clipped term is the larger (the value clip fraction's
    numerator). ``cliprange_value=None``: the plain squared error, nothing clipped."""
    error = (values - returns) ** 2
    if cliprange_value is None:
        return 0.5 * error, torch.zeros_like(error, dtype=torch.bool)
    if cliprange_value < 0:
        raise ValueError(f"cliprange_value must be >= 0 or None, got {cliprange_value}")
    clipped_values = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    clipped_error = (clipped_values - returns) ** 2
    return 0.5 * torch.maximum(error, clipped_error), clipped_error > error


def value_targets(
    mask: torch.Tensor,
    rewards: torch.Tensor,
    old_values: torch.Tensor,
    *,
    gamma: float,
    lam: float,
    whiten_advantages: bool,
    sum_over_processes: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """A generation batch's PPO targets from its rewards and its old values.

    Args:
        mask: ``(B, T)`` the tokens the policy produced (TRL's loss mask).
        rewards: ``(B,)`` each rollout's reward, put on its last policy token (:func:`terminal_rewards`).
        old_values: ``(B, T)`` the value model's values before the step's updates.
        gamma, lam, whiten_advantages: :class:`~trl_dta.train.critic.args.ValueArguments`'.
        sum_over_processes: sums a tensor over the processes (whitening and the metrics over the whole
            generation batch); None: one process.

    Returns:
        The batch's new fields: ``advantages``, ``returns`` and ``old_values`` (``(B, T)``, float32, 0 off the
        mask) and ``value_tokens`` (the policy tokens of every process, a 0-d tensor: the value loss's
        normaliser); and the metrics: ``value/mean`` and ``value/returns_mean`` over the policy tokens,
        ``value/explained_variance`` (1 - Var(returns - values) / Var(returns): how much of the returns'
        spread the values predict; 1 is perfect, 0 no better than their mean).
    """
    reduce = sum_over_processes or (lambda t: t)
    values = old_values.double()
    advantages, returns = gae(values, terminal_rewards(rewards, mask), mask, gamma, lam)
    if whiten_advantages:
        advantages = whiten(advantages, mask, sum_over_processes)
    on = mask.bool()
    error = (returns - values)[on]
    sums = torch.stack(
        [
            on.sum().double(),
            values[on].sum(),
            returns[on].sum(),
            (returns[on] ** 2).sum(),
            error.sum(),
            (error**2).sum(),
        ]
    )
    count, value_sum, ret, ret2, err, err2 = reduce(sums).tolist()
    metrics = {}
    if count:
        var_returns = ret2 / count - (ret / count) ** 2
        var_error = err2 / count - (err / count) ** 2
        explained = 1.0 - var_error / var_returns if var_returns > 1e-12 else float("nan")
        metrics = {
            "value/mean": value_sum / count,
            "value/returns_mean": ret / count,
            "value/explained_variance": explained,
        }
    fields = {
        "advantages": advantages.float(),
        "returns": returns.float(),
        "old_values": torch.where(on, old_values, 0.0).float(),
        "value_tokens": torch.tensor(count, device=mask.device),
    }
    return fields, metrics


class Targets(NamedTuple):
    """Per sequence, the advantages and returns of its trained tokens (0 for an unscorable rollout) and
    whether it was scored; the scored trained tokens of every process (the value loss's normaliser); the
    ``value/*`` metrics."""

    advantages: list[torch.Tensor]
    returns: list[torch.Tensor]
    scored: list[bool]
    tokens: float
    metrics: dict[str, float]


def sequence_targets(
    values: Sequence[torch.Tensor],
    rewards: Sequence[float],
    *,
    gamma: float,
    lam: float,
    whiten_advantages: bool,
    sum_over_processes: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Targets:
    """:func:`value_targets` on sequences of different lengths: ``values[k]``, sequence ``k``'s values at
    its trained tokens (1-D, in order), its reward ``rewards[k]`` on the last one. A NaN reward (a rollout no
    reward function scored) gives zeros and stays out of the whitening and the metrics. Equal to the padded
    ``(B, T)`` form with holes: GAE skips a hole as if it were not there."""
    sizes = [v.numel() for v in values]
    device = values[0].device if values else torch.device("cpu")
    old = torch.zeros(len(values), max(sizes, default=0), device=device)
    mask = torch.zeros(old.shape, dtype=torch.long, device=device)
    scored = [not math.isnan(r) for r in rewards]
    for k, v in enumerate(values):
        old[k, : v.numel()], mask[k, : v.numel()] = v.float(), int(scored[k])
    fields, metrics = value_targets(
        mask,
        torch.tensor([float(r) for r in rewards], dtype=torch.float64, device=device),
        old,
        gamma=gamma,
        lam=lam,
        whiten_advantages=whiten_advantages,
        sum_over_processes=sum_over_processes,
    )
    advantages, returns = fields["advantages"], fields["returns"]
    per_sequence = [(advantages[k, :n], returns[k, :n]) for k, n in enumerate(sizes)]
    return Targets(
        [a for a, _ in per_sequence],
        [r for _, r in per_sequence],
        scored,
        float(fields["value_tokens"]),
        metrics,
    )
