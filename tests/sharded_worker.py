"""One rank of the FSDP2 executor test (tests/test_sharded.py): torchrun, gloo, CPU.

Every rank builds the same fp32 model and the same random tries, shards the model with ``fully_shard`` (per
decoder layer, then the root, as accelerate's FSDP2 wraps it), walks its lexicographic part of each trie, and
compares the ``full_tensor()`` of its sharded gradients with the dense per-sequence gradients of ALL ranks'
sequences, averaged over ranks (FSDP2's reduction). It counts FSDP2's all-gathers and reduce-scatters per
walk. Rank 0 writes the results to ``argv[1]``; argv[2:] are the case names (see CASES).
"""

from __future__ import annotations

import contextlib
import json
import random
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, str(Path(__file__).parent))
from conftest import VOCAB, make_model  # noqa: E402

from trl_dta import PrefixTrie, TreeExecutor, lexicographic_partition  # noqa: E402
from trl_dta.compare import relative_error  # noqa: E402
from trl_dta.testing.oom import InjectOOM  # noqa: E402
from trl_dta.testing.torchrun import exit_worker  # noqa: E402

# case -> (model, executor options)
CASES = {
    "qwen3": ("qwen3", {}),
    "qwen3-chunked": ("qwen3", {"block_size": 4, "batch_tokens": 6}),
    "qwen3-padded": ("qwen3", {"pack_leaves": False}),
    "lora": ("lora", {}),
    "qwen3_5": ("qwen3_5", {}),
    "qwen3-bf16": ("qwen3-bf16", {}),
    "qwen3-per-layer": ("qwen3", {"gather_per_layer": True}),
    "qwen3-per-layer-chunked": ("qwen3", {"gather_per_layer": True, "block_size": 4, "batch_tokens": 6}),
    "qwen3-per-layer-padded": ("qwen3", {"gather_per_layer": True, "pack_leaves": False}),
    "lora-per-layer": ("lora", {"gather_per_layer": True, "block_size": 4, "batch_tokens": 6}),
    "qwen3_5-per-layer": ("qwen3_5", {"gather_per_layer": True, "block_size": 5}),
    # the last rank has nothing to walk and walks a two-token trie with a zero loss (as the trainer does)
    "qwen3-idle-rank": ("qwen3", {"idle": True}),
    "qwen3-per-layer-idle-rank": ("qwen3", {"gather_per_layer": True, "block_size": 4, "idle": True}),
    # out of memory on one rank only: rank 0 at the 2nd forward of its gradient walks, rank 1 at the 1st of
    # its log-prob walks (trl_dta/walk/memory/recovery.py): every rank walks again, nothing reduced before
    "qwen3-oom-rank0": ("qwen3", {"block_size": 4, "batch_tokens": 6, "oom": {"backward": 0, "logprobs": 1}}),
}

COUNTS = {"all_gather": 0, "reduce_scatter": 0, "backward": 0, "forward": 0}


def _counting(module, name, key):
    original = getattr(module, name)

    def wrapped(*args, **kwargs):
        COUNTS[key] += 1
        return original(*args, **kwargs)

    setattr(module, name, wrapped)


_counting(dist, "all_gather_single", "all_gather")
_counting(dist, "reduce_scatter_single", "reduce_scatter")
_counting(torch.autograd, "backward", "backward")


def build(kind: str):
    if kind == "qwen3_5":
        from test_hybrid import hybrid_model

        return hybrid_model("qwen3_5", seed=0, dtype=torch.float32).train()
    model = make_model("qwen3", "sdpa", dtype=torch.float32).train()
    if kind == "lora":
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        model = get_peft_model(
            model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
        )
    return model


def decoder_layers(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model.layers


def shard(model, kind: str):
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if kind.endswith("bf16")
        else MixedPrecisionPolicy()
    )
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def tries(seed: int) -> list[list[int]]:
    """A shared system prompt, groups under their prompts, a duplicate, and sequences that are prefixes of
    others."""
    rng = random.Random(seed)
    system = [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 6))]
    seqs = []
    for _ in range(rng.randint(2, 4)):
        prompt = system + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 5))]
        seqs += [
            prompt + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 7))]
            for _ in range(rng.randint(2, 4))
        ]
    seqs.append(list(seqs[0]))  # a duplicate
    seqs.append(seqs[1][:-1] if len(seqs[1]) > 2 else seqs[1] + [5])  # a prefix (or an extension) of another
    seqs.append(seqs[2] + [rng.randrange(3, VOCAB)])
    return seqs


def loss_for(seq_index: int):
    weight = torch.tensor(1.0 + 0.1 * seq_index)

    def loss(logps, entropies):
        return -(logps * weight).sum() + 0.01 * (entropies**2).sum()

    return loss


