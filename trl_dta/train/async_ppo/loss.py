""":class:`~trl_dta.AsyncTreePPOTrainer`'s loss: TRL's asynchronous GRPO loss, per rollout sample.

TRL's ``AsyncGRPOTrainer.compute_loss`` takes, over a micro-batch, a token-level clipped surrogate: for
each trained token ``p`` of a sample (``completion_mask[p] == 1``, ``p >= 1``; log-prob ``p - 1`` scores
it) with the sample's behaviour log-prob ``old_log_probs[p]`` (the vLLM server's, under the policy version
that generated the sample) and the sample's advantage ``A``::

    ratio = exp(logp - old);  term = -min(ratio * A, clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * A)
    loss  = sum(terms) / max(tokens_of_micro_batch / world_size, 1) / gradient_accumulation_steps

The sum splits by sample, so each sample's share is its own terms with its micro-batch's constants:
:class:`ClippedSurrogate` is that share, the walk's per-sequence loss. A sample keeps its own behaviour
log-probs and hence its own importance weight, whichever policy version produced it and whatever prefix it
shares with samples of other versions in the step's trie.

**The decoupled objective** (``use_decoupled_loss``, AReaL's, for stale samples): the ratio is taken against
the *proximal* policy, the trainer's weights when a proximal pass starts, and each token is weighted by the
importance weight ``w = π_prox / π_behav``, capped (:class:`Decoupled`)::

    ratio = exp(logp - prox);  term = -min(ratio * A, clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * A) * w

With one optimizer step per pass (``ppo_n_minibatches=1``, the default) the proximal policy *is* the policy of
the step's walk: the proximal log-probs are the gradient walk's own log-probs, detached, with no second pass.
The ratio is then 1 in value, the clip never binds, and the gradient of a token is ``-A · w · ∇logp``: the
stale token keeps its gradient, weighted, where the coupled objective clips it away. With
``ppo_n_minibatches=k > 1`` a no-gradient pass computes the proximal log-probs of k steps' samples once,
before the first of the k updates (:mod:`~trl_dta.train.async_ppo.minibatches`; each sample carries them,
``AsyncSample.proximal``): from the second update on the ratio moves and the clip holds the policy near the
proximal one. :func:`dense_loss` computes the proximal log-probs of a sample without a pass by a separate
no-gradient forward, so the tests check the first claim.

:func:`micro_batch_samples` reads a collated micro-batch (:mod:`trl_dta.train.async_ppo.data`) into
:class:`AsyncSample` records; :func:`dense_loss` is the same loss by a plain forward of each sample (the
reference the tests and ``tree_check_gradients`` compare the walk against); :func:`surrogate_sums` the sums
behind TRL's metrics (ratio, kl, entropy, clip ratios).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from ..step_results import StepSequence


class AsyncSample(NamedTuple):
    """One rollout sample of a step, as the walk sees it."""

    tokens: list[int]  # input_ids (prompt, completion, tool results: the whole row)
    batch: int  # its micro-batch in the step
    score_from: int  # first log-prob index the walk scores: the first trained token's, minus one
    positions: torch.Tensor  # indices into the scored log-probs (from score_from) of its trained tokens (CPU)
    old_logps: torch.Tensor  # the behaviour (vLLM) log-probs of those tokens (CPU, float32)
    advantage: float
    version: int = -1  # the policy version that generated it (-1: unknown)
    reward: float = 0.0  # its reward (the rollout worker's), for a value model's GAE
    row: int = 0  # its row in the collated micro-batch
    # from a proximal pass (ppo_n_minibatches > 1: async_ppo/minibatches.py), at its trained tokens; else None
    proximal: torch.Tensor | None = None  # the proximal policy's log-probs
    old_values: torch.Tensor | None = None  # with a value model: its values then (the value clip's)
    returns: torch.Tensor | None = None  # with a value model: GAE's returns then (its advantages: advantage)

    def sequence(self) -> StepSequence:
        """The sample as a sequence of its step's walk."""
        return StepSequence(self.tokens, self.batch, self.score_from)


def tokens_per_rank(inputs: dict, world_size: int = 1) -> float:
    """TRL's normaliser of a micro-batch: its trained tokens over all ranks (``counts[:, 0]``, written by the
    collator) divided by the world size, at least 1."""
    return max(float(inputs["counts"][0, 0]) / world_size, 1.0)


def step_samples(batches) -> list[AsyncSample]:
    """The samples of a step's micro-batches ``batches`` (:func:`micro_batch_samples`), each with its
    micro-batch's index."""
    return [s for b, inputs in enumerate(batches) for s in micro_batch_samples(inputs, b)]


