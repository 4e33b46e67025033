"""TRL integration: :class:`TreePPOTrainer` (TRL's ``GRPOTrainer``) and :class:`TreeSFTTrainer` (TRL's
``SFTTrainer``) with their training forward/backward replaced by the tree walk. It knows nothing of KV
caches.

Files say whom they serve: ``ppo_*`` only :class:`TreePPOTrainer`, ``sft_*`` only :class:`TreeSFTTrainer`,
the rest both.

* Shared: ``tree_args.py`` (the ``tree_*`` options both configs share, and the method's paper),
  ``refusals.py`` (what the trainers refuse when they are built: arguments, models, tokenizer, lengths),
  ``multi_process.py`` (DDP, FSDP2 and DeepSpeed around the walk:
  the checks at construction, the step flow, idle walks, the gradient all-reduce), ``load_balancing.py``
  (TRL's MoE load-balancing loss on a trie), ``gradient_check.py`` (``tree_check_gradients``).
* PPO: ``ppo_config.py`` (:class:`TreePPOConfig`), ``ppo_trainer.py`` (the trainer: TRL's hooks),
  ``ppo_step.py`` (a step's TRL micro-batches as trie sequences, and the walk's values back in TRL's shapes),
  ``ppo_losses.py`` (TRL's loss per row), ``ppo_rows.py`` (a
  TRL batch's rows as token sequences; batches merged and re-cut row-wise), ``ppo_repartition.py`` (a
  step's rollouts re-split across ranks). PPO with a value model: ``ppo_value_args.py`` (its options),
  ``ppo_values.py`` (its arithmetic: GAE over the policy's own tokens, whitening, the clipped value loss),
  ``ppo_critic.py`` (loading it, its optimizer and checkpoint), ``ppo_value_model.py`` (the trainers' hooks),
  ``ppo_async_values.py`` (the asynchronous trainer's: values at training time).
* SFT: ``sft_config.py`` (:class:`TreeSFTConfig`), ``sft_trainer.py`` (the trainer), ``sft_samples.py``
  (TRL's SFT batches as samples).

Words: a *row* is a row of a TRL batch tensor (PPO: one rollout, prompt then completion; SFT: one padded
row, which padding-free and packing fill with several samples); a *sample* is what TRL's SFT forward
attends over as one sequence; a *sequence* is what the walk takes, one per trie path (a PPO row's tokens, an
SFT sample's).
"""

from __future__ import annotations

from .ppo_config import TreePPOConfig
from .ppo_trainer import TreePPOTrainer
from .sft_config import TreeSFTConfig
from .sft_trainer import TreeSFTTrainer

__all__ = ["TreePPOConfig", "TreePPOTrainer", "TreeSFTConfig", "TreeSFTTrainer"]
