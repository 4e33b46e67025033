"""AsyncTreePPOTrainer's PPO minibatches (``ppo_n_minibatches = k``, issue 55): k optimizer steps per proximal
pass, against a dense SGD reference written here: per pass, the proximal log-probs (and a value model's old
values, GAE's returns and advantages, whitened over the pass) computed once by a plain forward of each sample
before the pass's first update; then each step's decoupled objective (the capped weight π_prox / π_behav, the
ratio to the proximal policy clipped) and clipped value loss, one SGD update each. Samples of mixed policy
versions; a pass cut short by ``max_steps``; the clip against the proximal policy binds from a pass's
second update on and is logged; what is refused."""

from __future__ import annotations

import math

import pytest
import torch
from peft import get_peft_model
from test_async_trainer import TEMPERATURE, lora_config, make_trainer, plain_model, rollouts
from test_async_value_model import make_critic
from test_async_value_model import make_trainer as make_value_trainer

from trl_dta import AsyncTreePPOConfig, AsyncTreePPOTrainer
from trl_dta.compare import relative_error

CAP, EPS, CLIP_VALUE = 1.3, 0.05, 0.05  # (a narrow trust region: it binds after one SGD step of lr 0.1)


def trained_logps(model, s):
    ids = torch.tensor([s.input_ids.tolist()])
    logits = model(input_ids=ids).logits[0, :-1] / TEMPERATURE
    trained = torch.tensor(s.completion_mask[1:]).bool()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0][trained]


def pass_targets(critic, samples):
    """A value model's old values, returns and whitened advantages per sample (γ = λ = 1: A_t = R - V_t,
    returns R), whitened over the pass's tokens."""
    with torch.no_grad():
        values = []
        for s in samples:
            ids = torch.tensor([s.input_ids.tolist()])
            values.append(critic(input_ids=ids).logits[0, :-1, 0][torch.tensor(s.completion_mask[1:]).bool()])
    raw = [s.metrics["reward"] - v.double() for s, v in zip(samples, values, strict=True)]
    flat = torch.cat(raw)
    mean, std = flat.mean(), flat.std(unbiased=False)
    advantages = [((a - mean) / (std + 1e-8)).float() for a in raw]
    returns = [torch.full_like(v, s.metrics["reward"]) for s, v in zip(samples, values, strict=True)]
    return values, returns, advantages


def reference_sgd(policy, critic, samples, steps, k, per_batch, accumulation, lr):
    """``steps`` SGD updates, ``k`` per proximal pass (module docstring); per update, the fraction of trained
    tokens whose ratio to the proximal policy is clipped (per micro-batch, averaged: as the trainer logs)."""
    per_step = per_batch * accumulation
    models = [policy] + ([critic] if critic is not None else [])
    clipped = []
    for start in range(0, steps, k):
        pass_samples = samples[start * per_step : min(start + k, steps) * per_step]
        with torch.no_grad():
            proximal = [trained_logps(policy, s) for s in pass_samples]
        targets = pass_targets(critic, pass_samples) if critic is not None else None
        for step in range(start, min(start + k, steps)):
            loss, fractions = 0.0, []
            for b in range(accumulation):
                over = count = 0
                first = (step - start) * per_step + b * per_batch
                batch = range(first, first + per_batch)
                tokens = sum(proximal[j].numel() for j in batch)
                for j in batch:
                    s, prox = pass_samples[j], proximal[j]
                    lp = trained_logps(policy, s)
                    behav = torch.tensor(s.old_log_probs[1:])[torch.tensor(s.completion_mask[1:]).bool()]
                    weight = torch.exp(prox - behav.to(prox))
                    weight = torch.where(weight > CAP, 0.0, weight)
                    adv = targets[2][j] if targets else torch.full_like(lp, float(torch.tensor(s.advantage)))
                    ratio = torch.exp(lp - prox)
                    terms = -torch.min(ratio * adv, torch.clamp(ratio, 1 - EPS, 1 + EPS) * adv) * weight
                    loss = loss + terms.sum() / tokens / accumulation
                    low, high = (ratio < 1 - EPS) & (adv < 0), (ratio > 1 + EPS) & (adv > 0)
                    over, count = over + int((low | high).sum()), count + lp.numel()
                    if critic is not None:
                        old, returns = targets[0][j], targets[1][j]
                        ids = torch.tensor([s.input_ids.tolist()])
                        v = critic(input_ids=ids).logits[0, :-1, 0][
                            torch.tensor(s.completion_mask[1:]).bool()
                        ]
                        clipped_v = old + (v - old).clamp(-CLIP_VALUE, CLIP_VALUE)
                        value = 0.5 * torch.maximum((v - returns) ** 2, (clipped_v - returns) ** 2)
                        loss = loss + value.sum() / tokens / accumulation
                fractions.append(over / count)
            for m in models:
                m.zero_grad(set_to_none=True)
            loss.backward()
            with torch.no_grad():
                for m in models:
                    for p in m.parameters():
                        if p.grad is not None:
                            p.sub_(lr * p.grad)
            clipped.append(sum(fractions) / len(fractions))
    return clipped


def update(trained, before):
    return {n: p.detach() - before[n] for n, p in trained.named_parameters()}


OPTIONS = dict(use_decoupled_loss=True, behav_imp_weight_cap=CAP, max_staleness=10, epsilon=EPS,
               epsilon_high=EPS, per_device_train_batch_size=3, gradient_accumulation_steps=2,
               learning_rate=0.1)  # fmt: skip


