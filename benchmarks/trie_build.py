"""Print PrefixTrie build times for a few step shapes (inputs given as Python lists).

    python benchmarks/trie_build.py [--n 20000] [--len 1000] [--repeat 3]

Each shape is built `repeat` times; the first (cold) and best times are printed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
from trl_dta.trie import PrefixTrie  # noqa: E402


def shapes(n: int, length: int, rng: np.random.Generator):
    yield "random (no sharing)", rng.integers(0, 50_000, size=(n, length)).tolist()
    yield "identical", [rng.integers(0, 50_000, size=length).tolist()] * n
    prefix = rng.integers(0, 50_000, size=length * 9 // 10)
    tails = rng.integers(0, 50_000, size=(n, length - len(prefix)))
    yield f"shared {len(prefix)}-token prefix", [np.concatenate([prefix, t]).tolist() for t in tails]
    prompts = [rng.integers(0, 50_000, size=int(rng.integers(100, 900))) for _ in range(64)]
    rl = [
        np.concatenate([prompts[i % 64], rng.integers(0, 50_000, size=int(rng.integers(2, length)))])
        for i in range(n)
    ]
    yield "64 prompts, ragged completions", [r.tolist() for r in rl]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=20_000)
    ap.add_argument("--len", type=int, default=1_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    for name, seqs in shapes(args.n, args.len, rng):
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            trie = PrefixTrie.from_sequences(seqs)
            times.append(time.perf_counter() - t0)
        print(
            f"{name:32s} first {times[0]:6.3f} s  best {min(times):6.3f} s  "
            f"tokens {trie.num_tokens:>10,}  unique {trie.num_unique_tokens:>10,}  "
            f"nodes {trie.num_nodes:>6,}"
        )
        del trie


if __name__ == "__main__":
    main()
