"""The walk's GPU plan on paper: kernel launches and FLOPs per optimizer step, walk against dense (issue 22).

A GPU runs one kernel per ATen operator of an eager PyTorch program, and the host pays a fixed cost to
launch each (~5 µs with PyTorch's dispatcher, whatever the kernel's size). Many small model calls can leave
the GPU waiting on the host. This script counts, on the CPU, the ATen operators of one walk and of TRL's
dense micro-batches for the same rows (a ``TorchDispatchMode`` records each operator call: what a GPU would
launch, not counting fusion), for a model with Qwen3-1.7B's shapes, and extrapolates to its 28 layers from
runs with 1 and 2 layers (operators grow linearly in layers). Then, per optimizer step:

* launch floor = kernels x launch cost;
* compute time = FLOPs (``trl_dta.walk.flops``, x3 for forward + backward) / (peak x utilisation).

Where the launch floor approaches the compute time, the walk needs fewer, larger calls (or CUDA graphs).

    python benchmarks/launch_model.py [--shape tau2-2x8-10k] [--launch_us 5] [--tflops 989] [--mfu 0.4]
                                      [--out OUT_DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from peer_bench.workloads import shapes_for  # noqa: E402

from trl_dta import PrefixTrie, TreeExecutor  # noqa: E402
from trl_dta.walk.flops import flops as count_flops  # noqa: E402
from trl_dta.walk.flops import per_token_costs  # noqa: E402

QWEN3_1_7B = dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, num_hidden_layers=28, vocab_size=151936,
                  tie_word_embeddings=True)  # fmt: skip


# operators that launch no kernel: views and allocations without initialisation
_NO_KERNEL = {"detach", "alias", "empty", "empty_strided", "empty_like", "lift_fresh", "new_empty",
              "new_empty_strided", "is_same_size", "sym_size", "sym_stride", "sym_numel"}  # fmt: skip


class OpCounter(TorchDispatchMode):
    """Counts the ATen operators that would launch a GPU kernel (views and bare allocations excluded)."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.overloadpacket.__name__ not in _NO_KERNEL:
            self.ops += 1
        return func(*args, **(kwargs or {}))


def small(layers: int) -> Qwen3ForCausalLM:
    """Qwen3-1.7B's operator structure at a width the CPU runs quickly (operators do not depend on it)."""
    cfg = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=192, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, num_hidden_layers=layers, tie_word_embeddings=True,
                      attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg).train()


def walk_ops(layers: int, seqs, froms) -> tuple[int, dict]:
    model = small(layers)
    executor = TreeExecutor(model)
    trie = PrefixTrie.from_sequences(seqs)
    executor.backward(trie, lambda i, lp, e: -lp.sum(), score_from=froms)  # warm: probe, checks
    before = (executor.calls.forward, executor.calls.backward, executor.calls.tokens)
    with OpCounter() as counter:
        executor.backward(trie, lambda i, lp, e: -lp.sum(), score_from=froms)
    calls = {"forward": executor.calls.forward - before[0], "backward": executor.calls.backward - before[1],
             "tokens": executor.calls.tokens - before[2]}  # fmt: skip
    return counter.ops, calls


