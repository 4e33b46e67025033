"""The walk schedule (trl_dta/walk/plan.py) on its own: packed subtrees, and the scoring helpers they need."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_dta.trie import PrefixTrie
from trl_dta.walk.attention.flex import FLEX_TILES
from trl_dta.walk.cost.costs import CallCost
from trl_dta.walk.plan import (
    LAUNCH_PRICES,
    MIN_GAIN,
    PackedSubtree,
    Pop,
    Push,
    SiblingLeaves,
    build_plan,
    plan_seconds,
)
from trl_dta.walk.scoring import path_scores, score_rows

_seq = st.lists(st.integers(0, 2), min_size=2, max_size=30)


def tau2_like():
    """A system prompt; two groups under a short shared node, one group alone; 3 leaves per group."""
    system = list(range(100, 140))
    groups = [[1, 2, 3, 4, 5, 6], [1, 2, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]]
    return [system + g + [50 + k] * (2 + k) for g in groups for k in range(3)]


def subtree_size(node):
    return node.num_tokens + sum(subtree_size(c) for c in node.children)


def covered(plan):
    """Each node's pushed segments and packed/leaf segments (the walk forwards each token of a node once)."""
    seen = {}
    for step in plan:
        segments = (
            [step.segment]
            if isinstance(step, Push)
            else step.segments
            if isinstance(step, SiblingLeaves | PackedSubtree)
            else []
        )
        for s in segments:
            seen.setdefault(s.node, []).append((s.start, s.end))
    return seen


@settings(max_examples=200, deadline=None)
@given(seqs=st.lists(_seq, min_size=1, max_size=12), block=st.sampled_from([3, 8, 1000]),
       batch=st.sampled_from([0, 5, 20, None]), limit=st.sampled_from([0, 4, 12, 1000]))  # fmt: skip
def test_packed_subtrees_cover_every_node_once_and_respect_the_limit(seqs, block, batch, limit):
    trie = PrefixTrie.from_sequences(seqs)
    batch = block if batch is None else batch
    plan = build_plan(trie, block, batch, packed=True, subtree_tokens=limit)
    seen = covered(plan)
    for node in trie.nodes():  # every token of every node exactly once, in order
        pieces = sorted(seen[node])
        assert pieces[0][0] == node.start and pieces[-1][1] == node.end
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:], strict=False))
    stack = []
    for step in plan:
        if isinstance(step, Push):
            stack.append(step.segment)
        elif isinstance(step, Pop):
            assert stack.pop() == step.segment
        elif isinstance(
            step, PackedSubtree
        ):  # a packed subtree: one whole subtree under the stack's top, within the limit
            top = stack[-1].node if stack else trie.root
            root = step.segments[0].node
            assert step.parents[0] == -1 and root.parent is top and not root.is_leaf
            assert sum(s.num_tokens for s in step.segments) == subtree_size(root) <= min(limit, batch, block)
            for k, (s, p) in enumerate(zip(step.segments, step.parents, strict=True)):
                assert (s.start, s.end, s.terminals) == (s.node.start, s.node.end, tuple(s.node.terminals))
                assert (p == -1) == (k == 0) and p < k
                assert p == -1 or s.node.parent is step.segments[p].node
    assert not stack


@settings(max_examples=100, deadline=None)
@given(seqs=st.lists(_seq, min_size=1, max_size=12), block=st.sampled_from([3, 1000]))
def test_no_packed_subtree_unless_asked_and_packed(seqs, block):
    trie = PrefixTrie.from_sequences(seqs)
    plain = build_plan(trie, block, block, packed=True)
    assert build_plan(trie, block, block, packed=True, subtree_tokens=0) == plain
    assert build_plan(trie, block, block, packed=False, subtree_tokens=10**6) == build_plan(
        trie, block, block
    )
    assert not any(isinstance(s, PackedSubtree) for s in plain)


def shape(plan):
    return [(type(s).__name__, [x.num_tokens for x in getattr(s, "segments", ())]) for s in plan]


def test_tau2_like_plan():
    trie = PrefixTrie.from_sequences(tau2_like())
    # the walk: push the system prompt, the shared 2-token node, each group; the leaves of a group together
    walk = build_plan(trie, 1000, 1000, packed=True)
    assert [type(s).__name__ for s in walk].count("Push") == 5
    # a limit of one group (6 + 2 + 3 + 4 tokens): each group one step, the shared 2-token node pushed
    one_group = build_plan(trie, 1000, 1000, packed=True, subtree_tokens=15)
    assert shape(one_group) == [
        ("Push", []), ("Push", []), ("PackedSubtree", [4, 2, 3, 4]), ("PackedSubtree", [4, 2, 3, 4]),
        ("Pop", []), ("PackedSubtree", [6, 2, 3, 4]), ("Pop", []),
    ]  # fmt: skip
    # the whole trie in one step
    whole = build_plan(trie, 1000, 1000, packed=True, subtree_tokens=1000)
    assert len(whole) == 1 and sum(s.num_tokens for s in whole[0].segments) == trie.num_unique_tokens


def _leaf_steps(plan):
    return [len(step.segments) for step in plan if isinstance(step, SiblingLeaves)]


