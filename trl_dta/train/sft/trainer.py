"""TreeSFTTrainer: TRL's SFTTrainer with the training forward/backward replaced by a prefix-trie walk.

Everything else is TRL's own: dataset preparation (conversational, tools, prompt-completion, chat templates,
``assistant_only_loss``, ``completion_only_loss``, truncation, packing), the collator, the sampler, gradient
accumulation, logging, evaluation, checkpointing, saving. What changes:

* :meth:`get_batch_samples` (where the Trainer fetches an optimizer step's micro-batches before training on
  them) keeps the step's micro-batches; at the step's first ``compute_loss`` every sample of all of them
  goes into one prefix trie (:mod:`trl_dta.train.sft.samples`: a row, or each sample of a padding-free row),
  walked once through the step seam (:class:`~trl_dta.train.step.StepWalker`, which also runs
  :class:`~trl_dta.TreePPOTrainer`'s steps). Each sample's loss is TRL's terms for its tokens (``nll`` or
  ``dft``) with the normaliser of its micro-batch (``num_items_in_batch`` across accumulation and ranks, or
  the micro-batch's own token count and the accumulation steps), plus, for MoE models, TRL's
  load-balancing loss of each micro-batch (:mod:`trl_dta.train.load_balancing`), so the accumulated
  gradient is TRL's. The gradients land in ``.grad`` during the walk; each micro-batch's ``compute_loss``
  returns TRL's loss value on a fresh tensor (the Trainer's ``backward`` adds nothing) and logs TRL's
  metrics for it, from the values the seam keeps per sample (a walk retried after running out of memory
  overwrites them).
* Metrics: ``entropy``, ``mean_token_accuracy`` (one more no-graph pass, ``tree_token_accuracy``),
  ``num_tokens``, ``aux_loss`` (MoE), as TRL computes them per micro-batch, and ``tree/*`` of each step.
* Evaluation (no gradients) runs TRL's own dense ``compute_loss``; so does a training step that the fitted
  cost model predicts faster dense (``tree_dense_fallback``, :mod:`trl_dta.train.dense_fallback`: TRL's
  gradients either way).
* Multi-process, as for ``TreePPOTrainer`` (the seam's, :mod:`trl_dta.train.multi_process`): DDP (the walk
  on the unwrapped module, the gradients averaged once per step), FSDP2 (each walk gathers once and
  reduce-scatters once), DeepSpeed ZeRO-2/3 (one reduction per step); TRL's per-rank batches are kept.
* Refused at construction: FSDP1, context/sequence parallelism, settings whose loss the walk cannot compute
  from its log-probs and entropies (label smoothing, ``compute_loss_func``, Liger kernels), multimodal data,
  fp16, activation offloading, PEFT prompt learning (docs/sft.md lists them with the reasons).
"""

from __future__ import annotations

import functools
import math
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from trl import SFTTrainer

from ..refusals import check_arguments
from ..step import StepSequence, StepWalk
from ..step_schedule import StepSchedule, checked, same_micro_batch
from ..tree_args import PAPER
from ..tree_trainer import TreeTrainer
from .config import TreeSFTConfig
from .samples import Sample, batch_samples, num_input_tokens, sample_length, trained_tokens

# the accuracy pass: at this temperature the label's log-prob is > -(log V + 1) iff it is the top-1 token
# (unless its logit is within ~1e-5 of the top one: a tie up to float rounding)
ACCURACY_TEMPERATURE = 1e-6


@dataclass
class _MicroBatch:
    """One micro-batch's share of a walk: TRL's loss value and the sums behind TRL's metrics."""

    loss: float = 0.0
    entropy: float = 0.0  # summed over trained tokens
    correct: float = 0.0  # trained tokens whose label is the top-1 token
    aux: torch.Tensor | None = None  # MoE: its load-balancing loss (TRL's aux_loss metric)


