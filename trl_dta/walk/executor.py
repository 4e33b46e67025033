"""The tree executor: forward and backward of every sequence of a prefix trie, each shared prefix once.

The walk follows the plan of :mod:`trl_dta.walk.plan`. A stack (:class:`~trl_dta.walk.state.Walk`) holds the
segments of the current root-to-node path; for each one it keeps what the segment left in every layer's
cache (for the state layers of hybrid and state-space models, its final conv / recurrent states), its last
hidden state (to score its children's first tokens) and its tokens' log-probs, each behind a *handle* whose
``.grad`` collects what descendants send into it. The path's K/V live in one buffer per attention layer
(:class:`~trl_dta.walk.path_kv.PathKV`), with a gradient buffer beside it that plays the same role:

* ``Push``: forward the segment on the path; keep the autograd graph, or (chunked backward) forward without
  one and recompute it at pop.
* ``SiblingLeaves`` / ``PackedSubtree``: forward sibling leaves (packed into one row with a block-diagonal
  causal mask, or right-padded where packing is not exact) or a whole small subtree (one packed row with a
  tree-shaped mask), compute each finished sequence's loss from the log-probs along its path and
  backpropagate at once: into the parameters, and into the handles of every segment on the stack.
* ``Pop``: backpropagate the segment's outputs with the gradients collected in their handles (and, for its
  K/V, at its positions of the gradient buffer), which continues into the parameters and into the handles
  of the segments below it; then free it.

State models never forward a single token on a carried state (decode kernels may compute something else,
or have no backward): such a one-token segment is *pending*, and its children forward its token again.

MoE models: the walk can also backpropagate a linear term in each segment's router probabilities (the
load-balancing loss, :mod:`trl_dta.walk.router`), and count router choices in a no-grad pass.

Because the loss of a sequence is a function of its own log-probs only, the sum of all these backward
calls is exactly ``sum_i loss_fn(i, logps_i, entropies_i).backward()`` over dense per-sequence forwards.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from torch import nn

from ..trie import PrefixTrie, TrieNode
from . import deepspeed as zero
from .budgets import Budgets, TokenBudgets
from .checks import check_count
from .costs import CallCost
from .errors import ArgumentTypeError, UnsupportedModelError
from .flops import flops as count_flops
from .forwards import forward, forward_packed, forward_padded
from .inputs import WalkInputs
from .model import CausalLM
from .path_kv import PathKV
from .peak import PeakMemory
from .plan import PackedSubtree, Pop, Push, Segment, SiblingLeaves, build_plan
from .recovery import RETRIES, OOMRecovery
from .router import RouterGrad, RouterStats, route
from .scoring import path_scores, score_rows, scored_from
from .sharding import agree_on, fsdp_units, gathered
from .state import CallCounts, Frame, OnSequence, SegmentOutputs, Walk, flat_outputs

logger = logging.getLogger(__name__)


LossFn = Callable[[int, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
T = TypeVar("T")


class TreeExecutor:
    """Forward/backward of the sequences of a :class:`~trl_dta.PrefixTrie` through a causal LM.

    Args:
        model: a ``transformers`` causal LM that takes a KV cache (see docs/supported-models.md), plain or
            PEFT (LoRA) wrapped, whole or sharded with FSDP2 (``fully_shard``: each walk gathers every unit
            once and reduce-scatters the gradients once, :mod:`trl_dta.walk.sharding`), or the module of a
            DeepSpeed ZeRO-2/3 engine (registered first: :mod:`trl_dta.walk.deepspeed`). Randomness must be
            off while it trains (checked at each call: :mod:`trl_dta.walk.determinism`). Models the walk
            cannot compute exactly raise :class:`~trl_dta.UnsupportedModelError`.
        block_size: most tokens forwarded with an autograd graph kept on the stack, and longest segment. Paths
            longer than that are walked with chunked backward (blocks forwarded without a graph, recomputed
            with one when popped). None: from ``memory_budget``.
        batch_tokens: budget for forwarding sibling leaves together in one call on their shared prefix: their
            total tokens when packed, rows x longest row when padded. None: from ``memory_budget`` (without
            one, ``block_size`` when that is given); 0 forwards one leaf per call.
        lm_head_fp32: compute the LM head projection in float32 (TRL's ``cast_lm_head_to_fp32``).
        pack_leaves: forward a batch of sibling leaves as one packed row with a block-diagonal causal mask
            (no padding, the shared past not replicated per leaf) where the attention backend takes a custom
            mask (eager, sdpa) and the construction probe finds packing exact for the model (no attention
            window, no bias built from key indices such as ALiBi); otherwise, or with False, as a right-padded
            batch.
        subtree_tokens: where leaves are packed, most tokens of a subtree (a node and all its descendants, or
            several sibling subtrees and leaves) forwarded whole in one packed row with a tree-shaped causal
            mask and backpropagated in one call. With budgets from memory, the device kind's cost model
            (:mod:`trl_dta.walk.costs`; :attr:`call_cost` to set one) decides which calls to merge within
            them: fewer calls against the attention pairs a dense mask computes for nothing. With the fixed
            budgets, each leaf batch is filled to its budget and each subtree that fits is packed on its own
            (the rule measured fastest on CPU). 0: sibling leaves only. None: from ``memory_budget``.
        gather_per_layer: for an FSDP2-sharded model whose gathered parameters do not fit: gather each decoder
            layer only for its own calls and reduce-scatter its gradients after each backward call, the calls
            of all ranks kept in lock-step (:mod:`trl_dta.walk.lockstep`), instead of gathering every unit
            once per walk. Slower: see docs/multi-process.md's memory model. Ignored for an unsharded
            model; refused under DeepSpeed ZeRO-3 (:mod:`trl_dta.walk.deepspeed`).
        memory_budget: bytes of activation memory a walk may use; the budgets not given are derived from it
            for each trie (:mod:`trl_dta.walk.budgets`: the longest path's graph first, so that nothing is
            forwarded twice, then the largest calls that fit). "auto": on CUDA, ``AUTO_FRACTION`` of the free
            memory at the first walk less the first optimizer step's gradients and Adam states; elsewhere,
            and with None, the fixed budgets measured fastest on CPU (:data:`~trl_dta.walk.budgets.FIXED`).
            The LM head scores at most ``HEAD_ROWS`` positions at once.
        oom_retries: a walk that runs out of memory (``torch.OutOfMemoryError``, ``MemoryError``) is walked
            again with every budget it used halved, up to this many times, its partial gradients discarded;
            the smaller budgets stay for later walks and grow back after a while
            (:mod:`trl_dta.walk.recovery`, ``oom_recovery``). 0: an out-of-memory error is raised as it is.
        budgets: a :class:`~trl_dta.walk.budgets.Budgets` built by the caller (with ``reserved_bytes``, say),
            instead of ``block_size``, ``batch_tokens``, ``subtree_tokens`` and ``memory_budget``.

    :attr:`budgets` (the :class:`~trl_dta.walk.budgets.Budgets`) reports the budgets in use
    (``budgets.in_use``, ``budgets.metrics()``), :meth:`take_oom_retries` the walks retried after running out
    of memory, :attr:`peak_memory` the last walk's peak memory (:mod:`trl_dta.walk.peak`).

    Gradient checkpointing, if the model has it on, is switched off during the walk and restored after:
    HF decoder layers drop a passed KV cache under it, and the walk bounds activation memory by itself.
    """

    def __init__(
        self,
        model: nn.Module,
        block_size: int | None = None,
        batch_tokens: int | None = None,
        lm_head_fp32: bool = False,
        pack_leaves: bool = True,
        subtree_tokens: int | None = None,
        gather_per_layer: bool = False,
        memory_budget: float | str | None = "auto",
        oom_retries: int = RETRIES,
        budgets: Budgets | None = None,
    ):
        if budgets is None:
            budgets = Budgets(memory_budget, block_size, batch_tokens, subtree_tokens)
        elif not isinstance(budgets, Budgets):
            raise ArgumentTypeError(f"budgets must be a Budgets, got {type(budgets).__name__}")
        elif (block_size, batch_tokens, subtree_tokens, memory_budget) != (None, None, None, "auto"):
            raise ValueError("pass the budgets either as budgets= or as keywords, not both")
        self.budgets = budgets  # the options, the budgets in use, their halving after running out of memory
        self._pack_leaves = bool(pack_leaves)
        self.gather_per_layer = bool(gather_per_layer)
        self.lm = CausalLM(model, lm_head_fp32=lm_head_fp32)
        self.calls = CallCounts()  # model calls of every walk so far (tree/calls, tree/tokens_per_call)
        # which calls to merge: the device kind's cost model unless set (:mod:`trl_dta.walk.costs`)
        self.call_cost: CallCost | None = None
        self.oom_recovery = OOMRecovery(oom_retries) if check_count("oom_retries", oom_retries) else None
        self.peak_memory: int | None = None  # bytes, the last walk's peak (:mod:`trl_dta.walk.peak`)

    @property
    def pack_leaves(self) -> bool:
        """Whether sibling leaves are packed into one row (asked for, and exact for the model)."""
        return self._pack_leaves and self.lm.can_pack

    @property
    def device(self) -> torch.device:
        return self.lm.device

    def token_budgets(self, trie: PrefixTrie, entropy_grad: bool = True) -> TokenBudgets:
        """The budgets a walk of ``trie`` uses (:meth:`trl_dta.walk.budgets.Budgets.derive`): those given to
        the constructor, the others derived from ``memory_budget`` for this trie's longest path, or the fixed
        defaults where no memory budget applies; halved ones after running out of memory."""
        return self.budgets.derive(trie, self.lm, entropy_grad)

    def take_oom_retries(self) -> int:
        """Walks run again after running out of memory since the last call (0 without recovery): what the
        trainers log as ``tree/oom_retries``."""
        return 0 if self.oom_recovery is None else self.oom_recovery.take_retries()

    def plan(self, trie: PrefixTrie, entropy_grad: bool = True) -> list:
        """The steps a walk of ``trie`` runs (:func:`trl_dta.walk.plan.build_plan`) with this executor's
        budgets and the call cost model of its device and attention kernel; records the budgets as
        ``budgets.in_use``."""
        budgets = self.token_budgets(trie, entropy_grad)
        self.budgets.use(budgets, self.lm.name)
        subtree = budgets.subtree_tokens if self.pack_leaves else 0
        costs = self.call_cost
        if costs is None and self.budgets.memory is not None:  # (fixed budgets: each leaf batch filled)
            costs = CallCost.for_model(self.lm.config, self.device.type, self.lm.block_sparse)
        return build_plan(
            trie, budgets.block_size, budgets.batch_tokens, self.pack_leaves, subtree, costs=costs
        )

    # ------------------------------------------------------------------ public API
    @torch.no_grad()
    def logprobs(
        self,
        trie: PrefixTrie,
        temperature: float = 1.0,
        entropies: bool = False,
        score_from: Sequence[int] | None = None,
    ) -> list[torch.Tensor] | tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-sequence log-probs ``lp[t] = log p(seq[t+1] | seq[:t+1])`` (length ``len(seq) - 1``), in input
        order, at ``temperature``; with ``entropies=True`` also the entropy of each of those distributions.

        ``score_from[i]``: the first log-prob index sequence ``i`` needs (e.g. its prompt length - 1); its
        result then starts there (``lp[k]`` is index ``score_from[i] + k``), and the LM head runs only on
        positions some sequence needs. Default: every position."""
        logps, ents = [None] * len(trie), [None] * len(trie)

        def record(index, lp, ent):
            logps[index], ents[index] = lp, ent

        self._recovered(
            lambda: self._walk(trie, temperature, entropies, record, grad=False, score_from=score_from),
            trie, grad=False,
        )  # fmt: skip
        return (logps, ents) if entropies else logps

    def flops(self, trie: PrefixTrie, score_from: Sequence[int] | None = None) -> tuple[float, float]:
        """(dense FLOPs, walk FLOPs) of a forward of ``trie`` (:mod:`trl_dta.walk.flops`): their ratio is the
        FLOP-weighted ideal speedup, beside ``trie.dedup_ratio``."""
        return count_flops(self.lm, trie, score_from)

    @torch.no_grad()
    def router_stats(self, trie: PrefixTrie) -> RouterStats:
        """MoE models: a forward of every unique token (no LM head, no graph) that counts, per trie node, the
        experts each token's router picks and sums its router probabilities (:class:`RouterStats`)."""
        if not self.lm.is_moe:
            raise ValueError(f"{self.lm.name} has no MoE router.")

        def walk() -> RouterStats:
            stats = RouterStats({}, {}, 0)  # (a fresh count for each attempt)
            self._walk(trie, 1.0, False, lambda *a: None, grad=False, router=stats, scoring=False)
            return stats

        return self._recovered(walk, trie, grad=False)

    def backward(
        self,
        trie: PrefixTrie,
        loss_fn: LossFn,
        temperature: float = 1.0,
        entropies: bool = False,
        router_grad: RouterGrad | None = None,
        score_from: Sequence[int] | None = None,
        entropy_grad: bool = True,
    ) -> float:
        """Accumulate into the trainable parameters' ``.grad`` exactly what
        ``sum_i loss_fn(i, logps_i, entropies_i).backward()`` would with dense per-sequence forwards, and
        return that summed loss. ``loss_fn(index, logps, entropies)`` returns a scalar tensor for sequence
        ``index`` (``entropies`` is None unless ``entropies=True``); it may depend on all of the sequence's
        log-probs (sequence-level losses).

        ``router_grad`` (MoE models): per trie node a vector ``v`` [num_experts]; the gradient of
        ``sum <v, softmax(router logits)>`` over the node's tokens and router layers is added as well. Nodes
        missing from the mapping add nothing. ``score_from``: as in :meth:`logprobs`; ``loss_fn`` then gets
        each sequence's log-probs from its ``score_from`` index on. ``entropy_grad=False``: the entropies
        ``loss_fn`` gets are values without a gradient (for metrics and masks; half the LM head's saved
        memory); the loss must then not be differentiated through them."""
        if router_grad is not None and not self.lm.is_moe:
            raise ValueError(f"router_grad given, but {self.lm.name} has no MoE router.")
        if router_grad is not None and self.gather_per_layer and fsdp_units(self.lm.model):
            raise UnsupportedModelError(
                "gather_per_layer with an MoE router loss is not supported: a gradient that reaches a layer "
                "through its router logits alone would find the layer resharded. Use the default gather-once "
                "mode."
            )
        if torch.is_inference_mode_enabled() or not torch.is_grad_enabled():
            mode = "torch.inference_mode()" if torch.is_inference_mode_enabled() else "torch.no_grad()"
            raise RuntimeError(
                f"TreeExecutor.backward was called under {mode}: it computes gradients, so it needs autograd "
                "on. Call it outside that context (logprobs() is the no-gradient walk)."
            )
        if not any(p.requires_grad for p in self.lm.model.parameters()):
            raise ValueError(
                f"{self.lm.name} has no parameter that requires grad: backward has nothing to do."
            )
        total = []

        def on_loss(index, lp, ent):
            loss = loss_fn(index, lp, ent)
            if not isinstance(loss, torch.Tensor):
                raise ArgumentTypeError(
                    f"loss_fn must return a scalar tensor, got {type(loss).__name__} for sequence {index}"
                )
            if loss.dim() != 0:
                raise ValueError(
                    f"loss_fn must return a scalar tensor, got shape {tuple(loss.shape)} for sequence {index}"
                )
            total.append(loss.detach())
            return loss

        def walk() -> None:
            total.clear()  # (a retried walk scores every sequence again)
            self._walk(
                trie, temperature, entropies, on_loss, grad=True, router=router_grad, score_from=score_from,
                entropy_grad=entropy_grad,
            )  # fmt: skip

        self._recovered(walk, trie, grad=True, entropy_grad=entropies and entropy_grad)
        return float(sum(t.detach().double() for t in total)) if total else 0.0

    def _recovered(
        self, walk: Callable[[], T], trie: PrefixTrie, grad: bool, entropy_grad: bool = False
    ) -> T:
        """Run ``walk()``, one walk of ``trie`` (``entropy_grad``: the walk's); one that runs out of memory is
        walked again with halved budgets by :attr:`oom_recovery` (:mod:`trl_dta.walk.recovery`), if on."""
        if self.oom_recovery is None or not isinstance(trie, PrefixTrie):  # (a bad trie: _walk says why)
            return walk()
        return self.oom_recovery.run(self, walk, trie, grad, entropy_grad)

    # ------------------------------------------------------------------ the walk
    def _walk(
        self, trie: PrefixTrie, temperature: float, entropies: bool, on_sequence: OnSequence, grad: bool,
        router: RouterGrad | RouterStats | None = None, scoring: bool = True,
        score_from: Sequence[int] | None = None, entropy_grad: bool = True,
    ) -> None:  # fmt: skip
        if not isinstance(trie, PrefixTrie):
            raise ArgumentTypeError(
                f"expected a PrefixTrie (PrefixTrie.from_sequences(...)), got {type(trie).__name__}"
            )
        if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
            raise ArgumentTypeError(f"temperature must be a number, got {type(temperature).__name__}")
        if not 0 < temperature < math.inf:  # NaN fails too
            raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
        model, lm = self.lm.model, self.lm
        agree_on(lm.check_sequences, trie, model)  # (sharded: every rank raises if one does)
        if zero.is_deepspeed(model):  # DeepSpeed ZeRO-2/3: gathered once, reduced once per step
            sharded = zero.gathered(model, grad, self.gather_per_layer)
        else:  # FSDP2 (or nothing to gather)
            sharded = gathered(model, grad, self.gather_per_layer, lm.decoder, lm.config.num_hidden_layers)
        peak = PeakMemory(self.device)
        with lm.no_gradient_checkpointing(), sharded as lockstep, peak:  # (its final reduction too)
            lm.check_model()
            seq_from, node_from = scored_from(trie, score_from)
            entropy_grad = grad and entropies and entropy_grad
            plan = self.plan(trie, entropy_grad)
            walk = Walk(
                trie, temperature, entropies, grad, on_sequence, PathKV(self._capacity(plan)), seq_from,
                node_from, router, scoring, self.calls, lockstep, entropy_grad=entropy_grad,
                inputs=WalkInputs(trie, plan, self.device, self.pack_leaves), peak=peak,
            )  # fmt: skip
            lockstep.start(len(plan), grad)
            for step in plan:
                with lockstep.round():
                    if isinstance(step, Push):
                        self._push(walk, step)
                    elif isinstance(step, Pop):
                        frame = walk.stack.pop()
                        if grad:
                            self._pop(walk, frame, step.keep_graph)
                    else:
                        self._rows(walk, step)
                peak.sample()
            lockstep.finish()
        self.peak_memory = peak.peak

    def _capacity(self, plan) -> int:
        """The most cache positions a forward of ``plan`` reaches (its start + its row's tokens)."""
        end = 0
        for step in plan:
            if isinstance(step, Push):
                end = max(end, step.segment.end)
            elif isinstance(step, SiblingLeaves | PackedSubtree):
                lengths = [s.num_tokens for s in step.segments]
                row = sum(lengths) if len(lengths) > 1 and self.pack_leaves else max(lengths)
                end = max(end, step.segments[0].start + max(row, 2))  # (padded: at least 2 wide)
        return end

    @staticmethod
    def _backprop(losses: list[torch.Tensor], walk: Walk | None = None) -> bool:
        """Backpropagate the sum of ``losses`` (through the model: by ``walk``'s lock-step); whether there was
        anything to backpropagate."""
        losses = [loss for loss in losses if loss.requires_grad]
        if losses:
            total = torch.stack(losses).sum()
            walk.lockstep.backward(total) if walk is not None else total.backward()
        return bool(losses)

    def _route_rows(self, walk: Walk, node: TrieNode, routers, top: Frame | None, lead: int):
        """MoE: route one row's router logits, whose first ``lead`` tokens are the pending segment ``top``'s:
        those are routed by the first forward that carries them (in exact arithmetic every child's forward
        computes the same router logits for them, so the term or count is taken once)."""
        if routers is None:
            return []
        terms = []
        if lead and not top.routed and (isinstance(walk.router, RouterStats) or torch.is_grad_enabled()):
            terms.append(route(walk.router, top.segment.node, [r[:lead] for r in routers], self.lm.top_k))
            top.routed = True
        terms.append(route(walk.router, node, [r[lead:] for r in routers], self.lm.top_k))
        return [t for t in terms if t is not None]

    # ------------------------------------------------------------------ push
    def _push(self, walk: Walk, step: Push) -> None:
        """Forward the segment (with its graph if it is kept), push it, and backpropagate the losses of the
        sequences that end with it."""
        segment, with_graph = step.segment, walk.grad and step.keep_graph
        top = walk.pending()
        kv_from = segment.start - (0 if top is None else top.pending.numel())
        with torch.set_grad_enabled(with_graph):
            out = self._compute_segment(walk, segment)
        walk.stack.append(Frame.pushed(segment, out, kv_from, with_graph, walk.entropy_grad))
        if walk.scoring:
            losses = [
                walk.on_sequence(i, *path_scores(walk.stack, None, None, 0, walk.seq_from[i]))
                for i in segment.terminals
            ]
            if walk.grad:
                self._backprop(losses)

    def _compute_segment(self, walk: Walk, segment: Segment) -> SegmentOutputs:
        """Forward ``segment`` on the walk's path.

        State models (:attr:`CausalLM.has_states`) never forward a single token on a carried state: models'
        one-token (decode) kernels may compute something else than their multi-token kernels (a clamp only
        one applies) or have no backward. Such a segment is *pending*: only its token's log-prob is computed
        (from the parent's last hidden state), and each child forwards the token again at the head of its
        own forward (one token more per child, exact)."""
        ids = walk.inputs.ids(segment)
        top = walk.pending()
        lead = 0 if top is None else top.pending.numel()
        if top is None and walk.stack and self.lm.has_states and ids.numel() == 1:
            return self._defer(walk, segment, ids)
        if lead:
            ids = torch.cat([top.pending, ids])
        start = segment.start - lead
        hidden, caches, routers = forward(self.lm, walk, ids[None], start)
        terms = self._route_rows(walk, segment.node, routers, top, lead)
        router_term = torch.stack(terms).sum() if terms else None
        if not walk.scoring:
            empty = hidden.new_zeros(0)
            return SegmentOutputs(caches, hidden[:, -1:], empty, None, router_term, segment.end - 1, None)
        # with a pending head, lp[start - 1] is the head's own
        first = walk.first_scored(segment.node)
        froms = [max(first, start) if lead else first]
        lps, ents, firsts = score_rows(
            self.lm, [hidden[0]], [ids], start, walk.parent_hidden(), walk.temperature, walk.entropies, froms,
            walk.entropy_grad,
        )  # fmt: skip
        ent = ents[0] if walk.entropies else None
        return SegmentOutputs(caches, hidden[:, -1:], lps[0], ent, router_term, firsts[0], None)

    def _defer(self, walk: Walk, segment: Segment, ids: torch.Tensor) -> SegmentOutputs:
        """A pending one-token segment (see :meth:`_compute_segment`): its log-prob from the parent's last
        hidden state, no forward."""
        parent_hidden = walk.parent_hidden()
        if not walk.scoring:
            return SegmentOutputs([], None, parent_hidden.new_zeros(0), None, None, segment.end - 1, ids)
        lps, ents, firsts = score_rows(
            self.lm, [parent_hidden.reshape(1, -1)[:0]], [ids], segment.start, parent_hidden,
            walk.temperature, walk.entropies, [walk.first_scored(segment.node)], walk.entropy_grad,
        )  # fmt: skip
        ent = ents[0] if walk.entropies else None
        return SegmentOutputs([], None, lps[0], ent, None, firsts[0], ids)

    # ------------------------------------------------------------------ rows: sibling leaves, packed subtrees
    def _rows(self, walk: Walk, step: SiblingLeaves | PackedSubtree) -> None:
        """Forward sibling leaves or a packed subtree in one call, and backpropagate its sequences' losses
        (and MoE router terms) at once."""
        segments = step.segments
        top = walk.pending()  # its token heads every row (state models, see _compute_segment)
        lead = 0 if top is None else top.pending.numel()
        ids = [walk.inputs.ids(s) for s in segments]
        if lead:
            ids = [torch.cat([top.pending, t]) for t in ids]
        start = segments[0].start - lead
        with torch.set_grad_enabled(walk.grad):
            if len(segments) > 1 and self.pack_leaves:
                hiddens, routers = forward_packed(self.lm, walk, ids, start, step)
            else:
                hiddens, routers = forward_padded(self.lm, walk, ids, start)
            losses = [
                term
                for segment, r in zip(segments, routers, strict=True)
                for term in self._route_rows(walk, segment.node, r, top, lead)
            ]
            if walk.scoring:
                losses += self._row_losses(walk, step, hiddens, ids, start, lead)
        walk.peak.sample()  # (the stack's graphs and this call's: where the walk's memory peaks)
        if walk.grad and self._backprop(losses, walk):
            walk.calls.backward += 1

    def _row_losses(self, walk: Walk, step, hiddens, ids, start: int, lead: int) -> list:
        """Score the rows of a leaves or subtree step (one LM-head call) and call ``on_sequence`` for each
        sequence that ends in it, with its log-probs along the stack and its ancestors in the row."""
        segments = step.segments
        parents = step.parents if isinstance(step, PackedSubtree) else (-1,) * len(segments)
        froms = [max(walk.first_scored(s.node), start if lead else 0) for s in segments]
        starts = [start] * len(segments) if lead else [s.start for s in segments]  # (lead: no subtree)
        above = [walk.parent_hidden() if p < 0 else hiddens[p][-1] for p in parents]
        lps, ents, firsts = score_rows(
            self.lm, hiddens, ids, starts, above, walk.temperature, walk.entropies, froms, walk.entropy_grad
        )
        pieces = [(lps[r], ents[r] if walk.entropies else None, firsts[r]) for r in range(len(segments))]
        losses = []
        for row, segment in enumerate(segments):
            chain, up = [], parents[row]  # the row's ancestors in the step, root first
            while up >= 0:
                chain.insert(0, pieces[up])
                up = parents[up]
            for i in segment.terminals:
                path = path_scores(walk.stack, *pieces[row][:2], firsts[row], walk.seq_from[i], chain)
                losses.append(walk.on_sequence(i, *path))
        return losses

    # ------------------------------------------------------------------ pop
    def _pop(self, walk: Walk, frame: Frame, kept_graph: bool) -> None:
        """Backpropagate a popped segment with the gradients its descendants sent into its handles and its
        K/V (recomputing its graph first under chunked backward)."""
        handles = frame.handles()
        has_router = frame.router_term is not None or (not kept_graph and walk.router is not None)
        has_kv = frame.pending is None and walk.kv.has_grad(frame.kv_from)
        if not has_router and not has_kv and not any(h is not None and h.grad is not None for h in handles):
            return
        # the K/V gradients its descendants sent, per attention layer (taken, and cleared for the segments
        # that will take these positions next)
        kv_layers = [i for i, layer in enumerate(frame.caches) if "k" in layer] if has_kv else []
        kv_grads = [walk.kv.take_grad(i, frame.kv_from, frame.segment.end) for i in kv_layers]
        walk.kv.popped(frame.kv_from)
        caches, outputs, router_term = frame.caches, frame.outputs(), frame.router_term
        if not kept_graph:  # chunked backward: recompute the segment, this time with a graph
            out = self._compute_segment(walk, frame.segment)
            caches, router_term = out.caches, out.router_term
            outputs = flat_outputs(out.caches, out.last_hidden, out.logps, out.entropies)
        pairs = [(out, None if h is None else h.grad) for out, h in zip(outputs, handles, strict=True)]
        for i, (grad_k, grad_v) in zip(kv_layers, kv_grads, strict=True):
            pairs += [(caches[i]["k"], grad_k), (caches[i]["v"], grad_v)]
        outs, grads = [], []
        for out, grad in pairs:
            if grad is not None and out.requires_grad:
                outs.append(out)
                grads.append(grad.to(out.dtype))
        if router_term is not None and router_term.requires_grad:
            outs.append(router_term)
            grads.append(torch.ones_like(router_term))
        walk.peak.sample()
        if outs and frame.pending is not None:  # the LM head alone, on the parent's hidden state
            torch.autograd.backward(outs, grads)
        elif outs:
            walk.lockstep.backward(outs, grads)
            walk.calls.backward += 1
