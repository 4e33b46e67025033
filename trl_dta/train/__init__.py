"""TRL integration: each trainer is TRL's own with its training forward and backward replaced by the tree
walk. It knows nothing of KV caches (the executor, :mod:`trl_dta.walk`, does).

A folder is a method (a trainer) or a model pass (a second model walked on the policy's trie,
``model_pass.py``):

* ``ppo/``: :class:`TreePPOTrainer` on TRL's ``GRPOTrainer``;
* ``async_ppo/``: :class:`AsyncTreePPOTrainer` on TRL's ``AsyncGRPOTrainer``;
* ``sft/``: :class:`TreeSFTTrainer` on TRL's ``SFTTrainer``;
* ``critic/`` (a model pass): a value model trained beside the policy (``value_model=`` of both PPO
  trainers): its arguments, GAE and the value loss, the model's loading, optimizer and checkpoint, its walk.

The files at this level are the seam every method shares, and import none of the folders:
``tree_trainer.py`` (:class:`~trl_dta.train.tree_trainer.TreeTrainer`, first in every trainer's bases),
``model_pass.py`` (the model passes' contract), ``tree_args.py`` (the ``tree_*`` options every config
shares), ``refusals.py`` (what every trainer refuses when it is built), ``step.py``
(:class:`~trl_dta.train.step.StepWalker`: one step's walk, its checks and its executors), ``step_walk.py``
(the passes over one step's trie), ``step_results.py`` (what the walk gives per sequence),
``step_schedule.py`` (an optimizer step's micro-batches: which is served next, the walk's results, the
dense-or-walk decision), ``dense_fallback.py`` and ``step_clock.py`` (that decision, and the timing it
learns from), ``dense_retry.py`` (a dense step that runs out of memory, walked again), ``multi_process.py``
(DDP, FSDP2 and DeepSpeed around the walk), ``load_balancing.py`` (TRL's MoE load-balancing loss on a
trie), ``gradient_check.py`` (``tree_check_gradients``).

Words: a *row* is a row of a TRL batch tensor (PPO: one rollout, prompt then completion; SFT: one padded
row, which padding-free and packing fill with several samples); a *sample* is what TRL's SFT forward
attends over as one sequence (for the asynchronous trainer, one rollout row of its queue); a *sequence* is
what the walk takes, one per trie path.
"""

from __future__ import annotations

from .ppo.config import TreePPOConfig
from .ppo.trainer import TreePPOTrainer
from .sft.config import TreeSFTConfig
from .sft.trainer import TreeSFTTrainer

# (AsyncTreePPOTrainer: ``trl_dta.AsyncTreePPOTrainer``, imported when used: TRL's asynchronous trainer needs
# the ``async`` extra)
__all__ = ["TreePPOConfig", "TreePPOTrainer", "TreeSFTConfig", "TreeSFTTrainer"]