class TreeSFTTrainer(TreeTrainer, SFTTrainer):
    """A drop-in replacement for ``trl.SFTTrainer`` (same arguments, datasets and collator) that trains on one
    prefix trie of each optimizer step's samples: shared prefixes (a system prompt and tool schemas, earlier
    turns of a conversation) are forwarded and backpropagated once, with exactly the dense gradients.

    Example::

        from trl_dta import TreeSFTConfig, TreeSFTTrainer

        args = TreeSFTConfig(output_dir="out", assistant_only_loss=True, gradient_accumulation_steps=4)
        trainer = TreeSFTTrainer(model="Qwen/Qwen3-0.6B", args=args, train_dataset=conversations)
        trainer.train()

    Args: those of ``SFTTrainer``. ``args`` should be a :class:`~trl_dta.TreeSFTConfig` (a plain
    ``SFTConfig`` gets the tree options' defaults; ``None`` makes a ``TreeSFTConfig``).

    Packing and padding-free batches are walked as their original samples (each run of a row's
    ``position_ids``), which is what TRL's forward attends over: the same loss, and samples shared across
    rows are still computed once.
    """

    _tag_names = ["trl", "sft", "trl-dta", "tree-sft"]
    _name = "TreeSFT"
    _paper = PAPER

    def __init__(self, model, args=None, *rest, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "") or "model"
            args = TreeSFTConfig(f"{name.split('/')[-1]}-TreeSFT")
        check_arguments(args, model, kwargs.get("peft_config"))  # (before TRL prepares the datasets)
        super().__init__(model, args, *rest, **kwargs)
        self._refuse_unsupported()
        self._tree_accuracy = getattr(self.args, "tree_token_accuracy", TreeSFTConfig.tree_token_accuracy)
        length = sample_length(self.args, self.train_dataset, self.eval_dataset)
        disable_dropout = getattr(self.args, "disable_dropout", TreeSFTConfig.disable_dropout)
        self._start_walking(length, disable_dropout=disable_dropout)

    def _refuse_unsupported(self) -> None:
        """What the walk cannot do in an SFT run (the rest: :class:`~trl_dta.train.step.StepWalker`)."""
        a = self.args
        if self._is_vision_dataset or self._is_vlm:
            raise ValueError("multimodal models and datasets are not supported by the tree walk (text only).")
        if self.compute_loss_func is not None:
            raise ValueError(
                "compute_loss_func needs the full logits; the tree walk computes the loss from each token's "
                "log-prob. Subclass TreeSFTTrainer instead, or use trl.SFTTrainer."
            )
        if a.label_smoothing_factor > 0 and a.loss_type == "nll":
            raise ValueError(
                "label_smoothing_factor needs every vocabulary log-prob of each position; the tree walk "
                "computes the label's log-prob and the entropy only. Set label_smoothing_factor=0 (TRL "
                "deprecates it)."
            )
        if a.activation_offloading:
            raise ValueError(
                "activation_offloading is not supported; the walk bounds its memory by tree_block_size."
            )
        parallelism = self.accelerator.parallelism_config
        if parallelism is not None and (parallelism.cp_enabled or parallelism.sp_enabled):
            raise ValueError("context and sequence parallelism are not supported by the tree walk.")

    # ------------------------------------------------------------------ the step's micro-batches
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        check = self._walker.take_check()  # (tree_check_gradients: the first step)
        self._schedule = StepSchedule(
            batches, same=same_micro_batch, prepare=self._prepare_inputs, key=num_items, check=check
        )
        return batches, num_items

    # ------------------------------------------------------------------ the training loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs or not (self.model.training and torch.is_grad_enabled()):  # evaluation: TRL's
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        schedule = self._schedule
        if schedule is None or not schedule.expects(inputs, num_items_in_batch):  # (a micro-batch alone)
            walked = self._walk(model, [inputs], num_items_in_batch)[0]
        elif schedule.takes_dense_path(lambda: self._prefer_dense(schedule)):  # (TRL's own loss)
            started = time.perf_counter()
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            self._dense_forward_done(started)
            return loss
        else:  # this micro-batch's share of the walk of its optimizer step (step_schedule.py)
            walked = schedule.serve(inputs, lambda batches: self._walk(model, batches, num_items_in_batch))
        self._log_metrics(inputs, walked)
        self._walker.micro_batch_done(model)  # (DDP: the step's gradients averaged once)
        device = inputs["input_ids"].device
        return torch.zeros((), device=device, requires_grad=True) + walked.loss  # gradients are in .grad

    def _prefer_dense(self, schedule: StepSchedule) -> bool:
        """Whether the step takes TRL's dense path (``tree_dense_fallback``), by the step seam's prediction
        (:meth:`StepWalker.prefer_dense`) for all of its micro-batches."""
        samples = batch_samples(schedule.batches, whole=self.aux_loss_enabled)
        return self._walker.prefer_dense(
            self.model,
            [StepSequence(s.tokens, s.batch, s.score_from) for s in samples],
            no_grad_passes=float(self._tree_accuracy),
            metrics=self._metrics["train"],
            checkpointing=bool(self.args.gradient_checkpointing),
            shapes=[tuple(b["input_ids"].shape) for b in schedule.batches],
        )

    def _scales(self, batches, num_items) -> tuple[list[float], int]:
        """Per micro-batch, the factor of a summed token loss in TRL's loss value; and what the Trainer
        divides the loss by for the gradient (the accumulation steps, unless the loss is normalised by
        ``num_items_in_batch``: 1)."""
        if self.loss_is_scaled_for_ga is not None:
            scaled = self.loss_is_scaled_for_ga
        else:
            scaled = (
                self.model_accepts_loss_kwargs and num_items is not None
            ) or self.compute_loss_func is not None
        accumulation = 1 if scaled else self.current_gradient_accumulation_steps
        values = []
        for inputs in batches:
            count = trained_tokens(inputs) if num_items is None else float(num_items)
            factor = 1.0 / max(float(count), 1.0)  # TRL clamps the count at 1
            if self.args.average_tokens_across_devices and num_items is not None:
                factor *= self.accelerator.num_processes // self.get_tp_size()
            values.append(factor)
        return values, accumulation

    def _walk(self, model, batches: list[dict], num_items) -> list[_MicroBatch]:
        """Walk one trie of every sample of ``batches``, each with its micro-batch's TRL loss; return each
        micro-batch's loss value and metric sums. The passes, in the order every rank keeps: the accuracy
        pass, the MoE router counts, the walk."""
        samples = batch_samples(batches, whole=self.aux_loss_enabled)
        values, accumulation = self._scales(batches, num_items)
        dft = self.args.loss_type == "dft"
        out = [_MicroBatch() for _ in batches]
        sequences = [StepSequence(s.tokens, s.batch, s.score_from) for s in samples]
        dense_loss = functools.partial(self.dense_loss, num_items_in_batch=num_items)
        with self._walker.step(
            model,
            sequences,
            metrics=self._metrics["train"],
            dense_loss=dense_loss,
            batches=batches,
            checked=checked(self._schedule, True),
        ) as step:
            if self._tree_accuracy:
                self._count_correct(step, samples, out)
            aux_values = [0.0] * len(batches)
            if self.aux_loss_enabled:  # TRL: + coef * aux / steps, the steps only with num_items_in_batch
                steps = self.current_gradient_accumulation_steps if num_items is not None else 1
                coef = self.router_aux_loss_coef / steps
                auxes, aux_values = step.router_loss(coef / accumulation, len(batches))
                aux_values = [v * accumulation for v in aux_values]
                for result, aux in zip(out, auxes, strict=True):
                    result.aux = aux

            def loss_fn(k: int, logps: torch.Tensor, entropies: torch.Tensor) -> torch.Tensor:
                sample: Sample = samples[k]
                return _token_loss(sample, logps, dft) * (values[sample.batch] / accumulation)

            step.backward(loss_fn, 1.0, entropies=True, entropy_grad=False)
        tokens = [0.0] * len(batches)
        for k, sample in enumerate(samples):  # (the values the walk kept per sample)
            logps, entropies = step.results.logps[k], step.results.entropies[k]
            tokens[sample.batch] += float(_token_loss(sample, logps, dft).double())
            mask = sample.mask.to(entropies.device)
            out[sample.batch].entropy += float(torch.where(mask, entropies, 0.0).double().sum())
        for result, total, value, aux in zip(out, tokens, values, aux_values, strict=True):
            result.loss = total * value + aux
        return out

    def _count_correct(self, step: StepWalk, samples: list[Sample], out: list[_MicroBatch]) -> None:
        """TRL's ``is_top1`` per trained token, from a no-graph walk at a temperature of ~0: there a label's
        log-prob is ~0 if its logit is the largest, and about -(gap to the largest) / temperature if not."""
        cold = step.logprobs(ACCURACY_TEMPERATURE)
        if not cold:
            return
        threshold = -(math.log(step.executor.lm.vocab_size) + 1.0)
        for sample, lp in zip(samples, cold, strict=True):
            top1 = (lp > threshold) & sample.mask.to(lp.device)
            out[sample.batch].correct += float(top1.sum())

    # ------------------------------------------------------------------ metrics
    def _log_metrics(self, inputs, walked: _MicroBatch) -> None:
        """TRL's metrics of a micro-batch (``SFTTrainer.compute_loss``), from the walk's sums."""
        mode = "train"
        device = inputs["input_ids"].device
        gather = self.accelerator.gather_for_metrics

        def total(x):
            return gather(torch.tensor(x, device=device)).sum()

        num_valid = total(trained_tokens(inputs))
        entropy_sum = total(walked.entropy)
        self._metrics[mode]["entropy"].append((entropy_sum / num_valid).item() if num_valid > 0 else 0.0)
        if self._tree_accuracy:
            correct = total(walked.correct)
            self._metrics[mode]["mean_token_accuracy"].append(
                (correct / num_valid).item() if num_valid > 0 else 0.0
            )
        self._total_train_tokens += int(total(num_input_tokens(inputs)).item()) // self._tp_size
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
        if self.aux_loss_enabled:
            aux = walked.aux if walked.aux is not None else torch.zeros((), device=device)
            self._metrics[mode]["aux_loss"].append(gather(aux.to(device)).mean().item())

    # ------------------------------------------------------------------ the dense path, for checking
    def dense_loss(self, model, inputs: dict, num_items_in_batch=None) -> torch.Tensor:
        """Stock ``SFTTrainer``'s loss of one micro-batch (with its graph), as the Trainer backpropagates it
        (divided by the accumulation steps where the Trainer divides), leaving this trainer's metrics as they
        were: what ``tree_check_gradients`` (and anyone checking the walk) compares the walk against."""
        with self._state_kept():
            loss = SFTTrainer.compute_loss(self, model, dict(inputs), num_items_in_batch=num_items_in_batch)
        _, accumulation = self._scales([inputs], num_items_in_batch)
        return loss / accumulation

    @contextmanager
    def _state_kept(self):
        state = (self._metrics, self._total_train_tokens)
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        try:
            yield
        finally:
            self._metrics, self._total_train_tokens = state


def _token_loss(sample: Sample, logps: torch.Tensor, dft: bool) -> torch.Tensor:
    """TRL's summed loss of a sample's trained tokens from its log-probs (``nll``; ``dft`` weights each by
    its detached probability, https://huggingface.co/papers/2508.05629)."""
    per_token = -logps
    if dft:
        per_token = per_token * logps.exp().detach()
    return torch.where(sample.mask.to(logps.device), per_token, 0.0).sum()
