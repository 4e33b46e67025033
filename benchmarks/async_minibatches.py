"""AsyncTreePPOTrainer with ppo_n_minibatches = 1 and = k on the CPU (issue 55): where the decoupled
objective's trust region binds, and what a proximal pass costs and shares.

A tiny Qwen3 (from a config), rollouts fed through TRL's own ``rollout_worker`` extension point
(``trl_dta.testing.async_grpo``: groups sharing a prompt, behaviour log-probs off the policy's, versions
mixed), the decoupled objective, a value model, AdamW. Each setting trains the same samples in the same
order; per optimizer step it prints the share of tokens the ratio to the proximal policy clips
(``clip_ratio/proximal_region_mean``), the value clip's share (``value/clip_ratio``), the step's time and,
at a pass's first step, the pass's walk (time, dedup ratio against the steps' own).

    python benchmarks/async_minibatches.py --steps 8 --k 1 4
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from trl_dta import AsyncTreePPOConfig, AsyncTreePPOTrainer, value_model_from
from trl_dta.testing.async_grpo import NoWeightTransfer, QueueWorker, synthetic_rollouts
from trl_dta.testing.grpo import make_dataset, tiny_model, tiny_tokenizer


def run(model_dir: str, samples, k: int, args) -> list[dict]:
    out = tempfile.mkdtemp()
    config = AsyncTreePPOConfig(
        output_dir=out, per_device_train_batch_size=args.batch, gradient_accumulation_steps=args.accumulation,
        max_steps=args.steps, bf16=False, use_cpu=True, learning_rate=args.lr, report_to=[],
        save_strategy="no", logging_steps=1, max_staleness=args.steps + 4, use_decoupled_loss=True,
        ppo_n_minibatches=k, weight_sync_steps=k, seed=0, value_learning_rate=args.value_lr,
    )  # fmt: skip
    critic = value_model_from(tiny_model(seed=1))
    trainer = AsyncTreePPOTrainer(
        model_dir, args=config, processing_class=tiny_tokenizer(), train_dataset=make_dataset(2),
        rollout_worker=QueueWorker(samples), weight_transfer=NoWeightTransfer(), value_model=critic,
    )  # fmt: skip
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    logs = [log for log in trainer.state.log_history if "clip_ratio/proximal_region_mean" in log]
    for log in logs:
        log["wall_s"] = wall
    return logs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--k", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--batch", type=int, default=8, help="samples per micro-batch")
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=96, help="tokens of each group's shared prompt")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--value_lr", type=float, default=3e-2)
    args = parser.parse_args()
    torch.manual_seed(0)
    model_dir = tempfile.mkdtemp()
    policy = tiny_model(seed=0)
    policy.save_pretrained(model_dir)
    per_step = args.batch * args.accumulation
    groups = -(-(args.steps * per_step + 2 * per_step) // 4)  # (a step's worth beyond: accelerate prefetches)
    samples = synthetic_rollouts(
        0, policy, 1.0, groups=groups, per_group=4, versions=(0, 1, 2), prompt=args.prompt, noise=0.3
    )
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {len(samples)} samples, "
        f"{per_step} per step"
    )
    for k in args.k:
        logs = run(model_dir, samples, k, args)
        print(f"\nppo_n_minibatches={k}: train() {logs[0]['wall_s']:.2f} s")
        print("| step | proximal clip | value clip | step s | pass walk s | pass dedup | step dedup |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for step, log in enumerate(logs, 1):
            walk = log.get("proximal_tree/time_s")
            print(
                f"| {step} | {log['clip_ratio/proximal_region_mean']:.3f} | {log['value/clip_ratio']:.3f} | "
                f"{log.get('perf/step_s', float('nan')):.3f} | {'' if walk is None else f'{walk:.3f}'} | "
                f"{log.get('proximal_tree/dedup_ratio', float('nan')):.2f} | {log['tree/dedup_ratio']:.2f} |"
            )


if __name__ == "__main__":
    main()
