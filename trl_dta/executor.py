"""The tree executor: forward and backward of every sequence of a prefix trie, each shared prefix once.

The walk follows the plan of :mod:`trl_dta.plan`. A stack holds the segments of the current root-to-node
path; for each one it keeps what the segment left in every layer's cache (for the state layers of hybrid and
state-space models, its final conv / recurrent states), its last hidden state (to score its children's first
tokens) and its tokens' log-probs. Descendants read these through *handles*: detached copies with
``requires_grad=True`` (autograd leaves; "leaf" alone always means a trie leaf here), so whatever gradient a
descendant sends into them accumulates in their ``.grad``. The path's K/V live in one buffer per attention
layer (:class:`~trl_dta.path_kv.PathKV`), with a gradient buffer beside it that plays the same role:

* ``Push``: forward the segment on the stack's caches (every segment's K/V, the top segment's states); keep
  the autograd graph, or (chunked backward) forward without one and recompute it at pop.
* ``Leaves``: forward a batch of sibling leaves (packed into one row with a block-diagonal causal mask, or
  right-padded where the attention backend takes no custom mask), compute each finished sequence's loss
  from the log-probs along its path and backpropagate at once: into the parameters, and into the handles of
  every segment on the stack.
* ``Pop``: backpropagate the segment's outputs with the gradients collected in their handles (and, for its
  K/V, at its positions of the gradient buffer), which continues into the parameters and into the handles
  of the segments below it; then free it.

State models never forward a single token on a carried state (decode kernels may compute something else,
or have no backward): such a one-token segment is *pending*, and its children forward its token again.

MoE models: the walk can also backpropagate a linear term in each segment's router probabilities (the
load-balancing loss, :mod:`trl_dta.router_loss`), and count router choices in a no-grad pass.

Because the loss of a sequence is a function of its own log-probs only, the sum of all these backward
calls is exactly ``sum_i loss_fn(i, logps_i, entropies_i).backward()`` over dense per-sequence forwards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .causal_lm import CausalLM, LayerCache
from .model_checks import packed_inputs
from .path_kv import PathKV
from .plan import Leaves, Pop, Push, Segment, build_plan
from .router_loss import RouterGrad, RouterStats, router_term
from .scoring import first_scored, path_scores, score_rows
from .trie import PrefixTrie, TrieNode

LossFn = Callable[[int, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def _handle(t: torch.Tensor | None) -> torch.Tensor | None:
    """A segment output's *handle*: a detached copy (an autograd leaf) that descendants read and whose
    ``.grad`` collects their gradients. Half-precision outputs (bf16 autocast) get a float32 handle, so the
    gradients of many children sum in float32."""
    if t is None:
        return None
    t = t.detach()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.float()
    return t.requires_grad_(True)


def _outputs(caches, last_hidden, logps, entropies) -> list[torch.Tensor | None]:
    """A segment's outputs that descendants read through handles, flattened in one fixed order (each layer's
    states by name, last hidden state, log-probs, entropies): the order :meth:`_Frame.outputs` and
    :meth:`_Frame.handles` share. K/V are read (and their gradients collected) in the walk's
    :class:`~trl_dta.path_kv.PathKV` instead."""
    states = [layer[k] for layer in caches for k in sorted(layer) if k not in ("k", "v")]
    return states + [last_hidden, logps, entropies]


@dataclass
class _Frame:
    """A segment on the stack: its outputs (graph tensors, or no-graph tensors to recompute) and their
    handles, which its descendants and its sequences' losses read."""

    segment: Segment
    caches: list[LayerCache]  # per layer: its K/V [1, kv_heads, L, head_dim] and/or its final states
    last_hidden: torch.Tensor  # [1, 1, D]
    logps: torch.Tensor  # [n scored tokens]
    entropies: torch.Tensor | None
    caches_in: list[LayerCache]  # handles of the above's states (K/V: in the walk's PathKV)
    last_hidden_in: torch.Tensor
    logps_in: torch.Tensor
    entropies_in: torch.Tensor | None
    lp_from: int  # log-prob index of logps[0]: the segment scores lp indices [lp_from, segment.end - 1)
    kv_from: int  # cache position of its forward's first token (its K/V: [kv_from, segment.end))
    router_term: torch.Tensor | None = None  # MoE: the segment's <v, softmax(router logits)> sum, with graph
    # state models: a one-token segment is not forwarded on its own (see TreeExecutor._compute_segment); its
    # token ids, forwarded at the head of each child's forward instead. No caches, no last hidden state.
    pending: torch.Tensor | None = None
    routed: bool = False  # MoE: a child's forward has already routed the pending token

    def outputs(self) -> list[torch.Tensor | None]:
        return _outputs(self.caches, self.last_hidden, self.logps, self.entropies)

    def handles(self) -> list[torch.Tensor | None]:
        return _outputs(self.caches_in, self.last_hidden_in, self.logps_in, self.entropies_in)