def dense_ops(layers: int, seqs, froms, micro_batches: int) -> int:
    """TRL's dense path: micro-batches of right-padded rows, forward + backward each."""
    model = small(layers)
    size = -(-len(seqs) // micro_batches)
    with OpCounter() as counter:
        for k in range(0, len(seqs), size):
            rows = seqs[k : k + size]
            width = max(map(len, rows))
            ids = torch.zeros(len(rows), width, dtype=torch.long)
            mask = torch.zeros(len(rows), width, dtype=torch.long)
            for r, s in enumerate(rows):
                ids[r, : len(s)], mask[r, : len(s)] = torch.tensor(s) % 512, 1
            keep = width - min(froms[k : k + size])
            logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=keep).logits
            torch.log_softmax(logits.float(), -1).sum().backward()
    return counter.ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="tau2-2x8-10k")
    parser.add_argument("--scale", type=float, default=1.0, help="lengths x this (a quick run)")
    parser.add_argument("--micro_batches", type=int, default=4, help="TRL's gradient accumulation steps")
    parser.add_argument("--launch_us", type=float, default=5.0, help="host cost per kernel launch, µs")
    parser.add_argument("--tflops", type=float, default=989.0, help="peak dense bf16 TFLOP/s (H200)")
    parser.add_argument("--mfu", type=float, default=0.4, help="fraction of peak the matmuls reach")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    workload = next(w for w in shapes_for("gpu", 512, args.scale) if w.name == args.shape)
    seqs, froms = [], []
    for prompt, completions in workload.groups:
        for c in completions:
            seqs.append(prompt + c)
            froms.append(len(prompt) - 1)
    L = QWEN3_1_7B["num_hidden_layers"]
    (w1, calls), (w2, _) = walk_ops(1, seqs, froms), walk_ops(2, seqs, froms)
    d1, d2 = dense_ops(1, seqs, froms, args.micro_batches), dense_ops(2, seqs, froms, args.micro_batches)
    walk_kernels = w1 + (w2 - w1) * (L - 1)
    dense_kernels = d1 + (d2 - d1) * (L - 1)
    # FLOPs at Qwen3-1.7B's sizes (a meta-device model: no memory)
    with torch.device("meta"):
        big = Qwen3ForCausalLM(Qwen3Config(**QWEN3_1_7B))

    class _LM:  # what flops() reads of a CausalLM (no executor: a meta model cannot be probed)
        config, lm_head, base, decoder = big.config, big.lm_head, big, big.model

    trie = PrefixTrie.from_sequences(seqs)
    dense_flops, walk_flops = count_flops(_LM, trie, froms)
    rate = args.tflops * 1e12 * args.mfu
    report = {
        "shape": args.shape, "rows": len(seqs), "tokens": trie.num_tokens, "dedup_ratio": trie.dedup_ratio,
        "flop_ratio": dense_flops / walk_flops, "walk_calls": calls,
        "kernels_per_layer_call": (w2 - w1) / max(1, calls["forward"] + calls["backward"]),
        "walk": {"kernels": walk_kernels, "launch_s": walk_kernels * args.launch_us * 1e-6,
                 "compute_s": 3 * walk_flops / rate},
        "dense": {"calls": 2 * args.micro_batches, "kernels": dense_kernels,
                  "launch_s": dense_kernels * args.launch_us * 1e-6, "compute_s": 3 * dense_flops / rate},
        "assumptions": {"launch_us": args.launch_us, "tflops": args.tflops, "mfu": args.mfu,
                        "per_token_costs": per_token_costs(_LM)},
    }  # fmt: skip
    for side in ("walk", "dense"):
        r = report[side]
        r["floor_s"] = max(r["launch_s"], r["compute_s"])
    report["predicted_speedup"] = report["dense"]["floor_s"] / report["walk"]["floor_s"]
    print(json.dumps(report, indent=1, default=float))
    w, d = report["walk"], report["dense"]
    print(f"\n{args.shape}: walk {calls['forward']} forward + {calls['backward']} backward calls, "
          f"{w['kernels']:,} kernels -> launch {w['launch_s']:.3f} s vs compute {w['compute_s']:.3f} s; "
          f"dense {d['kernels']:,} kernels -> launch {d['launch_s']:.3f} s vs compute {d['compute_s']:.3f} s;"
          " "
          f"predicted speedup {report['predicted_speedup']:.2f}x (dedup {trie.dedup_ratio:.2f}, "
          f"FLOP ideal {report['flop_ratio']:.2f})")  # fmt: skip
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "launch_model.json").write_text(json.dumps(report, indent=1, default=float))


if __name__ == "__main__":
    main()
