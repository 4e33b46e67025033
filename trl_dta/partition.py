"""Split a step's rollouts across data-parallel ranks: contiguous runs of the lexicographic order with
balanced unique-token cost.

Sorted lexicographically, sequences that share prefixes sit next to each other, so a contiguous run of
that order keeps its sharing: the cost of a run (the unique tokens of its prefix trie) is the first
sequence's length plus, for each following sequence, its length minus its longest common prefix with its
predecessor. That cost only grows when a run is extended on either side, so for a threshold ``T`` the
greedy scan (extend the current run while its cost stays <= T, else start a new one) uses the fewest runs
possible; binary search on ``T`` then gives the smallest maximum cost over all contiguous splits of the
order into ``num_parts`` runs. Each cut duplicates the prefix that the two sequences on either side of it
share (their LCP), at most ``(num_parts - 1) x`` the longest sequence in all. Among the splits that reach
the smallest maximum cost, a dynamic program over the cut positions (range-minimum queries, ``O(num_parts x
n log n)`` vectorised) picks the one that duplicates the fewest tokens, i.e. that cuts at the shallowest
branch points (between groups rather than inside one).

The lexicographic order is not the order the tree walk visits sequences (:meth:`PrefixTrie.dfs_order`, which
puts leaves and shallow subtrees first); both keep a shared prefix's sequences together, but only the
lexicographic order makes a run's cost the simple sum above.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from .token_sequences import convert, neighbour_lcp
from .trie import PrefixTrie

__all__ = ["LexicographicPartitionSampler", "lexicographic_partition"]


def _lexicographic(sequences: Sequence[Any]) -> tuple[list[int], np.ndarray, np.ndarray]:
    """(order, lengths, lcp) of ``sequences`` in lexicographic order (a prefix before its extensions, ties by
    index, as :meth:`PrefixTrie.lexicographic_order`): ``lengths[k]`` of the k-th sequence of the order and
    ``lcp[k]`` its longest common prefix with the one before (``lcp[0] = 0``). Any length is fine, 0 included:
    a partition needs no scored token."""
    converted = [convert(s, i, min_length=0) for i, s in enumerate(sequences)]
    if not converted:
        return [], np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    arrays, keys = zip(*converted, strict=True)
    order = sorted(range(len(arrays)), key=keys.__getitem__)
    lengths = np.array([len(a) for a in arrays], dtype=np.int64)
    lcp = np.array(neighbour_lcp(list(arrays), lengths, order), dtype=np.int64)
    return order, lengths[order], lcp


def _runs(starts_cost: np.ndarray, cum: np.ndarray, threshold: int, n: int) -> list[int] | None:
    """Greedy cut points (run starts) for ``threshold``, or None if a single sequence exceeds it."""
    starts, a = [], 0
    while a < n:
        if starts_cost[a] > threshold:
            return None
        starts.append(a)
        # largest b with cost(a..b-1) = len_a + cum[b] - cum[a+1] <= threshold
        a = int(np.searchsorted(cum, threshold - starts_cost[a] + cum[a + 1], side="right")) - 1
    return starts


def _weighted(lengths: np.ndarray, lcp: np.ndarray, costs) -> tuple[np.ndarray, np.ndarray]:
    """(cost of a run's first sequence, cost each next one adds) by the call costs ``costs`` (a
    :class:`~trl_dta.walk.cost.costs.CallCost`, fitted on the device: :mod:`trl_dta.walk.cost.cost_model`), in
    integer units: its new tokens, their attention pairs on its path (every earlier position) and one call's
    fixed cost (a new trie node is about one call). A run's cost still only grows when it is extended, so the
    search below is unchanged."""

    def seconds(new_from: np.ndarray) -> np.ndarray:
        tokens = lengths - new_from
        pairs = (lengths * (lengths + 1) - new_from * (new_from + 1)) / 2
        return np.where(tokens > 0, costs.fixed, 0.0) + costs.per_token * tokens + costs.per_pair * pairs

    start, increments = seconds(np.zeros_like(lengths)), seconds(lcp)
    unit = max(float(increments.sum()), 1e-30) / 2**40  # (integer units, far finer than any call)
    return np.ceil(start / unit).astype(np.int64), np.ceil(increments / unit).astype(np.int64)


def lexicographic_partition(
    sequences: Sequence[Any] | PrefixTrie, num_parts: int, costs=None
) -> list[list[int]]:
    """Indices of ``sequences`` for each of ``num_parts`` parts: contiguous runs of the lexicographic order
    whose largest unique-token cost is the smallest possible over all such splits.

    ``sequences`` are token-id sequences (lists, 1-D arrays or tensors of ids in ``[0, 2**32)``, of any
    length, empty included) or an already built :class:`PrefixTrie`. Every index appears in exactly one
    part; within a part, indices are in lexicographic order. Runs that cost more than others are split
    further while there are fewer runs than parts, so every part gets sequences when there are at least
    ``num_parts``; with fewer sequences than parts, each of the first ``len(sequences)`` parts gets one and
    the remaining parts are empty.

    ``costs``: a :class:`~trl_dta.walk.cost.costs.CallCost` (the fitted one of the device that walks the
    parts: :meth:`TreeExecutor.fitted_costs`), to balance the parts' predicted walk time instead of their
    unique tokens (:func:`_weighted`); every rank must pass the same one (one rank's, broadcast).
    """
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    if isinstance(sequences, PrefixTrie):
        order = sequences.lexicographic_order()
        lengths = np.array([sequences.sequence_length(i) for i in order], dtype=np.int64)
        lcp = np.array(sequences.lexicographic_lcp(), dtype=np.int64)
    else:
        order, lengths, lcp = _lexicographic(sequences)
    n = len(order)
    if n == 0:
        return [[] for _ in range(num_parts)]
    increments, start = lengths - lcp, lengths
    if costs is not None:
        start, increments = _weighted(lengths, lcp, costs)
    cum = np.concatenate([[0], np.cumsum(increments)])  # cum[k] = sum of increments before k
    # a run pays at least its largest increment; one run pays all
    lo, hi = int(increments.max()), int(cum[-1])
    while lo < hi:
        mid = (lo + hi) // 2
        runs = _runs(start, cum, mid, n)
        if runs is not None and len(runs) <= num_parts:
            hi = mid
        else:
            lo = mid + 1
    parts_wanted = min(num_parts, n)
    starts = _fewest_duplicates(start, cum, lcp, lo, parts_wanted)
    bounds = list(zip(starts, [*starts[1:], n], strict=True))
    parts = [order[a:b] for a, b in bounds]
    return parts + [[] for _ in range(num_parts - len(parts))]


def _fewest_duplicates(start, cum, lcp, threshold: int, parts: int) -> list[int]:
    """Run starts of a split into exactly ``parts`` runs, each costing <= ``threshold``, that minimises the
    duplicated tokens (the sum of the LCPs at the cuts). ``f[k][b]``: least duplication splitting the first
    ``b`` sequences into ``k`` runs; the last run ``[a, b)`` is feasible for ``a`` in a window ``[lo_b, b)``
    (a run's cost shrinks as its start moves right), so each layer is one batch of range-minimum queries."""
    n = len(start)
    lcp = lcp.astype(np.float64)  # lcp[a]: tokens duplicated by a cut before sequence a
    # cost(a, b) = start[a] - cum[a + 1] + cum[b] <= threshold  <=>  h[a] <= threshold - cum[b];
    # h is non-increasing
    h = start - cum[1:]
    b = np.arange(1, n + 1)
    lo = np.searchsorted(-h, -(threshold - cum[b]), side="left")  # first a with h[a] <= threshold - cum[b]
    f = np.where(lo == 0, 0.0, np.inf)  # one run: [0, b) feasible iff lo_b == 0
    f = np.concatenate([[np.inf], f])  # f[b] for b = 0..n (no runs can cover 0 sequences in k >= 1 runs)
    choices = []
    for k in range(2, parts + 1):
        g = f + np.concatenate([lcp, [np.inf]])  # cut before sequence a, a = 0..n
        low = np.maximum(lo, k - 1)
        best, arg = _range_min(g, low, b - 1)
        f = np.concatenate([[np.inf], best])
        choices.append(arg)
    if not np.isfinite(f[n]):
        raise AssertionError("no split at the optimal threshold: please report this input")
    starts, end = [], n
    for arg in reversed(choices):
        end = int(arg[end - 1])
        starts.append(end)
    return [0] + starts[::-1]


def _range_min(values: np.ndarray, left: np.ndarray, right: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """min and argmin of ``values[left[i] : right[i] + 1]`` for every i (inf where the range is empty),
    with a sparse table."""
    size = len(values)
    levels = [values]
    index = [np.arange(size)]
    width = 1
    while 2 * width <= size:
        v, ix = levels[-1], index[-1]
        a, c = v[: size - 2 * width + 1], v[width : size - width + 1]
        pick = c < a
        levels.append(np.where(pick, c, a))
        index.append(np.where(pick, ix[width : size - width + 1], ix[: size - 2 * width + 1]))
        width *= 2
    empty = right < left
    length = np.where(empty, 1, right - left + 1)
    level = np.floor(np.log2(length)).astype(np.int64)
    out_v = np.full(len(left), np.inf)
    out_i = np.zeros(len(left), dtype=np.int64)
    for j in np.unique(level):
        sel = (level == j) & ~empty
        lo, hi = left[sel], right[sel] - (1 << int(j)) + 1
        v1, v2 = levels[j][lo], levels[j][hi]
        pick = v2 < v1
        out_v[sel] = np.where(pick, v2, v1)
        out_i[sel] = np.where(pick, index[j][hi], index[j][lo])
    return out_v, out_i


class LexicographicPartitionSampler(Sampler[int]):
    """Like ``DistributedSampler``, but the indices of ``sequences`` are split with
    :func:`lexicographic_partition`: this rank gets one contiguous run of the lexicographic order, with
    balanced unique-token cost across ranks.

    Args:
        sequences: the step's rollouts as token-id sequences, identical on every rank (gathered).
        num_replicas: number of ranks (default: the process group's world size, else 1).
        rank: this rank (default: the process group's rank, else 0).
        costs: balance by these call costs (:func:`lexicographic_partition`), the same on every rank.
    """

    def __init__(
        self, sequences: Sequence[Any], num_replicas: int | None = None, rank: int | None = None, costs=None
    ):
        if num_replicas is None or rank is None:
            import torch.distributed as dist

            ready = dist.is_available() and dist.is_initialized()
            if num_replicas is None:
                num_replicas = dist.get_world_size() if ready else 1
            if rank is None:
                rank = dist.get_rank() if ready else 0
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in [0, {num_replicas})")
        self.num_replicas, self.rank = num_replicas, rank
        self.indices = lexicographic_partition(sequences, num_replicas, costs)[rank]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)
