""":class:`~trl_dta.AsyncTreePPOTrainer`'s value model (``value_model=``): PPO with a critic on asynchronous
rollouts.

The rollout worker scores each sample (its reward travels in the sample's metrics) and stamps a group
advantage on it; with a value model that advantage is not used. At each optimizer step, in the trainer:

1. the *current* value model walks the step's trie without gradients (values at training time, not at
   generation: a sample generated several versions ago is valued by today's critic);
2. GAE per sample over its trained tokens (:func:`~trl_dta.train.critic.gae.gae`: the tokens the policy
   produced, tool responses left out), its reward on its last trained token; advantages whitened over the
   step's trained tokens of every rank;
3. the policy's walk takes these per-token advantages (TRL's loss, or the decoupled one);
4. the value model is walked on the same trie with the value loss (one implementation:
   :class:`~trl_dta.train.critic.gae.ValueRowLoss`; its old values are the values of step 1, so the value clip
   does not bind), normalised as the policy's loss (the micro-batch's trained tokens per rank, the
   accumulation steps), and steps its own optimizer after the step's last micro-batch
   (:class:`~trl_dta.train.critic.hooks.ValueModelMixin`'s, as the synchronous trainer's).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from ..critic.gae import ValueRowLoss, value_targets
from .loss import AsyncSample


def check_episodes(args, given: dict) -> None:
    """Refuse GAE with ``gamma`` or ``lam`` below 1 where a conversation can reach the trainer as several
    rows. TRL's rollout worker forks a multi-turn conversation into a new row when its re-tokenised prompt
    drifts (``fork_threshold_tokens``), and stamps the episode's whole reward on each row; GAE here runs per
    row, each row's last trained token taken as the episode's end. At ``gamma = lam = 1`` (the defaults)
    that is exact: every policy token's advantage is the reward less its value, ``R - V_t``, in whichever
    row it is trained, once. Below 1 each earlier row would be discounted from its own end, not the
    episode's. Rows can fork where the worker runs tools or environments (multi-turn) or is a custom one
    (its rows unknown); single-turn rollouts from TRL's worker are one row each. ``given``: the trainer's
    arguments by name (``AsyncGRPOTrainer.__init__``'s)."""
    gamma, lam = getattr(args, "gamma", 1.0), getattr(args, "lam", 1.0)
    names = {
        "tools": "tools",
        "environment_factory": "environment_factory",
        "rollout_worker": "a custom rollout_worker",
    }
    sources = [said for name, said in names.items() if given.get(name)]
    if sources and (gamma < 1.0 or lam < 1.0):
        raise ValueError(
            f"AsyncTreePPOTrainer with a value model and gamma={gamma}, lam={lam}: with "
            f"{' and '.join(sources)} a conversation can reach the trainer as several rows (TRL's rollout "
            "worker forks one where its re-tokenised prompt drifts), each with the episode's whole reward, "
            "and GAE would discount each row from its own end. Set gamma=1.0 and lam=1.0 (then every policy "
            "token's advantage is the episode's, R - V), or use TreePPOTrainer."
        )


def sample_targets(
    samples: Sequence[AsyncSample],
    values: Sequence[torch.Tensor],
    *,
    gamma: float,
    lam: float,
    whiten_advantages: bool,
    sum_over_processes: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], dict[str, float]]:
    """Per sample, the advantages and returns of its trained tokens, by
    :func:`~trl_dta.train.critic.gae.value_targets` on the samples as rows (``values[k]``: sample ``k``'s
    values at its trained tokens; its reward on the last one); and the step's ``value/*`` metrics. A sample
    no reward function scored (TRL's rollout worker gives it a NaN reward) gets advantages and returns of 0
    and stays out of the whitening and the metrics, as an unscorable rollout in
    :class:`~trl_dta.TreePPOTrainer`: :func:`scorable` says which."""
    sizes = [v.numel() for v in values]
    device = values[0].device if values else torch.device("cpu")
    old = torch.zeros(len(values), max(sizes, default=0), device=device)
    mask = torch.zeros(old.shape, dtype=torch.long, device=device)
    for k, (s, v) in enumerate(zip(samples, values, strict=True)):
        old[k, : v.numel()], mask[k, : v.numel()] = v.float(), int(scorable(s))
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64, device=device)
    fields, metrics = value_targets(mask, rewards, old, gamma=gamma, lam=lam,
                                    whiten_advantages=whiten_advantages,
                                    sum_over_processes=sum_over_processes)  # fmt: skip
    advantages, returns = fields["advantages"], fields["returns"]
    return (
        [advantages[k, :n] for k, n in enumerate(sizes)],
        [returns[k, :n] for k, n in enumerate(sizes)],
        metrics,
    )


def scorable(sample: AsyncSample) -> bool:
    """Whether a reward function scored ``sample`` (TRL's rollout worker gives an unscorable one NaN)."""
    return not math.isnan(sample.reward)


class SampleValueLoss:
    """The value model's walk loss for a step's samples (``(k, values, _) -> scalar``): sample ``k``'s value
    loss at its trained tokens (:class:`~trl_dta.train.critic.gae.ValueRowLoss` on one row), over its
    micro-batch's normaliser and the accumulation steps; 0 for an unscorable sample (:func:`scorable`)."""

    def __init__(self, samples, old_values, returns, normalisers, accumulation, cliprange_value):
        self.samples = samples
        self.rows = [
            ValueRowLoss(
                torch.full((1, v.numel()), float(scorable(s)), device=v.device),
                v[None],
                r[None],
                normalisers[s.batch] * accumulation,
                cliprange_value,
            )  # fmt: skip
            for s, v, r in zip(samples, old_values, returns, strict=True)
        ]

    def __call__(self, k: int, values: torch.Tensor, _=None) -> torch.Tensor:
        s = self.samples[k]
        return self.rows[k](0, values[s.positions.to(values.device)])
