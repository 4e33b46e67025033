"""Where one TreePPOTrainer step spends its time, on the offline fixture of ``trl_dta/testing/grpo.py``
(scripted generation: no sampling, TRL's tool loop and rewards run). Needs TRL, imported only when it runs
(the GPU machine has none and never runs it)."""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

PARTS = ("step", "generate", "logprob", "walk", "train_step", "optimizer")  # what is clocked, per step
# model sizes: the quick profile's tiny Qwen3, else the shape of the "cpu" profile's model
QUICK_SIZE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
CPU_SIZE = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
}


def trainer_breakdown(steps: int, quick: bool) -> dict:
    """Per-step seconds of: generation + scoring (minus the no-grad tree log-prob pass inside it), that pass,
    the walk (forward + backward of the loss), TRL's loss and the rest of ``training_step``, the optimizer,
    the rest of the step."""
    from trl_dta import TreePPOConfig
    from trl_dta.testing.grpo import make_config, make_trainer, tiny_model

    times: dict[str, list[float]] = {k: [] for k in PARTS}
    config = make_config(
        config_cls=TreePPOConfig,
        per_device_train_batch_size=8,
        num_generations=8,
        num_iterations=2,
        max_steps=steps,
        max_completion_length=256,
        optim="adamw_torch",
        learning_rate=1e-5,
    )
    model = tiny_model(**(QUICK_SIZE if quick else CPU_SIZE))
    trainer = make_trainer(
        _timed_trainer(times), config, model=model, callbacks=[_clock(times)], num_prompts=steps
    )
    torch.manual_seed(0)
    trainer.train()
    return _summary(times, steps, trainer.state.log_history)


def _timed_trainer(times: dict[str, list[float]]) -> type:
    """A scripted TreePPOTrainer that adds its generation, log-prob pass, training step and walk times to the
    last entry of ``times``' lists."""
    from trl_dta import TreePPOTrainer
    from trl_dta.testing.grpo import ScriptedGenerationMixin

    class Timed(ScriptedGenerationMixin, TreePPOTrainer):
        scripted_record = False

        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            times["generate"][-1] += time.perf_counter() - t0
            return out

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            # clocked: TRL's no-grad log-prob pass (a tree walk); not its loss reading the walk's values
            no_grad = not torch.is_grad_enabled()
            t0 = time.perf_counter()
            out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
            if no_grad:
                times["logprob"][-1] += time.perf_counter() - t0
            return out

        def training_step(self, *args, **kwargs):
            t0 = time.perf_counter()
            out = super().training_step(*args, **kwargs)
            times["train_step"][-1] += time.perf_counter() - t0
            times["walk"][-1] += self._metrics["train"]["tree/time_s"][-1]
            return out

    return Timed


def _clock(times: dict[str, list[float]]):
    """A callback that opens a new entry in every list of ``times`` per step, and clocks the step and the
    optimizer."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            for v in times.values():
                v.append(0.0)
            self.t_step = time.perf_counter()

        def on_pre_optimizer_step(self, *a, **k):
            self.t_opt = time.perf_counter()

        def on_optimizer_step(self, *a, **k):
            times["optimizer"][-1] += time.perf_counter() - self.t_opt

        def on_step_end(self, *a, **k):
            times["step"][-1] += time.perf_counter() - self.t_step

    return Clock()


def _summary(times: dict[str, list[float]], steps: int, log_history: list[dict]) -> dict:
    # num_iterations=2: a generation every second step. Drop the first generation cycle (warm-up: the
    # executor's probe, first allocations) and average the rest: per-step costs, generation amortised.
    keep = slice(2, None) if steps >= 4 else slice(None)
    mean = {k: statistics.mean(v[keep]) for k, v in times.items()}
    parts = {
        "generation": mean["generate"] - mean["logprob"],
        "old_logprob_pass": mean["logprob"],
        "walk": mean["walk"],
        "trl_loss_and_rest": mean["train_step"] - mean["generate"] - mean["walk"],
        "optimizer": mean["optimizer"],
        "other": mean["step"] - mean["train_step"] - mean["optimizer"],
    }
    dedup = [float(h["tree/dedup_ratio"]) for h in log_history if "tree/dedup_ratio" in h]
    return {
        "steps": steps,
        "steps_averaged": len(times["step"][keep]),
        "step_s": mean["step"],
        "parts_s": parts,
        "raw": times,
        "dedup_ratio": float(np.mean(dedup)) if dedup else None,
    }
