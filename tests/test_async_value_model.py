"""AsyncTreePPOTrainer with a value model: the current critic's values at training time, GAE per sample in
the trainer, the policy and the value model walked on one trie, against a dense computation written here
(float32: per-sample forwards, GAE by an independent loop, whitening, TRL's coupled loss with per-token
advantages, the squared error of the values); ``train()`` with a value model; and two DDP processes (the
decoupled objective, ``async_dist_worker.py``) against one process's run of the same micro-batches (slow)."""

from __future__ import annotations

import math

import pytest
import torch
from test_async_trainer import EPS_HIGH, EPS_LOW, TEMPERATURE, make_config, plain_model, rollouts, walk_grads
from test_ppo_values import reference_gae

from trl_dta import AsyncTreePPOTrainer, value_model_from
from trl_dta.compare import relative_error
from trl_dta.testing.async_grpo import NoWeightTransfer, QueueWorker
from trl_dta.testing.grpo import make_dataset, tiny_tokenizer


def make_trainer(model_dir, out, value_model, samples=(), **overrides):
    return AsyncTreePPOTrainer(
        str(model_dir), args=make_config(out, **overrides), processing_class=tiny_tokenizer(),
        train_dataset=make_dataset(2), rollout_worker=QueueWorker(samples),
        weight_transfer=NoWeightTransfer(), value_model=value_model,
    )  # fmt: skip


def make_critic(model_dir):
    critic = value_model_from(plain_model(model_dir))
    with torch.no_grad():  # a head that is not zero: non-trivial values and advantages
        critic.score.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(3))
    return critic


def dense_reference(policy, critic, micro_batches, accumulation):
    """Policy and value losses of a step, dense, per sample; the advantages and returns by GAE (γ = λ = 1). A
    sample with a NaN reward (unscorable) has no advantage and no value loss, and stays out of the
    whitening; its tokens still count in its micro-batch's normaliser (TRL's)."""
    rows = [(s, torch.tensor([s.input_ids.tolist()]), torch.tensor(s.completion_mask[1:]).bool())
            for mb in micro_batches for s in mb]  # fmt: skip
    with torch.no_grad():
        values = [critic(input_ids=ids).logits[0, :-1, 0][trained] for _, ids, trained in rows]
    width = max(v.numel() for v in values)
    padded, mask, rewards = (torch.zeros(len(rows), width, dtype=torch.float64) for _ in range(3))
    for k, ((s, _, _), v) in enumerate(zip(rows, values, strict=True)):
        if math.isnan(s.metrics["reward"]):
            continue  # (mask 0: advantages and returns 0, out of the whitening)
        padded[k, : v.numel()], mask[k, : v.numel()] = v.double(), 1
        rewards[k, v.numel() - 1] = s.metrics["reward"]
    advantages, returns = reference_gae(padded, rewards, mask, 1.0, 1.0)
    on = mask.bool()
    advantages = torch.where(
        on, (advantages - advantages[on].mean()) / (advantages[on].std(unbiased=False) + 1e-8), 0.0
    )
    policy_loss, value_loss, k = 0.0, 0.0, 0
    for mb in micro_batches:
        tokens = sum(int(torch.tensor(s.completion_mask[1:]).sum()) for s in mb)
        for s in mb:
            _, ids, trained = rows[k]
            n = int(trained.sum())
            logits = policy(input_ids=ids).logits[0, :-1] / TEMPERATURE
            lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0][trained]
            old = torch.tensor(s.old_log_probs[1:])[trained]
            adv = advantages[k, :n].float()
            ratio = torch.exp(lp - old)
            per_token = -torch.min(ratio * adv, torch.clamp(ratio, 1 - EPS_LOW, 1 + EPS_HIGH) * adv)
            policy_loss = policy_loss + per_token.sum() / tokens / accumulation
            v = critic(input_ids=ids).logits[0, :-1, 0][trained]
            scored = float(mask[k, 0])  # (an unscorable sample: no value loss)
            value_loss = (
                value_loss + scored * (0.5 * (v - returns[k, :n].float()) ** 2).sum() / tokens / accumulation
            )
            k += 1
    return policy_loss, value_loss


@pytest.mark.parametrize("unscorable", [False, True])
def test_policy_and_value_gradients_equal_a_dense_step(model_dir, tmp_path, unscorable):
    """The step's gradients against the dense reference; ``unscorable``: one sample no reward function scored
    (TRL's rollout worker: a NaN reward, an advantage of 0) gets no advantage and no value loss, as in
    TreePPOTrainer (it once trained with advantages ``-V`` and returns 0)."""
    trainer = make_trainer(model_dir, tmp_path, make_critic(model_dir))
    critic = trainer._critic.model
    samples = rollouts(9, trainer.model, groups=2, per_group=3, versions=(0, 1))
    if unscorable:
        samples[1].metrics["reward"], samples[1].advantage = float("nan"), 0.0
    micro_batches = [samples[:3], samples[3:]]
    critic.zero_grad(set_to_none=True)
    grads, _, _ = walk_grads(trainer, micro_batches, accumulation=2)
    value_grads = {n: p.grad.clone() for n, p in critic.named_parameters()}
    critic.zero_grad(set_to_none=True)

    policy = plain_model(model_dir)
    reference_critic = make_critic(model_dir).eval()  # (its head's dropout off, as the trainer zeroes it)
    policy_loss, value_loss = dense_reference(policy, reference_critic, micro_batches, 2)
    (policy_loss + value_loss).backward()
    assert relative_error(grads, {n: p.grad for n, p in policy.named_parameters()}) <= 1e-4
    assert relative_error(value_grads, {n: p.grad for n, p in reference_critic.named_parameters()}) <= 1e-4
    metrics = trainer._metrics["train"]
    assert metrics["value/loss"] and metrics["value/explained_variance"] and metrics["value_tree/time_s"]


