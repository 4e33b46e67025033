"""A walk's host cost on a CPU, the proxy for a GPU's (issue 53): operators launched and host time per call.

On a GPU every ATen operator of an eager program is a kernel launch, and the host's time per decoder-layer
call bounds a walk of small calls (the first GPU run measured ~4.5 ms per layer call: docs/cost-model.md).
Two measures, each walk against the model's own dense pass over the same tokens, on a tiny Qwen3 (the width
does not change what is launched, and keeps the compute negligible next to the host's work):

* **operators**: a GRPO group (16 completions of 100 tokens under a 300-token prompt, issue 53's shape) walked
  as on CUDA (calls per segment through ``trl_dta.testing.varlen.counted_varlen_attn``, one operator each
  way as torch's flash kernel; the CUDA cost model; a GPU's memory and call budgets), against one dense
  forward + backward of the 16 rows (``logits_to_keep``: the LM head on completions); counted by
  ``trl_dta.testing.launches.OpCounter``, at 4 and 8 layers, so that the per-layer and per-walk parts
  separate (``tests/test_launches.py`` holds the total within 1.5x);
* **host time per layer call**: the walk of one 16-token sequence (one call) against the model's own forward +
  backward of it, at 1 and 8 layers, median of ``--repeats``; the slope per layer is the host's time per
  decoder-layer call, the intercept what a walk or a forward costs besides.

    python benchmarks/host_cost.py [--repeats 30] [--out docs]   # writes host-cost-cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from trl_dta import PrefixTrie, TreeExecutor
from trl_dta.testing.launches import OpCounter
from trl_dta.testing.varlen import counted_varlen_attn, flash_on_cpu
from trl_dta.walk.cost.costs import CallCost


def tiny(layers: int) -> Qwen3ForCausalLM:
    config = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=192, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, num_hidden_layers=layers,
                         attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).train()


def group(prompt: int = 300, completions: int = 16, length: int = 100) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    head = torch.randint(1, 500, (prompt,), generator=gen).tolist()
    return [head + torch.randint(1, 500, (length,), generator=gen).tolist() for _ in range(completions)]


def operators(layers: int) -> dict:
    """Operators of the GRPO group's walk as on CUDA, and of the dense pass, by name."""
    model, seqs, prompt = tiny(layers), group(), 300
    trie, froms = PrefixTrie.from_sequences(seqs), [prompt - 1] * len(seqs)

    def loss(i, logps, entropies):
        return -logps.sum()

    calls = 1 << 16  # (a GPU's cap on a call: DEVICE_COSTS["cuda"])
    kernel = flash_on_cpu(counted_varlen_attn)
    executor = TreeExecutor(
        model, memory_budget=60e9, batch_tokens=calls, subtree_tokens=calls, attention_kernel=kernel
    )
    executor.call_cost = CallCost.for_model(model.config, "cuda", kernel)
    executor.backward(trie, loss, score_from=froms)  # (warm: first-call checks)
    before = executor.calls.forward
    with OpCounter() as walk:
        executor.backward(trie, loss, score_from=froms)
    ids = torch.tensor(seqs)
    with OpCounter() as dense:
        logits = model(input_ids=ids, logits_to_keep=ids.shape[1] - prompt + 1).logits[:, :-1]
        (-torch.log_softmax(logits.float(), -1).gather(-1, ids[:, prompt:, None]).sum()).backward()
    return {"walk": walk.ops, "dense": dense.ops, "walk_calls": executor.calls.forward - before,
            "walk_by_name": dict(walk.by_name), "dense_by_name": dict(dense.by_name)}  # fmt: skip


def host_seconds(layers: int, repeats: int) -> dict:
    """Median seconds of the walk of one 16-token sequence and of the model's own forward + backward of it."""
    model = tiny(layers)
    seq = torch.randint(1, 500, (16,), generator=torch.Generator().manual_seed(2)).tolist()
    trie, ids = PrefixTrie.from_sequences([seq]), torch.tensor([seq])
    executor = TreeExecutor(model, memory_budget=None, block_size=1 << 16, batch_tokens=0, subtree_tokens=0)

    def walk():
        executor.backward(trie, lambda i, lp, e: -lp.mean())

    def dense():
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
        (-torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).mean()).backward()

    out = {}
    for name, run in (("walk", walk), ("dense", dense)):
        for _ in range(5):
            run()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ops = {n: operators(n) for n in (4, 8)}
    per_layer = {k: (ops[8][k] - ops[4][k]) / 4 for k in ("walk", "dense")}
    besides = {k: ops[4][k] - 4 * per_layer[k] for k in ("walk", "dense")}
    ratio = ops[4]["walk"] / ops[4]["dense"]
    print(
        f"operators, GRPO group as on CUDA: 4 layers walk {ops[4]['walk']} / dense {ops[4]['dense']} "
        f"({ratio:.2f}x, {ops[4]['walk_calls']} call); per layer walk {per_layer['walk']:.0f} / dense "
        f"{per_layer['dense']:.0f}; per walk besides {besides['walk']:.0f} / {besides['dense']:.0f}"
    )
    host = {n: host_seconds(n, args.repeats) for n in (1, 8)}
    slope = {k: (host[8][k] - host[1][k]) / 7 for k in ("walk", "dense")}
    rest = {k: (host[1][k] - slope[k]) * 1e3 for k in ("walk", "dense")}
    print(
        f"host time per decoder-layer call (16 tokens): walk {slope['walk'] * 1e3:.3f} ms, dense "
        f"{slope['dense'] * 1e3:.3f} ms ({slope['walk'] / slope['dense']:.2f}x); besides: walk "
        f"{rest['walk']:.2f} ms, dense {rest['dense']:.2f} ms"
    )
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        report = {
            "operators": ops,
            "operators_per_layer": per_layer,
            "host_s": host,
            "host_s_per_layer": slope,
            "threads": 1,
            "torch": torch.__version__,
        }
        (Path(args.out) / "host-cost-cpu.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