def test_where_launches_overlap_compute_a_compute_bound_walk_merges_less():
    """Two leaves under a long prefix, a dense mask: merging them saves a launch (0.3 s) for 0.2 s of
    attention pairs the tree does not need. Summed, merging pays; where launches overlap compute (a GPU) and
    the walk is compute-bound, the launch was hidden anyway: the leaves stay apart. Launch-bound, they merge
    either way."""
    trie = PrefixTrie.from_sequences([[1] * 1000 + [2] * 100, [1] * 1000 + [3] * 100])
    summed = CallCost(fixed=0.3, per_token=1e-3, per_pair=1e-5)
    overlapping = CallCost(fixed=0.3, per_token=1e-3, per_pair=1e-5, overlap=True)
    plan = lambda costs: build_plan(trie, 10_000, 10_000, packed=True, costs=costs)  # noqa: E731
    assert _leaf_steps(plan(summed)) == [2]
    assert _leaf_steps(plan(overlapping)) == [1, 1]
    assert plan_seconds(plan(overlapping), overlapping, True) < plan_seconds(plan(summed), overlapping, True)
    launch_bound = CallCost(fixed=100.0, per_token=1e-3, per_pair=1e-5, overlap=True)
    assert _leaf_steps(plan(launch_bound)) == [2]


@settings(max_examples=100, deadline=None)
@given(seqs=st.lists(_seq, min_size=1, max_size=12), fixed=st.sampled_from([1e-3, 1.0, 30.0]),
       sparse=st.booleans(), budget=st.sampled_from([4, 12, 1000]))  # fmt: skip
def test_overlapping_costs_never_pick_a_slower_plan(seqs, fixed, sparse, budget):
    """By its own cost model, the plan kept is never slower than the summed price's (the plan CUDA built
    before) nor, beyond MIN_GAIN, than either extreme price's (its search is a bisection between them), and
    covers every node once."""
    trie = PrefixTrie.from_sequences(seqs)
    kernel = FLEX_TILES if sparse else None
    costs = CallCost(fixed=fixed, per_token=0.01, per_pair=0.003, kernel=kernel, overlap=True)
    plan = build_plan(trie, 8, budget, packed=True, subtree_tokens=budget, costs=costs)
    summed = CallCost(fixed, 0.01, 0.003, kernel)  # (merge decisions at each price: no search)
    each = {p: build_plan(trie, 8, budget, True, budget, summed.priced(p)) for p in LAUNCH_PRICES}
    seconds = plan_seconds(plan, costs, True)
    assert seconds <= plan_seconds(each[1.0], costs, True) * (1 + 1e-12)
    for price in (LAUNCH_PRICES[0], LAUNCH_PRICES[-1]):
        assert seconds <= plan_seconds(each[price], costs, True) / (1 - MIN_GAIN)
    assert plan in each.values()
    for node, pieces in covered(plan).items():
        assert sorted(pieces)[0][0] == node.start and sorted(pieces)[-1][1] == node.end


def test_negative_subtree_tokens_rejected():
    with pytest.raises(ValueError, match="subtree_tokens"):
        build_plan(PrefixTrie.from_sequences([[1, 2]]), 8, 8, packed=True, subtree_tokens=-1)


class _Head:
    """A stand-in LM head: logits = hidden @ W (what score_rows calls as lm.logits)."""

    value_head = False  # (a CausalLM's: an LM head, not a value model's)

    def __init__(self, dim, vocab):
        self.w = torch.randn(dim, vocab, dtype=torch.float64)

    def logits(self, hidden, temperature):
        return hidden @ self.w / temperature


def test_score_rows_per_row_starts_equal_separate_calls():
    torch.manual_seed(0)
    lm, dim = _Head(4, 7), 4
    ids = [torch.randint(0, 7, (n,)) for n in (3, 1, 5)]
    hiddens = [torch.randn(t.numel(), dim, dtype=torch.float64) for t in ids]
    starts, parents, froms = [0, 6, 9], [None, torch.randn(dim), torch.randn(dim)], [0, 0, 10]
    together = score_rows(lm, hiddens, ids, starts, parents, 0.7, True, froms)
    for r in range(3):
        alone = score_rows(
            lm, hiddens[r : r + 1], ids[r : r + 1], starts[r], parents[r], 0.7, True, froms[r : r + 1]
        )
        assert torch.equal(together[0][r], alone[0][0]) and torch.equal(together[1][r], alone[1][0])
        assert together[2][r] == alone[2][0]


def test_path_scores_puts_the_subtree_pieces_between_stack_and_leaf():
    class Frame:
        logps_in, entropies_in, lp_from = torch.arange(0.0, 4.0), torch.arange(10.0, 14.0), 0

    above = [(torch.arange(4.0, 6.0), torch.arange(14.0, 16.0), 4)]
    lp, ent = path_scores([Frame()], torch.arange(6.0, 8.0), torch.arange(16.0, 18.0), 6, 3, above)
    assert lp.tolist() == [3.0, 4.0, 5.0, 6.0, 7.0] and ent.tolist() == [13.0, 14.0, 15.0, 16.0, 17.0]
