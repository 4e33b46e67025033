"""Running out of memory (trl_dta/walk/memory/recovery.py): an out-of-memory error injected at the k-th model
call of a walk (trl_dta/testing/oom.py) is recovered within the walk, with the gradients of an uninjected
walk; one in the construction probe is raised as what it is, never as a refusal of the model. The 2-process
FSDP2 case is in tests/test_sharded.py (tests/sharded_worker.py, case ``qwen3-oom-rank0``)."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch
from conftest import make_model, max_rel_diff

from trl_dta import (
    PrefixTrie,
    TreeExecutor,
    TreePPOConfig,
    TreePPOTrainer,
    TreeSFTConfig,
    TreeSFTTrainer,
    UnsupportedModelError,
)
from trl_dta.compare import relative_error
from trl_dta.testing.grpo import (
    GradRecorder,
    ScriptedGenerationMixin,
    make_config,
    make_trainer,
    tiny_model,
    tiny_tokenizer,
)
from trl_dta.testing.oom import InjectOOM
from trl_dta.testing.sft import make_sft_config, tool_conversations
from trl_dta.walk.errors import WalkOutOfMemoryError
from trl_dta.walk.memory.recovery import OOMRecovery

BUDGETS = dict(block_size=4, batch_tokens=6)  # chunked backward (pops recompute) and small leaf batches
# A retried walk against an uninjected one of the same plan on the same inputs: the same fp32 operations in
# the same order in one process, so bit for bit on any CPU (a retry that kept or doubled a failed pass's
# gradients, or walked another plan, would not be).
SAME_PLAN = 0.0
# Against another plan (the starting budgets), or inputs computed another way: other orders of summation,
# whose fp32 rounding differs by CPU (AVX2/AVX-512 kernels): the suite's fp32 parity bound.
OTHER_PLAN = 1e-5


def sequences(seed: int = 0) -> list[list[int]]:
    """A shared system prompt, groups of sibling leaves, a long path (chunked at block size 4), a
    duplicate."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 61) for _ in range(5)]
    seqs = []
    for _ in range(3):
        prompt = system + [rng.randrange(3, 61) for _ in range(rng.randint(1, 4))]
        seqs += [prompt + [rng.randrange(3, 61) for _ in range(rng.randint(1, 8))] for _ in range(3)]
    seqs.append(system[:3] + list(range(10, 24)))
    seqs.append(list(seqs[0]))
    return seqs


def loss_fn(i, lp, ent):
    return -(lp * (1.0 + 0.1 * i)).sum() + (0.0 if ent is None else 0.01 * (ent**2).sum())


def grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def walk_grads(model, trie, start=None, count=None, **options):
    """The gradients of one uninjected walk (added to ``start``, if given); ``count``: an InjectOOM that
    counts its model calls."""
    executor = TreeExecutor(model, **options)
    set_grads(model, start)
    with count or contextlib.nullcontext():
        executor.backward(trie, loss_fn, entropies=True)
    return grads(model)


def set_grads(model, start):
    for name, p in model.named_parameters():
        p.grad = None if start is None else start[name].clone()


def settings(executor) -> tuple:
    """The budgets the executor's next walk starts from: the halved ones in effect after running out of
    memory, else those given by hand (None: derived)."""
    halved = executor.budgets.halved
    return executor.budgets.given if halved is None else tuple(vars(halved).values())


def layer0(model):
    return model.model.layers[0]


def training_steps_walked(patch: pytest.MonkeyPatch) -> None:
    """A trainer's training steps walk while its no-grad passes (the old log-probs of ``num_iterations=2``)
    still ask ``tree_dense_fallback``: the reference for a step walked after its dense path failed, with the
    same inputs. (A run with "never" walks its old log-probs too: their fp32 rounding differs from the dense
    pass's by ~1e-7, which moves the step's gradients by ~1e-6, more on some CPUs: issue 63.)"""
    from trl_dta.train.step import StepWalker

    prefer_dense = StepWalker.prefer_dense

    def prefer(self, *args, **kwargs):  # (timed=False: a no-grad pass's decision; else a training step's)
        return not kwargs.get("timed", True) and prefer_dense(self, *args, **kwargs)

    patch.setattr(StepWalker, "prefer_dense", prefer)


