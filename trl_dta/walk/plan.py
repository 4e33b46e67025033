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
  makes for it. A dense mask's attention is computed over the whole packed row, so the budget trades
  per-call overhead against attention work; one subtree per step.
* With a cost model (``costs``, :mod:`trl_dta.walk.cost.costs`; the executor gives one where its budgets come
  from a memory budget) the budgets are limits and the model decides: a subtree of at most
  ``min(subtree_tokens, batch_tokens)`` tokens is packed where one call costs less than walking it, and
  consecutive children (leaves and packed subtrees) share one call, a :class:`PackedSubtree` with several
  roots, while that costs less than separate calls and stays within the budgets. A call costs its fixed
  cost plus its compute; where the fixed cost (kernel launches) overlaps compute (a GPU), the walk takes the
  larger of its summed launches and its summed compute instead, and the plan kept is the fastest of those
  built at several prices of a launch (:func:`_balanced`).
* Children are visited in :meth:`PrefixTrie.walk_children` order.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..trie import PrefixTrie, TrieNode
from .adapter.checks import check_count
from .cost.costs import CallCost, needed_pairs

# where a call's fixed cost overlaps compute (a GPU): the launch prices the plan may be built with, highest
# first (1: the summed cost; 0: merge only where it costs no compute), see _balanced
LAUNCH_PRICES = (4.0, 2.0, 1.0, *(2.0**-k for k in range(1, 11)), 0.0)
MIN_GAIN = 0.01  # a plan at another price than 1 must be this much faster by the cost model to be kept


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
    costs: CallCost | None = None
    key_weight: float = 0.0  # a gathered key position in tokens of a call's budget (attention per segment)
    steps: list[Step] = field(default_factory=list)
    graph_tokens: int = 0  # tokens with a kept graph currently on the stack
    _sizes: dict[TrieNode, int] = field(default_factory=dict)  # subtree tokens per node (packed subtrees)

    def __post_init__(self):
        if self.packed and self.subtree_tokens > 0:
            for node in reversed(list(self.trie.nodes())):  # children before parents
                self._sizes[node] = node.num_tokens + sum(self._sizes[c] for c in node.children)

    def _packs_subtree(self, node: TrieNode) -> bool:
        if not self.packed or self.subtree_tokens <= 0 or node.is_leaf:
            return False
        cap = min(self.subtree_tokens, self.batch_tokens)
        cap = min(cap, self.block_size) if self.costs is None else cap
        if self._sizes[node] > cap:
            return False
        unit = self._subtree(node)
        if self.key_weight and self._tokens([unit]) > cap:  # (its segments' keys count too)
            return False
        return self.costs is None or self._unit_cost([unit]) < self.costs.walked(
            [s.node for s in unit.segments]
        )

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

    # ---- one call for several children: sibling leaves, packed subtrees (units)
    def _flush(self, batch: list[PackedSubtree]) -> None:
        """One step for the batched units: sibling leaves, or (a subtree among them) a packed row of them."""
        if not batch:
            return
        if all(len(u.segments) == 1 for u in batch):
            self.steps.append(SiblingLeaves(tuple(u.segments[0] for u in batch)))
        elif len(batch) == 1:
            self.steps.append(batch[0])
        else:
            segments, parents = [], []
            for unit in batch:
                offset = len(segments)
                segments += unit.segments
                parents += [p if p < 0 else p + offset for p in unit.parents]
            self.steps.append(PackedSubtree(tuple(segments), tuple(parents)))
        batch.clear()

    def _tokens(self, batch: list[PackedSubtree]) -> float:
        lengths = [u.segments[0].num_tokens for u in batch]
        if self.packed or any(len(u.segments) > 1 for u in batch):
            segments = [s for u in batch for s in u.segments]
            keys = sum(s.end for s in segments) if len(segments) > 1 else 0  # (a segment's keys: its path)
            return sum(s.num_tokens for s in segments) + self.key_weight * keys
        return len(lengths) * max(lengths)  # padded rows

    def _unit_cost(self, batch: list[PackedSubtree]) -> float:
        segments = [s for u in batch for s in u.segments]
        past = segments[0].start if len(batch[0].segments) == 1 else batch[0].segments[0].start
        if not self.packed:
            width = max(s.num_tokens for s in segments)
            return self.costs.padded(past, len(segments), width)
        return self.costs.row(past, sum(s.num_tokens for s in segments), needed_pairs(segments))

    def _fits(self, batch: list[PackedSubtree], unit: PackedSubtree) -> bool:
        """Whether ``unit`` joins ``batch`` in one call: within the budgets, and (with a cost model) cheaper
        than two calls."""
        merged = batch + [unit]
        leaves = all(len(u.segments) == 1 for u in merged)
        if self.costs is None:  # fixed budgets: leaves fill a batch, a subtree is a call of its own
            return leaves and self._tokens(merged) <= self.batch_tokens
        cap = self.batch_tokens if leaves else min(self.batch_tokens, self.subtree_tokens)
        if self._tokens(merged) > cap:
            return False
        return self._unit_cost(merged) <= self._unit_cost(batch) + self._unit_cost([unit])

    def children(self, node: TrieNode) -> Iterator[TrieNode]:
        """Steps for the children of ``node``; yields each child to visit whole before going on."""
        batch: list[PackedSubtree] = []
        for child in self.trie.walk_children(node):
            if child.is_leaf and child.num_tokens <= self.block_size:
                unit = PackedSubtree((self._pieces(child)[0],), (-1,))
            elif self._packs_subtree(child):
                unit = self._subtree(child)
            else:
                self._flush(batch)
                yield child
                continue
            if batch and not self._fits(batch, unit):
                self._flush(batch)
            batch.append(unit)
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
    trie: PrefixTrie,
    block_size: int,
    batch_tokens: int,
    packed: bool = False,
    subtree_tokens: int = 0,
    costs: CallCost | None = None,
    key_weight: float = 0.0,
) -> list[Step]:
    """The list of steps that walks ``trie`` (see the module docstring for the rules); ``packed``: sibling
    leaves are forwarded packed into one row (their budget counts their tokens, not padded rows), and
    subtrees of at most ``subtree_tokens`` tokens are packed whole (0: never). ``costs``: decide by this cost
    model which calls to merge, within the budgets (None: fill each leaf batch up to its budget, and pack
    every subtree that fits, on its own). ``key_weight``: a packed row of several segments also counts the
    keys its segments attend (each segment's path up to its end: what attention per segment gathers,
    :mod:`trl_dta.walk.attention.segment_attention`), this many tokens each
    (:meth:`~trl_dta.walk.memory.budgets. ActivationBytes.key_weight`)."""
    block_size = check_count("block_size", block_size, minimum=1)
    batch_tokens = check_count("batch_tokens", batch_tokens)
    subtree_tokens = check_count("subtree_tokens", subtree_tokens)

    def build(price):
        priced = costs if price is None else costs.priced(price)
        return _build(trie, block_size, batch_tokens, packed, subtree_tokens, priced, key_weight)

    if costs is None or not costs.overlap:
        return build(None)
    return _balanced(build, costs, packed)


