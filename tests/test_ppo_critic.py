"""TreePPOTrainer with a value model against a dense PPO step on the same rollouts, in float32: the policy's
gradients against TRL's own ``_compute_loss`` (its dense forward) with the same per-token advantages, the
value model's against a per-sequence dense critic step written here; the old values and advantages against a
dense forward and an independent GAE loop."""

from __future__ import annotations

import pytest
import torch
from conftest import max_rel_diff
from test_ppo_values import reference_gae
from transformers import TrainerCallback

from trl_dta import TreePPOConfig, TreePPOTrainer, value_model_from
from trl_dta.testing.grpo import (
    ScriptedGenerationMixin,
    make_config,
    make_trainer,
    tiny_model,
    tiny_tokenizer,
)
from trl_dta.train.ppo_rows import batch_rows

TreeScripted = type("TreeScripted", (ScriptedGenerationMixin, TreePPOTrainer), {})
TOL = 1e-4
GA2 = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2, num_iterations=2)


class Recorder(TrainerCallback):
    """Per optimizer step: both models' weights at its start, and (just before the policy's optimizer step)
    the policy's and the value model's gradients."""

    def __init__(self):
        self.weights, self.policy_grads, self.value_grads = [], [], []

    def attach(self, trainer):
        self.trainer = trainer
        critic = trainer._critic
        step = critic.step

        def recorded_step():
            self.value_grads.append(_grads(critic.model))
            return step()

        critic.step = recorded_step

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        states = (self.trainer.model.state_dict(), self.trainer._critic.model.state_dict())
        self.weights.append(tuple({k: v.detach().clone() for k, v in s.items()} for s in states))

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.policy_grads.append(_grads(model))


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def train(tmp_path, policy_lora=False, critic_lora=False, **overrides):
    tokenizer = tiny_tokenizer()
    policy = tiny_model(tokenizer)
    critic = value_model_from(policy)
    with torch.no_grad():  # a head that is not zero: the first values (and advantages) are not trivial
        critic.score.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(3))
    peft_config = None
    if policy_lora or critic_lora:
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "v_proj", "down_proj"]
        lora = dict(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
        peft_config = LoraConfig(**lora) if policy_lora else None
        if critic_lora:
            torch.manual_seed(5)
            critic = get_peft_model(critic, LoraConfig(task_type="TOKEN_CLS", **lora))
    recorder = Recorder()
    config = make_config(tmp_path, TreePPOConfig, **{**GA2, **overrides})
    trainer = make_trainer(TreeScripted, config, model=policy, value_model=critic, peft_config=peft_config,
                           callbacks=[recorder])  # fmt: skip
    recorder.attach(trainer)
    trainer.train()
    return trainer, recorder


def dense_values(critic, rows):
    """Each row's values at its completion positions by a dense forward of the row alone."""
    out = []
    for row in rows:
        ids = torch.tensor([row.tokens])
        logits = critic(input_ids=ids).logits[0, :, 0]
        out.append(logits[row.prompt_length - 1 : row.prompt_length - 1 + row.completion_length])
    return out


def dense_value_loss(critic, inputs, norm, cliprange):
    """The micro-batch's clipped value loss, per sequence, dense: ``0.5 max((v - R)^2, (clip(v) - R)^2)`` on
    each policy token, summed, over ``norm``."""
    mask = inputs["completion_mask"] * inputs.get("tool_mask", torch.ones_like(inputs["completion_mask"]))
    total = 0.0
    for i, values in enumerate(dense_values(critic, batch_rows(inputs))):
        n = values.shape[0]
        old, returns, m = inputs["old_values"][i, :n], inputs["returns"][i, :n], mask[i, :n]
        clipped = old + torch.clamp(values - old, -cliprange, cliprange)
        per_token = 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
        total = total + (per_token * m).sum()
    return total / norm


def assert_dense_ppo(trainer, recorder, cliprange=0.2):
    policy, critic = trainer.model, trainer._critic.model
    args = trainer.args
    (generation,) = trainer.generation_batches  # one generation batch, used for both steps
    mask = generation["completion_mask"] * generation["tool_mask"]
    tokens = float(mask.sum())
    # old values: the value model at the start, densely; advantages: an independent GAE loop, whitened
    critic.load_state_dict(recorder.weights[0][1])
    with torch.no_grad():
        values = dense_values(critic, batch_rows(generation))
    old = torch.zeros_like(generation["old_values"])
    for i, v in enumerate(values):
        old[i, : v.numel()] = v
    assert (old * mask - generation["old_values"]).abs().max() <= 1e-5
    rewards = torch.zeros_like(old, dtype=torch.float64)
    for i, reward in enumerate(trainer._rewards_per_func.sum(dim=1)):
        last = mask[i].nonzero()[-1]
        rewards[i, last] = float(reward)
    advantages, returns = reference_gae(old.double() * mask, rewards, mask, args.gamma, args.lam)
    on = mask.bool()
    whitened = (advantages - advantages[on].mean()) / (advantages[on].std(unbiased=False) + 1e-8) * mask
    assert (generation["returns"] - returns).abs().max() <= 1e-5
    assert (generation["advantages"] - whitened).abs().max() <= 1e-5
    # each step: TRL's dense loss for the policy, the dense critic step, on that step's micro-batches
    per_step = args.gradient_accumulation_steps
    for step, (policy_state, critic_state) in enumerate(recorder.weights):
        policy.load_state_dict(policy_state)
        critic.load_state_dict(critic_state)
        policy.zero_grad()
        critic.zero_grad()
        for inputs in trainer.step_inputs[step * per_step : (step + 1) * per_step]:
            trainer.dense_loss(policy, inputs).backward()
            norm = tokens * per_step / args.steps_per_generation
            dense_value_loss(critic, inputs, norm, cliprange).backward()
        assert max_rel_diff(recorder.policy_grads[step], _grads(policy)) <= TOL, f"policy, step {step}"
        assert max_rel_diff(recorder.value_grads[step], _grads(critic)) <= TOL, f"value model, step {step}"


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_policy_and_value_gradients_equal_a_dense_ppo_step(tmp_path, loss_type):
    trainer, recorder = train(tmp_path, loss_type=loss_type, lam=0.95, gamma=0.99)
    assert len(recorder.policy_grads) == len(recorder.value_grads) == 2
    assert_dense_ppo(trainer, recorder)
    logs = trainer.state.log_history
    assert logs[1]["value/clip_ratio"] > 0  # the second step's values moved past the clip range


def test_lora_policy_and_lora_value_model_equal_a_dense_ppo_step(tmp_path):
    trainer, recorder = train(tmp_path, policy_lora=True, critic_lora=True)
    assert_dense_ppo(trainer, recorder)
