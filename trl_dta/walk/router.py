"""MoE router terms along the walk: count router choices in a no-grad pass, and backpropagate a linear term
in each node's router probabilities.

A load-balancing loss such as TRL's (Mixtral's ``load_balancing_loss_func``) has, once the top-k counts are
known, the gradient of a sum of per-token terms ``<v, softmax(router logits)>`` (see
:mod:`trl_dta.train.load_balancing`): the walk backpropagates that sum node by node, with one vector ``v``
per trie node (:meth:`TreeExecutor.backward`'s ``router_grad``), and gets the counts from one forward of the
trie's unique tokens without a graph (:meth:`TreeExecutor.router_stats`, which fills :class:`RouterStats`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..trie import TrieNode


@dataclass
class RouterStats:
    """Per trie node, over its tokens and the model's router layers: how often each expert was among the
    top-k of ``softmax(router logits)`` (``counts``), and the summed router probabilities (``probs``), each
    [num_experts] float32; ``layers`` is the number of router layers."""

    counts: dict[TrieNode, torch.Tensor]
    probs: dict[TrieNode, torch.Tensor]
    layers: int

    def add(self, node: TrieNode, routers: list[torch.Tensor], top_k: int) -> None:
        """Fold one row of ``node``'s router logits (per router layer [L, E]) into the statistics."""
        self.layers = len(routers)
        for logits in routers:
            probs = torch.softmax(logits, dim=-1)  # in the logits' dtype, as TRL's loss does
            picked = torch.topk(probs, top_k, dim=-1).indices.reshape(-1)
            counts = torch.bincount(picked, minlength=probs.shape[-1]).float()
            self.counts[node] = self.counts.get(node, 0) + counts
            self.probs[node] = self.probs.get(node, 0) + probs.float().sum(0)


# Per trie node, a vector v [num_experts]: the walk backpropagates sum over the node's tokens and router
# layers of <v, softmax(router logits)> (TreeExecutor.backward's router_grad)
RouterGrad = Mapping[TrieNode, torch.Tensor]


def router_term(v: torch.Tensor, routers: list[torch.Tensor]) -> torch.Tensor:
    """``sum <v, softmax(logits)>`` over the rows of every router layer's logits [L, E], in float32."""
    return sum((torch.softmax(logits, dim=-1).float() @ v.float()).sum() for logits in routers)


def route(
    router: RouterGrad | RouterStats, node: TrieNode, routers: list[torch.Tensor], top_k: int
) -> torch.Tensor | None:
    """Fold one row's router logits (per router layer [L, E]) for ``node`` into ``router``'s statistics (a
    counting pass), or return its ``sum <v, softmax(logits)>`` term (a gradient walk; None where the node
    has no vector or no graph is being built)."""
    if isinstance(router, RouterStats):
        router.add(node, routers, top_k)
        return None
    v = router.get(node)
    if v is None or not torch.is_grad_enabled():
        return None
    return router_term(v, routers)
