"""lexicographic_partition: contiguous in the lexicographic order, covers every index once, optimal max cost
(brute force); any sequence length."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_dta import PrefixTrie
from trl_dta.partition import LexicographicPartitionSampler, lexicographic_partition

sequences = st.lists(st.lists(st.integers(0, 3), min_size=2, max_size=9), min_size=1, max_size=12)
any_length = st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=6), min_size=0, max_size=10)


def part_cost(seqs, part) -> int:
    """Unique tokens of the prefix trie of the sequences in ``part`` (a brute-force count)."""
    return len({tuple(seqs[i][: k + 1]) for i in part for k in range(len(seqs[i]))})


def lex_order(seqs) -> list[int]:
    return sorted(range(len(seqs)), key=lambda i: list(seqs[i]))  # stable: ties by index


def brute_force_optimum(seqs, num_parts):
    """Over every split of the lexicographic order into exactly min(num_parts, n) runs: the smallest max
    part cost, and the fewest duplicated tokens (sum of part costs - global unique) among those."""
    order = lex_order(seqs)
    n = len(order)
    unique = part_cost(seqs, order)
    scores = []
    for cuts in itertools.combinations(range(1, n), min(num_parts, n) - 1):
        bounds = zip((0, *cuts), (*cuts, n), strict=True)
        costs = [part_cost(seqs, order[a:b]) for a, b in bounds]
        scores.append((max(costs), sum(costs) - unique))
    return min(scores)


def check_partition(seqs, num_parts, parts):
    assert len(parts) == num_parts
    flat = [i for part in parts for i in part]
    assert flat == lex_order(seqs)  # contiguous runs of the lexicographic order, each index exactly once
    assert sum(1 for p in parts if p) == min(num_parts, len(seqs))  # no empty part unless too few sequences
    if seqs:
        costs = [part_cost(seqs, p) for p in parts if p]
        unique = part_cost(seqs, flat)
        assert (max(costs), sum(costs) - unique) == brute_force_optimum(seqs, num_parts)


@settings(max_examples=200, deadline=None)
@given(seqs=sequences, num_parts=st.integers(1, 5))
def test_partition_is_contiguous_complete_and_optimal(seqs, num_parts):
    trie = PrefixTrie.from_sequences(seqs)
    parts = lexicographic_partition(seqs, num_parts)
    assert [i for p in parts for i in p] == trie.lexicographic_order()
    assert lexicographic_partition(trie, num_parts) == parts  # a built trie gives the same split
    check_partition(seqs, num_parts, parts)


@settings(max_examples=100, deadline=None)
@given(seqs=any_length, num_parts=st.integers(1, 4))
def test_any_sequence_length_is_accepted(seqs, num_parts):
    """A partition needs no scored token: 0- and 1-token sequences are split like any other."""
    check_partition(seqs, num_parts, lexicographic_partition(seqs, num_parts))


def test_short_sequences_and_bad_ids():
    assert lexicographic_partition([[], [5], [5, 1], [2]], 2) == [[0, 3], [1, 2]]
    assert lexicographic_partition([], 3) == [[], [], []]
    with pytest.raises(ValueError, match="sequence 1"):
        lexicographic_partition([[1, 2], [-1]], 2)
    with pytest.raises(ValueError, match="sequence 0"):
        lexicographic_partition([[1.5, 2.0]], 2)


def test_groups_stay_together_when_balanced():
    shared = list(range(100, 140))
    groups = [[shared + [g] * 20 + [k] * (5 + k) for k in range(4)] for g in range(4)]
    seqs = [s for group in groups for s in group]
    parts = lexicographic_partition(seqs, 4)
    assert sorted(sorted(p) for p in parts) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]


def test_fewer_sequences_than_parts():
    parts = lexicographic_partition([[1, 2], [1, 3]], 4)
    assert parts == [[0], [1], [], []]


def test_sampler_yields_this_ranks_part():
    seqs = [[1, 2, 3, k, k] for k in range(10)]
    parts = lexicographic_partition(seqs, 3)
    for rank in range(3):
        sampler = LexicographicPartitionSampler(seqs, num_replicas=3, rank=rank)
        assert list(sampler) == parts[rank] and len(sampler) == len(parts[rank])
    assert list(LexicographicPartitionSampler(seqs)) == list(range(10))  # no process group: one replica
    with pytest.raises(ValueError, match="rank 3"):
        LexicographicPartitionSampler(seqs, num_replicas=3, rank=3)
    with pytest.raises(ValueError, match="num_parts"):
        lexicographic_partition(seqs, 0)


def test_the_partition_balances_by_fitted_call_costs():
    """With call costs whose attention dominates, long sequences weigh more than their tokens: the parts'
    largest predicted cost is at most the token-balanced split's, by that cost."""
    from trl_dta.walk.cost.costs import CallCost

    rng = random.Random(5)
    seqs = [[rng.randrange(1, 50)] + [7] * rng.choice([20, 30, 400, 600]) for _ in range(24)]
    costs = CallCost(fixed=1e-3, per_token=1e-6, per_pair=1e-7)

    def cost(part):
        return sum(costs.fixed + costs.per_token * len(seqs[i]) + costs.per_pair * len(seqs[i]) ** 2 / 2
                   for i in part)  # fmt: skip

    weighted, plain = lexicographic_partition(seqs, 4, costs), lexicographic_partition(seqs, 4)
    assert sorted(i for p in weighted for i in p) == list(range(24))
    assert max(map(cost, weighted)) <= max(map(cost, plain)) * 1.0001
    assert max(map(cost, weighted)) < 0.95 * max(map(cost, plain))  # (here the token split is not balanced)
