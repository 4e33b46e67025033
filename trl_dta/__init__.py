"""trl-dta: RL post-training of LLMs on a prefix trie of rollouts, every shared prefix computed once.

The package follows the data: rollouts become a :class:`PrefixTrie` (``trie.py``), a step's sequences are cut
into contiguous runs across data-parallel ranks (``partition.py``), :class:`TreeExecutor` walks a trie through
a causal LM (``walk/``, which knows nothing of TRL), and :class:`TreePPOTrainer` plugs the walk into TRL's
``GRPOTrainer``, :class:`TreeSFTTrainer` into its ``SFTTrainer`` (``train/``, which knows nothing of KV
caches). ``envs/`` holds environments for TRL's ``environment_factory``; ``testing/`` the tiny offline
fixtures the tests and benchmarks share.

Importing the package is cheap: each public name loads its module on first use (the ``TYPE_CHECKING``
imports below are for IDEs and type checkers only).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .partition import LexicographicPartitionSampler, lexicographic_partition
    from .train.async_ppo.config import AsyncTreePPOConfig
    from .train.async_ppo.trainer import AsyncTreePPOTrainer
    from .train.critic.model import value_model_from
    from .train.ppo.config import TreePPOConfig
    from .train.ppo.trainer import TreePPOTrainer
    from .train.sft.config import TreeSFTConfig
    from .train.sft.trainer import TreeSFTTrainer
    from .trie import PrefixTrie
    from .walk.errors import UnsupportedModelError
    from .walk.executor import TreeExecutor

__version__ = "0.1.0"

_EXPORTS = {
    "AsyncTreePPOConfig": "trl_dta.train.async_ppo.config",
    "AsyncTreePPOTrainer": "trl_dta.train.async_ppo.trainer",
    "LexicographicPartitionSampler": "trl_dta.partition",
    "PrefixTrie": "trl_dta.trie",
    "TreeExecutor": "trl_dta.walk.executor",
    "TreePPOConfig": "trl_dta.train.ppo.config",
    "TreePPOTrainer": "trl_dta.train.ppo.trainer",
    "TreeSFTConfig": "trl_dta.train.sft.config",
    "TreeSFTTrainer": "trl_dta.train.sft.trainer",
    "UnsupportedModelError": "trl_dta.walk.errors",
    "lexicographic_partition": "trl_dta.partition",
    "value_model_from": "trl_dta.train.critic.model",
}

__all__ = [
    "AsyncTreePPOConfig",
    "AsyncTreePPOTrainer",
    "LexicographicPartitionSampler",
    "PrefixTrie",
    "TreeExecutor",
    "TreePPOConfig",
    "TreePPOTrainer",
    "TreeSFTConfig",
    "TreeSFTTrainer",
    "UnsupportedModelError",
    "lexicographic_partition",
    "value_model_from",
]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'trl_dta' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
