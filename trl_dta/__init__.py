"""trl-dta: RL post-training of LLMs on a prefix trie of rollouts, every shared prefix computed once.

Importing the package is cheap: the public names load their modules on first use (the ``TYPE_CHECKING``
imports below are for IDEs and type checkers only).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import TreePPOConfig
    from .executor import TreeExecutor
    from .partition import (
        DFSPartitionSampler,
        LexicographicPartitionSampler,
        dfs_partition,
        lexicographic_partition,
    )
    from .trainer import TreePPOTrainer
    from .trie import PrefixTrie

__version__ = "0.1.0"

_EXPORTS = {
    "DFSPartitionSampler": "trl_dta.partition",  # deprecated name of LexicographicPartitionSampler
    "LexicographicPartitionSampler": "trl_dta.partition",
    "PrefixTrie": "trl_dta.trie",
    "TreeExecutor": "trl_dta.executor",
    "TreePPOConfig": "trl_dta.config",
    "TreePPOTrainer": "trl_dta.trainer",
    "dfs_partition": "trl_dta.partition",  # deprecated name of lexicographic_partition
    "lexicographic_partition": "trl_dta.partition",
}

__all__ = [
    "DFSPartitionSampler",
    "LexicographicPartitionSampler",
    "PrefixTrie",
    "TreeExecutor",
    "TreePPOConfig",
    "TreePPOTrainer",
    "dfs_partition",
    "lexicographic_partition",
]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'trl_dta' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
