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

:func:`micro_batch_samples` reads a collated micro-batch (:mod:`trl_dta.train.ppo_async_data`) into
:class:`AsyncSample` records; :func:`dense_loss` is the same loss by a plain forward of each sample (the
reference the tests and ``tree_check_gradients`` compare the walk against); :func:`surrogate_sums` the sums
behind TRL's metrics (ratio, kl, entropy, clip ratios).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch


class AsyncSample(NamedTuple):
    """One rollout sample of a step, as the walk sees it."""

    tokens: list[int]  # input_ids (prompt, completion, tool results: the whole row)
    batch: int  # its micro-batch in the step
    score_from: int  # first log-prob index the walk scores: the first trained token's, minus one
    positions: torch.Tensor  # indices into the scored log-probs (from score_from) of its trained tokens (CPU)
    old_logps: torch.Tensor  # the behaviour (vLLM) log-probs of those tokens (CPU, float32)
    advantage: float


def tokens_per_rank(inputs: dict, world_size: int = 1) -> float:
    """TRL's normaliser of a micro-batch: its trained tokens over all ranks (``counts[:, 0]``, written by the
    collator) divided by the world size, at least 1."""
    return max(float(inputs["counts"][0, 0]) / world_size, 1.0)


def micro_batch_samples(inputs: dict, batch: int = 0) -> list[AsyncSample]:
    """The samples of a collated micro-batch (:class:`~trl_dta.train.ppo_async_data.SampleCollator`'s keys)
    that have a trained token; a sample without one (a zero-weight row among them) adds no loss term, so the
    walk leaves it out."""
    keys = ("input_ids", "completion_mask", "old_log_probs", "advantages", "lengths")
    ids, masks, old, advantages, lengths = (inputs[k].cpu() for k in keys)  # (one copy, not one per sample)
    samples = []
    for i, length in enumerate(lengths.tolist()):
        trained = torch.nonzero(masks[i, 1:length], as_tuple=True)[0] + 1  # token indices p with a loss term
        if trained.numel() == 0:
            continue
        score_from = int(trained[0]) - 1
        samples.append(
            AsyncSample(
                tokens=ids[i, :length].tolist(),
                batch=batch,
                score_from=score_from,
                positions=trained - 1 - score_from,
                old_logps=old[i, trained],
                advantage=float(advantages[i]),
            )
        )
    return samples


class ClippedSurrogate:
    """The walk's per-sequence loss (``(k, logps, entropies) -> scalar``, only computing): sample ``k``'s
    share of TRL's loss, ``logps`` being its log-probs from ``score_from`` on.

    Args:
        samples: the step's samples, indexed as the walk's sequences.
        normalisers: per micro-batch of the step, :func:`tokens_per_rank`.
        epsilon_low, epsilon_high: the clipping range ``[1 - epsilon_low, 1 + epsilon_high]``.
        accumulation: the gradient accumulation steps the loss is divided by (1 in evaluation).
    """

    def __init__(self, samples: Sequence[AsyncSample], normalisers: Sequence[float], epsilon_low: float,
                 epsilon_high: float, accumulation: int):  # fmt: skip
        self.samples, self.normalisers = samples, normalisers
        self.epsilon_low, self.epsilon_high, self.accumulation = epsilon_low, epsilon_high, accumulation

    def __call__(self, k: int, logps: torch.Tensor, entropies: torch.Tensor | None = None) -> torch.Tensor:
        s = self.samples[k]
        lp = logps[s.positions.to(logps.device)]
        old = s.old_logps.to(device=lp.device, dtype=lp.dtype)
        ratio = torch.exp(lp - old)
        clipped = torch.clamp(ratio, 1 - self.epsilon_low, 1 + self.epsilon_high)
        per_token = -torch.min(ratio * s.advantage, clipped * s.advantage)
        return per_token.sum() / self.normalisers[s.batch] / self.accumulation


def dense_loss(model, inputs: dict, epsilon_low: float, epsilon_high: float, temperature: float = 1.0,
               accumulation: int = 1, world_size: int = 1) -> torch.Tensor:  # fmt: skip
    """TRL's asynchronous GRPO loss of one collated micro-batch by a plain forward of each sample (full
    logits, ``log_softmax`` at ``temperature``): the dense reference of the walk, with its graph."""
    samples = micro_batch_samples(inputs)
    loss_fn = ClippedSurrogate(
        samples, [tokens_per_rank(inputs, world_size)], epsilon_low, epsilon_high, accumulation
    )
    device = next(model.parameters()).device
    total = None
    for k, s in enumerate(samples):
        ids = torch.tensor([s.tokens], device=device)
        logits = model(input_ids=ids).logits[0, :-1] / temperature
        logps = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
        loss = loss_fn(k, logps[s.score_from :])
        total = loss if total is None else total + loss
    if total is None:  # (no trained token: a zero that still depends on the model)
        total = sum(p.sum() * 0.0 for p in model.parameters() if p.requires_grad)
    return total


def surrogate_sums(logps: torch.Tensor, old: torch.Tensor, advantage: float, entropies: torch.Tensor,
                   epsilon_low: float, epsilon_high: float) -> torch.Tensor:  # fmt: skip
    """One sample's sums behind TRL's metrics, over its trained tokens: ``[ratio, kl (k3), entropy,
    low-clipped, high-clipped, region-clipped, count]`` (float64)."""
    logps, old, entropies = logps.double(), old.to(logps.device).double(), entropies.double()
    log_ratio = logps - old
    ratio = torch.exp(log_ratio)
    low = (ratio < 1 - epsilon_low) & (advantage < 0)
    high = (ratio > 1 + epsilon_high) & (advantage > 0)
    count = torch.tensor(float(logps.numel()), dtype=torch.float64, device=logps.device)
    clipped = [mask.double().sum() for mask in (low, high, low | high)]
    return torch.stack([ratio.sum(), ((ratio - 1) - log_ratio).sum(), entropies.sum(), *clipped, count])
