""":class:`~trl_dta.TreePPOTrainer`'s side of its value model (:class:`~trl_dta.train.critic.value_model.
ValueModel`): a generation batch's targets in TRL's ``(B, T)`` fields, and each training step's value losses
read back from them.

At generation (:func:`batch_targets`), the rollouts' rewards (TRL's reward functions, weighted and summed)
and the value model's values at each rollout's policy tokens (TRL's loss mask: completion tokens less tool
responses) give GAE's per-token advantages and returns; they go into the batch as ``advantages`` (replacing
TRL's group ones: TRL's loss reads them as they are, for every ``loss_type``), ``returns``, ``old_values``,
``value_mask`` (the policy tokens of scored rollouts) and ``value_tokens`` (their count over every process),
which TRL shuffles and cuts into micro-batches with the rest. At each training step
(:func:`micro_batch_targets`), each walked row's value loss reads its micro-batch's fields.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..critic.value_model import ValueModel, ValueTarget
from .losses import loss_mask
from .sequences import Owner, step_sequences


def batch_targets(
    critic: ValueModel,
    output: dict,
    rewards_per_func: torch.Tensor,
    reward_weights: torch.Tensor,
    process: int = 0,
) -> tuple[dict, dict]:
    """The generation batch ``output`` (this process's rows) with its value-model fields (module docstring),
    and the generation's ``value/*`` metrics. ``rewards_per_func``: ``(processes x B, F)`` every process's
    rollouts' rewards by reward function as TRL gathers them (NaN: not scored by that function), weighted by
    ``reward_weights`` and summed; a rollout no function scored gets NaN (no advantage, no value loss)."""
    rows, device = output["prompt_ids"].shape[0], output["prompt_ids"].device
    per_func = rewards_per_func[process * rows : (process + 1) * rows].to(device)
    rewards = (per_func * reward_weights.to(device).unsqueeze(0)).nansum(dim=1)
    rewards = torch.where(torch.isnan(per_func).all(dim=1), float("nan"), rewards)
    mask = loss_mask(output)
    seqs, owners = step_sequences([output], keep_prompt_only=False)
    positions = [mask[o.row].nonzero()[:, 0] for o in owners]
    values = critic.values(seqs, positions)
    targets = critic.targets(values, [float(rewards[o.row]) for o in owners])
    names = ("advantages", "returns", "old_values", "value_mask")
    fields = {name: torch.zeros(mask.shape, device=mask.device) for name in names}
    for k, (owner, p) in enumerate(zip(owners, positions, strict=True)):
        p = p.to(mask.device)
        fields["advantages"][owner.row, p] = targets.advantages[k].to(mask.device)
        fields["returns"][owner.row, p] = targets.returns[k].to(mask.device)
        fields["old_values"][owner.row, p] = values[k].float().to(mask.device)
        fields["value_mask"][owner.row, p] = float(targets.scored[k])
    fields["value_tokens"] = torch.tensor(targets.tokens, device=mask.device)
    return {**output, **fields}, targets.metrics


def micro_batch_targets(batches: Sequence[dict], owners: Sequence[Owner], trainer) -> list[ValueTarget]:
    """Per walked row (``owners``), its value loss's :class:`ValueTarget` from its micro-batch's fields: the
    value loss is the mean over the generation's policy tokens, on every process and in every micro-batch
    (``value_tokens`` per process, times the ``trainer``'s accumulation steps over its steps per
    generation)."""
    accumulation, per_generation = (
        trainer.current_gradient_accumulation_steps,
        trainer.args.steps_per_generation,
    )
    out = []
    for owner in owners:
        inputs = batches[owner.batch]
        tokens = float(inputs["value_tokens"]) / trainer.accelerator.num_processes
        norm = max(tokens, 1.0) * accumulation / per_generation
        positions = inputs["value_mask"][owner.row].nonzero()[:, 0]
        old, returns = inputs["old_values"][owner.row, positions], inputs["returns"][owner.row, positions]
        out.append(ValueTarget(positions, old, returns, 1.0, norm))
    return out
