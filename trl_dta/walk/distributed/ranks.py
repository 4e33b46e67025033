"""What the ranks of a sharded walk (FSDP2: :mod:`trl_dta.walk.distributed.sharding`; DeepSpeed ZeRO-2/3:
:mod:`trl_dta.walk.distributed.deepspeed`) agree on: how many they are, and how each one's part of a walk
ended, so that either every rank goes on or every rank raises (and out-of-memory recovery walks again on all
of them).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..errors import MEMORY_ERRORS, PeerOutOfMemoryError


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _outcome(error: BaseException | None) -> int:
    return 0 if error is None else 1 if isinstance(error, MEMORY_ERRORS) else 2


def agree_on_outcome(model: nn.Module, error: BaseException | None, failed: str = "failed in its walk"):
    """Every rank says how its part ended (``error``: this rank's, or None): return if no rank failed, else
    raise on every rank: its own error; on the others :class:`~trl_dta.walk.errors.PeerOutOfMemoryError` if
    a rank ran out of memory (and none failed otherwise), else a ``RuntimeError`` (also where this rank ran
    out of memory and another failed otherwise: nothing to walk again). One all-reduce, on every rank."""
    device = next(p.device for p in model.parameters())
    flag = torch.tensor([_outcome(error)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    worst = int(flag.item())
    if worst == 0:
        return
    if error is not None and _outcome(error) == worst:
        raise error
    if worst == 1:
        raise PeerOutOfMemoryError(
            "another rank's walk ran out of memory: no rank reduces its gradients, and every rank walks "
            "again with halved budgets (trl_dta.walk.memory.recovery) or gives up."
        )
    raise RuntimeError(f"another rank {failed}; no rank reduces its gradients.") from error
