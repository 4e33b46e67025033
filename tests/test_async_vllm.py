"""AsyncTreePPOTrainer end to end on a CPU with the real engine: TRL's rollout worker keeps a vLLM server
busy while the walk trains a LoRA policy, the adapter synced to the server by path after every optimizer step.

One server per module (``python -m vllm.entrypoints.openai.api_server``,
:class:`trl_dta.testing.vllm_server.VLLMServer`: 127.0.0.1, a free port, ``--enable-lora``,
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``, fp32) serves the tiny Qwen3 saved to disk, for three runs: TRL's
coupled objective, AReaL's decoupled objective with ``check_staleness_at_training``, and the decoupled
objective with a value model. Each run numbers its policy versions from its own base (as TRL's resume does
against a running server: an adapter name is never published twice, so no run reads another's adapters or
their prefix cache) and unloads its last adapters when it ends. Nothing is stubbed: TRL's
``AsyncRolloutWorker`` (a spawned process posting to ``/v1/completions``), its queue and staleness bound, its
LoRA sync (``/pause``, the adapter saved and loaded by path with ``/v1/load_lora_adapter``, ``/resume``,
stale adapters unloaded) and the walk. The tests keep, per optimizer step, the micro-batches and the walk's
shares the trainer trained, the adapter's weights and its gradients, and each sample's policy version as it
left the queue, then check:

* the staleness bound: when a sample leaves the queue (where TRL checks it), its version is at least the
  trainer's version minus ``max_staleness``; when it trains, the trainer's version is the same or one later
  (accelerate's dispatcher fetches the next micro-batch before the sync that ends a step: TRL's own
  behaviour, docs/async.md), never more; with ``check_staleness_at_training``, no sample past the bound at
  training is in the walk (and every other one is), ``staleness/train_dropped`` counts them;
* some step trains on rollouts of an earlier policy version (before each sync the trainer waits, bounded,
  until the queue holds a step's worth of rollouts of the current version, so generation is ahead);
* the sync: each sample's behaviour log-probs (the server's) equal the log-probs of one adapter the trainer
  had, at the sample's policy version N or later, never later than the trainer's version when the sample left
  the queue, and the adapter moves them between versions. (Later than N: TRL's rollout worker labels a group
  with the version read when its first generation is dispatched, ``RolloutGroup(model_version=...)`` in
  ``_AsyncRolloutLoop._generate_loop``, while each request names the adapter live when it is sent,
  ``_request_model`` in ``_generate_one_turn``; a sync between the two serves a later adapter under the
  earlier label. The label errs old, never new, and the loss uses the served log-probs.)
* exact gradients: each step's gradients equal the loss recomputed densely on the same samples with plain HF
  forwards of a fresh PEFT model holding that step's adapter (fp32, <= 1e-4 relative per tensor): TRL's
  asynchronous loss (token-level clipped surrogate, its per-micro-batch token normaliser), or the decoupled
  one (its proximal log-probs by a no-gradient forward of that model, the importance weight capped);
* the decoupled objective's proximal log-probs (the walk's own, detached) equal the log-probs of the
  trainer's adapter at the step's start, and some tokens' importance weights are far from 1 (stale samples);
* with a value model (``trl_dta.value_model_from`` the served checkpoint: a ``*ForTokenClassification``,
  num_labels 1, zero head) the run completes, logs the value loss every step, and the critic's weights move;
* the server is stopped by its process id (after the module's last test), and each rollout worker's
  process has exited.

Not run here, GPU-only: full-weight sync (TRL's NCCL weight-transfer engine, taken when the policy is not a
PEFT model). Needs vLLM (``make venv-vllm``; ``make test-vllm`` runs it); skipped where it is not installed.
Every wait is bounded (server start, requests, the queue wait, ``pytest.mark.timeout``).
"""

from __future__ import annotations

import os
import time

import pytest
import requests

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
pytest.importorskip("vllm")

import torch  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM, TrainerCallback  # noqa: E402

