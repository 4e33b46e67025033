"""The tree executor: forward and backward of every sequence of a prefix trie, each shared prefix once.

The walk follows the plan of :mod:`trl_dta.plan`. A stack holds the segments of the current root-to-node
path; for each one it keeps the K/V the segment produced in every layer, its last hidden state (to score
its children's first tokens) and its tokens' log-probs. Descendants read these as *detached leaves*
(``requires_grad=True``), so whatever gradient a descendant sends into them accumulates in their ``.grad``:

* ``Push``: forward the segment on the stack's K/V; keep the autograd graph, or (chunked backward) forward
  without one and recompute it at pop.
* ``Leaves``: forward a batch of sibling leaves (packed into one row with a block-diagonal causal mask, or
  right-padded where the attention backend takes no custom mask), compute each finished sequence's loss from the log-probs along its path and backpropagate
  at once: into the parameters, and into the leaves of every segment on the stack.
* ``Pop``: backpropagate the segment's outputs with the gradients collected in its leaves, which continues
  into the parameters and into the leaves of the segments below it; then free it.

Because the loss of a sequence is a function of its own log-probs only, the sum of all these backward
calls is exactly ``sum_i loss_fn(i, logps_i, entropies_i).backward()`` over dense per-sequence forwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .causal_lm import CausalLM
from .model_checks import packed_inputs
from .plan import Leaves, Pop, Push, Segment, build_plan
from .trie import PrefixTrie

LossFn = Callable[[int, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def _leaf(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().requires_grad_(True)


@dataclass
class _Frame:
    """A segment on the stack: its outputs (graph tensors, or no-graph tensors to recompute) and the leaves
    that its descendants and its sequences' losses read."""

    segment: Segment
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    last_hidden: torch.Tensor  # [1, 1, D]
    logps: torch.Tensor  # [n scored tokens]
    entropies: torch.Tensor | None
    kv_leaf: list[tuple[torch.Tensor, torch.Tensor]]
    last_hidden_leaf: torch.Tensor
    logps_leaf: torch.Tensor
    entropies_leaf: torch.Tensor | None