class TreeExecutor:
    """Forward/backward of the sequences of a :class:`~trl_dta.PrefixTrie` through a causal LM.

    Args:
        model: a ``transformers`` causal LM that takes a KV cache (see README "Supported models"),
            plain or PEFT (LoRA) wrapped. Dropout must be off while it trains (it is checked at each call).
        block_size: most tokens forwarded with an autograd graph kept on the stack, and longest segment. Paths
            longer than that are walked with chunked backward (blocks forwarded without a graph, recomputed
            with one when popped); logits are never computed for more than a block (or a leaf batch) at once.
        batch_tokens: budget for forwarding sibling leaves together in one call on their shared prefix: their
            total tokens when packed, rows x longest row when padded. ``None`` means ``block_size``; 0
            forwards one leaf per call.
        lm_head_fp32: compute the LM head projection in float32 (TRL's ``cast_lm_head_to_fp32``).
        pack_leaves: forward a batch of sibling leaves as one packed row with a block-diagonal causal mask
            (no padding, the shared past not replicated per leaf) where the attention backend takes a custom
            mask (eager, sdpa) and the construction probe finds packing exact for the model (no attention
            window, no bias built from key indices such as ALiBi); otherwise, or with False, as a right-padded
            batch.
        subtree_tokens: where leaves are packed, a subtree (a node and all its descendants) of at most this
            many tokens is forwarded whole in one packed row with a tree-shaped causal mask and
            backpropagated in one call (fewer, larger calls; the mask's attention covers the whole row, so
            larger subtrees trade call overhead for attention work). 0: sibling leaves only.

    Gradient checkpointing, if the model has it on, is switched off during the walk and restored after:
    HF decoder layers drop a passed KV cache under it, and the walk bounds activation memory by itself.
    """

    def __init__(
        self,
        model: nn.Module,
        block_size: int = 2048,
        batch_tokens: int | None = None,
        lm_head_fp32: bool = False,
        pack_leaves: bool = True,
        subtree_tokens: int = 512,
    ):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.lm = CausalLM(model, lm_head_fp32=lm_head_fp32)
        self.block_size = block_size
        self.batch_tokens = block_size if batch_tokens is None else batch_tokens
        self.pack_leaves = pack_leaves and self.lm.can_pack
        self.subtree_tokens = subtree_tokens if self.pack_leaves else 0
        self.device = self.lm.decoder.get_input_embeddings().weight.device
        self._router: RouterGrad | RouterStats | None = None  # set during a walk that reads router logits

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

        self._walk(trie, temperature, entropies, record, grad=False, score_from=score_from)
        return (logps, ents) if entropies else logps

    @torch.no_grad()
    def router_stats(self, trie: PrefixTrie) -> RouterStats:
        """MoE models: a forward of every unique token (no LM head, no graph) that counts, per trie node, the
        experts each token's router picks and sums its router probabilities (:class:`RouterStats`)."""
        if not self.lm.is_moe:
            raise ValueError(f"{type(self.lm.base).__name__} has no MoE router.")
        stats = RouterStats({}, {}, 0)
        self._walk(trie, 1.0, False, lambda *a: None, grad=False, router=stats, score=False)
        return stats

    def backward(
        self,
        trie: PrefixTrie,
        loss_fn: LossFn,
        temperature: float = 1.0,
        entropies: bool = False,
        router_grad: RouterGrad | None = None,
        score_from: Sequence[int] | None = None,
    ) -> float:
        """Accumulate into the trainable parameters' ``.grad`` exactly what
        ``sum_i loss_fn(i, logps_i, entropies_i).backward()`` would with dense per-sequence forwards, and
        return that summed loss. ``loss_fn(index, logps, entropies)`` returns a scalar tensor for sequence
        ``index`` (``entropies`` is None unless ``entropies=True``); it may depend on all of the sequence's
        log-probs (sequence-level losses).

        ``router_grad`` (MoE models): per trie node a vector ``v`` [num_experts]; the gradient of
        ``sum <v, softmax(router logits)>`` over the node's tokens and router layers is added as well. Nodes
        missing from the mapping add nothing. ``score_from``: as in :meth:`logprobs`; ``loss_fn`` then gets
        each sequence's log-probs from its ``score_from`` index on."""
        if router_grad is not None and not self.lm.is_moe:
            raise ValueError(f"router_grad given, but {type(self.lm.base).__name__} has no MoE router.")
        total = []

        def on_loss(index, lp, ent):
            loss = loss_fn(index, lp, ent)
            if loss.dim() != 0:
                raise ValueError(
                    f"loss_fn must return a scalar tensor, got shape {tuple(loss.shape)} for {index}"
                )
            total.append(loss.detach())
            return loss

        self._walk(
            trie, temperature, entropies, on_loss, grad=True, router=router_grad, score_from=score_from
        )
        return float(sum(t.detach().double() for t in total)) if total else 0.0

    # ------------------------------------------------------------------ the walk
    def _walk(
        self, trie: PrefixTrie, temperature: float, entropies: bool, on_sequence, grad: bool,
        router: RouterGrad | RouterStats | None = None, score: bool = True,
        score_from: Sequence[int] | None = None,
    ) -> None:  # fmt: skip
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.lm.check_call(trie.max_depth)
        stack: list[_Frame] = []
        self._router, self._scoring = router, score
        self._seq_from, self._node_from = first_scored(trie, score_from)
        plan = build_plan(trie, self.block_size, self.batch_tokens, self.pack_leaves, self.subtree_tokens)
        self._kv = PathKV(self._capacity(plan))
        try:
            with self.lm.no_gradient_checkpointing():
                for step in plan:
                    if isinstance(step, Push):
                        with_graph = grad and step.keep_graph
                        frame = self._push(trie, step.segment, stack, temperature, entropies, with_graph)
                        stack.append(frame)
                        if score:
                            losses = [
                                on_sequence(i, *path_scores(stack, None, None, 0, self._seq_from[i]))
                                for i in step.segment.terminals
                            ]
                            if grad:
                                self._backprop_losses(losses)
                    elif isinstance(step, Leaves):
                        self._leaves(trie, step, stack, temperature, entropies, on_sequence, grad)
                    elif isinstance(step, Pop):
                        frame = stack.pop()
                        if grad:
                            self._pop(trie, frame, step.keep_graph, stack, temperature, entropies)
        finally:
            self._router, self._scoring, self._kv = None, True, None

    def _capacity(self, plan) -> int:
        """The most cache positions a forward of ``plan`` reaches (its start + its row's tokens)."""
        end = 0
        for step in plan:
            if isinstance(step, Push):
                end = max(end, step.segment.end)
            elif isinstance(step, Leaves):
                lengths = [s.num_tokens for s in step.segments]
                row = sum(lengths) if len(lengths) > 1 and self.pack_leaves else max(lengths)
                end = max(end, step.segments[0].start + max(row, 2))  # (padded: at least 2 wide)
        return end

    def _from(self, node: TrieNode) -> int:
        return 0 if self._node_from is None else self._node_from[node]

    @staticmethod
    def _backprop_losses(losses: list[torch.Tensor]) -> None:
        losses = [loss for loss in losses if loss.requires_grad]
        if losses:
            torch.stack(losses).sum().backward()

    def _past(self, stack: list[_Frame], rows: int):
        """The stack's states, expanded to ``rows`` rows (no copy): the model starts from the top segment's
        states (and attends to the path's K/V in the walk's :class:`~trl_dta.path_kv.PathKV`)."""
        path = [f.caches_in for f in stack if f.pending is None]
        return self.lm.expand(path, rows) if path else None

    @staticmethod
    def _pending(stack: list[_Frame]) -> _Frame | None:
        return stack[-1] if stack and stack[-1].pending is not None else None

    def _route_rows(self, node: TrieNode, routers, top: _Frame | None, lead: int) -> list[torch.Tensor]:
        """MoE: :meth:`_route` one row's router logits, whose first ``lead`` tokens are the pending segment
        ``top``'s: those are routed by the first forward that carries them (in exact arithmetic every child's
        forward computes the same router logits for them, so the term or count is taken once)."""
        if routers is None:
            return []
        terms = []
        if lead and not top.routed and (isinstance(self._router, RouterStats) or torch.is_grad_enabled()):
            terms.append(self._route(top.segment.node, [r[:lead] for r in routers]))
            top.routed = True
        terms.append(self._route(node, [r[lead:] for r in routers]))
        return [t for t in terms if t is not None]

    def _forward(
        self, ids: torch.Tensor, start: int, stack: list[_Frame], positions=None, attention_mask=None
    ):
        """Decode ``ids`` [B, L] on the stack's caches: hidden [B, L, D], the new per-layer caches, and (when
        the walk reads router logits) each router layer's logits [B * L, E]."""
        past = self._past(stack, ids.shape[0])
        if self._router is None:
            return (*self.lm.forward(ids, start, past, positions, attention_mask, kv=self._kv), None)
        return self.lm.forward_routed(ids, start, past, positions, attention_mask, kv=self._kv)

    def _route(self, node: TrieNode, routers: list[torch.Tensor] | None) -> torch.Tensor | None:
        """MoE: fold one row's router logits (per router layer [L, E]) for ``node`` into the walk's router
        statistics (counting pass), or return its ``sum <v, softmax(logits)>`` term (gradient walk)."""
        if routers is None:
            return None
        if isinstance(self._router, RouterStats):
            self._router.add(node, routers, self.lm.top_k)
            return None
        v = self._router.get(node)
        if v is None or not torch.is_grad_enabled():
            return None
        return router_term(v, routers)

    def _segment_ids(self, trie: PrefixTrie, segment: Segment) -> torch.Tensor:
        tokens = trie.sequences[segment.node.seq][segment.start : segment.end]
        return torch.as_tensor(tokens, dtype=torch.long, device=self.device)

    def _compute_segment(self, trie, segment, stack, temperature, entropies):
        """Forward ``segment`` on the stack: its caches, last hidden state, log-probs, entropies, MoE router
        term, first scored index, and whether it is pending.

        State models (:attr:`CausalLM.has_states`) never forward a single token on a carried state: models'
        one-token (decode) kernels may compute something else than their multi-token kernels (a clamp only one
        applies) or have no backward. Such a segment is *pending*: only its token's log-prob is computed (from
        the parent's last hidden state), and each child forwards the token again at the head of its own
        forward (one token more per child, exact)."""
        ids = self._segment_ids(trie, segment)
        top = self._pending(stack)
        lead = 0 if top is None else top.pending.numel()
        if top is None and stack and self.lm.has_states and ids.numel() == 1:
            return self._defer(segment, ids, stack, temperature, entropies)
        if lead:
            ids = torch.cat([top.pending, ids])
        start = segment.start - lead
        hidden, caches, routers = self._forward(ids[None], start, stack)
        terms = self._route_rows(segment.node, None if routers is None else [r for r in routers], top, lead)
        router_term = torch.stack(terms).sum() if terms else None
        if not self._scoring:
            return caches, hidden[:, -1:], hidden.new_zeros(0), None, router_term, segment.end - 1, None
        parent_hidden = stack[-1].last_hidden_in if stack else None
        # with a pending head, lp[start - 1] is the head's own
        froms = [max(self._from(segment.node), start) if lead else self._from(segment.node)]
        lps, ents, firsts = score_rows(
            self.lm, [hidden[0]], [ids], start, parent_hidden, temperature, entropies, froms
        )
        ent = ents[0] if entropies else None
        return caches, hidden[:, -1:], lps[0], ent, router_term, firsts[0], None

    def _defer(self, segment, ids, stack, temperature, entropies):
        """A pending one-token segment (see :meth:`_compute_segment`): its log-prob from the parent's last
        hidden state, no forward."""
        parent_hidden = stack[-1].last_hidden_in
        if not self._scoring:
            return [], None, parent_hidden.new_zeros(0), None, None, segment.end - 1, ids
        lps, ents, firsts = score_rows(
            self.lm, [parent_hidden.reshape(1, -1)[:0]], [ids], segment.start, parent_hidden, temperature,
            entropies, [self._from(segment.node)],
        )  # fmt: skip
        return [], None, lps[0], (ents[0] if entropies else None), None, firsts[0], ids

    def _push(self, trie, segment, stack, temperature, entropies, with_graph) -> _Frame:
        top = self._pending(stack)
        kv_from = segment.start - (0 if top is None else top.pending.numel())
        with torch.set_grad_enabled(with_graph):
            caches, last_hidden, lp, ent, router_term, lp_from, pending = self._compute_segment(
                trie, segment, stack, temperature, entropies
            )
        return _Frame(
            segment, caches, last_hidden, lp, ent,
            caches_in=[{k: _handle(t) for k, t in layer.items() if k not in ("k", "v")} for layer in caches],
            last_hidden_in=_handle(last_hidden),
            logps_in=_handle(lp),
            entropies_in=_handle(ent),
            lp_from=lp_from,
            kv_from=kv_from,
            router_term=router_term if with_graph else None,
            pending=pending,
        )  # fmt: skip

    def _leaves(self, trie, step: Leaves, stack, temperature, entropies, on_sequence, grad) -> None:
        segments = step.segments
        parents = step.parents or (-1,) * len(segments)  # a packed subtree: each segment's parent in the row
        top = self._pending(stack)  # its token heads every row (state models, see _compute_segment)
        lead = 0 if top is None else top.pending.numel()
        ids = [self._segment_ids(trie, s) for s in segments]
        if lead:
            ids = [torch.cat([top.pending, t]) for t in ids]
        start = segments[0].start - lead
        parent_hidden = stack[-1].last_hidden_in if stack else None
        with torch.set_grad_enabled(grad):
            if len(segments) > 1 and self.pack_leaves:
                hiddens, routers = self._forward_packed(ids, start, stack, step)
            else:
                hiddens, routers = self._forward_padded(ids, start, stack)
            losses = [
                term
                for segment, r in zip(segments, routers, strict=True)
                for term in self._route_rows(segment.node, r, top, lead)
            ]
            if self._scoring:
                froms = [max(self._from(s.node), start if lead else 0) for s in segments]
                starts = (
                    [start] * len(segments) if lead else [s.start for s in segments]
                )  # (lead: no subtree)
                above = [parent_hidden if p < 0 else hiddens[p][-1] for p in parents]
                lps, ents, firsts = score_rows(
                    self.lm, hiddens, ids, starts, above, temperature, entropies, froms
                )
                pieces = [(lps[r], ents[r] if entropies else None, firsts[r]) for r in range(len(segments))]
                for row, segment in enumerate(segments):
                    chain, up = [], parents[row]  # the row's ancestors in the step, root first
                    while up >= 0:
                        chain.insert(0, pieces[up])
                        up = parents[up]
                    for i in segment.terminals:
                        path = path_scores(stack, *pieces[row][:2], firsts[row], self._seq_from[i], chain)
                        losses.append(on_sequence(i, *path))
        if grad:
            self._backprop_losses(losses)

    def _forward_padded(self, ids, start, stack):
        """Sibling leaves as a right-padded batch (causal attention keeps padding invisible to real tokens).
        Returns each row's hidden states and (MoE) each row's router logits per layer, padding dropped."""
        lengths = [t.numel() for t in ids]
        width = max(lengths)
        if self.lm.has_states and stack:  # never a one-token forward on a carried state: pad one more
            width = max(width, 2)
        batch = torch.zeros(len(ids), width, dtype=torch.long, device=self.device)
        for row, t in enumerate(ids):
            batch[row, : lengths[row]] = t
        hidden, _, routers = self._forward(batch, start, stack)
        per_row = [None] * len(ids)
        if routers is not None:  # each [B * width, E], row-major
            per_row = [
                [r.view(len(ids), width, -1)[row, :n] for r in routers] for row, n in enumerate(lengths)
            ]
        return [hidden[row, :n] for row, n in enumerate(lengths)], per_row

    def _forward_packed(self, ids, start, stack, step: Leaves):
        """Sibling leaves, or the segments of a subtree, packed into one row: each token attends the shared
        past, the earlier tokens of its own segment and its segment's ancestors in the row (a tree-shaped
        causal mask), at its own position (restarting at ``start`` for every sibling leaf). No padding, and
        the past K/V is not replicated per row."""
        lengths = [t.numel() for t in ids]
        positions, mask = packed_inputs(
            lengths, start, self.lm.lm_head.weight.dtype, self.device,
            parents=step.parents or None, starts=[s.start for s in step.segments] if step.parents else None,
        )  # fmt: skip
        hidden, _, routers = self._forward(
            torch.cat(ids)[None], start, stack, positions=positions, attention_mask=mask
        )
        per_row = [None] * len(ids)
        if routers is not None:  # each [total, E]
            per_row = [list(rows) for rows in zip(*(r.split(lengths) for r in routers), strict=True)]
        return list(hidden[0].split(lengths)), per_row

    def _pop(self, trie, frame: _Frame, kept_graph: bool, stack, temperature, entropies) -> None:
        handles = frame.handles()
        router_term = frame.router_term
        has_router = router_term is not None or (not kept_graph and self._router is not None)
        has_kv = frame.pending is None and self._kv.has_grad(frame.kv_from)
        if not has_router and not has_kv and not any(h is not None and h.grad is not None for h in handles):
            return
        # the K/V gradients its descendants sent, per attention layer (taken, and cleared for the segments
        # that will take these positions next)
        kv_layers = [i for i, layer in enumerate(frame.caches) if "k" in layer] if has_kv else []
        kv_grads = [self._kv.take_grad(i, frame.kv_from, frame.segment.end) for i in kv_layers]
        self._kv.popped(frame.kv_from)
        caches = frame.caches
        if kept_graph:
            outputs = frame.outputs()
        else:  # chunked backward: recompute the segment, this time with a graph
            caches, last_hidden, lp, ent, router_term, _, _ = self._compute_segment(
                trie, frame.segment, stack, temperature, entropies
            )
            outputs = _outputs(caches, last_hidden, lp, ent)
        outs, grads = [], []
        pairs = [(out, None if h is None else h.grad) for out, h in zip(outputs, handles, strict=True)]
        for i, (grad_k, grad_v) in zip(kv_layers, kv_grads, strict=True):
            pairs += [(caches[i]["k"], grad_k), (caches[i]["v"], grad_v)]
        for out, grad in pairs:
            if grad is not None and out.requires_grad:
                outs.append(out)
                grads.append(grad.to(out.dtype))
        if router_term is not None and router_term.requires_grad:
            outs.append(router_term)
            grads.append(torch.ones_like(router_term))
        if outs:
            torch.autograd.backward(outs, grads)
