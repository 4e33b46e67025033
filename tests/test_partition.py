"""dfs_partition: contiguous in the DFS order, covers every index once, optimal max cost (brute force)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_dta import PrefixTrie
from trl_dta.partition import DFSPartitionSampler, dfs_partition, part_cost

sequences = st.lists(st.lists(st.integers(0, 3), min_size=2, max_size=9), min_size=1, max_size=12)


def brute_force_optimum(trie, num_parts):
    """Over every split of the lexicographic order into exactly min(num_parts, n) runs: the smallest max
    part cost, and the fewest duplicated tokens (sum of part costs - global unique) among those."""
    order = trie.lexicographic_order()
    n = len(order)
    scores = []
    for cuts in itertools.combinations(range(1, n), min(num_parts, n) - 1):
        bounds = zip((0, *cuts), (*cuts, n))
        costs = [part_cost(trie, order[a:b]) for a, b in bounds]
        scores.append((max(costs), sum(costs) - trie.num_unique_tokens))
    return min(scores)


@settings(max_examples=200, deadline=None)
@given(seqs=sequences, num_parts=st.integers(1, 5))
def test_partition_is_contiguous_complete_and_optimal(seqs, num_parts):
    trie = PrefixTrie.from_sequences(seqs)
    parts = dfs_partition(seqs, num_parts)
    assert len(parts) == num_parts
    order = trie.lexicographic_order()
    flat = [i for part in parts for i in part]
    assert flat == order  # contiguous runs of the DFS order, in order, each index exactly once
    assert sum(1 for p in parts if p) == min(num_parts, len(seqs))  # no empty part unless too few sequences
    costs = [part_cost(trie, p) for p in parts if p]
    assert (max(costs), sum(costs) - trie.num_unique_tokens) == brute_force_optimum(trie, num_parts)


def test_groups_stay_together_when_balanced():
    shared = list(range(100, 140))
    groups = [[shared + [g] * 20 + [k] * (5 + k) for k in range(4)] for g in range(4)]
    seqs = [s for group in groups for s in group]
    parts = dfs_partition(seqs, 4)
    assert sorted(sorted(p) for p in parts) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]


def test_fewer_sequences_than_parts():
    parts = dfs_partition([[1, 2], [1, 3]], 4)
    assert parts == [[0], [1], [], []]


def test_sampler_yields_this_ranks_part():
    seqs = [[1, 2, 3, k, k] for k in range(10)]
    parts = dfs_partition(seqs, 3)
    for rank in range(3):
        sampler = DFSPartitionSampler(seqs, num_replicas=3, rank=rank)
        assert list(sampler) == parts[rank] and len(sampler) == len(parts[rank])
    assert list(DFSPartitionSampler(seqs)) == list(range(10))  # no process group: one replica
    with pytest.raises(ValueError, match="rank 3"):
        DFSPartitionSampler(seqs, num_replicas=3, rank=3)
    with pytest.raises(ValueError, match="num_parts"):
        dfs_partition(seqs, 0)
