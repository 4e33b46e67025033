"""One walk of a trainer step: the rows of several TRL micro-batches in one prefix trie, each row's loss
that of its own micro-batch, and each micro-batch's share of the results in TRL's (B, T) shapes.

:func:`build_trie` puts the rows in a trie and records, per trie sequence, its :class:`Owner`
(micro-batch, row, prompt length). :class:`StepLosses` is the walk's ``loss_fn``: it computes a row's loss
with its micro-batch's :class:`~trl_dta.train.ppo_losses.RowLoss` and collects the detached log-probs,
entropies and loss sums per micro-batch, which :meth:`StepLosses.results` hands back as one
:class:`Walked` each. It keeps each value by sequence, so a walk run again after running out of memory
(:mod:`trl_dta.walk.recovery`) overwrites what the failed walk collected instead of adding to it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..trie import PrefixTrie
from .ppo_rows import batch_rows


class Owner(NamedTuple):
    """Where a trie sequence comes from: row ``row`` of micro-batch ``batch``, whose prompt has
    ``prompt_length`` tokens (its completion's log-probs start at index ``prompt_length - 1``)."""

    batch: int
    row: int
    prompt_length: int


def build_trie(batches: Sequence[dict], keep_prompt_only: bool) -> tuple[PrefixTrie | None, list[Owner]]:
    """One trie of the rows of ``batches``, and per trie sequence its :class:`Owner`. Rows with no completion
    token have no loss and are left out, unless ``keep_prompt_only`` (MoE models: TRL's load-balancing loss
    counts every token of the attention mask, the prompt of such a row too)."""
    seqs, owners = [], []
    for b, inputs in enumerate(batches):
        for i, row in enumerate(batch_rows(inputs)):
            if row.prompt_length == 0 or (row.completion_length == 0 and not keep_prompt_only):
                continue
            if len(row.tokens) < 2:
                raise ValueError(f"row {i} has a single token; the tree walk needs at least two per row.")
            seqs.append(row.tokens)
            owners.append(Owner(b, i, row.prompt_length))
    return (PrefixTrie.from_sequences(seqs) if seqs else None), owners


def scatter(values: Sequence[torch.Tensor], owners: Sequence[Owner], shapes, device) -> list[torch.Tensor]:
    """Per micro-batch, a zero (B, T) tensor with each sequence's completion values (1-D, from the first
    completion position on) written into its row."""
    out = [torch.zeros(shape, device=device) for shape in shapes]
    for owner, value in zip(owners, values, strict=True):
        out[owner.batch][owner.row, : value.numel()] = value
    return out


@dataclass
class Walked:
    """One micro-batch's share of a walk: TRL-shaped (B, T) log-probs and entropies (detached), the MoE aux
    value, the sum of its row losses and of their magnitudes, and its aux term (coefficient applied)."""

    logps: torch.Tensor
    entropies: torch.Tensor
    aux: torch.Tensor | None
    policy: float
    magnitude: float
    aux_term: float = 0.0


class StepLosses:
    """The walk's ``loss_fn`` for the rows of ``batches``: row losses by ``row_losses[batch]`` (a callable
    ``(row, logps, entropies) -> scalar``), with the values each micro-batch needs collected on the way."""

    def __init__(self, batches: Sequence[dict], owners: Sequence[Owner], row_losses: Sequence[Callable]):
        self.owners, self.row_losses = owners, row_losses
        shapes = [b["completion_ids"].shape for b in batches]
        device = batches[0]["completion_ids"].device
        self.logps = [torch.zeros(s, device=device) for s in shapes]
        self.entropies = [torch.zeros(s, device=device) for s in shapes]
        # per micro-batch, by trie sequence: each row's loss and its magnitude
        self.totals: list[dict[int, torch.Tensor]] = [{} for _ in batches]
        self.magnitudes: list[dict[int, torch.Tensor]] = [{} for _ in batches]

    def __call__(self, index: int, lp: torch.Tensor, ent: torch.Tensor) -> torch.Tensor:
        b, i = self.owners[index].batch, self.owners[index].row
        n = lp.numel()
        if n == 0:  # a prompt-only row, kept for the MoE load-balancing loss: no policy loss
            return lp.new_zeros(())
        self.logps[b][i, :n], self.entropies[b][i, :n] = lp.detach(), ent.detach()
        loss = self.row_losses[b](i, lp, ent)
        self.totals[b][index] = loss.detach()
        self.magnitudes[b][index] = loss.detach().abs()
        return loss

    def results(self, auxes: Sequence[torch.Tensor | None], aux_terms: Sequence[float]) -> list[Walked]:
        """Each micro-batch's :class:`Walked`, with its MoE aux value and term (None, 0.0: dense models)."""

        def total(terms: dict[int, torch.Tensor]) -> float:
            return float(sum(t.double() for t in terms.values()))

        return [
            Walked(lp, ent, aux, total(tot), total(mag), term)
            for lp, ent, aux, tot, mag, term in zip(
                self.logps, self.entropies, auxes, self.totals, self.magnitudes, aux_terms, strict=True
            )
        ]
