"""One rank of a multi-process TreePPOTrainer run (launched by tests/test_distributed.py with torchrun).

Usage: torchrun --nproc_per_node 2 tests/dist_worker.py OUT_DIR MODEL_DIR LOSS_TYPE
Saves this rank's per-step gradients (taken just before the optimizer step) to OUT_DIR/rank{RANK}.pt. With
``VALUE_MODEL=1`` in the environment, the tree trainer has a value model (warm-started from the policy, its
head seeded; ``VALUE_LORA=1``: a LoRA of it) and the value model's gradients are saved too, with the
collectives of each of its walks; ``RESUME=1``: a checkpoint after step 1 that a new trainer resumes from,
both runs' final parameters saved. ``DENSE_FALLBACK``: the tree trainer's ``tree_dense_fallback`` (else the
fixtures' "never"); each training step's decision is saved (this rank's prediction, the path taken).
``MODE``: ``ddp`` (the default), or ``fsdp2`` / ``fsdp2-per-layer`` (accelerate's FSDP2 preparation on CPU
processes, trl_dta/testing/cpu_distributed.py: the policy and the value model sharded).
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch
from trl import GRPOConfig, GRPOTrainer

from trl_dta import TreePPOConfig, TreePPOTrainer
from trl_dta.testing.cpu_distributed import process_state, trainer_settings
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


GATHERS = ("all_gather_into_tensor", "all_gather_single")
REDUCTIONS = ("reduce_scatter_tensor", "reduce_scatter_single")  # (FSDP2's gradients; not the all_reduces the
# walk's ranks agree with)
# DeepSpeed's own communication backend (which calls torch.distributed's functions it looked up before)
DS_GATHERS = ("all_gather_into_tensor", "all_gather", "all_gather_base", "all_gather_coalesced")
DS_REDUCTIONS = ("all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor")
COUNTS: dict[str, int] = {}


def _count_collectives() -> None:
    """Count torch.distributed's gathers and reductions (FSDP2's among them) in :data:`COUNTS`."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    for name in GATHERS + REDUCTIONS:
        if hasattr(dist, name):
            original = getattr(dist, name)

            def counted(*args, _original=original, _name=name, **kwargs):
                COUNTS[_name] = COUNTS.get(_name, 0) + 1
                return _original(*args, **kwargs)

            setattr(dist, name, counted)
            if hasattr(c10d, name):
                setattr(c10d, name, counted)
    try:
        from deepspeed.comm.torch import TorchBackend
    except ImportError:  # pragma: no cover - the deepspeed extra
        return
    for name in DS_GATHERS + DS_REDUCTIONS:
        original = getattr(TorchBackend, name)

        def counted(*args, _original=original, _name=f"deepspeed.{name}", **kwargs):
            COUNTS[_name] = COUNTS.get(_name, 0) + 1
            return _original(*args, **kwargs)

        setattr(TorchBackend, name, counted)


def _phases(critic, phases: list) -> None:
    """Record the collectives of each of the value model's walks: ``(grad, gathers, reductions)``."""

    def counted(method, grad):
        def run(*args, **kwargs):
            before = dict(COUNTS)
            try:
                return method(*args, **kwargs)
            finally:
                delta = {k: v - before.get(k, 0) for k, v in COUNTS.items()}
                if any(k.startswith("deepspeed.") for k in COUNTS):  # (DeepSpeed's: its backend's calls)
                    gathers, reductions = (
                        tuple(f"deepspeed.{n}" for n in ns) for ns in (DS_GATHERS, DS_REDUCTIONS)
                    )
                else:
                    gathers, reductions = GATHERS, REDUCTIONS
                phases.append(
                    (grad, *(sum(delta.get(k, 0) for k in names) for names in (gathers, reductions)))
                )

        return run

    critic.values, critic.backward = counted(critic.values, False), counted(critic.backward, True)


def _critic(model_dir):
    """A value model warm-started from the policy, its head seeded."""
    from transformers import AutoModelForCausalLM

    from trl_dta import value_model_from

    critic = value_model_from(AutoModelForCausalLM.from_pretrained(model_dir))
    whole = contextlib.nullcontext()
    if hasattr(critic.score.weight, "ds_id"):  # (ZeRO-3: built under zero.Init, partitioned)
        import deepspeed

        whole = deepspeed.zero.GatheredParameters([critic.score.weight], modifier_rank=0)
    with torch.no_grad(), whole:
        critic.score.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(3))
    if os.environ.get("VALUE_LORA") == "1":  # (its adapters drawn the same on every rank and run)
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(5)
        lora = LoraConfig(task_type="TOKEN_CLS", r=4, lora_alpha=8, init_lora_weights=False,
                          target_modules=["q_proj", "v_proj", "down_proj"])  # fmt: skip
        critic = get_peft_model(critic, lora)
    return critic


