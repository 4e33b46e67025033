"""The memory budget as users type it: ``parse_memory_budget`` reads every accepted form into one canonical
value, for :class:`~trl_dta.walk.memory.budgets.Budgets` and the trainers' configs alike (one implementation).

Accepted forms (strings case-insensitive, spaces around the number and unit allowed)::

    "auto"                          the walk measures the free device memory (90% of it: Budgets)
    None, "none", "None", "null"    no memory budget: the fixed token budgets
    6e10, 8000000000, "6e10"        bytes
    "8GB", "1.5TB", "512 MB", "8kB" bytes in decimal units (powers of 1000)
    "8GiB", "512MiB", "4 KiB"       bytes in binary units (powers of 1024)
    "80%"                           that share of the device memory free at the first walk, as "auto"

The canonical values: None, ``"auto"``, a float of bytes, or a percentage string such as ``"80%"`` (kept as
typed, so a saved config reads back the same; :func:`memory_share` gives its fraction).
:func:`measure_free_memory` and :func:`auto_memory_bytes` turn ``"auto"`` (or a percentage) into bytes at
the first walk.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import torch

from ..errors import ArgumentTypeError

UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "pib": 2**50,
}
NONE_WORDS = ("none", "null")
AUTO_FRACTION = 0.9  # "auto" on CUDA: this share of the free memory at the first walk
FORMS = (
    '"auto" (the free device memory), None (also "none"/"null": the fixed token budgets), a number of bytes '
    "(6e10, 8000000000), bytes with a unit (8GB, 1.5TB, 512MB: powers of 1000; 8GiB, 512MiB: powers of "
    '1024), or a share of the device memory free at the first walk ("80%")'
)
_NUMBER = r"(?P<number>(?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?)"
_WITH_UNIT = re.compile(rf"{_NUMBER}\s*(?P<unit>[kmgtp]?i?b)", re.IGNORECASE)
_PERCENT = re.compile(rf"{_NUMBER}\s*%", re.IGNORECASE)


def _refuse(name: str, value, error: type[Exception] = ValueError) -> Exception:
    return error(f"{name} must be {FORMS}; got {value!r}")


def parse_memory_budget(value, name: str = "memory_budget") -> float | str | None:
    """``value`` (a memory budget as given in Python, a YAML file or on the command line) as its canonical
    value: None, ``"auto"``, a positive float of bytes, or a percentage string ``"<p>%"`` with ``0 < p <=
    100``. Anything else raises a ``ValueError`` naming the option (``name``) and the accepted forms (a wrong
    type: :class:`~trl_dta.walk.errors.ArgumentTypeError`, a ``TypeError`` too)."""
    given = value
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise _refuse(name, value, ArgumentTypeError)
    if isinstance(value, str):
        text = value.strip()
        if text.lower() in NONE_WORDS:
            return None
        if text.lower() == "auto":
            return "auto"
        percent = _PERCENT.fullmatch(text)
        if percent:
            share = float(percent["number"])
            if not 0 < share <= 100:
                raise _refuse(name, value)
            return f"{share:g}%"
        with_unit = _WITH_UNIT.fullmatch(text)
        if with_unit and with_unit["unit"].lower() in UNITS:
            value = float(with_unit["number"]) * UNITS[with_unit["unit"].lower()]
        else:
            try:
                value = float(text)
            except ValueError:
                raise _refuse(name, given) from None
    if not 0 < value < math.inf:  # (NaN fails too)
        raise _refuse(name, given)
    return float(value)


def memory_share(budget: float | str | None) -> float | None:
    """The fraction of the free device memory a canonical percentage budget (``"80%"``) names; None for any
    other canonical value."""
    if isinstance(budget, str) and budget.endswith("%"):
        return float(budget[:-1]) / 100
    return None


def measure_free_memory(
    model: torch.nn.Module, device: torch.device, others: Sequence[torch.nn.Module] = ()
) -> tuple[float, float] | None:
    """``memory_budget="auto"``, measured: on CUDA, the device's free memory now (what the driver has free and
    what PyTorch's allocator holds unused) and what the walk and the first optimizer step will still
    allocate (each trainable parameter's gradient, also where it has one: a walk accumulates into a fresh one,
    added to the one set aside after it; and two Adam states), of ``model`` and of the
    ``others`` trained in the same steps (a value model beside the policy: whichever walks first must leave
    room for both); None elsewhere (the device kind's fixed budgets apply)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)  # (its cache)
    later = 0
    for p in (p for m in (model, *others) for p in m.parameters()):
        if p.requires_grad:
            # the full size (ZeRO-3 partitions hold ds_numel; FSDP2's DTensors count their global size)
            size = (getattr(p, "ds_numel", None) or p.numel()) * p.element_size()
            later += 3 * size  # (a gradient held before the walk is set aside: a fresh one during it)
    return float(free), float(later)


def auto_memory_bytes(free: float, later: float, reserved: float = 0, fraction: float = AUTO_FRACTION):
    """``memory_budget="auto"``'s bytes (and a percentage's, its ``fraction``): ``fraction`` of the ``free``
    bytes measured less the ``reserved`` ones (another user of the device, such as a colocated vLLM engine,
    will claim them), less the ``later`` bytes the first optimizer step will allocate
    (:func:`measure_free_memory`)."""
    budget = fraction * (free - reserved) - later
    if budget <= 0:
        raise RuntimeError(
            f"memory budget ('auto', or a percentage): {free / 2**30:.2f} GiB free, less "
            f"{reserved / 2**30:.2f} GiB reserved "
            f"for other users of the device, of which {fraction:.0%} leaves nothing after the first "
            f"optimizer step's gradients and Adam states ({later / 2**30:.2f} GiB); pass memory_budget in "
            "bytes, or the token budgets."
        )
    return budget