class DenseSteps(AsyncTreePPOTrainer):
    """Every step by the dense path (``tree_dense_fallback="auto"`` deciding so): its samples read the pass's
    proximal log-probs as the walk's do."""

    def _prefer_dense(self, model, group):
        return True


@pytest.mark.parametrize("path", ["walk", "dense", "lora"])
def test_k_updates_per_proximal_pass_equal_dense_sgd_and_the_clip_binds(model_dir, tmp_path, path):
    """k = 3 over 4 steps (a pass of 3, then one of 1, cut by max_steps), the policy alone; each step walked,
    or by the dense path (the pass still walks), or a LoRA policy walked (the adapter trains; the reference
    a PEFT model holding the trainer's initial adapter)."""
    steps, k = 4, 3
    dense = dict(trainer_class=DenseSteps, tree_dense_fallback="auto") if path == "dense" else {}
    lora = dict(peft_config=lora_config()) if path == "lora" else {}
    queue = []  # (the trainer's queue worker starts at train(): the samples are put in before that)
    trainer = make_trainer(
        model_dir, tmp_path, queue, max_steps=steps, ppo_n_minibatches=k, **OPTIONS, **dense, **lora
    )
    reference = plain_model(model_dir)
    if path == "lora":
        reference = get_peft_model(reference, lora_config())
        reference.load_state_dict(trainer.model.state_dict())  # (the trainer's random initial adapter)
    samples = rollouts(31, reference, groups=10, per_group=3, versions=(0, 1, 2, 3), noise=0.3)
    trainer.rollout_worker.samples = samples
    before = {n: p.detach().clone() for n, p in reference.named_parameters()}
    trainer.train()
    clipped = reference_sgd(reference, None, samples, steps, k, 3, 2, OPTIONS["learning_rate"])
    assert relative_error(update(trainer.model, before), update(reference, before)) <= 1e-4
    assert max(float(u.abs().max()) for u in update(trainer.model, before).values()) > 1e-3  # it trained
    logs = [log for log in trainer.state.log_history if "clip_ratio/proximal_region_mean" in log]
    assert len(logs) == steps
    logged = [log["clip_ratio/proximal_region_mean"] for log in logs]
    assert logged[0] == logged[3] == 0.0  # a pass's first update: the policy is the proximal one
    assert logged[1] > 0 and logged[2] > 0  # the policy moved: the clip binds
    assert logged == pytest.approx(clipped, abs=1e-6)  # shares of token counts: their mean's rounding apart
    assert all("proximal_tree/time_s" in log for log in (logs[0], logs[3]))  # (one pass walk each)
    walked = [("tree/time_s" in log) for log in logs]  # (no step walks on the dense path)
    assert walked == [path != "dense"] * steps


def test_k_updates_with_a_value_model_equal_dense_sgd_and_its_clip_binds(model_dir, tmp_path):
    """k = 2 over 3 steps with a value model: its old values, returns and advantages from the pass."""
    steps, k = 3, 2
    policy = plain_model(model_dir)
    samples = rollouts(32, policy, groups=8, per_group=3, versions=(0, 1, 2), noise=0.3)
    trainer = make_value_trainer(model_dir, tmp_path, make_critic(model_dir), samples, max_steps=steps,
                                 ppo_n_minibatches=k, cliprange_value=CLIP_VALUE, **OPTIONS)  # fmt: skip
    critic = make_critic(model_dir).eval()  # (its head's dropout off, as the trainer's)
    policy_before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    critic_before = {n: p.detach().clone() for n, p in critic.named_parameters()}
    trainer.train()
    reference_sgd(policy, critic, samples, steps, k, 3, 2, OPTIONS["learning_rate"])
    assert relative_error(update(trainer.model, policy_before), update(policy, policy_before)) <= 1e-4
    value_update = update(trainer._critic.model, critic_before)
    assert relative_error(value_update, update(critic, critic_before)) <= 1e-4
    logs = [log for log in trainer.state.log_history if "value/clip_ratio" in log]
    assert len(logs) == steps
    assert logs[0]["value/clip_ratio"] == 0.0 and logs[1]["value/clip_ratio"] > 0  # the pass's second update


@pytest.mark.parametrize(
    "options,message",
    [
        (dict(ppo_n_minibatches=2), "needs use_decoupled_loss=True"),
        (dict(ppo_n_minibatches=0, use_decoupled_loss=True), "whole number >= 1"),
        (dict(ppo_n_minibatches=True, use_decoupled_loss=True), "whole number >= 1"),
        (dict(ppo_n_minibatches=2, use_decoupled_loss=True, tree_dense_fallback="always"), "proximal"),
    ],
)
def test_refused_settings(tmp_path, options, message):
    with pytest.raises(ValueError, match=message):
        AsyncTreePPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], **options)


def test_one_minibatch_is_todays_step(model_dir, tmp_path):
    """ppo_n_minibatches=1 (the default) takes no pass: the step's own log-probs are the proximal ones."""
    samples = rollouts(33, plain_model(model_dir), groups=4, per_group=3, versions=(0,))
    trainer = make_trainer(model_dir, tmp_path, samples, max_steps=1, **OPTIONS)
    trainer.train()
    (log,) = [log for log in trainer.state.log_history if "clip_ratio/proximal_region_mean" in log]
    assert log["clip_ratio/proximal_region_mean"] == 0.0 and "proximal_tree/time_s" not in log
    assert not math.isnan(log["decoupled/imp_weight_mean"])
