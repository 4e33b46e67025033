"""One rank of a multi-process TreePPOTrainer run (launched by tests/test_distributed.py with torchrun).

Usage: torchrun --nproc_per_node 2 tests/dist_worker.py OUT_DIR MODEL_DIR LOSS_TYPE
Saves this rank's per-step gradients (taken just before the optimizer step) to OUT_DIR/rank{RANK}.pt.
"""

from __future__ import annotations

import os
import sys

import torch
from trl import GRPOConfig, GRPOTrainer

from trl_dta import TreePPOConfig, TreePPOTrainer
from trl_dta.testing.grpo import GradRecorder, ScriptedGenerationMixin, make_config, make_trainer

BATCH = dict(
    per_device_train_batch_size=8, num_generations=4, learning_rate=2.0, num_iterations=2, max_steps=2
)


def unequal_dataset(num_prompts=4):
    """Prompts of very different lengths, so that a balanced DFS split gives ranks unequal row counts."""
    from datasets import Dataset

    from trl_dta.testing.grpo import SYSTEM_PROMPT, _user_message

    prompts = []
    for i in range(num_prompts):
        text = _user_message(i) + (
            " I ordered it for my sister, it is a birthday gift." * 12 if i == 0 else ""
        )
        prompts.append([{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": text}])
    return Dataset.from_dict({"prompt": prompts})


def main(out_dir, model_dir, loss_type, trainer="tree"):
    rank = int(os.environ.get("RANK", 0))
    tree = trainer == "tree"
    rows = []

    def record_rows(self, inputs):  # rows with a completion to train on, after any re-partition
        output = super(cls, self)._generate_and_score_completions(inputs)
        rows.append(int((output["completion_mask"].sum(1) > 0).sum()))
        return output

    base = TreePPOTrainer if tree else GRPOTrainer
    cls = type("T", (ScriptedGenerationMixin, base), {"_generate_and_score_completions": record_rows})
    batch = dict(BATCH)
    if int(os.environ.get("WORLD_SIZE", 1)) == 1:  # a one-process reference sees the whole global batch
        batch["per_device_train_batch_size"] *= int(os.environ.get("REFERENCE_WORLD", 2))
    accumulation = int(os.environ.get("GRAD_ACCUM", 1))  # same rows per optimizer step, in more micro-batches
    batch["per_device_train_batch_size"] //= accumulation
    batch["gradient_accumulation_steps"] = accumulation
    recorder = GradRecorder()
    config = make_config(
        os.path.join(out_dir, f"run{rank}"),
        config_cls=TreePPOConfig if tree else GRPOConfig,
        loss_type=loss_type,
        **batch,
    )
    t = make_trainer(cls, config, model=model_dir, callbacks=[recorder], dataset=unequal_dataset())
    t.train()
    torch.save({"grads": recorder.grads, "rows": rows}, os.path.join(out_dir, f"{trainer}{rank}.pt"))


if __name__ == "__main__":
    main(*sys.argv[1:])
