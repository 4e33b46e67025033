"""Running out of memory on purpose: :class:`InjectOOM` raises ``torch.OutOfMemoryError`` at the k-th call
of a module (decoder layer 0 sees every model call once), for the tests and benchmarks of
:mod:`trl_dta.walk.memory.recovery`.

Example::

    layer = model.model.layers[0]
    with InjectOOM(layer, at=3) as oom:  # the 3rd forward of layer 0 raises, once
        executor.backward(trie, loss_fn)
    assert oom.raised == 1

``inside="_pop"`` counts only the calls made with a function of that name on the stack (the recompute of a
popped segment under chunked backward); ``backward=True`` counts backward calls through the module instead.
"""

from __future__ import annotations

import sys

import torch
from torch import nn


def _on_stack(name: str) -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == name:
            return True
        frame = frame.f_back
    return False


class InjectOOM:
    """Raise ``error`` (default ``torch.OutOfMemoryError``) at the ``at``-th counted call of ``module``
    (1-based; ``None``: never, only count), ``times`` times in a row (default once: the next attempt goes
    through).

    Attributes: ``calls`` (calls counted so far), ``raised`` (errors raised), ``stacks`` (with ``record``:
    per counted call, whether ``record`` was on the stack)."""

    def __init__(
        self,
        module: nn.Module,
        at: int | None,
        inside: str | None = None,
        backward: bool = False,
        times: int = 1,
        error: type[BaseException] = torch.OutOfMemoryError,
        record: str | None = None,
    ):
        self.module, self.at, self.inside, self.backward = module, at, inside, backward
        self.times, self.error, self.record = times, error, record
        self.calls = self.raised = 0
        self.stacks: list[bool] = []
        self._handle = None

    def _hook(self, *args) -> None:
        if self.inside is not None and not _on_stack(self.inside):
            return
        self.calls += 1
        if self.record is not None:
            self.stacks.append(_on_stack(self.record))
        if self.at is not None and self.at <= self.calls < self.at + self.times:
            self.raised += 1
            raise self.error(
                f"CUDA out of memory (injected). Tried to allocate 20.00 MiB at call {self.calls} of "
                f"{type(self.module).__name__}."
            )

    def __enter__(self) -> InjectOOM:
        register = (
            self.module.register_full_backward_pre_hook
            if self.backward
            else self.module.register_forward_pre_hook
        )
        self._handle = register(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()
