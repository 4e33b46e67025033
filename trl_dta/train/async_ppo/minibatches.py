""":class:`~trl_dta.AsyncTreePPOTrainer`'s PPO minibatches (``ppo_n_minibatches = k``): k optimizer steps per
proximal pass, so that the decoupled objective's trust region binds.

With one optimizer step per batch, the proximal policy of the decoupled objective is the policy the step
trains: its ratio is 1 and its clip never binds (async_ppo/loss.py). AReaL takes several minibatch updates
per batch (its ``ppo_n_minibatches``) against one proximal policy, the policy before the first of them; TRL's
synchronous trainer has the same idea as ``steps_per_generation``. Here:

1. at the first optimizer step of a pass, the trainer takes k steps' micro-batches from the queue at once
   (:meth:`ProximalPasses.take`; fewer where training ends sooner);
2. one no-gradient walk of one trie of all their samples (more sharing than k walks) gives each sample's
   proximal log-probs at its trained tokens; with a value model, one walk of the value model gives its old
   values, and GAE its returns and advantages, whitened over the pass (:func:`add_pass_fields`). They are
   written into each micro-batch (``PASS_FIELDS``), so every path of the step reads them as the sample's own:
   the walk, the dense path (``tree_dense_fallback``), ``tree_check_gradients``;
3. the k optimizer steps follow, each on its own micro-batches: from the second on the policy has moved, the
   ratio to the proximal policy leaves 1 and the clip holds each update near it
   (``clip_ratio/proximal_region_mean``; the value clip's share, ``value/clip_ratio``).

Everything per optimizer step stays as it is: the learning-rate schedule, logging, checkpoints and weight
syncs count optimizer steps, and a sample's staleness is its version against the policy's at the step that
trains it (``staleness/train_*``; ``max_staleness`` is checked when a sample leaves the queue, at the pass's
start, and again at training with ``check_staleness_at_training``). A checkpoint taken inside a pass does not
hold the pass's later micro-batches (TRL's queue is not checkpointed either): a resumed run starts a new pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..step import StepWalker
from .loss import step_samples
from .values import with_targets


class ProximalPasses:
    """The micro-batches of the current pass's optimizer steps not trained yet (module docstring).

    Args:
        k: optimizer steps per pass (``ppo_n_minibatches``).
        compute: ``compute(batches)``: adds a pass's fields to the raw micro-batches ``batches`` of its steps
            (:func:`add_pass_fields`).
    """

    def __init__(self, k: int, compute: Callable[[list], None]):
        self.k, self._compute = k, compute
        self._steps: list[tuple] = []

    def take(self, fetch: Callable[[], tuple], steps_left: int) -> tuple:
        """The next optimizer step's micro-batches and item count. At a pass's first step, ``fetch()`` (one
        step's, the Trainer's ``get_batch_samples``) is called for the pass's ``min(k, steps_left)`` steps
        and their fields computed first."""
        if not self._steps:
            steps = [fetch() for _ in range(max(1, min(self.k, steps_left)))]
            steps = [s for s in steps if s[0]] or steps[:1]  # (the data's end: steps with no micro-batch)
            self._compute([b for batches, _ in steps for b in batches])
            self._steps = steps
        return self._steps.pop(0)


def add_pass_fields(
    walker: StepWalker, model, batches: Sequence[dict], temperature: float, critic=None, metrics=None
) -> None:
    """Step 2 of the module docstring: into each raw micro-batch of ``batches`` (collated, a pass's), the
    proximal log-probs of ``model`` as it is now at every sample's trained tokens, and with ``critic`` (a
    :class:`~trl_dta.train.critic.value_model.ValueModel`) old values, returns and per-token advantages
    (``[N, L]`` tensors aligned as ``old_log_probs``, named by ``PASS_FIELDS``). The walk's metrics are
    logged under ``proximal_tree/``."""
    samples = step_samples(batches)
    sequences = [s.sequence() for s in samples]
    with walker.step(model, sequences, training=False, metrics=metrics, prefix="proximal_tree/") as step:
        logps = step.logprobs(temperature)
    fields = {
        "proximal_log_probs": [lp[s.positions.to(lp.device)] for s, lp in zip(samples, logps, strict=True)]
    }
    if critic is not None:  # (every rank walks and whitens, with samples or not)
        valued = with_targets(critic, samples, sequences, metrics)
        fields["old_values"] = [s.old_values for s in valued]
        fields["returns"] = [s.returns for s in valued]
        fields["token_advantages"] = [s.advantage for s in valued]
    for inputs in batches:  # (in the values' dtype: an fp64 model's stay fp64)
        old = inputs["old_log_probs"]
        for name, per_sample in fields.items():
            dtype = per_sample[0].dtype if per_sample else old.dtype
            inputs[name] = torch.zeros(old.shape, dtype=dtype, device=old.device)
    for k, s in enumerate(samples):
        trained = s.positions + 1 + s.score_from  # (token p's value at p, as old_log_probs)
        for name, per_sample in fields.items():
            target = batches[s.batch][name]
            target[s.row, trained.to(target.device)] = per_sample[k].to(target)