def micro_batch_samples(inputs: dict, batch: int = 0) -> list[AsyncSample]:
    """The samples of a collated micro-batch (:class:`~trl_dta.train.async_ppo.data.SampleCollator`'s keys)
    that have a trained token; a sample without one (a zero-weight row among them) adds no loss term, so the
    walk leaves it out."""
    keys = ("input_ids", "completion_mask", "old_log_probs", "advantages", "lengths")
    ids, masks, old, advantages, lengths = (inputs[k].cpu() for k in keys)  # (one copy, not one per sample)
    versions = inputs["versions"].tolist() if "versions" in inputs else [-1] * len(lengths)
    rewards = inputs["rewards"].tolist() if "rewards" in inputs else [0.0] * len(lengths)
    passed = {k: inputs[k].cpu() for k in PASS_FIELDS if k in inputs}  # (a proximal pass's, aligned as old)
    samples = []
    for i, length in enumerate(lengths.tolist()):
        trained = torch.nonzero(masks[i, 1:length], as_tuple=True)[0] + 1  # token indices p with a loss term
        if trained.numel() == 0:
            continue
        score_from = int(trained[0]) - 1
        at = {k: v[i, trained] for k, v in passed.items()}
        advantage = at["token_advantages"] if "token_advantages" in at else float(advantages[i])
        samples.append(
            AsyncSample(
                tokens=ids[i, :length].tolist(),
                batch=batch,
                score_from=score_from,
                positions=trained - 1 - score_from,
                old_logps=old[i, trained],
                advantage=advantage,
                version=int(versions[i]),
                reward=float(rewards[i]),
                row=i,
                proximal=at.get("proximal_log_probs"),
                old_values=at.get("old_values"),
                returns=at.get("returns"),
            )
        )
    return samples


PASS_FIELDS = ("proximal_log_probs", "old_values", "returns", "token_advantages")
"""What a proximal pass adds to a collated micro-batch (``[N, L]`` each, aligned with ``old_log_probs``: token
``p``'s value at ``p``, set at trained tokens): :mod:`~trl_dta.train.async_ppo.minibatches`."""


class Decoupled(NamedTuple):
    """The decoupled objective's importance weight: its ``cap`` (None: none) and ``mode``, ``"mask"`` (a token
    over the cap leaves the loss, AReaL's filter) or ``"truncate"`` (its weight is clamped to the cap)."""

    cap: float | None = 5.0
    mode: str = "mask"

    def weights(self, proximal: torch.Tensor, behaviour: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token, the capped weight ``exp(proximal - behaviour)`` and whether it was over the cap."""
        weight = torch.exp(proximal - behaviour)
        if self.cap is None:
            return weight, torch.zeros_like(weight, dtype=torch.bool)
        over = weight > self.cap
        if self.mode == "mask":
            return torch.where(over, 0.0, weight), over
        return weight.clamp(max=self.cap), over


class ClippedSurrogate:
    """The walk's per-sequence loss (``(k, logps, entropies) -> scalar``, only computing): sample ``k``'s
    share of TRL's loss, ``logps`` being its log-probs from ``score_from`` on.

    Args:
        samples: the step's samples, indexed as the walk's sequences.
        normalisers: per micro-batch of the step, :func:`tokens_per_rank`.
        epsilon_low, epsilon_high: the clipping range ``[1 - epsilon_low, 1 + epsilon_high]``.
        accumulation: the gradient accumulation steps the loss is divided by (1 in evaluation).
        decoupled: the decoupled objective's weight settings (None: TRL's coupled objective).
        proximal: with ``decoupled``, per sample the proximal log-probs of its trained tokens; None: each
            sample's own (``AsyncSample.proximal``, a proximal pass's), else the walk's, detached (exact with
            one optimizer step per pass: module docstring).
    """

    def __init__(
        self,
        samples: Sequence[AsyncSample],
        normalisers: Sequence[float],
        epsilon_low: float,
        epsilon_high: float,
        accumulation: int,
        decoupled: Decoupled | None = None,
        proximal: Sequence[torch.Tensor] | None = None,
    ):
        self.samples, self.normalisers = samples, normalisers
        self.epsilon_low, self.epsilon_high, self.accumulation = epsilon_low, epsilon_high, accumulation
        self.decoupled, self.proximal = decoupled, proximal

    def __call__(self, k: int, logps: torch.Tensor, entropies: torch.Tensor | None = None) -> torch.Tensor:
        s = self.samples[k]
        lp = logps[s.positions.to(logps.device)]
        old = s.old_logps.to(device=lp.device, dtype=lp.dtype)
        weight = 1.0
        if self.decoupled is not None:  # the ratio against the proximal policy, the capped weight
            old = proximal_of(s, lp) if self.proximal is None else self.proximal[k].to(lp)
            weight, _ = self.decoupled.weights(old, s.old_logps.to(lp))
        ratio = torch.exp(lp - old)
        clipped = torch.clamp(ratio, 1 - self.epsilon_low, 1 + self.epsilon_high)
        advantage = _on(s.advantage, lp)  # (a float, or per token with a value model)
        per_token = -torch.min(ratio * advantage, clipped * advantage) * weight
        return per_token.sum() / self.normalisers[s.batch] / self.accumulation


def proximal_of(s: AsyncSample, logps: torch.Tensor) -> torch.Tensor:
    """Sample ``s``'s proximal log-probs at its trained tokens, beside ``logps`` (the policy's now): its
    proximal pass's, else ``logps`` detached (the policy of the step is the proximal one)."""
    return logps.detach() if s.proximal is None else s.proximal.to(logps)


