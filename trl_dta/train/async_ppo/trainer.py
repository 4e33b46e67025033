"""AsyncTreePPOTrainer: TRL's asynchronous GRPO (``trl.experimental.async_grpo.AsyncGRPOTrainer``) with each
optimizer step's rollouts walked as one prefix trie instead of TRL's whole-row tree packing.

Everything around the loss stays TRL's: the rollout worker that keeps a vLLM server busy (or a custom
``rollout_worker=``, TRL's extension point), the rollout queue and its staleness bound (``max_staleness``:
``RolloutQueueDataset`` drops older samples), weight sync after each step (NCCL full weights, GPU only, or a
LoRA adapter loaded by path), the optimizer loop, checkpoints, and the metrics (ratio, kl, entropy, clip
ratios, ``perf/*``, ``batch/*``, ``sample/*``). What changes:

* **Model loading.** TRL loads the policy with its FA3 tree-attention kernel and patches a fused LM head onto
  its forward. Both are TRL's ``__init__``'s own calls (no hook), so this trainer undoes them right after it:
  the loaded model is switched to ``tree_attn_implementation`` (``set_attn_implementation``; the FA3 kernel
  is fetched only at a forward, so none is ever fetched) and the fused-head forward, an instance attribute,
  is removed (the walk runs the backbone and the LM head itself). Loading twice, or patching TRL's module,
  would be the alternatives; this is the one that keeps TRL's loading (dtype, PEFT, pad tokens) as is.
* **Micro-batches** (:mod:`trl_dta.train.async_ppo.data`): ``per_device_train_batch_size`` samples per
  rank each, in queue order, none dropped for length (TRL's ``token_budget`` is refused). With several
  processes (DDP), each micro-batch is split across ranks by the contiguous lexicographic partition
  (:func:`~trl_dta.lexicographic_partition`) instead of TRL's greedy least-loaded rows; ranks with fewer
  samples get zero-weight rows. TRL's normaliser (the micro-batch's trained tokens over all ranks, per
  rank) and the walk's one gradient average per step make the gradient the single-process one.
* **The step** (``compute_loss``): at the first micro-batch of an optimizer step, the samples of all its
  micro-batches (``get_batch_samples`` keeps them) become one trie walked by
  :class:`~trl_dta.train.step.StepWalker`; each sample's loss is
  :class:`~trl_dta.train.async_ppo.loss.ClippedSurrogate`, its share of TRL's loss with its own behaviour
  log-probs and its micro-batch's normaliser, so the accumulated gradient is TRL's loss's, exactly. Samples
  of different policy versions share prefixes in the trie and keep their own importance weights. Each
  ``compute_loss`` then logs TRL's metrics of its micro-batch from the walk's values and returns its loss
  value (gradients are in ``.grad``).
* **Options beyond TRL's** (docs/async.md): AReaL's decoupled objective (``use_decoupled_loss``,
  :mod:`~trl_dta.train.async_ppo.loss`) and its k updates per proximal pass (``ppo_n_minibatches``,
  :mod:`~trl_dta.train.async_ppo.minibatches`), the staleness bound checked again when a sample trains
  (``check_staleness_at_training``), a value model (``value_model=``, :mod:`~trl_dta.train.async_ppo.values`)
  and the dense path on steps the cost model predicts slower to walk (``tree_dense_fallback``).

Tested: one process, and two DDP processes (gloo, CPU). FSDP2 goes through the walk's FSDP2 flow
(:mod:`trl_dta.train.multi_process`) but is not tested with this trainer. Refused, with a clear error: a MoE
load-balancing loss (TRL's is computed on its packed rows; set ``router_aux_loss_coef=0.0``),
vision-language checkpoints, a positive ``token_budget``, fp16, Liger kernels, PEFT prompt learning, a
model object instead of a path.
"""

from __future__ import annotations

import inspect
import time
from contextlib import contextmanager

import torch
from torch.utils.data import DataLoader
from trl.experimental.async_grpo import AsyncGRPOTrainer, async_grpo_trainer
from trl.experimental.async_grpo.async_grpo_trainer import RolloutQueueDataset, _EmptyIterableDataset

