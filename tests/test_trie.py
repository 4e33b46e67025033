"""Tests for trl_dta.trie.PrefixTrie."""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trl_dta.trie import PrefixTrie, TrieNode

torch = pytest.importorskip("torch")


# ---------------------------------------------------------------------- helpers


def dump(trie: PrefixTrie) -> list:
    """Canonical description of a trie: one tuple per node in walk pre-order."""
    return [
        (node.start, node.end, tuple(trie.tokens(node).tolist()), tuple(node.terminals))
        for node in trie.nodes()
    ]


def depth_of(node: TrieNode) -> int:
    d = 0
    while node.parent is not None:
        d += 1
        node = node.parent
    return d


def all_nodes_plain(trie: PrefixTrie) -> list[TrieNode]:
    """Every real node, found through `children` (independent of the walk order)."""
    out, todo = [], list(trie.root.children)
    while todo:
        node = todo.pop()
        out.append(node)
        todo.extend(node.children)
    return out


def max_end(node: TrieNode) -> int:
    best, todo = node.end, list(node.children)
    while todo:
        n = todo.pop()
        best = max(best, n.end)
        todo.extend(n.children)
    return best


# ---------------------------------------------------------------------- strategies

_token = st.integers(min_value=0, max_value=2)
_seq = st.lists(_token, min_size=2, max_size=30)


@st.composite
def _derived_sequences(draw):
    """Sequences made from a few shared bases: long shared prefixes, duplicates, prefixes."""
    bases = draw(st.lists(st.lists(_token, min_size=2, max_size=30), min_size=1, max_size=4))
    n = draw(st.integers(min_value=1, max_value=40))
    out = []
    for _ in range(n):
        base = draw(st.sampled_from(bases))
        k = draw(st.integers(min_value=0, max_value=len(base)))
        tail = draw(st.lists(_token, min_size=0, max_size=30 - k))
        seq = base[:k] + tail
        if len(seq) < 2:
            seq = base
        out.append(seq)
    return out


sequence_lists = st.one_of(st.lists(_seq, min_size=1, max_size=40), _derived_sequences())


# ---------------------------------------------------------------------- properties


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sequence_lists)
def test_trie_properties(seqs):
    original = copy.deepcopy(seqs)
    trie = PrefixTrie.from_sequences(seqs)
    n = len(seqs)
    assert seqs == original  # input not mutated
    assert len(trie) == trie.num_sequences == n
    assert all(a.dtype == np.int64 for a in trie.sequences)

    # root
    root = trie.root
    assert root.parent is None and root.start == root.end == 0 and root.seq == -1
    assert root.terminals == [] and trie.tokens(root).size == 0

    # every sequence is the concatenation of the tokens along its path
    for i, s in enumerate(seqs):
        path = trie.path(i)
        assert path[0].parent is root and path[0].start == 0
        assert path[-1].end == len(s) and i in path[-1].terminals
        for a, b in itertools.pairwise(path):
            assert b.parent is a and b.start == a.end
        rebuilt = np.concatenate([trie.tokens(node) for node in path]).tolist()
        assert rebuilt == s

    # unique tokens == number of distinct non-empty prefixes
    prefixes = {tuple(s[:k]) for s in seqs for k in range(1, len(s) + 1)}
    assert trie.num_unique_tokens == len(prefixes)
    assert trie.num_tokens == sum(map(len, seqs))
    assert trie.dedup_ratio == pytest.approx(trie.num_tokens / trie.num_unique_tokens)
    assert trie.max_depth == max(map(len, seqs))

    nodes = list(trie.nodes())
    plain = all_nodes_plain(trie)
    assert len(nodes) == len(plain) == trie.num_nodes
    assert {id(x) for x in nodes} == {id(x) for x in plain}
    assert sum(x.num_tokens for x in nodes) == trie.num_unique_tokens
    leaves = [x for x in nodes if x.is_leaf]
    assert trie.num_leaves == len(leaves)
    assert trie.stats()["mean_leaf_depth"] == pytest.approx(np.mean([x.end for x in leaves]))

    terminal_owner = {}
    for node in [root] + nodes:
        # compressed: a non-root internal node branches or ends a sequence
        if node is not root and not node.is_leaf:
            assert len(node.children) >= 2 or node.terminals
        if node is not root:
            assert node.num_tokens >= 1 and node.end == node.start + node.num_tokens
            assert trie.tokens(node).tolist() == seqs[node.seq][node.start : node.end]
            assert np.shares_memory(trie.tokens(node), trie.sequences[node.seq])
        # leaves end sequences
        if node.is_leaf and node is not root:
            assert node.terminals
        # children: sorted by first token, distinct first tokens, contiguous positions
        firsts = [int(trie.tokens(c)[0]) for c in node.children]
        assert firsts == sorted(firsts) and len(set(firsts)) == len(firsts)
        for c in node.children:
            assert c.parent is node and c.start == node.end
        # terminals in index order, each sequence exactly once
        assert node.terminals == sorted(node.terminals)
        for i in node.terminals:
            assert i not in terminal_owner
            terminal_owner[i] = node
            assert len(seqs[i]) == node.end
        # cached height
        assert node.height == max_end(node) - node.end
        # walk order rule
        walk = trie.walk_children(node)
        assert sorted(map(id, walk)) == sorted(map(id, node.children))
        kinds = [not c.is_leaf for c in walk]
        assert kinds == sorted(kinds)  # leaves first
        leaf_keys = [(c.num_tokens, int(trie.tokens(c)[0])) for c in walk if c.is_leaf]
        inner_keys = [(max_end(c) - node.end, int(trie.tokens(c)[0])) for c in walk if not c.is_leaf]
        assert leaf_keys == sorted(leaf_keys)
        assert inner_keys == sorted(inner_keys)
    assert set(terminal_owner) == set(range(n))

    # orders
    dfs = trie.dfs_order()
    lex = trie.lexicographic_order()
    assert sorted(dfs) == list(range(n))
    assert sorted(lex) == list(range(n))
    assert lex == sorted(range(n), key=lambda i: (list(seqs[i]), i))
    # dfs order = terminals of the nodes in walk pre-order
    assert dfs == [i for node in nodes for i in node.terminals]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2**32 - 1), min_size=2, max_size=8), min_size=1, max_size=10))
