"""TreeSFTTrainer: TRL's SFTTrainer with the training forward/backward replaced by a prefix-trie walk.

Everything else is TRL's own: dataset preparation (conversational, tools, prompt-completion, chat templates,
``assistant_only_loss``, ``completion_only_loss``, truncation, packing), the collator, the sampler, gradient
accumulation, logging, evaluation, checkpointing, saving. What changes:

* :meth:`get_batch_samples` (where the Trainer fetches an optimizer step's micro-batches before training on
  them) keeps the step's micro-batches; at the step's first ``compute_loss`` every sample of all of them
  goes into one prefix trie (:mod:`trl_dta.train.sft_samples`: a row, or each sample of a padding-free row),
  walked once by :meth:`TreeExecutor.backward`. Each sample's loss is TRL's terms for its tokens (``nll`` or
  ``dft``) with the normaliser of its micro-batch (``num_items_in_batch`` across accumulation and ranks, or
  the micro-batch's own token count and the accumulation steps), so the accumulated gradient is TRL's. The
  gradients land in ``.grad`` during the walk; each micro-batch's ``compute_loss`` returns TRL's loss value
  on a fresh tensor (the Trainer's ``backward`` adds nothing) and logs TRL's metrics for it.
* Metrics: ``entropy``, ``mean_token_accuracy`` (one more no-graph pass, ``tree_token_accuracy``),
  ``num_tokens``, as TRL computes them per micro-batch, and ``tree/*`` of each walk.
* Evaluation (no gradients) runs TRL's own dense ``compute_loss``.
* DDP: the walk runs on the unwrapped module and the gradients are averaged once per step; TRL's per-rank
  batches are kept. FSDP2: each walk gathers the sharded parameters once and reduce-scatters the gradients
  once (:mod:`trl_dta.walk.sharding`). FSDP1, DeepSpeed, context/sequence parallelism are refused (the
  distributed checks are ``TreePPOTrainer``'s, :func:`~trl_dta.train.multi_process.check_distributed`), as are
  settings whose loss the walk cannot compute from its log-probs and entropies (label smoothing,
  ``compute_loss_func``, Liger kernels), multimodal data, MoE load balancing (``router_aux_loss_coef``),
  fp16, activation offloading.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from accelerate.utils import DistributedType
from torch.distributed.tensor import DTensor
from trl import SFTTrainer

from ..trie import PrefixTrie
from ..walk.determinism import disable_randomness
from ..walk.executor import TreeExecutor
from ..walk.sharding import fsdp_units
from .gradient_check import GradientCheck
from .multi_process import all_reduce_gradients, check_distributed, idle_walks
from .sft_config import TreeSFTConfig
from .sft_samples import Sample, batch_samples, num_input_tokens, trained_tokens
from .tree_args import PAPER

# the accuracy pass: at this temperature the label's log-prob is > -(log V + 1) iff it is the top-1 token
# (unless its logit is within ~1e-5 of the top one: a tie up to float rounding)
ACCURACY_TEMPERATURE = 1e-6


@dataclass
class _Step:
    """An optimizer step's micro-batches as the Trainer fetched them, and what the walk gave each."""

    batches: list
    num_items: object
    results: list | None = None
    served: int = 0


@dataclass
class _MicroBatch:
    """One micro-batch's share of a walk: TRL's loss value and the sums behind TRL's metrics."""

    loss: float = 0.0
    entropy: float = 0.0  # summed over trained tokens
    correct: float = 0.0  # trained tokens whose label is the top-1 token
    terms: list = field(default_factory=list)


