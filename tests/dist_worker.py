"""One rank of a multi-process TreePPOTrainer run (launched by tests/test_distributed.py with torchrun).

Usage: torchrun --nproc_per_node 2 tests/dist_worker.py OUT_DIR MODEL_DIR LOSS_TYPE
Saves this rank's per-step gradients (taken just before the optimizer step) to OUT_DIR/rank{RANK}.pt. With
``VALUE_MODEL=1`` in the environment, the tree trainer has a value model (warm-started from the policy, its
head seeded) and the value model's gradients are saved too.
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
    extra, value_grads = {}, []
    if os.environ.get("VALUE_MODEL") == "1":
        from transformers import AutoModelForCausalLM

        from trl_dta import value_model_from

        critic = value_model_from(AutoModelForCausalLM.from_pretrained(model_dir))
        with torch.no_grad():
            critic.score.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(3))
        extra["value_model"] = critic
    t = make_trainer(cls, config, model=model_dir, callbacks=[recorder], dataset=unequal_dataset(), **extra)
    if extra:
        step = t._critic.step

        def recorded_step():
            value_grads.append({n: p.grad.clone() for n, p in t._critic.model.named_parameters()})
            return step()

        t._critic.step = recorded_step
    t.train()
    saved = {"grads": recorder.grads, "rows": rows, "value_grads": value_grads}
    torch.save(saved, os.path.join(out_dir, f"{trainer}{rank}.pt"))


if __name__ == "__main__":
    main(*sys.argv[1:])
