"""One rank of a two-process AsyncTreePPOTrainer run (torchrun, gloo, CPU), launched by :func:`launch` for
tests/test_async_trainer.py (TRL's coupled objective), tests/test_async_decoupled.py (the decoupled one) and
tests/test_async_value_model.py (the decoupled one with a value model; also under FSDP2).

Usage: torchrun --nproc_per_node 2 tests/async_dist_worker.py OUT_DIR MODEL_DIR [MODE]
MODE (:data:`MODES`): ``coupled`` (the default), ``coupled-dense`` (``tree_dense_fallback="always"``),
``decoupled``, ``decoupled-value``, ``decoupled-value-minibatches`` (``ppo_n_minibatches=STEPS``) or
``decoupled-value-minibatches-idle`` (the same with a rank that has nothing to train in the second step:
:func:`idle_rank_rollouts`); a mode with ``-fsdp2`` appended runs the same under accelerate's FSDP2 on CPU
processes (trl_dta/testing/cpu_distributed.py: the policy and the value model sharded).
Trains STEPS optimizer steps of SGD on the rollouts of :func:`distributed_rollouts` (fed by a queue worker on
the main process, weight sync a no-op) and saves this rank's parameters (and its value model's) to
OUT_DIR/rank{RANK}.pt. :func:`make_trainer` builds the same run for any number of processes, so a test can
train the one-process run of the same micro-batches in its own process.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from trl_dta import AsyncTreePPOConfig, AsyncTreePPOTrainer, value_model_from
from trl_dta.testing.async_grpo import NoWeightTransfer, QueueWorker, rollout, synthetic_rollouts
from trl_dta.testing.grpo import make_dataset, tiny_tokenizer
from trl_dta.testing.torchrun import exit_worker, run_workers

TEMPERATURE, EPSILON, EPSILON_HIGH = 0.9, 0.2, 0.28
STEPS, PER_RANK, ACCUMULATION, LR, RANKS = 2, 3, 2, 0.05, 2
CAP = 1.3  # the decoupled weight's cap: behaviour log-probs 0.4 off the policy's put some tokens over it
DECOUPLED = dict(use_decoupled_loss=True, behav_imp_weight_cap=CAP)
DENSE = dict(tree_dense_fallback="always")  # (TRL's dense path on every step, DDP reducing it)
MINIBATCHES = dict(DECOUPLED, ppo_n_minibatches=STEPS)  # (one proximal pass for the run's steps)
MODES = {"coupled": {}, "coupled-dense": DENSE, "decoupled": DECOUPLED, "decoupled-value": DECOUPLED,
         "decoupled-value-minibatches": MINIBATCHES,
         "decoupled-value-minibatches-idle": MINIBATCHES}  # fmt: skip


def plain_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")


def distributed_rollouts(model):
    """30 rollouts in groups of 3, policy versions 0 and 1 mixed; the first group's prompt is much longer,
    so the lexicographic partition gives the ranks unequal sample counts (zero-weight rows pad the other)."""
    prompts = [40] + [6] * 9
    return synthetic_rollouts(21, model, TEMPERATURE, groups=10, per_group=3, versions=(0, 1), prompt=prompts)


def idle_rank_rollouts(samples):
    """``samples`` with, in each micro-batch of the second step (two groups of 3), the group whose tokens sort
    last left untrained (its completion mask zeroed): the lexicographic partition gives it to the last rank,
    which has no sample to train in that step (the worker records it) while the other rank trains."""
    per_batch, out = PER_RANK * RANKS, list(samples)
    for first in range(per_batch * ACCUMULATION, 2 * per_batch * ACCUMULATION, per_batch):
        groups = [out[first : first + 3], out[first + 3 : first + per_batch]]
        last = max(range(2), key=lambda g: groups[g][0].input_ids.tolist())
        for k, s in enumerate(groups[last], first + 3 * last):
            out[k] = rollout(s.input_ids, [0] * len(s.input_ids), s.old_log_probs, s.advantage,
                             version=s.model_version, group=s.group_id)  # fmt: skip
    return out


def make_critic(model_dir):
    """The policy's weights with a value head drawn from a fixed seed (non-trivial values from the start)."""
    critic = value_model_from(plain_model(model_dir))
    with torch.no_grad():
        critic.score.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(3))
    return critic


