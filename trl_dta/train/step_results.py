"""What the step seam (:mod:`trl_dta.train.step`) takes and gives back per sequence: :class:`StepSequence`
(a sequence of a step's walk) and :class:`SequenceResults` (what its last scoring computed)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch


class StepSequence(NamedTuple):
    """One sequence of a step's walk."""

    tokens: list[int]  # at least two
    batch: int  # the micro-batch it came from (an index into the step's micro-batches)
    score_from: int  # its first scored log-prob index (log-prob t scores token t + 1)


class SequenceResults:
    """Per sequence of a step (by index), what its last scoring computed: its log-probs and entropies from
    ``score_from`` on, and its loss, all detached (None until scored). A pass walked again after running out
    of memory scores every sequence again and overwrites them."""

    def __init__(self, count: int):
        self.logps: list[torch.Tensor | None] = [None] * count
        self.entropies: list[torch.Tensor | None] = [None] * count
        self.losses: list[torch.Tensor | None] = [None] * count

    def record(self, index: int, logps, entropies, loss) -> None:
        self.logps[index] = logps.detach()
        self.entropies[index] = None if entropies is None else entropies.detach()
        self.losses[index] = loss.detach() if isinstance(loss, torch.Tensor) else None

    def total(self, indices: Sequence[int], absolute: bool = False) -> float:
        """The sum of the losses of ``indices`` (or of their magnitudes), in float64."""
        values = [self.losses[k].double() for k in indices if self.losses[k] is not None]
        return float(sum(v.abs() if absolute else v for v in values))
