"""Count the operators that make a GPU's host wait for the device, on any device (a CPU run shows them too).

On CUDA the host queues kernels ahead of the device until an operator needs a result back: a scalar read
(``.item()``: ``_local_scalar_dense``), an output whose size depends on the data (``nonzero``, boolean-mask
indexing, ``repeat_interleave`` without ``output_size``), or a tensor made from Python data (``torch.tensor(
list, device=...)``: a pageable copy, seen as ``lift_fresh``) or copied to the host. ``SyncCounter`` records
them with a ``TorchDispatchMode``, so a test on CPU can check that a walk's count does not grow with its
number of calls; ``benchmarks/gpu.sh`` checks the real thing under ``torch.cuda.set_sync_debug_mode``.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_ALWAYS = {"_local_scalar_dense", "nonzero", "lift_fresh", "masked_select", "unique_consecutive", "_unique2"}


class SyncCounter(TorchDispatchMode):
    """``with SyncCounter() as syncs: ...``; ``syncs.total``, ``syncs.ops`` (a Counter by operator name)."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in _ALWAYS:
            self.ops[name] += 1
        elif name == "repeat_interleave" and kwargs.get("output_size") is None and len(args) < 3:
            if isinstance(args[0], torch.Tensor) and args[0].dim() > 0 or len(args) > 1:
                self.ops[name] += 1
        elif name == "index" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ())
        ):
            self.ops["index (boolean mask)"] += 1
        elif name in ("_to_copy", "copy_") and _to_host(func, args, kwargs):
            self.ops[f"{name} (to host)"] += 1
        return func(*args, **kwargs)


def _to_host(func, args, kwargs) -> bool:
    """A copy from an accelerator to the CPU."""
    if func.overloadpacket.__name__ == "_to_copy":
        source, target = args[0], kwargs.get("device")
        return source.device.type != "cpu" and target is not None and torch.device(target).type == "cpu"
    target, source = args[0], args[1]
    return isinstance(source, torch.Tensor) and source.device.type != "cpu" and target.device.type == "cpu"