def _balanced(build, costs: CallCost, packed: bool) -> list[Step]:
    """Where a call's launches overlap compute, a walk takes the larger of its launches and its compute
    (:meth:`CallCost.walk`), which the summed price of each merge decision does not see: merging a call
    saves a launch even where launches are hidden behind compute, and a dense mask then computes attention
    pairs the tree does not need. So the plan is built at launch prices from :data:`LAUNCH_PRICES` (merging
    less as the price falls: more launches, less compute) and the fastest walk is kept, of the summed
    price's, the two extremes', and those of a bisection for where launches and compute cross (ties keep the
    higher price: fewer calls). Another plan replaces the summed price's only when it is at least
    ``MIN_GAIN`` faster."""
    seen: dict[int, tuple[float, float, list[Step]]] = {}  # price index -> (launches - compute, walk s, plan)

    def at(k: int):
        if k not in seen:
            steps = build(LAUNCH_PRICES[k])
            calls, compute = _tally(steps, costs, packed)
            seen[k] = (calls * costs.fixed - compute, costs.walk(calls, compute), steps)
        return seen[k]

    summed = LAUNCH_PRICES.index(1.0)
    at(summed)  # (the summed price's plan is a candidate: never slower than it)
    lo, hi = 0, len(LAUNCH_PRICES) - 1  # the highest price first
    if at(lo)[0] < 0 <= at(hi)[0]:  # bisect for the last compute-bound price (launches grow as it falls)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if at(mid)[0] < 0 else (lo, mid)
    best = min(seen, key=lambda k: (seen[k][1], k))
    if seen[best][1] > (1 - MIN_GAIN) * seen[summed][1]:  # (within the model's precision: keep it)
        best = summed
    return seen[best][2]