class TreeExecutor:
    """Forward/backward of the sequences of a :class:`~trl_dta.PrefixTrie` through a causal LM.

    Args:
        model: a ``transformers`` causal LM that takes a KV cache (Llama, Mistral, Qwen2, Qwen3, ... families),
            plain or PEFT (LoRA) wrapped. Dropout must be off while it trains (it is checked at each call).
        block_size: most tokens forwarded with an autograd graph kept on the stack, and longest segment. Paths
            longer than that are walked with chunked backward (blocks forwarded without a graph, recomputed
            with one when popped); logits are never computed for more than a block (or a leaf batch) at once.
        batch_tokens: budget (rows x longest row, padding included) for forwarding sibling leaves together in
            one call on their shared prefix. ``None`` means ``block_size``; 0 forwards one leaf per call.
        lm_head_fp32: compute the LM head projection in float32 (TRL's ``cast_lm_head_to_fp32``).
        pack_leaves: forward a batch of sibling leaves as one packed row with a block-diagonal causal mask
            (no padding, the shared past not replicated per leaf) where the attention backend takes a custom
            mask (eager, sdpa) and the construction probe finds packing exact for the model (no attention
            window, no bias built from key indices such as ALiBi); otherwise, or with False, as a right-padded
            batch.

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
    ):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.lm = CausalLM(model, lm_head_fp32=lm_head_fp32)
        self.block_size = block_size
        self.batch_tokens = block_size if batch_tokens is None else batch_tokens
        self.pack_leaves = pack_leaves and self.lm.can_pack
        self.device = self.lm.decoder.get_input_embeddings().weight.device
        self.forward_calls = 0  # counters, for tests and metrics
        self.forward_tokens = 0

    # ------------------------------------------------------------------ public API
    @torch.no_grad()
    def logprobs(
        self, trie: PrefixTrie, temperature: float = 1.0, entropies: bool = False
    ) -> list[torch.Tensor] | tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-sequence log-probs ``lp[t] = log p(seq[t+1] | seq[:t+1])`` (length ``len(seq) - 1``), in input
        order, at ``temperature``; with ``entropies=True`` also the entropy of each of those distributions."""
        logps, ents = [None] * len(trie), [None] * len(trie)

        def record(index, lp, ent):
            logps[index], ents[index] = lp, ent

        self._walk(trie, temperature, entropies, record, grad=False)
        return (logps, ents) if entropies else logps

    def backward(
        self, trie: PrefixTrie, loss_fn: LossFn, temperature: float = 1.0, entropies: bool = False
    ) -> float:
        """Accumulate into the trainable parameters' ``.grad`` exactly what
        ``sum_i loss_fn(i, logps_i, entropies_i).backward()`` would with dense per-sequence forwards, and
        return that summed loss. ``loss_fn(index, logps, entropies)`` returns a scalar tensor for sequence
        ``index`` (``entropies`` is None unless ``entropies=True``); it may depend on all of the sequence's
        log-probs (sequence-level losses)."""
        total = []

        def on_loss(index, lp, ent):
            loss = loss_fn(index, lp, ent)
            if loss.dim() != 0:
                raise ValueError(f"loss_fn must return a scalar tensor, got shape {tuple(loss.shape)} for {index}")
            total.append(loss.detach())
            return loss

        self._walk(trie, temperature, entropies, on_loss, grad=True)
        return float(sum(t.detach().double() for t in total)) if total else 0.0

    # ------------------------------------------------------------------ the walk
    def _walk(self, trie: PrefixTrie, temperature: float, entropies: bool, on_sequence, grad: bool) -> None:
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.lm.check_call(trie.max_depth)
        stack: list[_Frame] = []
        with self.lm.no_gradient_checkpointing():
            for step in build_plan(trie, self.block_size, self.batch_tokens):
                if isinstance(step, Push):
                    frame = self._push(trie, step.segment, stack, temperature, entropies, grad and step.keep_graph)
                    stack.append(frame)
                    losses = [
                        on_sequence(i, *self._path_scores(stack, None, None)) for i in step.segment.terminals
                    ]
                    if grad:
                        self._backprop_losses(losses)
                elif isinstance(step, Leaves):
                    self._leaves(trie, step, stack, temperature, entropies, on_sequence, grad)
                elif isinstance(step, Pop):
                    frame = stack.pop()
                    if grad:
                        self._pop(trie, frame, step.keep_graph, stack, temperature, entropies)

    @staticmethod
    def _path_scores(stack, logps, ents):
        """A sequence's log-probs (and entropies) along the stack, then ``logps``/``ents`` of a leaf row."""
        lps = [f.logps_leaf for f in stack] + ([logps] if logps is not None else [])
        cat_lp = torch.cat(lps)
        if stack and stack[0].entropies_leaf is None:
            return cat_lp, None
        es = [f.entropies_leaf for f in stack] + ([ents] if ents is not None else [])
        return cat_lp, (torch.cat(es) if es else None)

    @staticmethod
    def _backprop_losses(losses: list[torch.Tensor]) -> None:
        losses = [loss for loss in losses if loss.requires_grad]
        if losses:
            torch.stack(losses).sum().backward()

    def _past(self, stack: list[_Frame], rows: int):
        if not stack:
            return None
        past = []
        for layer in range(self.lm.num_layers):
            k = torch.cat([f.kv_leaf[layer][0] for f in stack], dim=2)
            v = torch.cat([f.kv_leaf[layer][1] for f in stack], dim=2)
            past.append((k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1)))
        return past

    def _forward(self, ids: torch.Tensor, start: int, stack: list[_Frame]):
        self.forward_calls += 1
        self.forward_tokens += ids.numel()
        return self.lm.forward(ids, start, self._past(stack, ids.shape[0]))

    def _score(self, hiddens, ids, start, parent_hidden, temperature, entropies):
        """Log-probs (and entropies) of each row's tokens (``hiddens[r]``: [L_r, D], ``ids[r]``: [L_r]): the
        logits of position ``t`` score token ``t + 1``, and the parent's last hidden state scores the
        segment's first token (none at the root). One LM-head call for all rows."""
        if start == 0:
            inputs = [h[:-1] for h in hiddens]
            targets = [t[1:] for t in ids]
        else:
            inputs = [torch.cat([parent_hidden.reshape(1, -1), h[:-1]]) for h in hiddens]
            targets = list(ids)
        counts = [t.numel() for t in targets]
        if sum(counts) == 0:
            empty = hiddens[0].new_zeros(0, dtype=torch.float64 if hiddens[0].dtype == torch.float64 else torch.float32)
            return [empty] * len(ids), ([empty] * len(ids) if entropies else None)
        logp_all = torch.log_softmax(self.lm.logits(torch.cat(inputs), temperature), dim=-1)
        lp = logp_all.gather(-1, torch.cat(targets)[:, None]).squeeze(-1)
        ent = -(logp_all.exp() * logp_all).sum(-1) if entropies else None
        return list(lp.split(counts)), (list(ent.split(counts)) if entropies else None)

    def _segment_ids(self, trie: PrefixTrie, segment: Segment) -> torch.Tensor:
        tokens = trie.sequences[segment.node.seq][segment.start : segment.end]
        return torch.as_tensor(tokens, dtype=torch.long, device=self.device)

    def _compute_segment(self, trie, segment, stack, temperature, entropies):
        ids = self._segment_ids(trie, segment)[None]
        hidden, kv = self._forward(ids, segment.start, stack)
        parent_hidden = stack[-1].last_hidden_leaf if stack else None
        lps, ents = self._score([hidden[0]], [ids[0]], segment.start, parent_hidden, temperature, entropies)
        return kv, hidden[:, -1:], lps[0], (ents[0] if entropies else None)

    def _push(self, trie, segment, stack, temperature, entropies, with_graph) -> _Frame:
        with torch.set_grad_enabled(with_graph):
            kv, last_hidden, lp, ent = self._compute_segment(trie, segment, stack, temperature, entropies)
        return _Frame(
            segment, kv, last_hidden, lp, ent,
            kv_leaf=[(_leaf(k), _leaf(v)) for k, v in kv],
            last_hidden_leaf=_leaf(last_hidden),
            logps_leaf=_leaf(lp),
            entropies_leaf=_leaf(ent),
        )  # fmt: skip

    def _leaves(self, trie, step: Leaves, stack, temperature, entropies, on_sequence, grad) -> None:
        segments = step.segments
        ids = [self._segment_ids(trie, s) for s in segments]
        start = segments[0].start
        parent_hidden = stack[-1].last_hidden_leaf if stack else None
        with torch.set_grad_enabled(grad):
            if len(segments) > 1 and self.pack_leaves:
                hiddens = self._forward_packed(ids, start, stack)
            else:
                hiddens = self._forward_padded(ids, start, stack)
            lps, ents = self._score(hiddens, ids, start, parent_hidden, temperature, entropies)
            losses = []
            for row, segment in enumerate(segments):
                path_lp, path_ent = self._path_scores(stack, lps[row], ents[row] if entropies else None)
                losses += [on_sequence(i, path_lp, path_ent) for i in segment.terminals]
        if grad:
            self._backprop_losses(losses)

    def _forward_padded(self, ids, start, stack):
        """Sibling leaves as a right-padded batch (causal attention keeps padding invisible to real tokens)."""
        lengths = [t.numel() for t in ids]
        batch = torch.zeros(len(ids), max(lengths), dtype=torch.long, device=self.device)
        for row, t in enumerate(ids):
            batch[row, : lengths[row]] = t
        hidden, _ = self._forward(batch, start, stack)
        return [hidden[row, :n] for row, n in enumerate(lengths)]

    def _forward_packed(self, ids, start, stack):
        """Sibling leaves packed into one row: each token attends the shared past and the earlier tokens of
        its own leaf (a block-diagonal causal mask), and positions restart at ``start`` for every leaf. No
        padding, and the past K/V is not replicated per leaf."""
        lengths = [t.numel() for t in ids]
        positions, mask = packed_inputs(lengths, start, self.lm.lm_head.weight.dtype, self.device)
        self.forward_calls += 1
        self.forward_tokens += sum(lengths)
        hidden, _ = self.lm.forward(
            torch.cat(ids)[None], start, self._past(stack, 1), positions=positions, attention_mask=mask
        )
        return list(hidden[0].split(lengths))

    def _pop(self, trie, frame: _Frame, kept_graph: bool, stack, temperature, entropies) -> None:
        pairs = [(out, leaf) for (k, v), (kl, vl) in zip(frame.kv, frame.kv_leaf) for out, leaf in ((k, kl), (v, vl))]
        pairs += [
            (frame.last_hidden, frame.last_hidden_leaf),
            (frame.logps, frame.logps_leaf),
            (frame.entropies, frame.entropies_leaf),
        ]
        if not any(leaf is not None and leaf.grad is not None for _, leaf in pairs):
            return
        if not kept_graph:  # chunked backward: recompute the segment, this time with a graph
            kv, last_hidden, lp, ent = self._compute_segment(trie, frame.segment, stack, temperature, entropies)
            outs = [t for pair in kv for t in pair] + [last_hidden, lp, ent]
            pairs = [(out, leaf) for out, (_, leaf) in zip(outs, pairs)]
        outs, grads = [], []
        for out, leaf in pairs:
            if leaf is not None and leaf.grad is not None and out.requires_grad:
                outs.append(out)
                grads.append(leaf.grad)
        if outs:
            torch.autograd.backward(outs, grads)
