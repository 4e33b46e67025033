"""The walk's GPU plan on paper: kernel launches and FLOPs per optimizer step, walk against dense (issue 22).

A GPU runs one kernel per ATen operator of an eager PyTorch program, and the host pays a fixed cost to
launch each (~5 µs with PyTorch's dispatcher, whatever the kernel's size). Many small model calls can leave
the GPU waiting on the host. This script counts, on the CPU, the ATen operators of one walk and of TRL's
dense micro-batches for the same rows (a ``TorchDispatchMode`` records each operator call: what a GPU would
launch, not counting fusion), for a model with Qwen3-1.7B's shapes, and extrapolates to its 28 layers from
runs with 1 and 2 layers (operators grow linearly in layers). Then, per optimizer step:

* launch floor = kernels x launch cost;
* compute time = FLOPs / (peak x utilisation): dense's from ``trl_dta.walk.cost.flops`` (x3 for forward +
  backward); the walk's from its plan, call by call: every token it forwards (those recomputed at pop
  twice), the attention pairs its kernel computes (``segments``, the default: each segment against the keys
  it sees, with torch's flash varlen kernel, the pairs the tree needs; ``mask``: the model's own sdpa with a
  packed row's mask, each call's whole rectangle; ``flex``: flex attention's block-sparse mask, the pairs
  needed plus a tile per row), the LM head where scored. Dense's attention counts only the causal pairs (a
  flash kernel's): a bound that favours dense.

The walk's budgets are those ``trl_dta.walk.memory.budgets.token_budgets`` picks for Qwen3-1.7B in bf16 within
``--memory`` bytes (default: 60e9, and what an 80 GB and a 141 GB GPU leave after 16 bytes per parameter
of weights, gradients and Adam states, 90% of the card), and the calls are merged by the CUDA cost model
(``trl_dta.walk.cost.costs``) for each attention path (``--kernels segments,mask,flex``). ``--fixed`` adds the
fixed CPU budgets (what a GPU ran before memory budgets). Where the launch floor approaches the compute
time, the walk needs fewer, larger calls (or CUDA graphs).

Calibration (issue 41, ``--launch_factors``): where the device's true launch cost is ``f x`` the shipped one
(0.5, 1, 2, 4), the walk's plan built with the shipped constants (uncalibrated) is set beside the plan built
with the constants the online fit recovers (``trl_dta.walk.cost.cost_model``: its fixed cost per call ``f x``
the shipped; tests/test_cost_model.py holds the fit to 5% on a simulated clock of this kind), each timed on
paper against dense on that device (both sides' launches at ``f x launch_us``). Beside them, a bound on any
plan: the better of the fewest calls the budgets allow (every merge made) and one call more that computes
no pair the tree does not need (each call launching as many kernels as those do). Where the calibrated plan
falls short of 0.9 of the FLOP ideal and the bound too, no plan of that attention path reaches it.

The counting walks run on this CPU as on CUDA: ``segments`` attends through
``trl_dta.testing.varlen.counted_varlen_attn`` (one operator each way, as the flash kernel), ``mask`` with the
walk's attention per segment turned off.

    python benchmarks/launch_model.py [--shapes tau2-2x8-10k] [--scales 1,0.125] [--launch_us 5]
                                      [--tflops 989] [--mfu 0.4] [--launch_factors 0.5,1,2,4] [--out OUT_DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from peer_bench.workloads import shapes_for  # noqa: E402

from trl_dta import PrefixTrie, TreeExecutor  # noqa: E402
from trl_dta.testing.launches import OpCounter  # noqa: E402
from trl_dta.testing.varlen import counted_varlen_attn, flash_on_cpu  # noqa: E402
from trl_dta.walk.attention.flex import FLEX_TILES  # noqa: E402
from trl_dta.walk.attention.masked import ModelAttention  # noqa: E402
from trl_dta.walk.attention.torch_varlen import TORCH_VARLEN  # noqa: E402
from trl_dta.walk.cost.costs import CallCost, needed_pairs  # noqa: E402
from trl_dta.walk.cost.flops import flops as count_flops  # noqa: E402
from trl_dta.walk.cost.flops import per_token_costs  # noqa: E402
from trl_dta.walk.memory.budgets import FIXED, token_budgets  # noqa: E402
from trl_dta.walk.plan import Push  # noqa: E402
from trl_dta.walk.scoring import scored_from  # noqa: E402

QWEN3_1_7B = dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, num_hidden_layers=28, vocab_size=151936,
                  tie_word_embeddings=True)  # fmt: skip


def small(layers: int) -> Qwen3ForCausalLM:
    """Qwen3-1.7B's operator structure at a width the CPU runs quickly (operators do not depend on it)."""
    cfg = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=192, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, num_hidden_layers=layers, tie_word_embeddings=True,
                      attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg).train()


