"""One rank of a two-process AsyncTreePPOTrainer run (torchrun, gloo, CPU), launched by
tests/test_async_trainer.py (test_two_processes_equal_dense_sgd).

Usage: torchrun --nproc_per_node 2 tests/async_dist_worker.py OUT_DIR MODEL_DIR
Trains STEPS optimizer steps of SGD on the rollouts of :func:`distributed_rollouts` (fed by a queue worker
on the main process, weight sync a no-op) and saves this rank's parameters to OUT_DIR/rank{RANK}.pt.
"""

from __future__ import annotations

import sys

import torch
from transformers import AutoModelForCausalLM

from trl_dta import AsyncTreePPOConfig, AsyncTreePPOTrainer
from trl_dta.testing.async_grpo import NoWeightTransfer, QueueWorker, synthetic_rollouts
from trl_dta.testing.grpo import make_dataset, tiny_tokenizer

TEMPERATURE, EPSILON, EPSILON_HIGH = 0.9, 0.2, 0.28
STEPS, PER_RANK, ACCUMULATION, LR, RANKS = 2, 3, 2, 0.05, 2


def distributed_rollouts(model):
    """30 rollouts in groups of 3, policy versions 0 and 1 mixed; the first group's prompt is much longer,
    so the lexicographic partition gives the ranks unequal sample counts (zero-weight rows pad the other)."""
    prompts = [40] + [6] * 9
    return synthetic_rollouts(21, model, TEMPERATURE, groups=10, per_group=3, versions=(0, 1), prompt=prompts)


def main(out_dir: str, model_dir: str) -> None:
    reference = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    args = AsyncTreePPOConfig(
        output_dir=out_dir, per_device_train_batch_size=PER_RANK, gradient_accumulation_steps=ACCUMULATION,
        max_steps=STEPS, bf16=False, use_cpu=True, optim="sgd", learning_rate=LR, max_grad_norm=0.0,
        report_to=[], save_strategy="no", logging_steps=1, epsilon=EPSILON, epsilon_high=EPSILON_HIGH,
        temperature=TEMPERATURE, max_staleness=3,
    )  # fmt: skip
    trainer = AsyncTreePPOTrainer(
        model_dir, args=args, processing_class=tiny_tokenizer(), train_dataset=make_dataset(2),
        rollout_worker=QueueWorker(distributed_rollouts(reference)), weight_transfer=NoWeightTransfer(),
    )  # fmt: skip
    trainer.train()
    rank = trainer.accelerator.process_index
    params = {n: p.detach().cpu().clone() for n, p in trainer.model.named_parameters()}
    torch.save({"params": params, "logs": trainer.state.log_history}, f"{out_dir}/rank{rank}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:3])