def dense_loss(
    model,
    inputs: dict,
    epsilon_low: float,
    epsilon_high: float,
    temperature: float = 1.0,
    accumulation: int = 1,
    world_size: int = 1,
    decoupled: Decoupled | None = None,
) -> torch.Tensor:
    """TRL's asynchronous GRPO loss of one collated micro-batch by a plain forward of each sample (full
    logits, ``log_softmax`` at ``temperature``): the dense reference of the walk, with its graph. With
    ``decoupled``, the decoupled objective, its proximal log-probs from a separate no-gradient forward of
    ``model`` as it is now."""
    samples = micro_batch_samples(inputs)
    device = next(model.parameters()).device

    def logps_of(s):
        ids = torch.tensor([s.tokens], device=device)
        logits = model(input_ids=ids).logits[0, :-1] / temperature
        return torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None])[s.score_from :, 0]

    proximal = None
    if decoupled is not None:  # (a proximal pass's where the samples have one)
        with torch.no_grad():
            proximal = [
                s.proximal if s.proximal is not None else logps_of(s)[s.positions.to(device)] for s in samples
            ]
    loss_fn = ClippedSurrogate(
        samples,
        [tokens_per_rank(inputs, world_size)],
        epsilon_low,
        epsilon_high,
        accumulation,
        decoupled,
        proximal,
    )
    total = None
    for k, s in enumerate(samples):
        loss = loss_fn(k, logps_of(s))
        total = loss if total is None else total + loss
    if total is None:  # (no trained token: a zero that still depends on the model)
        total = sum(p.sum() * 0.0 for p in model.parameters() if p.requires_grad)
    return total


def surrogate_sums(
    logps: torch.Tensor,
    old: torch.Tensor,
    advantage: float,
    entropies: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
) -> torch.Tensor:
    """One sample's sums behind TRL's metrics, over its trained tokens: ``[ratio, kl (k3), entropy,
    low-clipped, high-clipped, region-clipped, count]`` (float64)."""
    logps, old, entropies = logps.double(), old.to(logps.device).double(), entropies.double()
    advantage = _on(advantage, logps)
    log_ratio = logps - old
    ratio = torch.exp(log_ratio)
    low, high = clipped_tokens(ratio, advantage, epsilon_low, epsilon_high)
    count = torch.tensor(float(logps.numel()), dtype=torch.float64, device=logps.device)
    clipped = [mask.double().sum() for mask in (low, high, low | high)]
    return torch.stack([ratio.sum(), ((ratio - 1) - log_ratio).sum(), entropies.sum(), *clipped, count])


def clipped_tokens(ratio: torch.Tensor, advantage, epsilon_low: float, epsilon_high: float):
    """TRL's ``(low, high)`` token masks, where the clipped surrogate's clip binds (its gradient is zero): the
    ratio below ``1 - epsilon_low`` with a negative advantage, above ``1 + epsilon_high`` with a positive one
    (``advantage``: a float, or per token)."""
    advantage = _on(advantage, ratio)
    return (ratio < 1 - epsilon_low) & (advantage < 0), (ratio > 1 + epsilon_high) & (advantage > 0)


def importance_sums(logps: torch.Tensor, behaviour: torch.Tensor, decoupled: Decoupled) -> torch.Tensor:
    """One sample's decoupled-objective metrics over its trained tokens (``logps``: the proximal log-probs):
    ``[weight sum, tokens over the cap, largest weight]`` (float64; weights before capping)."""
    weight = torch.exp(logps.double() - behaviour.to(logps.device).double())
    _, over = decoupled.weights(logps.double(), behaviour.to(logps.device).double())
    largest = weight.max() if weight.numel() else weight.new_zeros(())
    return torch.stack([weight.sum(), over.double().sum(), largest])


def _on(advantage, like: torch.Tensor):
    """A sample's advantage beside ``like``: a float as it is; per-token advantages on its device, dtype."""
    return advantage if isinstance(advantage, float) else advantage.to(like)


def padded_logps(model, inputs: dict, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's dense path for a collated micro-batch: one forward of its right-padded rows (``input_ids`` with
    an attention mask from ``lengths``), ``(N, L - 1)`` log-probs of each next token at ``temperature``
    (with their graph) and entropies (detached)."""
    ids = inputs["input_ids"]
    mask = torch.arange(ids.shape[1], device=ids.device)[None, :] < inputs["lengths"].to(ids.device)[:, None]
    logits = model(input_ids=ids, attention_mask=mask.long()).logits[:, :-1].float() / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    entropies = -(log_probs.detach().exp() * log_probs.detach()).sum(-1)
    return log_probs.gather(-1, ids[:, 1:, None])[..., 0], entropies