def test_large_ids_and_array_inputs_agree(seqs):
    """Full uint32 id range; lists, numpy and torch inputs build the same trie."""
    from_lists = PrefixTrie.from_sequences(seqs)
    from_np = PrefixTrie.from_sequences([np.array(s, dtype=np.uint32) for s in seqs])
    from_torch = PrefixTrie.from_sequences([torch.tensor(s, dtype=torch.int64) for s in seqs])
    assert dump(from_lists) == dump(from_np) == dump(from_torch)
    assert from_lists.lexicographic_order() == sorted(range(len(seqs)), key=lambda i: (seqs[i], i))
    for i, s in enumerate(seqs):
        assert from_lists.sequences[i].tolist() == s


# ---------------------------------------------------------------------- hand-made tries


def test_walk_order_rule():
    seqs = [
        [7, 2, 8, 8, 8, 1],  # 0  internal child B = [2,8,8,8]: own 4 tokens, height 1
        [7, 5, 5, 5],  # 1  leaf [5,5,5] (3 tokens)
        [7, 1, 1, 1],  # 2  internal child A = [1]: own 1 token, height 2
        [7, 3],  # 3  leaf [3] (1 token)
        [7, 4, 4, 4],  # 4  internal child C = [4]: same depth as A, larger first token
        [6, 6],  # 5  leaf at the root
        [7, 1, 2],  # 6
        [7, 9],  # 7  leaf [9] (1 token)
        [7, 2, 8, 8, 8, 2],  # 8
        [7, 4, 5],  # 9
        [7, 3],  # 10 duplicate of 3
    ]
    trie = PrefixTrie.from_sequences(seqs)

    def tok(node):
        return trie.tokens(node).tolist()

    assert [tok(c) for c in trie.walk_children(trie.root)] == [[6, 6], [7]]
    p = trie.walk_children(trie.root)[1]
    assert p.terminals == [] and len(p.children) == 6
    # children stored lexicographically ...
    assert [tok(c)[0] for c in p.children] == [1, 2, 3, 4, 5, 9]
    # ... walked leaves first (by length, then first token), then internal children by
    # depth of their subtree below p: A and C reach depth 4 (tie -> A first), B reaches 6
    # even though B's own height (1) is smaller than A's (2).
    walk = trie.walk_children(p)
    assert [tok(c) for c in walk] == [[3], [9], [5, 5, 5], [1], [4], [2, 8, 8, 8]]
    a, c, b = walk[3:]
    assert (a.height, c.height, b.height) == (2, 2, 1)
    assert walk[0].terminals == [3, 10]
    assert [tok(x) for x in trie.walk_children(a)] == [[2], [1, 1]]
    assert [tok(x) for x in trie.walk_children(c)] == [[5], [4, 4]]
    assert [tok(x) for x in trie.walk_children(b)] == [[1], [2]]

    assert trie.dfs_order() == [5, 3, 10, 7, 1, 6, 2, 9, 4, 0, 8]
    assert trie.lexicographic_order() == [5, 2, 6, 0, 8, 3, 10, 4, 9, 1, 7]
    assert [tok(x) for x in trie.nodes()] == [
        [6, 6], [7], [3], [9], [5, 5, 5], [1], [2], [1, 1], [4], [5], [4, 4],
        [2, 8, 8, 8], [1], [2],
    ]  # fmt: skip
    # walk_children returns a copy: mutating it does not change the trie
    walk.clear()
    assert len(trie.walk_children(p)) == 6