from ..critic.value_model import ValueModel, ValueModelCheckpoints
from ..refusals import check_arguments, rollout_length
from ..step_schedule import StepSchedule, checked, same_micro_batch
from ..tree_args import PAPER
from ..tree_trainer import TreeTrainer
from .config import AsyncTreePPOConfig, check_async_arguments
from .data import SampleBatcher, SampleCollator, VersionedQueue
from .loss import (
    ClippedSurrogate,
    Decoupled,
    dense_loss,
    micro_batch_samples,
    step_samples,
    tokens_per_rank,
)
from .metrics import MicroBatchWalk, dense_micro_batch, micro_batch_metrics
from .minibatches import ProximalPasses, add_pass_fields
from .values import check_episodes, sample_targets


class AsyncTreePPOTrainer(TreeTrainer, ValueModelCheckpoints, AsyncGRPOTrainer):
    """TRL's ``AsyncGRPOTrainer`` (same arguments) training on one prefix trie of each optimizer step's
    rollouts: shared prefixes are forwarded and backpropagated once, memory is bounded by one root-to-leaf
    path (the ``tree_*`` budgets), no sample is dropped for its length, any attention the walk supports
    runs (CPU too), and the gradients equal TRL's asynchronous loss computed densely on the same samples.

    Example::

        from trl_dta import AsyncTreePPOConfig, AsyncTreePPOTrainer

        args = AsyncTreePPOConfig(output_dir="out", vllm_server_base_url="http://localhost:8000",
                                  per_device_train_batch_size=8, gradient_accumulation_steps=4,
                                  max_staleness=2)
        trainer = AsyncTreePPOTrainer(model="Qwen/Qwen3-0.6B", reward_funcs=reward_fn, args=args,
                                      train_dataset=dataset)
        trainer.train()

    Args: those of ``AsyncGRPOTrainer`` (``model`` is a model id or directory, as there; ``rollout_worker``
    and ``weight_transfer`` are TRL's protocols), and ``value_model`` (keyword): PPO with a value model, as
    :class:`~trl_dta.TreePPOTrainer`'s, its values taken at training time
    (:mod:`trl_dta.train.async_ppo.values`). ``args`` should be an :class:`~trl_dta.AsyncTreePPOConfig` (a
    plain ``AsyncGRPOConfig`` gets the tree options' defaults; ``None`` makes an ``AsyncTreePPOConfig``).
    One process or several (DDP; see the module docstring).
    """

    _tag_names = ["trl", "async-grpo", "trl-dta", "tree-ppo"]
    _name = "AsyncTreePPO"
    _paper = PAPER

    def __init__(self, model: str, reward_funcs=None, args=None, *rest, **kwargs):
        if not isinstance(model, str):
            raise TypeError(
                f"AsyncTreePPOTrainer (like TRL's AsyncGRPOTrainer) loads the policy itself: pass a model id "
                f"or directory, not a {type(model).__name__}."
            )
        value_model = kwargs.pop("value_model", None)
        if args is None:
            args = AsyncTreePPOConfig(f"{model.rstrip('/').split('/')[-1]}-AsyncTreePPO")
        check_async_arguments(args)  # (before TRL's set-up; a plain AsyncGRPOConfig too)
        check_arguments(args, None, kwargs.get("peft_config"))
        if value_model is not None:  # (rows of one conversation: ppo_async_values.check_episodes)
            signature = inspect.signature(AsyncGRPOTrainer.__init__)
            check_episodes(args, signature.bind(self, model, reward_funcs, args, *rest, **kwargs).arguments)
        with _peak_flops_off_cuda():
            super().__init__(model, reward_funcs, args, *rest, **kwargs)
        if self.aux_loss_enabled:
            raise ValueError(
                "AsyncTreePPOTrainer does not support the MoE load-balancing loss (TRL computes it on its "
                "packed rows, which the walk does not form); set router_aux_loss_coef=0.0."
            )
        if self._is_vlm:
            raise ValueError(
                "AsyncTreePPOTrainer trains text-only causal LMs; this checkpoint is vision-language."
            )
        self._use_walk_attention()
        disable_dropout = getattr(self.args, "disable_dropout", True)
        self._start_walking(
            rollout_length(self.args), disable_dropout=disable_dropout
        )  # (before the rollouts)
        a = self.args
        self._decoupled = None  # AReaL's decoupled objective (use_decoupled_loss), else TRL's coupled one
        if getattr(a, "use_decoupled_loss", False):
            self._decoupled = Decoupled(a.behav_imp_weight_cap, a.behav_imp_weight_mode)
        self._critic = None  # PPO's value model (value_model=: async_ppo/values.py), else None
        if value_model is not None:
            self._critic = ValueModel.for_trainer(value_model, self, rollout_length(a))
        self._passes = None  # ppo_n_minibatches > 1: the steps of the current proximal pass
        if getattr(a, "ppo_n_minibatches", 1) > 1:
            self._passes = ProximalPasses(a.ppo_n_minibatches, self._proximal_pass)

    def _proximal_pass(self, batches: list[dict]) -> None:
        """A pass's fields (proximal log-probs; with a value model old values, returns, advantages) added to
        its raw micro-batches by the policy as it is now (:func:`~trl_dta.train.async_ppo.minibatches.
        add_pass_fields`)."""
        model = self.model_wrapped if self.model_wrapped is not None else self.model
        add_pass_fields(self._walker, model, batches, self.temperature, self._critic, self._metrics["train"])

    def _use_walk_attention(self) -> None:
        """Undo TRL's model set-up for its packing: the FA3 tree attention and the fused-LM-head forward."""
        module = self.accelerator.unwrap_model(self.model)
        base = module.get_base_model() if hasattr(module, "get_base_model") else module
        base.set_attn_implementation(getattr(self.args, "tree_attn_implementation", "sdpa"))
        vars(base).pop("forward", None)  # (add_fused_lm_head's instance attribute: the class forward is back)

    # ------------------------------------------------------------------ data: TRL's queue, no sample dropped
    def get_train_dataloader(self) -> DataLoader:
        num_processes = self.accelerator.num_processes
        if self.accelerator.is_main_process:
            versioned = VersionedQueue(self.rollout_queue)  # (each sample's version, to its training step)
            dataset = RolloutQueueDataset(
                rollout_queue=versioned,
                model_version_fn=lambda: self.model_version,
                check_health_fn=self.rollout_worker.check_health,
                stale_after_s=self.args.heartbeat_stale_after_s,
                metrics=self._metrics["train"],
                max_staleness=self.args.max_staleness,
                report_to=self.args.report_to,
            )
            self._rollout_dataset = dataset  # (TRL's step metrics read its queue wait)
            dataset = SampleBatcher(
                dataset, self.args.per_device_train_batch_size * num_processes, versioned.versions
            )
        else:
            dataset = _EmptyIterableDataset()
        collator = SampleCollator(
            self.processing_class.pad_token_id,
            num_processes,
            groups_trained=self._trained_groups,
            metrics=self._metrics["train"],
        )
        return self.accelerator.prepare(DataLoader(dataset, batch_size=1, collate_fn=collator, num_workers=0))

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        if self._passes is None:
            batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        else:  # ppo_n_minibatches > 1: this step's share of its pass (async_ppo/minibatches.py)
            fetch = lambda: super(AsyncTreePPOTrainer, self).get_batch_samples(
                epoch_iterator, num_batches, device
            )
            batches, num_items = self._passes.take(fetch, self.state.max_steps - self.state.global_step)
        check = self._walker.take_check()  # (tree_check_gradients: the first step)
        self._schedule = StepSchedule(
            batches, same=same_micro_batch, prepare=self._prepare_inputs, check=check
        )
        return batches, num_items

    # ------------------------------------------------------------------ the loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("AsyncTreePPOTrainer does not support returning outputs")
        training = self.model.training and torch.is_grad_enabled()
        start = time.time()
        schedule = self._schedule if training else None
        if schedule is None or not schedule.expects(inputs):  # (evaluation, or a micro-batch walked alone)
            walked = self._walk(model, [inputs], training)[0]
        elif schedule.takes_dense_path(lambda: self._prefer_dense(model, schedule.prepared(inputs))):
            walked, loss = self._dense_micro_batch(model, inputs)  # (tree_dense_fallback: the same gradient)
            self._dense_forward_done(time.perf_counter() - (time.time() - start))
            self._last_forward_time_s = time.time() - start
            self._log_micro_batch(inputs, walked)
            return loss  # (the Trainer backpropagates it)
        else:  # this micro-batch's share of its optimizer step's walk (step_schedule.py)
            walked = schedule.serve(inputs, lambda batches: self._walk(model, batches, True))
        self._last_forward_time_s = time.time() - start
        self._log_micro_batch(inputs, walked)
        device = inputs["input_ids"].device
        loss = torch.tensor(walked.loss, device=device, dtype=torch.float32)
        if training:
            self._walker.micro_batch_done(model)
            if self._critic is not None:  # (its optimizer step after the step's last micro-batch)
                self._critic.micro_batch_done(self._metrics["train"])
            return torch.zeros((), device=device, requires_grad=True) + loss  # (gradients are in .grad)
        return loss

    def dense_loss(self, model, inputs: dict) -> torch.Tensor:
        """TRL's loss of one collated micro-batch by a plain forward of each sample (with its graph): what
        ``tree_check_gradients``, and the tests, compare the walk with."""
        return dense_loss(
            model,
            inputs,
            self.epsilon_low,
            self.epsilon_high,
            self.temperature,
            self.current_gradient_accumulation_steps,
            self.accelerator.num_processes,
            self._decoupled,
        )

    def _prefer_dense(self, model, group: list[dict]) -> bool:
        """Whether the step of the micro-batches ``group`` takes the dense path (``tree_dense_fallback``: one
        padded forward per micro-batch, :func:`~trl_dta.train.async_ppo.loss.padded_logps`, the same loss and
        gradient), by the step seam's prediction. Never with a value model or ``check_staleness_at_training``
        (both work on the step's walk)."""
        if self._critic is not None or getattr(self.args, "check_staleness_at_training", False):
            return False
        samples = step_samples(group)
        seqs = [s.sequence() for s in samples]
        shapes = [tuple(b["input_ids"].shape) for b in group]  # (padded_logps: all rows, padded)
        dense = self._walker.prefer_dense(model, seqs, metrics=self._metrics["train"], shapes=shapes)
        if dense:  # (the staleness at training, logged as the walk logs it)
            self._within_staleness(samples)
        return dense

    def _dense_micro_batch(self, model, inputs) -> tuple[MicroBatchWalk, torch.Tensor]:
        """The micro-batch's loss by the dense path (with its graph) and its share for the metrics."""
        samples = micro_batch_samples(inputs)
        normaliser = [tokens_per_rank(inputs, self.accelerator.num_processes)]
        loss_fn = ClippedSurrogate(
            samples,
            normaliser,
            self.epsilon_low,
            self.epsilon_high,
            self.current_gradient_accumulation_steps,
            self._decoupled,
        )
        return dense_micro_batch(model, inputs, samples, loss_fn, self.temperature)

    def _walk(self, model, batches: list[dict], training: bool) -> list[MicroBatchWalk]:
        """One trie of the samples of ``batches`` (micro-batches of a step), each sample with its
        micro-batch's share of TRL's loss: backward in training, scoring otherwise. Returns each micro-batch's
        share."""
        samples = step_samples(batches)
        if training:
            samples = self._within_staleness(samples)
        world = self.accelerator.num_processes
        accumulation = self.current_gradient_accumulation_steps if training else 1
        normalisers = [tokens_per_rank(inputs, world) for inputs in batches]
        sequences = [s.sequence() for s in samples]
        metrics = self._metrics["train" if training else "eval"]
        targets = None
        if self._critic is not None:  # the current value model's values, GAE: per-token advantages
            from_pass = all("old_values" in inputs for inputs in batches)  # (a pass's: ppo_n_minibatches)
            samples, targets = sample_targets(
                self._critic, samples, sequences, normalisers, accumulation, metrics, from_pass
            )
        loss_fn = ClippedSurrogate(
            samples, normalisers, self.epsilon_low, self.epsilon_high, accumulation, self._decoupled
        )
        walk = self._walker.step(
            model,
            sequences,
            training=training,
            metrics=metrics,
            dense_loss=self.dense_loss,
            batches=batches,
            checked=checked(self._schedule, training),
        )
        with walk as step:
            if training:
                step.backward(loss_fn, self.temperature, entropies=True, entropy_grad=False)
                if targets is not None:  # the value model on the same trie (its peak is the step's too)
                    step.include(self._critic.backward(sequences, targets, metrics))
            else:
                step.score(loss_fn, self.temperature)
        results = step.results
        out = [MicroBatchWalk([], [], [], 0.0) for _ in batches]
        for k, s in enumerate(samples):
            share = out[s.batch]
            positions = s.positions.to(results.logps[k].device)
            share.samples.append(s)
            share.logps.append(results.logps[k][positions])
            share.entropies.append(results.entropies[k][positions])
        for b, share in enumerate(out):
            share.loss = results.total([k for k, s in enumerate(samples) if s.batch == b])
        return out

    def _within_staleness(self, samples: list) -> list:
        """The step's samples as they train: their staleness now (the policy version less each one's, over
        every rank's samples) logged as ``staleness/train_max`` and ``staleness/train_mean``; with
        ``check_staleness_at_training``, a sample past ``max_staleness`` (TRL checks it when the sample leaves
        the queue; accelerate's prefetch can hand it to a later step) leaves the loss, counted in
        ``staleness/train_dropped`` (the micro-batch's normaliser, fixed when it was collated, is kept)."""
        known = [self.model_version - s.version for s in samples if s.version >= 0]
        limit = self.args.max_staleness
        check = getattr(self.args, "check_staleness_at_training", False)
        over = [s for s in samples if check and s.version >= 0 and self.model_version - s.version > limit]
        local = [sum(known), len(known), len(over), max(known, default=-1)]  # (one gather: the sums, the max)
        local = torch.tensor(local, dtype=torch.float64, device=self.accelerator.device)
        ranks = self.accelerator.gather(local).reshape(-1, 4)
        (total, count, dropped), largest = ranks[:, :3].sum(0).tolist(), float(ranks[:, 3].max())
        metrics = self._metrics["train"]
        if count:
            metrics["staleness/train_max"].append(largest)
            metrics["staleness/train_mean"].append(total / count)
        if check:
            metrics["staleness/train_dropped"].append(dropped)
        dropped_ids = {id(s) for s in over}
        return [s for s in samples if id(s) not in dropped_ids]

    def _log_micro_batch(self, inputs, walked: MicroBatchWalk) -> None:
        """TRL's per-micro-batch metrics (``compute_loss``'s, logged under "train" as TRL's are; the decoupled
        objective's too) from the walk's values (:mod:`~trl_dta.train.async_ppo.metrics`), and TRL's
        per-step accounting."""
        values = micro_batch_metrics(
            walked,
            self.accelerator,
            self.epsilon_low,
            self.epsilon_high,
            self._decoupled,
            inputs["input_ids"].device,
            version=self.model_version,
        )
        for name, value in values.items():
            self._metrics["train"][name].append(value)
        trained, forward, samples = inputs["counts"][0].tolist()  # (the micro-batch's, over all ranks)
        mean_seq_len = forward / samples
        self._step_forward_tokens += forward
        self._step_trained_tokens += trained
        self._step_seq_len_weighted += mean_seq_len * forward
        self._step_samples += samples
        self._step_forward_s += self._last_forward_time_s


@contextmanager
def _peak_flops_off_cuda():
    """TRL 1.16's ``__init__`` asks CUDA for the device's name (its MFU metrics), which fails on a machine
    without CUDA. For the time of that ``__init__``, a non-CUDA device gets TRL's answer for an unknown device
    (None: MFU metrics off, throughput and timings still logged); on CUDA, TRL's own function runs."""
    original = async_grpo_trainer.get_peak_flops_per_device

    def peak_flops(accelerator, dtype):
        return original(accelerator, dtype) if accelerator.device.type == "cuda" else None

    async_grpo_trainer.get_peak_flops_per_device = peak_flops
    try:
        yield
    finally:
        async_grpo_trainer.get_peak_flops_per_device = original
