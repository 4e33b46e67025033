"""The FLOP-weighted ideal speedup of a walk: dense FLOPs / walk FLOPs.

The token dedup ratio (tokens / unique tokens) counts every token alike. A forward's cost per token is not
alike: the decoder's matmuls cost the same at every position, attention grows with the position, and the
LM head runs only where a loss reads (``score_from``), on both sides. With a large vocabulary and a small
model the head dominates, and a shared prompt the head never scores saves little: the token ratio then
overstates what sharing can give. Per token at position ``t`` (forward; the backward's factor is the same
on both sides and cancels):

* decoder matmuls: ``2 x`` the parameters a token runs through (embeddings and LM head excluded; for MoE
  layers, the shared ones plus ``top_k / num_experts`` of the experts');
* attention: ``4 x layers x heads x head_dim x (t + 1)`` (scores and weighted values over ``t + 1`` keys;
  windows and state layers are not modelled);
* LM head, on scored positions only: ``2 x hidden x vocab`` (a value model's d -> 1 head: ``2 x hidden``).

Dense: every sequence's tokens and its scored positions. Walk: every trie node's tokens once, at their
positions, and each node's scored positions once (what :func:`~trl_dta.walk.scoring.scored_from` makes the
walk score).
"""

from __future__ import annotations

from collections.abc import Sequence

from ...trie import PrefixTrie
from ..scoring import scored_from


def per_token_costs(lm) -> tuple[float, float, float]:
    """(decoder matmul FLOPs per token, attention FLOPs per key per token, LM head FLOPs per scored row) of a
    :class:`~trl_dta.walk.adapter.model.CausalLM`."""
    config = lm.config
    head = lm.lm_head.weight
    embeddings = lm.base.get_input_embeddings()
    skip = {id(head)} | ({id(embeddings.weight)} if embeddings is not None else set())
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    body = 0.0
    for name, p in lm.decoder.named_parameters():
        if id(p) in skip:
            continue
        share = top_k / experts if experts and top_k and ".experts." in f".{name}." else 1.0
        body += getattr(p, "ds_numel", p.numel()) * share  # (ZeRO-3 partitioned: ds_numel is the full size)
    heads = getattr(config, "num_attention_heads", 0) or 0
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else 0)
    attention = 4.0 * config.num_hidden_layers * heads * head_dim
    rows, columns = getattr(head, "ds_shape", head.shape)
    return 2.0 * body, attention, 2.0 * rows * columns


def _sum_positions(start: int, end: int) -> int:
    """Sum of ``t + 1`` for ``t`` in ``[start, end)``: the keys each position attends."""
    return (end * (end + 1) - start * (start + 1)) // 2


def flops(lm, trie: PrefixTrie, score_from: Sequence[int] | None = None) -> tuple[float, float]:
    """(dense FLOPs, walk FLOPs) of a forward of ``trie``'s sequences through ``lm`` (module docstring)."""
    body, attention, head = per_token_costs(lm)
    seq_from, node_from = scored_from(trie, score_from)
    dense = 0.0
    for i in range(len(trie)):
        n = trie.sequence_length(i)
        dense += body * n + attention * _sum_positions(0, n) + head * (n - 1 - seq_from[i])
    walk = 0.0
    for node in trie.nodes():
        first = 0 if node_from is None else node_from[node]
        scored = max(
            0, (node.end - 1) - max(node.start - 1, first, 0)
        )  # log-prob indices [start - 1, end - 1)
        walk += body * node.num_tokens + attention * _sum_positions(node.start, node.end) + head * scored
    return dense, walk