def test_prefix_duplicates_and_stats():
    seqs = [[1, 2, 3, 4], [1, 2], [1, 2, 3, 4], [1, 2, 5], [9, 9]]
    trie = PrefixTrie.from_sequences(seqs)
    # [1,2] ends at an internal node; the two [1,2,3,4] share a leaf
    n12 = trie.path(1)[-1]
    assert trie.tokens(n12).tolist() == [1, 2] and n12.terminals == [1] and not n12.is_leaf
    assert trie.path(0)[-1] is trie.path(2)[-1]
    assert trie.path(0)[-1].terminals == [0, 2]
    assert trie.stats() == {
        "num_sequences": 5,
        "num_tokens": 15,
        "num_unique_tokens": 7,  # [1,2] [3,4] [5] [9,9]
        "dedup_ratio": 15 / 7,
        "num_nodes": 4,
        "num_leaves": 3,
        "max_depth": 4,
        "mean_leaf_depth": (3 + 4 + 2) / 3,
    }
    assert trie.path(-1) == trie.path(4)
    with pytest.raises(IndexError):
        trie.path(5)


def test_single_sequence_and_all_identical():
    trie = PrefixTrie.from_sequences([[4, 5, 6]])
    assert trie.num_nodes == 1 and trie.dfs_order() == [0] and trie.dedup_ratio == 1.0
    trie = PrefixTrie.from_sequences([[4, 5, 6]] * 5)
    (node,) = trie.nodes()
    assert node.terminals == [0, 1, 2, 3, 4] and trie.dedup_ratio == 5.0


# ---------------------------------------------------------------------- input kinds


def test_numpy_and_torch_inputs_match_lists_and_are_not_modified():
    seqs = [[3, 1, 4, 1, 5], [3, 1, 4, 2], [3, 1], [2, 7, 1, 8], [3, 1, 4, 1, 5]]
    want = PrefixTrie.from_sequences(seqs)
    np_inputs = [
        np.array(seqs[0], dtype=np.int64),
        np.array(seqs[1], dtype=np.int32),
        np.array(seqs[2], dtype=np.uint16),
        np.array(seqs[3], dtype=np.uint32),
        np.array(seqs[4], dtype=np.uint64),
    ]
    torch_inputs = [
        torch.tensor(seqs[0], dtype=torch.int64),
        torch.tensor(seqs[1], dtype=torch.int32),
        torch.tensor(seqs[2], dtype=torch.uint8),
        torch.tensor(seqs[3], dtype=torch.int16),
        torch.tensor(seqs[4], dtype=torch.int64)[::1],
    ]
    mixed = [tuple(seqs[0]), np_inputs[1], torch_inputs[2], seqs[3], seqs[4]]
    np_before = [a.copy() for a in np_inputs]
    torch_before = [t.clone() for t in torch_inputs]
    for inputs in (np_inputs, torch_inputs, mixed):
        got = PrefixTrie.from_sequences(inputs)
        assert dump(got) == dump(want)
        assert got.dfs_order() == want.dfs_order()
        assert got.lexicographic_order() == want.lexicographic_order()
    for a, b in zip(np_inputs, np_before, strict=True):
        assert np.array_equal(a, b)
    for a, b in zip(torch_inputs, torch_before, strict=True):
        assert torch.equal(a, b)

    # private copies: changing the inputs afterwards does not change the trie
    got = PrefixTrie.from_sequences(np_inputs)
    got_t = PrefixTrie.from_sequences(torch_inputs)
    for t in torch_inputs:
        assert not any(np.shares_memory(s, t.numpy()) for s in got_t.sequences)
    np_inputs[0][0] = 99
    torch_inputs[0][0] = 99
    assert got.sequences[0][0] == 3 and got_t.sequences[0][0] == 3
    assert all(s.dtype == np.int64 for s in got.sequences + got_t.sequences)


def test_other_iterables_accepted():
    # a 2-D array (rows are sequences), ranges, numpy ints inside lists
    trie = PrefixTrie.from_sequences(np.array([[1, 2, 3], [1, 2, 4]]))
    assert dump(trie) == dump(PrefixTrie.from_sequences([[1, 2, 3], [1, 2, 4]]))
    trie = PrefixTrie.from_sequences([range(5), [np.int64(0), np.uint32(1)], (0, 1, 2)])
    assert trie.sequences[1].tolist() == [0, 1]
    assert trie.num_unique_tokens == 5
    # a list mixing bools into ints is taken as ints, like numpy does
    assert PrefixTrie.from_sequences([[1, True, 0]]).sequences[0].tolist() == [1, 1, 0]
    assert PrefixTrie.from_sequences([[True, 1, 0]]).sequences[0].tolist() == [1, 1, 0]


