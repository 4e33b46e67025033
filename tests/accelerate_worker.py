"""One rank of a trainer run under accelerate's own multi-process preparation, on CPU (launched by
tests/test_accelerate_sharded.py with torchrun; or, with MODE ``stock``, one process of stock GRPOTrainer).

accelerate does not turn DeepSpeed or FSDP on without GPUs. As a *test device* (not a user setting), this
worker creates the process state itself before the trainer, with a gloo backend, and the trainer reuses it
(trl_dta/testing/cpu_distributed.py says how). From there on everything is accelerate's, TRL's and
DeepSpeed's own code: ``deepspeed.initialize`` or ``fsdp2_prepare_model`` (``fully_shard`` of the root,
embeddings, each layer, the norm and the LM head), TRL's reference-model preparation, saving and
checkpointing.

Usage: torchrun --nproc_per_node 2 tests/accelerate_worker.py OUT_DIR MODEL_DIR MODE VARIANT...
  MODE: stock (1 process, the whole global batch), zero2, zero3, fsdp2, fsdp2-per-layer, ddp
  VARIANT: plain, kl (beta > 0: the reference model prepared too), lora, save (save_model() at the end),
  resume (a checkpoint after step 1; a second trainer resumes from it)
Rank 0 writes OUT_DIR/MODE-VARIANT.pt: the final full parameters, their initial values, the logged grad
norms, the saved weights (save), the collectives per optimizer step.
"""

from __future__ import annotations

import glob
import os
import sys

import torch
import torch.distributed as dist

from trl_dta.testing.cpu_distributed import process_state, trainer_settings
from trl_dta.testing.torchrun import exit_worker

SETTINGS = dict(learning_rate=2.0, max_steps=2, num_iterations=2, gradient_accumulation_steps=2,
                per_device_train_batch_size=2, max_grad_norm=1.0)  # fmt: skip
VARIANTS = {
    "plain": {},
    "kl": {"beta": 0.1},
    "lora": {},
    "save": {},
    "resume": {"num_iterations": 1, "optim_args": "momentum=0.9"},
}
# ------------------------------------------------------------------------------------------------ counting
COUNTS: dict[str, int] = {}
PHASES: list[tuple[str, dict]] = []  # (walk-grad | walk-no-grad | flush, its collectives) in this step


def _count_collectives() -> None:
    """Count the collectives: torch.distributed's (FSDP2's, TRL's) and DeepSpeed's own (its communication
    backend, which calls torch.distributed's functions it looked up before this patch); a collective made
    inside another counted one is not counted again."""
    depth = [0]

    def counting(owner, name, key):
        original = getattr(owner, name)

        def wrapped(*args, **kwargs):
            if depth[0] == 0:
                COUNTS[key] = COUNTS.get(key, 0) + 1
            depth[0] += 1
            try:
                return original(*args, **kwargs)
            finally:
                depth[0] -= 1

        setattr(owner, name, wrapped)

    for name in ("all_gather_into_tensor", "all_gather", "reduce_scatter_tensor", "reduce_scatter",
                 "all_reduce", "broadcast", "all_gather_object", "barrier", "all_gather_single",
                 "reduce_scatter_single"):  # fmt: skip
        if hasattr(dist, name):  # (FSDP2 calls the last two, in torch 2.13)
            counting(dist, name, name)
    import torch.distributed.distributed_c10d as c10d

    for name in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_gather"):
        setattr(c10d, name, getattr(dist, name))
    from deepspeed.comm.torch import TorchBackend

    for name in ("all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor",
                 "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_base",
                 "all_gather_coalesced"):  # fmt: skip
        counting(TorchBackend, name, f"deepspeed.{name}")
    from trl_dta.walk.distributed import deepspeed as zero
    from trl_dta.walk.executor import TreeExecutor

    def phase(name, original):
        def wrapped(*args, **kwargs):
            before = dict(COUNTS)
            try:
                return original(*args, **kwargs)
            finally:
                label = name if name != "walk" else ("walk-grad" if kwargs["grad"] else "walk-no-grad")
                PHASES.append(
                    (label, {k: v - before.get(k, 0) for k, v in COUNTS.items() if v > before.get(k, 0)})
                )

        return wrapped

    TreeExecutor._walk = phase("walk", TreeExecutor._walk)
    zero.step_reduction.__exit__ = phase("flush", zero.step_reduction.__exit__)


# ------------------------------------------------------------------------------------------------ setup
def state_for(mode: str):
    """The process state the trainer will reuse (trl_dta/testing/cpu_distributed.py); None: stock, one plain
    process."""
    return None if mode == "stock" else process_state(mode)


def config_for(mode: str, variant: str, out: str, tree: bool):
    from trl import GRPOConfig

    from trl_dta import TreePPOConfig
    from trl_dta.testing.grpo import make_config

    settings = {**SETTINGS, **VARIANTS[variant]}
    if mode == "stock":  # one process sees the whole global batch
        settings["per_device_train_batch_size"] *= 2
    else:
        settings |= trainer_settings(mode)
    if variant == "resume":
        settings |= {"save_strategy": "steps", "save_steps": 1, "save_only_model": False}
    return make_config(out, config_cls=TreePPOConfig if tree else GRPOConfig, **settings)


