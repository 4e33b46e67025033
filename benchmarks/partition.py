"""Split one step's rollouts across K data-parallel ranks: how balanced is the per-rank work, and how many
shared-prefix tokens get computed more than once?

    python benchmarks/partition.py [--seed 0] [--out benchmarks/out]

What it compares
----------------
A rank that runs the prefix-trie executor pays for the *unique* tokens of its own rollouts (the tokens of
the trie built from them), so a rank's load is ``PrefixTrie.from_sequences(its rollouts).num_unique_tokens``
(0 for a rank with no rollouts). Four ways to split the same rollouts over K = 2, 8, 64 ranks:

(a) ``trl``        TRL's default: the step's rollouts in generation order (group after group, each group
                   the ``num_generations`` completions of one prompt), cut into K contiguous chunks of
                   equal row count; rank r gets chunk r. The sizes below make every chunk whole groups.
(b) ``greedy-raw`` Rollouts sorted by length, longest first; each goes to the rank with the fewest raw
                   (non-deduplicated) tokens so far.
(c) ``greedy-tree`` Same order; each rollout goes to the rank whose *tree* load would be smallest after
                   adding it, i.e. argmin_r load_r + len - LCP(rollout, rank r's rollouts) (ties: the rank
                   with the smaller load, then the lower index). The incremental cost is EXACT: the longest
                   common prefix of a sequence with a set is reached at the set's lexicographic neighbours,
                   so each rank keeps its rollouts' positions in the global lexicographic order in a sorted
                   list (bisect) and the LCP of two positions is a range-minimum over the global trie's
                   ``lexicographic_lcp()`` (sparse table). The script asserts that the greedy's running
                   loads equal the per-rank tries' unique tokens at the end.
(d) ``lexicographic``  ``trl_dta.lexicographic_partition``: contiguous runs of the lexicographic order
                   with the smallest possible maximum unique-token cost.

Metrics, all from the exact final per-rank tries:

* ``max/mean``: the largest rank load over the mean rank load. 1.00 is perfect balance; the step waits for
  the slowest rank, so 1.30 means ~30% of the ranks' aggregate time is idle waiting.
* ``max/ideal``: the largest rank load over ``global unique / K`` (a perfect split without duplication).
  This is the step time relative to the ideal and the fairest single number: ``max/mean`` divides by the
  method's own mean, which duplication inflates, so it flatters methods that duplicate a lot.
* ``dup tok``: sum of the rank loads minus the unique tokens of the global trie = tokens that are computed
  on more than one rank because a shared prefix landed on several ranks. ``dup %`` is that over the
  global unique tokens (the extra work on top of a perfect single-trie step). Every method that gives
  all K ranks work duplicates at least the shared system prompt K-1 times; TRL's split, whose chunks are
  whole groups, duplicates exactly that and nothing more.
* ``rows/rank``: fewest-most rollouts on a rank.

The JSON also holds each rank's load, ``lower_bound`` (no split can have a smaller max load: the longest
rollout, and at least ``shared + (global unique - shared) / K`` with ``shared`` the prefix common to all
rollouts) and ``max_over_bound``.

Shapes (synthetic, token ids uniform in a 32k vocabulary, seeded; the number of prompts grows with K so
that every rank has several rollouts):

* ``grpo``      one 500-token system prompt, prompts of 100-300 tokens, groups of 8, completions
                uniform 200-800.
* ``multiturn`` tau^2-like agent rollouts: a 2000-token system prompt + tool schemas, per task a user
                opening, groups of 8 sharing the first assistant tool call + tool response, then 2-4
                further turns where the group splits into subgroups at random turns (a subgroup shares
                its turns until it splits; the last turn is unique per rollout).
* ``skewed``    like grpo but prompts log-normal (20-6000 tokens) and completions heavy-tailed:
                log-normal with a per-prompt difficulty factor (20-16384 tokens), so some whole groups
                are far longer than others.

Outputs: an aligned table on stdout, ``<out>/partition.json`` and ``<out>/partition.png`` (one column
per shape, grouped bars per K for the four methods; rows: max/mean, max/ideal, duplicated tokens as % of
the global unique tokens). Lower is better everywhere. Pure Python/numpy; a few seconds.
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))  # common.py
import common  # noqa: E402

from trl_dta.partition import lexicographic_partition  # noqa: E402
from trl_dta.trie import PrefixTrie  # noqa: E402

VOCAB = 32_000
KS = (2, 8, 64)
METHODS = ("trl", "greedy-raw", "greedy-tree", "lexicographic")
SHAPES = ("grpo", "multiturn", "skewed")
# number of prompts (grpo, skewed) / tasks (multiturn) per K; groups of 8 rollouts each
NUM_PROMPTS = {
    "grpo": {2: 64, 8: 128, 64: 256},
    "skewed": {2: 64, 8: 128, 64: 256},
    "multiturn": {2: 32, 8: 32, 64: 64},
}
GROUP = 8


# ---------------------------------------------------------------------------------------------- shapes


def _tok(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, VOCAB, size=int(n), dtype=np.int64)


def make_grpo(rng: np.random.Generator, num_prompts: int) -> list[np.ndarray]:
    system = _tok(rng, 500)
    out = []
    for _ in range(num_prompts):
        prompt = np.concatenate([system, _tok(rng, rng.integers(100, 301))])
        out += [np.concatenate([prompt, _tok(rng, rng.integers(200, 801))]) for _ in range(GROUP)]
    return out


def make_skewed(rng: np.random.Generator, num_prompts: int) -> list[np.ndarray]:
    system = _tok(rng, 500)
    out = []
    for _ in range(num_prompts):
        plen = int(np.clip(rng.lognormal(np.log(200), 1.2), 20, 6000))
        prompt = np.concatenate([system, _tok(rng, plen)])
        difficulty = rng.lognormal(0.0, 0.8)  # whole groups of long completions
        for _ in range(GROUP):
            clen = int(np.clip(400 * difficulty * rng.lognormal(0.0, 0.8), 20, 16384))
            out.append(np.concatenate([prompt, _tok(rng, clen)]))
    return out


def make_multiturn(rng: np.random.Generator, num_tasks: int) -> list[np.ndarray]:
    system = _tok(rng, 2000)  # system prompt + tool schemas
    out: list[np.ndarray] = []

    def turn() -> np.ndarray:  # assistant message / tool call + tool or user response
        return np.concatenate([_tok(rng, rng.integers(30, 301)), _tok(rng, rng.integers(50, 601))])

    def grow(prefix: np.ndarray, size: int, turns_left: int) -> None:
        if turns_left == 1:  # last turn: every rollout's own final answer
            out.extend(np.concatenate([prefix, _tok(rng, rng.integers(20, 301))]) for _ in range(size))
            return
        if size > 1 and rng.random() < 0.5:  # this subgroup splits here into 2-3 parts
            nparts = int(rng.integers(2, min(3, size) + 1))
            cuts = np.sort(rng.choice(np.arange(1, size), size=nparts - 1, replace=False))
            sizes = np.diff(np.concatenate([[0], cuts, [size]])).tolist()
        else:
            sizes = [size]
        for s in sizes:
            grow(np.concatenate([prefix, turn()]), s, turns_left - 1)

    for _ in range(num_tasks):
        opening = _tok(rng, rng.integers(50, 301))
        first_call = np.concatenate([_tok(rng, rng.integers(30, 151)), _tok(rng, rng.integers(100, 801))])
        grow(np.concatenate([system, opening, first_call]), GROUP, int(rng.integers(2, 5)))
    return out


MAKERS = {"grpo": make_grpo, "multiturn": make_multiturn, "skewed": make_skewed}


# ---------------------------------------------------------------------------------------------- methods


def split_trl(seqs: list[np.ndarray], k: int) -> list[list[int]]:
    n = len(seqs)
    assert n % k == 0 and (n // k) % GROUP == 0, (n, k)  # equal rows, whole groups per rank
    b = n // k
    return [list(range(r * b, (r + 1) * b)) for r in range(k)]


def split_greedy_raw(seqs: list[np.ndarray], k: int) -> list[list[int]]:
    parts: list[list[int]] = [[] for _ in range(k)]
    heap = [(0, r) for r in range(k)]
    for i in sorted(range(len(seqs)), key=lambda i: -len(seqs[i])):
        load, r = heapq.heappop(heap)
        parts[r].append(i)
        heapq.heappush(heap, (load + len(seqs[i]), r))
    return parts


class _LexLCP:
    """LCP of any two sequences from their positions in the global lexicographic order (sparse table)."""

    def __init__(self, trie: PrefixTrie):
        lcp = np.array(trie.lexicographic_lcp(), dtype=np.int64)
        self.levels = [lcp]
        j = 1
        while 2 * j <= len(lcp):
            prev = self.levels[-1]
            self.levels.append(np.minimum(prev[:-j], prev[j:]))
            j *= 2
        self.levels = [lv.tolist() for lv in self.levels]

    def between(self, a: int, b: int) -> int:
        """LCP of the sequences at lexicographic positions a < b: min(lcp[a+1 .. b])."""
        lo, hi = a + 1, b
        lv = (hi - lo + 1).bit_length() - 1
        row = self.levels[lv]
        x, y = row[lo], row[hi - (1 << lv) + 1]
        return min(y, x)


def split_greedy_tree(seqs: list[np.ndarray], k: int, trie: PrefixTrie) -> tuple[list[list[int]], list[int]]:
    order = trie.lexicographic_order()
    pos = [0] * len(order)
    for p, i in enumerate(order):
        pos[i] = p
    lex = _LexLCP(trie)
    members: list[list[int]] = [[] for _ in range(k)]  # sorted lexicographic positions per rank
    parts: list[list[int]] = [[] for _ in range(k)]
    load = [0] * k
    for i in sorted(range(len(seqs)), key=lambda i: -len(seqs[i])):
        p, n = pos[i], len(seqs[i])
        best, best_new = -1, None
        for r in range(k):
            lst = members[r]
            j = bisect.bisect_left(lst, p)
            m = lex.between(lst[j - 1], p) if j else 0
            if j < len(lst):
                m = max(m, lex.between(p, lst[j]))
            new = load[r] + n - m
            if best_new is None or new < best_new or (new == best_new and load[r] < load[best]):
                best, best_new = r, new
        bisect.insort(members[best], p)
        parts[best].append(i)
        load[best] = best_new
    return parts, load


# ---------------------------------------------------------------------------------------------- run


def rank_loads(seqs: list[np.ndarray], parts: list[list[int]]) -> list[int]:
    return [PrefixTrie.from_sequences([seqs[i] for i in p]).num_unique_tokens if p else 0 for p in parts]


def evaluate(shape: str, k: int, seed: int) -> list[dict]:
    rng = np.random.default_rng([seed, SHAPES.index(shape), k])
    seqs = MAKERS[shape](rng, NUM_PROMPTS[shape][k])
    trie = PrefixTrie.from_sequences(seqs)
    glob = trie.num_unique_tokens
    # No split can beat this: a rank pays at least its longest rollout, and every used rank pays the prefix
    # shared by all rollouts (the system prompt), so max load >= shared + (global - shared) / K.
    shared = min(trie.lexicographic_lcp()[1:])
    bound = max(max(map(len, seqs)), shared + (glob - shared) / k)
    rows = []
    for method in METHODS:
        t0 = time.perf_counter()
        if method == "trl":
            parts = split_trl(seqs, k)
        elif method == "greedy-raw":
            parts = split_greedy_raw(seqs, k)
        elif method == "greedy-tree":
            parts, running = split_greedy_tree(seqs, k, trie)
        else:
            parts = lexicographic_partition(trie, k)
        split_s = time.perf_counter() - t0
        assert sorted(i for p in parts for i in p) == list(range(len(seqs))), method
        loads = rank_loads(seqs, parts)
        if method == "greedy-tree":
            assert running == loads, "incremental tree cost is not exact"
        mean = sum(loads) / k
        dup = sum(loads) - glob
        rows.append(
            {
                "shape": shape,
                "K": k,
                "method": method,
                "rollouts": len(seqs),
                "raw_tokens": trie.num_tokens,
                "global_unique": glob,
                "max_load": max(loads),
                "mean_load": mean,
                "max_over_mean": max(loads) / mean,
                "max_over_ideal": max(loads) / (glob / k),
                "lower_bound": bound,
                "max_over_bound": max(loads) / bound,
                "dup_tokens": dup,
                "dup_pct": 100.0 * dup / glob,
                "rows_min": min(map(len, parts)),
                "rows_max": max(map(len, parts)),
                "split_s": split_s,
                "loads": loads,
            }
        )
    return rows


COLUMNS = [  # (header, key, format)
    ("shape", "shape", "{}"), ("K", "K", "{}"), ("rollouts", "rollouts", "{}"),
    ("global uniq", "global_unique", "{:,}"), ("method", "method", "{}"),
    ("max/mean", "max_over_mean", "{:.3f}"), ("max/ideal", "max_over_ideal", "{:.3f}"),
    ("dup tok", "dup_tokens", "{:,}"), ("dup %", "dup_pct", "{:.2f}"), ("rows/rank", "rows_per_rank", "{}"),
]  # fmt: skip


def print_table(results: list[dict]) -> None:
    for shape in SHAPES:  # one block per shape
        for k in KS:
            rows = [dict(r, rows_per_rank=f"{r['rows_min']}-{r['rows_max']}") for r in results
                    if r["shape"] == shape and r["K"] == k]  # fmt: skip
            print(common.format_table(rows, COLUMNS) + "\n")


def plot(results: list[dict], path: str) -> None:
    plt = common.pyplot()

    panels = [
        ("max_over_mean", "max / mean rank load"),
        ("max_over_ideal", "max rank load / (global unique / K)"),
        ("dup_pct", "duplicated tokens, % of global unique"),
    ]
    fig, axes = plt.subplots(
        len(panels), len(SHAPES), figsize=(5 * len(SHAPES), 3.6 * len(panels)), squeeze=False
    )
    width = 0.8 / len(METHODS)
    x = np.arange(len(KS))
    for col, shape in enumerate(SHAPES):
        for row, (key, label) in enumerate(panels):
            ax = axes[row][col]
            for m, method in enumerate(METHODS):
                vals = [
                    next(
                        r[key]
                        for r in results
                        if r["shape"] == shape and r["K"] == k and r["method"] == method
                    )
                    for k in KS
                ]
                ax.bar(x + (m - (len(METHODS) - 1) / 2) * width, vals, width, label=method)
            ax.set_xticks(x, [f"K={k}" for k in KS])
            ax.set_ylabel(label)
            if row == 0:
                ax.set_title(shape)
            if key != "dup_pct":
                ax.axhline(1.0, color="k", lw=0.6)
                lo = min(r[key] for r in results if r["shape"] == shape)
                ax.set_ylim(min(0.98, lo - 0.02), None)
            ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Splitting a step's rollouts over K ranks (load = unique tokens of the rank's trie)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--out",
        default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"),
        help="folder for partition.json and partition.png",
    )
    args = ap.parse_args()
    t0 = time.perf_counter()
    results = [row for shape in SHAPES for k in KS for row in evaluate(shape, k, args.seed)]
    print_table(results)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "partition.json"), "w") as f:
        json.dump(
            {"args": vars(args), "group": GROUP, "num_prompts": NUM_PROMPTS, "results": results}, f, indent=1
        )
    plot(results, os.path.join(args.out, "partition.png"))
    print(f"\nwall {time.perf_counter() - t0:.1f} s; wrote {args.out}/partition.json and partition.png")


if __name__ == "__main__":
    main()
