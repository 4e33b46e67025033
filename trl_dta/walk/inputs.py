"""The index tensors of a walk's calls, built on the host and copied to the device once per walk.

Every call of the walk needs small integer tensors: its tokens' ids and, for a packed row, each token's
position, the index of its segment in the row and which segments are ancestors of which (the row's
tree-shaped mask is built from these two on the device, :mod:`trl_dta.walk.packing`). Made per call from
Python lists (``torch.tensor(list, device=cuda)``), each would be a pageable copy that makes the host wait
for the device, so that it cannot queue the next kernels while the current ones run. :class:`WalkInputs`
builds them all for a plan at once in one host tensor, pinned and copied with ``non_blocking=True``; each
call then takes views of it (slices at Python offsets: no synchronisation).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..trie import PrefixTrie
from .plan import PackedSubtree, Push, Segment, SiblingLeaves, Step


@dataclass(frozen=True)
class PackedRow:
    """A packed row's index tensors on the device: ``positions`` [T], ``segment`` [T] (each token's segment
    in the row) and ``ancestor`` [n, n] (bool: ``[k, j]`` when segment ``j`` is ``k`` or an ancestor of
    ``k`` in the row)."""

    positions: torch.Tensor
    segment: torch.Tensor
    ancestor: torch.Tensor

    @classmethod
    def siblings(cls, lengths: list[int], start: int, device) -> PackedRow:
        """Sibling leaves of the given lengths on a past of ``start`` tokens, built here (the probe's row)."""
        positions = torch.cat([torch.arange(start, start + n) for n in lengths])
        segment = torch.cat([torch.full((n,), k) for k, n in enumerate(lengths)])
        ancestor = torch.eye(len(lengths), dtype=torch.bool)
        return cls(positions.to(device), segment.to(device), ancestor.to(device))


class WalkInputs:
    """The ids of every segment of ``plan`` and the index tensors of its packed rows (``packed`` steps: those
    the executor forwards as one packed row), on ``device``, from one host-to-device copy."""

    def __init__(self, trie: PrefixTrie, plan: list[Step], device: torch.device, packed: bool):
        chunks: list = []  # of numpy arrays and lists: the host tensor, in order
        size = 0
        self._ids: dict[Segment, tuple[int, int]] = {}
        rows: dict[int, tuple[int, int, int]] = {}  # id(step): offsets of positions, segment index, ancestor
        for step in plan:
            segments = (step.segment,) if isinstance(step, Push) else getattr(step, "segments", ())
            for s in segments:
                if s not in self._ids:
                    self._ids[s] = (size, s.num_tokens)
                    chunks.append(trie.sequences[s.node.seq][s.start : s.end])
                    size += s.num_tokens
            is_row = isinstance(step, PackedSubtree) or isinstance(step, SiblingLeaves) and len(segments) > 1
            if packed and is_row:
                parents = step.parents if isinstance(step, PackedSubtree) else (-1,) * len(segments)
                n, tokens = len(segments), sum(s.num_tokens for s in segments)
                ancestor = np.eye(n, dtype=np.int64)
                for k, parent in enumerate(parents):  # parents come first
                    if parent >= 0:
                        ancestor[k] |= ancestor[parent]
                chunks += [np.arange(s.start, s.end) for s in segments]  # each token at its own position
                chunks += [np.full(s.num_tokens, k) for k, s in enumerate(segments)]
                chunks.append(ancestor.ravel())
                rows[id(step)] = (size, size + tokens, size + 2 * tokens, n)
                size += 2 * tokens + n * n
        host = (
            torch.from_numpy(np.concatenate(chunks).astype(np.int64))
            if chunks
            else torch.zeros(0, dtype=torch.long)
        )
        if device.type == "cuda":
            host = host.pin_memory()
        self._flat = host.to(device, non_blocking=True)
        self._rows = rows

    def ids(self, segment: Segment) -> torch.Tensor:
        """The token ids [L] of ``segment``."""
        begin, n = self._ids[segment]
        return self._flat[begin : begin + n]

    def row(self, step: Step) -> PackedRow:
        """The index tensors of a packed step."""
        positions, segment, ancestor, n = self._rows[id(step)]
        flat = self._flat
        return PackedRow(
            flat[positions:segment], flat[segment:ancestor], flat[ancestor : ancestor + n * n].view(n, n) > 0
        )
