"""AsyncTreePPOTrainer's decoupled objective (``use_decoupled_loss``, AReaL's): the walk against the same
objective written out here, with the proximal log-probs from a separate no-gradient forward; samples of four
policy versions in one trie, identical samples of different versions, tokens over the weight's cap (masked
or truncated); and ``train()`` against a dense SGD reference: a full policy, a LoRA policy (fp32, the
adapter's updates), and two DDP processes (torchrun, gloo: ``async_dist_worker.py``) against one process's
dense SGD. The end-to-end run against a vLLM server is in test_async_vllm.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_async_trainer import (
    EPS_HIGH,
    EPS_LOW,
    TEMPERATURE,
    make_trainer,
    plain_model,
    rollout,
    rollouts,
    true_logps,
    walk_grads,
)

from trl_dta.compare import relative_error
from trl_dta.train.async_ppo.loss import Decoupled

CAP = 1.3  # with behaviour log-probs 1.0 off the policy's, a third of the tokens are over it


def decoupled_reference(model, micro_batches, accumulation, cap, mode):
    """The decoupled objective written out: per micro-batch, over the flat list of its trained tokens, the
    proximal log-probs by a no-gradient forward, the weight exp(prox - behav) masked or clamped above
    ``cap``, the ratio against the proximal policy clipped, divided by the tokens and the accumulation."""
    total, over = 0.0, 0
    for samples in micro_batches:
        terms = []
        for s in samples:
            ids = torch.tensor([s.input_ids.tolist()])

            def logps(ids=ids):
                logits = model(input_ids=ids).logits[0, :-1] / TEMPERATURE
                return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]

            trained = torch.tensor(s.completion_mask[1:]).bool()
            with torch.no_grad():
                prox = logps()[trained]
            lp = logps()[trained]
            behav = torch.tensor(s.old_log_probs[1:])[trained].to(lp.dtype)
            weight = torch.exp(prox - behav)
            over += int((weight > cap).sum())
            weight = torch.where(weight > cap, 0.0, weight) if mode == "mask" else weight.clamp(max=cap)
            advantage = float(torch.tensor(s.advantage, dtype=torch.float32))
            ratio = torch.exp(lp - prox)
            clipped = torch.clamp(ratio, 1 - EPS_LOW, 1 + EPS_HIGH)
            terms.append(-torch.min(ratio * advantage, clipped * advantage) * weight)
        flat = torch.cat(terms)
        total = total + flat.sum() / max(flat.numel(), 1) / accumulation
    return total, over


@pytest.fixture(scope="module")
def fp64_decoupled(model_dir, tmp_path_factory, fp64_exact):
    budgets = dict(tree_block_size=16, tree_batch_tokens=24, tree_subtree_tokens=32)
    trainer = make_trainer(model_dir, tmp_path_factory.mktemp("fp64d"), use_decoupled_loss=True,
                           behav_imp_weight_cap=CAP, **budgets)  # fmt: skip
    trainer.model.double()
    return trainer


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 10_000), mode=st.sampled_from(["mask", "truncate"]), accumulation=st.integers(1, 2)
)
def test_decoupled_walk_equals_the_objective_written_out_fp64(fp64_decoupled, seed, mode, accumulation):
    trainer, model = fp64_decoupled, fp64_decoupled.model
    trainer._decoupled = Decoupled(CAP, mode)
    samples = rollouts(seed, model, groups=2, per_group=3, versions=(0, 1, 2, 3), noise=1.0)
    twin = samples[0]  # the same tokens from another policy version: other behaviour log-probs
    lp = true_logps(model, twin.input_ids.tolist())
    samples.append(rollout(twin.input_ids, twin.completion_mask, [0.0] + (lp - 0.5).tolist(), -0.7,
                           version=4, group=twin.group_id))  # fmt: skip
    cut = -(-len(samples) // accumulation)
    micro_batches = [samples[i : i + cut] for i in range(0, len(samples), cut)]
    grads, walked, batches = walk_grads(trainer, micro_batches, accumulation)
    model.zero_grad(set_to_none=True)
    loss, over = decoupled_reference(model, micro_batches, accumulation, CAP, mode)
    loss.backward()
    reference = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    assert over > 0  # some tokens over the cap: the masking/truncation is exercised
    assert relative_error(grads, reference) <= 1e-10
    assert sum(w.loss for w in walked) == pytest.approx(float(loss), rel=1e-10)
    # the library's dense reference (its own no-gradient proximal pass) agrees too
    trainer.current_gradient_accumulation_steps = accumulation
    dense = sum(float(trainer.dense_loss(model, b)) for b in batches)
    assert dense == pytest.approx(float(loss), rel=1e-10)


def test_decoupled_keeps_the_gradient_the_coupled_objective_clips_away(fp64_decoupled):
    """A stale sample whose behaviour log-probs are far below the policy's: every token's coupled ratio is
    past the clip range (no gradient from it); the decoupled objective weights it and keeps it."""
    trainer, model = fp64_decoupled, fp64_decoupled.model
    sample = rollouts(3, model, groups=1, per_group=1)[0]
    lp = true_logps(model, sample.input_ids.tolist())
    stale = rollout(sample.input_ids, sample.completion_mask, [0.0] + (lp - 0.25).tolist(), 1.0, version=0)
    trainer._decoupled = Decoupled(None, "mask")
    decoupled, _, _ = walk_grads(trainer, [[stale]], 1)
    trainer._decoupled = None
    coupled, _, _ = walk_grads(trainer, [[stale]], 1)
    trainer._decoupled = Decoupled(CAP, "mask")
    assert max(g.abs().max() for g in coupled.values()) == 0  # ratio exp(0.25) > 1.28 with A > 0: clipped
    assert max(g.abs().max() for g in decoupled.values()) > 0


def reference_sgd(reference, samples, steps, per_batch, accumulation, lr, names) -> list[int]:
    """``steps`` of plain SGD on ``reference``'s parameters ``names`` with the decoupled objective written out
    (:func:`decoupled_reference`, cap ``CAP``, "mask"), over ``samples`` in order; per step, the tokens over
    the cap."""
    overs = []
    for step in range(steps):
        chunk = samples[step * accumulation * per_batch : (step + 1) * accumulation * per_batch]
        micro_batches = [chunk[i : i + per_batch] for i in range(0, len(chunk), per_batch)]
        reference.zero_grad(set_to_none=True)
        loss, over = decoupled_reference(reference, micro_batches, accumulation, CAP, "mask")
        loss.backward()
        overs.append(over)
        with torch.no_grad():
            for n in names:
                reference.get_parameter(n).sub_(lr * reference.get_parameter(n).grad)
    return overs


def test_decoupled_train_steps_equal_dense_sgd_and_log_the_weights(model_dir, tmp_path):
    steps, per_batch, accumulation, lr = 2, 3, 2, 0.05
    reference = plain_model(model_dir)
    samples = rollouts(21, reference, groups=6, per_group=3, versions=(0, 1, 2, 3), noise=1.0)
    shape = dict(per_device_train_batch_size=per_batch, gradient_accumulation_steps=accumulation)
    trainer = make_trainer(
        model_dir, tmp_path, samples, max_steps=steps, learning_rate=lr, use_decoupled_loss=True,
        behav_imp_weight_cap=CAP, max_staleness=10, **shape,
    )  # fmt: skip
    before = {n: p.detach().clone() for n, p in reference.named_parameters()}
    trainer.train()
    reference_sgd(reference, samples, steps, per_batch, accumulation, lr, list(before))
    trained = dict(trainer.model.named_parameters())
    update = {n: trained[n].detach() - before[n] for n in before}
    expected = {n: p.detach() - before[n] for n, p in reference.named_parameters()}
    assert relative_error(update, expected) <= 1e-4
    step_logs = [log for log in trainer.state.log_history if "decoupled/imp_weight_mean" in log]
    assert len(step_logs) == steps
    assert all(0 < log["decoupled/capped_ratio"] < 1 for log in step_logs)
    assert all(log["decoupled/imp_weight_max"] > CAP for log in step_logs)


def test_decoupled_train_steps_with_a_lora_policy_equal_dense_sgd(model_dir, tmp_path):
    """The same with a LoRA policy (random A and B on q/v/down projections, the base frozen): the adapter's
    updates equal dense SGD on a PEFT model holding the trainer's initial adapter, fp32."""
    from peft import get_peft_model
    from test_async_trainer import lora_config

    steps, per_batch, accumulation, lr = 2, 3, 2, 0.05
    shape = dict(per_device_train_batch_size=per_batch, gradient_accumulation_steps=accumulation)
    options = dict(use_decoupled_loss=True, behav_imp_weight_cap=CAP, max_staleness=10)
    queue = []  # (the trainer's queue worker starts at train(): the samples are put in before that)
    trainer = make_trainer(model_dir, tmp_path, queue, peft_config=lora_config(), max_steps=steps,
                           learning_rate=lr, **shape, **options)  # fmt: skip
    reference = get_peft_model(plain_model(model_dir), lora_config())
    reference.load_state_dict(trainer.model.state_dict())  # (the trainer's random initial adapter)
    # behaviour log-probs 1.0 off the adapted policy's, versions mixed
    samples = rollouts(23, reference, groups=6, per_group=3, versions=(0, 1, 2, 3), noise=1.0)
    trainer.rollout_worker.samples = samples
    adapter = {n: p.detach().clone() for n, p in reference.named_parameters() if p.requires_grad}
    assert len(adapter) == 3 * 2 * 2  # A and B of 3 modules in 2 layers: only the adapter trains
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    trainer.train()
    overs = reference_sgd(reference, samples, steps, per_batch, accumulation, lr, list(adapter))
    assert all(over > 0 for over in overs)  # tokens over the cap in every step: the mask is exercised
    trained = dict(trainer.model.named_parameters())
    update = {n: trained[n].detach() - adapter[n] for n in adapter}
    expected = {n: reference.get_parameter(n).detach() - adapter[n] for n in adapter}
    assert relative_error(update, expected) <= 1e-4
    assert max(u.abs().max() for u in update.values()) > 1e-4  # it trained
    # the base does not train; TRL's full-weight sync (taken with no LoRA-enabled server: here) merges the
    # adapter into it and unmerges it, which moves it by float rounding only: W + D - D elementwise, no sum,
    # so a few ulps (6e-8) of the weights per sync on any CPU (seen 1.3e-7)
    assert frozen and relative_error({n: trained[n].detach() for n in frozen}, frozen) <= 1e-6
    step_logs = [log for log in trainer.state.log_history if "decoupled/imp_weight_mean" in log]
    assert len(step_logs) == steps and all(0 < log["decoupled/capped_ratio"] < 1 for log in step_logs)


