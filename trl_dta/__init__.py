"""trl-dta: RL post-training of LLMs on a prefix trie of rollouts, every shared prefix computed once.

Importing the package is cheap: the public names load their modules on first use.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "DFSPartitionSampler": "trl_dta.partition",
    "PrefixTrie": "trl_dta.trie",
    "TreeExecutor": "trl_dta.executor",
    "TreePPOConfig": "trl_dta.config",
    "TreePPOTrainer": "trl_dta.trainer",
    "dfs_partition": "trl_dta.partition",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'trl_dta' has no attribute {name!r}")
