"""The walk's steps (:mod:`trl_dta.walk.plan`), each run on one walk's state
(:class:`~trl_dta.walk.state.Walk`):

* ``Push`` (:func:`_push`): forward the segment on the path (:func:`_compute_segment`; with its graph if it
  is kept, else without one, recomputed at pop), push it, and backpropagate the losses of the sequences
  that end with it into the handles below it;
* ``SiblingLeaves`` / ``PackedSubtree`` (:func:`_rows`): forward the rows in one call, score them
  (:func:`_row_losses`), and backpropagate their sequences' losses (and MoE router terms) at once;
* ``Pop`` (:func:`_pop`): backpropagate the popped segment with the gradients its descendants sent into its
  handles and its K/V positions (recomputing it first under chunked backward).

:func:`run_step` dispatches; :class:`~trl_dta.walk.executor.TreeExecutor`'s loop calls it for each step of
its plan. State models never forward a single token on a carried state: such a one-token segment is
*pending* (:func:`_defer`), and each child forwards its token again at the head of its own forward.
"""

from __future__ import annotations

import torch

from ..trie import TrieNode
from .adapter.model import CausalLM
from .forwards import forward, forward_packed, forward_padded
from .plan import PackedSubtree, Pop, Push, Segment, SiblingLeaves, Step
from .router import RouterStats, route
from .scoring import path_scores, score_rows
from .state import Frame, SegmentOutputs, Walk, flat_outputs


def run_step(lm: CausalLM, walk: Walk, step: Step, packed: bool) -> None:
    """Run one step of a plan on ``walk`` through ``lm``; ``packed``: several rows are forwarded as one
    packed row (else as a right-padded batch)."""
    if isinstance(step, Push):
        _push(lm, walk, step)
    elif isinstance(step, Pop):
        frame = walk.stack.pop()
        if walk.grad:
            _pop(lm, walk, frame, step.keep_graph)
    else:
        _rows(lm, walk, step, packed)


def _backprop(losses: list[torch.Tensor], walk: Walk | None = None) -> bool:
    """Backpropagate the sum of ``losses`` (through the model: by ``walk``'s lock-step); whether there was
    anything to backpropagate."""
    losses = [loss for loss in losses if loss.requires_grad]
    if losses:
        total = torch.stack(losses).sum()
        walk.lockstep.backward(total) if walk is not None else total.backward()
    return bool(losses)


def _route_rows(lm: CausalLM, walk: Walk, node: TrieNode, routers, top: Frame | None, lead: int):
    """MoE: route one row's router logits, whose first ``lead`` tokens are the pending segment ``top``'s:
    those are routed by the first forward that carries them (in exact arithmetic every child's forward
    computes the same router logits for them, so the term or count is taken once)."""
    if routers is None:
        return []
    terms = []
    if lead and not top.routed and (isinstance(walk.router, RouterStats) or torch.is_grad_enabled()):
        terms.append(route(walk.router, top.segment.node, [r[:lead] for r in routers], lm.top_k))
        top.routed = True
    terms.append(route(walk.router, node, [r[lead:] for r in routers], lm.top_k))
    return [t for t in terms if t is not None]


# ---------------------------------------------------------------------- push
def _push(lm: CausalLM, walk: Walk, step: Push) -> None:
    """Forward the segment (with its graph if it is kept), push it, and backpropagate the losses of the
    sequences that end with it."""
    segment, with_graph = step.segment, walk.grad and step.keep_graph
    top = walk.pending()
    kv_from = segment.start - (0 if top is None else top.pending.numel())
    with torch.set_grad_enabled(with_graph):
        out = _compute_segment(lm, walk, segment)
    walk.stack.append(Frame.pushed(segment, out, kv_from, with_graph, walk.entropy_grad))
    if walk.scoring:
        losses = [
            walk.on_sequence(i, *path_scores(walk.stack, None, None, 0, walk.seq_from[i]))
            for i in segment.terminals
        ]
        if walk.grad:
            _backprop(losses)


