"""A TRL batch's rows as token sequences: what the trie and the partition see.

TRL keeps a batch as left-padded ``prompt_ids``/``prompt_mask`` and right-padded
``completion_ids``/``completion_mask`` (a multi-turn tool rollout is one flat completion). A row's sequence
is its prompt without the padding, then its completion up to the last unmasked token: exactly the tokens
the dense forward attends to (TRL's completion mask is ones then zeros).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


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
