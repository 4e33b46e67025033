"""``tree_dense_fallback``: a step whose rollouts share too little to pay for the tree takes TRL's dense path.

Before a step, the fitted cost model (:mod:`trl_dta.walk.cost.cost_model`) predicts two times for the same
rows:

* the walk's: its plan for the step's trie, by the constants in use (:meth:`CostModel.predict`), plus a
  third of it per no-gradient pass the trainer walks before (a forward costs about a third of a forward +
  backward);
* TRL's dense path's: one forward + backward call per micro-batch, its rows right-padded to the longest
  (``rows x width`` tokens, ``rows x width^2`` attention pairs: a dense causal kernel's rectangle, as the
  cost model counts a dense mask), the LM head on the scored positions; a third more compute with gradient
  checkpointing (its recomputed forward). Summed, or the larger of launches and compute where they overlap.

Each decided step is timed (:class:`StepClock`: from the decision to the optimizer step) and each path's
predictions are scaled by how far its own measured steps were off (measured over predicted seconds, priced
again by the constants in use). The decision ("auto") is made from measurements, not from the prior alone:

* **memory**: on CUDA, a step whose dense path would not fit the free memory (:func:`dense_bytes`: TRL's
  largest micro-batch with its checkpointing setting) walks;
* **exploration**: the first step takes the path predicted faster; a path the run has not measured is
  measured before its prediction is trusted: once, at the next step, where it is predicted within
  :data:`EXPLORE_WITHIN` of the chosen path (so the walk is explored where a prior underpricing dense sends
  the first step there, and the dense path where a prior overpricing it keeps it walking); and again
  whenever the chosen path's measured over predicted ratio drifts past ``DRIFT`` (2) from what it was when
  the other path was last measured. The dense path's first try is cut short after its first forward where
  that forward alone outlasts twice the walk's predicted step
  (:meth:`~trl_dta.train.step.StepWalker.dense_trial_too_slow`): a dense path far slower than its
  prediction costs one forward, not a step;
* otherwise the scaled predictions decide: dense where ``dense x (1 + margin) < walk``.

Every decision logs its path (``tree/path``) and why (``tree/path_reason``: :data:`REASONS`). The dense side
is priced with the walk's own constants, whose fixed cost per call also holds the walk's bookkeeping; the
measured ratios absorb what either path costs beyond its prediction. Gradients are the same either way
(TRL's own loss and backward), so exactness does not depend on the choice. Modes: "auto" (above), "never"
(always walk), "always" (always dense).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from ..trie import PrefixTrie
from ..walk.cost.cost_model import CostModel, plan_terms
from ..walk.memory.memory_model import activation_bytes, activation_dtype, autocast_copies
from ..walk.scoring import scored_from
from .step_clock import StepClock

MODES = ("auto", "never", "always")
NO_GRAD_SHARE = 1 / 3  # a forward's share of a forward + backward call
RECOMPUTE = 4 / 3  # gradient checkpointing: each call forwards twice
EXPLORE_WITHIN = 4.0  # an unmeasured path is explored where it is predicted at most this many times slower
FREE_SHARE = 0.9  # of the free device memory, what a dense step may take
# tree/path_reason: the prediction alone (a path not measured yet, nothing to explore), both paths' measured
# scales, an exploration, or the dense path's memory
REASONS = {"predicted": 0.0, "measured": 1.0, "explored": 2.0, "memory": 3.0}


class Prediction(NamedTuple):
    """A step's predicted seconds: its gradient walk, every pass of the walk, TRL's dense path (each scaled by
    its path's measured ratio); the choice and why (:data:`REASONS`); and the step's two prices by the
    constants in use when called (``price_step``: every pass of the walk; ``price_dense``: the dense path,
    unscaled), which :class:`StepClock` compares measured steps with."""

    walk_s: float
    step_s: float
    dense_s: float
    dense: bool
    price_step: Callable[[], float]
    price_dense: Callable[[], float]
    reason: str = "predicted"
    dense_bytes: float = 0.0  # the dense step's predicted activation peak (0: not estimated)


def checked_mode(mode: str, walk_only: bool) -> str:
    """``tree_dense_fallback`` as the step seam takes it: "always" is refused where every step must walk
    (``walk_only``: DeepSpeed or FSDP, whose steps the walk reduces and steps)."""
    if walk_only:
        refuse_always(
            mode,
            "under DeepSpeed or FSDP (the walk reduces the step's gradients and steps the engine itself)",
        )
    return mode


def refuse_always(mode: str, where: str) -> None:
    """Refuse ``tree_dense_fallback="always"`` ``where`` every step walks (a trainer's setting that needs the
    step's walk), rather than walk where the user asked for the dense path."""
    if mode == "always":
        raise ValueError(
            f'tree_dense_fallback="always" is not supported {where}: there every step walks. Use "auto" or '
            '"never".'
        )


Shapes = Sequence[tuple[int, int]] | None  # per micro-batch, (rows, width) of TRL's dense forward's tensors


def dense_terms(
    sequences: Sequence, checkpointing: bool = False, shapes: Shapes = None
) -> tuple[float, float, float, float]:
    """``(calls, tokens, pairs, scored)`` of TRL's dense path over ``sequences`` (each with ``tokens``,
    ``batch`` and ``score_from``): one call per micro-batch of right-padded rows. ``shapes``: per micro-batch,
    the ``(rows, width)`` of the tensors TRL's dense forward takes (padding rows and columns counted, and a
    micro-batch with no sequence still a call); else each micro-batch's sequences, padded to the longest."""
    batches: dict[int, list] = {}
    for s in sequences:
        batches.setdefault(s.batch, []).append(s)
    sizes = {b: (len(rows), max(len(s.tokens) for s in rows)) for b, rows in batches.items()}
    sizes.update(enumerate(shapes or ()))
    share = RECOMPUTE if checkpointing else 1.0
    calls = tokens = pairs = 0.0
    for rows, width in sizes.values():
        calls += share
        tokens += share * rows * width
        pairs += share * rows * width * width
    return calls, tokens, pairs, float(sum(len(s.tokens) - s.score_from for s in sequences))


def predict(
    executor,
    trie,
    sequences: Sequence,
    no_grad_passes: float = 0.0,
    checkpointing: bool = False,
    margin: float = 0.1,
    scales: tuple[float, float] = (1.0, 1.0),
    shapes: Shapes = None,
) -> Prediction:
    """The walk's and the dense path's predicted seconds for a step (module docstring), by ``executor``'s
    cost model (a :class:`~trl_dta.walk.executor.TreeExecutor` with one; ``shapes``: :func:`dense_terms`),
    each multiplied by its path's measured ratio (``scales``: the walk's, the dense path's)."""
    model: CostModel = executor.cost_model
    executor.fitted_costs()  # (the model's prior and cached fit, at the first use)
    plan = executor.plan(trie, record=False)
    _, node_from = scored_from(trie, [s.score_from for s in sequences])
    walk_terms = plan_terms(plan, model.template, executor.pack_leaves, node_from)
    dense_t = dense_terms(sequences, checkpointing, shapes)

    def price_walk() -> float:  # (by the constants in use when called)
        return model.seconds(walk_terms) + model.overhead_s

    def price_step() -> float:  # (every pass of the walk)
        return price_walk() * (1 + NO_GRAD_SHARE * no_grad_passes)

    def price_dense() -> float:
        return model.seconds(dense_t)

    walk_scale, dense_scale = scales
    walk, step, dense = price_walk() * walk_scale, price_step() * walk_scale, price_dense() * dense_scale
    return Prediction(walk, step, dense, _dense_wins(dense, step, margin), price_step, price_dense)


def _dense_wins(dense_s: float, step_s: float, margin: float) -> bool:
    """The rule of "auto" once measured: the dense step, ``margin`` added, is predicted faster."""
    return dense_s * (1 + margin) < step_s


def free_memory(device: torch.device) -> float | None:
    """Bytes free for a dense step on ``device`` (CUDA: the driver's free memory and what PyTorch's allocator
    holds unused); None elsewhere (not checked)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return float(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def dense_bytes(lm, sequences: Sequence, checkpointing: bool, shapes: Shapes = None) -> float:
    """TRL's dense step's activation peak on ``lm`` (a :class:`~trl_dta.walk.adapter.model.CausalLM`), by the
    walk's memory model (:func:`~trl_dta.walk.memory.memory_model.activation_bytes`): its largest
    micro-batch's padded tokens (``shapes``, else its sequences padded to the longest), each keeping every
    layer's activations, or with gradient checkpointing each layer's input and one layer's activations; the LM
    head's log-softmax at the scored positions, its logits and their gradient while it runs."""
    dtype, (autocast, _) = activation_dtype(lm), autocast_copies(lm)
    per = activation_bytes(lm.config, dtype, True, 1 if lm.value_head else None, autocast)
    layers, width = lm.config.num_hidden_layers, lm.config.hidden_size
    residual = (4 if autocast else torch.empty((), dtype=dtype).element_size()) * width
    batches: dict[int, list] = {}
    for s in sequences:
        batches.setdefault(s.batch, []).append(s)
    sizes = {b: (len(rows), max(len(s.tokens) for s in rows)) for b, rows in batches.items()}
    sizes.update(enumerate(shapes or ()))
    worst = 0.0
    for b, (rows, padded) in sizes.items():
        tokens = rows * padded
        held = tokens * (layers * residual + per.token / layers) if checkpointing else tokens * per.token
        scored = sum(len(s.tokens) - s.score_from for s in batches.get(b, ()))
        worst = max(worst, held + scored * (per.scored + per.transient))
    return worst


def decide(
    executor,
    sequences: Sequence,
    mode: str,
    margin: float,
    walk_only: bool,
    no_grad_passes: float = 0.0,
    checkpointing: bool = False,
    metrics=None,
    clock: StepClock | None = None,
    agree: Callable[[list[float]], list[float]] | None = None,
    shapes: Shapes = None,
) -> tuple[Prediction | None, bool]:
    """The prediction for a step of ``sequences`` (None without a cost model or sequences) and whether it
    takes the dense path: ``mode`` "always" and "never" say so; "auto" decides as the module docstring says
    (memory, exploration, the measured-scaled predictions), unless ``walk_only`` (DeepSpeed or FSDP: the walk
    reduces the step's gradients and steps the engine itself, where TRL's dense backward would not reach
    them). ``clock``: times the step and gives each path's measured scale and what to explore
    (:class:`StepClock`; None: a no-gradient pass, decided by the prediction and memory alone). ``agree``: on
    several processes, the elementwise largest of a list of floats over ranks
    (:func:`~trl_dta.train.multi_process.max_over_ranks`; every rank calls ``decide`` at the same point):
    "auto" then decides on the slowest rank's predicted walk and dense step (the ranks wait for each other at
    the gradients' all-reduce), and any rank's lack of room or exploration, so that every rank takes the same
    path (DDP's dense backward reduces in lock-step). ``shapes``: the dense forward's tensors
    (:func:`dense_terms`); ``no_grad_passes``: walks the trainer makes before the gradient walk (an accuracy
    pass); ``checkpointing``: the dense path recomputes its forward. Logs ``tree/path`` (1: dense, 0: the
    walk), ``tree/path_reason`` (:data:`REASONS`), ``tree/predicted_s`` and ``tree/predicted_dense_s``
    (scaled), each measured path's ``tree/walk_scale`` / ``tree/dense_scale``, the latest measured dense step
    ``tree/dense_s`` into ``metrics``; for a dense step also the trie's ``tree/tokens``,
    ``tree/unique_tokens`` and ``tree/dedup_ratio`` (a walked step's walk logs them)."""
    prediction, dense, trie, reason = None, mode == "always", None, "predicted"
    if clock is not None:
        clock.cancel()  # (a step that ended without an optimizer step is not timed)
    scales = (None, None) if clock is None else (clock.scale(False), clock.scale(True))
    auto = mode == "auto" and not walk_only and executor.cost_model is not None
    if sequences and executor.cost_model is not None:
        trie = PrefixTrie.from_sequences([s.tokens for s in sequences])
        prediction = predict(
            executor,
            trie,
            sequences,
            no_grad_passes,
            checkpointing,
            margin,
            tuple(1.0 if k is None else k for k in scales),
            shapes,
        )
    if auto:
        need = dense_bytes(executor.lm, sequences, checkpointing, shapes) if prediction is not None else 0.0
        votes = _votes(executor, prediction, need, margin, clock, scales)
        if agree is not None:  # (a rank without sequences still takes part: zeros)
            votes = agree(votes)
        dense, reason = _choose(votes, margin)
        if prediction is not None:
            prediction = prediction._replace(dense=dense, reason=reason, dense_bytes=need)
    if prediction is not None and clock is not None:  # (a dense step's price before scaling)
        price = prediction.price_dense if dense else prediction.price_step
        clock.start(dense, price, executor.device, explored=reason == "explored")
    if metrics is not None:
        _log(metrics, dense, reason, prediction, scales, clock, trie)
    return prediction, dense


def _votes(executor, prediction, need: float, margin, clock, scales) -> list[float]:
    """This rank's say in the decision: its predicted walk and dense step, whether its dense step lacks
    room (``need`` bytes: more than the free device memory allows, or at least what a dense step that ran
    out of memory was predicted to need), whether a path must be explored (the walk, the dense path),
    whether a path is unmeasured."""
    if prediction is None:
        return [0.0] * 6
    step_s, dense_s = prediction.step_s, prediction.dense_s
    free = free_memory(executor.device)
    no_room = free is not None and need > FREE_SHARE * free
    no_room = no_room or (clock is not None and need >= clock.dense_ceiling)
    chosen = _dense_wins(dense_s, step_s, margin) and not no_room
    explore = False
    if clock is not None:  # (the other path's prediction within reach of the chosen one's)
        other_s, chosen_s = (step_s, dense_s) if chosen else (dense_s, step_s)
        explore = clock.explore(chosen, other_s <= EXPLORE_WITHIN * chosen_s and (chosen or not no_room))
    unmeasured = None in scales
    return [
        step_s,
        dense_s,
        float(no_room),
        float(explore and chosen),
        float(explore and not chosen),
        float(unmeasured),
    ]


def _choose(votes: list[float], margin: float) -> tuple[bool, str]:
    """The path and why, from the (agreed) votes of :func:`_votes`."""
    step_s, dense_s, no_room, explore_walk, explore_dense, unmeasured = votes
    if no_room:
        return False, "memory"
    if explore_walk:
        return False, "explored"
    if explore_dense:
        return True, "explored"
    return _dense_wins(dense_s, step_s, margin), "predicted" if unmeasured else "measured"


def _log(metrics, dense: bool, reason: str, prediction, scales, clock, trie) -> None:
    metrics["tree/path"].append(float(dense))
    metrics["tree/path_reason"].append(REASONS[reason])
    if clock is not None and clock.last_dense_s is not None:
        metrics["tree/dense_s"].append(clock.last_dense_s)
    for name, scale in zip(("tree/walk_scale", "tree/dense_scale"), scales, strict=True):
        if scale is not None:
            metrics[name].append(scale)
    if prediction is not None:
        metrics["tree/predicted_s"].append(prediction.walk_s)
        metrics["tree/predicted_dense_s"].append(prediction.dense_s)
    if dense and trie is not None:  # (a walked step logs them itself): how much the step shared
        metrics["tree/tokens"].append(float(trie.num_tokens))
        metrics["tree/unique_tokens"].append(float(trie.num_unique_tokens))
        metrics["tree/dedup_ratio"].append(trie.dedup_ratio)
