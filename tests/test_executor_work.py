"""What the walk costs: tokens forwarded, size of each forward and of each logits block, and peak memory
held by autograd (flat in the number of leaves, unlike dense)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model

from trl_dta import PrefixTrie, TreeExecutor
from trl_dta.testing.memory import SavedTensorMeter

pytestmark = pytest.mark.usefixtures("fp64_exact")  # HF's float32 casts kept in float64


def sequences(prefix_len=40, groups=3, per_group=4, turn=9, tail=6, seed=0):
    """A system prompt, groups sharing a prompt, then a shared first turn per group, then own tails."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(0, 61, (n,), generator=gen).tolist()  # noqa: E731
    system = rand(prefix_len)
    out = []
    for _ in range(groups):
        prompt, first = rand(turn), rand(turn)
        out += [system + prompt + first + rand(tail + k) for k in range(per_group)]
    return out


class TokenCounter:
    """Counts the tokens and calls that go through the input embeddings and the LM head rows per call."""

    def __init__(self, model):
        self.calls, self.tokens, self.head_rows = [], 0, []
        self.handles = [
            model.get_input_embeddings().register_forward_hook(self._embed),
            model.get_output_embeddings().register_forward_hook(self._head),
        ]

    def _embed(self, module, args, output):
        self.calls.append(args[0].numel())
        self.tokens += args[0].numel()

    def _head(self, module, args, output):
        self.head_rows.append(args[0].shape[:-1].numel())

    def remove(self):
        for h in self.handles:
            h.remove()


def loss_fn(i, logps, entropies):
    return -logps.sum()


def test_every_unique_token_forwarded_once_without_chunking():
    model = make_model("qwen3", "sdpa", dtype=torch.float32)
    seqs = sequences()
    trie = PrefixTrie.from_sequences(seqs)
    executor = TreeExecutor(model, block_size=4096, batch_tokens=0)
    counter = TokenCounter(model)
    executor.backward(trie, loss_fn)
    counter.remove()
    assert counter.tokens == trie.num_unique_tokens
    assert trie.num_unique_tokens < trie.num_tokens / 2  # the shapes really share


def test_forward_and_logits_sizes_bounded_by_block_and_batch_budget():
    model = make_model("llama", "sdpa", dtype=torch.float32)
    trie = PrefixTrie.from_sequences(sequences())
    block, budget = 8, 20
    executor = TreeExecutor(model, block_size=block, batch_tokens=budget)
    counter = TokenCounter(model)
    executor.backward(trie, loss_fn)
    counter.remove()
    assert max(counter.calls) <= max(block, budget)
    assert max(counter.head_rows) <= max(block, budget)
    # chunked backward recomputes internal blocks, but never more than twice the unique tokens (+ padding)
    assert trie.num_unique_tokens < counter.tokens < 2 * trie.num_unique_tokens + budget * len(counter.calls)


@pytest.mark.parametrize("pack", [True, False])
def test_sibling_leaves_share_one_forward(pack):
    model = make_model("qwen3", "sdpa", dtype=torch.float32)
    seqs = [[1, 2, 3, 4] + [10 + k, 11, 12 + k, 13][: 2 + k % 3] for k in range(8)]
    executor = TreeExecutor(model, batch_tokens=64, pack_leaves=pack, subtree_tokens=0)
    counter = TokenCounter(model)
    executor.backward(PrefixTrie.from_sequences(seqs), loss_fn)
    counter.remove()
    leaf_tokens = sum(len(s) - 4 for s in seqs)
    assert counter.calls == [4, leaf_tokens if pack else 8 * 4]  # packed: no padding


def test_small_subtree_is_one_forward():
    model = make_model("qwen3", "sdpa", dtype=torch.float32)
    trie = PrefixTrie.from_sequences(sequences())  # a 40-token system prompt, 3 groups of 4 (~25 tokens each)
    executor = TreeExecutor(model, subtree_tokens=60)
    counter = TokenCounter(model)
    executor.backward(trie, loss_fn)
    counter.remove()
    # the system prompt, then each group (its prompt and first turn, and its 4 tails) in one call
    assert len(counter.calls) == 4 and counter.tokens == trie.num_unique_tokens


def leaf_sequences(num_leaves, prefix=256, leaf=256):
    gen = torch.Generator().manual_seed(num_leaves)
    shared = torch.randint(0, 61, (prefix,), generator=gen).tolist()
    # distinct first tokens: every leaf hangs directly off the shared prefix
    return [
        shared + [k] + torch.randint(0, 61, (leaf - 1,), generator=gen).tolist() for k in range(num_leaves)
    ]