@pytest.fixture(scope="module")
def model():
    return make_model("qwen3", dtype=torch.float32).train()


# ------------------------------------------------------------------ the probe: raised, never refused
@pytest.mark.parametrize("error", [torch.OutOfMemoryError, MemoryError])
def test_an_oom_in_the_construction_probe_is_raised_never_refused(model, error):
    with InjectOOM(layer0(model), None) as count:
        reference = TreeExecutor(model)
    assert count.calls >= 10 and reference.pack_leaves  # dense forwards, determinism, segments, packing
    for at in range(1, count.calls + 1):  # every forward of the probe, the packing check's last
        with InjectOOM(layer0(model), at, error=error) as oom, pytest.raises(error) as raised:
            TreeExecutor(model)
        assert oom.raised == 1
        assert not isinstance(raised.value, UnsupportedModelError), f"call {at}: {raised.value}"


def test_the_trainer_reports_an_oom_in_its_probe_as_an_oom(tmp_path):
    """The issue's run: the 3rd forward of decoder layer 0 in the probe ended in ``UnsupportedModelError: ...
    fails on a plain input``. The probe ran at the executor's construction, in the first step; it now runs
    when the trainer is built (the executor takes its verdict)."""
    tree_cls = type("TreeScripted", (ScriptedGenerationMixin, TreePPOTrainer), {})
    model = tiny_model()
    with InjectOOM(model.model.layers[0], 3), pytest.raises(torch.OutOfMemoryError) as raised:
        make_trainer(tree_cls, make_config(tmp_path, config_cls=TreePPOConfig, max_steps=1), model=model)
    assert not isinstance(raised.value, UnsupportedModelError)