def make_trainer(out_dir: str, model_dir: str, mode: str, processes: int) -> AsyncTreePPOTrainer:
    """The run of ``mode`` on ``processes`` processes: every micro-batch holds ``PER_RANK * RANKS`` samples
    whatever the process count, so runs on one and on two processes train the same micro-batches."""
    sharded = {}
    if mode.endswith("-fsdp2"):
        mode = mode.removesuffix("-fsdp2")
        if processes > 1:  # (one process: the plain reference)
            from trl_dta.testing.cpu_distributed import process_state, trainer_settings

            process_state("fsdp2")
            sharded = trainer_settings("fsdp2")
    args = AsyncTreePPOConfig(
        output_dir=out_dir, per_device_train_batch_size=PER_RANK * RANKS // processes,
        gradient_accumulation_steps=ACCUMULATION, max_steps=STEPS, bf16=False, optim="sgd",
        **({"use_cpu": True} | sharded),
        learning_rate=LR, max_grad_norm=0.0, report_to=[], save_strategy="no", logging_steps=1,
        epsilon=EPSILON, epsilon_high=EPSILON_HIGH, temperature=TEMPERATURE, max_staleness=3,
        **{"tree_dense_fallback": "never", **MODES[mode]},  # (one process walks too, as two do)
    )  # fmt: skip
    samples = distributed_rollouts(plain_model(model_dir))
    if mode.endswith("-idle"):
        samples = idle_rank_rollouts(samples)
    return AsyncTreePPOTrainer(
        model_dir, args=args, processing_class=tiny_tokenizer(), train_dataset=make_dataset(2),
        rollout_worker=QueueWorker(samples),
        weight_transfer=NoWeightTransfer(),
        value_model=make_critic(model_dir) if "-value" in mode else None,
    )  # fmt: skip


def trained_state(trainer: AsyncTreePPOTrainer) -> dict:
    """The policy's parameters, the value model's (if any) and the log history, on the CPU."""

    def state(model) -> dict:  # (FSDP2: whole, from the shards)
        params = model.named_parameters()
        return {n: getattr(p, "full_tensor", p.detach)().detach().cpu().clone() for n, p in params}

    critic = trainer._critic.model if trainer._critic is not None else None

    def sharded(model) -> bool:
        return model is not None and all(type(p).__name__ == "DTensor" for p in model.parameters())

    return {
        "params": state(trainer.model),
        "critic": {} if critic is None else state(critic),
        "logs": trainer.state.log_history,
        "sharded": (sharded(trainer.model), sharded(critic)),
    }


def launch(out_dir: Path, model_dir, mode: str = "coupled") -> list[dict]:
    """Run this worker on RANKS processes (torchrun, gloo); each rank's :func:`trained_state`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(RANKS),
           str(Path(__file__)), str(out_dir), str(model_dir), mode]  # fmt: skip
    result = run_workers(cmd, env=env, timeout=300, cwd=out_dir)
    assert result.returncode == 0, result.stderr[-4000:]
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(RANKS)]


def main(out_dir: str, model_dir: str, mode: str = "coupled") -> None:
    trainer = make_trainer(out_dir, model_dir, mode, RANKS)
    trained, within = [], trainer._within_staleness  # (each training walk's samples on this rank)
    trainer._within_staleness = lambda samples: trained.append(len(samples)) or within(samples)
    trainer.train()
    state = {**trained_state(trainer), "trained_samples": trained}
    torch.save(state, f"{out_dir}/rank{trainer.accelerator.process_index}.pt")
    exit_worker()  # (trl_dta/testing/torchrun.py)


if __name__ == "__main__":
    main(*sys.argv[1:4])