def walk_ops(layers: int, seqs, froms, budgets, call_cost, kernel: str) -> tuple[int, dict, list]:
    """Kernels of one walk with ``budgets`` and ``call_cost`` (the plan of the full-size model), its calls
    and its plan, on the attention path ``kernel`` (module docstring)."""
    model = small(layers)  # (flex has no CPU backward: its walk is counted as the mask's, one kernel a layer)
    attends = flash_on_cpu(counted_varlen_attn) if kernel == "segments" else ModelAttention("sdpa")
    executor = TreeExecutor(model, attention_kernel=attends, **vars(budgets))
    executor.call_cost = call_cost
    trie = PrefixTrie.from_sequences(seqs)
    executor.backward(trie, lambda i, lp, e: -lp.sum(), score_from=froms)  # warm: checks
    before = (executor.calls.forward, executor.calls.backward, executor.calls.tokens)
    with OpCounter() as counter:
        executor.backward(trie, lambda i, lp, e: -lp.sum(), score_from=froms)
    calls = {"forward": executor.calls.forward - before[0], "backward": executor.calls.backward - before[1],
             "tokens": executor.calls.tokens - before[2]}  # fmt: skip
    return counter.ops, calls, executor.plan(trie)


def plan_flops(lm, trie, froms, plan, call_cost: CallCost) -> dict:
    """Forward + backward FLOPs of a walk's plan (module docstring), and the tokens it recomputes; its
    attention pairs as ``call_cost`` counts them (the plan's own rule, ``CallCost.row_pairs``)."""
    body, attention, head = per_token_costs(lm)
    _, node_from = scored_from(trie, froms)
    total, recomputed = 0.0, 0
    for step in plan:
        if isinstance(step, Push):
            segments, recompute = [step.segment], not step.keep_graph
        elif hasattr(step, "segments"):
            segments, recompute = list(step.segments), False
        else:
            continue
        tokens = sum(s.num_tokens for s in segments)
        pairs = call_cost.row_pairs(segments[0].start, tokens, needed_pairs(segments))
        cost = body * tokens + attention * pairs
        total += 3 * cost + (cost if recompute else 0)
        recomputed += tokens if recompute else 0
    for node in trie.nodes():
        first = node_from[node]
        total += 3 * head * max(0, (node.end - 1) - max(node.start - 1, first, 0))
    return {"flops": total, "recomputed_tokens": recomputed}


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


def memories(args) -> dict[str, float]:
    """Activation memory per configuration: --memory, and an 80 / 141 GB GPU less 16 bytes a parameter."""
    params = 1.72e9  # Qwen3-1.7B
    out = {f"{m:.3g} B": m for m in args.memory}
    for card in args.cards:
        out[f"{card:g} GB GPU"] = 0.9 * card * 1e9 - 16 * params
    return out