def test_decoupled_two_processes_equal_dense_sgd(model_dir, tmp_path):
    """Two DDP processes (torchrun, gloo) with the decoupled objective: each micro-batch split by the
    lexicographic partition, each rank walking its share; both ranks' parameters equal one process's dense
    SGD on the whole micro-batches (the objective written out above, its proximal pass at each step's
    start)."""
    import async_dist_worker as dist

    ranks = dist.launch(tmp_path, model_dir, "decoupled")
    reference = plain_model(model_dir)
    before = {n: p.detach().clone() for n, p in reference.named_parameters()}
    samples = dist.distributed_rollouts(reference)
    per_batch = dist.PER_RANK * dist.RANKS  # a micro-batch: every rank's share
    capped = 0
    for step in range(dist.STEPS):
        chunk = samples[step * per_batch * dist.ACCUMULATION : (step + 1) * per_batch * dist.ACCUMULATION]
        micro_batches = [chunk[i : i + per_batch] for i in range(0, len(chunk), per_batch)]
        reference.zero_grad(set_to_none=True)
        loss, over = decoupled_reference(reference, micro_batches, dist.ACCUMULATION, dist.CAP, "mask")
        loss.backward()
        capped += over
        with torch.no_grad():
            for p in reference.parameters():
                p -= dist.LR * p.grad
    assert capped > 0  # some tokens over the cap: the mask is exercised across ranks
    expected = {n: p.detach() - before[n] for n, p in reference.named_parameters()}
    for rank in ranks:
        update = {n: rank["params"][n] - before[n] for n in before}
        assert relative_error(update, expected) <= 1e-4
    step_logs = [log for log in ranks[0]["logs"] if "decoupled/imp_weight_mean" in log]
    assert len(step_logs) == dist.STEPS and all(0 < log["decoupled/capped_ratio"] < 1 for log in step_logs)