def test_train_with_a_value_model_completes_and_saves_it(model_dir, tmp_path):
    from transformers import AutoModelForTokenClassification

    samples = rollouts(4, plain_model(model_dir), groups=6, per_group=3, versions=(0,))
    trainer = make_trainer(model_dir, tmp_path, str(model_dir), samples, max_steps=2, max_staleness=5)
    trainer.train()
    logs = [log for log in trainer.state.log_history if "value/loss" in log]
    assert len(logs) == 2 and all("value/grad_norm" in log for log in logs)
    assert trainer._critic.model.score.weight.any()  # a zero head at the start, trained
    trainer.save_model(str(tmp_path / "final"))
    assert AutoModelForTokenClassification.from_pretrained(tmp_path / "final" / "value_model").num_labels == 1


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode",
    [
        "decoupled-value",
        "decoupled-value-minibatches",
        "decoupled-value-minibatches-idle",
        "decoupled-value-fsdp2",
    ],
)
def test_two_processes_with_a_value_model_equal_one(model_dir, tmp_path, mode):
    """Two DDP processes (torchrun, gloo), the decoupled objective and a value model: GAE's whitening over
    every rank's tokens, both models' gradients averaged once per step. Both ranks' policy and value model
    equal one process's run of the same micro-batches (a one-process step is checked against a dense one
    above; ``-minibatches``: the run's steps in one proximal pass, ``ppo_n_minibatches``, each rank's pass
    walking its share of them, checked on one process in test_async_minibatches.py; ``-idle``: the last rank
    has nothing to train in the second step, and still agrees with the other on the pass's targets)."""
    import async_dist_worker as dist

    ranks = dist.launch(tmp_path / "two", model_dir, mode)
    one = dist.make_trainer(str(tmp_path / "one"), str(model_dir), mode, processes=1)
    before = dist.trained_state(one)
    one.train()
    expected = dist.trained_state(one)
    for name in ("params", "critic"):
        moved = {n: expected[name][n] - before[name][n] for n in before[name]}
        assert max(float(m.abs().max()) for m in moved.values()) > 1e-4, name  # both models trained
        for rank in ranks:
            update = {n: rank[name][n] - before[name][n] for n in before[name]}
            assert relative_error(update, moved) <= 1e-4, name
    for key in ("value/loss", "decoupled/imp_weight_mean"):
        assert len([log for log in ranks[0]["logs"] if key in log]) == dist.STEPS, key
    passes = [log for log in ranks[0]["logs"] if "proximal_tree/time_s" in log]
    assert len(passes) == (0 if mode.removesuffix("-fsdp2") == "decoupled-value" else 1)
    if mode.endswith("-fsdp2"):  # (both models sharded: every parameter a DTensor)
        assert all(rank["sharded"] == (True, True) for rank in ranks)
    if mode.endswith("-idle"):  # (the case is what it says: the last rank trained nothing in step 2)
        assert ranks[-1]["trained_samples"][1] == 0 and ranks[0]["trained_samples"][1] > 0


def test_a_conversation_forked_into_rows_gets_its_episodes_advantages_at_gamma_and_lam_one(tmp_path):
    """TRL's rollout worker can fork a multi-turn conversation into several rows, each with the episode's
    reward. GAE per row at γ = λ = 1 gives every policy token the episode's advantage, R - V (each token is
    trained in one row); below 1 it would not, so that combination is refused where rows can fork (tools,
    environments, a custom worker)."""
    from trl_dta.train.async_ppo.values import check_episodes
    from trl_dta.train.critic.gae import sequence_targets

    g = torch.Generator().manual_seed(0)
    first, second = torch.randn(5, generator=g), torch.randn(3, generator=g)  # (each row's trained tokens)

    def advantages(gamma, lam):
        options = dict(gamma=gamma, lam=lam, whiten_advantages=False)
        rows = sequence_targets([first, second], [2.0, 2.0], **options).advantages
        episode = sequence_targets([torch.cat([first, second])], [2.0], **options).advantages
        return torch.cat(rows), episode[0]

    rows, episode = advantages(1.0, 1.0)
    torch.testing.assert_close(rows, episode)
    torch.testing.assert_close(episode, 2.0 - torch.cat([first, second]))
    rows, episode = advantages(0.9, 0.95)
    assert not torch.allclose(rows, episode)  # (why it is refused below 1)
    args = make_config(tmp_path, gamma=0.99)
    for given in ({"tools": [len]}, {"environment_factory": dict}, {"rollout_worker": object()}):
        with pytest.raises(ValueError, match="gamma=1.0 and lam=1.0"):
            check_episodes(args, given)
    check_episodes(args, {"tools": None})  # (TRL's worker, single turn: one row per conversation)
    check_episodes(make_config(tmp_path), {"tools": [len]})  # (γ = λ = 1: exact)


def test_gae_below_one_with_rows_that_can_fork_is_refused_when_the_trainer_is_built(model_dir, tmp_path):
    with pytest.raises(ValueError, match="a custom rollout_worker"):
        make_trainer(model_dir, tmp_path, make_critic(model_dir), lam=0.95)
