"""The arithmetic of PPO with a value model (issue 39's first part; no trainer uses it yet): generalised
advantage estimation per rollout, advantage whitening, and the clipped value loss.

All three work on padded ``(B, T)`` completion tensors with a ``mask`` of the tokens the policy produced
(TRL's :func:`~trl_dta.train.ppo_losses.loss_mask`: completion tokens, less the tool-response tokens of a
multi-turn rollout). Masked-out positions are *holes*, not steps: a tool's response is the environment's
move, so GAE runs over the policy's own tokens only, each one's next state being the policy's next token
(AReaL skips them the same way). The value of the token after the last one is 0: a rollout ends there.

The names are those of TRL's former ``PPOTrainer`` (``gamma``, ``lam``, ``cliprange_value``). Exactness is
checked against loops written independently in ``tests/test_ppo_values.py`` (fp64, random holes).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


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