# ------------------------------------------------------------------ a walk: recovered exactly
CASES = {  # injector options: the first model call, a middle one, the last one, a pop's recompute, a backward
    "first": dict(at=1),
    "middle": dict(at="middle"),
    "last": dict(at="last"),
    "pop-recompute": dict(at=2, inside="_pop"),
    "backward": dict(at=3, backward=True),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("start", ["none", "accumulated"], ids=["no-grad-before", "grad-before"])
def test_an_oom_at_the_kth_call_gives_the_uninjected_gradients(model, case, start):
    trie = PrefixTrie.from_sequences(sequences())
    before = None
    if start == "accumulated":  # gradients already there (a walk of a step's second part): kept, added to
        torch.manual_seed(0)
        before = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    count = InjectOOM(layer0(model), None, record="_pop")
    original = walk_grads(model, trie, before, count, **BUDGETS)
    assert count.calls > 10 and 2 <= sum(count.stacks) < count.calls  # chunked: some calls recompute pops
    options = dict(CASES[case])
    options["at"] = {"middle": count.calls // 2, "last": count.calls}.get(options["at"], options["at"])
    executor = TreeExecutor(model, **BUDGETS)
    set_grads(model, before)
    with InjectOOM(layer0(model), **options) as oom:
        loss = executor.backward(trie, loss_fn, entropies=True)
    assert oom.raised == 1 and executor.oom_recovery.retried == 1
    assert settings(executor) == (2, 3, 256)  # (the subtree budget was derived: 512 on CPU)
    got = grads(model)
    same_plan = walk_grads(model, trie, before, block_size=2, batch_tokens=3, subtree_tokens=256)
    assert max_rel_diff(got, same_plan) <= SAME_PLAN
    assert max_rel_diff(got, original) <= OTHER_PLAN
    model.zero_grad(set_to_none=True)
    assert loss == pytest.approx(
        TreeExecutor(model, **BUDGETS).backward(trie, loss_fn, entropies=True),
        rel=OTHER_PLAN,  # (a retry walks halved budgets)
    )


def test_logprobs_are_recovered_too(model):
    trie = PrefixTrie.from_sequences(sequences(1))
    with torch.no_grad():
        ref, ref_ent = TreeExecutor(model, **BUDGETS).logprobs(trie, entropies=True)
        executor = TreeExecutor(model, **BUDGETS)
        with InjectOOM(layer0(model), 5) as oom:
            got, ent = executor.logprobs(trie, entropies=True)
    assert oom.raised == 1 and executor.oom_recovery.retried == 1
    assert relative_error(got, ref) <= OTHER_PLAN and relative_error(ent, ref_ent) <= OTHER_PLAN


def test_after_the_last_halving_a_clear_error_and_the_gradients_as_before(model):
    trie = PrefixTrie.from_sequences(sequences())
    torch.manual_seed(1)
    before = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    executor = TreeExecutor(model, oom_retries=2, **BUDGETS)
    set_grads(model, before)
    with InjectOOM(layer0(model), 1, times=10**6) as oom, pytest.raises(WalkOutOfMemoryError) as raised:
        executor.backward(trie, loss_fn, entropies=True)
    assert oom.raised == 3  # the walk and 2 retries
    assert isinstance(raised.value, torch.OutOfMemoryError) and isinstance(
        raised.value.__cause__, torch.OutOfMemoryError
    )
    message = str(raised.value)
    expected = ["block_size=4, batch_tokens=6, subtree_tokens=512", "block_size=1, batch_tokens=1",
                f"Longest path of the trie: {trie.max_depth} tokens", "Tried to allocate 20.00 MiB",
                "(in check_", "). The gradients are as they were"]  # fmt: skip
    for part in expected:
        assert part in message, message
    assert max_rel_diff(grads(model), before) == 0.0  # exactly as before the walk
    set_grads(model, None)


def test_at_the_smallest_budgets_it_gives_up_without_halving_further(model):
    trie = PrefixTrie.from_sequences(sequences())
    executor = TreeExecutor(model, block_size=1, batch_tokens=0, subtree_tokens=0)
    with (
        InjectOOM(layer0(model), 1, times=10**6) as oom,
        pytest.raises(WalkOutOfMemoryError, match="after 0 halv"),
    ):
        executor.backward(trie, loss_fn)
    assert oom.raised == 1
    model.zero_grad(set_to_none=True)


def test_opted_out_the_error_is_raised_unchanged(model):
    trie = PrefixTrie.from_sequences(sequences())
    executor = TreeExecutor(model, oom_retries=0, **BUDGETS)
    assert executor.oom_recovery is None
    with InjectOOM(layer0(model), 4), pytest.raises(torch.OutOfMemoryError) as raised:
        executor.backward(trie, loss_fn)
    assert type(raised.value) is torch.OutOfMemoryError and "injected" in str(raised.value)
    assert settings(executor) == (4, 6, None)
    model.zero_grad(set_to_none=True)


def test_smaller_budgets_stay_then_grow_back_never_above_the_ceiling(model):
    trie = PrefixTrie.from_sequences(sequences())
    executor = TreeExecutor(model, **BUDGETS)
    executor.oom_recovery = OOMRecovery(retries=3, grow_after=2)
    with InjectOOM(layer0(model), 1, times=2):  # two halvings in one walk
        executor.backward(trie, loss_fn)
    seen = [settings(executor)]
    for _ in range(5):
        executor.backward(trie, loss_fn)
        seen.append(settings(executor))
    # grown back all the way: the executor's own settings (the subtree budget derived again)
    assert seen == [(1, 1, 128), (1, 1, 128), (2, 3, 256), (2, 3, 256), (4, 6, None), (4, 6, None)]
    with torch.no_grad():  # a walk without gradients does not count towards growing back
        with InjectOOM(layer0(model), 1):
            executor.logprobs(trie)
        for _ in range(3):
            executor.logprobs(trie)
    assert settings(executor) == (2, 3, 256)
    executor.budgets.set_given(8, 8, 0)  # set by hand: the new ceiling
    with InjectOOM(layer0(model), 1):
        executor.backward(trie, loss_fn)
    for _ in range(2):
        executor.backward(trie, loss_fn)
    assert settings(executor) == (8, 8, 0)
    assert executor.oom_recovery.take_retries() == 4 and executor.oom_recovery.take_retries() == 0
    model.zero_grad(set_to_none=True)


# ------------------------------------------------------------------ the trainer: one SGD step
def test_trainer_step_with_an_oom_mid_walk_equals_the_uninjected_step(tmp_path, model_dir):
    tree_cls = type("TreeScripted", (ScriptedGenerationMixin, TreePPOTrainer), {})

    def run(name, at):
        recorder = GradRecorder()
        config = make_config(
            tmp_path / name, config_cls=TreePPOConfig, max_steps=1, tree_block_size=16, tree_batch_tokens=24,
            gradient_accumulation_steps=2, per_device_train_batch_size=2,
        )  # fmt: skip
        trainer = make_trainer(tree_cls, config, model=model_dir, callbacks=[recorder])
        with InjectOOM(trainer.model.model.layers[0], at, inside="backward") as oom:  # the gradient walk's
            trainer.train()
        params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        return trainer, recorder.grads[0], params, oom

    _, ref_grads, ref_params, count = run("plain", None)
    assert count.calls > 10
    # late in the walk: after some sequences' losses were collected (StepLosses must not count them twice)
    trainer, got_grads, got_params, oom = run("injected", count.calls * 2 // 3)
    assert oom.raised == 1
    assert trainer.state.log_history[0]["tree/oom_retries"] == 1.0
    assert settings(next(iter(trainer._walker.executors.values()))) == (8, 12, 256)  # kept for later steps
    assert max_rel_diff(got_grads, ref_grads) <= OTHER_PLAN
    # the run's parameters after one SGD step: lr x gradients OTHER_PLAN apart (a step taken twice: ~1e-2)
    assert relative_error(got_params, ref_params) <= OTHER_PLAN


def test_sft_step_with_an_oom_mid_walk_logs_what_the_uninjected_step_logs(tmp_path):
    """TreeSFTTrainer, one leaf per call (tree_batch_tokens=8, tree_subtree_tokens=0), 2 SGD steps of 3
    conversations: 10 forwards with autograd on, an out-of-memory error at the 5th (the first step's last,
    after its other sequences' losses were collected). The retried step logs the loss, entropy and accuracy
    of the uninjected one (a loss function that accumulated would count those sequences twice) and its
    retry; the parameters after both steps are the uninjected run's."""

    def run(name, at):
        config = make_sft_config(
            tmp_path / name, config_cls=TreeSFTConfig, tree_batch_tokens=8, tree_subtree_tokens=0,
            assistant_only_loss=True, per_device_train_batch_size=1, gradient_accumulation_steps=3,
        )  # fmt: skip
        trainer = TreeSFTTrainer(model=tiny_model(), args=config, train_dataset=tool_conversations(6),
                                 processing_class=tiny_tokenizer())  # fmt: skip
        with InjectOOM(trainer.model.model.layers[0], at, inside="backward") as oom:  # the gradient walks'
            trainer.train()
        params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        return [h for h in trainer.state.log_history if "loss" in h], params, oom

    ref_logs, ref_params, count = run("plain", None)
    assert count.calls == 10
    logs, params, oom = run("injected", 5)
    assert oom.raised == 1
    assert len(logs) == len(ref_logs) == 2
    for got, ref in zip(logs, ref_logs, strict=True):
        for key in ("loss", "entropy", "mean_token_accuracy"):
            assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), key
    assert [h["tree/oom_retries"] for h in logs] == [1.0, 0.0]
    assert [h["tree/oom_retries"] for h in ref_logs] == [0.0, 0.0]
    assert relative_error(params, ref_params) <= OTHER_PLAN  # (the retry walks halved budgets: another plan)


def test_a_walk_that_fails_otherwise_leaves_the_gradients_as_they_were(model):
    trie = PrefixTrie.from_sequences(sequences())
    torch.manual_seed(2)
    before = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    set_grads(model, before)
    calls = []

    def failing(i, lp, ent):
        calls.append(i)
        if len(calls) == 4:
            raise KeyError("a loss_fn bug")
        return loss_fn(i, lp, ent)

    with pytest.raises(KeyError, match="a loss_fn bug"):
        TreeExecutor(model, **BUDGETS).backward(trie, failing)
    assert max_rel_diff(grads(model), before) == 0.0
    set_grads(model, None)


def test_router_counts_are_recovered_too():
    from test_router_loss import moe_model

    moe = moe_model(dtype=torch.float32)
    trie = PrefixTrie.from_sequences(sequences(2))
    ref = TreeExecutor(moe, **BUDGETS).router_stats(trie)
    executor = TreeExecutor(moe, **BUDGETS)
    with InjectOOM(moe.model.layers[0], 6) as oom:
        got = executor.router_stats(trie)
    assert oom.raised == 1 and executor.oom_recovery.retried == 1
    assert got.layers == ref.layers and got.counts.keys() == ref.counts.keys()
    for node in ref.counts:
        assert torch.equal(got.counts[node], ref.counts[node])  # counted once, not twice
        assert torch.allclose(got.probs[node], ref.probs[node], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------- TRL's dense path (dense fallback)
@pytest.mark.parametrize("at", [1, 2])  # the step's first micro-batch, or its second (the first's dropped)
def test_a_dense_step_that_runs_out_of_memory_is_walked(tmp_path, model_dir, monkeypatch, at):
    """``tree_dense_fallback`` (here "always"): the dense forward of the first step's ``at``-th micro-batch
    runs out of memory; the step's gradients are dropped and the step is walked from its first micro-batch:
    bit for bit the gradients of the same run whose training steps walk from the start (the same walk on
    the same inputs), the second step dense again."""
    tree_cls = type("TreeScripted", (ScriptedGenerationMixin, TreePPOTrainer), {})

    def run(name, mode, at):
        recorder = GradRecorder()
        config = make_config(
            tmp_path / name, config_cls=TreePPOConfig, max_steps=2, tree_dense_fallback=mode,
            gradient_accumulation_steps=2, per_device_train_batch_size=2,
        )  # fmt: skip
        trainer = make_trainer(tree_cls, config, model=model_dir, callbacks=[recorder])
        with InjectOOM(trainer.model.model.layers[0], at, inside="_compute_loss") as oom:  # TRL's dense pass
            trainer.train()
        logs = [h for h in trainer.state.log_history if "tree/path" in h]
        return trainer, recorder.grads, logs, oom

    with monkeypatch.context() as patch:
        training_steps_walked(patch)
        _, walked, _, _ = run("walked", "always", None)
    _, never, _, _ = run("never", "never", None)
    _, dense, _, _ = run("dense", "always", None)
    trainer, got, logs, oom = run("injected", "always", at)
    assert oom.raised == 1 and trainer._walker.dense_oom_retries == 1
    assert [h.get("tree/dense_oom_retries", 0.0) for h in logs] == [1.0, 0.0]
    assert max_rel_diff(got[0], walked[0]) <= SAME_PLAN  # the step walked, as it is walked directly
    assert max_rel_diff(got[0], never[0]) <= OTHER_PLAN  # (its old log-probs walked there: other rounding)
    assert max_rel_diff(got[1], dense[1]) <= OTHER_PLAN  # (its parameters: the walk's, within fp32 rounding)


def test_a_dense_sft_step_that_runs_out_of_memory_is_walked(tmp_path):
    """The same for ``TreeSFTTrainer``: the dense path's out-of-memory error at the first step's second
    micro-batch; the step walked, its logged loss the walked run's."""

    def run(name, mode, at):
        config = make_sft_config(
            tmp_path / name, config_cls=TreeSFTConfig, assistant_only_loss=True, tree_dense_fallback=mode,
            per_device_train_batch_size=1, gradient_accumulation_steps=3,
        )  # fmt: skip
        trainer = TreeSFTTrainer(model=tiny_model(), args=config, train_dataset=tool_conversations(6),
                                 processing_class=tiny_tokenizer())  # fmt: skip
        with InjectOOM(trainer.model.model.layers[0], at, inside="compute_loss") as oom:
            trainer.train()
        params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        return [h for h in trainer.state.log_history if "loss" in h], params, oom

    walked_logs, walked, _ = run("walked", "never", None)
    logs, params, oom = run("injected", "always", 2)
    assert oom.raised == 1
    assert [h.get("tree/dense_oom_retries", 0.0) for h in logs] == [1.0, 0.0]
    assert logs[0]["loss"] == pytest.approx(walked_logs[0]["loss"], rel=1e-5)
    dense_logs, dense, _ = run("dense", "always", None)
    assert logs[1]["loss"] == pytest.approx(dense_logs[1]["loss"], rel=1e-5)
    assert relative_error(params, walked) <= OTHER_PLAN


def test_a_first_try_of_the_dense_path_far_slower_than_the_walk_is_cut_short(
    tmp_path, model_dir, monkeypatch
):
    """A first try of the dense path whose first micro-batch's forward takes longer than twice the walk's
    measured step is cut short (``StepWalker.dense_trial_too_slow``, forced here): the dense path is recorded
    that slow and the step is walked, with a walked step's gradients (``tree/dense_trials_cut``)."""
    from trl_dta.train.step import StepWalker

    tree_cls = type("TreeScripted", (ScriptedGenerationMixin, TreePPOTrainer), {})
    cut = []

    def too_slow(self, started):
        trial, self._trial = getattr(self, "_trial", False), False
        cut.append(trial)
        return trial  # (the first micro-batch of every first try: as if its forward had been that slow)

    def forced_try(prefer_dense):  # (every dense step a first try: "auto" after a walked step, as it were)
        def prefer(self, *args, **kwargs):
            dense = prefer_dense(self, *args, **kwargs)
            self._trial = dense and kwargs.get("timed", True)
            return dense

        return prefer

    def run(name, mode):
        recorder = GradRecorder()
        config = make_config(
            tmp_path / name, config_cls=TreePPOConfig, max_steps=1, tree_dense_fallback=mode,
            gradient_accumulation_steps=2, per_device_train_batch_size=2,
        )  # fmt: skip
        trainer = make_trainer(tree_cls, config, model=model_dir, callbacks=[recorder])
        trainer.train()
        return trainer, recorder.grads

    with monkeypatch.context() as patch:
        training_steps_walked(patch)
        _, walked = run("walked", "always")
    monkeypatch.setattr(StepWalker, "dense_trial_too_slow", too_slow)
    monkeypatch.setattr(StepWalker, "prefer_dense", forced_try(StepWalker.prefer_dense))
    trainer, got = run("cut", "always")
    assert cut == [True]  # (checked once: the step's first dense micro-batch)
    logs = [h for h in trainer.state.log_history if "tree/path" in h]
    assert logs[0]["tree/dense_trials_cut"] == 1.0 and "tree/dense_oom_retries" not in logs[0]
    assert max_rel_diff(got[0], walked[0]) <= SAME_PLAN


@pytest.mark.parametrize("injected", ["policy", "value model"])
def test_each_models_retries_are_logged_on_its_own_walk(tmp_path, injected):
    """TreePPOTrainer with a value model: an out-of-memory error in one model's walk is recovered there and
    counted on that model's metrics (``tree/oom_retries`` for the policy, ``value_tree/oom_retries`` for the
    value model), not the other's (the value model's walk, inside the policy's, once took both)."""
    from trl_dta import value_model_from

    tree_cls = type("TreeScripted", (ScriptedGenerationMixin, TreePPOTrainer), {})
    policy = tiny_model()
    critic = value_model_from(policy)
    config = make_config(tmp_path, config_cls=TreePPOConfig, max_steps=2, num_iterations=1)
    trainer = make_trainer(tree_cls, config, model=policy, value_model=critic)
    module = trainer.model if injected == "policy" else trainer._critic.model
    with InjectOOM(layer0(module), at=1) as oom:
        trainer.train()
    assert oom.raised == 1
    logs = [h for h in trainer.state.log_history if "tree/oom_retries" in h]
    retries = [sum(h[f"{p}oom_retries"] for h in logs) for p in ("tree/", "value_tree/")]
    assert retries == ([1.0, 0.0] if injected == "policy" else [0.0, 1.0])
