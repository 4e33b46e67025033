""":class:`~trl_dta.AsyncTreePPOTrainer`'s micro-batches: TRL's rollout queue cut into fixed-count
micro-batches that keep every sample, whatever its length.

TRL's ``AsyncGRPOTrainer`` reads its rollout queue through ``RolloutQueueDataset`` (the staleness bound,
queue metrics) and a planner: ``TokenBudgetBatcher`` (drops a sample longer than ``token_budget``) or
``FixedCountBatcher``; its collator then packs each rank's row for its FA3 tree attention. Here the queue
dataset stays TRL's, :class:`SampleBatcher` takes ``per_device_train_batch_size`` samples per rank per
micro-batch and drops none, and :class:`SampleCollator` (TRL's collator, its metrics and epoch accounting
kept) splits them across ranks by the contiguous lexicographic partition and lays them out one per row: each
rank's walk builds its step's trie from them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from trl.experimental.async_grpo.async_grpo_trainer import DataCollatorForRollout
from trl.experimental.async_grpo.packing import TreeRow
from trl.trainer.utils import pad

from ...partition import lexicographic_partition


class VersionedQueue:
    """TRL's rollout queue, remembering the policy version of each sample taken from it (by its
    ``input_ids`` array, which ``RolloutQueueDataset`` yields as it is): the version travels with the sample
    to the step that trains it (TRL's queue dataset yields the sample without it). Everything else is the
    queue's."""

    def __init__(self, queue):
        self.queue, self.versions = queue, {}

    def get(self, *args, **kwargs):
        sample = self.queue.get(*args, **kwargs)
        self.versions[id(sample.input_ids)] = int(sample.model_version)
        return sample

    def __getattr__(self, name):
        return getattr(self.queue, name)


class SampleBatcher(torch.utils.data.IterableDataset):
    """Micro-batches of ``count`` samples from ``dataset`` (TRL's ``RolloutQueueDataset``), in queue order.
    No sample is dropped: the walk's memory is bounded by its own budgets, not by the samples' lengths.
    ``versions``: a :class:`VersionedQueue`'s, whose versions are added to the samples (``model_version``)."""

    def __init__(self, dataset, count: int, versions: dict | None = None):
        if count < 1:
            raise ValueError(
                f"a micro-batch needs at least one sample, got per_device_train_batch_size={count}"
            )
        self.dataset, self.count, self.versions = dataset, count, versions

    def __iter__(self):
        batch = []
        for sample in self.dataset:
            if self.versions is not None:
                sample = {**sample, "model_version": self.versions.pop(id(sample["input_ids"]), -1)}
            batch.append(sample)
            if len(batch) == self.count:
                yield batch
                batch = []


@dataclass
class SampleCollator(DataCollatorForRollout):
    """One micro-batch of rollout samples (all ranks' share) as tensors, one sample per row, right-padded.

    With ``num_processes`` ranks, the samples are split by :func:`~trl_dta.lexicographic_partition`
    (contiguous runs of their lexicographic order with balanced unique-token cost: samples that share a
    prefix are neighbours, cut apart only where the balance needs it) and laid out rank after rank, each run
    padded to the same row count with *zero-weight rows* (a copy of a sample with its completion mask zeroed:
    no loss term, no token counted, left out of the walk), so that TRL's dispatcher (``split_batches``)
    hands rank ``r`` the ``r``-th block.

    Keys: ``input_ids``, ``completion_mask``, ``old_log_probs`` (``[N, L]``, aligned with ``input_ids`` as
    TRL's samples are), ``lengths``, ``advantages``, ``versions`` (``[N]``: the policy version that generated
    each sample, -1 if unknown), ``rewards`` (``[N]``: each sample's reward, for a value model) and
    ``counts`` (``[N, 3]``, every row the
    micro-batch's trained tokens over all ranks, its unique tokens as TRL's packing counts them, and its
    number of samples: TRL's normaliser and ``perf/*`` accounting). Logs TRL's per-micro-batch sample
    metrics (one ``TreeRow`` per rank) and counts the trained prompt groups as TRL's collator does."""

    def torch_call(self, examples: list[Any]) -> dict[str, Any]:
        (samples,) = examples  # (batch_size=1 over SampleBatcher: one micro-batch)
        ids, masks, old = [], [], []
        for i, sample in enumerate(samples):
            ids.append(torch.as_tensor(sample["input_ids"], dtype=torch.long).flatten())
            masks.append(torch.as_tensor(sample["completion_mask"], dtype=torch.long).flatten())
            old.append(torch.as_tensor(sample["old_log_probs"], dtype=torch.float32).flatten())
            if not len(ids[-1]) == len(masks[-1]) == len(old[-1]):
                raise ValueError(
                    f"rollout sample {i}: input_ids ({len(ids[-1])}), completion_mask ({len(masks[-1])}) and "
                    f"old_log_probs ({len(old[-1])}) must have the same length."
                )
            if len(ids[-1]) < 2:
                raise ValueError(
                    f"rollout sample {i} has {len(ids[-1])} token(s); the walk needs two or more."
                )
        runs = [list(range(len(samples)))]
        if self.num_processes > 1:
            runs = lexicographic_partition([x.tolist() for x in ids], self.num_processes)
        rows = [TreeRow() for _ in runs]  # (TRL's packing of each rank's run: unique tokens and metrics)
        for row, run in zip(rows, runs, strict=True):
            for i in run:
                row.add(samples[i])
        width = max(len(run) for run in runs)
        order, weight = [], []
        for run in runs:
            filler = run[0] if run else 0
            order += run + [filler] * (width - len(run))
            weight += [1] * len(run) + [0] * (width - len(run))
        keep = torch.tensor(weight)
        advantages = torch.tensor([float(s["advantage"]) for s in samples], dtype=torch.float32)
        trained = sum(int(m[1:].sum()) for m in masks)
        counts = [float(trained), float(sum(len(row.tokens) for row in rows)), float(len(samples))]
        lengths = torch.tensor([len(ids[i]) for i in order])
        batch = {
            "input_ids": pad([ids[i] for i in order], padding_value=self.pad_token_id),
            "completion_mask": pad([masks[i] for i in order], padding_value=0) * keep[:, None],
            "old_log_probs": pad([old[i] for i in order], padding_value=0.0),
            "lengths": lengths,
            "advantages": advantages[order] * keep,
            "counts": torch.tensor([counts] * len(order)),
            "versions": torch.tensor([int(samples[i].get("model_version", -1)) for i in order]),
            "rewards": torch.tensor([float(samples[i].get("metrics", {}).get("reward", 0.0)) for i in order]),
        }
        self.groups_trained.update(s["group_id"] for s in samples)
        padded = torch.arange(batch["input_ids"].shape[1])[None, :] < lengths[:, None]
        self._log_metrics(rows=rows, all_examples=list(samples), padded=padded.long())
        return batch