from trl_dta import AsyncTreePPOConfig, AsyncTreePPOTrainer, value_model_from  # noqa: E402
from trl_dta.compare import relative_error  # noqa: E402
from trl_dta.testing.grpo import make_dataset, reward_fn, tiny_tokenizer  # noqa: E402
from trl_dta.testing.vllm import save_tiny_model  # noqa: E402
from trl_dta.testing.vllm_server import VLLMServer  # noqa: E402
from trl_dta.train.gradient_check import TINY  # noqa: E402

STEPS = 4
VALUE_STEPS = 2  # the run with a value model: it has to complete and train the critic
MAX_STALENESS = 2
BATCH = 4  # samples per micro-batch
ACCUMULATION = 2  # micro-batches per optimizer step
TOLERANCE = 1e-4  # gradients, walk vs dense (relative, per tensor; fp32)
LOGPROB_TOLERANCE = 1e-4  # the server's log-probs vs the adapter's (absolute; fp32 both)
QUEUE_WAIT_S = 120.0
STARTUP_S = 420.0  # the server's start: ~35 s on an idle 2-core machine, over 240 s next to other engines
LORA = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)


def _key(ids, old_log_probs) -> tuple:
    """A rollout sample's identity: its tokens and behaviour log-probs."""
    old = torch.as_tensor(old_log_probs, dtype=torch.float32)
    return tuple(int(t) for t in ids), bytes(old.numpy())


class VersionLog:
    """TRL's rollout queue as ``RolloutQueueDataset`` reads it (``get``, ``qsize``); keeps, by :func:`_key`,
    each sample's policy version and the trainer's version when it left the queue (when TRL checks the
    staleness bound)."""

    def __init__(self, inner, trainer):
        self.inner, self.trainer = inner, trainer
        self.versions: dict[tuple, list[tuple[int, int]]] = {}

    def get(self, *args, **kwargs):
        sample = self.inner.get(*args, **kwargs)
        entry = (sample.model_version, self.trainer.model_version)
        self.versions.setdefault(_key(sample.input_ids, sample.old_log_probs), []).append(entry)
        return sample

    def qsize(self) -> int:
        return self.inner.qsize()


class Recorder(TrainerCallback):
    """Per optimizer step, the adapter's weights and gradients before ``optimizer.step()``
    (``max_grad_norm=0``: nothing clipped). At each step's end (before TRL's sync, a callback added after
    this one), waits until the queue holds a step's worth of rollouts, so that the next step trains on
    rollouts of the version before it."""

    def __init__(self, samples_per_step: int):
        self.samples_per_step = samples_per_step
        self.trainer = None
        self.params: list[dict[str, torch.Tensor]] = []
        self.grads: list[dict[str, torch.Tensor]] = []
        self.queue_waits: list[float] = []
        self.worker_process = None  # (TRL's worker forgets its process when it stops)
        self.ended_at = None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        named = [(n, p) for n, p in self.trainer.model.named_parameters() if p.requires_grad]
        self.params.append({n: p.detach().clone() for n, p in named})
        self.grads.append({n: p.grad.detach().clone() for n, p in named})

    def on_step_end(self, args, state, control, **kwargs):
        self.worker_process = self.trainer.rollout_worker._process
        start = time.monotonic()
        while self.trainer.rollout_queue.qsize() < self.samples_per_step:
            if time.monotonic() - start > QUEUE_WAIT_S:
                raise TimeoutError(f"the rollout queue held < {self.samples_per_step} for {QUEUE_WAIT_S} s")
            time.sleep(0.2)
        self.queue_waits.append(time.monotonic() - start)

    def on_train_end(self, args, state, control, **kwargs):
        self.ended_at = time.monotonic()  # (TRL stops its rollout worker after this)


class RecordingTrainer(AsyncTreePPOTrainer):
    """Keeps each micro-batch it trains (step, the trainer's policy version, the collated micro-batch) and
    each training walk's shares."""

    trained: list[tuple[int, int, dict]]
    walks: list[tuple[int, list]]  # (step, the walk's share of each of its micro-batches: MicroBatchWalk)

    def training_step(self, model, inputs, num_items_in_batch=None):
        batch = {k: v.cpu() for k, v in inputs.items()}
        self.trained.append((self.state.global_step, self.model_version, batch))
        return super().training_step(model, inputs, num_items_in_batch)

    def _walk(self, model, batches, training):
        shares = super()._walk(model, batches, training)
        if training:
            self.walks.append((self.state.global_step, shares))
        return shares


