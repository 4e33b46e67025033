"""TreePPOTrainer on an FSDP2-sharded model against stock GRPOTrainer on the same model unsharded (launched by
tests/test_sharded.py in a subprocess: it starts a one-process gloo group of its own).

accelerate does not turn FSDP on without GPUs, so the model is sharded here the way accelerate's FSDP2
prepares it (``fully_shard`` per decoder layer, then the root; LoRA applied before sharding) and the
trainer runs in accelerate's single-process mode: the trainer code that runs (the walk gathering once and
reducing once, with FSDP2's own hooks) is the code that runs under ``fsdp_version: 2`` on GPUs.

Usage: python tests/fsdp_trainer_worker.py OUT_FILE MODEL_DIR VARIANT   (VARIANT: plain, kl (the reference
model sharded too), lora, per-layer (tree_gather_per_layer))
"""

from __future__ import annotations

import socket
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM
from trl import GRPOConfig

from trl_dta import TreePPOConfig, TreePPOTrainer
from trl_dta.testing.grpo import (
    GradRecorder,
    ScriptedGenerationMixin,
    ScriptedGRPOTrainer,
    make_config,
    make_trainer,
)
from trl_dta.testing.torchrun import exit_worker

SETTINGS = dict(learning_rate=2.0, max_steps=2, num_iterations=2, gradient_accumulation_steps=2,
                per_device_train_batch_size=2)  # fmt: skip
VARIANTS = {"plain": {}, "kl": {"beta": 0.1}, "lora": {}, "per-layer": {}}
TREE_OPTIONS = {"per-layer": {"tree_gather_per_layer": True}}


def load(model_dir, variant):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if variant == "lora":
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                 init_lora_weights=False))  # fmt: skip
    return model


def shard(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for layer in base.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def run(trainer_cls, config_cls, model, out, variant, sharded=False):
    recorder = GradRecorder()
    options = TREE_OPTIONS.get(variant, {}) if sharded else {}
    config = make_config(out, config_cls=config_cls, **SETTINGS, **VARIANTS[variant], **options)
    trainer = make_trainer(trainer_cls, config, model=model, callbacks=[recorder])
    if sharded and trainer.ref_model is not None:  # as TRL's prepare_fsdp does under FSDP2
        shard(trainer.ref_model)
    trainer.train()
    return recorder.grads, trainer


def main(out_file, model_dir, variant):
    torch.set_num_threads(1)
    stock, _ = run(ScriptedGRPOTrainer, GRPOConfig, load(model_dir, variant), out_file + ".stock", variant)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    tree_cls = type("TreeScripted", (ScriptedGenerationMixin, TreePPOTrainer), {})
    model = shard(load(model_dir, variant))
    tree, trainer = run(tree_cls, TreePPOConfig, model, out_file + ".tree", variant, sharded=True)
    models = [trainer.model] + ([trainer.ref_model] if trainer.ref_model is not None else [])
    sharded = [sum(type(p).__name__ == "DTensor" for p in m.parameters()) for m in models]
    torch.save({"stock": stock, "tree": tree, "sharded_parameters": sharded,
                "distributed_type": str(trainer.accelerator.distributed_type)}, out_file)  # fmt: skip
    exit_worker()  # (trl_dta/testing/torchrun.py)


if __name__ == "__main__":
    main(*sys.argv[1:])
