"""The layout of one call's segments for attention per segment (:class:`SegmentLayout`: per segment its
queries and the cache positions of its keys, as a variable-length kernel takes them, and the kernel that
attends them: :mod:`trl_dta.walk.attention.kernel`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import UnsupportedModelError
from .kernel import AttentionKernel
from .packing import PackedRow
from .sdpa import SDPA_SEGMENTS, per_segment_pays

ATTENTION = "trl_dta_segments"  # the attention function's name in transformers' AttentionInterface


def key_ranges(lengths: list[int], parents: tuple[int, ...], start: int) -> list[list[tuple[int, int]]]:
    """For each segment of a row of ``lengths`` (``parents[k]``: the index of segment ``k``'s parent in the
    row, -1 for the past; parents come first) on a past of ``start`` tokens: the cache positions it sees (the
    past, its ancestors' tokens, its own), as ascending ``[begin, end)`` ranges, adjacent ones merged."""
    offsets = np.concatenate([[0], np.cumsum(lengths)]) + start
    out = []
    for k in range(len(lengths)):
        chain, j = [], k
        while j >= 0:
            chain.append(j)
            j = parents[j]
        ranges = [[0, start]] if start else []
        for j in reversed(chain):  # in row order: ancestors come before their descendants
            lo, hi = int(offsets[j]), int(offsets[j + 1])
            if ranges and ranges[-1][1] == lo:
                ranges[-1][1] = hi
            else:
                ranges.append([lo, hi])
        out.append([(lo, hi) for lo, hi in ranges])
    return out


@dataclass(eq=False)
class SegmentLayout:
    """One call's segments (module docstring): host lengths, and the kernel's index tensors on the device.

    ``q_cu`` / ``k_cu``: cumulative query / key lengths [n + 1] (int32); ``key_index``: the cache positions
    of every segment's keys, concatenated [sum(k_lens)] (None: one segment that sees ``[0, start + tokens)``,
    read in place); ``row``: a packed row's index tensors (its mask, where the row is attended whole);
    ``split``: the sdpa kernel attends per segment (else the row at once); ``kernel``: what attends it (the
    walk's, resolved at its plan)."""

    start: int
    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]
    q_cu: torch.Tensor
    k_cu: torch.Tensor
    key_index: torch.Tensor | None
    row: PackedRow | None
    split: bool
    calls: int = 0  # attention calls made with it since the call began
    kernel: AttentionKernel = SDPA_SEGMENTS
    ran: str = ""  # the name of the kernel that attended its last call

    @property
    def tokens(self) -> int:
        return sum(self.q_lens)

    @staticmethod
    def host(lengths: list[int], parents: tuple[int, ...], start: int):
        """The layout's host arrays: ``(q_cu, k_cu, key_index or None, k_lens, split)``."""
        ranges = key_ranges(lengths, parents, start)
        k_lens = [sum(hi - lo for lo, hi in r) for r in ranges]
        q_cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        k_cu = np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int32)
        index = None
        if len(lengths) > 1:
            index = np.concatenate([np.arange(lo, hi) for r in ranges for lo, hi in r]).astype(np.int64)
        tokens = sum(lengths)
        needed = sum(q * k - q * (q - 1) // 2 for q, k in zip(lengths, k_lens, strict=True))
        split = len(lengths) == 1 or per_segment_pays(start, tokens, needed)
        return q_cu, k_cu, index, k_lens, split

    @classmethod
    def build(
        cls, lengths: list[int], parents: tuple[int, ...], start: int, device, row=None, kernel=SDPA_SEGMENTS
    ) -> SegmentLayout:
        """A layout built here, with its own host-to-device copies (the probe's, tests'); a walk builds its
        calls' layouts at once (:class:`~trl_dta.walk.inputs.WalkInputs`)."""
        q_cu, k_cu, index, k_lens, split = cls.host(lengths, parents, start)
        return cls(
            start,
            tuple(lengths),
            tuple(k_lens),
            torch.from_numpy(q_cu).to(device),
            torch.from_numpy(k_cu).to(device),
            None if index is None else torch.from_numpy(index).to(device),
            row,
            split,
            kernel=kernel,
        )

    def gather(self, k, v):
        """Every segment's keys and values, one after another [sum(k_lens), Hkv, D], from the call's
        [start + tokens, Hkv, D] (a lone segment's: as they are)."""
        if self.key_index is None:
            return k, v
        return k.index_select(0, self.key_index), v.index_select(0, self.key_index)

    def check_used(self, layers: int, name: str) -> None:
        """Refuse a call whose model did not attend through the registered function
        (:func:`~trl_dta.walk.attention.segment_attention.attention`) once per attention layer."""
        if self.calls != layers:
            raise UnsupportedModelError(
                f"{name}: {self.calls} of its {layers} attention layers called transformers' attention "
                f"function {ATTENTION!r}; a model with its own attention code cannot attend per segment."
            )
