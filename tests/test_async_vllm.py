"""AsyncTreePPOTrainer end to end on a CPU with the real engine: TRL's rollout worker keeps a vLLM server
busy while the walk trains a LoRA policy, the adapter synced to the server by path after every optimizer step.

One server (``python -m vllm.entrypoints.openai.api_server``, :class:`trl_dta.testing.vllm_server.VLLMServer`:
127.0.0.1, a free port, ``--enable-lora``, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``, fp32) serves the tiny
Qwen3 saved to disk. Nothing is stubbed: TRL's ``AsyncRolloutWorker`` (a spawned process posting to
``/v1/completions``), its queue and staleness bound, its LoRA sync (``/pause``, the adapter saved and loaded
by path with ``/v1/load_lora_adapter``, ``/resume``, stale adapters unloaded) and the walk. The test keeps,
per optimizer step, the micro-batches the walk trained, the adapter's weights and its gradients, and each
sample's policy version as it left the queue, then checks:

* the staleness bound: when a sample leaves the queue (where TRL checks it), its version is at least the
  trainer's version minus ``max_staleness``; when it trains, the trainer's version is the same or one later
  (accelerate's dispatcher fetches the next micro-batch before the sync that ends a step: TRL's own
  behaviour, docs/async.md), never more;
* some step trains on rollouts of an earlier policy version (before each sync the trainer waits, bounded,
  until the queue holds a step's worth of rollouts of the current version, so generation is ahead);
* the sync: each sample's behaviour log-probs (the server's, under adapter ``trl-policy-v{N}``) equal the
  log-probs of the adapter the trainer had at version N, and the adapter moves them between versions;
* exact gradients: each step's gradients equal TRL's asynchronous loss (token-level clipped surrogate, its
  per-micro-batch token normaliser) recomputed densely on the same samples with plain HF forwards of a fresh
  PEFT model holding that step's adapter (fp32, <= 1e-4 relative per tensor);
* the server is stopped by its process id, and the rollout worker's process has exited.

Not run here, GPU-only: full-weight sync (TRL's NCCL weight-transfer engine, taken when the policy is not a
PEFT model). Needs vLLM (``make venv-vllm``; ``make test-vllm`` runs it); skipped where it is not installed.
Every wait is bounded (server start, requests, the queue wait, ``pytest.mark.timeout``).
"""

from __future__ import annotations

import os
import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
pytest.importorskip("vllm")

import torch  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM, TrainerCallback  # noqa: E402

from trl_dta import AsyncTreePPOConfig, AsyncTreePPOTrainer  # noqa: E402
from trl_dta.compare import relative_error  # noqa: E402
from trl_dta.testing.grpo import make_dataset, reward_fn, tiny_tokenizer  # noqa: E402
from trl_dta.testing.vllm import save_tiny_model  # noqa: E402
from trl_dta.testing.vllm_server import VLLMServer  # noqa: E402
from trl_dta.train.gradient_check import TINY  # noqa: E402

STEPS = 4
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
    """Keeps each micro-batch it trains: (step, the trainer's policy version, the collated micro-batch)."""

    trained: list[tuple[int, int, dict]]

    def training_step(self, model, inputs, num_items_in_batch=None):
        batch = {k: v.cpu() for k, v in inputs.items()}
        self.trained.append((self.state.global_step, self.model_version, batch))
        return super().training_step(model, inputs, num_items_in_batch)


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


def _dense_loss(model, inputs: dict, epsilon_low: float, epsilon_high: float) -> torch.Tensor:
    """TRL's ``AsyncGRPOTrainer.compute_loss`` of one micro-batch (one process), densely: per trained token,
    -min(r A, clamp(r, 1 - epsilon_low, 1 + epsilon_high) A) with r = exp(logp - old), summed, over
    max(the micro-batch's trained tokens, 1), over the accumulation steps."""
    total, tokens = 0.0, 0
    for ids, mask, old, advantage in _rows(inputs):
        trained = _trained(mask)
        tokens += trained.numel()
        if trained.numel():
            ratio = torch.exp(_logps(model, ids)[trained - 1] - old[trained])
            clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
            total = total - torch.min(ratio * advantage, clipped * advantage).sum()
    return total / max(tokens, 1) / ACCUMULATION


def _sample_version(log: VersionLog, ids, old) -> tuple[int, int]:
    """(policy version, the trainer's version when it left the queue) of a trained sample."""
    entries = log.versions.get(_key(ids, old))
    assert entries, "a trained sample that did not come from the rollout queue"
    assert len({v for v, _ in entries}) == 1, "one rollout, two policy versions"
    return entries[-1]


