"""One rank of a multi-process SFT run (launched by tests/test_sft_distributed.py with torchrun, or alone).

Usage: [torchrun --nproc_per_node 2] tests/sft_dist_worker.py OUT_DIR MODEL_DIR {tree,stock}
Each optimizer step sees the same 8 conversations whatever the process count (a one-process run gets the
global batch); saves this rank's per-step gradients and log history to OUT_DIR/{trainer}{RANK}.pt.
"""

from __future__ import annotations

import os
import sys

import torch
from trl import SFTConfig, SFTTrainer

from trl_dta import TreeSFTConfig, TreeSFTTrainer
from trl_dta.testing.grpo import GradRecorder, tiny_tokenizer
from trl_dta.testing.sft import make_sft_config, tool_conversations


def main(out_dir, model_dir, trainer="tree"):
    from transformers import AutoModelForCausalLM

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    tree = trainer == "tree"
    recorder = GradRecorder()
    config = make_sft_config(
        os.path.join(out_dir, f"{trainer}-run{rank}"),
        config_cls=TreeSFTConfig if tree else SFTConfig,
        per_device_train_batch_size=4 // world,
        gradient_accumulation_steps=2,
        assistant_only_loss=True,
    )
    cls = TreeSFTTrainer if tree else SFTTrainer
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    t = cls(model=model, args=config, train_dataset=tool_conversations(16), processing_class=tiny_tokenizer(),
            callbacks=[recorder])  # fmt: skip
    t.train()
    logs = [h for h in t.state.log_history if "entropy" in h]
    torch.save({"grads": recorder.grads, "logs": logs}, os.path.join(out_dir, f"{trainer}{rank}.pt"))


if __name__ == "__main__":
    main(*sys.argv[1:])