def _rows(inputs: dict):
    """A collated micro-batch's samples: (input_ids, completion_mask, old_log_probs, advantage) per row."""
    for i, length in enumerate(inputs["lengths"].tolist()):
        yield (
            inputs["input_ids"][i, :length],
            inputs["completion_mask"][i, :length],
            inputs["old_log_probs"][i, :length],
            float(inputs["advantages"][i]),
        )


def _trained(mask: torch.Tensor) -> torch.Tensor:
    """Token positions p with a loss term (completion_mask 1, p >= 1)."""
    return torch.nonzero(mask[1:], as_tuple=True)[0] + 1


def _logps(model, ids: torch.Tensor) -> torch.Tensor:
    """log p(ids[p] | ids[:p]) for p >= 1, at index p - 1 (temperature 1): a plain forward, full logits."""
    logits = model(input_ids=ids[None]).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[1:, None])[:, 0]


def _dense_loss(model, inputs: dict, trainer: AsyncTreePPOTrainer, dropped=()) -> torch.Tensor:
    """The trainer's loss of one micro-batch (one process), densely. TRL's ``AsyncGRPOTrainer.compute_loss``:
    per trained token, -min(r A, clamp(r, 1 - epsilon_low, 1 + epsilon_high) A) with r = exp(logp - old),
    summed, over max(the micro-batch's trained tokens, 1), over the accumulation steps. With
    ``use_decoupled_loss`` (AReaL's): r = exp(logp - prox), prox by a no-gradient forward of ``model`` as it
    is, each term times w = exp(prox - old), over ``behav_imp_weight_cap`` masked to 0 or clamped.
    ``dropped``: rows left out of the sum (past the staleness bound at training), counted in the
    normaliser."""
    args = trainer.args
    total, tokens = 0.0, 0
    for row, (ids, mask, old, advantage) in enumerate(_rows(inputs)):
        trained = _trained(mask)
        tokens += trained.numel()
        if not trained.numel() or row in dropped:
            continue
        lp, base, weight = _logps(model, ids)[trained - 1], old[trained], 1.0
        if args.use_decoupled_loss:
            with torch.no_grad():
                base = _logps(model, ids)[trained - 1]
            weight, cap = torch.exp(base - old[trained]), args.behav_imp_weight_cap
            if args.behav_imp_weight_mode == "mask":
                weight = torch.where(weight > cap, 0.0, weight)
            else:
                weight = weight.clamp(max=cap)
        ratio = torch.exp(lp - base)
        clipped = torch.clamp(ratio, 1 - trainer.epsilon_low, 1 + trainer.epsilon_high)
        total = total - (torch.min(ratio * advantage, clipped * advantage) * weight).sum()
    return total / max(tokens, 1) / ACCUMULATION


def _sample_version(log: VersionLog, ids, old) -> tuple[int, int]:
    """(policy version, the trainer's version when it left the queue) of a trained sample."""
    entries = log.versions.get(_key(ids, old))
    assert entries, "a trained sample that did not come from the rollout queue"
    assert len({v for v, _ in entries}) == 1, "one rollout, two policy versions"
    return entries[-1]


class Run:
    """A finished training run against the module's server: the trainer, its :class:`Recorder` and
    :class:`VersionLog`, its first policy version ``base``, and timings."""

    def __init__(self, trainer, recorder, log, base, seconds):
        self.trainer, self.recorder, self.log, self.base, self.seconds = trainer, recorder, log, base, seconds