def _compute_segment(lm: CausalLM, walk: Walk, segment: Segment) -> SegmentOutputs:
    """Forward ``segment`` on the walk's path.

    State models (:attr:`CausalLM.has_states`) never forward a single token on a carried state: models'
    one-token (decode) kernels may compute something else than their multi-token kernels (a clamp only
    one applies) or have no backward. Such a segment is *pending*: only its token's log-prob is computed
    (from the parent's last hidden state), and each child forwards the token again at the head of its
    own forward (one token more per child, exact)."""
    ids = walk.inputs.ids(segment)
    top = walk.pending()
    lead = 0 if top is None else top.pending.numel()
    if top is None and walk.stack and lm.has_states and ids.numel() == 1:
        return _defer(lm, walk, segment, ids)
    if lead:
        ids = torch.cat([top.pending, ids])
    start = segment.start - lead
    hidden, caches, routers = forward(lm, walk, ids[None], start, layout=walk.inputs.layout(segment))
    terms = _route_rows(lm, walk, segment.node, routers, top, lead)
    router_term = torch.stack(terms).sum() if terms else None
    if not walk.scoring:
        empty = hidden.new_zeros(0)
        return SegmentOutputs(caches, hidden[:, -1:], empty, None, router_term, segment.end - 1, None)
    # with a pending head, lp[start - 1] is the head's own
    first = walk.first_scored(segment.node)
    froms = [max(first, start) if lead else first]
    lps, ents, firsts = score_rows(
        lm,
        [hidden[0]],
        [ids],
        start,
        walk.parent_hidden(),
        walk.temperature,
        walk.entropies,
        froms,
        walk.entropy_grad,
        walk.head,
    )
    ent = ents[0] if walk.entropies else None
    return SegmentOutputs(caches, hidden[:, -1:], lps[0], ent, router_term, firsts[0], None)


def _defer(lm: CausalLM, walk: Walk, segment: Segment, ids: torch.Tensor) -> SegmentOutputs:
    """A pending one-token segment (see :func:`_compute_segment`): its log-prob from the parent's last
    hidden state, no forward."""
    parent_hidden = walk.parent_hidden()
    if not walk.scoring:
        return SegmentOutputs([], None, parent_hidden.new_zeros(0), None, None, segment.end - 1, ids)
    lps, ents, firsts = score_rows(
        lm,
        [parent_hidden.reshape(1, -1)[:0]],
        [ids],
        segment.start,
        parent_hidden,
        walk.temperature,
        walk.entropies,
        [walk.first_scored(segment.node)],
        walk.entropy_grad,
        walk.head,
    )
    ent = ents[0] if walk.entropies else None
    return SegmentOutputs([], None, lps[0], ent, None, firsts[0], ids)


# ---------------------------------------------------------------------- rows: sibling leaves, packed subtrees
def _rows(lm: CausalLM, walk: Walk, step: SiblingLeaves | PackedSubtree, packed: bool) -> None:
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
        if len(segments) > 1 and packed:
            hiddens, routers = forward_packed(lm, walk, ids, start, step)
        else:
            hiddens, routers = forward_padded(lm, walk, ids, start, walk.inputs.layout(step))
        losses = [
            term
            for segment, r in zip(segments, routers, strict=True)
            for term in _route_rows(lm, walk, segment.node, r, top, lead)
        ]
        if walk.scoring:
            losses += _row_losses(lm, walk, step, hiddens, ids, start, lead)
    walk.peak.sample()  # (the stack's graphs and this call's: where the walk's memory peaks)
    if walk.grad and _backprop(losses, walk):
        walk.calls.backward += 1


def _row_losses(lm: CausalLM, walk: Walk, step, hiddens, ids, start: int, lead: int) -> list:
    """Score the rows of a leaves or subtree step (one LM-head call) and call ``on_sequence`` for each
    sequence that ends in it, with its log-probs along the stack and its ancestors in the row."""
    segments = step.segments
    parents = step.parents if isinstance(step, PackedSubtree) else (-1,) * len(segments)
    froms = [max(walk.first_scored(s.node), start if lead else 0) for s in segments]
    starts = [start] * len(segments) if lead else [s.start for s in segments]  # (lead: no subtree)
    above = [walk.parent_hidden() if p < 0 else hiddens[p][-1] for p in parents]
    lps, ents, firsts = score_rows(
        lm, hiddens, ids, starts, above, walk.temperature, walk.entropies, froms, walk.entropy_grad, walk.head
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


# ---------------------------------------------------------------------- pop
def _pop(lm: CausalLM, walk: Walk, frame: Frame, kept_graph: bool) -> None:
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
        out = _compute_segment(lm, walk, frame.segment)
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
