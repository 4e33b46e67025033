"""How close the walk runs to what its unique tokens cost: the τ² step trie against one causal row.

    python benchmarks/ceiling.py [--case tau2-ga4] [--threads 1,2] [--repeats 5]

The trainer benchmark (``benchmarks/trainer.py``) compares the walk with dense TRL against the token dedup
ratio. This script asks a narrower question: given the step's unique tokens, how much faster could any
schedule of them be? It captures the loss walk's trie of one ``TreePPOTrainer`` step of a ``trainer.py`` case
(same model, same scripted batch) and times, alternating, median of ``--repeats``:

* ``walk``: ``TreeExecutor.backward`` on that trie, LM head on the scored positions, as the trainer runs it;
* ``one row``: forward + backward of one causal row as long as the trie's unique tokens, LM head on as many
  positions as the walk scores. It computes the same matmuls as the walk with no mask, no cache and one
  call, but attends over every earlier unique token (more attention than the trie needs): a reference
  for what the unique tokens cost in the best-shaped single call, not a computation of the same loss;
* ``dense``: forward + backward of the step's rows as one right-padded batch (TRL's layout, one call).

and splits each walk's operator time (``torch.profiler``) into matmuls, attention and the rest, per thread
count, to show what gains from a second thread. ``dedup`` and ``flop ratio`` (``TreeExecutor.flops``) are the
token and FLOP-weighted ideals of walk vs dense.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import trainer as bench  # noqa: E402  (benchmarks/trainer.py: its cases, model and trainers)

from trl_dta import PrefixTrie, TreeExecutor  # noqa: E402
from trl_dta.testing.grpo import tiny_model  # noqa: E402


def step_trie(case: str):
    """The sequences and score_from of the first loss walk of a one-step TreePPOTrainer run of ``case``."""
    caught, backward = [], TreeExecutor.backward

    def capture(self, trie, loss_fn, *args, score_from=None, **kwargs):
        caught.append((list(trie.sequences), score_from))
        return backward(self, trie, loss_fn, *args, score_from=score_from, **kwargs)

    TreeExecutor.backward = capture
    try:
        with tempfile.TemporaryDirectory() as out:
            bench.run("c: TreePPO", 1, out, case=case)
    finally:
        TreeExecutor.backward = backward
    sequences, score_from = caught[0]
    return PrefixTrie.from_sequences(sequences), list(score_from)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", choices=sorted(bench.CASES), default="tau2-ga4")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    trie, score_from = step_trie(args.case)
    model = tiny_model(seed=0, **bench.MODEL)
    executor = TreeExecutor(model)
    dense_flops, walk_flops = executor.flops(trie, score_from)
    unique, vocab = trie.num_unique_tokens, model.config.vocab_size
    scored = sum(len(s) - 1 - f for s, f in zip(trie.sequences, score_from, strict=True))  # dense's count
    walk_scored = round(scored / trie.dedup_ratio)  # about what the walk scores (each node's positions once)
    rows = [torch.as_tensor(s) for s in trie.sequences]
    padded = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)

    def walk():
        executor.backward(trie, lambda i, logps, entropies: logps.sum(), score_from=score_from)

    def forward_backward(ids, keep):
        hidden = model.model(input_ids=ids).last_hidden_state[:, -keep:]
        torch.log_softmax(model.lm_head(hidden).float(), -1).sum().backward()

    ids = torch.randint(0, vocab, (1, unique))
    methods = {"walk": walk, "one row": lambda: forward_backward(ids, walk_scored),
               "dense": lambda: forward_backward(padded, padded.shape[1] - min(score_from))}  # fmt: skip
    print(f"{args.case}: {len(trie)} rows, {unique} unique tokens, dedup {trie.dedup_ratio:.2f}, "
          f"flop ratio {dense_flops / walk_flops:.2f}")  # fmt: skip
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        times = collections.defaultdict(list)
        for fn in methods.values():  # warm-up
            model.zero_grad(set_to_none=True)
            fn()
        for _ in range(args.repeats):
            for name, fn in methods.items():
                model.zero_grad(set_to_none=True)
                started = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - started)
        med = {name: statistics.median(t) for name, t in times.items()}
        split = collections.Counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            walk()
        for event in prof.key_averages():
            if event.key.startswith("aten::"):
                kind = "matmul" if event.key in ("aten::mm", "aten::addmm", "aten::bmm") else "other"
                kind = "attention" if "scaled_dot_product" in event.key else kind
                split[kind] += event.self_cpu_time_total / 1e3
        walk_s = med["walk"]
        ratios = f"dense/walk {med['dense'] / walk_s:.2f}x, one row/walk {med['one row'] / walk_s:.2f}"
        timings = ", ".join(f"{n} {t * 1e3:.0f} ms" for n, t in med.items())
        ops = ", ".join(f"{k} {v:.0f} ms" for k, v in sorted(split.items()))
        print(f"  {threads} thread(s): {timings}; {ratios}; walk ops: {ops}")


if __name__ == "__main__":
    main()