def _train(model_dir, server, out, base: int, steps: int = STEPS, value_model=None, **options) -> Run:
    """Train ``steps`` optimizer steps against ``server``, the policy versions numbered from ``base`` + 1
    (TRL's resume sets ``model_version`` the same way), then unload the run's adapters still loaded."""
    # (tree_dense_fallback "never": every step walks, and the walk is what is checked)
    args = AsyncTreePPOConfig(
        output_dir=str(out), vllm_server_base_url=server.base_url, vllm_server_timeout=60,
        request_timeout=60, heartbeat_stale_after_s=120.0, max_steps=steps, per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATION, num_generations=4, max_completion_length=12,
        max_staleness=MAX_STALENESS, temperature=1.0, optim="sgd", learning_rate=2.0, max_grad_norm=0.0,
        lr_scheduler_type="constant", logging_steps=1, report_to=[], save_strategy="no", seed=0,
        dtype="float32", bf16=False, use_cpu=True, tree_dense_fallback="never", **options,
    )  # fmt: skip
    recorder = Recorder(BATCH * ACCUMULATION)
    trainer = RecordingTrainer(
        model=model_dir, reward_funcs=reward_fn, args=args, train_dataset=make_dataset(16),
        processing_class=tiny_tokenizer(), peft_config=LoraConfig(**LORA), callbacks=[recorder],
        value_model=value_model,
    )  # fmt: skip
    assert trainer._lora_sync, "the adapter is synced by path (TRL's LoRA sync), not over NCCL"
    recorder.trainer, trainer.trained, trainer.walks = trainer, [], []
    log = VersionLog(trainer.rollout_queue, trainer)
    trainer.rollout_queue = log
    trainer.model_version = base
    trainer.rollout_worker.update_model_version(base)
    started = time.monotonic()
    try:
        trainer.train()
    finally:
        for version in range(base + 1, trainer.model_version + 1):  # (unloading a missing name is no error)
            name = f"trl-policy-v{version}"
            requests.post(f"{server.base_url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)
    return Run(trainer, recorder, log, base, time.monotonic() - started)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("async_vllm") / "model")


@pytest.fixture(scope="module")
def server(model_dir):
    """The module's server; stopped by its process id after the last test."""
    server = VLLMServer(
        model_dir, "--enable-lora", "--max-lora-rank", "8", "--max-loras", str(MAX_STALENESS + 2),
        "--max-model-len", "512", env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"},
        startup_timeout=STARTUP_S,
    )  # fmt: skip
    started = time.monotonic()
    with server:
        server_pid = server.process.pid
        print(f"\nasync e2e: server up in {time.monotonic() - started:.0f} s")
        yield server
    assert server.process is None
    with pytest.raises(ProcessLookupError):
        os.kill(server_pid, 0)


class DensePeft:
    """A fresh PEFT model (plain HF forwards, eager attention) that takes the adapter a run had before each
    optimizer step."""

    def __init__(self, model_dir, run: Run):
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        base.config._attn_implementation = "eager"
        self.model = get_peft_model(base, LoraConfig(**LORA))
        self.params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        self.run = run
        assert sorted(self.params) == sorted(run.recorder.grads[0]), (
            "the fresh PEFT model's adapter names differ"
        )

    def load(self, step: int) -> None:
        """The trainer's adapter before optimizer step ``step``: policy version ``base + step + 1``."""
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(self.run.recorder.params[step][n])


def _check_run(run: Run, steps: int) -> dict[int, list[int]]:
    """What every run must show: steps, syncs, the staleness bound at the queue, the rollout worker's exit.
    Returns each step's samples' policy versions."""
    trainer, recorder, base = run.trainer, run.recorder, run.base
    assert recorder.worker_process is not None and not recorder.worker_process.is_alive()
    assert trainer.state.global_step == steps
    assert trainer.model_version == base + steps + 1  # (the cold sync at the start, then one per step)
    assert len(recorder.grads) == steps and len(trainer.trained) == steps * ACCUMULATION
    versions: dict[int, list[int]] = {}
    for step, version, inputs in trainer.trained:
        assert version == base + step + 1  # (base + 1: the initial adapter, synced at the start)
        for ids, _, old, _ in _rows(inputs):
            sample_version, taken_at = _sample_version(run.log, ids, old)
            assert taken_at - MAX_STALENESS <= sample_version <= taken_at, (step, taken_at, sample_version)
            assert taken_at <= version <= taken_at + 1, (step, version, taken_at)
            versions.setdefault(step, []).append(sample_version)
    return versions


