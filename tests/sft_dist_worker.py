"""One rank of a multi-process SFT run (launched by tests/test_sft_distributed.py with torchrun, or alone).

Usage: [torchrun --nproc_per_node 2] tests/sft_dist_worker.py OUT_DIR MODEL_DIR {tree,stock} [MODE]
MODE: ddp (default: torchrun and use_cpu, accelerate's MULTI_CPU), zero2, zero3 (DeepSpeed, prepared by
accelerate itself on gloo processes: trl_dta/testing/cpu_distributed.py, a test device).
Each optimizer step sees the same 8 conversations whatever the process count (a one-process run gets the
global batch); saves this rank's per-step gradients (DDP), log history, the full parameters before and after
training and what DeepSpeed sharded to OUT_DIR/{trainer}{RANK}.pt (MODE other than ddp: {trainer}-{MODE}...).
``DENSE_FALLBACK`` in the environment: the tree trainer's ``tree_dense_fallback`` (else the fixtures'
"never").
"""

from __future__ import annotations

import os
import sys

import torch
from trl import SFTConfig, SFTTrainer

from trl_dta import TreeSFTConfig, TreeSFTTrainer
from trl_dta.testing.cpu_distributed import process_state, trainer_settings
from trl_dta.testing.grpo import GradRecorder, tiny_tokenizer
from trl_dta.testing.sft import make_sft_config, tool_conversations
from trl_dta.testing.torchrun import exit_worker


def full_parameters(model) -> dict[str, torch.Tensor]:
    """The trainable parameters, whole (ZeRO-3: gathered)."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if any(hasattr(p, "ds_id") for _, p in params):
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in params]):
            return {n: p.detach().clone() for n, p in params}
    return {n: p.detach().clone() for n, p in params}


def main(out_dir, model_dir, trainer="tree", mode="ddp"):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    tree = trainer == "tree"
    if world > 1:
        process_state(mode)
    name = trainer if mode == "ddp" else f"{trainer}-{mode}"
    recorder, fallback = GradRecorder(), os.environ.get("DENSE_FALLBACK")
    config = make_sft_config(
        os.path.join(out_dir, f"{name}-run{rank}"),
        config_cls=TreeSFTConfig if tree else SFTConfig,
        per_device_train_batch_size=4 // world,
        gradient_accumulation_steps=2,
        assistant_only_loss=True,
        **(trainer_settings(mode) if world > 1 else {}),
        **({"tree_dense_fallback": os.environ["DENSE_FALLBACK"]} if tree and fallback else {}),
    )
    cls = TreeSFTTrainer if tree else SFTTrainer
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    t = cls(model=model, args=config, train_dataset=tool_conversations(16), processing_class=tiny_tokenizer(),
            callbacks=[recorder])  # fmt: skip
    initial = full_parameters(t.model)
    t.train()
    module = t.accelerator.unwrap_model(t.model_wrapped)
    result = {
        "grads": recorder.grads,
        "logs": [h for h in t.state.log_history if "entropy" in h],
        "initial": initial,
        "final": full_parameters(module),
        "distributed_type": str(t.accelerator.distributed_type),
        "engine": type(t.model_wrapped).__name__,
        "zero3_partitioned": sum(
            hasattr(p, "ds_id") and p.data.numel() < p.ds_numel for p in module.parameters()
        ),
        "parameters": sum(1 for _ in module.parameters()),
    }
    torch.save(result, os.path.join(out_dir, f"{name}{rank}.pt"))
    exit_worker()  # (trl_dta/testing/torchrun.py)


if __name__ == "__main__":
    main(*sys.argv[1:])
