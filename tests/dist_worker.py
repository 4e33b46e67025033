"""One rank of a multi-process TreePPOTrainer run (launched by tests/test_distributed.py with torchrun).

Usage: torchrun --nproc_per_node 2 tests/dist_worker.py OUT_DIR MODEL_DIR LOSS_TYPE
Saves this rank's per-step gradients (taken just before the optimizer step) to OUT_DIR/rank{RANK}.pt. With
``VALUE_MODEL=1`` in the environment, the tree trainer has a value model (warm-started from the policy, its
head seeded) and the value model's gradients are saved too. ``DENSE_FALLBACK``: the tree trainer's
``tree_dense_fallback`` (else the fixtures' "never"); each training step's decision is saved (this rank's
prediction, the path taken).
"""

from __future__ import annotations

import os
import sys

import torch
from trl import GRPOConfig, GRPOTrainer

from trl_dta import TreePPOConfig, TreePPOTrainer
from trl_dta.testing.grpo import GradRecorder, ScriptedGenerationMixin, make_config, make_trainer
from trl_dta.testing.torchrun import exit_worker

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
    if os.environ.get("DENSE_FALLBACK"):  # (the fixtures pin "never")
        batch["tree_dense_fallback"] = os.environ["DENSE_FALLBACK"]
    recorder = GradRecorder()
    config = make_config(
        os.path.join(out_dir, f"run{rank}"),
        config_cls=TreePPOConfig if tree else GRPOConfig,
        loss_type=loss_type,
        **({k: v for k, v in batch.items() if tree or not k.startswith("tree_")}),
    )
    extra, value_grads, decisions = {}, [], []
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
    if tree:  # each training step's decision: this rank's prediction and the path taken
        prefer_dense = t._walker.prefer_dense

        def recorded(*args, timed=True, **kwargs):
            dense = prefer_dense(*args, timed=timed, **kwargs)
            if timed:
                prediction = t._walker.prediction  # (plain floats: torch.load's weights_only)
                decisions.append(((prediction.step_s, prediction.dense_s), dense))
            return dense

        t._walker.prefer_dense = recorded
    t.train()
    saved = {"grads": recorder.grads, "rows": rows, "value_grads": value_grads, "decisions": decisions}
    torch.save(saved, os.path.join(out_dir, f"{trainer}{rank}.pt"))
    exit_worker()  # (trl_dta/testing/torchrun.py)


if __name__ == "__main__":
    main(*sys.argv[1:])
