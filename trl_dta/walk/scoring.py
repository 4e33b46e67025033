"""Which positions the walk scores, and each sequence's log-probs along the walk's stack.

What a scored position gives is the walk's head (:mod:`trl_dta.walk.heads`): log-probs (and entropies), a
value model's values, or the hidden states themselves; output index ``t`` comes from the hidden state at
position ``t`` (the state before token ``t + 1``, where the log-prob of token ``t + 1`` is read), whatever
the head. Below, "log-probs" names those outputs.

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
from .errors import ArgumentTypeError
from .heads import default_head


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
    lm,
    hiddens,
    ids,
    start,
    parent_hidden,
    temperature: float,
    entropies: bool,
    froms,
    entropy_grad=True,
    head=None,
):
    """The head's outputs (log-probs, and entropies) of each row's tokens (``hiddens[r]``: [L_r, D],
    ``ids[r]``: [L_r], at positions ``start..``): position ``t`` scores token ``t + 1`` (output index ``t``),
    and the parent's last hidden state scores the segment's first token (none at the root). Row ``r`` is
    scored from index ``max(froms[r], start - 1)`` on; returns, per row, the outputs, entropies and that
    first index. ``head`` (:mod:`trl_dta.walk.heads`; default: ``lm``'s) runs on all rows' positions together,
    in its own chunks.
    ``start`` and ``parent_hidden`` are shared by the rows (sibling leaves), or lists with one per row (the
    segments of a packed subtree). ``entropy_grad=False``: entropies are values only (no graph)."""
    head = default_head(lm) if head is None else head
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
        empty = head.nothing(hiddens[0])
        return [empty] * len(ids), ([empty] * len(ids) if entropies else None), firsts
    out, ent = head.score(lm, torch.cat(inputs), torch.cat(targets), temperature, entropies, entropy_grad)
    return list(out.split(counts)), (list(ent.split(counts)) if entropies else None), firsts
