"""The output head as a seam: what a walk computes at its scored positions, from their hidden states, and
hands to a sequence's loss along its path.

A walk scores a position once, in the segment that holds it, and a sequence's loss reads the scored outputs of
every segment on its path (:func:`~trl_dta.walk.scoring.path_scores`); their gradients reach each segment
through its handles (:mod:`trl_dta.walk.state`). What is scored is the executor's :class:`Head`
(``TreeExecutor(model, head=...)``):

* :class:`LogProbs` (the default): each position's log-prob of the next token, and its entropy; the LM head
  and the log-softmax run :data:`HEAD_ROWS` positions at a time;
* :class:`Values` (a value model's default): the value head's one output per position;
* :class:`HiddenStates`: the last hidden states themselves ``[n, D]``; the loss applies the model's output
  head (``TreeExecutor.head_logits``: the LM head with the config's logit scale, soft-capping and a
  temperature) chunk by chunk (:func:`chunked`), so a loss over the whole vocabulary (a distillation
  divergence) is walked without a ``[tokens, vocab]`` tensor ever existing whole.

A head also says what it costs (:meth:`Head.scored_bytes`, :meth:`Head.chunk_bytes`): the memory model
(:func:`~trl_dta.walk.memory.memory_model.activation_bytes`) counts what the stack keeps per scored position
and the head's chunk. A new head is one class here with these three methods, and a test against dense
autograd.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch.utils.checkpoint import checkpoint

HEAD_ROWS = 1024  # the LM head runs on at most this many positions at once


class Head(Protocol):
    """What a walk computes at its scored positions (module docstring)."""

    def score(
        self,
        lm,
        hidden: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        entropies: bool,
        entropy_grad: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The outputs of positions ``hidden`` [N, D] whose next tokens are ``targets`` [N]: a tensor whose
        first dimension is N, and the entropies [N] (or None)."""

    def scored_bytes(self, vocab: int, hidden: int, element: int, entropy_grad: bool) -> int:
        """Bytes the stack keeps per scored position (its saved tensors and handles)."""

    def chunk_bytes(self, vocab: int) -> int:
        """Bytes per position of the head's chunk while it runs (logits and their gradient)."""

    def nothing(self, hidden: torch.Tensor) -> torch.Tensor:
        """The outputs of no position (a call whose rows score nothing), like those of ``hidden``'s."""


class LogProbs:
    """Log-probs of the next tokens, and entropies (module docstring)."""

    def score(self, lm, hidden, targets, temperature, entropies, entropy_grad):
        lps, ents = [], []
        for rows, target in zip(hidden.split(HEAD_ROWS), targets.split(HEAD_ROWS), strict=True):
            logp_all = torch.log_softmax(lm.logits(rows, temperature), dim=-1)
            lps.append(logp_all.gather(-1, target[:, None]).squeeze(-1))
            if entropies:
                with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                    ents.append(-(logp_all.exp() * logp_all).sum(-1))
        return torch.cat(lps), (torch.cat(ents) if entropies else None)

    def scored_bytes(self, vocab, hidden, element, entropy_grad):
        return (
            8 if entropy_grad else 4
        ) * vocab + element * hidden  # log-softmax (+ entropy), the head's input

    def chunk_bytes(self, vocab):
        return 8 * vocab

    def nothing(self, hidden):
        return hidden.new_zeros(0, dtype=torch.float64 if hidden.dtype == torch.float64 else torch.float32)


class Values(LogProbs):
    """A value model's head: one output per position (no target, no entropy)."""

    def score(self, lm, hidden, targets, temperature, entropies, entropy_grad):
        values = [lm.logits(rows, 1.0).squeeze(-1) for rows in hidden.split(HEAD_ROWS)]
        return torch.cat(values), None

    def scored_bytes(self, vocab, hidden, element, entropy_grad):
        return super().scored_bytes(1, hidden, element, entropy_grad)

    def chunk_bytes(self, vocab):
        return 8


class HiddenStates:
    """The scored positions' last hidden states ``[n, D]``; the loss applies the output head itself, chunk by
    chunk (:func:`chunked`). No entropies; the walk's temperature must be 1 (the loss passes its own to
    ``TreeExecutor.head_logits``)."""

    def score(self, lm, hidden, targets, temperature, entropies, entropy_grad):
        return hidden, None

    def scored_bytes(self, vocab, hidden, element, entropy_grad):
        return 4 * hidden + element * hidden  # a float32 handle of each scored state, and the state

    def chunk_bytes(self, vocab):
        return 8 * vocab  # the loss's chunk: its logits and their gradient

    def nothing(self, hidden):
        return hidden.reshape(-1, hidden.shape[-1])[:0]


def default_head(lm) -> Head:
    """The head a walk through ``lm`` scores with unless told: a value model's values, else log-probs."""
    return Values() if lm.value_head else LogProbs()


def chunked(
    loss_of_rows: Callable[[torch.Tensor, int], torch.Tensor], hidden: torch.Tensor, rows: int = HEAD_ROWS
) -> torch.Tensor:
    """``sum_k loss_of_rows(hidden[k : k + rows], k)``, each chunk checkpointed: whatever ``loss_of_rows``
    makes of its rows (the output head's logits over the vocabulary) exists for at most ``rows`` positions at
    once, in the forward and again in the backward (recomputed from the chunk's hidden states)."""
    total = None
    for k in range(0, hidden.shape[0], rows):
        chunk = hidden[k : k + rows]
        if torch.is_grad_enabled() and chunk.requires_grad:
            term = checkpoint(loss_of_rows, chunk, k, use_reentrant=False, preserve_rng_state=False)
        else:
            term = loss_of_rows(chunk, k)
        total = term if total is None else total + term
    return hidden.new_zeros(()) if total is None else total