def tree_peak(num_leaves):
    model = make_model("qwen3", "sdpa", dtype=torch.float32)
    executor = TreeExecutor(model)
    trie = PrefixTrie.from_sequences(leaf_sequences(num_leaves))
    with SavedTensorMeter(model) as meter:
        executor.backward(trie, loss_fn)
    return meter.peak


def dense_peak(num_leaves):
    model = make_model("qwen3", "sdpa", dtype=torch.float32)
    ids = torch.tensor(leaf_sequences(num_leaves))
    with SavedTensorMeter(model) as meter:
        logits = model(input_ids=ids).logits[:, :-1]
        loss = -torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).sum()
        loss.backward()
    return meter.peak


def test_peak_saved_memory_flat_in_number_of_leaves():
    small, large = tree_peak(8), tree_peak(32)
    assert large <= 1.25 * small, (small, large)
    dense_small, dense_large = dense_peak(8), dense_peak(32)  # negative control: dense grows with the batch
    assert 3.5 * dense_small <= dense_large <= 4.5 * dense_small, (dense_small, dense_large)


@pytest.mark.parametrize("block_size", [1000, 7])
def test_lm_head_runs_only_on_scored_positions(block_size):
    """With score_from = prompt length - 1, the LM head sees exactly the log-probs some loss reads: the union
    over sequences of (context, target) pairs from score_from on, each once (chunked recompute included).
    A node's last hidden state scores the first token of each child: one row per child."""
    model = make_model("qwen3", "sdpa", dtype=torch.float32)
    seqs = sequences()
    froms = [40 + 9 - 1] * len(seqs)  # system prompt + prompt: the completions start after them
    trie = PrefixTrie.from_sequences(seqs)
    needed = {tuple(s[: t + 2]) for s, f in zip(seqs, froms, strict=True) for t in range(f, len(s) - 1)}
    executor = TreeExecutor(model, block_size=block_size)
    counter = TokenCounter(model)
    try:
        executor.logprobs(trie, score_from=froms)
        assert sum(counter.head_rows) == len(needed)
        counter.head_rows.clear()
        executor.logprobs(trie)  # default: every position of every unique path
        assert sum(counter.head_rows) == trie.num_unique_tokens - len(trie.root.children)
    finally:
        counter.remove()


def test_call_counts_are_the_model_calls():
    """``executor.calls`` (tree/calls, tree/tokens_per_call) counts what goes through the model: forward calls
    and their token positions as the embeddings see them, and backward calls only in gradient walks."""
    model = make_model("qwen3", "sdpa", dtype=torch.float32)
    trie = PrefixTrie.from_sequences(sequences())
    executor = TreeExecutor(model, block_size=16, batch_tokens=24)
    counter = TokenCounter(model)
    try:
        executor.backward(trie, loss_fn)
        assert executor.calls.forward == len(counter.calls) > 1
        assert executor.calls.tokens == counter.tokens
        backward = executor.calls.backward
        assert 1 <= backward <= executor.calls.forward  # one per leaf batch and per popped segment at most
        executor.logprobs(trie)
        assert executor.calls.forward == len(counter.calls) and executor.calls.backward == backward
    finally:
        counter.remove()


def test_flop_ideal_matches_a_count_over_unique_prefixes():
    """dense / walk FLOPs (tree/flop_ratio): the walk's side counted by brute force over distinct prefixes
    (each token once, at its position) and distinct (context, target) pairs the LM head scores."""
    from trl_dta.walk.cost.flops import per_token_costs

    model = make_model("qwen3", "sdpa", dtype=torch.float32)
    seqs = sequences()
    froms = [40 + 9 - 1 - (i % 3) for i in range(len(seqs))]
    executor = TreeExecutor(model)
    body, attention, head = per_token_costs(executor.lm)
    dense = sum(body * len(s) + attention * len(s) * (len(s) + 1) / 2 + head * (len(s) - 1 - f)
                for s, f in zip(seqs, froms, strict=True))  # fmt: skip
    prefixes = {tuple(s[: t + 1]) for s in seqs for t in range(len(s))}
    scored = {tuple(s[: t + 2]) for s, f in zip(seqs, froms, strict=True) for t in range(f, len(s) - 1)}
    walk = sum(body + attention * len(p) for p in prefixes) + head * len(scored)
    assert executor.flops(PrefixTrie.from_sequences(seqs), froms) == pytest.approx((dense, walk), rel=1e-12)
    assert 1 < dense / walk < PrefixTrie.from_sequences(seqs).dedup_ratio  # the unscored prompt saves less
    # nothing shared: 1; two copies of one sequence, all scored: 2
    dense, walk = executor.flops(PrefixTrie.from_sequences([[1, 2, 3], [4, 5]]))
    assert dense == walk
    dense, walk = executor.flops(PrefixTrie.from_sequences([[1, 2, 3, 4]] * 2))
    assert dense / walk == pytest.approx(2.0, rel=1e-12)
