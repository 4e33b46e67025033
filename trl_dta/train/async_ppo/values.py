""":class:`~trl_dta.AsyncTreePPOTrainer`'s side of its value model (:class:`~trl_dta.train.critic.value_model.
ValueModel`): PPO with a critic on asynchronous rollouts.

The rollout worker scores each sample (its reward travels in the sample's metrics) and stamps a group
advantage on it; with a value model that advantage is not used. At each optimizer step, in the trainer
(:func:`sample_targets`):

1. the *current* value model walks the step's trie without gradients (values at training time, not at
   generation: a sample generated several versions ago is valued by today's critic), at each sample's
   trained tokens (the tokens the policy produced, tool responses left out);
2. GAE per sample, its reward on its last trained token; advantages whitened over the step's trained tokens
   of every rank; a sample no reward function scored (a NaN reward) gets none;
3. the policy's walk takes these per-token advantages (TRL's loss, or the decoupled one);
4. the value model is walked on the same trie with the value loss (its old values are the values of step
   1, so the value clip does not bind), normalised as the policy's loss (the micro-batch's trained tokens
   per rank, the accumulation steps), and steps its own optimizer after the step's last micro-batch.

With ``ppo_n_minibatches = k > 1``, steps 1-2 run once per proximal pass, over k optimizer steps' samples
(:func:`with_targets`, called by :mod:`~trl_dta.train.async_ppo.minibatches`; advantages whitened over the
pass): each sample carries its old values, returns and advantages to its step, and from the pass's second
update on the value clip (``cliprange_value``) binds as the policy's does.

GAE runs per row: :func:`check_episodes` refuses what that would get wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import isnan

from ..critic.value_model import ValueModel, ValueTarget
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
    critic: ValueModel,
    samples: Sequence[AsyncSample],
    sequences: Sequence,
    normalisers,
    accumulation: int,
    metrics,
    from_pass: bool = False,
) -> tuple[list[AsyncSample], list[ValueTarget]]:
    """Steps 1-2 (module docstring): the step's ``samples`` with per-token advantages, and each one's
    :class:`ValueTarget` for the value model's walk (step 4); the generation's ``value/*`` metrics logged
    into ``metrics``. ``from_pass``: the samples carry a proximal pass's old values, returns and advantages
    (``ppo_n_minibatches > 1``, :func:`with_targets` at the pass) and keep them: no walk here. Every rank
    passes the same ``from_pass`` (steps 1-2 have collectives)."""
    if not from_pass:
        samples = with_targets(critic, samples, sequences, metrics)
    losses = [
        ValueTarget(
            s.positions,
            s.old_values,
            s.returns,
            float(not isnan(s.reward)),
            normalisers[s.batch] * accumulation,
        )
        for s in samples
    ]
    return list(samples), losses


def with_targets(
    critic: ValueModel, samples: Sequence[AsyncSample], sequences: Sequence, metrics
) -> list[AsyncSample]:
    """Steps 1-2 for ``samples`` (a step's, or a proximal pass's): each with its values (``old_values``: the
    value clip's), GAE's ``returns`` and its per-token ``advantage``, whitened over them on every rank (a
    sample with a NaN reward gets zeros); the ``value/*`` metrics logged into ``metrics``."""
    values = critic.values(sequences, [s.positions for s in samples])
    targets = critic.targets(values, [s.reward for s in samples])
    for name, value in targets.metrics.items():
        metrics[name].append(value)
    return [
        s._replace(old_values=v, returns=r, advantage=a)
        for s, v, r, a in zip(samples, values, targets.returns, targets.advantages, strict=True)
    ]
