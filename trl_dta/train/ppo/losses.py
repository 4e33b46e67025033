"""TRL's GRPO-family loss, one row at a time.

``GRPOTrainer._compute_loss`` turns a padded (B, T) micro-batch of per-token log-probs into one scalar.
The tree walk meets the rows one by one (a row's log-probs are complete only at its leaf), so this module
writes the same loss as a sum of per-row terms: ``sum_i RowLoss(i, logps_i, entropies_i)`` equals TRL's
loss, value and gradient, for every ``loss_type`` and option. Every cross-row quantity of TRL's loss is a
constant of the micro-batch (row count, mask totals, ``num_items_in_batch``, the entropy-quantile mask), so
it is computed once here from the inputs; the per-token math follows TRL line by line, on (1, T) rows.

``tests/test_losses.py`` checks this against TRL's own ``_compute_loss`` for each loss type and option: it
is what catches drift when TRL changes (the supported TRL range is kept narrow for that reason).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "vespo", "luspo")
ROW_NORMALISED = ("grpo", "sapo", "luspo", "dr_grpo")  # loss types whose normaliser counts the rows


def loss_mask(inputs: dict) -> torch.Tensor:
    """TRL's (B, T) mask of the completion tokens the loss reads: the completion mask, times the tool mask
    (0 on tool-response tokens of multi-turn rollouts) when there is one."""
    mask = inputs["completion_mask"]
    return mask if "tool_mask" not in inputs else mask * inputs["tool_mask"]


@dataclass(frozen=True)
class LossSettings:
    """The numbers of a GRPOTrainer's loss (read from the trainer by :meth:`from_trainer`)."""

    loss_type: str
    epsilon_low: float
    epsilon_high: float
    delta: float | None
    beta: float
    use_bias_correction_kl: bool
    importance_sampling_level: str
    sapo_temperature_pos: float
    sapo_temperature_neg: float
    vespo: tuple[float, float, float, float]  # k_pos, lambda_pos, k_neg, lambda_neg
    off_policy_mask_threshold: float | None
    vllm_importance_sampling: bool
    max_completion_length: int
    num_processes: int
    steps_per_generation: int

    @classmethod
    def from_trainer(cls, trainer) -> LossSettings:
        args = trainer.args
        if trainer.loss_type not in LOSS_TYPES:
            raise ValueError(
                f"loss_type {trainer.loss_type!r} is not supported by the tree trainer ({LOSS_TYPES})."
            )
        return cls(
            loss_type=trainer.loss_type,
            epsilon_low=trainer.epsilon_low,
            epsilon_high=trainer.epsilon_high,
            delta=args.delta,
            beta=trainer.beta,
            use_bias_correction_kl=args.use_bias_correction_kl,
            importance_sampling_level=trainer.importance_sampling_level,
            sapo_temperature_pos=args.sapo_temperature_pos,
            sapo_temperature_neg=args.sapo_temperature_neg,
            vespo=(args.vespo_k_pos, args.vespo_lambda_pos, args.vespo_k_neg, args.vespo_lambda_neg),
            off_policy_mask_threshold=trainer.off_policy_mask_threshold,
            vllm_importance_sampling=bool(trainer.use_vllm and trainer.vllm_importance_sampling_correction),
            max_completion_length=trainer.max_completion_length,
            num_processes=trainer.accelerator.num_processes,
            steps_per_generation=args.steps_per_generation,
        )


