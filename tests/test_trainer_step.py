"""The step seam on its own (trl_dta/train/step.py), driven as a third trainer would drive it (its module
docstring's example): sequences from two micro-batches with a per-sequence loss, against dense per-sequence
forwards; a retried walk keeps one result per sequence; an empty step walks nothing and logs nothing."""

from __future__ import annotations

import random
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from conftest import max_rel_diff

from trl_dta.compare import relative_error
from trl_dta.testing.grpo import tiny_model
from trl_dta.testing.oom import InjectOOM
from trl_dta.train.step import StepSequence, StepWalker

ARGS = SimpleNamespace(tree_block_size=8, tree_batch_tokens=8, tree_subtree_tokens=0)  # (the rest: defaults)


def sequences() -> list[StepSequence]:
    """Two micro-batches of three samples each, sharing a prompt, each scored from its prompt's end."""
    rng = random.Random(0)
    prompt = [rng.randrange(3, 500) for _ in range(12)]
    out = []
    for b in range(2):
        for _ in range(3):
            completion = [rng.randrange(3, 500) for _ in range(rng.randint(3, 9))]
            out.append(StepSequence(prompt + completion, b, 11))
    return out


def loss_fn(seqs, behaviour):
    """A clipped-ratio loss on per-token behaviour log-probs, normalised per micro-batch (an asynchronous
    GRPO trainer's shape): it only computes."""

    def loss(k, logps, entropies):
        ratio = torch.exp(logps - behaviour[k])
        return -(torch.clamp(ratio, 0.8, 1.2) * (1.0 + 0.5 * k)).sum() / (10.0 * (1 + seqs[k].batch))

    return loss


def dense_logps(model, s: StepSequence) -> torch.Tensor:
    ids = torch.tensor(s.tokens)[None]
    lsm = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    return lsm.gather(-1, ids[0, 1:, None])[s.score_from :, 0]


def dense(model, seqs, behaviour):
    """Per-sequence dense forwards: the gradients and each sequence's log-probs from score_from on."""
    model.zero_grad(set_to_none=True)
    fn, logps = loss_fn(seqs, behaviour), []
    for k, s in enumerate(seqs):
        lp = dense_logps(model, s)
        fn(k, lp, None).backward()
        logps.append(lp.detach())
    return {n: p.grad.clone() for n, p in model.named_parameters()}, logps


@pytest.fixture
def setup():
    model = tiny_model().train()
    seqs = sequences()
    torch.manual_seed(1)
    with torch.no_grad():  # 0.2 off the policy's: ratios on both sides of the clip, so gradients not all 0
        behaviour = [lp + 0.2 * torch.randn_like(lp) for lp in (dense_logps(model, s) for s in seqs)]
    return model, seqs, behaviour


def walk(model, seqs, behaviour, metrics=None):
    walker = StepWalker(ARGS, Accelerator(cpu=True), model)
    model.zero_grad(set_to_none=True)
    with walker.step(model, seqs, metrics=metrics) as step:
        step.backward(loss_fn(seqs, behaviour), entropies=True)
    return step, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_a_third_trainer_drives_the_seam(setup):
    model, seqs, behaviour = setup
    ref_grads, ref_logps = dense(model, seqs, behaviour)
    metrics = defaultdict(list)
    step, grads = walk(model, seqs, behaviour, metrics)
    assert max_rel_diff(grads, ref_grads) <= 1e-5
    assert relative_error(step.results.logps, ref_logps) <= 1e-5
    assert all(
        e is not None and e.shape == lp.shape for e, lp in zip(step.results.entropies, ref_logps, strict=True)
    )
    for key in ("tree/tokens", "tree/dedup_ratio", "tree/calls", "tree/block_size", "tree/oom_retries",
                "tree/peak_memory_gib", "tree/time_s"):  # fmt: skip
        assert len(metrics[key]) == 1, key
    assert metrics["tree/block_size"] == [8.0] and metrics["tree/oom_retries"] == [0.0]
    assert metrics["tree/dedup_ratio"][0] > 1.3  # the prompt is walked once


def test_a_retried_walk_keeps_one_result_per_sequence(setup):
    model, seqs, behaviour = setup
    ref, ref_grads = walk(model, seqs, behaviour)
    calls = []
    inner = loss_fn(seqs, behaviour)

    def counting(k, logps, entropies):
        calls.append(k)
        return inner(k, logps, entropies)

    with InjectOOM(model.model.layers[0], None, inside="backward") as count:
        walk(model, seqs, behaviour)
    walker = StepWalker(ARGS, Accelerator(cpu=True), model)
    metrics = defaultdict(list)
    model.zero_grad(set_to_none=True)
    with InjectOOM(model.model.layers[0], count.calls, inside="backward") as oom:  # the walk's last forward
        with walker.step(model, seqs, metrics=metrics) as step:
            step.backward(counting, entropies=True)
    assert oom.raised == 1 and len(calls) > len(seqs)  # some sequences were scored twice
    assert metrics["tree/oom_retries"] == [1.0]
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert max_rel_diff(grads, ref_grads) <= 1e-5
    # (the retry walks in smaller blocks: other fp32 sums than the first walk's, so fp32's parity bound)
    assert step.results.total(range(len(seqs))) == pytest.approx(
        ref.results.total(range(len(seqs))), rel=1e-5
    )


def test_an_empty_step_walks_nothing_and_logs_nothing(setup):
    model, _, _ = setup
    walker = StepWalker(ARGS, Accelerator(cpu=True), model)
    metrics = defaultdict(list)
    with walker.step(model, [], metrics=metrics) as step:
        assert step.logprobs(entropies=True) == ([], [])
        step.backward(lambda k, logps, entropies: logps.sum())
    assert step.trie is None and not metrics and walker.executors == {}


def test_bad_sequences_and_options_are_refused(setup):
    model, _, _ = setup
    walker = StepWalker(ARGS, Accelerator(cpu=True), model)
    with pytest.raises(ValueError, match="sequence 1 has 1 token"):
        walker.step(model, [StepSequence([1, 2], 0, 0), StepSequence([3], 0, 0)])
    with pytest.raises(ValueError, match="tree_block_size"):
        StepWalker(SimpleNamespace(tree_block_size=0), Accelerator(cpu=True), model)
    with pytest.raises(ValueError, match="fp16"):
        StepWalker(SimpleNamespace(fp16=True), Accelerator(cpu=True), model)
