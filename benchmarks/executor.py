"""Benchmark: TreeExecutor.backward vs a dense padded forward+backward on tau2-bench-shaped rollout batches.

    python benchmarks/executor.py [--quick] [--sizes small,large] [--repeats 3] [--dense_micro_batch 8]
                                  [--model qwen3|qwen3_5]

What is measured, per batch size, on a small Qwen3 (random weights, fp32, CPU), or with ``--model qwen3_5``
a Qwen3.5-shaped hybrid of the same size (three Gated DeltaNet layers, then one attention layer; the walk
carries their conv and recurrent states; transformers' PyTorch kernels, as on a CPU without
flash-linear-attention):

* dense: the rollouts right-padded to the longest one (as TRL pads a generation batch), forwarded and
  backpropagated ``--dense_micro_batch`` rows at a time (gradients accumulated), full logits, log_softmax in
  fp32, per-row GRPO-like loss on the completion tokens. No gradient checkpointing.
* tree: ``PrefixTrie.from_sequences`` (timed too) + ``TreeExecutor.backward`` with the same loss.

Both give the same gradients (checked before timing; the checked run, also metered for memory, is the
warm-up). Times are medians of ``--repeats`` alternating runs; memory is the peak of autograd-saved tensors
(``SavedTensorMeter``), i.e. activations, not the allocator's peak.

Reading the table: ``dedup`` = tokens / unique tokens is the speedup one would expect if cost were linear in
tokens forwarded, so ``speedup / dedup`` is the tree's efficiency against that ideal. It can exceed 1: dense
also pays for padding (``padded`` = padded tokens / real tokens) and attends over the shared prefix once per
row. Below 1 it measures the walk's overheads: many small forwards instead of a few big ones, and
per-segment backward calls. ``--dense_logits_to_keep`` gives dense TRL's saving of
computing the LM head on completion positions only (the tree computes it on every unique token).

Run it on an otherwise idle machine. If another job holds one of the cores, each multi-threaded op waits
for a descheduled thread: a 2-thread run then slowed the tree (thousands of small ops) ~10x but dense
(fewer, bigger ops) ~2x; use ``--threads 1`` there. The JSON keeps every run, their minimum and the load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch
from transformers import AutoModelForCausalLM, Qwen3_5TextConfig, Qwen3Config

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's trl_dta
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # common.py
import common

from trl_dta import PrefixTrie, TreeExecutor
from trl_dta.compare import relative_error
from trl_dta.testing.memory import SavedTensorMeter

VOCAB = 32_000
# Shapes: one system prompt + tool schemas shared by all rollouts; per task a prompt shared by its group;
# per half-group a shared first agent turn + tool response; then each rollout's own later turns.
SIZES = {
    "tiny": {
        "num_tasks": 1,
        "group": 8,
        "system_len": 64,
        "prompt_len": 16,
        "first_turn_len": 16,
        "later_len": 32,
    },
    "small": {
        "num_tasks": 1,
        "group": 8,
        "system_len": 512,
        "prompt_len": 64,
        "first_turn_len": 96,
        "later_len": 128,
    },
    "medium": {
        "num_tasks": 1,
        "group": 12,
        "system_len": 768,
        "prompt_len": 64,
        "first_turn_len": 96,
        "later_len": 384,
    },
    "large": {
        "num_tasks": 2,
        "group": 10,
        "system_len": 768,
        "prompt_len": 64,
        "first_turn_len": 96,
        "later_len": 192,
    },
}
DEFAULT_SIZES = "small,medium,large"


def make_model(kind: str = "qwen3") -> torch.nn.Module:
    # Tiny but not trivial. The 32k vocab matters: in small models the LM head dominates the cost (here 8.2M
    # of ~12M parameters) and the [tokens, vocab] fp32 logits dominate activation memory, as in real training.
    sizes = dict(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, tie_word_embeddings=False,
    )  # fmt: skip
    if kind == "qwen3_5":  # Qwen3.5's layout: 3 linear-attention (Gated DeltaNet) layers per attention layer
        config = Qwen3_5TextConfig(
            **sizes, layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
            linear_conv_kernel_dim=4,
        )  # fmt: skip
    else:
        config = Qwen3Config(**sizes)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.float().eval()  # eval: no dropout (the tree walk requires it)


def tau2_batch(num_tasks, group, system_len, prompt_len, first_turn_len, later_len, seed=0):
    """Random-token rollouts shaped like a tau2-bench step (see SIZES); later turns ~ U[0.5, 1.5] x later_len
    tokens, so rollouts diverge after their half-group's first turn."""
    rng = np.random.default_rng(seed)
    rand = lambda n: rng.integers(0, VOCAB, size=n).tolist()
    system, seqs = rand(system_len), []
    for _ in range(num_tasks):
        prompt = rand(prompt_len)
        firsts = [rand(first_turn_len) for _ in range(2)]  # same first tool call in each half of the group
        for r in range(group):
            later = int(rng.integers(later_len // 2, later_len * 3 // 2 + 1))
            seqs.append(system + prompt + firsts[2 * r // group] + rand(later))
    return seqs


def grpo_advantages(num_tasks, group, seed=0) -> torch.Tensor:
    """Random rewards standardised within each group, as GRPO does."""
    rewards = np.random.default_rng(seed + 1).normal(size=(num_tasks, group))
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    return ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).flatten()


def dense_backward(model, seqs, adv, completion_start, micro_batch, logits_to_keep=False):
    """Right-pad every rollout to the longest, then forward/backward ``micro_batch`` rows at a time."""
    rows, width = len(seqs), max(map(len, seqs))
    ids = torch.zeros(rows, width, dtype=torch.long)
    attn = torch.zeros(rows, width, dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, : len(s)], attn[r, : len(s)] = torch.as_tensor(s), 1
    # logps[:, t] scores token t + 1; the completion is scored from position completion_start - 1 on.
    first = completion_start - 1
    for lo in range(0, rows, micro_batch):
        mb_ids, mb_attn = ids[lo : lo + micro_batch], attn[lo : lo + micro_batch]
        if logits_to_keep:  # TRL-style: LM head only on the completion positions
            out = model(input_ids=mb_ids, attention_mask=mb_attn, logits_to_keep=width - first)
            logits = out.logits[:, :-1]
        else:
            logits = model(input_ids=mb_ids, attention_mask=mb_attn).logits[:, first:-1]
        logps = torch.log_softmax(logits.float(), -1).gather(-1, mb_ids[:, first + 1 :, None]).squeeze(-1)
        mask = mb_attn[:, first + 1 :].float()
        mean_logp = (logps * mask).sum(1) / mask.sum(1)
        grpo_loss(mean_logp, adv[lo : lo + micro_batch], rows).sum().backward()


def grpo_loss(mean_logp, adv, rows):
    """On-policy GRPO surrogate per sequence: -advantage x mean completion log-prob, / rows (batch mean)."""
    return -adv * mean_logp / rows


def tree_backward(executor, seqs, adv, completion_start):
    trie = PrefixTrie.from_sequences(seqs)
    executor.backward(trie, lambda i, lp, _: grpo_loss(lp[completion_start - 1 :].mean(), adv[i], len(seqs)))
    return trie


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def run_size(name, shape, model, executor, args):
    seqs = tau2_batch(**shape, seed=0)
    adv = grpo_advantages(shape["num_tasks"], shape["group"], seed=0)
    start = shape["system_len"] + shape["prompt_len"]
    micro, keep = args.dense_micro_batch, args.dense_logits_to_keep
    dense = lambda: dense_backward(model, seqs, adv, start, micro, keep)
    tree = lambda: tree_backward(executor, seqs, adv, start)

    # Correctness guard + memory + warm-up: one metered run of each, gradients compared.
    model.zero_grad(set_to_none=True)
    with SavedTensorMeter(model) as dense_meter:
        dense()
    ref = grads(model)
    model.zero_grad(set_to_none=True)
    with SavedTensorMeter(model) as tree_meter:
        trie = tree()
    got = grads(model)
    if got.keys() != ref.keys():
        raise SystemExit(f"[{name}] tree and dense give gradients to different parameters; aborting")
    # per tensor, relative to its largest entry; tensors whose gradient is tiny next to the largest one (the
    # hybrid's decay gates, ~4e-4 of it: sums of cancelling terms through float32 kernels, where two exact
    # computations differ by ~2e-3 of their own size) against the largest
    err = relative_error(got, ref, tiny=1e-3)
    if not err < 1e-3:
        raise SystemExit(f"[{name}] tree and dense gradients differ (max relative error {err:.2e}); aborting")

    dense_s, tree_s = [], []
    for _ in range(args.repeats):
        model.zero_grad(set_to_none=True)
        dense_s.append(common.timed(dense))
        model.zero_grad(set_to_none=True)
        tree_s.append(common.timed(tree))
    model.zero_grad(set_to_none=True)
    d, t = statistics.median(dense_s), statistics.median(tree_s)
    padded = len(seqs) * max(map(len, seqs))
    return {
        "size": name, "shape": shape, "rows": len(seqs), "tokens": trie.num_tokens,
        "unique_tokens": trie.num_unique_tokens, "dedup_ratio": trie.dedup_ratio, "padded_tokens": padded,
        "padded_ratio": padded / trie.num_tokens, "trie_nodes": trie.num_nodes, "grad_max_rel_err": err,
        "dense_s": d, "tree_s": t, "dense_runs_s": dense_s,
        "tree_runs_s": tree_s, "dense_min_s": min(dense_s), "tree_min_s": min(tree_s), "speedup": d / t,
        "speedup_over_dedup": d / t / trie.dedup_ratio,
        "dense_saved_mib": dense_meter.peak / 2**20, "tree_saved_mib": tree_meter.peak / 2**20,
        "memory_ratio": dense_meter.peak / tree_meter.peak,
    }  # fmt: skip


COLUMNS = [  # (header, key, format)
    ("size", "size", "{}"), ("rows", "rows", "{}"), ("tokens", "tokens", "{:,}"),
    ("unique", "unique_tokens", "{:,}"), ("dedup", "dedup_ratio", "{:.2f}x"),
    ("padded", "padded_ratio", "{:.2f}x"),
    ("dense s", "dense_s", "{:.2f}"), ("tree s", "tree_s", "{:.2f}"), ("speedup", "speedup", "{:.2f}x"),
    ("speedup/dedup", "speedup_over_dedup", "{:.2f}"), ("dense MiB", "dense_saved_mib", "{:.0f}"),
    ("tree MiB", "tree_saved_mib", "{:.0f}"), ("mem ratio", "memory_ratio", "{:.1f}x"),
]  # fmt: skip


def print_table(results):
    print(common.format_table(results, COLUMNS))


def plot(results, path):
    plt = common.pyplot()

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    x, names = np.arange(len(results)), [r["size"] for r in results]
    ax1.bar(x - 0.2, [r["dense_s"] for r in results], 0.4, label="dense (padded)")
    ax1.bar(x + 0.2, [r["tree_s"] for r in results], 0.4, label="tree")
    ax1.set(xticks=x, xticklabels=names, ylabel="forward+backward, s (median)", title="Time per step")
    ax1.legend()
    dedup = [r["dedup_ratio"] for r in results]
    line = np.linspace(1, max(dedup) * 1.1, 2)
    ax2.plot(line, line, "k--", lw=1, label="y = x (linear in tokens)")
    ax2.plot(line, 0.7 * line, "k:", lw=1, label="y = 0.7x")
    ax2.scatter(dedup, [r["speedup"] for r in results], zorder=3)
    for r in results:
        ax2.annotate(r["size"], (r["dedup_ratio"], r["speedup"]), textcoords="offset points", xytext=(5, -10))
    ax2.set(xlabel="dedup ratio (tokens / unique tokens)", ylabel="speedup (dense / tree)")
    ax2.set_title("Speedup vs dedup")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: the 'tiny' size, 1 repeat (< 1 minute)")
    ap.add_argument("--sizes", help=f"comma-separated, of {list(SIZES)} (default {DEFAULT_SIZES})")
    ap.add_argument("--repeats", type=int, help="timed runs of each path (default 3; 1 with --quick)")
    ap.add_argument("--dense_micro_batch", type=int, default=8, help="dense rows per forward/backward")
    ap.add_argument(
        "--dense_logits_to_keep", action="store_true", help="dense: LM head on completions only (TRL)"
    )
    ap.add_argument("--block_size", type=int, default=2048, help="TreeExecutor block_size")
    ap.add_argument(
        "--model", choices=["qwen3", "qwen3_5"], default="qwen3", help="attention or hybrid model"
    )
    ap.add_argument("--threads", type=int, default=2, help="torch threads (1 if other jobs share the cores)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
    args = ap.parse_args()
    args.sizes = (args.sizes or ("tiny" if args.quick else DEFAULT_SIZES)).split(",")
    args.repeats = args.repeats or (1 if args.quick else 3)
    unknown = [s for s in args.sizes if s not in SIZES]
    if unknown:
        ap.error(f"unknown size(s) {unknown}; choose from {list(SIZES)}")

    sys.stdout.reconfigure(line_buffering=True)  # progress lines show up even when piped
    torch.set_num_threads(args.threads)
    load_before = common.warn_if_busy(args.threads)  # busy cores stall the tree's many small ops most
    wall = time.perf_counter()
    model = make_model(args.model)
    executor = TreeExecutor(model, block_size=args.block_size)  # once: it runs a small probe
    results = []
    for name in args.sizes:
        results.append(run_size(name, SIZES[name], model, executor, args))
        r = results[-1]
        err = r["grad_max_rel_err"]
        print(f"[{name}] dense {r['dense_s']:.2f} s, tree {r['tree_s']:.2f} s, grad err {err:.1e}")
    wall = time.perf_counter() - wall
    print()
    print_table(results)
    print(f"\nmedian of {args.repeats} run(s); {torch.get_num_threads()} threads; total wall {wall:.0f} s")

    os.makedirs(args.out, exist_ok=True)
    env = common.environment(load_before, wall)
    name = "executor" if args.model == "qwen3" else f"executor-{args.model}"
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump({"args": vars(args), "env": env, "results": results}, f, indent=2)
    plot(results, os.path.join(args.out, f"{name}.png"))
    print(f"wrote {args.out}/{name}.json and {name}.png")


if __name__ == "__main__":
    main()
