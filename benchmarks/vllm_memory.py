"""Memory next to a colocated vLLM engine (issue 33, item 3): how much more KV cache the walk leaves vLLM
than stock TRL's dense pass with gradient checkpointing, for a Qwen3-1.7B τ² step on an 80 GB GPU.

In colocate mode a vLLM engine takes ``vllm_gpu_memory_utilization`` of the GPU for its weights, activations
and KV cache; with sleep mode it releases them while the trainer trains and takes them back to generate.
TreePPOTrainer's ``tree_memory_budget="auto"`` leaves that share alone (``VLLMMixin.vllm_reserved_bytes``),
so what training needs at its peak bounds the share vLLM can be given, and so its KV cache:

    KV cache = GPU - training state (16 B/param) - training activation peak - vLLM weights (2 B/param)

The walk's and dense + checkpointing's activation peaks differ; the difference is KV cache for vLLM, in
tokens of ``2 x layers x kv_heads x head_dim x 2`` bytes (bf16).

* ``--paper`` (any machine, no model built): the two peaks by the project's memory model on the
  ``tau2-2x8-10k`` step (docs/benchmarks.md; rows of 9.7-10.8k tokens), bf16 autocast over fp32 master
  weights (the GPU config): the walk's by :func:`trl_dta.walk.memory.budgets.activation_bytes` (what
  ``token_budgets`` plans with), at the budgets of a few configurations; dense + checkpointing as TRL runs
  it: micro-batches of ``per_device_train_batch_size`` rows padded to the longest, each decoder layer's
  float32 input kept, one layer's graph rebuilt at a time, TRL's chunked LM head (its input and a few
  numbers per scored token).
* ``--device cuda`` (``benchmarks/gpu.sh``): the same step (``--scale`` of its lengths) measured:
  ``torch.cuda.max_memory_allocated`` above what is allocated before, for the walk at block / calls 2048 and
  for dense + ``gradient_checkpointing_enable()`` micro-batches with a chunked LM head, beside the model's
  prediction at that scale. ``--device cpu`` runs the same code as a smoke test (no peaks measured).

    python benchmarks/vllm_memory.py --paper [--out OUT_DIR]
    python benchmarks/vllm_memory.py --device cuda [--scale 1] [--out OUT_DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint
from transformers import Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from peer_bench.workloads import shapes_for  # noqa: E402

from trl_dta import PrefixTrie, TreeExecutor  # noqa: E402
from trl_dta.walk.attention.sdpa import SDPA_SEGMENTS  # noqa: E402
from trl_dta.walk.heads import HEAD_ROWS  # noqa: E402
from trl_dta.walk.memory import peak as peak_stats  # noqa: E402
from trl_dta.walk.memory.budgets import activation_bytes  # noqa: E402
from trl_dta.walk.memory.memory_model import plan_peak  # noqa: E402
from trl_dta.walk.plan import build_plan  # noqa: E402
from trl_dta.walk.scoring import scored_from  # noqa: E402

QWEN3_1_7B = dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                  num_hidden_layers=28)  # fmt: skip
PARAMS = 1.72e9
GPU_BYTES = 80e9
MICRO_BATCH = 8  # recipes/configs/ppo_tau2_qwen3_gpu.yaml's per_device_train_batch_size
WALK_BUDGETS = {  # name: (block, calls); None: the trie's longest path above a leaf (nothing recomputed)
    "walk, nothing recomputed (block = longest path, calls 512)": (None, 512),
    "walk, block 4096, calls 4096": (4096, 4096),
    "walk, block 2048, calls 2048": (2048, 2048),
    "walk, block 1024, calls 1024": (1024, 1024),
}


def step(scale: float, vocab: int):
    """The tau2-2x8-10k step: sequences, where each one's scored part starts, its trie."""
    workload = next(w for w in shapes_for("gpu", vocab, scale) if w.name == "tau2-2x8-10k")
    seqs, froms = [], []
    for prompt, completions in workload.groups:
        for c in completions:
            seqs.append(prompt + c)
            froms.append(len(prompt) - 1)
    return seqs, froms, PrefixTrie.from_sequences(seqs)


