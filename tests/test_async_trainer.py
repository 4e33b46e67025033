"""AsyncTreePPOTrainer (issue 34): TRL's asynchronous GRPO with each optimizer step's rollouts walked as a
trie.

All on a CPU: a tiny Qwen3 saved to a temporary directory (conftest's ``model_dir``: TRL's async trainer
loads its policy from a path), rollouts fed by TRL's own extension point (a custom ``rollout_worker``
putting prepared samples on a queue, ``trl_dta.testing.async_grpo``), weight sync switched off by a no-op
``weight_transfer``.

(a) gradients of a step (two micro-batches, shared prompts and turns, masked tool tokens, ratios on both
    sides of the clipping range): the walk against stock TRL's own ``compute_loss`` on TRL's own packing
    and collator (its FA3 kernel replaced by the same attention in PyTorch), fp32 <= 1e-4, with TRL's
    metrics and loss values; and against an independent dense forward per sample in fp64 (hypothesis).
(b) a trie that mixes policy versions: shared prefixes and identical samples from different versions, each
    with its own behaviour log-probs and importance weight.
(c) a sample longer than TRL's token budget allows: TRL's batcher drops it, the walk trains it (chunked).
(d) ``train()`` for three optimizer steps with SGD: the parameters' updates equal a dense reference's; TRL's
    staleness bound drops a stale sample; TRL's metrics and weight syncs happen.
(e) what is refused, with clear errors.
"""

from __future__ import annotations

import async_dist_worker as dist
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
from trl.experimental.async_grpo.async_grpo_trainer import TokenBudgetBatcher

from trl_dta import AsyncTreePPOConfig, AsyncTreePPOTrainer, PrefixTrie
from trl_dta.compare import relative_error
from trl_dta.testing.async_grpo import (
    DenseCheck,
    NoWeightTransfer,
    QueueWorker,
    as_example,
    policy_logps,
    register_cpu_tree_attention,
    rollout,
    stock_trl_model,
    synthetic_rollouts,
    trl_micro_batch,
)
from trl_dta.testing.grpo import make_dataset, tiny_model, tiny_tokenizer
from trl_dta.train.async_ppo.data import SampleCollator

EPS_LOW, EPS_HIGH, TEMPERATURE = 0.2, 0.28, 0.9
METRICS = ("ratio", "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
           "clip_ratio/low_min", "clip_ratio/high_max")  # fmt: skip


def make_config(out, **overrides) -> AsyncTreePPOConfig:
    kw = dict(
        output_dir=str(out), per_device_train_batch_size=3, gradient_accumulation_steps=2, max_steps=1,
        bf16=False, use_cpu=True, optim="sgd", learning_rate=0.05, max_grad_norm=0.0, report_to=[],
        save_strategy="no", logging_steps=1, epsilon=EPS_LOW, epsilon_high=EPS_HIGH, temperature=TEMPERATURE,
        max_staleness=3, tree_dense_fallback="never",  # (every step walks: these tests test the walk)
    )  # fmt: skip
    kw.update(overrides)
    return AsyncTreePPOConfig(**kw)


class CheckedTrainer(DenseCheck, AsyncTreePPOTrainer):
    pass


def make_trainer(
    model_dir, out, samples=(), peft_config=None, trainer_class=AsyncTreePPOTrainer, **overrides
):
    return trainer_class(
        str(model_dir), args=make_config(out, **overrides), processing_class=tiny_tokenizer(),
        peft_config=peft_config,
        train_dataset=make_dataset(2), rollout_worker=QueueWorker(samples),
        weight_transfer=NoWeightTransfer(),
    )  # fmt: skip


def plain_model(model_dir, dtype=torch.float32):
    return AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="eager", dtype=dtype)


def true_logps(model, tokens) -> torch.Tensor:
    return policy_logps(model, tokens, TEMPERATURE)


def rollouts(seed, model, **kw):
    return synthetic_rollouts(seed, model, TEMPERATURE, **kw)


def collated(samples) -> dict:
    return SampleCollator(tiny_tokenizer().pad_token_id, 1).torch_call([[as_example(s) for s in samples]])


