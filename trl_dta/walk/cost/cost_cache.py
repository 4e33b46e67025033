"""Where fitted call-cost constants are kept between runs: one JSON file in the user's cache directory, one
entry per device and model signature, so that the next run on the same device and model starts calibrated.

The directory: ``TRL_DTA_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/trl_dta``, else ``~/.cache/trl_dta``
(the platform's user cache directory on Linux; a per-user directory elsewhere too). Writes are atomic (a
temporary file renamed over the old one); an unreadable file is ignored, not fatal: the shipped constants
are the fallback.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
from pathlib import Path

import torch

from .cost_fit import Constants

logger = logging.getLogger(__name__)
FILE = "call_costs.json"
VERSION = 1  # of the entries' layout: entries of another version are ignored


def cache_dir(directory: str | os.PathLike | None = None) -> Path:
    """The directory the fits are kept in (module docstring); ``directory`` wins when given."""
    if directory:
        return Path(directory)
    if os.environ.get("TRL_DTA_CACHE_DIR"):
        return Path(os.environ["TRL_DTA_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "trl_dta"


def device_name(device: torch.device) -> str:
    """What the constants depend on besides the model: the accelerator's name, or the CPU's model and the
    threads torch computes with; and torch's version (its kernels and dispatch)."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{device.type}: {cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def model_signature(config, dtype: torch.dtype, attention: str, packed: str) -> str:
    """The model's shape as the constants see it: widths, depth, vocabulary, dtype, attention kernel and
    the kernel that attends it (``packed``: its name, which says the pairs a packed row computes)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    keys = (
        "model_type",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "moe_intermediate_size",
        "num_experts",
        "num_local_experts",
        "num_experts_per_tok",
        "vocab_size",
    )
    shape = {k: getattr(config, k, None) for k in keys}
    text = json.dumps([shape, str(dtype), attention, packed], sort_keys=True)
    short = hashlib.sha256(text.encode()).hexdigest()[:12]
    layers, width = shape["num_hidden_layers"], shape["hidden_size"]
    return f"{shape['model_type']}-{layers}x{width}-{str(dtype).removeprefix('torch.')}-{attention}-{short}"


class CostCache:
    """The fits kept in ``directory`` (:func:`cache_dir`), by key ``"device | model signature"``."""

    def __init__(self, directory: str | os.PathLike | None = None):
        self.path = cache_dir(directory) / FILE

    def _entries(self) -> dict:
        try:
            entries = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as error:
            logger.warning("Ignoring the call-cost cache %s: %s", self.path, error)
            return {}
        return entries if isinstance(entries, dict) else {}

    def load(self, key: str) -> tuple[Constants, int] | None:
        """The constants kept for ``key`` and how many observations they were fitted from; None if none."""
        entry = self._entries().get(key)
        if not isinstance(entry, dict) or entry.get("version") != VERSION:
            return None
        try:
            return Constants(*(float(entry[k]) for k in Constants._fields)), int(entry["observations"])
        except (KeyError, TypeError, ValueError):
            return None

    def save(self, key: str, constants: Constants, observations: int) -> None:
        """Keep ``constants`` for ``key`` (other keys untouched). A failure to write is logged, not raised."""
        entries = self._entries()
        entries[key] = {"version": VERSION, **constants._asdict(), "observations": observations}
        self._write(entries)

    def remove(self, key: str) -> None:
        """Forget ``key``'s constants (``tree_cost_fit="reset"``)."""
        entries = self._entries()
        if entries.pop(key, None) is not None:
            self._write(entries)

    def _write(self, entries: dict) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, delete=False, suffix=".tmp") as f:
                json.dump(entries, f, indent=1, sort_keys=True)
            os.replace(f.name, self.path)
        except OSError as error:
            logger.warning("Could not write the call-cost cache %s: %s", self.path, error)