def dense_reference(model, seqs, world, indices=None):
    """sum over ALL sequences (or those of ``indices``) of their losses, / world (FSDP2 averages over ranks):
    dense, per sequence."""
    model.zero_grad(set_to_none=True)
    for i, seq in enumerate(seqs):
        if indices is not None and i not in indices:
            continue
        ids = torch.tensor(seq)[None]
        logits = model(input_ids=ids).logits[0, :-1].float()
        lsm = torch.log_softmax(logits, -1)
        lp = lsm.gather(-1, ids[0, 1:, None]).squeeze(-1)
        ent = -(lsm.exp() * lsm).sum(-1)
        (loss_for(i)(lp, ent) / world).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def walk_reference(executor, model, seqs, world, indices=None):
    """The same walk on the unsharded model, over ALL sequences (or those of ``indices``), / world."""
    model.zero_grad(set_to_none=True)
    indices = sorted(indices) if indices is not None else list(range(len(seqs)))
    executor.backward(PrefixTrie.from_sequences([seqs[i] for i in indices]),
                      lambda j, lp, ent: loss_for(indices[j])(lp, ent) / world, entropies=True)  # fmt: skip
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def dense_sharded(model, seqs, world):
    """Stock FSDP2 (a gather and a reduce-scatter per call, so every rank must make the same calls): every
    sequence forwarded and backpropagated one by one on every rank, / world, averaged over ranks by FSDP2."""
    model.zero_grad(set_to_none=True)
    for i, seq in enumerate(seqs):
        ids = torch.tensor(seq)[None]
        lsm = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        lp = lsm.gather(-1, ids[0, 1:, None]).squeeze(-1)
        (loss_for(i)(lp, -(lsm.exp() * lsm).sum(-1)) / world).backward()
    return {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}


def _gather_steps(executor, trie) -> list[int]:
    """Each rank's number of plan steps (the per-layer mode pads every rank to the most)."""
    steps = len(executor.plan(trie))
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, steps)
    return out


def _inject(oom: dict, walk: str, rank: int, model, at: int):
    """Out of memory at the ``at``-th forward of decoder layer 0, on the rank ``oom[walk]`` names."""
    if oom.get(walk) != rank:
        return contextlib.nullcontext()
    return InjectOOM(decoder_layers(model)[0], at)


def run_case(case: str, rank: int, world: int) -> dict:
    kind, options = CASES[case]
    options = dict(options)
    idle = options.pop("idle", False)
    oom = options.pop("oom", {})
    reference_model = build(kind)
    reference_walk = TreeExecutor(reference_model, **options)
    model = shard(build(kind), kind)
    executor = TreeExecutor(model, **options)
    units = sum(1 for _ in decoder_layers(model)) + 1
    out = {"units": units, "walks": []}
    for seed in range(3):
        seqs = tries(1000 * len(case) + seed)
        parts = lexicographic_partition(seqs, world)
        part = parts[rank]
        walking = None
        if idle:  # the last rank's sequences are dropped: it walks the idle trie
            walking = {i for p in parts[:-1] for i in p}
            part = [] if rank == world - 1 else part
        ref = dense_reference(reference_model, seqs, world, walking)
        walked = walk_reference(reference_walk, reference_model, seqs, world, walking)
        stock = dense_sharded(model, seqs, world) if kind.endswith("bf16") else None
        trie = PrefixTrie.from_sequences([seqs[i] for i in part] if part else [[0, 1]])
        model.zero_grad(set_to_none=True)
        for k in COUNTS:
            COUNTS[k] = 0
        hook = decoder_layers(model)[0].register_forward_pre_hook(
            lambda *a: COUNTS.__setitem__("forward", COUNTS["forward"] + 1)
        )

        def loss(j, lp, ent, part=part):
            return loss_for(part[j])(lp, ent) if part else lp.sum() * 0.0

        retried = executor.oom_recovery.retried
        with _inject(oom, "backward", rank, model, at=2):
            executor.backward(trie, loss, entropies=True)
        hook.remove()
        retries = [executor.oom_recovery.retried - retried]
        walk_counts = dict(COUNTS)
        walk_counts["steps_all_ranks"] = _gather_steps(executor, trie)
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
        err = relative_error({n: grads[n] for n in ref}, ref, tiny=1e-6)
        walk_err = relative_error({n: grads[n] for n in walked}, walked, tiny=1e-6)
        stock_err = None if stock is None else relative_error({n: stock[n] for n in ref}, ref, tiny=1e-6)
        for k in COUNTS:
            COUNTS[k] = 0
        retried = executor.oom_recovery.retried
        with torch.no_grad(), _inject(oom, "logprobs", rank, model, at=1):
            logps = executor.logprobs(trie)
        retries.append(executor.oom_recovery.retried - retried)
        with torch.no_grad():
            dense = [
                torch.log_softmax(
                    reference_model(input_ids=torch.tensor(seqs[i])[None]).logits[0, :-1].float(), -1
                )
                .gather(-1, torch.tensor(seqs[i])[1:, None])
                .squeeze(-1)
                for i in part
            ]
        lp_err = max((relative_error(a, b) for a, b in zip(logps, dense, strict=False)), default=0.0)
        out["walks"].append(
            {
                "grad_error": err,
                "walk_error": walk_err,
                "stock_error": stock_err,
                "logp_error": lp_err,
                "missing": sorted(set(ref) - set(grads)),
                "counts": walk_counts,
                "logprob_counts": dict(COUNTS),
                "sequences": len(part),
                "retries": retries,  # (gradient walk, log-prob walk)
                "block_size": executor.budgets.in_use.block_size,
            }
        )
    return out


def main():
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {case: run_case(case, rank, world) for case in sys.argv[2:]}
    if rank == 0:
        Path(sys.argv[1]).write_text(json.dumps({"world": world, "cases": results}, indent=1))
    exit_worker()  # (trl_dta/testing/torchrun.py)


if __name__ == "__main__":
    main()