class RowLoss:
    """``RowLoss(settings, inputs, ...)(i, logps, entropies)``: row ``i``'s share of TRL's micro-batch loss.

    Args:
        settings: the loss's numbers.
        inputs: the micro-batch as ``_compute_loss`` receives it (completion_mask, advantages, optional
            tool_mask, old/ref/sampling log-probs, importance_sampling_ratio, num_items_in_batch).
        accumulation_steps: ``current_gradient_accumulation_steps`` in training, 1 in evaluation.
        entropy_mask: TRL's top-entropy-quantile mask of the micro-batch, or None.
        entropy_coef: the entropy bonus coefficient applied in this step (0 for none).
        training: whether the normalisers are those of training (gradient accumulation) or evaluation.
        rows: the row count of the row-counting normalisers (grpo, sapo, luspo, dr_grpo); default: the
            micro-batch's rows. A re-partitioned micro-batch padded with zero-weight rows passes the
            configured per-device batch size, which keeps the global objective of stock TRL.

    ``logps``/``entropies`` passed to the call are the row's completion log-probs/entropies over its first
    ``n <= T`` completion positions (the rest of the row is masked); they keep their autograd graph.
    """

    def __init__(
        self,
        settings,
        inputs,
        accumulation_steps,
        entropy_mask=None,
        entropy_coef=0.0,
        training=True,
        rows=None,
    ):
        self.s = settings
        self.inputs = inputs
        self.mask = loss_mask(inputs)
        self.rows = self.mask.shape[0] if rows is None else rows
        advantages = inputs["advantages"]
        self.advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
        self.entropy_mask = entropy_mask
        self.entropy_coef = entropy_coef
        self.accumulation = accumulation_steps
        # constants of the micro-batch: TRL's normalisers
        s = settings
        if s.loss_type in ("grpo", "sapo", "luspo"):
            self.norm = self.rows * accumulation_steps  # mean over rows (of per-row means for grpo/sapo)
        elif s.loss_type == "bnpo":
            self.norm = self.mask.sum().clamp(min=1.0) * accumulation_steps
        elif s.loss_type == "dr_grpo":
            self.norm = self.rows * s.max_completion_length * accumulation_steps
        else:  # cispo, dapo, vespo: num_items_in_batch rescaled to one accumulation window
            norm = inputs["num_items_in_batch"].clamp(min=1.0) / s.num_processes
            self.norm = norm * accumulation_steps / s.steps_per_generation if training else norm
        if entropy_coef:
            effective = self.mask if entropy_mask is None else self.mask * entropy_mask
            self.entropy_norm = effective.sum().clamp(min=1.0) * accumulation_steps

    def _row(self, name, i):
        value = self.inputs.get(name)
        return None if value is None else value[i : i + 1]

    def __call__(self, i: int, logps: torch.Tensor, entropies: torch.Tensor | None) -> torch.Tensor:
        s = self.s
        mask, advantages = self.mask[i : i + 1], self.advantages[i : i + 1]
        old = self._row("old_per_token_logps", i)
        n = logps.shape[0]
        # (1, T) row: the live log-probs, then the masked tail filled so that ratios there are exactly 1
        fill = old[0, n:] if old is not None else logps.new_zeros(mask.shape[1] - n)
        per_token_logps = torch.cat([logps, fill.to(logps.dtype)]).unsqueeze(0)
        old = per_token_logps.detach() if old is None else old

        off_policy_mask = None
        if s.off_policy_mask_threshold is not None:
            off_policy_mask = self._off_policy_mask(i, advantages, per_token_logps, old, mask)

        log_ratio = per_token_logps - old
        if s.importance_sampling_level == "token":
            log_importance_weights = log_ratio
        elif s.importance_sampling_level == "sequence":
            log_importance_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        else:
            raise ValueError(f"Unknown importance sampling level: {s.importance_sampling_level}")
        coef_1 = torch.exp(log_importance_weights)

        if s.beta != 0.0:
            ref = self._row("ref_per_token_logps", i)
            per_token_kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
            if s.use_bias_correction_kl:
                per_token_kl = per_token_kl * coef_1

        per_token_loss = self._policy_loss(i, coef_1, log_ratio, advantages, per_token_logps, mask)

        if s.off_policy_mask_threshold is not None:
            per_token_loss = per_token_loss * off_policy_mask
        entropy_mask = None if self.entropy_mask is None else self.entropy_mask[i : i + 1]
        if entropy_mask is not None:
            per_token_loss = per_token_loss * entropy_mask
        if s.vllm_importance_sampling and s.loss_type != "vespo":
            per_token_loss = per_token_loss * self._row("importance_sampling_ratio", i)
        if s.beta != 0.0:
            per_token_loss = per_token_loss + s.beta * per_token_kl

        masked = (per_token_loss * mask).sum()
        if s.loss_type in ("grpo", "sapo"):
            masked = masked / mask.sum().clamp(min=1.0)
        loss = masked / self.norm

        if self.entropy_coef:
            effective = mask if entropy_mask is None else mask * entropy_mask
            row_entropies = torch.cat([entropies, entropies.new_zeros(mask.shape[1] - n)]).unsqueeze(0)
            loss = loss - self.entropy_coef * (row_entropies * effective).sum() / self.entropy_norm
        return loss

    def _off_policy_mask(self, i, advantages, per_token_logps, old, mask) -> torch.Tensor:
        from trl import GRPOTrainer

        sampling = self._row("sampling_per_token_logps", i)
        return GRPOTrainer.get_off_policy_mask(
            advantages=advantages,
            per_token_logps=per_token_logps,
            sampling_per_token_logps=old if sampling is None else sampling,
            mask=mask,
            off_policy_threshold=self.s.off_policy_mask_threshold,
        )

    def _policy_loss(self, i, coef_1, log_ratio, advantages, per_token_logps, mask) -> torch.Tensor:
        """The (1, T) policy-gradient term of the loss type, before masks, importance correction and KL."""
        s = self.s
        if s.loss_type == "cispo":
            clamped_ratios = torch.clamp(coef_1, max=s.epsilon_high).detach()
            return -clamped_ratios * advantages * per_token_logps
        elif s.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
            coef_2 = torch.clamp(coef_1, 1 - s.epsilon_low, 1 + s.epsilon_high)
            if s.delta is not None:
                coef_1 = torch.clamp(coef_1, max=s.delta)
            return -torch.min(coef_1 * advantages, coef_2 * advantages)
        elif s.loss_type == "sapo":
            temperatures = torch.where(advantages > 0, s.sapo_temperature_pos, s.sapo_temperature_neg)
            return -(torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures) * advantages
        elif s.loss_type == "vespo":
            from trl import GRPOTrainer

            k_pos, lambda_pos, k_neg, lambda_neg = s.vespo
            phi_seq = GRPOTrainer.get_gamma_weights(
                advantages=advantages,
                log_ratio_per_token=log_ratio,
                mask=mask,
                importance_sampling_ratio=self._row("importance_sampling_ratio", i),
                k_pos=k_pos,
                lambda_pos=lambda_pos,
                k_neg=k_neg,
                lambda_neg=lambda_neg,
            )
            return -phi_seq * advantages * per_token_logps
        raise ValueError(f"Unknown loss type: {s.loss_type}")
