"""Re-partition a step's rollouts across data-parallel ranks along the lexicographic order.

TRL generates rollouts per rank. Before training, :func:`repartition` gathers every rank's rollouts (all
per-row and per-token fields the loss needs), splits the global batch with
:func:`~trl_dta.lexicographic_partition` (contiguous runs of the lexicographic order with balanced
unique-token cost, so groups that share prefixes stay on one rank) and keeps this rank's run.

Runs have unequal row counts, but TRL gathers (B,)-shaped metrics across ranks and splits a rank's batch
into equal micro-batches, so every rank pads its run to the same row count (a multiple of
``steps_per_generation``) with *zero-weight rows*: copies of a real row with an all-zero completion mask and
a zero advantage. Such a row adds nothing to any loss term, to ``num_items_in_batch`` or to a masked
metric; the tree walk skips it. Normalisers that count rows are given the configured per-device batch
size instead of the padded count (see ``RowLoss``), so the global objective is unchanged.
"""

from __future__ import annotations

import torch.distributed as dist
from trl.trainer.utils import split_tensor_dict

from ...partition import lexicographic_partition
from .rows import BATCH_WIDE, PER_TOKEN, PROMPT, batch_rows, concat_batches, take_rows

SUPPORTED = {*PROMPT, *PER_TOKEN, *BATCH_WIDE}


def partition_sequences(batch: dict) -> list[list[int]]:
    """Each row's tokens for partitioning (:func:`trl_dta.train.ppo.rows.batch_rows`; a row without a
    completion is its prompt, so it stays next to its group)."""
    return [row.tokens for row in batch_rows(batch)]


def _rows(batch: dict, index: list[int], count: int) -> dict:
    """Rows ``index`` of ``batch``, then zero-weight copies of row ``index[0]`` (or row 0) up to ``count``."""
    filler = index[0] if index else 0
    out = take_rows(batch, index + [filler] * (count - len(index)))
    real = len(index)
    out["completion_mask"] = out["completion_mask"].clone()
    out["completion_mask"][real:] = 0
    for key in ("advantages", "value_mask"):  # (a value model's mask: its padding rows train nothing)
        if key in out:
            out[key] = out[key].clone()
            out[key][real:] = 0
    return out


def repartition(batch: dict, multiple: int = 1, costs=None) -> tuple[dict, dict]:
    """This rank's run of the global batch's lexicographic order, padded with zero-weight rows to the same row
    count on every rank (a multiple of ``multiple``). Returns the batch and a few numbers for logging.
    ``costs``: rank 0's fitted call costs (:meth:`TreeExecutor.fitted_costs`; broadcast here, so that every
    rank cuts the same runs) balance the runs' predicted walk time instead of their unique tokens."""
    unknown = set(batch) - SUPPORTED
    if unknown:
        raise ValueError(f"cannot re-partition rollouts with fields {sorted(unknown)} (multimodal inputs?).")
    world, rank = dist.get_world_size(), dist.get_rank()
    device = batch["prompt_ids"].device
    local = {k: v.detach().cpu() for k, v in batch.items()}
    gathered: list[dict | None] = [None] * world
    dist.all_gather_object(gathered, local)
    merged = concat_batches(gathered)
    shared = [costs]
    dist.broadcast_object_list(shared, src=0)  # (each rank fits its own: one rank's decides)
    parts = lexicographic_partition(partition_sequences(merged), world, shared[0])
    count = max(len(p) for p in parts)
    count = -(-count // multiple) * multiple
    mine = {k: v.to(device) for k, v in _rows(merged, parts[rank], count).items()}
    info = {"rows": float(len(parts[rank])), "padded_rows": float(count - len(parts[rank]))}
    return mine, info


def lexicographic(micro_batches: list[dict]) -> list[dict]:
    """TRL's shuffled micro-batches of a generation batch, re-cut in lexicographic order of the rows
    (``tree_lexicographic_steps``: each optimizer step's rows share more prefixes)."""
    merged = concat_batches(micro_batches)
    seqs = partition_sequences(merged)
    order = sorted(range(len(seqs)), key=seqs.__getitem__)
    return split_tensor_dict(take_rows(merged, order), len(micro_batches))
