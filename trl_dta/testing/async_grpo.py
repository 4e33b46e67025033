"""Offline fixtures for :class:`~trl_dta.AsyncTreePPOTrainer` and stock TRL's ``AsyncGRPOTrainer`` on a CPU.

* :class:`QueueWorker`: a rollout worker (TRL's ``RolloutWorkerProtocol``, its extension point for custom
  rollout backends) that puts prepared ``RolloutSample`` objects on an in-process queue when the trainer
  starts it; :class:`NoWeightTransfer`: TRL's ``WeightTransferProtocol`` doing nothing (TRL's documented
  way to turn trainer-side weight sync off). Together they let the trainer run with no vLLM server.
* :func:`rollout`: a ``RolloutSample`` from token lists; :func:`synthetic_rollouts`: groups of them with
  shared prompts and turns, masked tool responses, behaviour log-probs near the policy's own and advantages
  of both signs.
* :class:`DenseCheck`: a mixin that checks every optimizer step's walk against the dense loss (e.g. a step
  that trains on rollouts of an earlier policy version, in an end-to-end run).
* :func:`stock_trl_model` and :func:`cpu_tree_attention`: the policy as stock TRL runs it (its
  ``tree_fa3`` attention and fused LM head), with the FA3 varlen kernel replaced by a plain PyTorch
  computation of the same attention, so that TRL's own packing, collator and ``compute_loss`` run on a CPU
  as the dense reference of the walk. :func:`trl_micro_batch` packs samples as TRL's planner and collator do.
"""

from __future__ import annotations

import math
import queue

import numpy as np
import torch
from transformers import AttentionInterface
from trl.experimental.async_grpo.async_grpo_trainer import DataCollatorForRollout
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample
from trl.experimental.async_grpo.packing import TREE_ATTENTION, TreeRow, register_tree_attention
from trl.trainer.utils import add_fused_lm_head, create_model_from_path

from ..train.gradient_check import GradientCheck


class QueueWorker:
    """TRL's ``RolloutWorkerProtocol`` over a fixed list of samples, queued in order at :meth:`start`. Records
    the model versions the trainer announces (``versions``)."""

    def __init__(self, samples):
        self.rollout_buffer: queue.Queue = queue.Queue()
        self.metrics_queue: queue.Queue = queue.Queue()
        self.samples = list(samples)
        self.versions: list[int] = []
        self.stopped = False

    def start(self) -> None:
        for sample in self.samples:
            self.rollout_buffer.put(sample)

    def stop(self) -> None:
        self.stopped = True

    def update_model_version(self, model_version: int) -> None:
        self.versions.append(model_version)

    def check_health(self, stale_after_s: float) -> None:
        raise RuntimeError("QueueWorker: the trainer asked for more rollout samples than were prepared.")


class DenseCheck:
    """Put in front of :class:`~trl_dta.AsyncTreePPOTrainer` (``class T(DenseCheck, AsyncTreePPOTrainer)``;
    one process): every training walk (one per optimizer step) is compared with the dense per-sample loss of
    the same micro-batches (:meth:`~trl_dta.AsyncTreePPOTrainer.dense_loss`, through
    :class:`~trl_dta.train.gradient_check.GradientCheck`, which keeps the walk's gradients as they are).
    ``gradient_errors``: the relative error of each step, in order."""

    def _walk(self, model, batches, training):
        if not training:
            return super()._walk(model, batches, training)
        check = GradientCheck(self.dense_loss, model, batches, tolerance=math.inf)
        out = super()._walk(model, batches, training)
        self.__dict__.setdefault("gradient_errors", []).append(check.finish())
        return out


class NoWeightTransfer:
    """TRL's ``WeightTransferProtocol``, sending nothing (no server to sync). Counts the syncs. It reads the
    weights' iterator to its end, as a real transfer does: under FSDP2 each weight is gathered from every rank
    (``full_tensor``), and the other ranks gather them too (TRL's weight sync), so an iterator left unread
    would leave their gathers unmatched."""

    def __init__(self):
        self.syncs = 0

    def init_weight_transfer(self) -> None:
        pass

    def pause(self) -> None:
        pass

    def send_weights(self, iterator) -> None:
        for _ in iterator:
            pass
        self.syncs += 1

    def resume(self) -> None:
        pass

    def destroy(self) -> None:
        pass


def rollout(tokens, completion_mask, old_logps, advantage: float, version: int = 0, group: int = 0):
    """A ``RolloutSample`` (TRL's rollout worker's type) from a token list, its completion mask and its
    behaviour log-probs (both aligned with ``tokens``)."""
    return RolloutSample(
        prompt=[],
        completion=[],
        input_ids=np.asarray(tokens, dtype=np.int64),
        completion_mask=np.asarray(completion_mask, dtype=np.int64),
        old_log_probs=np.asarray(old_logps, dtype=np.float32),
        advantage=float(advantage),
        model_version=version,
        group_id=group,
        metrics={"reward": float(advantage)},
    )


def as_example(sample: RolloutSample) -> dict:
    """The dict TRL's ``RolloutQueueDataset`` yields for a sample."""
    return {
        "input_ids": sample.input_ids,
        "completion_mask": sample.completion_mask,
        "old_log_probs": sample.old_log_probs,
        "advantage": sample.advantage,
        "group_id": sample.group_id,
        "metrics": sample.metrics,
    }


