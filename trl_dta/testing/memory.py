"""Measure the bytes autograd keeps for backward: a device-independent view of activation memory.

``SavedTensorMeter`` installs ``torch.autograd.graph.saved_tensors_hooks``: each tensor autograd saves is
counted when packed and uncounted when the graph that holds it is freed (a finalizer on the packed
handle), so ``peak`` is the largest amount of saved activations alive at once. Parameters are not
counted (they are alive anyway). Tensors saved twice count twice; views count their own size. With
``by_storage=True`` it counts what is really held instead: each storage once, whole, while any saved
tensor on it is alive (the walk's path K/V buffer, a norm's float32 input saved by two operators).
"""

from __future__ import annotations

import weakref

import torch


class _Packed:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class SavedTensorMeter:
    """Context manager: ``with SavedTensorMeter(model) as meter: ...; meter.peak`` (bytes)."""

    def __init__(self, model: torch.nn.Module | None = None, by_storage: bool = False):
        self._params = {p.data_ptr() for p in model.parameters()} if model is not None else set()
        self._storages = {p.untyped_storage().data_ptr() for p in model.parameters()} if model else set()
        self.by_storage = by_storage
        self._held: dict[int, list[int]] = {}  # by_storage: storage -> [bytes, saved tensors alive on it]
        self.live = 0
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def _release(self, key: int) -> None:
        held = self._held[key]
        held[1] -= 1
        if held[1] == 0:
            self.live -= held[0]
            del self._held[key]

    def _pack(self, tensor: torch.Tensor) -> _Packed:
        packed = _Packed(tensor)
        if self.by_storage:
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key and key not in self._storages:
                if key not in self._held:
                    self._held[key] = [storage.nbytes(), 0]
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                self._held[key][1] += 1
                weakref.finalize(packed, self._release, key)
        elif tensor.data_ptr() not in self._params:
            nbytes = tensor.numel() * tensor.element_size()
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(packed, self._free, nbytes)
        return packed

    @staticmethod
    def _unpack(packed: _Packed) -> torch.Tensor:
        return packed.tensor

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
