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
from contextlib import AbstractContextManager

import torch
from accelerate.utils import DistributedType

from ..trie import PrefixTrie
from ..walk.budgets import Budgets
from ..walk.cost_model import CostModel
from ..walk.determinism import check_deterministic, disable_randomness
from ..walk.executor import TreeExecutor
from ..walk.preflight import preflight
from .dense_fallback import Prediction, StepClock, checked_mode, decide, refuse_always
from .gradient_check import GradientCheck
from .load_balancing import step_router_grad
from .multi_process import UNUSED_EXPERTS, StepFlow, check_distributed
from .refusals import LengthBound, check_arguments, tokenizer_size
from .step_results import SequenceResults, StepSequence
from .tree_args import TreeArguments

logger = logging.getLogger(__name__)
LossFn = Callable[[int, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


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
        if self.multi_process and self.check_gradients:
            raise ValueError("tree_check_gradients runs on a single process only.")
        if self.flow.deepspeed and self.check_gradients:  # (DeepSpeed's hooks would reduce the dense pass)
            raise ValueError("tree_check_gradients is not supported under DeepSpeed; check without it.")
        names = ("tree_memory_budget", "tree_block_size", "tree_batch_tokens", "tree_subtree_tokens")
        self.budget_options = tuple(_option(args, name) for name in names)
        Budgets(*self.budget_options, prefix="tree_")  # (validated now: a plain TRL config is not)
        self.reserved_bytes = 0.0
        self.options = dict(
            lm_head_fp32=getattr(args, "cast_lm_head_to_fp32", False), gather_per_layer=gather_per_layer,
            oom_retries=_option(args, "tree_oom_retries"),
        )  # fmt: skip
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

    def executor(self, model) -> TreeExecutor:
        """The executor of ``model`` (wrapped or not; built at its first call, with check_models' verdict)."""
        self.flow.register(model)  # (DeepSpeed: the walk finds the engines)
        seen = self._by_model.get(id(model))  # (unwrap_model reads package metadata: ~1.5 ms a call)
        if seen is not None and seen[0] is model:
            return seen[1]
        module = self.accelerator.unwrap_model(model)
        if id(module) not in self.executors:
            budgets = Budgets(*self.budget_options, reserved_bytes=self.reserved_bytes, prefix="tree_")
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
        and optimizer states too (:meth:`~trl_dta.walk.budgets.Budgets.train_with`). Call before their first
        walk."""
        self.trained = [self.accelerator.unwrap_model(m) for m in models]

    def reserve(self, reserved_bytes: float) -> None:
        """Bytes another user of the device claims while the walks run or right after them (a colocated vLLM
        engine): ``tree_memory_budget="auto"`` (or a percentage) takes them off the free memory it measures,
        for every executor (:class:`~trl_dta.walk.budgets.Budgets`)."""
        self.reserved_bytes = reserved_bytes
        for executor in self.executors.values():
            executor.budgets.reserve(reserved_bytes)

    def check_models(self, policy, *others, tokenizer=None, length: LengthBound | None = None,
                     disable_dropout: bool = True) -> None:  # fmt: skip
        """At the trainer's construction, after TRL's: refuse what the first walk of ``policy`` (and of
        ``others``, a reference model; None is skipped) would refuse whatever the data
        (:mod:`trl_dta.walk.preflight`: the model's structure and the probe, ``tokenizer``'s size, the
        longest sequence the arguments allow), then ``disable_dropout`` (:meth:`disable_randomness`), or,
        without it, refuse randomness left on in the policy, by setting and by behaviour."""
        unwrap = self.accelerator.unwrap_model
        length = length or LengthBound(None)
        models, size = [m for m in (policy, *others) if m is not None], tokenizer_size(tokenizer)
        for k, model in enumerate(models):
            self.flow.register(model)  # (DeepSpeed: a reference model's engine, its hooks off in the probe)
            module = unwrap(model)
            preflight(
                module, lm_head_fp32=self.options["lm_head_fp32"], tokenizer_size=size,
                max_length=length.tokens, length_setting=length.setting, option=length.option,
                training=k == 0 and not disable_dropout, probe=self._placed(module),
            )  # fmt: skip
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
        self, model, sequences: Sequence[StepSequence], *, training: bool = True, metrics=None,
        dense_loss: Callable | None = None, batches: Sequence[dict] | None = None, prefix: str = "tree/",
    ) -> StepWalk:  # fmt: skip
        """The walk of one step's ``sequences`` on ``model``, as a context manager (:class:`StepWalk`); on a
        normal exit the step's ``tree/*`` metrics are appended to ``metrics`` (a ``defaultdict(list)``, e.g.
        the trainer's ``self._metrics["train"]``; None: not logged), named with ``prefix`` (a second model
        walked on the same trie, a value model, logs under its own: ``"value_tree/"``).
        ``dense_loss(model, inputs)`` and the step's micro-batches ``batches``: what
        ``tree_check_gradients`` compares the step against, at the first gradient step."""
        check = None
        if training and self.check_gradients and dense_loss is not None:
            check = lambda: GradientCheck(dense_loss, model, batches, self.check_tolerance)
            self.check_gradients = False  # (once)
        return StepWalk(self, model, sequences, training, metrics, check, prefix)

    def prefer_dense(self, model, sequences: Sequence[StepSequence], *, no_grad_passes: float = 0.0,
                     checkpointing: bool = False, metrics=None, timed=True, shapes=None) -> bool:  # fmt: skip
        """Whether the step of ``sequences`` should take TRL's dense path (``tree_dense_fallback``:
        :func:`trl_dta.train.dense_fallback.decide` documents the arguments and the metrics); the prediction
        stays in :attr:`prediction`. A step that ``tree_check_gradients`` still has to check walks.
        ``timed``: a training step, timed by :attr:`step_clock` (False: a no-gradient pass)."""
        mode, executor = "never" if self.check_gradients else self.dense_fallback, self.executor(model)
        if timed and mode != "never" and not self.flow.dense_backward_ok(executor.lm):
            refuse_always(mode, UNUSED_EXPERTS)
            mode = "never"
        self.prediction, dense = decide(
            executor, sequences, mode, self.dense_margin, self.walk_only, no_grad_passes, checkpointing,
            metrics, self.step_clock if timed else None, self.flow.agreement(timed), shapes,
        )  # fmt: skip
        return dense

    def micro_batch_done(self, model) -> None:
        """Call at the end of each training micro-batch (``compute_loss``): under DDP, after the step's last
        one, the step's gradients are averaged over ranks (once; DeepSpeed flushes in the trainer's
        ``accelerator.backward``, FSDP2 reduced in the walk)."""
        self.flow.after_micro_batch(model)

    def take_oom_retries(self) -> int:
        """Walks retried after running out of memory, over every executor, since the last call."""
        return sum(e.take_oom_retries() for e in self.executors.values())

    def needs_idle_walks(self, model) -> bool:
        return self.flow.needs_idle_walks(self.accelerator.unwrap_model(model))


class StepWalk(AbstractContextManager):
    """The passes over one step's trie (built from the sequences at construction; None when there are none,
    and then each pass is an idle walk where the other ranks need one). ``results``: the
    :class:`SequenceResults` of the last :meth:`backward` or :meth:`score`."""

    def __init__(self, walker: StepWalker, model, sequences, training: bool, metrics, check, prefix="tree/"):
        self.walker, self.model, self.training, self.metrics = walker, model, training, metrics
        self.prefix = prefix
        self._check = check() if check is not None else None  # (the dense pass, before the walk's time)
        self._started = time.perf_counter()
        self.sequences = list(sequences)
        for k, s in enumerate(self.sequences):
            if len(s.tokens) < 2:
                raise ValueError(f"sequence {k} has {len(s.tokens)} token(s); the walk needs two or more.")
        self.trie = PrefixTrie.from_sequences([s.tokens for s in self.sequences]) if self.sequences else None
        self.score_from = [s.score_from for s in self.sequences]
        self.results = SequenceResults(len(self.sequences))
        self.router_grad = None
        self.peak_memory: int | None = None
        self.time_s: float | None = None  # (set on exit)
        self._calls = None

    @property
    def executor(self) -> TreeExecutor:
        return self.walker.executor(self.model)  # (cached per model: StepWalker.executor)

    def __enter__(self) -> StepWalk:
        if self.trie is not None:
            calls = self.executor.calls
            self._calls = (calls.forward, calls.backward, calls.tokens)
        return self

    def __exit__(self, kind, *exc):
        self.time_s = time.perf_counter() - self._started
        if kind is None and self._check is not None and self.metrics is not None:
            self.metrics[f"{self.prefix}check_error"].append(self._check.finish())
        if kind is None and self.trie is not None and self.metrics is not None:
            self._log(self.metrics)
        return False

    # ------------------------------------------------------------------ passes
    def logprobs(self, temperature: float = 1.0, entropies: bool = False):
        """A no-gradient pass: per sequence its log-probs from ``score_from`` on (and entropies), as
        :meth:`TreeExecutor.logprobs` returns them (empty lists on an empty step)."""
        if self.trie is None:
            self._idle()
            return ([], []) if entropies else []
        with torch.no_grad(), self.walker.accelerator.autocast():
            out = self.executor.logprobs(
                self.trie, temperature, entropies=entropies, score_from=self.score_from
            )
        self._measured()
        return out

    def router_loss(self, coef: float, num_batches: int) -> tuple[list, list[float]]:
        """MoE models: each micro-batch's load-balancing loss over its sequences (TRL's, from a no-gradient
        count of the router's choices, :mod:`trl_dta.train.load_balancing`) and its value times ``coef``; the
        gradient of ``coef`` times their sum is added to :meth:`backward`'s. Micro-batches with no sequence
        get None and 0.0."""
        auxes, terms = [None] * num_batches, [0.0] * num_batches
        if self.trie is None:
            self._idle()
            return auxes, terms
        with self.walker.accelerator.autocast():
            self.router_grad = step_router_grad(self.executor, self.trie, self.sequences, coef, auxes, terms)
        self._measured()
        return auxes, terms

    def backward(self, loss_fn: LossFn, temperature: float = 1.0, entropies: bool = True,
                 entropy_grad: bool = True) -> None:  # fmt: skip
        """The gradient pass: ``.grad`` of the model's trainable parameters gets the gradient of the sum of
        ``loss_fn(k, logps_k, entropies_k)`` over the sequences (plus :meth:`router_loss`'s), exactly; each
        sequence's values are recorded in :attr:`results`. ``entropy_grad=False``: the loss reads the
        entropies as values only (less memory)."""
        flow = self.walker.flow
        if self.trie is None:
            if self.walker.needs_idle_walks(self.model):
                with flow.gradient_walk(self.model), self.walker.accelerator.autocast():
                    self.executor.backward(_idle_trie(), lambda i, logps, ents: logps.sum() * 0.0)
            return
        with flow.gradient_walk(self.model), self.walker.accelerator.autocast():
            self.executor.backward(
                self.trie, self._recorded(loss_fn), temperature, entropies=entropies,
                router_grad=self.router_grad, score_from=self.score_from, entropy_grad=entropy_grad,
            )  # fmt: skip
        self._measured()

    def score(self, loss_fn: LossFn, temperature: float = 1.0, entropies: bool = True) -> None:
        """Evaluation's counterpart of :meth:`backward`: each sequence's values and loss, no gradient."""
        out = self.logprobs(temperature, entropies=entropies)
        lps, ents = out if entropies else (out, [None] * len(out))
        record = self._recorded(loss_fn)
        for k, (lp, ent) in enumerate(zip(lps, ents, strict=True)):
            record(k, lp, ent)

    def include(self, other: StepWalk) -> None:
        """Another model's walk of this step, run inside this one (a value model's): its peak memory counts
        toward this step's (``tree/peak_memory_gib`` is the larger of the two walks), its time is not this
        walk's (each logs its own ``time_s``)."""
        if other.peak_memory is not None:
            self.peak_memory = max(other.peak_memory, self.peak_memory or 0)
        self._started += other.time_s or 0.0

    # ------------------------------------------------------------------ helpers
    def _recorded(self, loss_fn: LossFn) -> LossFn:
        def on_sequence(k, logps, entropies):
            loss = loss_fn(k, logps, entropies)
            self.results.record(k, logps, entropies, loss)
            return loss

        return on_sequence

    def _idle(self) -> None:
        """A no-gradient idle walk, where the other ranks' walks need this rank's (collectives)."""
        if self.walker.needs_idle_walks(self.model):
            with self.walker.accelerator.autocast():
                self.executor.logprobs(_idle_trie())

    def _measured(self) -> None:
        peak = self.executor.peak_memory
        if peak is not None:
            self.peak_memory = max(peak, self.peak_memory or 0)

    def _log(self, metrics) -> None:
        """The step's ``tree/*`` metrics, named with :attr:`prefix` (docs/options.md, "Metrics")."""
        trie, executor, p = self.trie, self.executor, self.prefix
        metrics[f"{p}tokens"].append(float(trie.num_tokens))
        metrics[f"{p}unique_tokens"].append(float(trie.num_unique_tokens))
        metrics[f"{p}dedup_ratio"].append(trie.dedup_ratio)
        dense, walk = executor.flops(trie, self.score_from)
        metrics[f"{p}flop_ratio"].append(dense / walk)
        forward, backward = executor.calls.forward - self._calls[0], executor.calls.backward - self._calls[1]
        metrics[f"{p}calls"].append(float(forward + backward))
        metrics[f"{p}tokens_per_call"].append((executor.calls.tokens - self._calls[2]) / max(forward, 1))
        metrics[f"{p}time_s"].append(self.time_s)
        for name, value in executor.budgets.metrics().items():  # the budgets in use (derived or given)
            metrics[f"{p}{name}"].append(float(value))
        metrics[f"{p}oom_retries"].append(float(self.walker.take_oom_retries()))
        if self.peak_memory is not None:
            metrics[f"{p}peak_memory_gib"].append(self.peak_memory / 2**30)
        if executor.cost_model is not None:  # the constants in use, the last measured gradient walk
            for name, value in executor.cost_model.metrics().items():
                metrics[p + name.removeprefix("tree/")].append(value)


def _idle_trie() -> PrefixTrie:
    """What a rank with nothing to walk walks, with a zero loss: two tokens."""
    return PrefixTrie.from_sequences([[0, 1]])


def _option(args, name: str):
    return getattr(args, name, getattr(TreeArguments, name))