def cpu_tree_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    *,
    tree_kv_index,
    tree_cu_seqlens_q,
    tree_cu_seqlens_k,
    tree_max_seqlen_q=None,
    tree_max_seqlen_k=None,
    scaling=None,
    sliding_window=None,
    softcap=None,
    **kwargs,
):
    """TRL's tree attention (``trl.experimental.async_grpo.packing.tree_attention``) in plain PyTorch: each
    segment's queries attend causally (bottom-right aligned, as FA3's varlen kernel with ``causal=True``) to
    the K/V of its root-to-segment path, gathered by ``tree_kv_index``."""
    if sliding_window or softcap:
        raise NotImplementedError("cpu_tree_attention: no sliding window or softcap")
    q, k, v = (x.transpose(1, 2)[0] for x in (query, key, value))  # [N, heads, D]
    k, v = k.index_select(0, tree_kv_index), v.index_select(0, tree_kv_index)
    repeat = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    cu_q, cu_k = tree_cu_seqlens_q.tolist(), tree_cu_seqlens_k.tolist()
    for s in range(len(cu_q) - 1):
        (qa, qb), (ka, kb) = cu_q[s : s + 2], cu_k[s : s + 2]
        lq, lk = qb - qa, kb - ka
        qs = q[qa:qb].transpose(0, 1)
        ks, vs = (x[ka:kb].repeat_interleave(repeat, dim=1).transpose(0, 1) for x in (k, v))
        mask = torch.arange(lk, device=q.device)[None, :] <= (
            lk - lq + torch.arange(lq, device=q.device)[:, None]
        )
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scaling)
        out[qa:qb] = o.transpose(0, 1)
    return out.unsqueeze(0), None


def register_cpu_tree_attention() -> None:
    """Register :func:`cpu_tree_attention` under TRL's attention name (call again after constructing a TRL
    async trainer: its ``__init__`` registers the FA3 one)."""
    register_tree_attention()
    AttentionInterface.register(TREE_ATTENTION, cpu_tree_attention)


def stock_trl_model(model_dir, temperature: float = 1.0, dtype=torch.float32):
    """The policy as TRL's ``AsyncGRPOTrainer.__init__`` loads it (``tree_fa3`` attention, fused LM head with
    log-probs and entropies), with :func:`cpu_tree_attention` registered under TRL's attention name."""
    register_cpu_tree_attention()
    model = create_model_from_path(
        str(model_dir), device_map=None, attn_implementation=TREE_ATTENTION, dtype=dtype
    )
    add_fused_lm_head(model, temperature=temperature, outputs=("log_probs", "entropy"))
    return model


def trl_micro_batch(samples, pad_token_id: int) -> dict:
    """``samples`` packed as TRL's planner and collator pack one micro-batch on one rank (one ``TreeRow``)."""
    row = TreeRow()
    for sample in samples:
        row.add(as_example(sample))
    return DataCollatorForRollout(pad_token_id, 1).torch_call([[row]])


@torch.no_grad()
def policy_logps(model, tokens, temperature: float = 1.0) -> torch.Tensor:
    """``log p(tokens[t] | tokens[:t])`` for ``t >= 1`` at ``temperature`` (index ``t - 1`` scores ``t``), in
    float64, by a plain forward."""
    ids = torch.tensor([list(tokens)], device=next(model.parameters()).device)
    logits = model(input_ids=ids).logits[0, :-1].double() / temperature
    return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0].cpu()


def synthetic_rollouts(
    seed,
    model,
    temperature: float = 1.0,
    groups=2,
    per_group=3,
    versions=(0,),
    prompt=6,
    long_tail=0,
    noise=0.4,
    vocab=(10, 590),
):
    """Rollout samples in ``groups`` of ``per_group`` that share a prompt (``prompt`` tokens, or one length
    per group); even members also share a first turn; the second member has a masked tool response inside
    its completion. Behaviour log-probs are ``model``'s own plus uniform noise of ``noise`` (importance
    ratios on both sides of a 0.2 clipping range); advantages of both signs (float32 values); versions
    cycle through ``versions``. ``long_tail``: extra completion tokens on the first sample."""
    g = torch.Generator().manual_seed(seed)

    def rand(n):
        return torch.randint(vocab[0], vocab[1], (n,), generator=g).tolist()

    out = []
    for group in range(groups):
        length = prompt if isinstance(prompt, int) else prompt[group]
        head, turn = rand(length), rand(3)
        for m in range(per_group):
            tail = rand(int(torch.randint(2, 7, (1,), generator=g)) + (long_tail if not out else 0))
            completion = (turn if m % 2 == 0 else []) + tail
            mask = [1] * len(completion)
            if m == 1:  # a tool response (masked) between two generated parts
                completion, mask = completion[:1] + rand(4) + completion[1:], [1] + [0] * 4 + mask[1:]
            tokens, mask = head + completion, [0] * length + mask
            lp = policy_logps(model, tokens, temperature)
            wobble = (torch.rand(len(tokens), generator=g, dtype=torch.float64) * 2 - 1) * noise
            old = [0.0] + (lp + wobble[1:]).tolist()
            advantage = float(torch.randn(1, generator=g))
            version = versions[len(out) % len(versions)]
            out.append(rollout(tokens, mask, old, advantage, version=version, group=group))
    return out
