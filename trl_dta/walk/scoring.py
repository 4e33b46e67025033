"""Which positions the walk scores, and each sequence's log-probs along the walk's stack.

For a value model (:attr:`~trl_dta.walk.model.CausalLM.value_head`) the same bookkeeping carries values:
value index ``t`` is the head applied to the hidden state at position ``t`` (the state before token
``t + 1``, where the log-prob of token ``t + 1`` is read), in the log-probs' slot.

A sequence needs its log-probs from some index on (``score_from``: for a training row, its prompt length - 1;
``lp[t] = log p(seq[t+1] | seq[:t+1])``). A trie node scores from the smallest index any sequence through
it needs, or from its own first index, so the LM head runs only where some loss reads and every sequence's
scored indices are contiguous along its path. The executor holds the stack; these functions do the
bookkeeping.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

from ..trie import PrefixTrie, TrieNode
from .budgets import HEAD_ROWS
from .errors import ArgumentTypeError


def scored_from(trie: PrefixTrie, score_from: Sequence[int] | None):
    """Per sequence, and per node the smallest over the sequences through it: the first log-prob index to
    score. A node scores from there (or from its own first index), so each sequence's scored indices
    are contiguous along its path."""
    if score_from is None:
        return [0] * len(trie), None
    score_from = score_from.tolist() if hasattr(score_from, "tolist") else list(score_from)  # tensor, array
    for i, first in enumerate(score_from):
        if isinstance(first, bool) or not isinstance(first, numbers.Integral):
            raise ArgumentTypeError(f"score_from[{i}] must be an int (a log-prob index), got {first!r}")
    if len(score_from) != len(trie):
        raise ValueError(f"score_from has {len(score_from)} entries for {len(trie)} sequences")
    node_from: dict[TrieNode, int] = {}
    for i, first in enumerate(score_from):
        if not 0 <= first <= trie.sequence_length(i) - 1:
            raise ValueError(f"score_from[{i}] = {first} is outside [0, {trie.sequence_length(i) - 1}]")
        for node in trie.path(i):
            node_from[node] = min(node_from.get(node, first), first)
    return [int(f) for f in score_from], node_from


def path_scores(stack, logps, ents, leaf_from: int, seq_from: int, above=()):
    """A sequence's log-probs (and entropies) from its index ``seq_from`` on: the scored part of each
    segment on the stack, then of the ``above`` pieces (``(logps, entropies, first index)`` of the segments of
    a packed subtree on the sequence's path, root first), then ``logps``/``ents`` of a leaf row (which start
    at index ``leaf_from``)."""
    pieces = [(f.logps_in, f.entropies_in, f.lp_from) for f in stack] + list(above)
    if logps is not None:
        pieces.append((logps, ents, leaf_from))
    cut = [max(0, seq_from - first) for _, _, first in pieces]
    cat_lp = torch.cat([lp[c:] for (lp, _, _), c in zip(pieces, cut, strict=True)])
    if pieces[0][1] is None:
        return cat_lp, None
    return cat_lp, torch.cat([e[c:] for (_, e, _), c in zip(pieces, cut, strict=True)])


def score_rows(
    lm, hiddens, ids, start, parent_hidden, temperature: float, entropies: bool, froms, entropy_grad=True
):
    """Log-probs (and entropies) of each row's tokens (``hiddens[r]``: [L_r, D], ``ids[r]``: [L_r], at
    positions ``start..``): the logits of position ``t`` score token ``t + 1`` (log-prob index ``t``),
    and the parent's last hidden state scores the segment's first token (none at the root). Row ``r``
    is scored from index ``max(froms[r], start - 1)`` on; returns, per row, the log-probs, entropies and
    that first index. The LM head runs on all rows' positions together, :data:`HEAD_ROWS` at a time (so that
    its float32 logits and their gradients are never alive for more positions at once). ``start`` and
    ``parent_hidden`` are shared by the rows (sibling leaves), or lists with one per row (the segments of a
    packed subtree). ``entropy_grad=False``: entropies are values only (no graph, half the saved bytes)."""
    rows = len(ids)
    starts = start if isinstance(start, (list, tuple)) else [start] * rows
    parents = parent_hidden if isinstance(parent_hidden, (list, tuple)) else [parent_hidden] * rows
    inputs, targets, firsts = [], [], []
    for h, t, first, begin, parent in zip(hiddens, ids, froms, starts, parents, strict=True):
        end = begin + t.numel() - 1  # one past the segment's last log-prob index
        first = min(max(first, begin - 1, 0), end)
        if first < begin:  # the parent's last hidden state scores the first token
            inputs.append(torch.cat([parent.reshape(1, -1).to(h.dtype), h[: end - begin]]))
        else:
            inputs.append(h[first - begin : end - begin])
        targets.append(t[first + 1 - begin : end + 1 - begin])
        firsts.append(first)
    counts = [t.numel() for t in targets]
    if sum(counts) == 0:
        empty = hiddens[0].new_zeros(
            0, dtype=torch.float64 if hiddens[0].dtype == torch.float64 else torch.float32
        )
        return [empty] * len(ids), ([empty] * len(ids) if entropies else None), firsts
    lps, ents = [], []
    for rows_in, rows_target in zip(
        torch.cat(inputs).split(HEAD_ROWS), torch.cat(targets).split(HEAD_ROWS), strict=True
    ):
        if lm.value_head:  # a value model: the head's one output per position (no target, no entropy)
            lps.append(lm.logits(rows_in, 1.0).squeeze(-1))
            continue
        logp_all = torch.log_softmax(lm.logits(rows_in, temperature), dim=-1)
        lps.append(logp_all.gather(-1, rows_target[:, None]).squeeze(-1))
        if entropies:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                ents.append(-(logp_all.exp() * logp_all).sum(-1))
    lp = torch.cat(lps) if len(lps) > 1 else lps[0]
    ent = (torch.cat(ents) if len(ents) > 1 else ents[0]) if entropies else None
    return list(lp.split(counts)), (list(ent.split(counts)) if entropies else None), firsts