class TreeSFTTrainer(SFTTrainer):
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
        super().__init__(model, args, *rest, **kwargs)
        a = self.args

        def option(name):
            return getattr(a, name, getattr(TreeSFTConfig, name))

        self._tree_options = {
            "block_size": option("tree_block_size"),
            "batch_tokens": option("tree_batch_tokens"),
            "subtree_tokens": option("tree_subtree_tokens"),
            "memory_budget": option("tree_memory_budget"),
        }
        self._tree_check = option("tree_check_gradients")
        self._tree_check_tolerance = option("tree_check_tolerance")
        self._tree_accuracy = option("tree_token_accuracy")
        self._executors: dict[int, TreeExecutor] = {}
        self._tree_step: _Step | None = None
        self._multi_process = self.accelerator.num_processes > 1
        self._refuse_unsupported()
        if option("disable_dropout"):
            disable_randomness(self.accelerator.unwrap_model(self.model))

    def _refuse_unsupported(self) -> None:
        a = self.args
        if self._is_vision_dataset or self._is_vlm:
            raise ValueError("multimodal models and datasets are not supported by the tree walk (text only).")
        if a.fp16:
            raise ValueError(
                "fp16 mixed precision (gradient scaling) is not supported by the tree walk; use bf16."
            )
        if a.use_liger_kernel:
            raise ValueError(
                "use_liger_kernel replaces the model's layers and loss kernels; it is not supported by the "
                "tree walk."
            )
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
        if self.aux_loss_enabled:
            raise ValueError(
                "the MoE load-balancing loss (router_aux_loss_coef) is not supported by TreeSFTTrainer yet; "
                "set router_aux_loss_coef=0.0 (TreePPOTrainer supports it)."
            )
        if a.activation_offloading:
            raise ValueError(
                "activation_offloading is not supported; the walk bounds its memory by tree_block_size."
            )
        parallelism = self.accelerator.parallelism_config
        if parallelism is not None and (parallelism.cp_enabled or parallelism.sp_enabled):
            raise ValueError("context and sequence parallelism are not supported by the tree walk.")
        check_distributed(self.accelerator)  # TreePPOTrainer's rules: FSDP1 refused, FSDP2 settings
        if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            raise ValueError(
                "DeepSpeed is not supported by TreeSFTTrainer yet (TreePPOTrainer routes DeepSpeed's step "
                "around the walk; the SFT trainer does not): use DDP or FSDP2."
            )
        if self._multi_process and self._tree_check:
            raise ValueError("tree_check_gradients runs on a single process only.")

    def _executor(self, model) -> TreeExecutor:
        model = self.accelerator.unwrap_model(model)
        if id(model) not in self._executors:
            self._executors[id(model)] = TreeExecutor(model, **self._tree_options)
        return self._executors[id(model)]

    # ------------------------------------------------------------------ the step's micro-batches
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._tree_step = _Step(list(batches), num_items)
        return batches, num_items

    # ------------------------------------------------------------------ the training loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs or not (self.model.training and torch.is_grad_enabled()):  # evaluation: TRL's
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        walked = self._walked_in_step(model, inputs, num_items_in_batch)
        self._log_metrics(inputs, walked)
        device = inputs["input_ids"].device
        if self._multi_process and self.accelerator.sync_gradients:
            # the walk ran on the unwrapped module (no DDP hooks): average the accumulated gradients once (on
            # an FSDP2 model the walk has reduce-scattered the sharded ones itself: only parameters left out
            # of every FSDP2 unit are averaged here)
            plain = [p for p in model.parameters() if p.requires_grad and not isinstance(p, DTensor)]
            if plain:
                all_reduce_gradients(plain)
        return torch.zeros((), device=device, requires_grad=True) + walked.loss  # gradients are in .grad

    def _walked_in_step(self, model, inputs, num_items_in_batch) -> _MicroBatch:
        """This micro-batch's share of the walk of its optimizer step: at the step's first micro-batch, walk
        every micro-batch the Trainer fetched for the step, then serve the results one at a time. A
        micro-batch that is not the step's next one (``compute_loss`` called directly) is walked alone."""
        step = self._tree_step
        index = step.served if step is not None else 0
        if (
            step is None
            or index >= len(step.batches)
            or num_items_in_batch is not step.num_items
            or not _same_batch(step.batches[index], inputs)
        ):
            return self._walk(model, [inputs], num_items_in_batch)[0]
        if step.results is None:
            batches = [inputs if k == index else self._prepare_inputs(b) for k, b in enumerate(step.batches)]
            check = None
            if self._tree_check:
                check = GradientCheck(
                    _DenseStep(self, num_items_in_batch), model, batches, self._tree_check_tolerance
                )
            step.results = self._walk(model, batches, num_items_in_batch)
            if check is not None:
                self._metrics["train"]["tree/check_error"].append(check.finish())
                self._tree_check = False
        step.served += 1
        return step.results[index]

    def _scales(self, batches, num_items) -> tuple[list[float], list[float]]:
        """Per micro-batch, the factor of a summed token loss in TRL's loss value, and in the gradient (the
        Trainer divides by the accumulation steps unless the loss is normalised by ``num_items_in_batch``)."""
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
        return values, [v / accumulation for v in values]

    def _walk(self, model, batches: list[dict], num_items) -> list[_MicroBatch]:
        """Walk one trie of every sample of ``batches``, each with its micro-batch's TRL loss; return each
        micro-batch's loss value and metric sums."""
        started = time.perf_counter()
        samples = batch_samples(batches)
        values, grads = self._scales(batches, num_items)
        out = [_MicroBatch() for _ in batches]
        if not samples:
            if self._multi_process and fsdp_units(self.accelerator.unwrap_model(model)):
                # the other ranks' walks gather and reduce: take part (the accuracy pass, then the backward)
                with self.accelerator.autocast():
                    idle_walks(self._executor(model), int(self._tree_accuracy), training=True)
            return out
        trie = PrefixTrie.from_sequences([s.tokens for s in samples])
        score_from = [s.score_from for s in samples]
        executor = self._executor(model)
        before = (executor.calls.forward, executor.calls.backward, executor.calls.tokens)
        dft = self.args.loss_type == "dft"

        def loss_fn(k: int, logps: torch.Tensor, entropies: torch.Tensor) -> torch.Tensor:
            sample: Sample = samples[k]
            mask = sample.mask.to(logps.device)
            per_token = -logps
            if dft:  # DFT: https://huggingface.co/papers/2508.05629
                per_token = per_token * logps.exp().detach()
            total = torch.where(mask, per_token, 0.0).sum()
            result = out[sample.batch]
            result.terms.append(total.detach())
            result.entropy += float(torch.where(mask, entropies.detach(), 0.0).double().sum())
            return total * grads[sample.batch]

        with self.accelerator.autocast():
            if self._tree_accuracy:  # (before the backward: the order idle_walks keeps on sharded models)
                self._count_correct(executor, trie, samples, score_from, out)
            executor.backward(trie, loss_fn, 1.0, entropies=True, score_from=score_from)
        for result, value in zip(out, values, strict=True):
            result.loss = float(sum(t.double() for t in result.terms)) * value
            result.terms = []
        self._log_walk(trie, executor, before, score_from, time.perf_counter() - started)
        return out

    def _count_correct(self, executor, trie, samples, score_from, out) -> None:
        """TRL's ``is_top1`` per trained token, from a no-graph walk at a temperature of ~0: there a label's
        log-prob is ~0 if its logit is the largest, and about -(gap to the largest) / temperature if not."""
        threshold = -(math.log(executor.lm.vocab_size) + 1.0)
        with torch.no_grad():
            cold = executor.logprobs(trie, ACCURACY_TEMPERATURE, score_from=score_from)
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

    def _log_walk(self, trie, executor, before, score_from, seconds: float) -> None:
        """The walk's metrics: the trie's tokens and dedup ratio, the FLOP-weighted ideal (dense FLOPs / walk
        FLOPs), the model calls of its passes and tokens per forward call, and its time."""
        metrics = self._metrics["train"]
        metrics["tree/tokens"].append(float(trie.num_tokens))
        metrics["tree/unique_tokens"].append(float(trie.num_unique_tokens))
        metrics["tree/dedup_ratio"].append(trie.dedup_ratio)
        dense, walk = executor.flops(trie, score_from)
        metrics["tree/flop_ratio"].append(dense / walk)
        forward = executor.calls.forward - before[0]
        backward = executor.calls.backward - before[1]
        metrics["tree/calls"].append(float(forward + backward))
        metrics["tree/tokens_per_call"].append((executor.calls.tokens - before[2]) / max(forward, 1))
        metrics["tree/time"].append(seconds)

    # ------------------------------------------------------------------ the dense path, for checking
    def dense_loss(self, model, inputs: dict, num_items_in_batch=None) -> torch.Tensor:
        """Stock ``SFTTrainer``'s loss of one micro-batch (with its graph), as the Trainer backpropagates it
        (divided by the accumulation steps where the Trainer divides), leaving this trainer's metrics as they
        were: what ``tree_check_gradients`` (and anyone checking the walk) compares the walk against."""
        with self._state_kept():
            loss = SFTTrainer.compute_loss(self, model, dict(inputs), num_items_in_batch=num_items_in_batch)
        values, grads = self._scales([inputs], num_items_in_batch)
        return loss * (grads[0] / values[0])

    @contextmanager
    def _state_kept(self):
        state = (self._metrics, self._total_train_tokens)
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        try:
            yield
        finally:
            self._metrics, self._total_train_tokens = state


class _DenseStep:
    """The trainer as :class:`GradientCheck` sees it: ``dense_loss(model, inputs)`` with the step's
    ``num_items_in_batch``."""

    def __init__(self, trainer: TreeSFTTrainer, num_items):
        self.trainer, self.num_items = trainer, num_items

    def dense_loss(self, model, inputs):
        return self.trainer.dense_loss(model, inputs, self.num_items)


def _same_batch(raw: dict, inputs: dict) -> bool:
    """Whether ``inputs`` (prepared by the Trainer) is the micro-batch ``raw`` the dataloader gave."""
    a, b = raw.get("input_ids"), inputs.get("input_ids")
    return a is not None and b is not None and a.shape == b.shape and torch.equal(a.to(b.device), b)
