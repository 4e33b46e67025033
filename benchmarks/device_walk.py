"""The device-sized walk measured on a GPU (issue 27): what ``launch_model.py`` predicts, checked.

For a model with Qwen3-1.7B's shapes (random weights, bf16) and the ``tau2-2x8-10k`` step (``--scale`` of
its lengths), per attention path: the budgets ``memory_budget="auto"`` derives, the walk's calls, its time
against TRL-style dense micro-batches (median of ``--repeats``), the walk's CUDA peak, whether it
recomputes, and its gradients against the default path's (the same plan's paths must agree to bf16
rounding). Then the host synchronisations of a no-grad and a gradient walk, counted by
``torch.cuda.set_sync_debug_mode("warn")``: none expected in the first, one in the second (``backward``
returns the summed loss as a float).

The paths (``trl_dta/walk/attention/segment_attention.py``): ``segments`` (the default: every call attends per
segment, with torch's flash varlen kernel on CUDA), ``segments_sdpa`` (the same layout through sdpa, one call
per segment: the kernel's fallback), ``mask`` (the model's own sdpa with the packed row's whole-row mask: the
walk before attention per segment, and what models the walk's function cannot run get) and
``flex_attention`` (a block-sparse ``BlockMask``, compiled).

``--sides`` picks the paths (default: segments, segments_sdpa and mask on CUDA; flex runs apart, last in the
GPU suite, under its own limit: its first call compiles, and on 2026-12-04 it hit dynamo's recompile limit).
The JSON (``--name``.json in ``--out``) is written after each side: a cut keeps the sides that ran.
``--flex_parity``: first, the flex path's exactness: fp32 gradients of random tries against the model's own
dense ones (<= 1e-5, or the script fails; ``--parity_only`` stops there).

    python benchmarks/device_walk.py [--scale 0.125] [--layers 28] [--repeats 3] [--out OUT_DIR]
    python benchmarks/device_walk.py --sides flex_attention --flex_parity --name device_walk_flex --out OUT

On CPU (``--device cpu``, a smoke run; ``--dims tiny``: a small model, bf16 matmuls being slow on a CPU) only
``segments`` runs (flex has no backward there).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from peer_bench.workloads import shapes_for  # noqa: E402

from trl_dta import PrefixTrie, TreeExecutor  # noqa: E402
from trl_dta.compare import relative_error  # noqa: E402
from trl_dta.walk.attention.flex import FLEX_TILES  # noqa: E402
from trl_dta.walk.attention.masked import ModelAttention  # noqa: E402
from trl_dta.walk.attention.sdpa import SDPA_SEGMENTS  # noqa: E402
from trl_dta.walk.cost.costs import CallCost  # noqa: E402
from trl_dta.walk.memory import peak as walk_peak  # noqa: E402
from trl_dta.walk.plan import Push  # noqa: E402

QWEN3_1_7B = dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, vocab_size=151936, tie_word_embeddings=True)  # fmt: skip
# (a small model for a CPU's smoke run; the full vocabulary: the shapes draw token ids from it)
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=151936, tie_word_embeddings=True)  # fmt: skip
DIMS = {"qwen3-1.7b": QWEN3_1_7B, "tiny": TINY}
CUDA_SIDES = "segments,segments_sdpa,mask"


# the attention kernel each path gives the executor (None: the model's own choice)
PATH_KERNELS = {"segments": None, "segments_sdpa": SDPA_SEGMENTS, "mask": ModelAttention("sdpa")}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def build(args, attn: str, device):
    config = Qwen3Config(**DIMS[args.dims], num_hidden_layers=args.layers, attn_implementation=attn)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs
        return Qwen3ForCausalLM(config).to(torch.bfloat16).train()


def loss_fn(i, lp, ent):
    return -lp.float().mean()


def dense_time(model, seqs, froms, micro_batches: int, device) -> float:
    """TRL's dense path: right-padded micro-batches, forward + backward each."""
    size = -(-len(seqs) // micro_batches)
    sync(device)
    start = time.perf_counter()
    for k in range(0, len(seqs), size):
        rows = seqs[k : k + size]
        width = max(map(len, rows))
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for r, s in enumerate(rows):
            ids[r, : len(s)], mask[r, : len(s)] = torch.tensor(s), 1
        keep = width - min(froms[k : k + size])
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), logits_to_keep=keep).logits
        torch.log_softmax(logits.float(), -1)[..., 0].mean().backward()
    sync(device)
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def count_syncs(executor, model, trie, froms) -> dict[str, int]:
    """Host synchronisations CUDA reports during a no-grad and a gradient walk (``backward`` returns the
    summed loss as a float: one, at its end)."""
    counts = {}
    for name in ("logprobs", "backward"):
        model.zero_grad(set_to_none=True)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if name == "logprobs":
                    executor.logprobs(trie, score_from=froms)
                else:
                    executor.backward(trie, loss_fn, score_from=froms, entropy_grad=False)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        counts[name] = sum("synchroniz" in str(w.message) for w in caught)
    return counts


