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

:class:`TreeExecutor` builds the plan and the walk's state and runs the steps (:mod:`trl_dta.walk.steps`).
Because the loss of a sequence is a function of its own log-probs only, the sum of all these backward
calls is exactly ``sum_i loss_fn(i, logps_i, entropies_i).backward()`` over dense per-sequence forwards.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TypeVar

import torch
from torch import nn

from ..trie import PrefixTrie
from .adapter.checks import check_count
from .adapter.model import CausalLM
from .attention.kernel import AttentionKernel
from .call_checks import check_backward_call, check_loss, check_walk_call
from .cost.cost_model import CostModel
from .cost.costs import CallCost
from .cost.flops import flops as count_flops
from .distributed import deepspeed as zero
from .distributed.sharding import agree_on, gathered
from .errors import ArgumentTypeError
from .heads import Head, default_head
from .inputs import WalkInputs
from .memory.budgets import Budgets, TokenBudgets
from .memory.peak import PeakMemory
from .memory.recovery import RETRIES, OOMRecovery
from .path_kv import PathKV
from .plan import build_plan, capacity
from .router import RouterGrad, RouterStats
from .scoring import scored_from
from .state import CallCounts, OnSequence, Walk
from .steps import run_step

LossFn = Callable[[int, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
T = TypeVar("T")


class TreeExecutor:
    """Forward/backward of the sequences of a :class:`~trl_dta.PrefixTrie` through a causal LM.

    What a scored position gives is the executor's ``head`` (:mod:`trl_dta.walk.heads`): log-probs and
    entropies; a value model's values (a ``*ForTokenClassification``, or ``*ForSequenceClassification``,
    ``num_labels=1``: :meth:`logprobs` returns values, :meth:`backward` calls ``loss_fn(i, values_i, None)``);
    or the hidden states, the loss applying the output head itself (:meth:`head_logits`). The latter two walk
    at temperature 1.0 without entropies (a ``ValueError`` otherwise).

    Args:
        model: a ``transformers`` causal LM that takes a KV cache (see docs/supported-models.md), plain or
            PEFT (LoRA) wrapped, whole or sharded with FSDP2 (``fully_shard``: each walk gathers every unit
            once and reduce-scatters the gradients once, :mod:`trl_dta.walk.distributed.sharding`), or the
            module of a DeepSpeed ZeRO-2/3 engine (registered first: :mod:`~trl_dta.walk.distributed.
            deepspeed`). Randomness must be off while it trains (checked at each call). Models the walk
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
            (:mod:`trl_dta.walk.cost.costs`; :attr:`call_cost` to set one) decides which calls to merge within
            them: fewer calls against the attention pairs a dense mask computes for nothing. With the fixed
            budgets, each leaf batch is filled to its budget and each subtree that fits is packed on its own
            (the rule measured fastest on CPU). 0: sibling leaves only. None: from ``memory_budget``.
        gather_per_layer: for an FSDP2-sharded model whose gathered parameters do not fit: gather each decoder
            layer only for its own calls and reduce-scatter its gradients after each backward call, the calls
            of all ranks kept in lock-step (:mod:`trl_dta.walk.distributed.lockstep`), instead of gathering
            every unit once per walk. Slower: see docs/multi-process.md's memory model. Ignored for an
            unsharded model; refused under DeepSpeed ZeRO-3 (:mod:`trl_dta.walk.distributed.deepspeed`).
        memory_budget: bytes of activation memory a walk may use; the budgets not given are derived from it
            for each trie (:mod:`trl_dta.walk.memory.budgets`: the longest path's graph first, so that nothing
            is forwarded twice, then the largest calls that fit). "auto": on CUDA, ``AUTO_FRACTION`` of the
            free memory at the first walk less the first optimizer step's gradients and Adam states; a
            percentage ("80%"): that share instead; elsewhere, and with None, the fixed budgets measured
            fastest on CPU (:data:`~trl_dta.walk.memory.budgets.FIXED`). Strings as users type them ("8GiB",
            "6e10", "none"): :func:`~trl_dta.walk.memory.memory_budget.parse_memory_budget`.
        oom_retries: a walk that runs out of memory (``torch.OutOfMemoryError``, ``MemoryError``) is walked
            again with every budget it used halved, up to this many times, its partial gradients discarded;
            the smaller budgets stay for later walks and grow back after a while (:mod:`~trl_dta.walk.memory.
            recovery`, ``oom_recovery``). 0: an out-of-memory error is raised as it is.
        budgets: a :class:`~trl_dta.walk.memory.budgets.Budgets` built by the caller (``reserved_bytes``...),
            instead of ``block_size``, ``batch_tokens``, ``subtree_tokens`` and ``memory_budget``.
        cost_model: a :class:`~trl_dta.walk.cost.cost_model.CostModel` (or its mode: "auto", "reset",
            "frozen"): the gradient walks time their calls and the plan is built with the constants fitted to
            them (docs/cost-model.md). None: the device kind's shipped constants, nothing timed.
        head: what a scored position gives (a :class:`~trl_dta.walk.heads.Head`); None: the model's default
            (:func:`~trl_dta.walk.heads.default_head`: values for a value model, else log-probs).
        attention_kernel: how its calls attend (:mod:`trl_dta.walk.attention.kernel`); None: the kernel of the
            model's ``attn_implementation`` (:mod:`trl_dta.walk.attention.kernels`).

    :attr:`budgets` reports the budgets in use (``budgets.in_use``, ``budgets.metrics()``),
    :meth:`take_oom_retries` the walks retried after running out of memory, :attr:`peak_memory` the last
    walk's peak. Gradient checkpointing is switched off during a walk (HF decoder layers drop a passed KV
    cache under it; the walk bounds activation memory by itself) and restored after.
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
        cost_model: CostModel | str | None = None,
        head: Head | None = None,
        attention_kernel: AttentionKernel | None = None,
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
        self.lm = CausalLM(model, lm_head_fp32=lm_head_fp32, kernel=attention_kernel)
        self.head = default_head(self.lm) if head is None else head
        self.calls = CallCounts()  # model calls of every walk so far (tree/calls, tree/tokens_per_call)
        # which calls to merge: the device kind's cost model unless set (:mod:`trl_dta.walk.cost.costs`)
        self.call_cost: CallCost | None = None
        self.cost_model = CostModel(cost_model) if isinstance(cost_model, str) else cost_model
        self.oom_recovery = OOMRecovery(oom_retries) if check_count("oom_retries", oom_retries) else None
        self.peak_memory: int | None = None  # bytes, the last walk's peak (:mod:`trl_dta.walk.memory.peak`)

    @property
    def pack_leaves(self) -> bool:
        """Whether sibling leaves are packed into one row (asked for, and exact for the model)."""
        return self._pack_leaves and self.lm.can_pack

    @property
    def device(self) -> torch.device:
        return self.lm.device

    def token_budgets(self, trie: PrefixTrie, entropy_grad: bool = True) -> TokenBudgets:
        """The budgets a walk of ``trie`` uses (:meth:`~trl_dta.walk.memory.budgets.Budgets.derive`): those
        given to the constructor, the others derived from ``memory_budget`` for this trie's longest path, or
        the fixed defaults where no memory budget applies; halved ones after running out of memory."""
        return self.budgets.derive(trie, self.lm, entropy_grad, self.head)

    def take_oom_retries(self) -> int:
        """Walks run again after running out of memory since the last call (0 without recovery): what the
        trainers log as ``tree/oom_retries``."""
        return 0 if self.oom_recovery is None else self.oom_recovery.take_retries()

    def plan(
        self, trie: PrefixTrie, entropy_grad: bool = True, record: bool = True, explore=False, kernel=None
    ) -> list:
        """The steps a walk of ``trie`` runs (:func:`trl_dta.walk.plan.build_plan`) with this executor's
        budgets and the call cost model of its device and attention ``kernel`` (None: the model's,
        :meth:`~trl_dta.walk.adapter.model.CausalLM.walk_kernel`; fitted, with a :attr:`cost_model`);
        records the budgets as ``budgets.in_use`` (unless not ``record``). ``explore``: within the same
        budgets, merge nothing (launches priced at 0), so that the cost model measures small calls."""
        budgets = self.token_budgets(trie, entropy_grad)
        if record:
            self.budgets.use(budgets, self.lm.name)
        subtree = budgets.subtree_tokens if self.pack_leaves else 0
        kernel = kernel or self.lm.walk_kernel()
        costs = self.call_cost
        if costs is None and (self.budgets.memory is not None or explore):  # (else each leaf batch filled)
            costs = self.fitted_costs() or CallCost.for_model(self.lm.config, self.device.type, kernel)
            # (exploring, rows are priced at their rectangle: split per segment a merge would cost nothing)
            costs = replace(costs, fixed=0.0, kernel=None) if explore else costs
        key_weight = 0.0  # (memory budgets: a call's gathered keys count against it, where they are kept)
        if self.budgets.memory is not None and kernel.keeps_keys:
            key_weight = self.budgets.key_weight(self.lm, entropy_grad, self.head)
        return build_plan(
            trie, budgets.block_size, budgets.batch_tokens, self.pack_leaves, subtree, costs, key_weight
        )

    def _cost_model_explores(self) -> bool:
        """Whether the cost model asks this gradient walk to explore (never with a pinned call_cost)."""
        if self.cost_model is None:
            return False
        self.cost_model.start(self.lm, self.device)
        return self.cost_model.explores()

    def fitted_costs(self) -> CallCost | None:
        """The call costs fitted on this device (:attr:`cost_model`), once calibrated; else None."""
        if self.cost_model is not None:
            self.cost_model.start(self.lm, self.device)
            return self.cost_model.costs() if self.cost_model.calibrated else None

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
            trie,
            grad=False,
        )
        return (logps, ents) if entropies else logps

    def head_logits(self, hidden: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """The model's output head on ``hidden`` [..., D] (float32): with its logit scale and soft-capping,
        / ``temperature`` (a value model's values): what a loss of the ``HiddenStates`` head applies."""
        return self.lm.logits(hidden, temperature)

    def flops(self, trie: PrefixTrie, score_from: Sequence[int] | None = None) -> tuple[float, float]:
        """(dense FLOPs, walk FLOPs) of a forward of ``trie`` (:mod:`trl_dta.walk.cost.flops`): their ratio is
        the FLOP-weighted ideal speedup, beside ``trie.dedup_ratio``."""
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
        check_backward_call(self.lm, router_grad, self.gather_per_layer)
        total = []

        def on_loss(index, lp, ent):
            loss = check_loss(loss_fn(index, lp, ent), index)
            total.append(loss.detach())
            return loss

        def walk() -> None:
            total.clear()  # (a retried walk scores every sequence again)
            self._walk(
                trie,
                temperature,
                entropies,
                on_loss,
                grad=True,
                router=router_grad,
                score_from=score_from,
                entropy_grad=entropy_grad,
            )

        self._recovered(walk, trie, grad=True, entropy_grad=entropies and entropy_grad)
        return float(sum(t.detach().double() for t in total)) if total else 0.0

    def _recovered(
        self, walk: Callable[[], T], trie: PrefixTrie, grad: bool, entropy_grad: bool = False
    ) -> T:
        """Run ``walk()``, one walk of ``trie`` (``entropy_grad``: the walk's); one that runs out of memory is
        walked again with halved budgets by :attr:`oom_recovery` (:mod:`~trl_dta.walk.memory.recovery`)."""
        if self.oom_recovery is None or not isinstance(trie, PrefixTrie):  # (a bad trie: _walk says why)
            return walk()
        return self.oom_recovery.run(self, walk, trie, grad, entropy_grad)

    # ------------------------------------------------------------------ the walk
    def _walk(
        self,
        trie: PrefixTrie,
        temperature: float,
        entropies: bool,
        on_sequence: OnSequence,
        grad: bool,
        router: RouterGrad | RouterStats | None = None,
        scoring: bool = True,
        score_from: Sequence[int] | None = None,
        entropy_grad: bool = True,
    ) -> None:
        model, lm = self.lm.model, self.lm
        check_walk_call(lm, trie, temperature, entropies, self.head)
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
            started = time.perf_counter()
            explore = grad and self.call_cost is None and self._cost_model_explores()
            kernel = lm.walk_kernel()  # (the plan prices it, the calls attend with it)
            plan = self.plan(trie, entropy_grad, explore=explore, kernel=kernel)
            path_kv = PathKV(capacity(plan, self.pack_leaves))
            walk = Walk(
                trie,
                temperature,
                entropies,
                grad,
                on_sequence,
                path_kv,
                seq_from,
                node_from,
                router,
                scoring,
                self.calls,
                lockstep,
                entropy_grad=entropy_grad,
                inputs=WalkInputs(trie, plan, self.device, self.pack_leaves, kernel),
                peak=peak,
                head=self.head,
            )
            timing = None
            if grad and self.cost_model is not None:  # (the gradient walks are timed: docs/cost-model.md)
                self.cost_model.start(lm, self.device)
                timing = self.cost_model.timing(plan, self.pack_leaves, node_from)
            if timing is not None:
                timing.begin(self.device, started)
            lockstep.start(len(plan), grad)
            for step in plan:
                with lockstep.round():
                    run_step(lm, walk, step, self.pack_leaves)
                peak.sample()
                if timing is not None:
                    timing.step(step)
            lockstep.finish()
            if timing is not None:
                timing.end()
        self.peak_memory = peak.peak
