"""TreePPOTrainer: TRL's GRPOTrainer with the policy forward/backward replaced by a prefix-trie walk.

Everything else is TRL's own: generation (tools and environments included), rewards, advantages, the
shuffle of each generation batch into micro-batches, gradient accumulation, logging, checkpointing,
saving. What changes:

* ``compute_loss``: at the first micro-batch of each optimizer step (its schedule:
  :mod:`trl_dta.train.step_schedule`), the rows of *all* the step's micro-batches (TRL's buffered, shuffled
  micro-batches) go into one prefix trie, walked once through the step seam (:mod:`trl_dta.train.step`,
  :mod:`trl_dta.train.ppo.sequences`); each row's loss is :class:`~trl_dta.train.ppo.losses.RowLoss` with
  the constants of the micro-batch TRL put it in, so the accumulated gradient is exactly TRL's, for every
  loss type, in ``.grad`` during the walk. Each micro-batch's ``compute_loss`` then runs TRL's
  ``_compute_loss`` on its (detached) walk values in place of the model: TRL's metrics and adaptive-entropy
  state, and a loss that must equal the sum of its row losses (checked), returned on a fresh tensor that
  requires grad (the Trainer's ``backward`` adds nothing).
* ``_get_per_token_logps_and_entropies`` (TRL's no-grad passes: old-policy and reference log-probs)
  walks one trie of the generation batch, its LM head only on completion positions (TRL's
  ``logits_to_keep``).
* :meth:`TreePPOTrainer.dense_loss`: stock TRL's dense loss of a micro-batch (``tree_check_gradients``).
* Several processes (:mod:`trl_dta.train.multi_process`; DDP, FSDP2, DeepSpeed ZeRO-2/3; FSDP1 refused):
  the step's rollouts are first re-split across ranks (:mod:`trl_dta.train.ppo.repartition`), except for
  losses with per-micro-batch statistics (bnpo, ``top_entropy_quantile``, the entropy bonus).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from contextlib import contextmanager

import torch
from trl import GRPOTrainer

from ...vllm import VLLMMixin
from ..critic.value_model import ValueModel, ValueModelCheckpoints
from ..dense_fallback import refuse_always
from ..refusals import check_arguments, rollout_length
from ..step_schedule import StepSchedule, checked
from ..tree_args import PAPER
from ..tree_trainer import TreeTrainer
from .config import TreePPOConfig
from .losses import ROW_NORMALISED, LossSettings, RowLoss, loss_mask
from .repartition import lexicographic, repartition
from .sequences import RowLosses, Walked, scatter, step_sequences, walked_batches
from .values import batch_targets, micro_batch_targets

logger = logging.getLogger(__name__)

_MULTIMODAL = tuple(  # the multimodal inputs TRL's batches can carry (refused)
    "pixel_values image_grid_thw pixel_attention_mask spatial_shapes image_sizes token_type_ids "
    "mm_token_type_ids image_position_ids".split()
)


class TreePPOTrainer(TreeTrainer, VLLMMixin, ValueModelCheckpoints, GRPOTrainer):
    """A drop-in replacement for ``trl.GRPOTrainer`` (same arguments) that trains on one prefix trie of each
    optimizer step's rollouts: shared prefixes are forwarded and backpropagated once, with exactly the
    dense gradients.

    Example::

        from trl_dta import TreePPOConfig, TreePPOTrainer

        args = TreePPOConfig(output_dir="out", num_generations=8, gradient_accumulation_steps=4)
        trainer = TreePPOTrainer(model="Qwen/Qwen3-0.6B", reward_funcs=reward_fn, args=args,
                                 train_dataset=dataset)
        trainer.train()

    Args: those of ``GRPOTrainer``, and:
        args: should be a :class:`~trl_dta.TreePPOConfig` (a plain ``GRPOConfig`` gets the tree options'
            defaults; ``None`` makes a ``TreePPOConfig``).
        value_model (keyword): ``None`` (default): TRL's group-relative advantages, no critic. Else PPO with a
            value model (:mod:`trl_dta.train.critic.value_model`, docs/ppo-critic.md): a Hub id or path (a
            ``*ForTokenClassification`` with ``num_labels=1`` loaded with ``model_init_kwargs``; a causal
            LM's checkpoint, the policy's own for a warm start, gets a zero head), or a module (a
            ``*ForTokenClassification``, or a PEFT model of one; :func:`~trl_dta.value_model_from` builds one
            from the policy). GAE (``gamma``, ``lam``) gives per-token advantages, and the value model is
            trained on the same trie with its own optimizer (``value_learning_rate``,
            ``value_max_grad_norm``, ``cliprange_value``). One process or DDP.
    """

    _tag_names = ["trl", "grpo", "trl-dta", "tree-ppo"]
    _name = "TreePPO"
    _paper = PAPER

    def __init__(self, model, reward_funcs=None, args=None, *rest, value_model=None, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "") or "model"
            args = TreePPOConfig(f"{name.split('/')[-1]}-TreePPO")
        check_arguments(args, model, kwargs.get("peft_config"))  # (before TRL's set-up)
        super().__init__(model, reward_funcs, args, *rest, **kwargs)
        a = self.args
        self._start_walking(  # (a colocated vLLM engine's share reserved: VLLMMixin)
            rollout_length(a),
            self.ref_model,
            disable_dropout=a.disable_dropout,
            reserved_bytes=self.vllm_reserved_bytes(),
        )
        self._tree_lexicographic = getattr(a, "tree_lexicographic_steps", False)
        self._tree_ordered = None  # the buffered micro-batches last put in lexicographic order
        self._loss_settings = LossSettings.from_trainer(self)
        self._critic = None  # PPO's value model (value_model=: critic/value_model.py), else None
        if value_model is not None:  # (after the policy's checks)
            self._critic = ValueModel.for_trainer(value_model, self, rollout_length(a))
        self._rewards_per_func = None  # the last generation batch's rewards (a value model's targets)
        # Re-partition the global batch in lexicographic runs, unless the loss has per-micro-batch statistics
        # (bnpo, top_entropy_quantile, entropy bonus): those keep TRL's per-rank batches.
        self._repartition = self._walker.multi_process and not (
            self.loss_type == "bnpo" or self.top_entropy_quantile < 1.0 or self._entropy_bonus_enabled
        )
        # TRL's router loss is not row-normalised: on re-partitioned rows, with padding rows, every step walks
        self._router_loss_walks = self._repartition and self.aux_loss_enabled
        if self._router_loss_walks:
            refuse_always(self._walker.dense_fallback, "with a router loss on re-partitioned rows")

    # ------------------------------------------------------------------ multi-process: re-partition
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self._critic is not None:
            self._rewards_per_func = rewards  # (every process's rows, as TRL gathers them)
        return rewards

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self._critic is not None:  # GAE's per-token advantages replace TRL's group ones (ppo/values.py)
            output = self._value_targets(output)
        if self._repartition and self.model.training:
            output, info = repartition(output, multiple=self.args.steps_per_generation)
            self._metrics["train"]["tree/rank_rows"].append(info["rows"])
            self._metrics["train"]["tree/rank_padding_rows"].append(info["padded_rows"])
        return output

    def _value_targets(self, output: dict) -> dict:
        """The generation batch with its value model's targets (:func:`~trl_dta.train.ppo.values.
        batch_targets`, from this process's rows of the rewards TRL gathered)."""
        weights, process = self.reward_weights, self.accelerator.process_index
        output, metrics = batch_targets(self._critic, output, self._rewards_per_func, weights, process)
        for name, value in metrics.items():
            self._metrics["train" if self.model.training else "eval"][name].append(value)
        return output

    # ------------------------------------------------------------------ opt-in: lexicographic steps
    def _prepare_inputs(self, generation_batch):
        inputs = super()._prepare_inputs(generation_batch)
        if (
            self._tree_lexicographic
            and self.model.training
            and self._buffered_inputs is not self._tree_ordered
        ):
            self._buffered_inputs = self._tree_ordered = lexicographic(self._buffered_inputs)
            inputs = self._buffered_inputs[self._step % self.args.steps_per_generation]
        return inputs

    # ------------------------------------------------------------------ TRL's log-prob passes
    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        """TRL's no-grad log-prob passes (old policy, reference model) through one trie of the batch, or TRL's
        own pass where ``tree_dense_fallback`` predicts it faster (the same values). Called
        by TRL's ``_compute_loss`` with a :class:`Walked` or :class:`_DensePass` in place of the model (see
        :meth:`_trl_loss`, :meth:`dense_loss`): the walk's values, or TRL's own dense pass."""
        if isinstance(model, Walked):
            return model.logps, model.entropies, model.aux
        trl = (input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss)
        if isinstance(model, _DensePass):
            return super()._get_per_token_logps_and_entropies(model.module, *trl, **multimodal)
        if any(multimodal.get(k) is not None for k in _MULTIMODAL):
            raise ValueError("multimodal inputs are not supported by the tree walk.")
        if torch.is_grad_enabled():
            raise RuntimeError("TreePPOTrainer computes gradients through the tree walk, not the dense path.")
        prompt_len = input_ids.shape[1] - logits_to_keep
        batch = {
            "prompt_ids": input_ids[:, :prompt_len],
            "prompt_mask": attention_mask[:, :prompt_len],
            "completion_ids": input_ids[:, prompt_len:],
            "completion_mask": attention_mask[:, prompt_len:],
        }
        seqs, owners = step_sequences([batch], keep_prompt_only=self.aux_loss_enabled)
        chunk = batch_size or input_ids.shape[0]  # (TRL's dense pass forwards the rows chunk by chunk)
        chunked = [s._replace(batch=o.row // chunk) for s, o in zip(seqs, owners, strict=True)]
        if self._walker.prefer_dense(model, chunked, timed=False):  # (tree_dense_fallback: TRL's own pass)
            return super()._get_per_token_logps_and_entropies(model, *trl)
        with self._walker.step(model, seqs, training=False) as step:
            out = step.logprobs(self.temperature, entropies=compute_entropy)
        lps, ents = out if compute_entropy else (out, None)
        shape = [(input_ids.shape[0], logits_to_keep)]
        logps = scatter(lps, owners, shape, input_ids.device)[0]
        entropies = scatter(ents, owners, shape, input_ids.device)[0] if compute_entropy else None
        return logps, entropies, None

    # ------------------------------------------------------------------ the training loss
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        self._schedule = None  # (a new optimizer step: its schedule is made at its first micro-batch)
        return super().get_batch_samples(epoch_iterator, num_batches, device)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("The TreePPOTrainer does not support returning outputs")
        multimodal = [k for k in _MULTIMODAL if inputs.get(k) is not None]
        if multimodal:
            raise ValueError(
                f"multimodal inputs ({', '.join(multimodal)}) are not supported by the tree walk."
            )
        training = self.model.training and torch.is_grad_enabled()
        schedule = self._scheduled(inputs) if training else None
        if schedule is None:  # (evaluation, or a micro-batch that is not TRL's buffered one: walked alone)
            walked = self._walk(model, [inputs], training=training)[0]
        elif schedule.takes_dense_path(lambda: self._prefer_dense(model, schedule.batches)):
            started = time.perf_counter()
            loss = GRPOTrainer._compute_loss(self, _DensePass(model), inputs)  # (TRL's own loss and backward)
            self._dense_forward_done(started)
            return loss * self._padding_scale(inputs)
        else:  # this micro-batch's share of the walk of its optimizer step (step_schedule.py)
            walked = schedule.serve(inputs, lambda batches: self._walk(model, batches, training=True))
        loss = self._trl_loss(inputs, walked)
        if training:
            self._walker.micro_batch_done(model)  # (DDP: the step's gradients averaged once)
            if self._critic is not None:  # (its optimizer step after the step's last micro-batch)
                self._critic.micro_batch_done(self._metrics["train"])
            return torch.zeros((), device=loss.device, requires_grad=True) + loss  # gradients are in .grad
        return loss

    def _scheduled(self, inputs) -> StepSchedule | None:
        """The current optimizer step's schedule where ``inputs`` is TRL's buffered micro-batch it expects
        next; made at the step's first micro-batch from TRL's buffered micro-batches of the step, and extended
        by the next generation batch's where a step runs past the end of one. None for a micro-batch that is
        not TRL's buffered one (``compute_loss`` called directly, a custom ``_prepare_inputs``)."""
        index = self._step % self.args.steps_per_generation
        buffered = self._buffered_inputs
        if buffered is None or index >= len(buffered) or buffered[index] is not inputs:
            return None
        steps, schedule = self.current_gradient_accumulation_steps, self._schedule
        if schedule is None:
            check = self._walker.take_check()  # (tree_check_gradients: the first step)
            schedule = self._schedule = StepSchedule(buffered[index : index + steps], check=check)
        elif schedule.done and len(schedule.batches) < steps:  # (the step's rest, from the next generation)
            schedule.extend(buffered[index : index + steps - len(schedule.batches)])
        return schedule if schedule.expects(inputs) else None

    def _prefer_dense(self, model, group: list[dict]) -> bool:
        """Whether the step of the micro-batches ``group`` takes TRL's dense path (``tree_dense_fallback``:
        the cost model predicts it faster; the same gradients; :meth:`StepWalker.prefer_dense`). Never with a
        value model (its training walk shares the step's trie) or a router loss on re-partitioned rows."""
        if self._critic is not None or self._router_loss_walks:
            return False
        seqs, _ = step_sequences(group, keep_prompt_only=self.aux_loss_enabled)
        passes = float(self.top_entropy_quantile < 1.0) + float(self.aux_loss_enabled)
        shapes = [
            (len(b["prompt_ids"]), b["prompt_ids"].shape[1] + b["completion_ids"].shape[1]) for b in group
        ]
        return self._walker.prefer_dense(
            model,
            seqs,
            no_grad_passes=passes,
            metrics=self._metrics["train"],
            checkpointing=bool(self.args.gradient_checkpointing),
            shapes=shapes,
        )

    def _padding_scale(self, inputs) -> float:
        """What TRL's loss of a re-partitioned micro-batch is multiplied by to keep the global objective: a
        row-normalised loss divides by the micro-batch's rows, its zero-weight padding rows counted, where the
        walk divides by the configured rows (ppo/repartition.py); so rows over configured there, else 1."""
        rows, configured = inputs["completion_mask"].shape[0], self.args.per_device_train_batch_size
        return rows / configured if self._padded(inputs) and self.loss_type in ROW_NORMALISED else 1.0

    def _padded(self, inputs) -> bool:
        """Whether a training micro-batch holds a re-partition's padding rows (more or fewer rows than
        configured)."""
        rows = inputs["completion_mask"].shape[0]
        return self._repartition and self.model.training and rows != self.args.per_device_train_batch_size

    def _row_loss(self, inputs, training: bool, entropies: torch.Tensor | None) -> RowLoss:
        """TRL's loss for one micro-batch, per row: the micro-batch constants are settled here."""
        entropy_mask = None
        if self.top_entropy_quantile < 1.0:  # couples the micro-batch's rows: its entropies come first
            entropy_mask = self.get_high_entropy_mask(
                entropies, loss_mask(inputs), 1 - self.top_entropy_quantile
            )
        entropy_coef = 0.0
        if self._entropy_bonus_enabled:  # TRL applies the coefficient set at the end of the previous step
            entropy_coef = self.entropy_coef
            if self.use_adaptive_entropy and self._last_world_entropy > self.args.entropy_target:
                entropy_coef = 0.0
        accumulation = self.current_gradient_accumulation_steps if training else 1
        rows = self.args.per_device_train_batch_size if (self._repartition and training) else None
        return RowLoss(self._loss_settings, inputs, accumulation, entropy_mask, entropy_coef, training, rows)

    def _walk(self, model, batches: list[dict], training: bool) -> list[Walked]:
        """Walk one trie of the rows of ``batches`` (backward in training, log-probs in evaluation), each row
        with its own micro-batch's loss; return each micro-batch's share. The passes, in the order every rank
        keeps: the step's entropies (``top_entropy_quantile``), the MoE router counts, the walk."""
        seqs, owners = step_sequences(batches, keep_prompt_only=self.aux_loss_enabled)
        metrics = self._metrics["train" if training else "eval"]
        with self._walker.step(
            model,
            seqs,
            training=training,
            metrics=metrics,
            dense_loss=self.dense_loss,
            batches=batches,
            checked=checked(self._schedule, training),
        ) as step:
            quantile = None
            if self.top_entropy_quantile < 1.0:  # couples a micro-batch's rows: their entropies come first
                _, ents = step.logprobs(self.temperature, entropies=True)
                shapes = [b["completion_ids"].shape for b in batches]
                quantile = scatter(ents, owners, shapes, batches[0]["completion_ids"].device)
            row_losses = [
                self._row_loss(inputs, training, None if quantile is None else quantile[b])
                for b, inputs in enumerate(batches)
            ]
            auxes, aux_terms = [None] * len(batches), [0.0] * len(batches)
            if self.aux_loss_enabled:  # MoE: TRL's load-balancing loss, exactly (load_balancing.py)
                steps = self.current_gradient_accumulation_steps if training else 1
                coef = self.router_aux_loss_coef / steps
                auxes, aux_terms = step.router_loss(coef, len(batches))
            losses = RowLosses(owners, row_losses)
            if training:
                step.backward(losses, self.temperature, entropy_grad=self._entropy_bonus_enabled)
                if self._critic is not None:  # the value model on the same trie (its peak is the step's too)
                    targets = micro_batch_targets(batches, owners, self)
                    step.include(self._critic.backward(seqs, targets, metrics))
            else:
                step.score(losses, self.temperature)
        if self.aux_loss_enabled:
            device = batches[0]["completion_ids"].device
            auxes = [torch.zeros((), device=device) if a is None else a for a in auxes]
        return walked_batches(step.results, owners, batches, auxes, aux_terms)

    def _trl_loss(self, inputs, walked: Walked) -> torch.Tensor:
        """TRL's own loss of the micro-batch on the walk's values (its metrics and state), checked against the
        walk's row losses: a guard against TRL changing its loss under ``RowLoss``."""
        loss = GRPOTrainer._compute_loss(self, walked, inputs).detach()  # walked stands in for the model
        total = walked.policy + walked.aux_term
        expected = total  # what TRL's _compute_loss must give on these values
        padded = self._padded(inputs)
        if padded and self.loss_type in ROW_NORMALISED:  # (TRL divides by the padded rows: _padding_scale)
            expected = walked.policy / self._padding_scale(inputs) + walked.aux_term
        if abs(float(loss) - expected) > 1e-4 * walked.magnitude + 1e-7:  # fp32 rounding of a sum of terms
            raise RuntimeError(
                f"TRL's loss on the walk's log-probs ({float(loss):.8g}) differs from the sum of the per-row "
                f"losses ({expected:.8g}): trl_dta's RowLoss no longer mirrors this TRL version's loss."
            )
        return torch.tensor(total, device=loss.device, dtype=loss.dtype) if padded else loss

    # ------------------------------------------------------------------ the dense path, for checking
    def dense_loss(self, model, inputs: dict) -> torch.Tensor:
        """TRL's own loss of one micro-batch through stock ``GRPOTrainer``'s dense forward (with its graph),
        leaving this trainer's metrics and adaptive-entropy state as they were: what ``tree_check_gradients``
        (and anyone checking the walk) compares the walk's gradients against."""
        with self._state_kept():
            return GRPOTrainer._compute_loss(self, _DensePass(model), inputs)

    @contextmanager
    def _state_kept(self):
        """Run TRL's loss without logging its metrics or advancing its adaptive-entropy state."""
        state = (self._metrics, self.entropy_coef, self._entropy_window_stats, self._last_world_entropy)
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        try:
            yield
        finally:
            self._metrics, self.entropy_coef, self._entropy_window_stats, self._last_world_entropy = state


class _DensePass:
    """Stands in for the model in TRL's ``_compute_loss``: its log-prob pass then runs TRL's own dense
    forward of ``module`` (:meth:`TreePPOTrainer.dense_loss`)."""

    def __init__(self, module):
        self.module = module
