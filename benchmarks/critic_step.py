"""Benchmark: a step with a value model, walked against dense per-sequence training, beside the policy alone.

    python benchmarks/critic_step.py [--quick] [--repeats 3] [--threads 2] [--out docs/critic-step.json]

For each shape, in one run, alternating (median of ``--repeats`` after one warm-up of each):

* ``dense policy``: TRL's way, one padded forward + backward per group (per sample for turn-level samples),
  the LM head on completion positions (``benchmarks/peer_bench``'s ``dense``);
* ``dense policy + value``: the same, then the value model (``value_model_from(policy)``) the same way with
  the value loss on the completion positions;
* ``walk policy``: ``TreeExecutor.backward`` on the step's trie;
* ``walk policy + value``: the same, then the value model's own executor on the same trie.

The question (issue 39): does the whole step with a critic keep the policy's speed-up? ``ratio`` =
(speed-up with the value model) / (speed-up of the policy alone); within 10% of 1 is the target. Shapes:

* ``tau2-2x8``: the peers' τ² CPU shape (``benchmarks/peer_bench/workloads.py``: 2 tasks x 8 rollouts, a
  shared system prompt, tool turns shared by halves and quarters of a group);
* ``turns-4x6``: turn-level samples: 4 trajectories of 6 turns, each turn its own sample whose prompt is
  the whole history so far (system, user, earlier turns), as trainers that train per turn build them.

Model: the peer benchmark's ``cpu`` Qwen3 (4 layers, hidden 256, 32k vocabulary) in fp32, sdpa.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peer_bench.context import completion_logps, grpo_loss, padded  # noqa: E402
from peer_bench.workloads import Workload, make_model, tau2_shape  # noqa: E402

from trl_dta import PrefixTrie, TreeExecutor, value_model_from  # noqa: E402


def turn_level(name, vocab, trajectories, turns, system, user, turn, seed=0) -> Workload:
    """Each turn of each trajectory as its own sample: prompt = the history before it, completion = it."""
    rng = np.random.default_rng(seed)
    rand = lambda n: rng.integers(0, vocab, size=int(n)).tolist()  # noqa: E731
    sys_tokens, groups = rand(system), []
    for _ in range(trajectories):
        history = sys_tokens + rand(user)
        for _ in range(turns):
            completion = rand(rng.integers(turn // 2, turn * 3 // 2 + 1))
            groups.append((list(history), [completion]))
            history += completion + rand(turn // 2)  # the turn, then a tool's or the user's answer
    return Workload(name, "turns", groups, torch.as_tensor(rng.normal(size=len(groups)), dtype=torch.float32))


def value_loss(values, targets, rows):
    return 0.5 * ((values - targets) ** 2).mean() / rows


def dense_step(model, wl, value):
    """One padded forward + backward per group; the value model's values on completion positions."""
    rows, lo = wl.num_rows, 0
    for prompt, comps in wl.groups:
        c_ids, c_mask = padded(comps, "cpu")
        p_ids = torch.as_tensor(prompt)[None].expand(len(comps), -1)
        ids, mask = torch.cat([p_ids, c_ids], 1), torch.cat([torch.ones_like(p_ids), c_mask], 1)
        width = c_ids.shape[1]
        m = c_mask.float()
        if value:
            values = model(input_ids=ids, attention_mask=mask).logits[:, -width - 1 : -1, 0]
            loss = sum(value_loss(values[r][m[r] > 0], 1.0, rows) for r in range(len(comps)))
        else:
            logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=width + 1).logits[:, :-1]
            lp = completion_logps(logits, c_ids)
            loss = grpo_loss((lp * m).sum(1) / m.sum(1), wl.advantages[lo : lo + len(comps)], rows)
        loss.backward()
        lo += len(comps)


def walk_step(executor, wl, value):
    rows = wl.rows
    trie = PrefixTrie.from_sequences([s for s, _ in rows])

    def loss_fn(i, out, _):
        if value:
            return value_loss(out, 1.0, len(rows))
        return grpo_loss(out.mean(), wl.advantages[i], len(rows))

    executor.backward(trie, loss_fn, score_from=[plen - 1 for _, plen in rows])


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the tiny model and shapes (a smoke run)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    name = "tiny" if args.quick else "cpu"
    policy = make_model(name, "cpu", torch.float32, "sdpa")
    critic = value_model_from(policy).eval()
    vocab = policy.config.vocab_size
    scale = 0.25 if args.quick else 1.0
    s = lambda n: max(2, int(n * scale))  # noqa: E731
    shapes = [
        tau2_shape("tau2-2x8", vocab, tasks=2, group=8, system=s(384), prompt=s(64), turn=s(96), final=s(96)),
        turn_level("turns-4x6", vocab, trajectories=4, turns=6, system=s(384), user=s(64), turn=s(96)),
    ]
    executors = {v: TreeExecutor(m, block_size=2048) for v, m in ((False, policy), (True, critic))}
    runs = {
        "dense_policy": lambda wl: dense_step(policy, wl, False),
        "dense_value": lambda wl: dense_step(critic, wl, True),
        "walk_policy": lambda wl: walk_step(executors[False], wl, False),
        "walk_value": lambda wl: walk_step(executors[True], wl, True),
    }
    results = []
    for wl in shapes:
        times = {k: [] for k in runs}
        for repeat in range(args.repeats + 1):  # the first: warm-up, not kept
            for key, run in runs.items():
                policy.zero_grad(set_to_none=True)
                critic.zero_grad(set_to_none=True)
                t = timed(lambda: run(wl))  # noqa: B023
                if repeat:
                    times[key].append(t)
        med = {k: statistics.median(v) for k, v in times.items()}
        policy_speedup = med["dense_policy"] / med["walk_policy"]
        step_speedup = (med["dense_policy"] + med["dense_value"]) / (med["walk_policy"] + med["walk_value"])
        stats = wl.stats()
        row = {"shape": wl.name, "rows": stats["rows"], "tokens": stats["tokens"], "dedup": stats["dedup"],
               **{f"{k}_s": v for k, v in med.items()}, "policy_speedup": policy_speedup,
               "step_speedup": step_speedup, "ratio": step_speedup / policy_speedup}  # fmt: skip
        results.append(row)
        print(" | ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    if args.out:
        meta = {"model": name, "threads": args.threads, "repeats": args.repeats, "torch": torch.__version__}
        Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