def _build(trie, block_size, batch_tokens, packed, subtree_tokens, costs, key_weight=0.0) -> list[Step]:
    builder = _Builder(trie, block_size, batch_tokens, packed, subtree_tokens, costs, key_weight)
    visiting = [builder.children(trie.root)]  # the nodes being visited, root first
    while visiting:
        child = next(visiting[-1], None)
        if child is None:
            visiting.pop()
        else:
            visiting.append(builder.visit(child))
    return builder.steps


def plan_seconds(steps: list[Step], costs: CallCost, packed: bool) -> float:
    """Seconds of a walk of ``steps`` by ``costs`` (:meth:`CallCost.walk`)."""
    return costs.walk(*_tally(steps, costs, packed))


def _tally(steps: list[Step], costs: CallCost, packed: bool) -> tuple[float, float]:
    """The forward + backward calls of a walk of ``steps`` and their compute seconds."""
    calls = tokens = pairs = 0.0
    for step in steps:
        c, t, p = step_terms(step, costs, packed)
        calls, tokens, pairs = calls + c, tokens + t, pairs + p
    return calls, costs.per_token * tokens + costs.per_pair * pairs


def step_terms(step: Step, costs: CallCost, packed: bool) -> tuple[float, int | float, int | float]:
    """What one step of a walk adds to its cost, as ``(calls, tokens, pairs)``: a push and its pop are one
    forward + backward call (counted at the push; a push recomputed at pop a third more, its extra forward),
    a leaves or subtree step one call; ``tokens`` forwarded and attention ``pairs`` computed as ``costs``
    counts them (its attention kind: dense or block-sparse masks). A pop adds nothing."""
    if isinstance(step, Push):
        s = step.segment
        share = 1.0 if step.keep_graph else 4 / 3
        return share, share * s.num_tokens, share * costs.row_pairs(s.start, s.num_tokens, needed_pairs([s]))
    if isinstance(step, SiblingLeaves | PackedSubtree):
        segments = step.segments
        past = segments[0].start
        if packed and (len(segments) > 1 or isinstance(step, PackedSubtree)):
            tokens = sum(s.num_tokens for s in segments)
            return 1.0, tokens, costs.row_pairs(past, tokens, needed_pairs(segments))
        rows, width = len(segments), max(s.num_tokens for s in segments)
        return 1.0, rows * width, rows * width * (past + width)
    return 0.0, 0, 0


def capacity(plan, packed: bool) -> int:
    """The most cache positions a forward of ``plan`` reaches (its start + its row's tokens)."""
    end = 0
    for step in plan:
        if isinstance(step, Push):
            end = max(end, step.segment.end)
        elif isinstance(step, SiblingLeaves | PackedSubtree):
            lengths = [s.num_tokens for s in step.segments]
            row = sum(lengths) if len(lengths) > 1 and packed else max(lengths)
            end = max(end, step.segments[0].start + max(row, 2))  # (padded: at least 2 wide)
    return end
