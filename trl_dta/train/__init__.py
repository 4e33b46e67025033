"""TRL integration: :class:`TreePPOTrainer`, TRL's ``GRPOTrainer`` with its policy forward/backward replaced
by the tree walk. It knows nothing of KV caches.

``config.py`` (:class:`TreePPOConfig`), ``trainer.py`` (the trainer: TRL's hooks), ``step.py`` (one optimizer
step's trie walked with each row's TRL loss), ``rows.py`` (a TRL batch's rows as token sequences),
``losses.py`` (TRL's loss per row), ``load_balancing.py`` (TRL's MoE load-balancing loss on a trie),
``distributed.py`` (re-partition across ranks, one gradient all-reduce per step), ``parallel.py`` (what
DDP, FSDP2 and DeepSpeed need around the walk: the checks at construction, the step flow),
``gradient_check.py`` (``tree_check_gradients``), ``tree_args.py`` (the tree options both configs share).

:class:`TreeSFTTrainer` (``sft_trainer.py``, ``sft_config.py``, ``sft_rows.py``: TRL's SFT batches as
samples) is TRL's ``SFTTrainer`` on the same walk.
"""

from __future__ import annotations

from .config import TreePPOConfig
from .sft_config import TreeSFTConfig
from .sft_trainer import TreeSFTTrainer
from .trainer import TreePPOTrainer

__all__ = ["TreePPOConfig", "TreePPOTrainer", "TreeSFTConfig", "TreeSFTTrainer"]