def test_input_list_not_mutated():
    inner = [5, 6, 7]
    outer = [inner, [5, 6]]
    PrefixTrie.from_sequences(outer)
    assert outer == [[5, 6, 7], [5, 6]] and outer[0] is inner


# ---------------------------------------------------------------------- rejections


@pytest.mark.parametrize(
    "bad, match",
    [
        ([], r"no sequences"),
        ((), r"no sequences"),
        ([[1, 2], [3]], r"sequence 1 has 1 token"),
        ([[1, 2], []], r"sequence 1 has 0 token"),
        ([np.array([1, 2]), np.array([5])], r"sequence 1 has 1 token"),
        ([[1, 2], [1.0, 2.0]], r"sequence 1 has dtype float64"),
        ([[1, 2], [1, 2.5]], r"sequence 1 has dtype float64"),
        ([np.array([1.0, 2.0])], r"sequence 0 has dtype float64"),
        ([[True, False]], r"sequence 0 has dtype bool"),
        ([np.array([True, False])], r"sequence 0 has dtype bool"),
        ([[1, 2], ["a", "b"]], r"sequence 1 has dtype <U1"),
        ([[1, 2], "ab"], r"sequence 1 has dtype <U2"),
        ([[None, 1]], r"sequence 0 has dtype object"),
        ([[1, 2], [3, 4], [5, -1]], r"sequence 2 has a negative token id \(-1\)"),
        ([np.array([5, -3], dtype=np.int8)], r"sequence 0 has a negative token id \(-3\)"),
        ([[1, 2**32]], r"sequence 0 has a token id >= 2\*\*32 \(4294967296\)"),
        ([[1, 2**64 - 1]], r"sequence 0 has a token id >= 2\*\*32"),
        ([[1, 2], [1, 2**70]], r"sequence 1 has a token id >= 2\*\*32"),
        ([np.array([1, 2**40], dtype=np.uint64)], r"sequence 0 has a token id >= 2\*\*32"),
        ([np.zeros((2, 2), dtype=np.int64)], r"sequence 0 must be 1-D, got shape \(2, 2\)"),
        ([[1, 2], [[1, 2], [3, 4]]], r"sequence 1 must be 1-D"),
        ([[1, 2], [[1, 2], [3]]], r"sequence 1 could not be turned into"),
        ([[1, 2], 7], r"sequence 1 must be 1-D"),
    ],
)
def test_rejects_bad_input(bad, match):
    with pytest.raises(ValueError, match=match):
        PrefixTrie.from_sequences(bad)


@pytest.mark.parametrize(
    "tensor, match",
    [
        (torch.tensor([1.0, 2.0]), r"sequence 1 has dtype torch.float32"),
        (torch.tensor([1, 2], dtype=torch.bfloat16), r"sequence 1 has dtype torch.bfloat16"),
        (torch.tensor([True, False]), r"sequence 1 has dtype torch.bool"),
        (torch.tensor([1, -2]), r"sequence 1 has a negative token id"),
        (torch.tensor([1, 2**33]), r"sequence 1 has a token id >= 2\*\*32"),
        (torch.tensor([3]), r"sequence 1 has 1 token"),
        (torch.tensor(3), r"sequence 1 must be 1-D"),
        (torch.zeros(2, 3, dtype=torch.long), r"sequence 1 must be 1-D"),
    ],
)
def test_rejects_bad_tensors(tensor, match):
    before = tensor.clone()
    with pytest.raises(ValueError, match=match):
        PrefixTrie.from_sequences([[1, 2], tensor])
    assert torch.equal(tensor, before)


def test_rejects_non_iterable():
    with pytest.raises(TypeError, match="iterable"):
        PrefixTrie.from_sequences(5)


# ---------------------------------------------------------------------- size


def test_large_build():
    """2k x 1k tokens as Python lists, 64 prompts (2M tokens, under a second). The 20M-token build is timed
    in benchmarks/trie_build.py, not here."""
    n = 2_000
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 50_000, size=500) for _ in range(64)]
    completions = rng.integers(0, 50_000, size=(n, 500))
    completions[:, 0] = 50_000 + np.arange(n)  # completions never share a token
    seqs = [np.concatenate([prompts[i % 64], completions[i]]).tolist() for i in range(n)]
    trie = PrefixTrie.from_sequences(seqs)
    assert trie.num_tokens == n * 1_000
    assert trie.num_unique_tokens == 64 * 500 + n * 500
    assert trie.num_leaves == n
    assert sorted(trie.dfs_order()) == list(range(n))
    i = 1_234
    assert np.concatenate([trie.tokens(n) for n in trie.path(i)]).tolist() == seqs[i]