@pytest.mark.parametrize("objective", ["coupled", "decoupled"])
def test_async_tree_trainer_lora_on_real_server(model_dir, server, tmp_path, objective):
    """``coupled``: TRL's objective. ``decoupled``: ``use_decoupled_loss`` (cap 5, mask: the defaults) with
    ``check_staleness_at_training``."""
    decoupled = objective == "decoupled"
    options = dict(use_decoupled_loss=True, check_staleness_at_training=True) if decoupled else {}
    run = _train(model_dir, server, tmp_path / "out", base=100 if decoupled else 0, **options)
    trainer, recorder, log, base = run.trainer, run.recorder, run.log, run.base
    stopping = time.monotonic() - recorder.ended_at
    versions = _check_run(run, STEPS)
    late = sum(v > log.versions[_key(ids, old)][-1][1] for _, v, inputs in trainer.trained
               for ids, _, old, _ in _rows(inputs))  # fmt: skip
    stale = [step for step, vs in versions.items() if min(vs) < base + step + 1]
    assert stale, f"no step trained on rollouts of an earlier policy: {versions}"

    # -- staleness at training: rows past max_staleness when their step trains (from the recorded versions)
    over: dict[tuple[int, int], set[int]] = {}  # (step, micro-batch of the step) -> rows left out
    past_bound = 0
    for k, (step, version, inputs) in enumerate(trainer.trained):
        rows = enumerate(_rows(inputs))
        past = {
            r for r, (ids, _, old, _) in rows if version - _sample_version(log, ids, old)[0] > MAX_STALENESS
        }
        over[(step, k % ACCUMULATION)] = past if decoupled else set()  # (the coupled run trains them)
        past_bound += len(past)
    if decoupled:
        logged = [entry for entry in trainer.state.log_history if "staleness/train_max" in entry]
        assert len(logged) == STEPS
        assert sum(entry["staleness/train_dropped"] for entry in logged) == past_bound
        assert len(trainer.walks) == STEPS  # one walk per step (never the dense path: the staleness check)
        for step, shares in trainer.walks:
            assert len(shares) == ACCUMULATION
            for b, share in enumerate(shares):
                _, version, inputs = trainer.trained[step * ACCUMULATION + b]
                walked = {s.row for s in share.samples}
                with_tokens = {r for r, row in enumerate(_rows(inputs)) if _trained(row[1]).numel()}
                assert walked == with_tokens - over[(step, b)], (step, b)  # none past the bound trains
                for s in share.samples:
                    assert version - s.version <= MAX_STALENESS

    # -- exact gradients: dense recompute with plain HF forwards of a fresh PEFT model at each step's adapter
    dense = DensePeft(model_dir, run)
    worst = 0.0
    for step in range(STEPS):
        dense.load(step)
        for p in dense.params.values():
            p.grad = None
        for k, (s, _, inputs) in enumerate(trainer.trained):
            if s == step:
                loss = _dense_loss(dense.model, inputs, trainer, over[(step, k % ACCUMULATION)])
                if isinstance(loss, torch.Tensor):  # (not when every row of the micro-batch is left out)
                    loss.backward()
        assert max(float(p.grad.abs().max()) for p in dense.params.values()) > 0
        got, ref = [recorder.grads[step][n] for n in dense.params], [p.grad for p in dense.params.values()]
        worst = max(worst, relative_error(got, ref, tiny=TINY))

    # -- the decoupled objective's proximal log-probs: the trainer's adapter at the step's start
    proximal_error, weight_far, note = 0.0, 0.0, ""
    if decoupled:
        with torch.no_grad():
            for step, shares in trainer.walks:
                dense.load(step)
                for share in shares:
                    for s, walked_logps in zip(share.samples, share.logps, strict=True):
                        ids = torch.tensor(s.tokens)
                        own = _logps(dense.model, ids)[s.score_from + s.positions]
                        proximal_error = max(proximal_error, float((walked_logps.cpu() - own).abs().max()))
                        weight_far = max(weight_far, float((own - s.old_logps).abs().max()))
        step_logs = [entry for entry in trainer.state.log_history if "decoupled/imp_weight_mean" in entry]
        assert len(step_logs) == STEPS
        assert proximal_error <= LOGPROB_TOLERANCE
        assert weight_far >= 100 * LOGPROB_TOLERANCE  # stale samples: importance weights away from 1
        capped = [round(entry["decoupled/capped_ratio"], 3) for entry in step_logs]
        note = f"; proximal log-probs {proximal_error:.2e}, |log w| up to {weight_far:.2f}, capped {capped}"

    # -- the synced adapters: the server's behaviour log-probs are the trainer's adapter's at one version from
    # the sample's label to the trainer's version when it left the queue (later than the label: a sync between
    # TRL's labelling of the sample's group and the sample's request; module docstring)
    logprob_error, moved, relabelled = 0.0, 0.0, 0
    with torch.no_grad():
        for _, _, inputs in trainer.trained:
            for ids, mask, old, _ in _rows(inputs):
                label, taken_at = (v - base for v in _sample_version(log, ids, old))
                trained = _trained(mask)
                errors = {}
                for version in range(label, taken_at + 1):
                    dense.load(version - 1)
                    own = _logps(dense.model, ids)[trained - 1]
                    errors[version] = float((own - old[trained]).abs().max())
                served = min(errors, key=errors.get)
                relabelled += served != label
                logprob_error = max(logprob_error, errors[served])
                if served < STEPS:
                    dense.load(served - 1)
                    own = _logps(dense.model, ids)[trained - 1]
                    dense.load(served)
                    moved = max(moved, float((_logps(dense.model, ids)[trained - 1] - own).abs().max()))
    print(
        f"\nasync e2e ({objective}): trainer built and trained in {run.seconds:.0f} s (the worker's stop "
        f"{stopping:.0f} s of it); sample versions per step {versions} ({late} trained one version after "
        f"leaving the queue, {past_bound} past max_staleness at training); queue waits "
        f"{[round(w, 1) for w in recorder.queue_waits]} s; gradients {worst:.2e} (relative); behaviour "
        f"log-probs {logprob_error:.2e} ({relabelled} served by an adapter later than their label); the "
        f"adapter moves them by {moved:.2e}{note}"
    )
    assert worst <= TOLERANCE
    assert logprob_error <= LOGPROB_TOLERANCE
    assert moved >= 100 * LOGPROB_TOLERANCE