def walk_peak(
    config, block: int, calls: int, trie=None, froms=None, attention=SDPA_SEGMENTS, gradients_held=False
) -> float:
    """The walk's activation peak at these budgets (bytes), under bf16 autocast over float32 weights (the GPU
    config): values-only entropies (TRL's default: no entropy bonus). Without ``trie``, the memory model
    ``token_budgets`` plans with (every token counted as scored, the path as long as the block); with it, that
    model applied to the walk's plan step by step (``trl_dta.walk.memory.memory_model.plan_peak``: the plan of
    the fixed budgets, its calls attended by the kernel ``attention``). Both add autocast's bf16 copies of
    the weights and, with
    ``gradients_held`` (gradients allocated before the walk, as ``measured`` does; TRL's first micro-batch of
    a step has none), the fresh float32 gradients the walk accumulates into before adding them."""
    per = activation_bytes(config, torch.bfloat16, entropy_grad=False, autocast=True)
    fixed = 2 * PARAMS + (4 * PARAMS if gradients_held else 0)
    if trie is None:
        return (per.position + per.token + per.scored) * (block + calls) + per.transient * HEAD_ROWS + fixed
    plan = build_plan(trie, block, calls, True, calls)
    return plan_peak(plan, config, per, scored_from(trie, froms)[1], attention).total + fixed


def dense_checkpointed_peak(config, seqs, froms, micro_batch: int) -> float:
    """Stock TRL's dense pass with gradient checkpointing, at its largest micro-batch (bytes), under bf16
    autocast over float32 weights: every decoder layer's float32 input, one layer's graph rebuilt in the
    backward (``activation_bytes``' per-layer share, autocast's), its attention's K/V repeated to every query
    head (transformers' sdpa with a padding mask, grouped-query attention) and the micro-batch's 4-D mask (one
    byte a pair), TRL's chunked LM head (its float32 input, and the log-normaliser, log-prob and entropy of
    each scored position), and autocast's bf16 copies of the weights."""
    per = activation_bytes(config, torch.bfloat16, entropy_grad=False, autocast=True)
    layers, width = config.num_hidden_layers, config.hidden_size
    per_layer = (per.token - (4 * width + 2 * 2 * width) - 8) / layers  # (less the final norm, the token id)
    repeated = 2 * config.num_attention_heads * config.head_dim * 2  # K and V of every query head, bf16
    peak = 0.0
    rows = sorted(range(len(seqs)), key=lambda r: -len(seqs[r]))  # TRL shuffles; the longest batch bounds
    for k in range(0, len(rows), micro_batch):
        batch = rows[k : k + micro_batch]
        width_tokens = max(len(seqs[r]) for r in batch)
        tokens = len(batch) * width_tokens  # padded
        scored = len(batch) * max(len(seqs[r]) - froms[r] - 1 for r in batch)
        layer = tokens * (layers * 4 * width + per_layer + repeated) + len(batch) * width_tokens**2
        peak = max(peak, layer + scored * (4 * width + 12))
    return peak + 2 * PARAMS


