"""The cost model fitted online: the walk times its own calls, and the plan uses the fitted constants.

The shipped constants (:data:`~trl_dta.walk.cost.costs.DEVICE_COSTS`) are a prior. :class:`CostModel` times
the gradient walks of an executor and fits the constants to them
(:func:`~trl_dta.walk.cost.cost_fit.fit_constants`, over a window of recent observations, the last fit the
prior of the next):

* On a CPU each forward + backward call is timed on the monotonic clock (a push and its pop make one call;
  a leaves or subtree step one), which gives many differently shaped observations per walk; the walk's time
  outside its calls (building the plan, copying its inputs) is kept as a per-walk overhead.
* On CUDA the host must not wait for the device: two events bracket the whole walk, and their time is read
  at the next walk, when the device has long passed them (the walk's loss total syncs at its end anyway),
  so no sync is added; a walk is one observation, fitted with the overlapping model (the larger of the
  launches and the compute).

The plan uses the fitted constants once ``MIN_OBSERVATIONS`` are measured, and adopts a new fit only where
it changes the predicted time of a recent observation by more than ``REPLAN`` (a plan is rebuilt for each
walk: what changes is the constants it is built with). Once the constants have not changed for ``STABLE``
timed walks, only one walk in ``SAMPLE_EVERY`` is timed. Every adopted fit is kept in the cache
(:mod:`trl_dta.walk.cost.cost_cache`) under the device's name and the model's signature; the next run starts
from it.

Exploration (where costs overlap: a GPU): a walk whose compute hides its launches bounds ``fixed`` from
above and no more, so walks that are all compute-bound cannot tell the launch cost the plan's merges hang on
(:func:`~trl_dta.walk.cost.cost_fit.fixed_uncertainty`: infinite without a launch-bound walk). So where a run
starts from the prior (no cached fit) and its first ``EXPLORE_AFTER`` walks leave ``fixed`` uncertain by
more than ``EXPLORE_ABOVE``, one gradient walk is planned unmerged (launches priced at 0: a call per node, or
per leaf batch; any plan is exact), which is launch-bound, and timed; it stays in the fit beside the window.
One walk per run, once per device and model: the next run starts from the cache. On a CPU the calls are
timed one by one and their sizes vary within a walk: there, measured on this project's CPU
(docs/cost-model.md), the merged calls determine ``fixed`` well enough, and an unmerged walk of a small model
would mostly measure the clock's noise, so a CPU never explores.

Modes (``tree_cost_fit``): ``"auto"`` starts from the cached fit or the shipped constants and fits online;
``"reset"`` forgets the cached fit and starts from the shipped constants; ``"frozen"`` uses the cached fit
(or the shipped constants) and never times or writes. (``"off"``, the shipped constants alone, is no
:class:`CostModel` at all.)
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import replace

import torch

from ..plan import PackedSubtree, Pop, Push, SiblingLeaves, step_terms
from .cost_cache import CostCache, device_name, model_signature
from .cost_fit import Constants, Observation, fit_constants, fixed_uncertainty
from .costs import CallCost, device_costs

logger = logging.getLogger(__name__)
MODES = ("auto", "reset", "frozen")
WINDOW = 64  # observations kept for the fit (CPU: calls; CUDA: walks): recent ones, the plan's call sizes
MIN_OBSERVATIONS = 8  # before the fit replaces the prior
REPLAN = 0.03  # a fit that moves an observation's predicted time by more than this is adopted
STABLE = 5  # timed walks without a change of constants, after which only a sample is timed
SAMPLE_EVERY = 10
EXPLORE_ABOVE = 0.25  # the relative standard error of ``fixed`` above which a walk explores (docstring)
EXPLORE_WALKS = 1  # at most, per run
EXPLORE_AFTER = 4  # gradient walks (the first untimed) whose merged calls may determine ``fixed`` first
REFITS = 8  # fits per timed walk at most, each from the last (until the constants move < 0.1%)


class CostModel:
    """The fitted call costs of one executor's model on its device (module docstring).

    Args:
        mode: "auto", "reset" or "frozen".
        cache_dir: where fits are kept (None: :func:`~trl_dta.walk.cost.cost_cache.cache_dir`'s default).
        prior: constants to start from instead of the shipped ones (benchmarks: deliberately wrong ones).
        persist: keep adopted fits in the cache (False: only in this object).
    """

    def __init__(
        self, mode: str = "auto", cache_dir=None, prior: CallCost | None = None, persist: bool = True
    ):
        if mode not in MODES:
            raise ValueError(f"cost fit mode must be one of {MODES} (or 'off': no cost model), got {mode!r}")
        self.mode, self.persist = mode, persist and mode != "frozen"
        self.cache = CostCache(cache_dir)
        self._given_prior = prior
        self.key: str | None = None
        self.template: CallCost | None = None  # the shipped costs: attention kind, overlap
        self.prior: Constants | None = None
        self.active: Constants | None = None  # what the plan is built with
        self.fitted: Constants | None = None  # the latest fit (adopted or not)
        self.residual = 0.0
        self.observed = 0  # observations measured in all (with the cached fit's)
        self.window: deque[Observation] = deque(maxlen=WINDOW)
        self.anchors: list[Observation] = []  # the explored walk's calls: kept in the fit (docstring)
        self.explored = 0  # walks planned unmerged to measure ``fixed``
        self._from_cache = False
        self._exploring = False
        self.overhead_s = 0.0  # CPU: a walk's time outside its calls
        self.last_walk_s: float | None = None  # the latest measured gradient walk
        self.last_terms: tuple | None = None  # the latest timed walk's summed terms
        self._walks = 0
        self._unchanged = 0
        self._pending: list[_Timing] = []

    # ------------------------------------------------------------------ the constants
    def start(self, lm, device: torch.device) -> None:
        """At the first walk of ``lm`` (a :class:`~trl_dta.walk.adapter.model.CausalLM`): the prior, the cache
        key, the cached fit (mode "auto" and "frozen")."""
        if self.key is not None:
            return
        from ..memory.budgets import activation_dtype

        kernel = lm.walk_kernel()
        shipped = CallCost.for_model(lm.config, device.type, kernel)
        given = self._given_prior or shipped  # (its constants; attention kind and overlap: the device's)
        template = replace(shipped, fixed=given.fixed, per_token=given.per_token, per_pair=given.per_pair)
        text = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
        scored = 6 * text.hidden_size * (1 if lm.value_head else text.vocab_size)  # (the LM head's FLOPs)
        rate = device_costs(device.type).flop_rate
        prior = Constants(template.fixed, template.per_token, template.per_pair, scored / rate)
        attention = getattr(lm.config, "_attn_implementation", None) or "eager"
        signature = model_signature(lm.config, activation_dtype(lm), attention, kernel.name)
        self.initialise(template, prior, f"{device_name(device)} | {signature}")

    def initialise(self, template: CallCost, prior: Constants, key: str) -> None:
        """Start from ``prior`` (the constants) for ``template``'s attention kind and overlap, kept under
        ``key``: what :meth:`start` does with a model; tests and benchmarks call it without one."""
        self.template, self.key = template, key
        self.prior = self.active = prior
        cached = None
        if self.mode == "reset":
            self.cache.remove(self.key)
        elif self._given_prior is None:
            cached = self.cache.load(self.key)
        if cached is not None:
            self.active, self.observed = cached
            self._from_cache = True
            logger.info("Call costs from the cache (%s): %s", self.key, self.active)

    @property
    def calibrated(self) -> bool:
        """Whether the constants in use were fitted to this device (here, or in an earlier run)."""
        return self.observed >= MIN_OBSERVATIONS

    def costs(self) -> CallCost:
        """The constants the plan is built with, as a :class:`CallCost`."""
        a = self.active
        return replace(self.template, fixed=a.fixed, per_token=a.per_token, per_pair=a.per_pair)

    def predict(self, plan, packed: bool, node_from=None) -> float:
        """Seconds of a gradient walk of ``plan`` by the constants in use (with the per-walk overhead)."""
        terms = plan_terms(plan, self.template, packed, node_from)
        return self.active.seconds(terms, self.template.overlap) + self.overhead_s

    def seconds(self, terms, constants: Constants | None = None) -> float:
        """Seconds of ``terms`` ``(calls, tokens, pairs, scored)`` by ``constants`` (default: in use)."""
        return (constants or self.active).seconds(terms, self.template.overlap)

    def explores(self) -> bool:
        """Whether the gradient walk about to be planned should explore (module docstring): costs overlap, the
        run started from the prior, ``EXPLORE_AFTER`` walks have left ``fixed`` uncertain, and no walk has
        explored yet. The executor then plans it with launches priced at 0, and :meth:`timing` times it."""
        self._collect()
        self._exploring = (
            self.mode != "frozen"
            and not self._from_cache
            and self.explored < EXPLORE_WALKS
            and self._walks >= EXPLORE_AFTER
            and self.template.overlap
            and self.uncertainty() > EXPLORE_ABOVE
        )
        return self._exploring

    def uncertainty(self) -> float:
        """The relative standard error of the fitted ``fixed``
        (:func:`~trl_dta.walk.cost.cost_fit.fixed_uncertainty`)."""
        fitted = self.fitted or self.active
        return fixed_uncertainty([*self.anchors, *self.window], fitted, self.template.overlap)

    # ------------------------------------------------------------------ timing the walks
    def timing(self, plan, packed: bool, node_from=None) -> _Timing | None:
        """The timer of a gradient walk of ``plan`` about to start; None where this walk is not timed."""
        self._collect()
        if self.mode == "frozen":
            return None
        self._walks += 1
        exploring, self._exploring = self._exploring, False
        if exploring:
            self.explored += 1
            return _Timing(self, plan, packed, node_from, anchor=True)
        if self._walks == 1:  # (the first walk warms up: lazy initialisation, allocator growth)
            return None
        if self._unchanged >= STABLE and self._walks % SAMPLE_EVERY:
            return None
        return _Timing(self, plan, packed, node_from)

    def _collect(self) -> None:
        """CUDA: the walks whose end event the device has passed (no sync: ``query``)."""
        while self._pending and (not self._pending[0].ended or self._pending[0].events[1].query()):
            timing = self._pending.pop(0)
            if not timing.ended:  # (a walk that raised, out of memory say: nothing to read)
                continue
            start, end = timing.events
            seconds = start.elapsed_time(end) / 1e3
            self.add([Observation(*timing.totals(), seconds)], walk_s=seconds, anchor=timing.anchor)

    def add(
        self, observations: list[Observation], walk_s: float, calls_s: float | None = None, anchor=False
    ) -> None:
        """Record a timed walk: its ``observations``, its seconds, and (CPU) the seconds of its calls; refit,
        and adopt the fit where it moves the predicted times by more than ``REPLAN`` (:meth:`change`).
        ``anchor``: an explored walk, whose observations stay in the fit (module docstring)."""
        self.last_walk_s = walk_s
        if calls_s is not None:  # (a running mean of what the calls leave out)
            self.overhead_s += 0.3 * (max(walk_s - calls_s, 0.0) - self.overhead_s)
        if anchor:
            self.anchors = [*self.anchors, *observations][-WINDOW:]
        else:
            self.window.extend(observations)
        self.observed += len(observations)
        self.last_terms = tuple(sum(o.terms[k] for o in observations) for k in range(4))
        kept, fitted = [*self.anchors, *self.window], self.fitted or self.active
        for _ in range(REFITS):  # (each fit the next one's prior: a prior far off moves in a few rounds)
            previous = fitted
            fitted, self.residual = fit_constants(kept, previous, self.template.overlap, scale=self.prior)
            if fitted.ratio(previous) < 1e-3:
                break
        self.fitted = fitted
        if self.observed < MIN_OBSERVATIONS:
            return
        if self.active is self.prior or self.change() > REPLAN:
            self.active, self._unchanged = self.fitted, 0
            logger.info(
                "Call costs fitted on this device: %s (residual %.1f%%)", self.active, 100 * self.residual
            )
            if self.persist:
                self.cache.save(self.key, self.active, self.observed)
        else:
            self._unchanged += 1

    def change(self) -> float:
        """How much the latest fit moves the predicted time of any observation in the fit from the
        constants in use (the largest relative change: a constant that only calls of one shape pay for still
        counts; a fit that moves what no walk pays for does not)."""
        if self.fitted is None or not (self.window or self.anchors):
            return 0.0
        return max(
            abs(self.seconds(o.terms, self.fitted) / max(self.seconds(o.terms), 1e-30) - 1)
            for o in (*self.anchors, *self.window)
        )

    def metrics(self) -> dict[str, float]:
        """The constants in use and the latest measured gradient walk, as the trainers log them."""
        self._collect()
        if self.active is None:
            return {}
        a = self.active
        out = {
            "tree/cost_fixed_s": a.fixed,
            "tree/cost_token_s": a.per_token,
            "tree/cost_pair_s": a.per_pair,
            "tree/cost_scored_s": a.per_scored,
            "tree/cost_calibrated": float(self.calibrated),
        }
        if self.last_walk_s is not None:
            out["tree/walk_s"] = self.last_walk_s
        return out


class _Timing:
    """One timed gradient walk: per call on the host's clock (CPU), or two CUDA events around the walk."""

    def __init__(self, model: CostModel, plan, packed: bool, node_from, anchor: bool = False):
        self.model, self.plan, self.packed, self.node_from = model, plan, packed, node_from
        self.anchor = anchor
        self.events = None
        self.ended = False
        self.observations: list[Observation] = []
        self._pushed: dict[int, tuple] = {}  # id(segment) -> (terms, seconds) of its push, until its pop

    def begin(self, device: torch.device, started: float) -> None:
        """At the walk's first step; ``started``: when the walk began (``time.perf_counter``, CPU)."""
        if device.type == "cuda":
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self.events[0].record()
            self.model._pending.append(self)
        self._started, self._last = started, time.perf_counter()

    def step(self, step) -> None:
        """After each step of the plan (CPU: its seconds go to its call)."""
        if self.events is not None:
            return
        now = time.perf_counter()
        seconds, self._last = now - self._last, now
        terms = call_terms(step, self.model.template, self.packed, self.node_from)
        if isinstance(step, Push):
            self._pushed[id(step.segment)] = (terms, seconds)
        elif isinstance(step, Pop):
            pushed = self._pushed.pop(id(step.segment), None)
            if pushed is not None:
                self.observations.append(Observation(*pushed[0], pushed[1] + seconds))
        else:
            self.observations.append(Observation(*terms, seconds))

    def end(self) -> None:
        self.ended = True
        if self.events is not None:
            self.events[1].record()  # (read by CostModel._collect at a later walk)
            return
        walk_s = time.perf_counter() - self._started
        calls_s = sum(o.seconds for o in self.observations)
        self.model.add(self.observations, walk_s, calls_s=calls_s, anchor=self.anchor)

    def totals(self) -> tuple:
        return plan_terms(self.plan, self.model.template, self.packed, self.node_from)


def call_terms(step, costs: CallCost, packed: bool, node_from=None) -> tuple:
    """``(calls, tokens, pairs, scored)`` of one step (:func:`~trl_dta.walk.plan.step_terms`, plus the
    positions the LM head scores)."""
    calls, tokens, pairs = step_terms(step, costs, packed)
    if isinstance(step, Push):
        segments = (step.segment,)
    elif isinstance(step, SiblingLeaves | PackedSubtree):
        segments = step.segments
    else:
        segments = ()
    scored = 0
    for s in segments:
        first = node_from.get(s.node, s.start) if node_from else s.start
        scored += max(0, s.end - max(s.start, first))
    return calls, tokens, pairs, scored


def plan_terms(plan, costs: CallCost, packed: bool, node_from=None) -> tuple:
    """The summed ``(calls, tokens, pairs, scored)`` of a walk of ``plan``."""
    totals = [0.0, 0.0, 0.0, 0.0]
    for step in plan:
        for k, value in enumerate(call_terms(step, costs, packed, node_from)):
            totals[k] += value
    return tuple(totals)
