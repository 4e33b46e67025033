"""A test device: accelerate's own DeepSpeed and FSDP2 preparation on CPU processes (gloo), for tests and
benchmarks. Not a user setting: on GPUs, ``accelerate launch --config_file recipes/accelerate_configs/...``.

accelerate does not turn DeepSpeed or FSDP on without GPUs (with ``use_cpu`` it runs DDP; without a GPU
backend it counts one process per rank). Creating the process state before the trainer, with a gloo backend,
and having the trainer reuse it, makes it prepare them anyway:

* ``PartialState(backend="gloo")`` in each process started by ``torchrun``;
* DeepSpeed: ``ACCELERATE_USE_DEEPSPEED=true`` first (DeepSpeed's CPU accelerator falls back to gloo when the
  oneCCL bindings are absent);
* FSDP2: ``state.distributed_type = DistributedType.MULTI_GPU`` (accelerate then turns it into FSDP; the
  device stays CPU);
* the trainer's arguments: ``use_cpu=False``, ``accelerator_config={"use_configured_state": True}`` and the
  DeepSpeed config or FSDP2 options (:func:`trainer_settings`).

From there on the preparation (``deepspeed.initialize``; ``fsdp2_prepare_model``, which shards the root, the
embeddings, each decoder layer, the final norm and the LM head), TRL's reference-model preparation, saving and
checkpointing are accelerate's, TRL's and DeepSpeed's own code.
"""

from __future__ import annotations

import os

MODES = ("ddp", "fsdp2", "fsdp2-per-layer", "zero2", "zero3")

_DEEPSPEED = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": False},
    "fp16": {"enabled": False},
}
_FSDP2 = {
    "fsdp_version": 2,
    "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
    "reshard_after_forward": True,
    "state_dict_type": "FULL_STATE_DICT",
    "cpu_ram_efficient_loading": False,
}


def deepspeed_config(stage: int) -> dict:
    """A fp32 DeepSpeed config of ZeRO ``stage``; the rest ("auto") comes from the trainer's arguments."""
    zero = {"stage": stage}
    if stage == 3:  # tiny models partition only with a zero persistence threshold
        zero |= {"stage3_param_persistence_threshold": 0, "stage3_gather_16bit_weights_on_model_save": True}
    return {**_DEEPSPEED, "zero_optimization": zero}


def process_state(mode: str):
    """The process state a trainer of ``mode`` reuses (module docstring); call it before each new trainer in
    the same process (the previous trainer's accelerator is forgotten). ``ddp``: None, no trick is needed
    (``torchrun`` and ``use_cpu=True`` give accelerate's MULTI_CPU data parallel)."""
    from accelerate import PartialState
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "ddp":
        return None
    AcceleratorState._reset_state(reset_partial_state=False)  # (a second trainer configures its own)
    if mode.startswith("zero"):
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    state = PartialState(backend="gloo")
    if mode.startswith("fsdp2"):  # (again for a later trainer: the last one made the shared state FSDP)
        state.distributed_type = DistributedType.MULTI_GPU
    return state


def trainer_settings(mode: str) -> dict:
    """The TrainingArguments / GRPOConfig fields of ``mode`` (with :func:`process_state` called first)."""
    if mode == "ddp":
        return {"use_cpu": True}
    settings = {"use_cpu": False, "accelerator_config": {"use_configured_state": True}}
    if mode.startswith("zero"):
        settings["deepspeed"] = deepspeed_config(int(mode[-1]))
    if mode.startswith("fsdp2"):
        settings |= {"fsdp": "full_shard", "fsdp_config": dict(_FSDP2)}
    if mode == "fsdp2-per-layer":
        settings["tree_gather_per_layer"] = True
    return settings