def run_shape(args, name: str, scale: float) -> dict:
    workload = next(w for w in shapes_for("gpu", 512, scale) if w.name == name)
    seqs, froms = [], []
    for prompt, completions in workload.groups:
        for c in completions:
            seqs.append(prompt + c)
            froms.append(len(prompt) - 1)
    L = QWEN3_1_7B["num_hidden_layers"]
    with torch.device("meta"):
        big = Qwen3ForCausalLM(Qwen3Config(**QWEN3_1_7B))

    class _LM:  # what flops() reads of a CausalLM (no executor: a meta model cannot be probed)
        config, lm_head, base, decoder = big.config, big.lm_head, big, big.model

    trie = PrefixTrie.from_sequences(seqs)
    dense_flops, walk_flops = count_flops(_LM, trie, froms)
    d1, d2 = dense_ops(1, seqs, froms, args.micro_batches), dense_ops(2, seqs, froms, args.micro_batches)
    dense_kernels = d1 + (d2 - d1) * (L - 1)
    rate = args.tflops * 1e12 * args.mfu
    dense = {"calls": 2 * args.micro_batches, "kernels": dense_kernels,
             "launch_s": dense_kernels * args.launch_us * 1e-6,
             "compute_s": 3 * dense_flops / rate}  # fmt: skip
    dense["floor_s"] = max(dense["launch_s"], dense["compute_s"])
    path = max(n.start for n in trie.nodes() if n.is_leaf)
    report = {"shape": name, "scale": scale, "rows": len(seqs), "tokens": trie.num_tokens,
              "unique_tokens": trie.num_unique_tokens, "dedup_ratio": trie.dedup_ratio,
              "flop_ratio": dense_flops / walk_flops, "path_tokens": path, "dense": dense,
              "walk": []}  # fmt: skip
    configs = [(label, m) for label, m in memories(args).items()] + (
        [("fixed CPU budgets", None)] if args.fixed else []
    )
    for label, memory in configs:
        budgets = (
            FIXED
            if memory is None
            else token_budgets(
                big.config, torch.bfloat16, memory, "cuda", path_tokens=path, entropy_grad=False
            )
        )
        for kernel in args.kernels:
            priced = {"flex": FLEX_TILES, "segments": TORCH_VARLEN, "mask": None}[kernel]  # (None: rectangle)
            cost = CallCost.for_model(big.config, "cuda", priced)
            planning = None if memory is None else cost  # (the fixed budgets: no cost model)
            (w1, calls, plan), (w2, _, _) = (
                walk_ops(k, seqs, froms, budgets, planning, kernel) for k in (1, 2)
            )
            kernels = w1 + (w2 - w1) * (L - 1)
            planned = plan_flops(_LM, trie, froms, plan, cost)
            walk = {"memory": label, "memory_bytes": memory, "kernel": kernel, "budgets": vars(budgets),
                    "calls": calls, "kernels": kernels, "kernels_vs_dense": kernels / dense_kernels,
                    "launch_s": kernels * args.launch_us * 1e-6, "compute_s": planned["flops"] / rate,
                    "recompute_share": planned["recomputed_tokens"] / trie.num_unique_tokens}  # fmt: skip
            walk["floor_s"] = max(walk["launch_s"], walk["compute_s"])
            walk["launch_share"] = walk["launch_s"] / walk["compute_s"]
            walk["predicted_speedup"] = dense["floor_s"] / walk["floor_s"]
            walk["of_flop_ideal"] = walk["predicted_speedup"] / report["flop_ratio"]
            report["walk"].append(walk)
            print(f"{name} x{scale:g} [{label}, {kernel}] budgets {tuple(vars(budgets).values())}: "
                  f"{calls['forward']}+{calls['backward']} calls, {kernels:,} kernels "
                  f"({walk['kernels_vs_dense']:.2f}x dense), launch {walk['launch_s']:.3f} s vs compute "
                  f"{walk['compute_s']:.3f} s ({walk['launch_share']:.0%}), recompute "
                  f"{walk['recompute_share']:.0%}, predicted {walk['predicted_speedup']:.2f}x "
                  f"({walk['of_flop_ideal']:.2f} of the FLOP ideal {report['flop_ratio']:.2f}; dedup "
                  f"{trie.dedup_ratio:.2f})", flush=True)  # fmt: skip
            if memory is not None and args.launch_factors and label == configs[0][0]:  # (the first budget)
                walk["calibration"] = calibration(args, (_LM, trie, seqs, froms), budgets, cost, kernel,
                                                  kernels, planned, dense, report["flop_ratio"])  # fmt: skip
    return report


