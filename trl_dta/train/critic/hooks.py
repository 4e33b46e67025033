""":class:`~trl_dta.TreePPOTrainer`'s value-model hooks (``value_model=``): PPO with a critic on TRL's
``GRPOTrainer``, the critic walked on each step's trie beside the policy.

A mixin of the trainer (``class TreePPOTrainer(VLLMMixin, ValueModelMixin, GRPOTrainer)``); without a value
model every hook passes through. With one:

* **Generation** (:meth:`_value_targets`, called on each generation batch): the rollouts' rewards (TRL's
  reward functions, weighted and summed, kept by :meth:`_calculate_rewards`) go on each rollout's last
  policy token; the old values come from one no-gradient walk of the value model on the batch's trie; GAE
  per rollout over the policy's own tokens (tool responses skipped) gives per-token advantages and returns
  (:func:`~trl_dta.train.critic.gae.value_targets`), whitened over every process. The batch's
  ``advantages`` become these ``(B, T)`` ones: TRL's loss reads them as they are, for every ``loss_type``.
* **Training** (:meth:`_walk_value_model`, inside each step's walk): the value model is walked on the same
  trie and the same sequences as the policy, by its own executor, with the clipped value loss of each
  sequence (:class:`~trl_dta.train.critic.gae.ValueRowLoss`); its optimizer steps after the step's last
  micro-batch (:meth:`_value_model_step`: gradients averaged over processes, clipped on their own).
* **Checkpoints**: the value model is saved beside the policy (``value_model/`` in the checkpoint and in
  ``output_dir``), with its optimizer and scheduler states, and restored on resume.

Metrics: ``value/loss``, ``value/clip_ratio``, ``value/grad_norm`` per step; ``value/mean``,
``value/returns_mean``, ``value/explained_variance`` per generation batch; the value model's walk logs
``value_tree/*`` as the policy's logs ``tree/*``.
"""

from __future__ import annotations

import torch

from ..dense_fallback import refuse_always
from ..ppo.losses import loss_mask
from ..ppo.sequences import RowLosses, scatter, step_sequences
from ..refusals import check_value_model, rollout_length
from .gae import ValueRowLoss, value_targets
from .model import Critic, load_value_model