def _train(model_dir, server, out) -> tuple[RecordingTrainer, Recorder, VersionLog]:
    args = AsyncTreePPOConfig(
        output_dir=str(out), vllm_server_base_url=server.base_url, vllm_server_timeout=60,
        request_timeout=60, heartbeat_stale_after_s=120.0, max_steps=STEPS, per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATION, num_generations=4, max_completion_length=12,
        max_staleness=MAX_STALENESS, temperature=1.0, optim="sgd", learning_rate=2.0, max_grad_norm=0.0,
        lr_scheduler_type="constant", logging_steps=1, report_to=[], save_strategy="no", seed=0,
        dtype="float32", bf16=False, use_cpu=True,
    )  # fmt: skip
    recorder = Recorder(BATCH * ACCUMULATION)
    trainer = RecordingTrainer(
        model=model_dir, reward_funcs=reward_fn, args=args, train_dataset=make_dataset(16),
        processing_class=tiny_tokenizer(), peft_config=LoraConfig(**LORA), callbacks=[recorder],
    )  # fmt: skip
    assert trainer._lora_sync, "the adapter is synced by path (TRL's LoRA sync), not over NCCL"
    recorder.trainer, trainer.trained = trainer, []
    log = VersionLog(trainer.rollout_queue, trainer)
    trainer.rollout_queue = log
    trainer.train()
    return trainer, recorder, log


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("async_vllm") / "model")


def test_async_tree_trainer_lora_on_real_server(model_dir, tmp_path):
    server = VLLMServer(
        model_dir, "--enable-lora", "--max-lora-rank", "8", "--max-loras", str(MAX_STALENESS + 2),
        "--max-model-len", "512", env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"},
        startup_timeout=STARTUP_S,
    )  # fmt: skip
    started = time.monotonic()
    with server:
        server_pid = server.process.pid
        served_at = time.monotonic() - started
        trainer, recorder, log = _train(model_dir, server, tmp_path / "out")
        trained_at = time.monotonic() - started
        stopping = time.monotonic() - recorder.ended_at
    assert server.process is None
    with pytest.raises(ProcessLookupError):
        os.kill(server_pid, 0)
    assert recorder.worker_process is not None and not recorder.worker_process.is_alive()
    assert trainer.state.global_step == STEPS
    assert trainer.model_version == STEPS + 1  # (the cold sync at the start, then one per step)
    assert len(recorder.grads) == STEPS and len(trainer.trained) == STEPS * ACCUMULATION

    # -- each trained sample's policy version, and the staleness bound
    versions: dict[int, list[int]] = {}
    late = 0  # samples trained one version after they left the queue
    for step, version, inputs in trainer.trained:
        assert version == step + 1  # (v1: the initial adapter, synced at the start)
        for ids, _, old, _ in _rows(inputs):
            sample_version, taken_at = _sample_version(log, ids, old)
            assert taken_at - MAX_STALENESS <= sample_version <= taken_at, (step, taken_at, sample_version)
            assert taken_at <= version <= taken_at + 1, (step, version, taken_at)
            late += version > taken_at
            versions.setdefault(step, []).append(sample_version)
    stale = [step for step, vs in versions.items() if min(vs) < step + 1]
    assert stale, f"no step trained on rollouts of an earlier policy: {versions}"

    # -- exact gradients: dense recompute with plain HF forwards of a fresh PEFT model at each step's adapter
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    base.config._attn_implementation = "eager"
    dense = get_peft_model(base, LoraConfig(**LORA))
    params = {n: p for n, p in dense.named_parameters() if p.requires_grad}
    assert sorted(params) == sorted(recorder.grads[0]), "the fresh PEFT model's adapter names differ"

    def load(step: int) -> None:  # the trainer's adapter before optimizer step `step`: version step + 1
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(recorder.params[step][n])

    worst = 0.0
    for step in range(STEPS):
        load(step)
        for p in params.values():
            p.grad = None
        for s, _, inputs in trainer.trained:
            if s == step:
                _dense_loss(dense, inputs, trainer.epsilon_low, trainer.epsilon_high).backward()
        assert max(float(p.grad.abs().max()) for p in params.values()) > 0
        got, ref = [recorder.grads[step][n] for n in params], [p.grad for p in params.values()]
        worst = max(worst, relative_error(got, ref, tiny=TINY))

    # -- the synced adapters: the server's behaviour log-probs are the trainer's adapter's at that version
    logprob_error, moved = 0.0, 0.0
    with torch.no_grad():
        for _, _, inputs in trainer.trained:
            for ids, mask, old, _ in _rows(inputs):
                sample_version = _sample_version(log, ids, old)[0]
                trained = _trained(mask)
                load(sample_version - 1)
                own = _logps(dense, ids)[trained - 1]
                logprob_error = max(logprob_error, float((own - old[trained]).abs().max()))
                if sample_version < STEPS:
                    load(sample_version)
                    moved = max(moved, float((_logps(dense, ids)[trained - 1] - own).abs().max()))
    print(
        f"\nasync e2e: server up in {served_at:.0f} s, trainer built and trained in "
        f"{trained_at - served_at:.0f} s (the worker's stop {stopping:.0f} s of it); sample "
        f"versions per step {versions} ({late} trained one version after leaving the queue); queue waits "
        f"{[round(w, 1) for w in recorder.queue_waits]} s; gradients {worst:.2e} (relative); behaviour "
        f"log-probs {logprob_error:.2e}; the adapter moves them by {moved:.2e}"
    )
    assert worst <= TOLERANCE
    assert logprob_error <= LOGPROB_TOLERANCE
    assert moved >= 100 * LOGPROB_TOLERANCE