def model_for(model_dir: str, variant: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_config = None
    if variant == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    return model, peft_config


def trainer_for(mode, variant, model_dir, out):
    from trl_dta import TreePPOTrainer
    from trl_dta.testing.grpo import ScriptedGenerationMixin, ScriptedGRPOTrainer, make_trainer

    tree = mode != "stock"
    if tree:  # a new trainer in this process: its accelerator configures DeepSpeed / FSDP anew
        state_for(mode)
    cls = type("TreeScripted", (ScriptedGenerationMixin, TreePPOTrainer), {}) if tree else ScriptedGRPOTrainer
    config = config_for(mode, variant, out, tree)
    model, peft_config = model_for(model_dir, variant)
    if peft_config is not None:
        torch.manual_seed(0)  # (init_lora_weights=False draws the adapters: the same on every rank and run)
    return make_trainer(cls, config, model=model, peft_config=peft_config)


def full_parameters(trainer) -> dict[str, torch.Tensor]:
    """The policy's trainable parameters, whole (ZeRO-3: gathered; FSDP2: full_tensor), by PEFT-free name."""
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if any(hasattr(p, "ds_id") for _, p in params):
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in params]):
            return {_name(n): p.detach().clone() for n, p in params}
    return {_name(n): getattr(p, "full_tensor", p.detach)().detach().clone() for n, p in params}


def _name(n: str) -> str:
    return n.replace("base_model.model.", "").replace("_fsdp_wrapped_module.", "")


def grad_norms(trainer) -> list[float]:
    return [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]


def saved_weights(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        weights |= load_file(f)
    return {_name(n).replace(".default", ""): w for n, w in weights.items()}


def run(mode: str, variant: str, model_dir: str, out_dir: str) -> dict:
    out = os.path.join(out_dir, f"run-{mode}-{variant}")
    trainer = trainer_for(mode, variant, model_dir, out)
    steps = []

    from transformers import TrainerCallback

    class Counter(TrainerCallback):  # collectives per optimizer step: all, and those of each walk and flush
        def on_step_begin(self, *a, **k):
            COUNTS.clear()
            PHASES.clear()

        def on_step_end(self, *a, **k):
            steps.append({"all": dict(COUNTS), "phases": list(PHASES)})

    trainer.add_callback(Counter())
    initial = full_parameters_unwrapped(trainer)
    trainer.train()
    result = {"final": full_parameters(trainer), "initial": initial, "grad_norms": grad_norms(trainer),
              "collectives": steps, "distributed_type": str(trainer.accelerator.distributed_type),
              "world": trainer.accelerator.num_processes}  # fmt: skip
    if variant == "save":
        trainer.save_model(os.path.join(out, "saved"))
        result["saved"] = saved_weights(os.path.join(out, "saved"))
    if variant == "resume":
        checkpoint = os.path.join(out, "checkpoint-1")
        resumed = trainer_for(mode, variant, model_dir, out + "-resumed")
        resumed.train(resume_from_checkpoint=checkpoint)
        result["resumed"] = full_parameters(resumed)
    if mode != "stock":
        result["sharded"] = describe_sharding(trainer)
    return result


def full_parameters_unwrapped(trainer) -> dict[str, torch.Tensor]:
    """The trainable parameters before training (nothing is wrapped yet; under ZeRO-3, zero.Init has
    partitioned them already)."""
    params = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]
    if any(hasattr(p, "ds_id") for _, p in params):
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in params]):
            return {_name(n): p.detach().clone() for n, p in params}
    return {_name(n): p.detach().clone() for n, p in params}


def describe_sharding(trainer) -> dict:
    """What the preparation did: FSDP2's units, ZeRO-3's partitioned parameters, the reference model's."""
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    from trl_dta.walk.distributed.sharding import fsdp_units

    info = {
        "fsdp_units": [type(u).__name__ for u in fsdp_units(model)],
        "dtensors": sum(type(p).__name__ == "DTensor" for p in model.parameters()),
        "zero3_partitioned": sum(
            hasattr(p, "ds_id") and p.data.numel() < p.ds_numel for p in model.parameters()
        ),
        "engine": type(trainer.model_wrapped).__name__,
        "parameters": sum(1 for _ in model.parameters()),
    }
    if trainer.ref_model is not None:
        ref = trainer.accelerator.unwrap_model(trainer.ref_model)
        info["ref_engine"] = type(trainer.ref_model).__name__
        info["ref_partitioned"] = sum(
            hasattr(p, "ds_id") and p.data.numel() < p.ds_numel for p in ref.parameters()
        )
        info["ref_dtensors"] = sum(type(p).__name__ == "DTensor" for p in ref.parameters())
    return info


def main(out_dir, model_dir, mode, *variants):
    torch.set_num_threads(1)
    state_for(mode)
    _count_collectives()
    rank = int(os.environ.get("RANK", 0))
    for variant in variants:
        result = run(mode, variant, model_dir, out_dir)
        if rank == 0:
            torch.save(result, os.path.join(out_dir, f"{mode}-{variant}.pt"))
    exit_worker()  # (trl_dta/testing/torchrun.py)


if __name__ == "__main__":
    main(*sys.argv[1:])