class ValueModelMixin:
    """The value-model hooks of a GRPO trainer (module docstring). ``self._critic``: the
    :class:`~trl_dta.train.critic.model.Critic`, or None."""

    _critic: Critic | None = None

    def _init_value_model(self, value_model) -> None:
        """After TRL's set-up and the policy's checks: load, place and check the value model."""
        if value_model is None:
            return
        check_value_model(value_model, self.accelerator)
        refuse_always(self._walker.dense_fallback, "with a value model (its walk shares the policy's trie)")
        a = self.args
        if isinstance(value_model, str):
            kwargs = dict(a.model_init_kwargs or {})
            kwargs.setdefault("dtype", self.accelerator.unwrap_model(self.model).dtype)
            kwargs.setdefault("attn_implementation", self.model.config._attn_implementation)
            kwargs.setdefault("trust_remote_code", a.trust_remote_code)
            kwargs["device_map"] = None  # (placed on the trainer's device by Critic)
            value_model = load_value_model(value_model, **kwargs)
        self._critic = Critic(value_model, a, self.accelerator)
        self._walker.train_together(self.model, self._critic.model)
        self._walker.check_models(  # (the value model trains: as the policy, dropout off or refused)
            self._critic.model, tokenizer=self.processing_class, length=rollout_length(a),
            disable_dropout=a.disable_dropout,
        )  # fmt: skip
        self._rewards_per_func = None

    # ------------------------------------------------------------------ generation: targets
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self._critic is not None:
            self._rewards_per_func = rewards  # (every process's rows, as TRL gathers them)
        return rewards

    def _value_targets(self, output: dict) -> dict:
        """The generation batch ``output`` with its value-model fields: per-token ``advantages`` (replacing
        TRL's group ones), ``returns``, ``old_values``, ``value_mask`` and ``value_tokens``."""
        if self._critic is None:
            return output
        rows, device = output["prompt_ids"].shape[0], output["prompt_ids"].device
        start = self.accelerator.process_index * rows
        per_func = self._rewards_per_func[start : start + rows].to(device)
        scorable = ~torch.isnan(per_func).all(dim=1)  # TRL's unscorable rows: no advantage, no value loss
        rewards = (per_func * self.reward_weights.to(device).unsqueeze(0)).nansum(dim=1)
        mask = loss_mask(output) * scorable.unsqueeze(1)
        seqs, owners = step_sequences([output], keep_prompt_only=False)
        with self._walker.step(self._critic.model, seqs, training=False) as step:
            values = step.logprobs()
        old_values = scatter(values, owners, [mask.shape], device)[0]
        reduce = (lambda t: self.accelerator.reduce(t, "sum")) if self.accelerator.num_processes > 1 else None
        a = self.args
        fields, metrics = value_targets(
            mask, rewards, old_values, gamma=a.gamma, lam=a.lam, whiten_advantages=a.whiten_advantages,
            sum_over_processes=reduce,
        )  # fmt: skip
        mode = "train" if self.model.training else "eval"
        for name, value in metrics.items():
            self._metrics[mode][name].append(value)
        return {**output, **fields, "value_mask": mask.to(fields["returns"].dtype)}

    # ------------------------------------------------------------------ training: the value model's walk
    def _walk_value_model(self, seqs, owners, batches: list[dict], metrics):
        """Inside a training step's walk: the value model walked on the same sequences, each with its clipped
        value loss (gradients in its ``.grad``). Returns the walk (:class:`~trl_dta.train.step.StepWalk`)."""
        a = self.args
        accumulation = self.current_gradient_accumulation_steps
        row_losses = []
        for inputs in batches:  # the value loss is the mean over the step's policy tokens, on every process
            tokens = float(inputs["value_tokens"]) / self.accelerator.num_processes
            norm = max(tokens, 1.0) * accumulation / a.steps_per_generation
            row_losses.append(ValueRowLoss(inputs["value_mask"], inputs["old_values"], inputs["returns"],
                                           norm, a.cliprange_value))  # fmt: skip
        with self._walker.step(self._critic.model, seqs, metrics=metrics, prefix="value_tree/") as step:
            step.backward(RowLosses(owners, row_losses), entropies=False)
        loss, clipped, tokens = 0.0, 0.0, 0.0
        for k, owner in enumerate(owners):
            values = step.results.logps[k]
            if values is None or values.numel() == 0:
                continue
            row_loss = row_losses[owner.batch]
            loss += float(step.results.losses[k])
            clipped += float(row_loss.clipped(owner.row, values).sum())
            tokens += float(row_loss.mask[owner.row, : values.numel()].sum())
        totals = torch.tensor([loss, clipped, tokens], dtype=torch.float64, device=self.accelerator.device)
        loss, clipped, tokens = self.accelerator.reduce(totals, "sum").tolist()
        metrics["value/loss"].append(loss / self.accelerator.num_processes)
        metrics["value/clip_ratio"].append(clipped / max(tokens, 1.0))
        return step

    def _value_model_step(self) -> None:
        """After each training micro-batch: after the step's last one, the value model's gradients averaged
        over processes (DDP), then its optimizer step."""
        if self._critic is None:
            return
        self._walker.micro_batch_done(self._critic.model)
        if self.accelerator.sync_gradients:
            self._metrics["train"]["value/grad_norm"].append(self._critic.step())

    # ------------------------------------------------------------------ optimizer and checkpoints
    def create_scheduler(self, num_training_steps: int, optimizer=None):
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        if self._critic is not None:  # (built with the policy's: the Trainer knows the step count now)
            self._critic.create_optimizer(self, num_training_steps)
        return scheduler

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        super().save_model(output_dir, _internal_call)
        if self._critic is not None and self.args.should_save:
            self._critic.save(output_dir or self.args.output_dir, optimizer=False)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        if self._critic is not None and self.args.should_save:
            self._critic.save(output_dir, weights=False)  # (save_model wrote its weights)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if self._critic is not None and checkpoint is not None:
            self._critic.load(checkpoint)
