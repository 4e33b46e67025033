"""One rank of the DeepSpeed executor test (tests/test_deepspeed.py): torchrun, gloo, CPU.

Every rank builds the same fp32 model and the same random tries (tests/sharded_worker.py's), wraps the model
with ``deepspeed.initialize`` (ZeRO-2 or ZeRO-3), walks its lexicographic part of each trie, and compares the
reduced gradients (``safe_get_full_grad``) with the dense per-sequence gradients of ALL ranks' sequences,
averaged over ranks (DeepSpeed's reduction). Two walks per optimizer step share one ``step_reduction``. It
counts DeepSpeed's collectives inside the walks and in the flush. With ``idle``, the last rank has nothing
to walk and walks the two-token trie with a zero loss, as the trainer does; with ``oom``, rank 0 runs out of
memory in each step's second walk (every rank walks it again). Rank 0 writes the results to
``argv[1]``; argv[2:] are the case names (see CASES).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from sharded_worker import build, dense_reference, loss_for, tries  # noqa: E402

from trl_dta import PrefixTrie, TreeExecutor, lexicographic_partition  # noqa: E402
from trl_dta.compare import relative_error  # noqa: E402
from trl_dta.testing.torchrun import exit_worker  # noqa: E402
from trl_dta.walk.distributed import deepspeed as zero  # noqa: E402

# case -> (model, ZeRO stage, idle last rank, out of memory on rank 0 in each step's second walk)
CASES = {
    "zero2": ("qwen3", 2, False, False),
    "zero3": ("qwen3", 3, False, False),
    "zero3-lora": ("lora", 3, False, False),
    "zero2-idle-rank": ("qwen3", 2, True, False),
    "zero3-idle-rank": ("qwen3", 3, True, False),
    "zero2-oom-rank0": ("qwen3", 2, False, True),
    "zero3-oom-rank0": ("qwen3", 3, False, True),
}
COUNTS: dict[str, int] = {}


def _count() -> None:
    from deepspeed.comm.torch import TorchBackend

    depth = [0]
    for name in ("all_reduce", "reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_gather",
                 "broadcast", "reduce_scatter", "all_gather_coalesced"):  # fmt: skip
        original = getattr(TorchBackend, name)

        def wrapped(*args, _name=name, _original=original, **kwargs):
            if depth[0] == 0:
                COUNTS[_name] = COUNTS.get(_name, 0) + 1
            depth[0] += 1
            try:
                return _original(*args, **kwargs)
            finally:
                depth[0] -= 1

        setattr(TorchBackend, name, wrapped)


def engine_for(kind: str, stage: int):
    import deepspeed

    model = build(kind)
    params = [p for p in model.parameters() if p.requires_grad]
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(params, lr=0.0), config=config)
    zero.register_engine(engine)
    return engine


def run_case(case: str, rank: int, world: int) -> dict:
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_grad

    from trl_dta.testing.oom import InjectOOM

    kind, stage, idle, oom = CASES[case]
    reference_model = build(kind)
    engine = engine_for(kind, stage)
    executor = TreeExecutor(engine.module)
    names = [n for n, p in engine.module.named_parameters() if p.requires_grad]
    out = {"parameters": sum(1 for _ in engine.module.parameters()), "steps": []}
    for seed in range(2):  # two optimizer steps
        seqs = tries(1000 * len(case) + seed)
        parts = lexicographic_partition(seqs, world)
        walking = {i for p in parts[:-1] for i in p} if idle else None
        part = [] if idle and rank == world - 1 else parts[rank]
        ref = dense_reference(reference_model, seqs, world, walking)
        halves = [part[: len(part) // 2], part[len(part) // 2 :]]  # two walks in one step
        COUNTS.clear()
        phases = []
        retried = executor.oom_recovery.retried
        with zero.step_reduction(engine):
            for k, half in enumerate(halves):
                before = dict(COUNTS)
                trie = PrefixTrie.from_sequences([seqs[i] for i in half] if half else [[0, 1]])

                def loss(j, lp, ent, half=half):
                    return loss_for(half[j])(lp, ent) if half else lp.sum() * 0.0

                at = 1 if oom and k == 1 and rank == 0 else None  # (rank 0: the second walk's first call)
                with InjectOOM(executor.lm.decoder.layers[0], at=at):
                    executor.backward(trie, loss, entropies=True)
                phases.append({k: v - before.get(k, 0) for k, v in COUNTS.items() if v > before.get(k, 0)})
            before = dict(COUNTS)
        phases.append({k: v - before.get(k, 0) for k, v in COUNTS.items() if v > before.get(k, 0)})  # flush
        grads = {n: safe_get_full_grad(p).detach().clone() for n, p in engine.module.named_parameters()
                 if p.requires_grad}  # fmt: skip
        retries = [None] * world
        dist.all_gather_object(retries, executor.oom_recovery.retried - retried)
        engine.step()  # (lr 0: the parameters stay; the gradients are cleared)
        with torch.no_grad():
            before = dict(COUNTS)
            executor.logprobs(PrefixTrie.from_sequences([seqs[i] for i in part] or [[0, 1]]))
            logprob = {k: v - before.get(k, 0) for k, v in COUNTS.items() if v > before.get(k, 0)}
        out["steps"].append(
            {
                "grad_error": relative_error({n: grads[n] for n in ref}, ref, tiny=1e-6),
                "missing": sorted(set(ref) - set(grads)),
                "trainable": len(names),
                "walks": phases[:2],
                "flush": phases[2],
                "logprobs": logprob,
                "sequences": len(part),
                "retries": retries,
            }
        )
    return out


def main():
    import deepspeed
    import torch.distributed as dist

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    _count()
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {case: run_case(case, rank, world) for case in sys.argv[2:]}
    if rank == 0:
        Path(sys.argv[1]).write_text(json.dumps({"world": world, "cases": results}, indent=1))
    exit_worker()  # (trl_dta/testing/torchrun.py)


if __name__ == "__main__":
    main()