def calibration(args, step, budgets, shipped: CallCost, kernel: str, kernels: int, planned: dict,
                dense: dict, flop_ratio: float) -> list[dict]:  # fmt: skip
    """Per true launch factor ``f`` (module docstring): the uncalibrated plan (built with ``shipped``, its
    ``kernels`` and ``planned`` FLOPs) and the calibrated one (built with ``f x`` the fixed cost), each as a
    fraction of the FLOP ideal on a device whose launches cost ``f x launch_us``."""
    lm, trie, seqs, froms = step
    L, rate = QWEN3_1_7B["num_hidden_layers"], args.tflops * 1e12 * args.mfu

    def measured(call_cost: CallCost) -> tuple[int, dict, float]:
        (k1, calls, plan), (k2, _, _) = (walk_ops(n, seqs, froms, budgets, call_cost, kernel) for n in (1, 2))
        return k1 + (k2 - k1) * (L - 1), calls, plan_flops(lm, trie, froms, plan, call_cost)["flops"]

    # the bound: the fewest calls the budgets allow (every merge priced as free), and one call more at the
    # FLOP ideal's compute (no pair the tree does not need), each call launching as many kernels as these do
    fewest_kernels, fewest_calls, fewest_flops = measured(replace(shipped, fixed=1e6 * shipped.fixed))
    per_call = fewest_kernels / fewest_calls["forward"]
    rows = []
    for f in args.launch_factors:
        launch_us = f * args.launch_us
        dense_s = max(dense["kernels"] * launch_us * 1e-6, dense["compute_s"])
        n, calls, flops = measured(replace(shipped, fixed=f * shipped.fixed))
        sides = {"uncalibrated": (kernels, planned["flops"]), "calibrated": (n, flops)}
        row = {"launch_factor": f, "calibrated_calls": calls}
        for side, (n, flops) in sides.items():
            walk_s = max(n * launch_us * 1e-6, flops / rate)
            row[side] = {"kernels": n, "walk_s": walk_s, "speedup": dense_s / walk_s,
                         "of_flop_ideal": dense_s / walk_s / flop_ratio}  # fmt: skip
        bound_s = min(max(fewest_kernels * launch_us * 1e-6, fewest_flops / rate),
                      max((fewest_calls["forward"] + 1) * per_call * launch_us * 1e-6,
                          dense["compute_s"] / flop_ratio))  # fmt: skip
        row["bound"] = {"fewest_calls": fewest_calls["forward"], "kernels_per_call": per_call,
                        "walk_s": bound_s, "of_flop_ideal": dense_s / bound_s / flop_ratio}  # fmt: skip
        rows.append(row)
        uncalibrated, calibrated = row["uncalibrated"]["of_flop_ideal"], row["calibrated"]["of_flop_ideal"]
        print(f"  true launch {f:g}x: uncalibrated plan {uncalibrated:.2f} of the FLOP ideal, calibrated "
              f"{calibrated:.2f} ({calls['forward']} forwards), bound {row['bound']['of_flop_ideal']:.2f}",
              flush=True)  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="tau2-2x8-10k")
    parser.add_argument("--scales", default="1,0.125", help="lengths x these")
    parser.add_argument(
        "--memory", default="60e9", help="activation memory budgets in bytes, comma-separated"
    )
    parser.add_argument("--cards", default="80,141", help="GPU memory in GB, comma-separated ('' for none)")
    parser.add_argument("--kernels", default="segments,mask,flex", help="attention paths (module docstring)")
    parser.add_argument("--fixed", action="store_true", help="also the fixed CPU budgets")
    parser.add_argument("--micro_batches", type=int, default=4, help="TRL's gradient accumulation steps")
    parser.add_argument("--launch_us", type=float, default=5.0, help="host cost per kernel launch, µs")
    parser.add_argument("--tflops", type=float, default=989.0, help="peak dense bf16 TFLOP/s (H200)")
    parser.add_argument("--mfu", type=float, default=0.4, help="fraction of peak the matmuls reach")
    parser.add_argument(
        "--launch_factors",
        default="0.5,1,2,4",
        help="true launch cost / shipped, for the calibrated vs uncalibrated plan ('' for none)",
    )
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    args.launch_factors = [float(f) for f in args.launch_factors.split(",") if f]
    args.memory = [float(m) for m in args.memory.split(",") if m]
    args.cards = [float(c) for c in args.cards.split(",") if c]
    args.kernels = [k for k in args.kernels.split(",") if k]
    torch.set_num_threads(max(1, torch.get_num_threads()))
    reports = [run_shape(args, name, float(scale)) for name in args.shapes.split(",")
               for scale in args.scales.split(",")]  # fmt: skip
    assumptions = {"launch_us": args.launch_us, "tflops": args.tflops, "mfu": args.mfu}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        out = {"assumptions": assumptions, "shapes": reports}
        (Path(args.out) / "launch_model.json").write_text(json.dumps(out, indent=1, default=float))


if __name__ == "__main__":
    main()