def test_async_tree_trainer_with_a_value_model_on_real_server(model_dir, server, tmp_path):
    """The decoupled objective with a value model (the served checkpoint as a ``*ForTokenClassification``,
    num_labels 1, its head zero): the run completes, the value loss is logged every step, the critic moves."""
    critic = value_model_from(str(model_dir), dtype=torch.float32)
    before = {n: p.detach().clone() for n, p in critic.named_parameters()}
    options = dict(use_decoupled_loss=True, value_learning_rate=0.05)  # (the policy's 2.0 diverges it)
    run = _train(model_dir, server, tmp_path / "out", 200, VALUE_STEPS, critic, **options)
    _check_run(run, VALUE_STEPS)
    trainer = run.trainer
    logs = [entry for entry in trainer.state.log_history if "value/loss" in entry]
    assert len(logs) == VALUE_STEPS and all("value/grad_norm" in entry for entry in logs)
    after = dict(trainer._critic.model.named_parameters())
    moved = {n: float((after[n].detach().cpu() - p).abs().max()) for n, p in before.items()}
    assert moved["score.weight"] > 0 and sum(m > 0 for m in moved.values()) > 1  # the head and the body
    assert max(float(g.abs().max()) for g in run.recorder.grads[-1].values()) > 0  # the policy's too
    print(
        f"\nasync e2e (value model): trainer built and trained in {run.seconds:.0f} s; value loss "
        f"{[round(entry['value/loss'], 4) for entry in logs]}; the critic moved by up to "
        f"{max(moved.values()):.2e}"
    )