def walk_grads(trainer, micro_batches, accumulation):
    """The walk's gradients of a step of ``micro_batches`` (lists of samples), and its micro-batch shares."""
    batches = [collated(mb) for mb in micro_batches]
    trainer.current_gradient_accumulation_steps = accumulation
    trainer.model.zero_grad(set_to_none=True)
    walked = trainer._walk(trainer.model, batches, True)
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.model.zero_grad(set_to_none=True)
    return grads, walked, batches


def reference_loss(model, micro_batches, accumulation) -> torch.Tensor:
    """TRL's asynchronous GRPO loss written out independently: per micro-batch, the clipped surrogate over the
    flat list of its trained tokens, divided by their count and by the accumulation steps; log-probs from a
    plain forward of each sample."""
    total = 0.0
    for samples in micro_batches:
        lps, olds, advs = [], [], []
        for s in samples:
            ids = torch.tensor([s.input_ids.tolist()])
            logits = model(input_ids=ids).logits[0, :-1] / TEMPERATURE
            lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
            trained = torch.tensor(s.completion_mask[1:]).bool()
            lps.append(lp[trained])
            olds.append(torch.tensor(s.old_log_probs[1:])[trained].to(lp.dtype))
            advs.append(
                torch.full((int(trained.sum()),), float(torch.tensor(s.advantage, dtype=torch.float32)))
            )
        lp, old, adv = torch.cat(lps), torch.cat(olds), torch.cat(advs).to(lps[0].dtype)
        ratio = torch.exp(lp - old)
        per_token = -torch.min(ratio * adv, torch.clamp(ratio, 1 - EPS_LOW, 1 + EPS_HIGH) * adv)
        total = total + per_token.sum() / max(lp.numel(), 1) / accumulation
    return total


def reference_grads(model, micro_batches, accumulation):
    model.zero_grad(set_to_none=True)
    reference_loss(model, micro_batches, accumulation).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return grads


# ---------------------------------------------------------------------------------------------------- (a)
def lora_config() -> LoraConfig:
    return LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
    )


@pytest.mark.parametrize(
    "lora,attention", [(False, "sdpa"), (True, "eager")], ids=["full-sdpa", "lora-eager"]
)
def test_walk_equals_stock_trl_loss_fp32(model_dir, tmp_path, lora, attention):
    peft_config = lora_config() if lora else None
    trainer = make_trainer(model_dir, tmp_path, peft_config=peft_config, tree_attn_implementation=attention)
    assert trainer.model.config._attn_implementation == attention
    samples = rollouts(1, plain_model(model_dir), groups=2, per_group=3)
    micro_batches = [samples[:3], samples[3:]]
    grads, walked, batches = walk_grads(trainer, micro_batches, accumulation=2)

    stock = stock_trl_model(model_dir, TEMPERATURE)  # TRL's model set-up; its FA3 kernel as PyTorch
    if lora:  # (TRL wraps after patching its head; the adapter's weights copied from the trainer's)
        stock = get_peft_model(stock, lora_config())
        stock.load_state_dict(trainer.model.state_dict())
    register_cpu_tree_attention()
    trainer._metrics["train"].clear()
    losses = []
    for mb in micro_batches:  # stock TRL's compute_loss on TRL's own packing of the micro-batch
        loss = AsyncGRPOTrainer.compute_loss(
            trainer, stock, trl_micro_batch(mb, tiny_tokenizer().pad_token_id)
        )
        loss.backward()
        losses.append(float(loss))
    trl_grads = {n: p.grad for n, p in stock.named_parameters() if p.requires_grad}
    assert len(trl_grads) == (3 * 2 * 2 if lora else 25)  # (LoRA: A and B of 3 modules in 2 layers)
    error = relative_error(grads, trl_grads)
    assert error <= 1e-4, error
    assert [w.loss for w in walked] == pytest.approx(losses, rel=1e-5)

    trl_metrics = {k: list(trainer._metrics["train"][k]) for k in METRICS}
    trainer._metrics["train"].clear()
    for inputs, share in zip(batches, walked, strict=True):
        trainer._log_micro_batch(inputs, share)
    for name in METRICS:
        assert trainer._metrics["train"][name] == pytest.approx(trl_metrics[name], rel=1e-4, abs=1e-6), name
    clipped = trl_metrics["clip_ratio/region_mean"]
    assert 0 < max(clipped) < 1, clipped  # some tokens clipped, some not: both branches of the loss


