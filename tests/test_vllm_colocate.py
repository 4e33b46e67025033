"""TreePPOTrainer with the real vLLM engine on CPU, colocate mode, against stock GRPOTrainer.

Each case runs in a subprocess (colocate mode initialises ``torch.distributed`` in the calling process): this
file's ``__main__`` trains stock ``GRPOTrainer`` (with :class:`trl_dta.vllm.VLLMMixin`, which only makes the
CPU engine run in the policy's dtype and sync through ``reload_weights``: stock TRL's sync fails on this
backend), then ``TreePPOTrainer``, each on the tiny Qwen3 saved to disk (head_dim 32, tied LM head), fp32,
SGD, the same seed and config, and writes what the test compares:

* the rollouts vLLM sampled (equal: same engine seed, same weights up to fp32 rounding);
* the accumulated gradients of every optimizer step (<= 1e-4 relative, max|diff| / max|ref| per tensor);
* after every step, the engine's log-probs of a fixed sequence against the trained model's (LoRA: the PEFT
  model, whose adapters TRL merges for the engine): the weights are synced, and they moved.

Cases: full fine-tuning, LoRA, the importance-sampling correction, ``num_iterations`` 2, and multi-turn
tool rollouts through ``tools=`` and through ``environment_factory``.

Needs vLLM (``make venv-vllm``; ``make test-vllm`` runs this file); skipped where it is not installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("vllm")

import torch  # noqa: E402

from trl_dta.compare import relative_error  # noqa: E402
from trl_dta.testing.vllm import engine_env  # noqa: E402

TOLERANCE = 1e-4  # fp32 gradients, walk vs dense (relative, per tensor)
SYNC_TOLERANCE = 1e-4  # engine vs trained model, log-probs (absolute; measured ~3e-6)
CASE_TIMEOUT = 600  # seconds per case (both trainers, engine start-ups included); measured ~40-90 s

# One tool call, or an answer: the turn vLLM's structured outputs make the random tiny model emit, so that
# TRL's tool loop runs (the call is parsed, executed, its result appended, the next turn generated).
TOOL_TURN = (
    r'(Let me check\.\n<tool_call>\n\{"name": "get_order_status", '
    r'"arguments": \{"order_id": "[A-H][1-9][0-9]"\}\}\n</tool_call>|Done for order [A-H][1-9][0-9]\.)'
)

CASES = {
    "full": {},
    "lora": {"lora": True},
    # top_k: vLLM's processed log-probs are renormalised over the top 50 tokens, so the importance-sampling
    # ratios are far from 1 (and the correction changes the loss)
    "importance_sampling": {
        "config": {
            "vllm_importance_sampling_correction": True,
            "vllm_importance_sampling_mode": "token_truncate",
            "top_k": 50,
        }
    },
    "iterations": {"config": {"num_iterations": 2}, "steps": 4},
    "tools": {
        "tools": True,
        "config": {
            "vllm_structured_outputs_regex": TOOL_TURN,
            "max_tool_calling_iterations": 2,
            "max_completion_length": 192,
        },
    },
    "environment": {  # the same turns through environment_factory (OrderDesk), which also owns a reward
        "environment": True,
        "config": {
            "vllm_structured_outputs_regex": TOOL_TURN,
            "max_tool_calling_iterations": 2,
            "max_completion_length": 192,
        },
    },
}


class OrderDesk:
    """An environment for TRL's ``environment_factory``: one instance per rollout, its public methods are the
    tools, ``get_reward`` a reward of its own (how many look-ups the rollout made)."""

    def reset(self, **row) -> None:
        self.lookups = 0

    def get_order_status(self, order_id: str) -> str:
        """Look up the shipping status of an order.

        Args:
            order_id: The identifier of the order to look up.

        Returns:
            A one-line status report.
        """
        from trl_dta.testing.grpo import get_order_status

        self.lookups += 1
        return get_order_status(order_id)

    def get_reward(self) -> float:
        return 0.5 * self.lookups


# ------------------------------------------------------------------------------------------------ the test
@pytest.mark.parametrize("case", list(CASES))
def test_colocate_matches_stock(case, tmp_path):
    proc = subprocess.run(
        [sys.executable, __file__, case, str(tmp_path)],
        env=engine_env(),
        capture_output=True,
        text=True,
        timeout=CASE_TIMEOUT,
    )
    assert proc.returncode == 0, f"case {case} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    stock = torch.load(tmp_path / "stock.pt", weights_only=False)
    tree = torch.load(tmp_path / "tree.pt", weights_only=False)
    steps = CASES[case].get("steps", 3)

    # the same rollouts, sampled by the engine
    assert len(stock["rollouts"]) == len(tree["rollouts"]) >= 1
    for a, b in zip(stock["rollouts"], tree["rollouts"], strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), f"rollouts differ in {key}"

    # the gradients of every optimizer step
    assert len(stock["grads"]) == len(tree["grads"]) == steps
    for step, (ref, got) in enumerate(zip(stock["grads"], tree["grads"], strict=True)):
        assert ref.keys() == got.keys() and ref
        for name in ref:
            err = relative_error(got[name], ref[name])
            assert err <= TOLERANCE, f"step {step + 1}, {name}: relative error {err:.3g}"

    # the engine holds the trained weights after every step, and they moved
    for run in (stock, tree):
        assert len(run["sync_errors"]) == steps
        assert max(run["sync_errors"]) <= SYNC_TOLERANCE, run["sync_errors"]
        assert min(run["sync_changes"]) >= 100 * SYNC_TOLERANCE, run["sync_changes"]

    # item 5's metrics: the walk's and the step's time every step, the generation's at each generation
    logs = [entry for entry in tree["log_history"] if "loss" in entry]
    assert all("tree/time_s" in e and "step_time" in e for e in logs)
    assert sum("perf/generation_s" in e for e in logs) == len(tree["rollouts"])
    if case == "lora":
        assert all(".lora_" in name for name in tree["grads"][0]), "only the adapters train"
    if case == "importance_sampling":
        key = "sampling/importance_sampling_ratio/mean"
        ratios = [e[key] for e in logs if key in e]
        assert ratios and max(ratios) < 0.95, ratios  # the correction changes the loss
    if case in ("tools", "environment"):
        masks = [r["tool_mask"] for r in tree["rollouts"]]
        assert any(bool((m == 0).any()) for m in masks), "no tool result in any rollout"


# ------------------------------------------------------------------------------------------------ the run
def _run(case: str, out: Path) -> None:
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from trl_dta import TreePPOConfig, TreePPOTrainer
    from trl_dta.testing.grpo import TOOLS, GradRecorder, make_config, make_dataset, reward_fn, tiny_tokenizer
    from trl_dta.testing.vllm import WeightSyncCheck, fixed_sequence, save_tiny_model
    from trl_dta.vllm import VLLMMixin

    spec = CASES[case]
    directory = save_tiny_model(out / "model")

    class Recorded:
        """Keeps the rollouts of each generation batch (what the engine sampled)."""

        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            keys = ("prompt_ids", "completion_ids", "completion_mask", "tool_mask")
            self.rollouts.append({k: output[k].detach().clone() for k in keys if k in output})
            return output

    class Stock(Recorded, VLLMMixin, GRPOTrainer):
        rollouts: list

    class Tree(Recorded, TreePPOTrainer):
        rollouts: list

    for name, trainer_cls, config_cls in (("stock", Stock, GRPOConfig), ("tree", Tree, TreePPOConfig)):
        overrides = dict(
            use_vllm=True,
            vllm_mode="colocate",
            vllm_gpu_memory_utilization=0.05,  # (CPU: the KV cache is VLLM_CPU_KVCACHE_SPACE, engine_env)
            vllm_max_model_length=1024,
            vllm_importance_sampling_correction=False,
            max_steps=spec.get("steps", 3),
            num_iterations=1,
            gradient_accumulation_steps=2,  # 8 rollouts (2 prompts x 4) per generation, 2 micro-batches
            max_completion_length=24,
            learning_rate=0.1,
        )
        overrides.update(spec.get("config", {}))
        config = make_config(out / name, config_cls=config_cls, **overrides)
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        lora = None
        if spec.get("lora"):  # random B: the adapters change the model from the first step on
            lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                              init_lora_weights=False)  # fmt: skip
        grads, check = GradRecorder(), WeightSyncCheck(fixed_sequence())
        trainer = trainer_cls(
            model=model,
            reward_funcs=reward_fn,
            args=config,
            train_dataset=make_dataset(2),
            processing_class=tiny_tokenizer(),
            callbacks=[grads, check],
            peft_config=lora,
            tools=list(TOOLS) if spec.get("tools") else None,
            environment_factory=OrderDesk if spec.get("environment") else None,
        )
        trainer.rollouts = []
        check.trainer = trainer
        trainer.train()
        torch.save(
            {
                "grads": grads.grads,
                "rollouts": trainer.rollouts,
                "sync_errors": check.errors,
                "sync_changes": check.changes,
                "log_history": trainer.state.log_history,
            },
            out / f"{name}.pt",
        )
        print(
            name, json.dumps({"sync_errors": check.errors, "log": trainer.state.log_history[-2]}), flush=True
        )
        del trainer


if __name__ == "__main__":
    _run(sys.argv[1], Path(sys.argv[2]))
    sys.stdout.flush()
    os._exit(0)  # (vLLM's engine threads may hold the interpreter at exit)
