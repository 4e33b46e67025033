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
from trl_dta.train.ppo.rows import batch_rows

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


@pytest.mark.parametrize(
    "shape",
    [
        dict(steps_per_generation=4, num_iterations=1),
        dict(steps_per_generation=4, num_iterations=2, max_steps=4),
    ],
    ids=["spg4", "spg4-iter2"],
)
def test_several_steps_per_generation_train_on_the_generations_old_values(tmp_path, shape):
    """TRL's steps_per_generation larger than the accumulation (and num_iterations): every optimizer step of a
    generation batch reads the old values and advantages of the generation (the value model as it was then),
    so the value clip binds from the second step on (the synchronous counterpart of AsyncTreePPOConfig's
    ppo_n_minibatches)."""
    trainer, recorder = train(tmp_path, **shape)
    assert (
        len(recorder.policy_grads) == len(recorder.value_grads) == GA2["max_steps"] * shape["num_iterations"]
    )
    assert_dense_ppo(trainer, recorder)
    clip = [log["value/clip_ratio"] for log in trainer.state.log_history if "value/clip_ratio" in log]
    assert clip[0] == 0.0 and all(c > 0 for c in clip[1:])


def test_lora_policy_and_lora_value_model_equal_a_dense_ppo_step(tmp_path):
    trainer, recorder = train(tmp_path, policy_lora=True, critic_lora=True)
    assert_dense_ppo(trainer, recorder)


# ------------------------------------------------------------------------------------------------------------
# Learning per-leaf targets, resume, loading, refusals
# ------------------------------------------------------------------------------------------------------------
def test_the_value_model_learns_each_leafs_own_target_on_a_shared_prefix():
    """8 rollouts share a prompt and a first chunk, then a decisive token sets each one's return to 1 or 0.
    Trained through the step seam, each sequence with its own targets, the values that have seen the
    decisive token reach their own rollout's return, those before it the rollouts' mean: a walk that kept
    one leaf's targets on the shared tokens would fit that leaf's return there and fail both."""
    from types import SimpleNamespace

    from accelerate import Accelerator

    from trl_dta.train.critic.value_model import ValueLosses, ValueTarget
    from trl_dta.train.step import StepSequence, StepWalker

    critic = value_model_from(tiny_model()).eval()  # (its head's dropout off)
    prompt, chunk, tail = list(range(10, 20)), list(range(30, 36)), list(range(40, 44))
    returns = [float(i % 2) for i in range(8)]
    rows = [prompt + chunk + [60 + i] + tail for i in range(8)]  # the decisive token: one per rollout
    seqs = [StepSequence(r, 0, len(prompt) - 1) for r in rows]
    width = len(chunk) + 1 + len(tail)
    every = torch.arange(width)  # (every position a trained token, its target the rollout's return)
    targets = [
        ValueTarget(every, torch.zeros(width), torch.full((width,), r), 1.0, 8 * width) for r in returns
    ]
    loss = ValueLosses(targets, cliprange_value=None)
    walker = StepWalker(SimpleNamespace(), Accelerator(cpu=True), critic)
    optimizer = torch.optim.Adam(critic.parameters(), lr=1e-2)
    for _ in range(150):
        with walker.step(critic, seqs) as step:
            step.backward(lambda k, values, _: loss(k, values), entropies=False)
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():  # dense forwards: the values the model learnt
        values = torch.stack(
            [critic(input_ids=torch.tensor([r])).logits[0, len(prompt) - 1 : -1, 0] for r in rows]
        )
    before, after = (
        values[:, : len(chunk) + 1],
        values[:, len(chunk) + 1 :],
    )  # before/after the decisive token
    assert (before - 0.5).abs().max() < 0.05, before
    assert (after - torch.tensor(returns)[:, None]).abs().max() < 0.05, after


