"""The walk schedule: the order in which the executor forwards and backpropagates a prefix trie.

A plan is a flat list of four kinds of steps, computed from the trie alone (no model, no tensors), so that
the executor's loop stays small and the schedule can be tested on its own:

* :class:`Push` forwards one *segment* (at most ``block_size`` tokens of a trie node) on top of the K/V of
  the segments already on the stack, and pushes it. ``keep_graph`` says whether its autograd graph is kept
  until it is popped; if not, it is forwarded without a graph now and recomputed with one when popped
  (chunked backward). ``terminals`` are the sequences that end with this segment.
* :class:`SiblingLeaves` forwards a batch of sibling leaf segments in one call on top of the stack,
  computes their sequences' losses and backpropagates them at once. A leaf is never forwarded without a
  graph (cut tail).
* :class:`PackedSubtree` does the same for a trie node and all its descendants, whole, in one call (see
  ``subtree_tokens`` below).
* :class:`Pop` backpropagates the top segment with the gradients its descendants sent into its K/V,
  last hidden state and log-probs, then frees it.

Rules:

* A trie node longer than ``block_size`` is cut into a chain of segments of ``block_size`` tokens, the last
  one holding the remainder; for a leaf node the last piece is the leaf.
* Pushed segments keep their graph while the tokens with a kept graph on the stack stay within
  ``block_size`` (greedy from the root down: the segments nearest the root are the ones every path
  shares). The others are recomputed at pop. With ``block_size`` at least the longest path, every token
  is forwarded exactly once.
* Sibling leaves (leaf children of the same node, at most ``block_size`` long) are batched in walk order
  while the batch's cost stays within ``batch_tokens``: the sum of their lengths when the executor packs
  them into one row (``packed``), ``rows x longest row`` when it pads them into a batch (walk order is
  shortest first, so padding stays small). ``batch_tokens=0`` forwards one leaf per call.
* Packed subtrees (``packed`` and ``subtree_tokens > 0``): an internal child whose subtree (the node and
  all its descendants) holds at most ``min(subtree_tokens, batch_tokens, block_size)`` tokens is one
  :class:`PackedSubtree` step, instead of a push, its children's steps and a pop: one forward and
  one backward call for the whole subtree (a tree-shaped causal mask), fewer and larger calls than the walk
  makes for it. The mask's attention is computed over the whole packed row, so the budget trades per-call
  overhead against attention work; one subtree per step.
* Children are visited in :meth:`PrefixTrie.walk_children` order.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..trie import PrefixTrie, TrieNode
from .checks import check_count


@dataclass(frozen=True)
class Segment:
    """Tokens ``[start, end)`` of the path through ``node`` (a piece of the node, or all of it)."""

    node: TrieNode
    start: int
    end: int
    terminals: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Push:
    segment: Segment
    keep_graph: bool


@dataclass(frozen=True)
class SiblingLeaves:
    """Leaf segments that are children of the stack's top, forwarded in one call (packed into one row, or a
    padded batch), their sequences' losses backpropagated at once."""

    segments: tuple[Segment, ...]


@dataclass(frozen=True)
class PackedSubtree:
    """A trie node under the stack's top and all its descendants, whole, forwarded in one packed row with a
    tree-shaped causal mask and backpropagated in one call. ``segments`` are whole trie nodes, each after its
    parent; ``parents[k]`` is the index in ``segments`` of segment ``k``'s parent (-1: the stack's top)."""

    segments: tuple[Segment, ...]
    parents: tuple[int, ...]


@dataclass(frozen=True)
class Pop:
    segment: Segment
    keep_graph: bool


Step = Push | SiblingLeaves | PackedSubtree | Pop


