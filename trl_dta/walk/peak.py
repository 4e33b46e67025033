"""The memory a walk peaks at: :attr:`TreeExecutor.peak_memory <trl_dta.walk.executor.TreeExecutor>`, which
the trainers log as ``tree/peak_memory`` (bytes).

* CUDA: ``torch.cuda.max_memory_allocated`` after ``torch.cuda.reset_peak_memory_stats`` at the walk's start:
  the most bytes PyTorch held allocated on the device at once during the walk, weights, gradients and
  optimizer states included. The reset is the device's: code that reads the peak statistics across a walk
  sees the peak since that walk's start (of nested walks, only the outermost resets). No host sync.
* CPU (Linux): the process's resident set size (``/proc/self/statm``), sampled where the walk's memory model
  (:mod:`trl_dta.walk.budgets`) puts its peaks: after each step, and before each backward call (the stack's
  graphs plus the running call's). A lower bound of the true peak: buffers that live only inside one call
  (the LM head's logits, the backward's transients) are missed. The process's high-water mark (``VmHWM``) is
  left alone, so that what measures a whole process (``ru_maxrss``, benchmarks/demo_memory.py) stays true;
  resetting it per walk would hide every peak before the last walk's start.
* Elsewhere (other accelerators, no ``/proc``): None.
"""

from __future__ import annotations

import os

import torch

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_DEPTH = {"cuda": 0}  # walks running now, per device kind (nested: a loss_fn that walks another trie)


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
