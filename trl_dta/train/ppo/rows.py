"""A TRL batch's rows: as token sequences (what the trie and the partition see), and batches merged or
re-cut row-wise.

TRL keeps a batch as left-padded ``prompt_ids``/``prompt_mask`` and right-padded
``completion_ids``/``completion_mask`` (a multi-turn tool rollout is one flat completion), plus per-row and
per-token fields. A row's sequence is its prompt without the padding, then its completion up to the last
unmasked token: exactly the tokens the dense forward attends to (TRL's completion mask is ones then zeros).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

# per-token fields (right-padded to the completion width) and their padding values
PER_TOKEN = {
    "completion_ids": 0,
    "completion_mask": 0,
    "tool_mask": 1,
    "old_per_token_logps": 0.0,
    "ref_per_token_logps": 0.0,
    "sampling_per_token_logps": 0.0,
    "importance_sampling_ratio": 1.0,
    "advantages": 0.0,  # (B, T) with a value model; (B,) otherwise, kept as it is
    "old_values": 0.0,
    "returns": 0.0,
    "value_mask": 0.0,
}
PROMPT = ("prompt_ids", "prompt_mask")  # left-padded to the prompt width
# one value for the whole batch (the same on every rank), not per row
BATCH_WIDE = ("num_items_in_batch", "value_tokens")


class Row(NamedTuple):
    tokens: list[int]  # prompt (unpadded) + completion up to its last unmasked token
    prompt_length: int
    completion_length: int  # 0: nothing to score (e.g. a truncated row masked out)


def batch_rows(batch: dict) -> list[Row]:
    """Every row of ``batch`` (a dict with TRL's prompt/completion ids and masks) as a :class:`Row`."""
    rows = []
    for p_ids, p_mask, c_ids, c_mask in zip(
        batch["prompt_ids"],
        batch["prompt_mask"],
        batch["completion_ids"],
        batch["completion_mask"],
        strict=True,
    ):
        prompt = p_ids[p_mask.bool()]
        real = c_mask.nonzero()
        length = int(real[-1]) + 1 if real.numel() else 0
        rows.append(Row(torch.cat([prompt, c_ids[:length]]).tolist(), prompt.numel(), length))
    return rows


def _pad(t: torch.Tensor, width: int, value, left: bool = False) -> torch.Tensor:
    if t.dim() < 2 or t.shape[1] == width or t.shape[1] == 1:  # (B,) or per-sequence (B, 1) fields
        return t
    pad = t.new_full((t.shape[0], width - t.shape[1], *t.shape[2:]), value)
    return torch.cat([pad, t] if left else [t, pad], dim=1)


def concat_batches(batches: Sequence[dict]) -> dict:
    """One batch of the rows of ``batches`` (micro-batches of a generation batch, or every rank's batch),
    prompts left-padded and per-token fields right-padded to common widths. Values that are not per-row
    (``num_items_in_batch``, ``None``) are the same in every batch: the first one's is kept."""
    prompt_width = max(b["prompt_ids"].shape[1] for b in batches)
    completion_width = max(b["completion_ids"].shape[1] for b in batches)
    merged = {}
    for key, first in batches[0].items():
        values = [b[key] for b in batches]
        if key not in BATCH_WIDE and isinstance(first, torch.Tensor) and first.ndim > 0:
            if key in PROMPT:
                values = [_pad(v, prompt_width, 0, left=True) for v in values]
            elif key in PER_TOKEN:
                values = [_pad(v, completion_width, PER_TOKEN[key]) for v in values]
            merged[key] = torch.cat(values)
        elif isinstance(first, list):
            merged[key] = [x for v in values for x in v]
        else:
            merged[key] = first
    return merged


def take_rows(batch: dict, index: Sequence[int]) -> dict:
    """Rows ``index`` of ``batch``, in that order (values that are not per-row are kept as they are)."""
    order = torch.tensor(list(index), dtype=torch.long)
    taken = {}
    for key, value in batch.items():
        if key not in BATCH_WIDE and isinstance(value, torch.Tensor) and value.ndim > 0:
            taken[key] = value.index_select(0, order.to(value.device))
        elif isinstance(value, list):
            taken[key] = [value[i] for i in index]
        else:
            taken[key] = value
    return taken
