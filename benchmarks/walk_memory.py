"""What holds the memory of a walk: the τ² retail step's loss forward/backward (one 5.4k-token prompt, 4
completions of 130 tokens, a SmolLM2-135M-shaped Llama built from its config, fp32, sdpa) walked by
``TreeExecutor`` at several block sizes, against a dense forward/backward of the 4 rows with and without
gradient checkpointing (``logits_to_keep``: LM head on the completions only, as TRL). Each run in a fresh
process.

    python benchmarks/walk_memory.py [--runs tree:2048,tree:512,tree:256,dense+ckpt] [--threads 2]

Per run: ``saved MiB``, the peak of the tensors autograd keeps for backward
(``trl_dta.testing.memory.SavedTensorMeter``; views and tensors saved by several ops count once per save, so
this overstates shared storage such as a mask every layer saves); ``RSS MiB``, the process's peak resident
memory during the forward/backward minus its resident memory just before (the model and its gradients are
allocated before); ``s``, wall time. ``dense`` (no checkpointing) needs ~48 GB here and is not run by default.

Why the walk holds what it holds: every token forwarded with a graph keeps ~30 layers x ~74 KB of
activations (fp32, hidden 576, MLP 1536: the MLP's four 1536-wide tensors dominate), ~2.2 MB per token,
against ~69 KB per token for dense + checkpointing (each layer's input). At its peak the walk keeps the
graph of up to ``block_size`` tokens on its stack plus one more block (a recomputed block at pop, or a leaf
batch of up to ``batch_tokens``, which defaults to ``block_size``), plus the K/V of the path that each of
those forwards' attention saves (repeated per query head by transformers' sdpa path on CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT, COMPLETION, ROWS = 5400, 130, 4
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                    tie_word_embeddings=True, rope_theta=100000.0)  # fmt: skip


def _status_mib(key: str) -> float:  # VmRSS (now) or VmHWM (peak since the last reset), Linux
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key)) / 1024


def measure(run: str, threads: int) -> dict:
    """One run, in this process."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    sys.path.insert(0, ROOT)
    from trl_dta import PrefixTrie, TreeExecutor
    from trl_dta.testing.memory import SavedTensorMeter

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SMOLLM2_135M), attn_implementation="sdpa").train()
    prompt = torch.randint(100, 40000, (PROMPT,)).tolist()
    seqs = [prompt + torch.randint(100, 40000, (COMPLETION,)).tolist() for _ in range(ROWS)]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    name, _, block = run.partition(":")
    executor = TreeExecutor(model, block_size=int(block)) if name == "tree" else None
    if name == "dense+ckpt":
        model.gradient_checkpointing_enable()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
    before = _status_mib("VmRSS:")
    started = time.perf_counter()
    with SavedTensorMeter(model) as meter:
        if executor is not None:
            trie = PrefixTrie.from_sequences(seqs)
            executor.backward(trie, lambda i, lp, ent: lp.sum(), score_from=[PROMPT - 1] * ROWS)
        else:
            ids = torch.tensor(seqs)
            logits = model(input_ids=ids, logits_to_keep=COMPLETION + 1, use_cache=False).logits[:, :-1]
            logits.log_softmax(-1).gather(-1, ids[:, -COMPLETION:, None]).sum().backward()
    return dict(run=run, saved_mib=meter.peak / 2**20, rss_mib=_status_mib("VmHWM:") - before,
                seconds=time.perf_counter() - started)  # fmt: skip


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default="tree:2048,tree:512,tree:256,dense+ckpt",
                    help="comma-separated: tree:BLOCK_SIZE, dense+ckpt, dense")  # fmt: skip
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "out", "walk-memory.json"))
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one run in this process
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.threads)))
        return
    results = []
    for run in args.runs.split(","):
        cmd = [sys.executable, __file__, "--one", run, "--threads", str(args.threads)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"{run}: failed (exit {done.returncode})\n{done.stderr[-2000:]}")
            continue
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        r = results[-1]
        print(f"{run:12s} saved {r['saved_mib']:.0f} MiB, RSS +{r['rss_mib']:.0f} MiB, {r['seconds']:.1f} s")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(prompt=PROMPT, completion=COMPLETION, rows=ROWS, model=SMOLLM2_135M,
                       threads=args.threads, runs=results), f, indent=2)  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
