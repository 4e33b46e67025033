"""Budgets from memory: the analytic activation bytes against what autograd saves, the derivation's
priorities, the executor's use of them (explicit budgets win), and values-only entropies."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import VOCAB, dense_grads, grads_of, make_model, max_rel_diff
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from trl_dta import PrefixTrie, TreeExecutor
from trl_dta.testing.memory import SavedTensorMeter
from trl_dta.walk.memory.budgets import (
    AUTO_FRACTION,
    FIXED,
    MIN_CALL_TOKENS,
    Budgets,
    TokenBudgets,
    activation_bytes,
    token_budgets,
)

SHAPES = dict(vocab_size=2000, hidden_size=256, intermediate_size=704, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, num_hidden_layers=2,
              attn_implementation="sdpa")  # fmt: skip
QWEN3_1_7B = Qwen3Config(hidden_size=2048, intermediate_size=6144, num_attention_heads=16,
                         num_key_value_heads=8, head_dim=128, num_hidden_layers=28,
                         vocab_size=151936)  # fmt: skip


def _saved_bytes(model, length: int, scored: int, entropies: bool, autocast: bool = False) -> int:
    """Peak bytes autograd holds (each storage once) for one walk of one sequence, whole in one block."""
    executor = TreeExecutor(model, block_size=4 * length, memory_budget=None)
    trie = PrefixTrie.from_sequences([[(7 * t) % 1999 + 1 for t in range(length)]])
    froms = [length - 1 - scored]
    loss = lambda i, lp, ent: -lp.sum() - (ent.sum() if ent is not None else 0)  # noqa: E731
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        executor.backward(trie, loss, score_from=froms, entropies=entropies)  # warm: probe, checks
        with SavedTensorMeter(model, by_storage=True) as meter:
            executor.backward(trie, loss, score_from=froms, entropies=entropies)
    return meter.peak


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "autocast"])
def test_activation_bytes_match_saved_bytes(family, dtype):
    """Per token, what autograd saves (each storage once: the path buffer's K/V among them) against the model,
    in float32, bfloat16, and bfloat16 autocast over float32 weights (TRL's mixed precision). The constant
    parts (autocast's weight copies, the head's transients) cancel in the per-token slope."""
    qwen3 = family == "qwen3"
    cls, config_cls = (Qwen3ForCausalLM, Qwen3Config) if qwen3 else (LlamaForCausalLM, LlamaConfig)
    config = config_cls(**SHAPES, tie_word_embeddings=True)
    torch.manual_seed(0)
    autocast = dtype == "autocast"
    dtype = torch.bfloat16 if autocast else dtype
    model = cls(config).to(torch.float32 if autocast else dtype).train()
    scored = 40
    per = activation_bytes(config, dtype, entropy_grad=True, autocast=autocast)
    kv_values = config.num_hidden_layers * 2 * 2 * 64 * torch.empty((), dtype=dtype).element_size()
    for entropies in (False, True):
        head = per.scored if entropies else activation_bytes(config, dtype, False, autocast=autocast).scored
        short, long = (_saved_bytes(model, n, scored, entropies, autocast) for n in (96, 192))
        measured = long if not autocast else long - short  # (autocast: per token, its weight copies cancel)
        predicted = (192 if not autocast else 96) * (per.token + kv_values) + (
            0 if autocast else scored * head
        )
        assert abs(predicted - measured) / measured < 0.10, (predicted, measured)


def test_token_budgets_priorities():
    bf16 = torch.bfloat16
    # the tau2-2x8-10k step: 8,704 tokens above its deepest leaf; 60 GB holds them with room for calls
    budgets = token_budgets(QWEN3_1_7B, bf16, 60e9, "cuda", path_tokens=8704)
    assert budgets.block_size == 8704 and budgets.batch_tokens >= MIN_CALL_TOKENS
    assert budgets.subtree_tokens == budgets.batch_tokens
    # a path that does not fit: the memory is split 2:1, the block smaller than the path
    split = token_budgets(QWEN3_1_7B, bf16, 20e9, "cuda", path_tokens=8704)
    per = activation_bytes(QWEN3_1_7B, bf16)
    stack, call = (
        split.block_size * (per.token + per.scored),
        split.batch_tokens * (per.position + per.token + per.scored),
    )  # (the path's K/V are held for the whole path, whatever the block)
    assert split.block_size < 8704 and stack == pytest.approx(2 * call, rel=0.05)
    # more memory never gives smaller budgets; a CPU caps its calls where larger ones stop paying
    more = token_budgets(QWEN3_1_7B, bf16, 120e9, "cuda", path_tokens=8704)
    assert more.block_size == 8704 and more.batch_tokens > budgets.batch_tokens
    assert token_budgets(QWEN3_1_7B, bf16, 120e9, "cpu", path_tokens=8704).batch_tokens <= 2048
    # values-only entropies halve the LM head's saved bytes: larger calls in the same memory
    lean = token_budgets(QWEN3_1_7B, bf16, 60e9, "cuda", path_tokens=8704, entropy_grad=False)
    assert lean.batch_tokens > budgets.batch_tokens
    with pytest.raises(ValueError, match="too small"):
        token_budgets(QWEN3_1_7B, bf16, 1e8, "cuda")
    with pytest.raises(ValueError, match="memory_bytes"):
        token_budgets(QWEN3_1_7B, bf16, -1, "cuda")
    assert TreeExecutor.__init__.__defaults__  # (the executor takes them: TreeExecutor(model, **vars(b)))
    assert set(vars(budgets)) == {"block_size", "batch_tokens", "subtree_tokens"}


def test_executor_budgets_from_memory_and_explicit_ones_win():
    model = make_model("qwen3", "sdpa", seed=0)
    trie = PrefixTrie.from_sequences([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 10], [1, 2, 11]])
    assert TreeExecutor(model).token_budgets(trie) == FIXED  # CPU "auto": the fixed CPU budgets
    assert TreeExecutor(model, memory_budget=None).token_budgets(trie) == FIXED
    derived = TreeExecutor(model, memory_budget=2e6).token_budgets(trie)
    config, dtype = model.config, model.lm_head.weight.dtype
    assert derived == token_budgets(config, dtype, 2e6, "cpu", path_tokens=4)
    given = TreeExecutor(model, block_size=3, memory_budget=2e6).token_budgets(trie)
    assert given == TokenBudgets(3, derived.batch_tokens, derived.subtree_tokens)
    fixed = TreeExecutor(model, block_size=3, memory_budget=None).token_budgets(trie)
    assert fixed == TokenBudgets(3, 3, 512)  # a block by hand: the leaf batch follows it
    executor = TreeExecutor(model, **vars(TokenBudgets(5, 7, 0)))
    assert executor.token_budgets(trie) == TokenBudgets(5, 7, 0)
    with pytest.raises(ValueError, match="memory_budget"):
        TreeExecutor(model, memory_budget="lots")


def test_budgets_options_are_validated_in_one_place():
    """Every bad option raises at construction, naming it as the caller spells it (the trainers' config
    builds a Budgets with prefix "tree_"); good ones are kept as given."""
    bad = [
        (dict(block_size=0), ValueError, "block_size must be >= 1"),
        (dict(block_size=2.5), TypeError, "block_size must be an int"),
        (dict(batch_tokens=-1), ValueError, "batch_tokens must be >= 0"),
        (dict(subtree_tokens="8"), TypeError, "subtree_tokens must be an int"),
        (dict(memory_budget=0), ValueError, "memory_budget must be"),
        (dict(memory_budget="lots"), ValueError, "memory_budget must be"),
        (dict(memory_budget=float("inf")), ValueError, "memory_budget must be"),
        (dict(memory_budget=True), ValueError, "memory_budget must be"),
        (dict(reserved_bytes=-1), ValueError, "reserved_bytes must be"),
        (dict(reserved_bytes=float("nan")), ValueError, "reserved_bytes must be"),
        (dict(reserved_bytes="1GB"), TypeError, "reserved_bytes must be a number"),
    ]
    for options, error, message in bad:
        with pytest.raises(error, match=message):
            Budgets(**options)
        with pytest.raises(error, match="tree_" + message):
            Budgets(**options, prefix="tree_")
    budgets = Budgets(memory_budget=3e9, block_size=8, batch_tokens=0, reserved_bytes=1 << 30)
    assert budgets.given == (8, 0, None) and budgets.memory_budget == 3e9
    assert budgets.reserved_bytes == 1 << 30
    assert budgets.in_use is None and budgets.metrics() == {} and budgets.history == []
    with pytest.raises(ValueError, match="reserved_bytes"):
        budgets.reserve(-5)
    with pytest.raises(ValueError, match="either"):  # an executor takes a Budgets or the keywords
        TreeExecutor(make_model("qwen3", "sdpa"), block_size=4, budgets=budgets)


def test_budgets_are_derived_per_trie_and_reported():
    """With a memory budget, each trie gets its own budgets (the block follows its longest path); the walk
    records them as ``in_use``, its metrics and history report them."""
    model = make_model("qwen3", "sdpa", dtype=torch.float32, seed=0)
    per = activation_bytes(model.config, torch.float32)
    memory = per.transient * 1024 + 700 * (per.token + per.scored + per.position)  # the paths and 512 more
    executor = TreeExecutor(model, memory_budget=memory)
    loss = lambda i, lp, ent: -lp.sum()  # noqa: E731
    short = PrefixTrie.from_sequences([[1, 2, 3, 4, 5], [1, 2, 3, 6, 7, 8]])
    base = [1 + t % 50 for t in range(40)]
    long = PrefixTrie.from_sequences([base, base[:30] + [7, 7]])
    used = []
    for trie in (short, long, long):
        executor.backward(trie, loss)
        used.append(executor.budgets.in_use)
        path = max(n.start for n in trie.nodes() if n.is_leaf)
        derived = token_budgets(model.config, torch.float32, memory, "cpu", path, entropy_grad=False)
        assert used[-1] == derived  # (the walk's entropies carry no gradient: it computes none)
    assert used[0].block_size == 3 and used[1].block_size == 30  # the longest path above a leaf
    assert executor.budgets.metrics() == {k: float(v) for k, v in vars(used[1]).items()}
    assert [(c.event, c.budgets) for c in executor.budgets.history] == [("walk", used[0]), ("walk", used[1])]
    model.zero_grad(set_to_none=True)


def test_budgets_halve_and_grow_back_to_the_options():
    model = make_model("qwen3", "sdpa", seed=0)
    lm = TreeExecutor(model).lm
    trie = PrefixTrie.from_sequences([[1, 2, 3, 4, 5], [1, 2, 3, 6, 7, 8]])
    budgets = Budgets(memory_budget=None, block_size=40, batch_tokens=6)
    start = budgets.derive(trie, lm)
    assert start == TokenBudgets(40, 6, FIXED.subtree_tokens)
    assert budgets.halve(start) == TokenBudgets(20, 3, 256) == budgets.derive(trie, lm)
    assert budgets.halve(TokenBudgets(20, 3, 256)) == TokenBudgets(10, 1, 128) == budgets.halved
    assert budgets.halvings == 2 and budgets.given == (40, 6, None)  # the options are kept
    budgets.grow()
    assert budgets.derive(trie, lm) == TokenBudgets(20, 3, 256)  # one halving back, from the ceiling
    budgets.grow()
    assert budgets.halved is None and budgets.derive(trie, lm) == start  # the options' own again
    budgets.grow()  # (nothing to grow)
    assert budgets.halve(TokenBudgets(1, 0, 0)) is None and budgets.halvings == 0  # nothing to halve
    budgets.halve(start)
    budgets.set_given(8, 8, 0)  # by hand: replaces the halved budgets
    assert budgets.halvings == 0 and budgets.derive(trie, lm) == TokenBudgets(8, 8, 0)
    events = [(c.event, c.budgets) for c in budgets.history]
    assert events == [
        ("halved", TokenBudgets(20, 3, 256)), ("halved", TokenBudgets(10, 1, 128)),
        ("grown", TokenBudgets(20, 3, 256)), ("grown", None), ("halved", TokenBudgets(20, 3, 256)),
        ("set", None),
    ]  # fmt: skip


def test_auto_takes_reserved_bytes_off_the_free_memory(monkeypatch):
    """ "auto" on CUDA: AUTO_FRACTION x (free - reserved) - what the first optimizer step adds, measured once;
    reserve() changes it for the next walks. (The CUDA memory query is mocked: no GPU here; the arithmetic
    and the derivation from it are real.)"""
    model = make_model("qwen3", "sdpa", seed=0)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    gib = float(1 << 30)
    calls = []

    def mem_get_info(device):
        calls.append(device)
        return 2 * gib, 80 * gib

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 0.5 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 0.25 * gib)
    budgets = Budgets(reserved_bytes=gib)
    cuda = torch.device("cuda")
    free = 2.25 * gib  # the driver's free memory and the allocator's unused cache
    expected = AUTO_FRACTION * (free - gib) - 3 * params  # (no gradients yet: gradients and two Adam states)
    assert budgets.memory_bytes(model, cuda) == pytest.approx(expected)
    budgets.reserve(0.5 * gib)
    assert budgets.memory_bytes(model, cuda) == pytest.approx(expected + AUTO_FRACTION * 0.5 * gib)
    assert len(calls) == 1  # measured once, at the first walk
    assert Budgets(memory_budget=1e9, reserved_bytes=gib).memory_bytes(model, cuda) == 1e9  # given: as is
    assert Budgets().memory_bytes(model, torch.device("cpu")) is None  # off CUDA: the fixed budgets
    with pytest.raises(RuntimeError, match="reserved"):
        Budgets(reserved_bytes=free).memory_bytes(model, cuda)


def _resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_peak_memory_is_reported_after_a_walk():
    """CPU: the process's resident set size at the walk's high points (trl_dta/walk/memory/peak.py), sampled
    from its start: at least what was resident when it started; set by every walk."""
    model = make_model("qwen3", "sdpa", seed=0)
    executor = TreeExecutor(model)
    assert executor.peak_memory is None
    trie = PrefixTrie.from_sequences([[1 + t % 50 for t in range(200)], [1, 2, 3, 4, 5]])
    executor.backward(trie, lambda i, lp, ent: -lp.sum())
    assert executor.peak_memory > 0
    ballast = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB more resident during the next walk
    resident = _resident()
    executor.logprobs(trie)
    slack = 16 << 20  # (pages the allocator returns between the two reads)
    assert executor.peak_memory >= resident - slack and resident > (64 << 20)
    del ballast
    model.zero_grad(set_to_none=True)


@pytest.mark.usefixtures("fp64_exact")
def test_memory_derived_walk_is_exact():
    """A memory budget too small for the longest path: chunked backward and small calls, still exact."""
    model = make_model("qwen3", "sdpa", seed=2)
    base = [1 + (3 * t) % (VOCAB - 1) for t in range(40)]
    seqs = [base, base[:30] + [5, 6, 7], [1, 2, 3]]
    loss_fn = lambda i, lp, ent: (lp * torch.linspace(-1, 1, lp.numel(), dtype=lp.dtype)).sum()  # noqa: E731
    ref, _ = dense_grads(model, seqs, loss_fn)
    per = activation_bytes(model.config, torch.float64)
    memory = per.transient * 1024 + 30 * (per.token + per.scored + per.position)
    executor = TreeExecutor(model, memory_budget=memory)
    model.zero_grad(set_to_none=True)
    executor.backward(PrefixTrie.from_sequences(seqs), loss_fn)
    assert executor.budgets.in_use.block_size < 30  # the path does not fit: recomputed at pop
    assert max_rel_diff(grads_of(model), ref) < 1e-10


@pytest.mark.usefixtures("fp64_exact")
def test_values_only_entropies():
    """``entropy_grad=False``: a loss that reads entropies gets the gradient of that loss, them detached."""
    model = make_model("qwen3", "sdpa", seed=3)
    seqs = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2, 9, 10, 11, 12]]

    def loss_fn(i, lp, ent):  # entropies as weights (a mask in TRL), and a term that would differentiate them
        return (lp * ent.detach()).sum() + 0.5 * ent.sum()

    detached = lambda i, lp, ent: (lp * ent.detach()).sum()  # noqa: E731
    for block_size in (2, 100):  # chunked backward too: the pop's recompute takes no entropy gradient
        executor = TreeExecutor(model, block_size=block_size)
        model.zero_grad(set_to_none=True)
        executor.backward(PrefixTrie.from_sequences(seqs), loss_fn, entropies=True, entropy_grad=False)
        got = grads_of(model)
        model.zero_grad(set_to_none=True)
        executor.backward(PrefixTrie.from_sequences(seqs), detached, entropies=True)
        assert max_rel_diff(got, grads_of(model)) < 1e-12


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_host_syncs_do_not_grow_with_calls(family):
    """Every call's ids, positions and mask indices come from one host-to-device copy per walk: the walk's
    sync-prone operators (scalar reads, data-dependent shapes, tensors from Python data) stay a constant."""
    from trl_dta.testing.syncs import SyncCounter

    model = make_model(family, "sdpa", dtype=torch.float32)
    counts = []
    for rollouts in (4, 16):
        seqs = [[1, 2, 3, 4, 5, 6 + i % 7, 7 + i % 5] + [10 + i % 11] * 3 for i in range(rollouts)]
        trie = PrefixTrie.from_sequences(seqs)
        executor = TreeExecutor(model, block_size=3, batch_tokens=4, subtree_tokens=6)
        executor.backward(trie, lambda i, lp, ent: lp.sum(), entropies=True)  # warm: first-call checks
        before = executor.calls.forward + executor.calls.backward
        with SyncCounter() as syncs:
            executor.backward(trie, lambda i, lp, ent: lp.sum(), entropies=True)
            executor.logprobs(trie)
        calls = executor.calls.forward + executor.calls.backward - before
        counts.append((calls, syncs.total, dict(syncs.ops)))
    (few_calls, few, _), (many_calls, many, ops) = counts
    assert many_calls > 3 * few_calls  # the check means something: many more calls
    assert many == few <= 4, ops  # per walk: the inputs' copy, and backward's summed loss


def _random_rows(seed: int):
    """Packed rows of random trees (parents first) with their segment lengths, and a past length."""
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 7, (), generator=gen))
    parents = [-1] + [int(torch.randint(-1, k, (), generator=gen)) for k in range(1, n)]
    lengths = [int(torch.randint(1, 90, (), generator=gen)) for _ in range(n)]
    return parents, lengths, int(torch.randint(0, 200, (), generator=gen))


@pytest.mark.parametrize("seed", range(6))
def test_block_mask_is_the_packed_mask(seed):
    """Flex attention's BlockMask of a packed row admits exactly the pairs of the additive mask (sdpa's),
    tile by tile and pair by pair (flex's kernels need CUDA; benchmarks/gpu.sh checks its gradients)."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    from trl_dta.trie import TrieNode
    from trl_dta.walk.attention.packing import causal_block_mask, packed_block_mask, packed_mask
    from trl_dta.walk.inputs import WalkInputs
    from trl_dta.walk.plan import PackedSubtree, Segment

    parents, lengths, past = _random_rows(seed)
    starts = []
    for parent in parents:
        starts.append(past if parent < 0 else starts[parent] + lengths[parent])
    segments = tuple(
        Segment(TrieNode(None, s, s + n, 0), s, s + n) for s, n in zip(starts, lengths, strict=True)
    )
    step = PackedSubtree(segments, tuple(parents))
    trie = PrefixTrie.from_sequences([list(range(1, max(s.end for s in segments) + 1))])
    row = WalkInputs(trie, [step], torch.device("cpu"), packed=True).row(step)
    visible = packed_mask(row, past, torch.float32)[0, 0] == 0
    block = packed_block_mask(row, past)
    tokens = sum(lengths)
    q, kv = torch.arange(tokens)[:, None], torch.arange(past + tokens)[None, :]
    assert torch.equal(block.mask_mod(0, 0, q, kv), visible)
    assert torch.equal(block.to_dense()[0, 0].bool(), _tiles(visible, block.BLOCK_SIZE))
    causal = causal_block_mask(tokens, past, "cpu")
    assert torch.equal(causal.mask_mod(0, 0, q, kv), kv <= q + past)


def _tiles(visible: torch.Tensor, size) -> torch.Tensor:
    """Which tiles of ``visible`` hold a visible pair."""
    rows, cols = size if isinstance(size, tuple) else (size, size)
    q, k = visible.shape
    padded = torch.zeros(-(-q // rows) * rows, -(-k // cols) * cols, dtype=torch.bool)
    padded[:q, :k] = visible
    return padded.view(padded.shape[0] // rows, rows, -1, cols).any(dim=(1, 3))


def test_flex_attention_is_refused_on_cpu():
    from trl_dta import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="flex_attention.*CUDA only"):
        TreeExecutor(make_model("qwen3", "flex_attention", dtype=torch.float32))


def test_cuda_peak_read_across_walks_keeps_what_their_resets_cleared(monkeypatch):
    """A walk resets CUDA's peak statistics at its start (its own tree/peak_memory_gib);
    peak.max_memory_allocated still gives the peak since the last outside reset. CUDA's counters are simulated
    (no GPU here)."""
    from trl_dta.walk.memory import peak

    stats = {"peak": 0}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: stats["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: stats.update(peak=0))
    monkeypatch.setattr(peak, "_CARRIED", {})
    cuda = torch.device("cuda", 0)
    peak.reset_peak_memory_stats(cuda)
    stats["peak"] = 100  # e.g. generation, before the walk
    with peak.PeakMemory(cuda) as walk:
        stats["peak"] = 30  # the walk's own peak
        with peak.PeakMemory(cuda):  # a nested walk does not reset
            stats["peak"] = 40
    assert walk.peak == 40
    assert peak.max_memory_allocated(cuda) == 100
    stats["peak"] = 120  # after the walk: a new high
    assert peak.max_memory_allocated(cuda) == 120
    peak.reset_peak_memory_stats(cuda)
    assert peak.max_memory_allocated(cuda) == 0