def parity(device, tries: int = 12) -> float:
    """fp32, TF32 off: the walk with flex attention (merging every call the budgets allow, so that packed rows
    and subtrees carry the BlockMasks) against the model's own dense per-sequence gradients on random tries;
    the largest per-tensor relative error."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    config = Qwen3Config(vocab_size=97, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, num_hidden_layers=2)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    for t in range(tries):
        torch.manual_seed(t)
        with torch.device(device):
            flex = Qwen3ForCausalLM(Qwen3Config(**config.to_dict(), attn_implementation="flex_attention"))
            dense = Qwen3ForCausalLM(Qwen3Config(**config.to_dict(), attn_implementation="sdpa"))
        dense.load_state_dict(flex.state_dict())
        base = torch.randint(0, 97, (int(torch.randint(4, 300, (), generator=gen)),), generator=gen).tolist()
        seqs = []
        for _ in range(int(torch.randint(2, 9, (), generator=gen))):
            cut = int(torch.randint(1, len(base), (), generator=gen))
            tail = torch.randint(0, 97, (int(torch.randint(1, 200, (), generator=gen)),), generator=gen)
            seqs.append(base[:cut] + tail.tolist())
        executor = TreeExecutor(flex, block_size=int(torch.randint(8, 512, (), generator=gen)))
        executor.call_cost = CallCost(fixed=1.0, per_token=0.0, per_pair=0.0, kernel=FLEX_TILES)
        executor.backward(PrefixTrie.from_sequences(seqs), lambda i, lp, e: -(lp * (1 + i)).mean())
        for i, seq in enumerate(seqs):
            ids = torch.tensor([seq], device=device)
            lp = torch.log_softmax(dense(input_ids=ids).logits[0, :-1].float(), -1).gather(
                -1, ids[0, 1:, None]
            )
            (-(lp.squeeze(-1) * (1 + i)).mean()).backward()
        ref = dict(dense.named_parameters())
        worst = max([worst] + [relative_error(p.grad, ref[n].grad) for n, p in flex.named_parameters()])
    print(
        f"flex walk vs dense, fp32, {tries} random tries: max relative gradient error {worst:.2e}", flush=True
    )
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=0.125)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--micro_batches", type=int, default=4)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="")
    parser.add_argument("--parity_only", action="store_true")
    parser.add_argument("--flex_parity", action="store_true", help="first, flex's fp32 exactness (CUDA)")
    parser.add_argument(
        "--sides", help=f"comma-separated paths (default: {CUDA_SIDES} on CUDA, segments else)"
    )
    parser.add_argument("--dims", default="qwen3-1.7b", choices=list(DIMS))
    parser.add_argument("--name", default="device_walk", help="the JSON's file name in --out, without .json")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and (args.flex_parity or args.parity_only):
        error = parity(device)
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "flex_parity.json").write_text(json.dumps({"max_relative_error": error}))
        if error > 1e-5:
            sys.exit(f"flex walk gradients differ from dense: {error:.2e} > 1e-5")
        if args.parity_only:
            return
    workload = next(
        w for w in shapes_for("gpu", DIMS[args.dims]["vocab_size"], args.scale) if w.name == "tau2-2x8-10k"
    )
    seqs, froms = [], []
    for prompt, completions in workload.groups:
        for c in completions:
            seqs.append(prompt + c)
            froms.append(len(prompt) - 1)
    trie = PrefixTrie.from_sequences(seqs)
    # (path, attention implementation): the default first, the others compared with it
    names = (args.sides or (CUDA_SIDES if device.type == "cuda" else "segments")).split(",")
    sides = [(name, "flex_attention" if name == "flex_attention" else "sdpa") for name in names]
    report = {"shape": workload.name, "scale": args.scale, "layers": args.layers, "rows": len(seqs),
              "tokens": trie.num_tokens, "unique_tokens": trie.num_unique_tokens,
              "dedup_ratio": trie.dedup_ratio, "kernels": {}}  # fmt: skip
    grads = {}

    def write() -> None:  # (after each side: a cut keeps what ran)
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / f"{args.name}.json").write_text(json.dumps(report, indent=1, default=float))

    for path, attn in sides:
        model = build(args, attn, device)
        executor = TreeExecutor(model, attention_kernel=PATH_KERNELS.get(path))  # memory_budget="auto"
        walk_times = []
        for _ in range(args.repeats + 1):  # the first: compilation (flex), allocator warm-up
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                walk_peak.reset_peak_memory_stats()
            before = (executor.calls.forward, executor.calls.backward)
            sync(device)
            start = time.perf_counter()
            executor.backward(trie, loss_fn, score_from=froms, entropy_grad=False)
            sync(device)
            walk_times.append(time.perf_counter() - start)
        plan = executor.plan(trie, entropy_grad=False)
        peak = walk_peak.max_memory_allocated() / 2**30 if device.type == "cuda" else None
        grads[path] = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
        recomputed = sum(s.segment.num_tokens for s in plan if isinstance(s, Push) and not s.keep_graph)
        if path == "segments" or attn != "sdpa":
            dense = [dense_time(model, seqs, froms, args.micro_batches, device) for _ in range(args.repeats)]
        else:  # (the same model and rows as the default path's: its dense time)
            dense = [report["kernels"].get("segments", {}).get("dense_s", float("nan"))]
        row = {"budgets": executor.budgets.metrics(), "attention_calls": dict(executor.calls.attention),
               "calls": {"forward": executor.calls.forward - before[0],
                         "backward": executor.calls.backward - before[1]},
               "first_walk_s": walk_times[0], "walk_s": statistics.median(walk_times[1:]),
               "dense_s": statistics.median(dense),
               "recompute_share": recomputed / trie.num_unique_tokens, "peak_gib": peak}  # fmt: skip
        row["speedup"] = row["dense_s"] / row["walk_s"]
        report["kernels"][path] = row
        print(f"[{path}] budgets {row['budgets']} calls {row['calls']} walk {row['walk_s']:.3f} s (first "
              f"{row['first_walk_s']:.1f} s) dense {row['dense_s']:.3f} s -> {row['speedup']:.2f}x "
              f"(dedup {trie.dedup_ratio:.2f}), recompute {row['recompute_share']:.0%}, "
              f"peak {row['peak_gib']} GiB", flush=True)  # fmt: skip
        if device.type == "cuda" and path in ("segments", "flex_attention"):  # host syncs in a walk
            row["syncs"] = count_syncs(executor, model, trie, froms)
            print(f"[{path}] host syncs per walk (set_sync_debug_mode): {row['syncs']}", flush=True)
        if path != "segments" and "segments" in grads:
            err = max(relative_error(grads[path][n], g) for n, g in grads["segments"].items())
            report[f"{path}_vs_segments_grad_error"] = err
            print(f"{path} vs segments gradients (bf16, same weights): max relative error {err:.2e}")
        write()
        del model, executor
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
