"""Count the operators a walk dispatches: on a GPU, each is a kernel launch and its host time.

A GPU runs one kernel per ATen operator of an eager PyTorch program, and the host pays a fixed cost to launch
each, whatever its size. :class:`OpCounter` records each operator call with a ``TorchDispatchMode`` (views
and bare allocations excluded: they launch nothing), so that a CPU shows what a GPU walk launches, against a
dense forward and backward of the same rows (``tests/test_launches.py``, ``benchmarks/launch_model.py``). A
walk counted as on CUDA attends through :func:`trl_dta.testing.varlen.counted_varlen_attn` (one operator
each way, as torch's flash kernel).
"""

from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

# operators that launch no kernel: views and allocations without initialisation
NO_KERNEL = {
    "detach",
    "alias",
    "empty",
    "empty_strided",
    "empty_like",
    "lift_fresh",
    "new_empty",
    "new_empty_strided",
    "is_same_size",
    "sym_size",
    "sym_stride",
    "sym_numel",
}


class OpCounter(TorchDispatchMode):
    """``with OpCounter() as ops: ...``; ``ops.ops`` (the total), ``ops.by_name`` (a Counter by operator)."""

    def __init__(self):
        super().__init__()
        self.by_name: Counter[str] = Counter()

    @property
    def ops(self) -> int:
        return sum(self.by_name.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.overloadpacket.__name__ not in NO_KERNEL:
            self.by_name[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))
