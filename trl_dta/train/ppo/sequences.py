""":class:`~trl_dta.TreePPOTrainer`'s side of the step seam (:mod:`trl_dta.train.step`): a step's TRL
micro-batches as the walk's sequences, each row's loss that of its own micro-batch, and the walk's values
back in TRL's (B, T) shapes.

:func:`step_sequences` turns the rows of several micro-batches into the walk's sequences
(:class:`~trl_dta.train.step.StepSequence`) and records, per sequence, its :class:`Owner` (micro-batch, row,
prompt length). :class:`RowLosses` is the walk's loss function: a row's loss by its micro-batch's
:class:`~trl_dta.train.ppo.losses.RowLoss`. :func:`walked_batches` reads the step's
:class:`~trl_dta.train.step.SequenceResults` (kept by sequence: a walk run again after running out of memory
overwrites them) into one :class:`Walked` per micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..step_results import SequenceResults, StepSequence
from .rows import batch_rows


class Owner(NamedTuple):
    """Where a walk sequence comes from: row ``row`` of micro-batch ``batch``, whose prompt has
    ``prompt_length`` tokens (its completion's log-probs start at index ``prompt_length - 1``)."""

    batch: int
    row: int
    prompt_length: int


def step_sequences(batches: Sequence[dict], keep_prompt_only: bool) -> tuple[list[StepSequence], list[Owner]]:
    """The rows of ``batches`` as the walk's sequences (scored from their completion on), and per sequence
    its :class:`Owner`. Rows with no completion token have no loss and are left out, unless
    ``keep_prompt_only`` (MoE models: TRL's load-balancing loss counts every token of the attention mask, the
    prompt of such a row too)."""
    seqs, owners = [], []
    for b, inputs in enumerate(batches):
        for i, row in enumerate(batch_rows(inputs)):
            if row.prompt_length == 0 or (row.completion_length == 0 and not keep_prompt_only):
                continue
            if len(row.tokens) < 2:
                raise ValueError(f"row {i} has a single token; the tree walk needs at least two per row.")
            seqs.append(StepSequence(row.tokens, b, row.prompt_length - 1))
            owners.append(Owner(b, i, row.prompt_length))
    return seqs, owners


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


class RowLosses:
    """The walk's loss function for a step's sequences: sequence ``k``'s loss by its micro-batch's row loss
    (``row_losses[batch]``, a callable ``(row, logps, entropies) -> scalar``). It only computes: the values
    are kept by the step's result store."""

    def __init__(self, owners: Sequence[Owner], row_losses: Sequence[Callable]):
        self.owners, self.row_losses = owners, row_losses

    def __call__(self, k: int, lp: torch.Tensor, ent: torch.Tensor) -> torch.Tensor:
        owner = self.owners[k]
        if lp.numel() == 0:  # a prompt-only row, kept for the MoE load-balancing loss: no policy loss
            return lp.new_zeros(())
        return self.row_losses[owner.batch](owner.row, lp, ent)


def walked_batches(
    results: SequenceResults, owners: Sequence[Owner], batches: Sequence[dict], auxes, aux_terms
) -> list[Walked]:
    """Each micro-batch's :class:`Walked` from the step's per-sequence results, with its MoE aux value and
    term (None and 0.0 for dense models, or a micro-batch with no sequence: then a zero aux for MoE)."""
    shapes = [b["completion_ids"].shape for b in batches]
    device = batches[0]["completion_ids"].device
    logps = [torch.zeros(s, device=device) for s in shapes]
    entropies = [torch.zeros(s, device=device) for s in shapes]
    members: list[list[int]] = [[] for _ in batches]
    for k, owner in enumerate(owners):
        lp, ent = results.logps[k], results.entropies[k]
        if lp is None or lp.numel() == 0:  # (not scored, or a prompt-only row)
            continue
        logps[owner.batch][owner.row, : lp.numel()] = lp
        entropies[owner.batch][owner.row, : lp.numel()] = ent
        members[owner.batch].append(k)
    return [
        Walked(lp, ent, aux, results.total(ks), results.total(ks, absolute=True), term)
        for lp, ent, aux, ks, term in zip(logps, entropies, auxes, members, aux_terms, strict=True)
    ]