@pytest.fixture(scope="module")
def fp64_trainer(model_dir, tmp_path_factory, fp64_exact):
    """A trainer whose policy is in float64 (HF's float32 casts kept in float64: conftest's ``fp64_exact``),
    walking with small budgets (chunked paths, packed leaves)."""
    budgets = dict(tree_block_size=16, tree_batch_tokens=24, tree_subtree_tokens=32)
    trainer = make_trainer(model_dir, tmp_path_factory.mktemp("fp64"), **budgets)
    trainer.model.double()
    return trainer


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), groups=st.integers(1, 3), per_group=st.integers(1, 4),
       accumulation=st.integers(1, 3))  # fmt: skip
def test_walk_equals_dense_fp64(fp64_trainer, seed, groups, per_group, accumulation):
    samples = rollouts(seed, fp64_trainer.model, groups=groups, per_group=per_group)
    cut = max(1, len(samples) // accumulation)
    micro_batches = [samples[i : i + cut] for i in range(0, len(samples), cut)]
    grads, walked, _ = walk_grads(fp64_trainer, micro_batches, accumulation)
    error = relative_error(grads, reference_grads(fp64_trainer.model, micro_batches, accumulation))
    assert error <= 1e-12, error


# ---------------------------------------------------------------------------------------------------- (b)
def test_trie_mixing_policy_versions(fp64_trainer):
    model = fp64_trainer.model
    samples = rollouts(7, model, groups=2, per_group=3, versions=(0, 1, 2))
    twin = samples[0]  # the same tokens generated again by a later policy: other behaviour log-probs
    lp = true_logps(model, twin.input_ids.tolist())
    old = [0.0] + (lp - 0.3).tolist()
    samples.append(rollout(twin.input_ids, twin.completion_mask, old, -0.5, version=3, group=twin.group_id))
    micro_batches = [samples[:4], samples[4:]]
    assert len({s.model_version for s in samples}) == 4
    trie = PrefixTrie.from_sequences([s.input_ids.tolist() for s in samples])
    assert trie.num_unique_tokens < trie.num_tokens  # versions share prefixes in one trie

    grads, walked, _ = walk_grads(fp64_trainer, micro_batches, accumulation=2)
    error = relative_error(grads, reference_grads(model, micro_batches, 2))
    assert error <= 1e-12, error
    first, last = walked[0], walked[1]
    assert torch.equal(first.logps[0], last.logps[-1])  # one policy, one set of log-probs for the twins
    ratio_first = torch.exp(first.logps[0] - first.samples[0].old_logps)
    ratio_last = torch.exp(last.logps[-1] - last.samples[-1].old_logps)
    # each its own importance weight: the twin's behaviour log-probs are the policy's minus 0.3
    assert torch.allclose(ratio_last, torch.full_like(ratio_last, torch.exp(torch.tensor(0.3)).item()))
    assert not torch.allclose(ratio_first, ratio_last)


# ---------------------------------------------------------------------------------------------------- (c)
def test_over_length_sample_is_trained_not_dropped(fp64_trainer):
    samples = rollouts(3, fp64_trainer.model, groups=2, per_group=2, long_tail=150)
    longest = max(len(s.input_ids) for s in samples)
    budget = 64
    assert longest > 2.5 * budget
    metrics = {"batch/dropped_oversize_total": []}
    list(TokenBudgetBatcher([as_example(s) for s in samples], 1, budget, metrics))
    assert metrics["batch/dropped_oversize_total"] == [1.0]  # TRL's token-budgeted batcher drops it

    micro_batches = [samples]
    grads, walked, _ = walk_grads(fp64_trainer, micro_batches, accumulation=1)
    assert len(walked[0].samples) == len(samples)
    assert len(walked[0].samples[0].tokens) == longest
    error = relative_error(grads, reference_grads(fp64_trainer.model, micro_batches, 1))
    assert error <= 1e-12, error  # walked in blocks of tree_block_size=16 tokens


# ---------------------------------------------------------------------------------------------------- (d)
def test_train_steps_equal_dense_sgd(model_dir, tmp_path):
    steps, per_batch, accumulation, lr = 3, 3, 2, 0.05
    reference = plain_model(model_dir)
    fresh = rollouts(11, reference, groups=4, per_group=3, versions=(0, 1))
    fresh += rollouts(12, reference, groups=3, per_group=3, versions=(1, 0))
    stale = rollout(fresh[0].input_ids, fresh[0].completion_mask, fresh[0].old_log_probs, 1.0, version=-10)
    queued = fresh[:4] + [stale] + fresh[4:]  # (the stale one is dropped by TRL's max_staleness)
    shape = dict(per_device_train_batch_size=per_batch, gradient_accumulation_steps=accumulation)
    trainer = make_trainer(
        model_dir, tmp_path, queued, max_steps=steps, learning_rate=lr, tree_check_gradients=True,
        trainer_class=CheckedTrainer, **shape,
    )  # fmt: skip
    before = {n: p.detach().clone() for n, p in reference.named_parameters()}
    prepared = []  # (each micro-batch is moved to the device by the Trainer, and once more for the walk)
    prepare = trainer._prepare_inputs
    trainer._prepare_inputs = lambda batch: prepared.append(1) or prepare(batch)
    trainer.train()
    assert len(prepared) == steps * (2 * accumulation - 1)  # (not again for the dense-path decision)

    used = steps * accumulation * per_batch
    for step in range(steps):
        chunk = fresh[step * accumulation * per_batch : (step + 1) * accumulation * per_batch]
        micro_batches = [chunk[i : i + per_batch] for i in range(0, len(chunk), per_batch)]
        if step == 0:
            assert {s.model_version for s in micro_batches[0]} == {0, 1}  # versions mixed in one step
        grads = reference_grads(reference, micro_batches, accumulation)
        with torch.no_grad():
            for n, p in reference.named_parameters():
                p -= lr * grads[n]
    trained = dict(trainer.model.named_parameters())
    update = {n: trained[n].detach() - before[n] for n in before}
    expected = {n: p.detach() - before[n] for n, p in reference.named_parameters()}
    error = relative_error(update, expected)
    assert error <= 1e-4, error
    assert max(u.abs().max() for u in update.values()) > 1e-4  # it did train

    logs = trainer.state.log_history
    assert sum(log.get("sample/dropped_stale_total", 0) for log in logs) == 1
    assert trainer.weight_transfer.syncs == steps + 1  # the cold sync, then one per step
    assert trainer.rollout_worker.versions == list(range(1, steps + 2)) and trainer.rollout_worker.stopped
    step_logs = [log for log in logs if "ratio" in log]
    assert len(step_logs) == steps
    assert step_logs[0]["tree/check_error"] <= 1e-4  # tree_check_gradients: the dense per-sample loss, once
    assert all("tree/check_error" not in log for log in step_logs[1:])
    assert len(trainer.gradient_errors) == steps and max(trainer.gradient_errors) <= 1e-4  # every step's walk
    for key in (*METRICS, "perf/fwd_bwd_s", "batch/trained_tokens_per_step", "tree/dedup_ratio", "loss"):
        assert all(key in log for log in step_logs), key
    assert used < len(fresh)


def test_collator_splits_by_lexicographic_partition(model_dir):
    samples = dist.distributed_rollouts(plain_model(model_dir))[:6]  # the long-prompt group and one other
    batch = SampleCollator(tiny_tokenizer().pad_token_id, 2).torch_call([[as_example(s) for s in samples]])
    width = batch["input_ids"].shape[0] // 2
    assert width == 3  # each rank's block padded to the same row count
    blocks = []
    for rank in range(2):
        rows = range(rank * width, (rank + 1) * width)
        real = [r for r in rows if batch["completion_mask"][r].any()]
        blocks.append({tuple(batch["input_ids"][r, : batch["lengths"][r]].tolist()) for r in real})
    groups = [{tuple(s.input_ids.tolist()) for s in samples[g * 3 : g * 3 + 3]} for g in range(2)]
    assert sorted(blocks, key=len) == sorted(groups, key=len)  # each group on one rank, whole
    assert batch["counts"][0].tolist()[0] == sum(int(s.completion_mask[1:].sum()) for s in samples)


@pytest.mark.parametrize("mode", ["coupled", pytest.param("coupled-dense", marks=pytest.mark.slow)])
def test_two_processes_equal_dense_sgd(model_dir, tmp_path, mode):
    """Two DDP processes (torchrun, gloo): each micro-batch split by the lexicographic partition, each rank
    walking its share of the step (``coupled-dense``: taking the dense path, DDP reducing it); the parameters
    equal one process's dense SGD on the same micro-batches."""
    ranks = dist.launch(tmp_path, model_dir, mode)

    reference = plain_model(model_dir)
    before = {n: p.detach().clone() for n, p in reference.named_parameters()}
    samples = dist.distributed_rollouts(reference)
    per_batch = dist.PER_RANK * dist.RANKS  # a micro-batch: every rank's share
    for step in range(dist.STEPS):
        chunk = samples[step * per_batch * dist.ACCUMULATION : (step + 1) * per_batch * dist.ACCUMULATION]
        micro_batches = [chunk[i : i + per_batch] for i in range(0, len(chunk), per_batch)]
        grads = reference_grads(reference, micro_batches, dist.ACCUMULATION)
        with torch.no_grad():
            for n, p in reference.named_parameters():
                p -= dist.LR * grads[n]
    expected = {n: p.detach() - before[n] for n, p in reference.named_parameters()}
    for rank in ranks:
        update = {n: rank["params"][n] - before[n] for n in before}
        error = relative_error(update, expected)
        assert error <= 1e-4, error
    assert len([log for log in ranks[0]["logs"] if "ratio" in log]) == dist.STEPS
    paths = [[log["tree/path"] for log in rank["logs"] if "tree/path" in log] for rank in ranks]
    assert paths[0] == paths[1] == [float(mode == "coupled-dense")] * dist.STEPS


# ---------------------------------------------------------------------------------------------------- (e)
def test_refusals(model_dir, tmp_path):
    with pytest.raises(ValueError, match="token_budget"):
        make_config(tmp_path, token_budget=64)
    with pytest.raises(ValueError, match="tree_attn_implementation"):
        make_config(tmp_path, model_init_kwargs={"attn_implementation": "eager"})
    with pytest.raises(ValueError, match="not supported by the tree walk"):
        make_config(tmp_path, tree_attn_implementation="tree_fa3")
    with pytest.raises(TypeError, match="model id or directory"):
        AsyncTreePPOTrainer(tiny_model(), args=make_config(tmp_path))
    with pytest.raises(ValueError, match="not a value model"):  # a causal LM passed as the value model
        AsyncTreePPOTrainer(str(model_dir), args=make_config(tmp_path), value_model=tiny_model(),
                            processing_class=tiny_tokenizer(), train_dataset=make_dataset(2),
                            rollout_worker=QueueWorker([]), weight_transfer=NoWeightTransfer())  # fmt: skip
    with pytest.raises(ValueError, match="use_liger_kernel"):
        make_trainer(model_dir, tmp_path, use_liger_kernel=True)
    with pytest.raises(ValueError, match='"always" is not supported with check_staleness_at_training'):
        make_trainer(model_dir, tmp_path, check_staleness_at_training=True, tree_dense_fallback="always")
    plain = dict(output_dir=str(tmp_path), bf16=False, use_cpu=True, report_to=[], max_steps=1)
    with pytest.raises(ValueError, match="token_budget"):  # a plain AsyncGRPOConfig is checked too
        AsyncTreePPOTrainer(str(model_dir), args=AsyncGRPOConfig(**plain, token_budget=64))
    trainer = AsyncTreePPOTrainer(
        str(model_dir), args=AsyncGRPOConfig(**plain), processing_class=tiny_tokenizer(),
        train_dataset=make_dataset(2), rollout_worker=QueueWorker([]), weight_transfer=NoWeightTransfer(),
    )  # fmt: skip
    assert trainer.model.config._attn_implementation == "sdpa"  # (TRL's FA3 tree attention switched off)
    assert "forward" not in vars(trainer.model)  # (TRL's fused-LM-head forward removed)

    moe_dir = tmp_path / "moe"
    tokenizer = tiny_tokenizer()
    moe = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
        num_experts_per_tok=2, output_router_logits=False, router_aux_loss_coef=0.01,
    ))  # fmt: skip
    moe.save_pretrained(moe_dir)
    with pytest.raises(ValueError, match="router_aux_loss_coef=0.0"):
        make_trainer(moe_dir, tmp_path)