def test_resume_takes_the_same_steps_as_an_uninterrupted_run(tmp_path):
    """Adam for both models (their optimizer states matter from the step after the resume), saved every 2
    steps: resumed from checkpoint-2, steps 3 and 4 have the gradients of the uninterrupted run's."""
    steps = dict(optim="adamw_torch", learning_rate=1e-3, max_steps=4, save_strategy="steps", save_steps=2)
    full, full_rec = train(tmp_path / "full", **steps)
    first, _ = train(tmp_path / "resumed", **{**steps, "max_steps": 2})
    assert (tmp_path / "resumed" / "checkpoint-2" / "value_model" / "optimizer.pt").exists()
    tokenizer = tiny_tokenizer()
    policy = tiny_model(tokenizer)
    critic = value_model_from(policy)
    recorder = Recorder()
    config = make_config(tmp_path / "resumed", TreePPOConfig, **{**GA2, **steps})
    second = make_trainer(TreeScripted, config, model=policy, value_model=critic, callbacks=[recorder])
    recorder.attach(second)
    second.train(resume_from_checkpoint=str(tmp_path / "resumed" / "checkpoint-2"))
    assert len(recorder.policy_grads) == len(recorder.value_grads) == 2
    for step in range(2):
        assert max_rel_diff(recorder.policy_grads[step], full_rec.policy_grads[2 + step]) <= TOL
        assert max_rel_diff(recorder.value_grads[step], full_rec.value_grads[2 + step]) <= TOL


def test_a_path_loads_a_token_classifier_warm_started_with_a_zero_head_and_saves_it_beside(tmp_path):
    from transformers import AutoModelForTokenClassification

    tiny_model(tiny_tokenizer()).save_pretrained(tmp_path / "policy")
    config = make_config(tmp_path / "out", TreePPOConfig, max_steps=1)
    trainer = make_trainer(TreeScripted, config, model=str(tmp_path / "policy"),
                           value_model=str(tmp_path / "policy"))  # fmt: skip
    critic = trainer._critic.model
    assert type(critic).__name__ == "Qwen3ForTokenClassification" and critic.config.num_labels == 1
    assert not critic.score.weight.any()
    for name, p in critic.model.named_parameters():  # the decoder: the policy's weights
        torch.testing.assert_close(p, trainer.model.model.get_parameter(name), rtol=0, atol=0)
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    saved = AutoModelForTokenClassification.from_pretrained(tmp_path / "final" / "value_model")
    for (name, p), (_, q) in zip(critic.named_parameters(), saved.named_parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q, rtol=0, atol=0, msg=name)
    assert critic.score.weight.any()  # (it trained)


def test_what_a_value_model_cannot_do_is_refused_when_the_trainer_is_built(tmp_path):
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from trl_dta.train.critic.value_model import check_value_model

    fsdp1 = SimpleNamespace(distributed_type=DistributedType.FSDP, state=SimpleNamespace(fsdp_plugin=None))
    with pytest.raises(ValueError, match="needs FSDP2"):
        check_value_model("Qwen/Qwen3-0.6B", fsdp1)
    fsdp2 = SimpleNamespace(fsdp_plugin=SimpleNamespace(fsdp_version=2))
    check_value_model("Qwen/Qwen3-0.6B", SimpleNamespace(distributed_type=DistributedType.FSDP, state=fsdp2))
    with pytest.raises(TypeError, match="value_model must be a Hub id or a path"):
        make_trainer(TreeScripted, make_config(tmp_path, TreePPOConfig), value_model=3)
    policy = tiny_model(tiny_tokenizer())
    with pytest.raises(ValueError, match="not a value model"):  # the policy itself, by mistake
        make_trainer(TreeScripted, make_config(tmp_path, TreePPOConfig), model=policy, value_model=policy)
    dropout = value_model_from(policy)
    assert any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in dropout.modules())
    config = make_config(tmp_path, TreePPOConfig, disable_dropout=False)
    with pytest.raises(Exception, match="(?i)dropout"):
        make_trainer(TreeScripted, config, model=policy, value_model=dropout)
    small = value_model_from(tiny_model(tiny_tokenizer(), vocab_size=200))
    with pytest.raises(Exception, match="(?i)tokenizer"):
        make_trainer(TreeScripted, make_config(tmp_path, TreePPOConfig), model=policy, value_model=small)
    forced = make_config(tmp_path, TreePPOConfig, tree_dense_fallback="always")  # (the value model walks)
    with pytest.raises(ValueError, match='"always" is not supported with a value model'):
        make_trainer(TreeScripted, forced, model=policy, value_model=value_model_from(policy))