def _whole(trainer) -> dict:
    """The policy's and the value model's parameters, whole (FSDP2: from the shards; ZeRO-3: gathered), by
    name."""
    policy = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    out = {}
    for kind, model in {"policy": policy, "value": trainer._critic.model}.items():
        params = list(model.named_parameters())
        gathered = contextlib.nullcontext()
        if any(hasattr(p, "ds_id") for _, p in params):
            import deepspeed

            gathered = deepspeed.zero.GatheredParameters([p for _, p in params])
        with gathered:
            out |= {f"{kind}.{n}": getattr(p, "full_tensor", p.detach)().detach().clone() for n, p in params}
    return out


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
    mode, resume = os.environ.get("MODE", "ddp"), os.environ.get("RESUME") == "1"
    if resume:  # a checkpoint after step 1 (SGD with momentum: its state must be restored too)
        batch |= {
            "save_strategy": "steps",
            "save_steps": 1,
            "save_only_model": False,
            "optim_args": "momentum=0.9",
            "num_iterations": 1,  # (a step's generation not split across the checkpoint)
        }
    if mode != "ddp" and int(os.environ.get("WORLD_SIZE", 1)) > 1:
        process_state(mode)
        batch |= trainer_settings(mode)
        _count_collectives()
    if tree and os.environ.get("VALUE_MODEL") == "1":
        batch["lam"] = 0.95  # (GAE with lambda < 1; the value loss clipped at cliprange_value's 0.2)
    recorder = GradRecorder()
    config = make_config(
        os.path.join(out_dir, "run" if resume else f"run{rank}"),  # (resume: one checkpoint for all ranks)
        config_cls=TreePPOConfig if tree else GRPOConfig,
        loss_type=loss_type,
        **({k: v for k, v in batch.items() if tree or not k.startswith("tree_")}),
    )
    extra, value_grads, decisions, phases = {}, [], [], []
    if os.environ.get("VALUE_MODEL") == "1":
        extra["value_model"] = _critic(model_dir)
    t = make_trainer(cls, config, model=model_dir, callbacks=[recorder], dataset=unequal_dataset(), **extra)
    if extra:
        step = t._critic.step

        def recorded_step():
            model = t._critic.model  # (FSDP2: whole gradients, from the shards)
            named = [
                (n, p.grad) for n, p in model.named_parameters() if p.grad is not None
            ]  # (LoRA: trained)
            grads = {n: getattr(g, "full_tensor", g.detach)() for n, g in named}
            value_grads.append({n: g.detach().clone() for n, g in grads.items()})
            return step()

        t._critic.step = recorded_step
        _phases(t._critic, phases)
    if tree:  # each training step's decision: this rank's prediction and the path taken
        prefer_dense = t._walker.prefer_dense

        def recorded(*args, timed=True, **kwargs):
            dense = prefer_dense(*args, timed=timed, **kwargs)
            if timed:
                prediction = t._walker.prediction  # (plain floats: torch.load's weights_only)
                decisions.append(((prediction.step_s, prediction.dense_s), dense))
            return dense

        t._walker.prefer_dense = recorded
    initial = _whole(t) if extra and os.environ.get("FINAL") == "1" else None
    t.train()
    saved = {"grads": recorder.grads, "rows": rows, "value_grads": value_grads, "decisions": decisions,
             "value_phases": phases}  # fmt: skip
    if extra:
        from trl_dta.walk.distributed.sharding import fsdp_units

        critic = t._critic.model
        saved["value_units"] = len([u for u in fsdp_units(critic) if any(True for _ in u.parameters())])
        saved["value_dtensors"] = sum(type(p).__name__ == "DTensor" for p in critic.parameters())
        saved["value_parameters"] = sum(1 for _ in critic.parameters())
    if initial is not None:  # (the parameters' updates, where gradients are not left in .grad: DeepSpeed)
        saved["updates"] = {n: p - initial[n] for n, p in _whole(t).items()}
        saved["value_engine"] = type(t._critic.engine).__name__  # (DeepSpeed: its own engine)
        saved["value_zero3"] = sum(hasattr(p, "ds_id") for p in t._critic.model.parameters())
    if resume:  # the run resumed from its step-1 checkpoint, by a new trainer
        saved["final"] = _whole(t)
        if mode != "ddp" and int(os.environ.get("WORLD_SIZE", 1)) > 1:
            process_state(mode)
        config.output_dir = os.path.join(out_dir, "resumed")
        again = make_trainer(
            cls, config, model=model_dir, dataset=unequal_dataset(), value_model=_critic(model_dir)
        )
        again.train(resume_from_checkpoint=os.path.join(out_dir, "run", "checkpoint-1"))
        saved["resumed"] = _whole(again)
    torch.save(saved, os.path.join(out_dir, f"{trainer}{rank}.pt"))
    exit_worker()  # (trl_dta/testing/torchrun.py)


if __name__ == "__main__":
    main(*sys.argv[1:])
