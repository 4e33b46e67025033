"""PPO's value arithmetic (trl_dta/train/critic/gae.py) against references written here independently: GAE as
a loop over each rollout's policy tokens (tool-response holes removed first), whitening by torch's own
statistics, the clipped value loss term by term. fp64, ≤ 1e-12."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_dta.train.critic.gae import clipped_value_loss, gae, whiten


def reference_gae(values, rewards, mask, gamma, lam):
    """Per row: keep the policy's tokens only, run the textbook recursion backwards, put the results back."""
    advantages, returns = torch.zeros_like(values), torch.zeros_like(values)
    for b in range(values.shape[0]):
        steps = [t for t in range(values.shape[1]) if mask[b, t]]
        v = [float(values[b, t]) for t in steps] + [0.0]
        r = [float(rewards[b, t]) for t in steps]
        running = 0.0
        for k in reversed(range(len(steps))):
            running = r[k] + gamma * v[k + 1] - v[k] + gamma * lam * running
            advantages[b, steps[k]] = running
            returns[b, steps[k]] = running + v[k]
    return advantages, returns


def rollouts(seed: int, rows: int, length: int, holes: bool):
    """Values and rewards of random rows: a padded tail, tool-response holes, a terminal reward on each row's
    last policy token and a small per-token reward (a KL penalty's) on the others."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, length, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, length + 1, (rows,), generator=g)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    if holes:
        mask = mask * (torch.rand(rows, length, generator=g) > 0.3).long()
    rewards = 0.01 * torch.randn(rows, length, generator=g, dtype=torch.float64) * mask
    for b in range(rows):
        on = mask[b].nonzero()
        if len(on):
            rewards[b, on[-1]] += float(torch.randint(0, 2, (), generator=g))
    return values, rewards, mask


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.integers(1, 5), length=st.integers(1, 24),
       gamma=st.sampled_from([1.0, 0.99]), lam=st.sampled_from([1.0, 0.95]), holes=st.booleans())  # fmt: skip
def test_gae_equals_a_loop_over_each_rollouts_policy_tokens(seed, rows, length, gamma, lam, holes):
    values, rewards, mask = rollouts(seed, rows, length, holes)
    advantages, returns = gae(values, rewards, mask, gamma, lam)
    ref_advantages, ref_returns = reference_gae(values, rewards, mask, gamma, lam)
    assert (advantages - ref_advantages).abs().max() <= 1e-12
    assert (returns - ref_returns).abs().max() <= 1e-12
    assert not advantages[mask == 0].any() and not returns[mask == 0].any()


def test_gae_with_gamma_and_lambda_one_gives_monte_carlo_returns():
    """γ = λ = 1: the return is the sum of the rewards still to come, whatever the values; the tool response
    in the middle (a hole) is skipped."""
    values = torch.tensor([[0.3, -1.0, 9.0, 0.5, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 1, 0]])
    rewards = torch.tensor([[0.1, 0.0, 0.0, 1.0, 0.0]], dtype=torch.float64)
    advantages, returns = gae(values, rewards, mask, 1.0, 1.0)
    torch.testing.assert_close(returns, torch.tensor([[1.1, 1.0, 0.0, 1.0, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(advantages, torch.tensor([[0.8, 2.0, 0.0, 0.5, 0.0]], dtype=torch.float64))


def test_gae_refuses_what_is_not_a_rollout():
    values, rewards, mask = rollouts(0, 2, 6, holes=True)
    with pytest.raises(ValueError, match="rewards must be 0 where mask is 0"):
        gae(values, rewards + 1.0, mask, 1.0, 0.95)
    with pytest.raises(ValueError, match=r"lam must be in \[0, 1\]"):
        gae(values, rewards, mask, 1.0, 1.5)
    with pytest.raises(ValueError, match=r"must be \(B, T\) alike"):
        gae(values[0], rewards[0], mask[0], 1.0, 0.95)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), rows=st.integers(2, 6), length=st.integers(1, 16))
def test_whitening_over_processes_equals_whitening_the_whole_batch(seed, rows, length):
    """Two processes, each with half the rows, summing their statistics, whiten as one process with all."""
    values, _, mask = rollouts(seed, rows, length, holes=True)
    if not mask.any():
        return
    on = mask.bool()
    expected = torch.where(on, (values - values[on].mean()) / (values[on].std(unbiased=False) + 1e-8), 0.0)
    torch.testing.assert_close(whiten(values, mask), expected, rtol=0, atol=1e-12)
    half = rows // 2
    parts = [(values[:half], mask[:half]), (values[half:], mask[half:])]

    def whiten_both():
        """The two processes' collectives, in the order each makes them: the mean's sums, then the squared
        deviations' (each process is handed what both sent)."""
        means = [torch.stack([x[m.bool()].sum(), m.sum().double()]) for x, m in parts]
        mean = float((means[0] + means[1])[0] / (means[0] + means[1])[1])
        squares = sum(((x[m.bool()] - mean) ** 2).sum().reshape(1) for x, m in parts)
        answers = [means[0] + means[1], squares]
        return torch.cat([whiten(x, m, sum_over_processes=_replies(answers)) for x, m in parts])

    whitened = whiten_both()
    torch.testing.assert_close(whitened, expected, rtol=0, atol=1e-12)


def _replies(answers):
    """A stand-in collective: the k-th call returns ``answers[k]``."""
    replies = iter(answers)
    return lambda _: next(replies)


def test_whitening_equal_values_gives_zero():
    x, mask = torch.full((2, 3), 0.7, dtype=torch.float64), torch.ones(2, 3)
    assert whiten(x, mask).abs().max() < 1e-6
    assert not whiten(x, torch.zeros(2, 3)).any()


def test_clipped_value_loss_term_by_term_and_its_gradient():
    old = torch.tensor([0.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    returns = torch.tensor([1.0, -1.0, 0.05, 1.0], dtype=torch.float64)
    values = torch.tensor([0.5, 0.5, 0.1, 1.0], dtype=torch.float64, requires_grad=True)
    loss, clipped = clipped_value_loss(values, old, returns, cliprange_value=0.2)
    # token 0: v moved toward R beyond the clip: the clipped error (0.8^2) is larger, so v gets no gradient
    # token 1: v moved away from R: the unclipped error (1.5^2) is larger; token 2: within the range
    expected = 0.5 * torch.tensor([0.64, 2.25, 0.0025, 0.0], dtype=torch.float64)
    torch.testing.assert_close(loss.detach(), expected, rtol=0, atol=1e-15)
    assert clipped.tolist() == [True, False, False, False]
    loss.sum().backward()
    torch.testing.assert_close(values.grad, torch.tensor([0.0, 1.5, 0.05, 0.0], dtype=torch.float64))
    plain, none = clipped_value_loss(values.detach(), old, returns, cliprange_value=None)
    torch.testing.assert_close(plain, 0.5 * (values.detach() - returns) ** 2)
    assert not none.any()
    with pytest.raises(ValueError, match="cliprange_value must be >= 0"):
        clipped_value_loss(values, old, returns, cliprange_value=-0.1)
