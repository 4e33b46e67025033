"""Helpers shared by the benchmark scripts: machine/load record, aligned tables, timing, peak memory.

Kept free of trl_dta and of TRL so that every script (and ``benchmarks/gpu.sh`` on a machine without TRL)
can import it; torch is imported only by the helpers that use it (benchmarks/partition.py needs none).
"""

from __future__ import annotations

import ctypes
import datetime
import gc
import os
import platform
import time
from typing import Self

# ------------------------------------------------------------------------------------------------ machine


def load_average() -> float:
    """1-minute load average (0.0 where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def warn_if_busy(threads: int, limit: float = 0.5) -> float:
    """Print a warning when other jobs share the cores (the walk's many small ops suffer most); return the
    load average seen."""
    load = load_average()
    if load > limit:
        print(
            f"warning: 1-min load average {load:.1f} before starting: timings will be noisy, and inflated if "
            f"other jobs take cores the {threads} thread(s) need (try --threads 1)"
        )
    return load


def processor_name() -> str:
    """The CPU model (Linux /proc/cpuinfo), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(load_before: float, wall_s: float, **extra) -> dict:
    """What a result file needs to be read later: versions, machine, date, load average before and after."""
    import torch
    import transformers

    env = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": processor_name(),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "wall_s": wall_s,
        "load_avg_1min_before": load_before,
        "load_avg_1min_after": load_average(),
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    env.update(extra)
    return env


# ------------------------------------------------------------------------------------------------ tables


def format_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """An aligned plain-text table. ``columns``: (header, key, format); a missing or None value prints '-',
    a string value prints as is (e.g. 'OOM')."""

    def cell(row, key, fmt):
        value = row.get(key)
        if value is None:
            return "-"
        return value if isinstance(value, str) else fmt.format(value)

    cells = [[h for h, _, _ in columns]] + [[cell(r, k, f) for _, k, f in columns] for r in rows]
    widths = [max(len(row[c]) for row in cells) for c in range(len(columns))]
    lines = []
    for i, row in enumerate(cells):
        lines.append(
            "  ".join(
                c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """The same table in GitHub markdown (for README)."""

    def cell(row, key, fmt):
        value = row.get(key)
        if value is None:
            return "-"
        return value if isinstance(value, str) else fmt.format(value)

    lines = ["| " + " | ".join(h for h, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r, k, f) for _, k, f in columns) + " |" for r in rows]
    return "\n".join(lines)


def pyplot():
    """matplotlib.pyplot with the non-interactive backend (imported only when a plot is drawn)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ------------------------------------------------------------------------------------------------ timing


def synchronize(device=None) -> None:
    import torch

    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device=None) -> float:
    """Wall seconds of ``fn()`` (after a garbage collection; CUDA synchronised on both sides)."""
    gc.collect()
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


# ------------------------------------------------------------------------------------------------ memory


def _proc_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _trim_heap() -> None:
    """Hand freed heap pages back to the OS, so that an RSS peak measures this call, not the last one's
    leftovers (glibc only; a no-op elsewhere)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


class PeakMemory:
    """Peak memory a block adds on top of what was live when it started.

    CUDA: ``torch.cuda.max_memory_allocated`` minus the allocated bytes at entry. CPU: the process's peak
    resident set (Linux ``VmHWM``, reset by writing 5 to ``/proc/self/clear_refs``) minus the RSS at entry,
    after trimming the heap; ``None`` where the OS offers neither.
    """

    def __init__(self, device="cpu"):
        import torch

        self.device = torch.device(device)
        self.peak: int | None = None

    def __enter__(self) -> Self:
        import torch

        from trl_dta.walk.memory import peak as walk_peak  # (the walks' own resets of CUDA's peak accounted)

        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            walk_peak.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            return self
        _trim_heap()
        self._base = None
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._base = _proc_status_kib("VmRSS")
        except OSError:
            pass
        return self

    def __exit__(self, *exc) -> None:
        import torch

        from trl_dta.walk.memory import peak as walk_peak

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = walk_peak.max_memory_allocated(self.device) - self._base
        elif self._base is not None:
            hwm = _proc_status_kib("VmHWM")
            self.peak = None if hwm is None else max(hwm - self._base, 0) * 1024
