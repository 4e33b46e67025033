"""Measure a device's call-cost constants for the walk's cost model
(``trl_dta.walk.cost.costs.DEVICE_COSTS``).

The plan merges calls by ``seconds = fixed + per_token x tokens + per_pair x pairs``
(``trl_dta.walk.cost.costs``), with ``fixed = layer_call_s x layers`` and the per-token and per-pair terms the
FLOPs over ``flop_rate``. This script times forward + backward calls of a model (one row of ``tokens`` on a
cached past of ``past`` tokens, median of ``--repeats``) and fits the three by least squares: the fixed cost
per layer and call, and the FLOP rates of the matmuls and of attention.

    python benchmarks/call_costs.py [--device cpu] [--threads 2] [--hidden 576 --layers 8] [--out OUT_DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from scipy.optimize import nnls
from transformers import LlamaConfig, LlamaForCausalLM

from trl_dta import PrefixTrie, TreeExecutor
from trl_dta.walk.cost.costs import CallCost, device_costs


def measured_model(hidden: int, layers: int, device) -> tuple[LlamaConfig, LlamaForCausalLM]:
    """The model whose calls are timed (also ``cost_fit.py``'s): a Llama of ``hidden`` width (SmolLM2-135M's
    by default), GQA 9/3 heads, sdpa, fp32, seed 0, in train mode."""
    config = LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                         num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=layers,
                         attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(0)
    return config, LlamaForCausalLM(config).to(device).train()


def timed_call(executor, past: int, tokens: int, repeats: int, device) -> float:
    """Median seconds of the walk of one sequence: ``past`` tokens pushed (timed apart), ``tokens`` scored."""
    gen = torch.Generator().manual_seed(past * 7919 + tokens)
    seq = torch.randint(1, 500, (past + tokens,), generator=gen).tolist()
    sibling = seq[:past] + torch.randint(1, 500, (tokens,), generator=gen).tolist()
    trie = PrefixTrie.from_sequences([seq, sibling] if past else [seq])
    froms = [max(past - 1, 0)] * len(trie)
    times = []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        executor.backward(trie, lambda i, lp, e: -lp.mean(), score_from=froms)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def measure(config, model, device, repeats: int = 3) -> tuple[dict, list[dict]]:
    """Time the grid of calls and fit the constants: ``(fit, rows)``, the fit as ``layer_call_s`` and the two
    FLOP rates (``cost_fit.py`` calls it too, to compare its online fit in the same conditions)."""
    # FLOPs per token (matmuls) and per attention pair, whole model, forward + backward: the cost model's
    # per-token and per-pair seconds times the rate they were computed at
    reference = CallCost.for_model(config, device.type)
    rate = device_costs(device.type).flop_rate
    token_flops, pair_flops = reference.per_token * rate, reference.per_pair * rate
    executor = TreeExecutor(model, memory_budget=None, block_size=1 << 16, batch_tokens=0, subtree_tokens=0)
    rows = []
    for past in (0, 512, 2048):
        for tokens in (16, 128, 512, 1024):
            seconds = timed_call(executor, past, tokens, repeats, device)
            if (
                past
            ):  # the past pushed (causal, no mask: half its square), two leaves on it (masked: rectangles)
                calls, forwarded, pairs = (
                    3,
                    past + 2 * tokens,
                    past * past // 2 + 2 * tokens * (past + tokens),
                )
            else:
                calls, forwarded, pairs = 1, tokens, tokens * tokens // 2
            rows.append({"past": past, "tokens": tokens, "calls": calls, "forwarded": forwarded,
                         "pairs": pairs, "seconds": seconds})  # fmt: skip
            print(f"past {past:5d} tokens {tokens:5d}: {seconds * 1e3:8.1f} ms", flush=True)
    # seconds = overhead + fixed x calls + per_token x forwarded + per_pair x pairs, by non-negative least
    # squares of relative residuals, as the online fit (trl_dta/walk/cost/cost_model.py) models a walk: a
    # 16-token call weighs as much as a 4k-token one, and the walk's own time outside its calls (its plan, its
    # inputs) is a per-walk overhead, not part of the fixed cost per call
    a = np.array([[1, r["calls"], r["forwarded"], r["pairs"]] for r in rows], dtype=float)
    y = np.array([r["seconds"] for r in rows])
    scale = a.max(axis=0)  # (columns of unit size, for the solver)
    (overhead, fixed, per_token, per_pair) = nnls(a / scale / y[:, None], np.ones(len(y)))[0] / scale
    layers = config.num_hidden_layers
    fit = {
        "walk_overhead_s": overhead,
        "layer_call_s": fixed / layers,
        "matmul_flop_rate": token_flops / per_token if per_token > 0 else None,
        "attention_flop_rate": pair_flops / per_pair if per_pair > 0 else None,
    }
    return fit, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=576)  # SmolLM2-135M's widths
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    config, model = measured_model(args.hidden, args.layers, device)
    fit, rows = measure(config, model, device, args.repeats)
    print(json.dumps(fit, indent=1))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        out = {"device": args.device, "threads": args.threads, "hidden": args.hidden, "layers": args.layers,
               "rows": rows, "fit": fit}  # fmt: skip
        (Path(args.out) / f"call_costs_{device.type}.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
