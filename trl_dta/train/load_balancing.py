"""TRL's MoE load-balancing loss over the sequences of a prefix trie, value and exact gradient.

TRL adds ``router_aux_loss_coef * aux`` to the loss of MoE models, where ``aux`` is Mixtral's
``load_balancing_loss_func`` over the router logits of every real token of every row of the micro-batch, all
router layers concatenated (TRL uses that one function for every MoE family). With ``p = softmax(logits)``
per token and layer, ``C[e]`` the number of (token, layer) pairs whose top-k picks expert ``e``, ``S[e]`` the
sum of ``p[e]`` and ``M`` the number of (token, layer) pairs:

    aux = E * <C, S> / M**2

The top-k counts ``C`` carry no gradient, so ``d aux = E / M**2 * sum <C, dp>`` over every (token, layer): a
sum of per-token terms, which the tree walk can backpropagate node by node, once ``C`` is known. A token
shared by ``w`` sequences appears ``w`` times in the dense batch with the same ``p``, so a trie node of
multiplicity ``w`` gets the vector ``v = w * E * C / M**2`` and the walk backpropagates ``<v, p>`` for each of
its tokens and layers (:meth:`TreeExecutor.backward`'s ``router_grad``,
:mod:`trl_dta.walk.router`). ``C`` (and ``S``, for the value)
come from one forward of the trie's unique tokens without a graph (:meth:`TreeExecutor.router_stats`).
``tests/test_router_loss.py`` checks this against Mixtral's function and, end to end, against stock TRL.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..trie import PrefixTrie, TrieNode
from ..walk.router import RouterStats


def node_weights(trie: PrefixTrie, sequences: Iterable[int]) -> dict[TrieNode, int]:
    """For each trie node, how many of ``sequences`` (indices into the trie) pass through it."""
    weights: dict[TrieNode, int] = {}
    for i in sequences:
        for node in trie.path(i):
            weights[node] = weights.get(node, 0) + 1
    return weights


def load_balancing_loss(
    stats: RouterStats, weights: dict[TrieNode, int], num_experts: int
) -> tuple[torch.Tensor, dict[TrieNode, torch.Tensor]]:
    """The load-balancing loss of the sequences whose tokens have multiplicities ``weights`` (a float32
    scalar), and per node the vector ``v`` whose ``<v, softmax(logits)>`` terms, summed over the node's
    tokens and router layers, have the loss's gradient."""
    counts = sum(w * stats.counts[n] for n, w in weights.items())
    probs = sum(w * stats.probs[n] for n, w in weights.items())
    pairs = stats.layers * sum(w * n.num_tokens for n, w in weights.items())
    scale = num_experts / float(pairs) ** 2
    value = scale * (counts * probs).sum()
    return value, {n: (w * scale) * counts for n, w in weights.items()}


def step_router_grad(executor, trie: PrefixTrie, owners, coef: float, auxes: list, aux_terms: list) -> dict:
    """A step's walk of several micro-batches: each micro-batch's load-balancing loss (into ``auxes``, times
    ``coef`` into ``aux_terms``), and the summed per-node vectors the walk backpropagates (``router_grad``);
    ``owners``: each trie sequence's :class:`~trl_dta.train.ppo.sequences.Owner`."""
    stats = executor.router_stats(trie)
    router_grad: dict = {}
    for b in range(len(auxes)):
        weights = node_weights(trie, [k for k, owner in enumerate(owners) if owner.batch == b])
        if not weights:
            continue
        auxes[b], v = load_balancing_loss(stats, weights, executor.lm.num_experts)
        aux_terms[b] = coef * float(auxes[b])
        for node, x in v.items():
            router_grad[node] = router_grad.get(node, 0) + coef * x
    return router_grad
