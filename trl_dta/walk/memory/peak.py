"""The memory a walk peaks at: :attr:`TreeExecutor.peak_memory <trl_dta.walk.executor.TreeExecutor>`, which
the trainers log in GiB as ``tree/peak_memory_gib``.

* CUDA: ``torch.cuda.max_memory_allocated`` after ``torch.cuda.reset_peak_memory_stats`` at the walk's start:
  the most bytes PyTorch held allocated on the device at once during the walk, weights, gradients and
  optimizer states included (of nested walks, only the outermost resets). No host sync. The reset is the
  device's, as a training loop's per-step memory logging resets it: ``torch.cuda.max_memory_allocated`` read
  across a walk gives the peak since that walk's start. :func:`max_memory_allocated` here gives the peak
  since the last :func:`reset_peak_memory_stats` (or the process's start), the walks' resets accounted: what
  code that measures more than a walk (the benchmarks) reads.
* CPU (Linux): the process's resident set size (``/proc/self/statm``), sampled where the walk's memory model
  (:mod:`trl_dta.walk.memory.budgets`) puts its peaks: after each step, and before each backward call (the
  stack's graphs plus the running call's). A lower bound of the true peak: buffers that live only inside one
  call (the LM head's logits, the backward's transients) are missed. The process's high-water mark (``VmHWM``)
  is left alone, so that what measures a whole process (``ru_maxrss``, benchmarks/demo_memory.py) stays true;
  resetting it per walk would hide every peak before the last walk's start.
* Elsewhere (other accelerators, no ``/proc``): None.
"""

from __future__ import annotations

import os

import torch

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_DEPTH = {"cuda": 0}  # walks running now, per device kind (nested: a loss_fn that walks another trie)
_CARRIED: dict[int, int] = {}  # per CUDA device: the peak walks' resets cleared since the last outside reset


def _index(device) -> int:
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


def max_memory_allocated(device="cuda") -> int:
    """CUDA's peak allocated bytes on ``device`` since the last :func:`reset_peak_memory_stats`, as
    ``torch.cuda.max_memory_allocated`` would read had no walk reset the device's statistics."""
    return max(_CARRIED.get(_index(device), 0), torch.cuda.max_memory_allocated(device))


def reset_peak_memory_stats(device="cuda") -> None:
    """``torch.cuda.reset_peak_memory_stats``, for :func:`max_memory_allocated` too."""
    torch.cuda.reset_peak_memory_stats(device)
    _CARRIED[_index(device)] = 0


class PeakMemory:
    """Context manager around one walk on ``device``: ``peak`` (bytes, or None) once it exits;
    :meth:`sample` at the walk's high points (CPU; a no-op elsewhere)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak: int | None = None
        self._fd: int | None = None

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            _DEPTH["cuda"] += 1
            if _DEPTH["cuda"] == 1:
                index = _index(self.device)
                _CARRIED[index] = max(_CARRIED.get(index, 0), torch.cuda.max_memory_allocated(self.device))
                torch.cuda.reset_peak_memory_stats(self.device)
        elif self.device.type == "cpu":
            try:
                self._fd = os.open("/proc/self/statm", os.O_RDONLY)
            except OSError:  # (no procfs: not Linux)
                self._fd = None
            self.sample()
        return self

    def sample(self) -> None:
        """CPU: take the resident set size now into the peak."""
        if self._fd is not None:
            rss = int(os.pread(self._fd, 128, 0).split()[1]) * _PAGE  # (size, resident, ... in pages)
            self.peak = rss if self.peak is None else max(self.peak, rss)

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            _DEPTH["cuda"] -= 1
            self.peak = torch.cuda.max_memory_allocated(self.device)
        elif self._fd is not None:
            self.sample()
            os.close(self._fd)
            self._fd = None