@dataclass
class _Builder:
    """Builds the plan depth-first without recursion (a trie may be thousands of nodes deep: the per-turn
    samples of one long conversation are each a prefix of the next). Each node being visited is a generator
    on an explicit stack; it yields the internal children the driver in :func:`build_plan` visits next."""

    trie: PrefixTrie
    block_size: int
    batch_tokens: int
    packed: bool
    subtree_tokens: int = 0
    steps: list[Step] = field(default_factory=list)
    graph_tokens: int = 0  # tokens with a kept graph currently on the stack
    _sizes: dict[TrieNode, int] = field(default_factory=dict)  # subtree tokens per node (packed subtrees)

    def __post_init__(self):
        if self.packed and self.subtree_tokens > 0:
            for node in reversed(list(self.trie.nodes())):  # children before parents
                self._sizes[node] = node.num_tokens + sum(self._sizes[c] for c in node.children)

    def _packs_subtree(self, node: TrieNode) -> bool:
        limit = min(self.subtree_tokens, self.batch_tokens, self.block_size)
        return self.packed and self.subtree_tokens > 0 and not node.is_leaf and self._sizes[node] <= limit

    def _subtree(self, node: TrieNode) -> PackedSubtree:
        segments, parents, todo = [], [], [(node, -1)]
        while todo:  # pre-order: a node before its children, children in walk order
            n, parent = todo.pop()
            segments.append(Segment(n, n.start, n.end, tuple(n.terminals)))
            parents.append(parent)
            todo.extend((c, len(segments) - 1) for c in reversed(self.trie.walk_children(n)))
        return PackedSubtree(tuple(segments), tuple(parents))

    def _pieces(self, node: TrieNode) -> list[Segment]:
        cuts = list(range(node.start, node.end, self.block_size)) + [node.end]
        pieces = [Segment(node, a, b) for a, b in itertools.pairwise(cuts)]
        last = pieces[-1]
        pieces[-1] = Segment(node, last.start, last.end, tuple(node.terminals))
        return pieces

    def _push(self, segment: Segment) -> Push:
        keep = self.graph_tokens + segment.num_tokens <= self.block_size
        if keep:
            self.graph_tokens += segment.num_tokens
        step = Push(segment, keep)
        self.steps.append(step)
        return step

    def _pop(self, push: Push) -> None:
        if push.keep_graph:
            self.graph_tokens -= push.segment.num_tokens
        self.steps.append(Pop(push.segment, push.keep_graph))

    def _flush(self, batch: list[Segment]) -> None:
        if batch:
            self.steps.append(SiblingLeaves(tuple(batch)))
            batch.clear()

    def _cost(self, batch: list[Segment]) -> int:
        lengths = [s.num_tokens for s in batch]
        return sum(lengths) if self.packed else len(lengths) * max(lengths)

    def children(self, node: TrieNode) -> Iterator[TrieNode]:
        """Steps for the children of ``node``; yields each child to visit whole before going on."""
        batch: list[Segment] = []
        for child in self.trie.walk_children(node):
            if child.is_leaf and child.num_tokens <= self.block_size:
                segment = self._pieces(child)[0]
                if batch and self._cost(batch + [segment]) > self.batch_tokens:
                    self._flush(batch)
                batch.append(segment)
                continue
            self._flush(batch)
            if self._packs_subtree(child):
                self.steps.append(self._subtree(child))
            else:
                yield child
        self._flush(batch)

    def visit(self, node: TrieNode) -> Iterator[TrieNode]:
        """Pushes of ``node``'s segments, its children's steps (yielding the children to visit), its pops."""
        pieces = self._pieces(node)
        if node.is_leaf:  # a leaf longer than a block: a chain of pushes ending in a one-leaf step
            pieces, tail = pieces[:-1], pieces[-1]
        pushes = [self._push(p) for p in pieces]
        if node.is_leaf:
            self.steps.append(SiblingLeaves((tail,)))
        else:
            yield from self.children(node)
        for push in reversed(pushes):
            self._pop(push)


def build_plan(
    trie: PrefixTrie, block_size: int, batch_tokens: int, packed: bool = False, subtree_tokens: int = 0
) -> list[Step]:
    """The list of steps that walks ``trie`` (see the module docstring for the rules); ``packed``: sibling
    leaves are forwarded packed into one row (their budget counts their tokens, not padded rows), and
    subtrees of at most ``subtree_tokens`` tokens are packed whole (0: never)."""
    block_size = check_count("block_size", block_size, minimum=1)
    batch_tokens = check_count("batch_tokens", batch_tokens)
    subtree_tokens = check_count("subtree_tokens", subtree_tokens)
    builder = _Builder(trie, block_size, batch_tokens, packed, subtree_tokens)
    visiting = [builder.children(trie.root)]  # the nodes being visited, root first
    while visiting:
        child = next(visiting[-1], None)
        if child is None:
            visiting.pop()
        else:
            visiting.append(builder.visit(child))
    return builder.steps
