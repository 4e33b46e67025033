"""One optimizer step's walk, whichever trainer drives it: :class:`StepWalker`, the one seam between a TRL
trainer and the tree walk.

A trainer hands the walker the *sequences* of a step (token lists, each with the micro-batch it came from
and the first log-prob index its loss reads: :class:`StepSequence`) and a per-sequence loss
``(index, logps, entropies) -> scalar``. The walker owns the rest:

* the executors (one per model it is asked to walk: the policy, a reference model) and their budgets
  (the ``tree_*`` options of :class:`~trl_dta.train.tree_args.TreeArguments`);
* the multi-process flow (:mod:`trl_dta.train.multi_process`): DDP's one gradient average per step, FSDP2's
  and DeepSpeed's walks, and the *idle walks* a rank with nothing to walk makes so that every rank's
  collectives match (each pass of :class:`StepWalk` on an empty step makes one);
* out-of-memory recovery (the executor walks a pass again with halved budgets) and a per-sequence result
  store that is safe to retry (:class:`SequenceResults`: a retried walk overwrites what the failed one
  recorded, so a loss function must only compute, never accumulate);
* the checks at construction, the randomness check (``disable_dropout``), the gradient self-check
  (``tree_check_gradients``) and the ``tree/*`` metrics of each step: the trie's tokens, dedup and FLOP
  ratios, model calls, time, the budgets in use, out-of-memory retries and the walk's peak memory.

A step is walked in *passes*, each over the whole trie, in an order every rank keeps: no-gradient passes
first (:meth:`StepWalk.logprobs`, the MoE router counts of :meth:`StepWalk.router_loss`), then the gradient
pass (:meth:`StepWalk.backward`) or, in evaluation, :meth:`StepWalk.score`. Example (one optimizer step of
micro-batches, each a list of samples with per-token behaviour log-probs, as an asynchronous GRPO trainer
packs them)::

    walker = StepWalker(args, accelerator, model)  # in the trainer's __init__, after TRL's
    sequences = [StepSequence(s.tokens, batch=b, score_from=s.prompt_length - 1)
                 for b, micro_batch in enumerate(step_batches) for s in micro_batch]

    def loss_fn(k, logps, entropies):  # sequence k's loss: only computes, never accumulates
        s = samples[k]
        ratio = torch.exp(logps - s.behaviour_logps)
        return -(ratio * s.advantage).sum() / tokens_in_step

    with walker.step(model, sequences, metrics=self._metrics["train"]) as step:
        step.backward(loss_fn, temperature, entropies=True)  # gradients in .grad
    step.results.losses[k], step.results.logps[k]  # per sequence, detached
    walker.micro_batch_done(model)  # in each compute_loss: DDP averages after the step's last one
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch
from accelerate.utils import DistributedType

from ..walk.adapter.determinism import check_deterministic, disable_randomness
from ..walk.adapter.preflight import preflight
from ..walk.cost.cost_model import CostModel
from ..walk.executor import TreeExecutor
from ..walk.memory.budgets import Budgets
from .dense_fallback import NO_GRAD_SHARE, Prediction, checked_mode, decide, refuse_always
from .gradient_check import GradientCheck
from .multi_process import UNUSED_EXPERTS, StepFlow, check_distributed
from .refusals import LengthBound, check_arguments, tokenizer_size
from .step_clock import DRIFT, StepClock
from .step_results import StepSequence
from .step_walk import StepWalk
from .tree_args import TreeArguments

logger = logging.getLogger(__name__)


class StepWalker:
    """Walks a trainer's optimizer steps (module docstring). Built once, in the trainer's ``__init__`` after
    TRL's (its accelerator and model are needed); refuses what the walk cannot do at once.

    Args:
        args: the trainer's config (a :class:`~trl_dta.train.tree_args.TreeArguments`; a plain TRL config
            gets the tree options' defaults).
        accelerator: the trainer's ``accelerate.Accelerator``.
        model: the trainer's model (checked: PEFT prompt learning is refused).

    Besides the ``tree_*`` options it reads ``cast_lm_head_to_fp32`` (GRPO's) and ``tree_gather_per_layer``
    (:class:`~trl_dta.TreePPOConfig`'s: FSDP2, a decoder layer gathered per call) where the config has them.
    """

    def __init__(self, args, accelerator, model):
        gather_per_layer = getattr(args, "tree_gather_per_layer", False)
        check_arguments(args, model)
        check_distributed(accelerator, gather_per_layer)
        self.accelerator = accelerator
        self.flow = StepFlow(accelerator)
        self.multi_process = accelerator.num_processes > 1
        self.check_gradients = _option(args, "tree_check_gradients")
        self.check_tolerance = _option(args, "tree_check_tolerance")
        self._check_pending = self.check_gradients  # (take_check: the first scheduled step is checked)
        if self.multi_process and self.check_gradients:
            raise ValueError("tree_check_gradients runs on a single process only.")
        if self.flow.deepspeed and self.check_gradients:  # (DeepSpeed's hooks would reduce the dense pass)
            raise ValueError("tree_check_gradients is not supported under DeepSpeed; check without it.")
        names = ("tree_memory_budget", "tree_block_size", "tree_batch_tokens", "tree_subtree_tokens")
        # validated once, here (a plain TRL config is not); each executor gets a fresh copy
        self.budgets = Budgets(*(_option(args, name) for name in names), prefix="tree_")
        self.reserved_bytes = 0.0
        self.options = dict(
            lm_head_fp32=getattr(args, "cast_lm_head_to_fp32", False),
            gather_per_layer=gather_per_layer,
            oom_retries=_option(args, "tree_oom_retries"),
        )
        self.executors: dict[int, TreeExecutor] = {}
        self._by_model: dict[int, tuple] = {}  # id(model) -> (model, its executor): wrapped or not
        self.trained: list = []  # the models trained in the same steps (train_together)
        self.cost_fit, self.cost_cache = _option(args, "tree_cost_fit"), _option(args, "tree_cost_cache")
        # DeepSpeed, FSDP: every step walks (tree_dense_fallback)
        self.walk_only = accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP)
        self.dense_fallback = checked_mode(_option(args, "tree_dense_fallback"), self.walk_only)
        self.dense_margin = _option(args, "tree_dense_margin")
        self.prediction: Prediction | None = None  # prefer_dense's last
        self.step_clock = StepClock()  # (the trainer stops it at each optimizer step: StepClockCallback)
        # dense steps walked again after running out of memory (give_up_dense_step)
        self.dense_oom_retries = 0

    def executor(self, model) -> TreeExecutor:
        """The executor of ``model`` (wrapped or not; built at its first call, with check_models' verdict)."""
        self.flow.register(model)  # (DeepSpeed: the walk finds the engines)
        seen = self._by_model.get(id(model))  # (unwrap_model reads package metadata: ~1.5 ms a call)
        if seen is not None and seen[0] is model:
            return seen[1]
        module = self.accelerator.unwrap_model(model)
        if id(module) not in self.executors:
            budgets = self.budgets.fresh(self.reserved_bytes)
            if any(m is module for m in self.trained):
                budgets.train_with(*(m for m in self.trained if m is not module))
            costs = None if self.cost_fit == "off" else CostModel(self.cost_fit, self.cost_cache)
            self.executors[id(module)] = TreeExecutor(
                module, budgets=budgets, cost_model=costs, **self.options
            )
        self._by_model[id(model)] = (model, self.executors[id(module)])
        return self.executors[id(module)]

    def train_together(self, *models) -> None:
        """Several models trained in the same optimizer steps, each walked by its own executor (a policy and
        its value model): each walk's ``tree_memory_budget="auto"`` leaves room for the others' gradients
        and optimizer states too (:meth:`~trl_dta.walk.memory.budgets.Budgets.train_with`). Call before their
        first walk."""
        self.trained = [self.accelerator.unwrap_model(m) for m in models]

    def reserve(self, reserved_bytes: float) -> None:
        """Bytes another user of the device claims while the walks run or right after them (a colocated vLLM
        engine): ``tree_memory_budget="auto"`` (or a percentage) takes them off the free memory it measures,
        for every executor (:class:`~trl_dta.walk.memory.budgets.Budgets`)."""
        self.reserved_bytes = reserved_bytes
        for executor in self.executors.values():
            executor.budgets.reserve(reserved_bytes)

    def check_models(
        self, policy, *others, tokenizer=None, length: LengthBound | None = None, disable_dropout: bool = True
    ) -> None:
        """At the trainer's construction, after TRL's: refuse what the first walk of ``policy`` (and of
        ``others``, a reference model; None is skipped) would refuse whatever the data
        (:mod:`trl_dta.walk.adapter.preflight`: the model's structure and the probe, ``tokenizer``'s size, the
        longest sequence the arguments allow), then ``disable_dropout`` (:meth:`disable_randomness`), or,
        without it, refuse randomness left on in the policy, by setting and by behaviour."""
        unwrap = self.accelerator.unwrap_model
        length = length or LengthBound(None)
        models, size = [m for m in (policy, *others) if m is not None], tokenizer_size(tokenizer)
        for k, model in enumerate(models):
            self.flow.register(model)  # (DeepSpeed: a reference model's engine, its hooks off in the probe)
            module = unwrap(model)
            preflight(
                module,
                lm_head_fp32=self.options["lm_head_fp32"],
                tokenizer_size=size,
                max_length=length.tokens,
                length_setting=length.setting,
                option=length.option,
                training=k == 0 and not disable_dropout,
                probe=self._placed(module),
            )
        if disable_dropout:
            self.disable_randomness(policy, *others)
        elif self._placed(module := unwrap(policy)):
            self._check_deterministic(module)

    def _placed(self, module) -> bool:
        """Whether ``module``'s weights are where it will walk (the accelerator's device kind): not under
        DeepSpeed or FSDP before their preparation moves a model loaded on the CPU, nor on the meta device."""
        kind = self.accelerator.device.type
        return all(p.device.type == kind for p in module.parameters())

    def disable_randomness(self, policy, *others) -> list[str]:
        """``disable_dropout``: zero every dropout probability and noise scale of ``policy`` and ``others``
        (a reference model; None is skipped), on modules and in configs, then check by behaviour that the
        policy is deterministic in train mode (two forwards of the same input): what is left is refused with
        the settings named. Returns what was set to 0."""
        unwrap = self.accelerator.unwrap_model
        changed = [c for m in (policy, *others) if m is not None for c in disable_randomness(unwrap(m))]
        if changed:
            logger.info("disable_dropout: set to 0: %s", ", ".join(changed))
        if self._placed(module := unwrap(policy)):  # (elsewhere: the executor checks at its first call)
            self._check_deterministic(module)
        return changed

    @staticmethod
    def _check_deterministic(policy) -> None:
        """Two forwards of the same input in train mode must agree (the settings named if not)."""
        base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
        modes = [(m, m.training) for m in policy.modules()]
        policy.train()
        try:
            device = base.get_input_embeddings().weight.device
            check_deterministic(policy, base, device, type(base).__name__)
        finally:
            for m, mode in modes:
                m.training = mode

    def step(
        self,
        model,
        sequences: Sequence[StepSequence],
        *,
        training: bool = True,
        metrics=None,
        dense_loss: Callable | None = None,
        batches: Sequence[dict] | None = None,
        prefix: str = "tree/",
        checked: bool = False,
    ) -> StepWalk:
        """The walk of one step's ``sequences`` on ``model``, as a context manager (:class:`StepWalk`); on a
        normal exit the step's ``tree/*`` metrics are appended to ``metrics`` (a ``defaultdict(list)``, e.g.
        the trainer's ``self._metrics["train"]``; None: not logged), named with ``prefix`` (a second model
        walked on the same trie, a value model, logs under its own: ``"value_tree/"``).
        ``checked``: the step ``tree_check_gradients`` checks (its schedule's ``check``): its gradients are
        compared with ``dense_loss(model, inputs)`` over the step's micro-batches ``batches``."""
        check = None
        if training and checked and dense_loss is not None:
            check = lambda: GradientCheck(dense_loss, model, batches, self.check_tolerance)
        return StepWalk(self, model, sequences, training, metrics, check, prefix)

    def take_check(self) -> bool:
        """Whether the optimizer step about to be scheduled is the one ``tree_check_gradients`` checks: True
        once, for the first step whose schedule asks (:class:`~trl_dta.train.step_schedule.StepSchedule`'s
        ``check``: that step walks, its walk compared with TRL's dense path)."""
        check, self._check_pending = self._check_pending, False
        return check

    def prefer_dense(
        self,
        model,
        sequences: Sequence[StepSequence],
        *,
        no_grad_passes: float = 0.0,
        checkpointing: bool = False,
        metrics=None,
        timed=True,
        shapes=None,
    ) -> bool:
        """Whether the step of ``sequences`` should take TRL's dense path (``tree_dense_fallback``:
        :func:`trl_dta.train.dense_fallback.decide` documents the arguments and the metrics); the prediction
        stays in :attr:`prediction`. (The step ``tree_check_gradients`` checks walks: its schedule says so.)
        ``timed``: a training step, timed by :attr:`step_clock` (False: a no-gradient pass)."""
        mode, executor = self.dense_fallback, self.executor(model)
        if timed and mode != "never" and not self.flow.dense_backward_ok(executor.lm):
            refuse_always(mode, UNUSED_EXPERTS)
            mode = "never"
        self.prediction, dense = decide(
            executor,
            sequences,
            mode,
            self.dense_margin,
            self.walk_only,
            no_grad_passes,
            checkpointing,
            metrics,
            self.step_clock if timed else None,
            self.flow.agreement(timed),
            shapes,
        )
        if timed:  # (whether a dense step that runs out of memory can start again from here: no gradient yet)
            self._fresh = all(p.grad is None for p in model.parameters() if p.requires_grad)
            # (the dense path's first try, in "auto": against the walk's predicted step, scaled once measured)
            self._trial = dense and mode == "auto" and not self.step_clock.ratios(True)
        return dense

    def dense_trial_too_slow(self, started: float) -> bool:
        """At the end of a dense micro-batch's forward (begun at ``started``, ``time.perf_counter``): whether
        it is the first micro-batch of the dense path's first try and took longer than ``DRIFT`` x the walk's
        predicted step (by the constants in use, scaled by the walk's measured steps once there are some);
        then the dense path is recorded that slow (the forward a third of its micro-batch's forward and
        backward) and the step can be walked instead (:class:`~trl_dta.train.dense_retry.RetriesDenseSteps`).
        On one process only, and where the step started with no gradient (it can start again)."""
        trial, self._trial = getattr(self, "_trial", False), False  # (the first micro-batch only)
        prediction = self.prediction
        if not trial or prediction is None or self.multi_process or not self._fresh:
            return False
        if self.accelerator.device.type == "cuda":  # (once, on a first try)
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - started) / NO_GRAD_SHARE
        if seconds * NO_GRAD_SHARE <= DRIFT * prediction.step_s:  # (the forward against the walked step)
            return False
        self.step_clock.record(True, prediction.price_dense, seconds)
        return True

    def give_up_dense_step(self, model, out_of_memory: bool = True) -> bool:
        """A step on TRL's dense path ran out of memory: make its walk possible from the step's start (every
        gradient it accumulated dropped, its timing forgotten, later steps that need as much memory kept off
        the dense path) and return True; False where it cannot start again (gradients were held before the
        step, or several processes, whose dense backward reduces in lock-step: the error is raised as it
        is)."""
        if not getattr(self, "_fresh", False) or self.multi_process:  # (DDP's dense backward: in lock-step)
            return False
        for p in model.parameters():
            p.grad = None
        self.step_clock.cancel()
        if out_of_memory and self.prediction is not None and self.prediction.dense_bytes:
            self.step_clock.dense_ceiling = min(self.step_clock.dense_ceiling, self.prediction.dense_bytes)
        self.dense_oom_retries += out_of_memory
        return True

    def micro_batch_done(self, model) -> None:
        """Call at the end of each training micro-batch (``compute_loss``): under DDP, after the step's last
        one, the step's gradients are averaged over ranks (once; DeepSpeed flushes in the trainer's
        ``accelerator.backward``, FSDP2 reduced in the walk)."""
        self.flow.after_micro_batch(model)

    def needs_idle_walks(self, model) -> bool:
        return self.flow.needs_idle_walks(self.accelerator.unwrap_model(model))


def _option(args, name: str):
    return getattr(args, name, getattr(TreeArguments, name))
