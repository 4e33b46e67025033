"""The index tensors of a walk's calls, built on the host and copied to the device once per walk.

Every call of the walk needs small integer tensors: its tokens' ids and, for a packed row, each token's
position, the index of its segment in the row and which segments are ancestors of which (the row's
tree-shaped mask is built from these two on the device, :mod:`trl_dta.walk.attention.packing`). Made per call
from Python lists (``torch.tensor(list, device=cuda)``), each would be a pageable copy that makes the host
wait for the device, so that it cannot queue the next kernels while the current ones run. :class:`WalkInputs`
builds them all for a plan at once in one host tensor, pinned and copied with ``non_blocking=True``; each
call then takes views of it (slices at Python offsets: no synchronisation). Where the model attends per
segment (:mod:`trl_dta.walk.attention.segment_attention`), each call's
:class:`~trl_dta.walk.attention.segment_attention. SegmentLayout` (its cumulative lengths, int32 viewed in the
same tensor, and its key index) is built the same way.
"""

from __future__ import annotations

import numpy as np
import torch

from ..trie import PrefixTrie
from .attention.packing import PackedRow
from .attention.segment_layout import SegmentLayout
from .plan import PackedSubtree, Push, Segment, SiblingLeaves, Step


class WalkInputs:
    """The ids of every segment of ``plan`` and the index tensors of its packed rows (``packed`` steps: those
    the executor forwards as one packed row), on ``device``, from one host-to-device copy; where the walk's
    ``kernel`` attends per segment, every one-row call's :class:`~trl_dta.walk.attention.segment_layout.
    SegmentLayout` too, attended by it (:meth:`layout`)."""

    def __init__(self, trie: PrefixTrie, plan: list[Step], device: torch.device, packed: bool, kernel=None):
        self._chunks: list = []  # of numpy arrays and lists: the host tensor, in order
        self._size = 0
        self._ids: dict[Segment, tuple[int, int]] = {}
        rows: dict[int, tuple[int, int, int, int]] = {}  # id(step): offsets of positions, segment, ancestor
        layouts: dict[object, tuple] = {}  # a push's segment, or id(step): the layout's host parts
        for step in plan:
            steps = (step.segment,) if isinstance(step, Push) else getattr(step, "segments", ())
            for s in steps:
                if s not in self._ids:
                    self._ids[s] = (self._size, s.num_tokens)
                    self._add(trie.sequences[s.node.seq][s.start : s.end])
            parents = step.parents if isinstance(step, PackedSubtree) else (-1,) * len(steps)
            is_row = isinstance(step, PackedSubtree) or isinstance(step, SiblingLeaves) and len(steps) > 1
            if packed and is_row:
                rows[id(step)] = self._row(steps, parents)
            one_row = len(steps) == 1 or packed and is_row  # (a push, a lone leaf, a packed row)
            key = step.segment if isinstance(step, Push) else id(step)
            if kernel is not None and kernel.per_segment and one_row and key not in layouts:
                layouts[key] = self._layout([s.num_tokens for s in steps], parents, steps[0].start)
        flat = np.concatenate(self._chunks).astype(np.int64) if self._chunks else np.zeros(0, np.int64)
        host = torch.from_numpy(flat)
        if device.type == "cuda":
            host = host.pin_memory()
        self._flat = host.to(device, non_blocking=True)
        self._rows = rows
        self._packed_rows: dict[int, PackedRow] = {}
        self._kernel = kernel
        self._layouts = {key: self._view(key, *parts) for key, parts in layouts.items()}

    def _add(self, chunk) -> int:
        """Append ``chunk`` to the host tensor; its offset."""
        offset = self._size
        self._chunks.append(chunk)
        self._size += len(chunk)
        return offset

    def _row(self, segments, parents) -> tuple[int, int, int, int]:
        n, tokens = len(segments), sum(s.num_tokens for s in segments)
        ancestor = np.eye(n, dtype=np.int64)
        for k, parent in enumerate(parents):  # parents come first
            if parent >= 0:
                ancestor[k] |= ancestor[parent]
        positions = self._size
        for s in segments:  # each token at its own position
            self._add(np.arange(s.start, s.end))
        for k, s in enumerate(segments):
            self._add(np.full(s.num_tokens, k))
        self._add(ancestor.ravel())
        return positions, positions + tokens, positions + 2 * tokens, n

    def _layout(self, lengths, parents, start) -> tuple:
        q_cu, k_cu, index, k_lens, split = SegmentLayout.host(lengths, parents, start)
        # the two int32 arrays (n + 1 each) travel as n + 1 int64 values, viewed back as int32 on the device
        cu = self._add(np.concatenate([q_cu, k_cu]).view(np.int64))
        index_at = None if index is None else (self._add(index), len(index))
        return start, tuple(lengths), tuple(k_lens), cu, len(q_cu), index_at, split

    def _view(self, key, start, lengths, k_lens, cu, n, index_at, split) -> SegmentLayout:
        both = self._flat[cu : cu + n].view(torch.int32)  # (no copy)
        index = None if index_at is None else self._flat[index_at[0] : index_at[0] + index_at[1]]
        row = self.row(key) if isinstance(key, int) and key in self._rows else None
        layout = SegmentLayout(start, lengths, k_lens, both[:n], both[n:], index, row, split)
        layout.kernel = self._kernel
        return layout

    def ids(self, segment: Segment) -> torch.Tensor:
        """The token ids [L] of ``segment``."""
        begin, n = self._ids[segment]
        return self._flat[begin : begin + n]

    def row(self, step) -> PackedRow:
        """The index tensors of a packed step (or its ``id``)."""
        key = step if isinstance(step, int) else id(step)
        if key not in self._packed_rows:
            positions, segment, ancestor, n = self._rows[key]
            flat = self._flat
            self._packed_rows[key] = PackedRow(
                flat[positions:segment],
                flat[segment:ancestor],
                flat[ancestor : ancestor + n * n].view(n, n) > 0,
            )
        return self._packed_rows[key]

    def layout(self, call) -> SegmentLayout | None:
        """The layout of a call: a push's (or a recomputed pop's) ``Segment``, or a leaves or subtree step
        forwarded as one row; None where the walk does not attend per segment."""
        return self._layouts.get(call if isinstance(call, Segment) else id(call))
