"""FSDP2 smoke test for a lent GPU (benchmarks/gpu.sh), or the CPU (``--device cpu``, gloo).

One process (world size 1: FSDP2's code paths, not its communication): a Qwen3 model from a config (random
weights, no download), sharded with ``fully_shard`` per decoder layer and at the root as accelerate's FSDP2
does, walks a GRPO-shaped trie. It reports the gradient error against the dense per-sequence gradients of
the same model unsharded, FSDP2's all-gathers and reduce-scatters per walk (one per unit expected), and
the peak memory of the walk against docs/multi-process.md's memory model (gathered parameters + unsharded
gradient accumulator, activations aside). Exits non-zero if the gradients or the counts are off.

    python benchmarks/fsdp2_smoke.py [--device cuda] [--hidden 1024 --layers 8] [--out OUT_DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import Qwen3Config, Qwen3ForCausalLM

from trl_dta import PrefixTrie, TreeExecutor
from trl_dta.compare import relative_error
from trl_dta.testing.torchrun import exit_worker
from trl_dta.walk.memory import peak as walk_peak

COUNTS = {"all_gather": 0, "reduce_scatter": 0}


def _count_fsdp() -> None:
    """Count FSDP2's gathers (a parameter group unsharded from sharded) and reductions (``foreach_reduce``),
    which FSDP2 runs even on one rank (the collectives themselves are skipped there)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_module

    unshard, reduce = group_module.FSDPParamGroup.unshard, group_module.foreach_reduce

    def counted_unshard(self, *args, **kwargs):
        if not self.is_unsharded and self._all_gather_result is None:
            COUNTS["all_gather"] += 1
        return unshard(self, *args, **kwargs)

    def counted_reduce(*args, **kwargs):
        COUNTS["reduce_scatter"] += 1
        return reduce(*args, **kwargs)

    group_module.FSDPParamGroup.unshard = counted_unshard
    group_module.foreach_reduce = counted_reduce


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--per_layer", action="store_true", help="gather_per_layer (counts not checked)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    device = torch.device(args.device)
    if (
        device.type == "cuda" and device.index is None
    ):  # set_device wants an index (torch 2.11 refuses "cuda")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    _count_fsdp()
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.cuda.set_device(device)
    config = Qwen3Config(vocab_size=32000, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=max(1, args.hidden // 128), head_dim=64,
                         tie_word_embeddings=False, attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(0)
    reference = Qwen3ForCausalLM(config).to(device).train()
    model = Qwen3ForCausalLM(config).to(device).train()
    model.load_state_dict(reference.state_dict())
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    units = args.layers + 1
    n = sum(p.numel() for p in reference.parameters())

    prompt = [(7 * t + 3) % 32000 for t in range(256)]
    seqs = [prompt + [(11 * t + k) % 32000 for t in range(32 + 8 * k)] for k in range(8)]

    def loss_fn(i, logps, entropies):
        return -(logps * (1 + 0.1 * i)).sum() / 100

    reference.zero_grad(set_to_none=True)
    for i, seq in enumerate(seqs):
        ids = torch.tensor(seq, device=device)[None]
        lsm = torch.log_softmax(reference(input_ids=ids).logits[0, :-1].float(), -1)
        loss_fn(i, lsm.gather(-1, ids[0, 1:, None]).squeeze(-1), None).backward()
    ref = {k: p.grad for k, p in reference.named_parameters()}
    del reference
    executor = TreeExecutor(model, gather_per_layer=args.per_layer)
    trie = PrefixTrie.from_sequences(seqs)
    for k in COUNTS:
        COUNTS[k] = 0
    if device.type == "cuda":
        torch.cuda.synchronize()
        walk_peak.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    executor.backward(trie, loss_fn)
    peak = walk_peak.max_memory_allocated() - before if device.type == "cuda" else None
    grads = {k: p.grad.full_tensor() for k, p in model.named_parameters()}
    error = relative_error(grads, {k: ref[k] for k in grads}, tiny=1e-6)
    report = {
        "device": str(device), "per_layer": args.per_layer, "parameters": n, "units": units,
        "dedup_ratio": trie.dedup_ratio,
        "grad_error": error, **COUNTS,
        "peak_walk_bytes": peak, "model_bytes_gathered_plus_accumulator": 8 * n,  # fp32: 4n + 4n
    }  # fmt: skip
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        name = "fsdp2_smoke_per_layer.json" if args.per_layer else "fsdp2_smoke.json"
        (Path(args.out) / name).write_text(json.dumps(report, indent=1))
    counted = args.per_layer or (COUNTS["all_gather"] == units and COUNTS["reduce_scatter"] == units)
    ok = error <= 1e-4 and counted
    return 0 if ok else 1


if __name__ == "__main__":
    exit_worker(main())  # (its process group would outlive the interpreter: trl_dta/testing/torchrun.py)