def paper(args) -> dict:
    config = Qwen3Config(**QWEN3_1_7B)
    seqs, froms, trie = step(1.0, config.vocab_size)
    path = max(n.start for n in trie.nodes() if n.is_leaf)
    kv_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2
    fixed = 16 * PARAMS + 2 * PARAMS  # training state (fp32 weights, grads, Adam) + vLLM's bf16 weights
    rows = {"dense + gradient checkpointing (TRL)": dense_checkpointed_peak(config, seqs, froms, MICRO_BATCH)}
    for name, (block, calls) in WALK_BUDGETS.items():
        rows[name] = walk_peak(config, path if block is None else block, calls)
    dense = rows["dense + gradient checkpointing (TRL)"]
    table = []
    for name, peak in rows.items():
        kv = GPU_BYTES - fixed - peak
        more = (dense - peak) / kv_token
        table.append({"run": name, "activation_peak_gb": peak / 1e9, "kv_cache_gb": kv / 1e9,
                      "kv_tokens": int(kv // kv_token), "more_kv_tokens_than_dense": int(more),
                      "more_rows_than_dense": more / (trie.num_tokens / len(seqs))})  # fmt: skip
    report = {"shape": "tau2-2x8-10k", "rows": len(seqs), "tokens": trie.num_tokens, "longest_path": path,
              "gpu_bytes": GPU_BYTES, "fixed_bytes": fixed, "kv_bytes_per_token": kv_token,
              "micro_batch": MICRO_BATCH, "table": table}  # fmt: skip
    print(f"Qwen3-1.7B, {report['shape']} ({len(seqs)} rows, {trie.num_tokens} tokens, longest path above a "
          f"leaf {path}), 80 GB: {fixed / 1e9:.1f} GB of training state and vLLM weights; KV "
          f"{kv_token / 1024:.0f} KiB per token")  # fmt: skip
    print("| run | activation peak GB | KV cache left GB | KV tokens | more than dense (tokens, rows) |")
    print("|---|---|---|---|---|")
    for r in table:
        print(
            f"| {r['run']} | {r['activation_peak_gb']:.1f} | {r['kv_cache_gb']:.1f} | {r['kv_tokens']:,} | "
            f"{r['more_kv_tokens_than_dense']:,} ({r['more_rows_than_dense']:.1f}) |"
        )
    return report


def chunked_logps(hidden, head, targets, chunk: int = 4096):
    """Log-probs of ``targets`` from ``hidden`` (N, d), the LM head recomputed per chunk in the backward:
    only its input and the results are kept (what TRL's chunked kernel keeps)."""

    def piece(h, t):
        return torch.log_softmax(head(h).float(), -1).gather(-1, t[:, None])[:, 0]

    return torch.cat([checkpoint(piece, hidden[i : i + chunk], targets[i : i + chunk], use_reentrant=False)
                      for i in range(0, hidden.shape[0], chunk)])  # fmt: skip


def measured(args) -> dict:
    device = torch.device(args.device)
    config = Qwen3Config(**{**QWEN3_1_7B, "num_hidden_layers": args.layers})
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).train()  # fp32 master weights, bf16 autocast (the GPU config)
    seqs, froms, trie = step(args.scale, config.vocab_size)
    cuda = device.type == "cuda"

    def peak_of(run) -> float | None:
        model.zero_grad(set_to_none=False)  # gradients allocated before: not part of the peak
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            peak_stats.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            run()
        if cuda:
            torch.cuda.synchronize()
            return (peak_stats.max_memory_allocated() - base) / 1e9
        return None

    def dense():
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        order = sorted(range(len(seqs)), key=lambda r: -len(seqs[r]))
        for k in range(0, len(order), MICRO_BATCH):
            rows = order[k : k + MICRO_BATCH]
            width = max(len(seqs[r]) for r in rows)
            ids = torch.zeros(len(rows), width, dtype=torch.long)
            mask = torch.zeros(len(rows), width, dtype=torch.long)
            keep = torch.zeros(len(rows), width, dtype=torch.bool)
            for i, r in enumerate(rows):
                ids[i, : len(seqs[r])], mask[i, : len(seqs[r])] = torch.tensor(seqs[r]), 1
                keep[i, froms[r] : len(seqs[r]) - 1] = True
            ids, mask, keep = ids.to(device), mask.to(device), keep.to(device)
            hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
            targets = ids[:, 1:][keep[:, :-1]]
            logps = chunked_logps(hidden[:, :-1][keep[:, :-1]], model.lm_head, targets)
            (-logps.mean()).backward()
        model.gradient_checkpointing_disable()

    def walk():
        executor = TreeExecutor(
            model, block_size=2048, batch_tokens=2048, subtree_tokens=2048, memory_budget=None
        )
        executor.backward(trie, lambda i, lp, ent: -lp.float().mean(), score_from=froms, entropy_grad=False)

    got = {"dense + gradient checkpointing": peak_of(dense), "walk, block 2048, calls 2048": peak_of(walk)}
    dense_gb = dense_checkpointed_peak(config, seqs, froms, MICRO_BATCH) / 1e9
    predicted = {"dense + gradient checkpointing": dense_gb,
                 "walk, block 2048, calls 2048": walk_peak(config, 2048, 2048, trie, froms,
                                                           gradients_held=True) / 1e9}  # fmt: skip
    report = {"device": str(device), "scale": args.scale, "layers": args.layers, "rows": len(seqs),
              "tokens": trie.num_tokens, "measured_gb": got, "predicted_gb": predicted}  # fmt: skip
    for name in got:
        shown = "-" if got[name] is None else f"{got[name]:.2f}"
        print(f"{name}: measured {shown} GB, predicted {predicted[name]:.2f} GB")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paper", action="store_true", help="the model on paper only (no model built)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--scale", type=float, default=1.0, help="of the step's lengths (--device runs)")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    report = paper(args) if args.paper else measured(args)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        name = "vllm_memory_paper.json" if args.paper else "vllm_memory.json"
        (Path(args.out) / name).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
