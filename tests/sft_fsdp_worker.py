"""TreeSFTTrainer on an FSDP2-sharded model against stock SFTTrainer on the same model unsharded (launched by
tests/test_sft_distributed.py in a subprocess: it starts a one-process gloo group of its own).

As tests/fsdp_trainer_worker.py does for TreePPOTrainer: accelerate does not turn FSDP on without GPUs, so
the model is sharded here the way accelerate's FSDP2 prepares it (``fully_shard`` per decoder layer, then the
root; LoRA applied before sharding) and the trainer runs in accelerate's single-process mode: the walk
gathering once and reducing once, with FSDP2's own hooks, is the code that runs under ``fsdp_version: 2``.

Usage: python tests/sft_fsdp_worker.py OUT_FILE MODEL_DIR VARIANT   (VARIANT: plain, lora)
"""

from __future__ import annotations

import socket
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM
from trl import SFTConfig, SFTTrainer

from trl_dta import TreeSFTConfig, TreeSFTTrainer
from trl_dta.testing.grpo import GradRecorder, tiny_tokenizer
from trl_dta.testing.sft import make_sft_config, tool_conversations
from trl_dta.testing.torchrun import exit_worker


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


def run(trainer_cls, config_cls, model, out):
    recorder = GradRecorder()
    config = make_sft_config(out, config_cls=config_cls, assistant_only_loss=True)
    trainer = trainer_cls(model=model, args=config, train_dataset=tool_conversations(8),
                          processing_class=tiny_tokenizer(), callbacks=[recorder])  # fmt: skip
    trainer.train()
    return recorder.grads, trainer


def main(out_file, model_dir, variant):
    torch.set_num_threads(1)
    stock, _ = run(SFTTrainer, SFTConfig, load(model_dir, variant), out_file + ".stock")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    tree, trainer = run(TreeSFTTrainer, TreeSFTConfig, shard(load(model_dir, variant)), out_file + ".tree")
    sharded = sum(type(p).__name__ == "DTensor" for p in trainer.model.parameters())
    torch.save({"stock": stock, "tree": tree, "sharded_parameters": sharded}, out_file)
    exit_worker()  # (trl_dta/testing/torchrun.py)


if __name__ == "__main__":
    main(*sys.argv[1:])