def test_bad_decoupled_settings_are_refused(model_dir, tmp_path):
    from test_async_trainer import make_config

    with pytest.raises(ValueError, match="behav_imp_weight_cap must be a number > 1"):
        make_config(tmp_path, use_decoupled_loss=True, behav_imp_weight_cap=0.5)
    with pytest.raises(ValueError, match="behav_imp_weight_mode must be 'mask' or 'truncate'"):
        make_config(tmp_path, use_decoupled_loss=True, behav_imp_weight_mode="clip")


def test_staleness_at_training_is_logged_and_checked_when_asked(model_dir, tmp_path):
    """The step's samples carry their policy version from the queue to the walk: the staleness at training
    is logged; with ``check_staleness_at_training`` a sample past ``max_staleness`` when its step trains
    leaves the loss (here: the trainer's version moved on after the queue's check)."""
    from test_async_trainer import as_example, tiny_tokenizer

    from trl_dta.train.async_ppo.data import SampleCollator

    reference = plain_model(model_dir)
    samples = rollouts(5, reference, groups=2, per_group=3, versions=(0, 1, 2))
    trainer = make_trainer(model_dir, tmp_path, max_staleness=1, check_staleness_at_training=True)
    trainer.model_version = 3  # staleness 3, 2, 1: the first two kinds are past the bound
    examples = [{**as_example(s), "model_version": s.model_version} for s in samples]  # (as SampleBatcher)
    batches = [SampleCollator(tiny_tokenizer().pad_token_id, 1).torch_call([examples])]
    assert batches[0]["versions"].tolist() == [s.model_version for s in samples]
    trainer.current_gradient_accumulation_steps = 1  # (set by the Trainer's loop)
    walked = trainer._walk(trainer.model, batches, True)
    assert {s.version for s in walked[0].samples} == {2}
    metrics = trainer._metrics["train"]
    assert metrics["staleness/train_max"] == [3.0] and metrics["staleness/train_mean"] == [2.0]
    assert metrics["staleness/train_dropped"] == [4.0]


def test_a_trained_sample_keeps_the_version_the_queue_gave_it(model_dir, tmp_path):
    """End to end through TRL's queue dataset: versions reach the walk, and the staleness is logged."""
    samples = rollouts(6, plain_model(model_dir), groups=6, per_group=3, versions=(0,))
    trainer = make_trainer(model_dir, tmp_path, samples, max_steps=2, max_staleness=5)
    trainer.train()
    logs = [log for log in trainer.state.log_history if "staleness/train_max" in log]
    # samples of version 0, trained at versions 1 and 2 (TRL's cold weight sync makes the first version 1)
    assert [log["staleness/train_max"] for log in logs] == [1.0, 2.0]
    assert trainer.rollout_worker.versions[:2] == [1, 2]


def test_a_step_on_the_dense_path_equals_the_walk(model_dir, tmp_path):
    """``tree_dense_fallback="always"``: each micro-batch is one padded forward (the dense path the cost
    model prices) with the same loss: the same parameter updates as the walk's, and ``tree/path`` says so."""
    reference = plain_model(model_dir)
    samples = rollouts(8, reference, groups=6, per_group=3, versions=(0, 1), noise=1.0)
    shape = dict(
        per_device_train_batch_size=3, gradient_accumulation_steps=2, max_steps=2, learning_rate=0.05
    )
    updates = []
    for mode in ("never", "always"):
        options = dict(use_decoupled_loss=True, behav_imp_weight_cap=CAP, max_staleness=10)
        trainer = make_trainer(
            model_dir, tmp_path / mode, samples, tree_dense_fallback=mode, **shape, **options
        )
        trainer.train()
        updates.append(
            {n: p.detach() - reference.get_parameter(n) for n, p in trainer.model.named_parameters()}
        )
        paths = [log["tree/path"] for log in trainer.state.log_history if "tree/path" in log]
        assert paths == ([1.0, 1.0] if mode == "always" else [0.0, 0.0])
        timed = [log["tree/dense_s"] for log in trainer.state.log_history if "tree/dense_s" in log]
        assert len(timed) == (mode == "always")  # (the first dense step's, at the second's decision)
        staleness = [
            log["staleness/train_max"] for log in trainer.state.log_history if "staleness/train_max" in log
        ]
        assert len(staleness) == 2  # (logged on either path)
    assert relative_error(updates[1], updates[0]) <= 1e-4
    assert max(u.abs().max() for u in updates[0].values()) > 1e-4  # it trained


@pytest.mark.parametrize("at", [1, 2])
def test_a_dense_step_that_runs_out_of_memory_is_walked(model_dir, tmp_path, at):
    """``tree_dense_fallback="always"``, the dense forward of the first step's ``at``-th micro-batch out of
    memory: the step is walked from its first micro-batch (its gradients dropped first), the run's updates a
    walked run's to fp32 rounding."""
    from trl_dta.testing.oom import InjectOOM

    reference = plain_model(model_dir)
    samples = rollouts(8, reference, groups=6, per_group=3, versions=(0, 1), noise=1.0)
    shape = dict(
        per_device_train_batch_size=3, gradient_accumulation_steps=2, max_steps=2, learning_rate=0.05
    )
    updates, logs = [], []
    for mode, inject in (("never", None), ("always", at)):
        options = dict(use_decoupled_loss=True, behav_imp_weight_cap=CAP, max_staleness=10)
        trainer = make_trainer(
            model_dir, tmp_path / f"{mode}{inject}", samples, tree_dense_fallback=mode, **shape, **options
        )
        with InjectOOM(trainer.model.model.layers[0], inject, inside="_dense_micro_batch") as oom:
            trainer.train()
        updates.append(
            {n: p.detach() - reference.get_parameter(n) for n, p in trainer.model.named_parameters()}
        )
        logs = [log for log in trainer.state.log_history if "tree/path" in log]
    assert oom.raised == 1
    assert [log.get("tree/dense_oom_retries", 0.0) for log in logs] == [1.0, 0.0]
    assert relative_error(updates[1], updates[0]) <= 1e-4
