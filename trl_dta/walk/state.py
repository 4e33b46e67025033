"""What one walk keeps while it runs: its inputs, the path's K/V and the stack of frames.

A :class:`Walk` is built at the start of each :class:`~trl_dta.walk.executor.TreeExecutor` call and passed
down; nothing of it is stored on the executor, so two walks (a loss that walks another trie on the same
executor, say) never see each other's state.

A :class:`Frame` is a segment on the stack. Descendants read its outputs through *handles*: detached copies
with ``requires_grad=True`` (autograd leaves; "leaf" alone always means a trie leaf here), so whatever
gradient a descendant sends into them accumulates in their ``.grad``, which the segment's pop
backpropagates. Its K/V are read (and their gradients collected) in the walk's
:class:`~trl_dta.walk.path_kv.PathKV` instead.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..trie import PrefixTrie, TrieNode
from .adapter.cache import KV, LayerCache, expand_states, states_of
from .distributed.lockstep import Lockstep
from .heads import Head, LogProbs
from .inputs import WalkInputs
from .memory.peak import PeakMemory
from .path_kv import PathKV
from .plan import Segment
from .router import RouterGrad, RouterStats

# on_sequence(index, logps, entropies): called once per sequence with its log-probs (and entropies, or
# None); in a gradient walk it returns the sequence's loss, which the walk backpropagates
OnSequence = Callable[[int, torch.Tensor, "torch.Tensor | None"], "torch.Tensor | None"]


def handle(t: torch.Tensor | None) -> torch.Tensor | None:
    """A segment output's handle: a detached copy (an autograd leaf) that descendants read and whose
    ``.grad`` collects their gradients. Half-precision outputs (bf16 autocast) get a float32 handle, so the
    gradients of many children sum in float32."""
    if t is None:
        return None
    t = t.detach()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.float()
    return t.requires_grad_(True)


def flat_outputs(caches: list[LayerCache], last_hidden, logps, entropies) -> list[torch.Tensor | None]:
    """A segment's outputs that descendants read through handles, in one fixed order (each layer's states by
    name, last hidden state, log-probs, entropies): the order :meth:`Frame.outputs` and :meth:`Frame.handles`
    share. K/V are not among them (they live in the walk's PathKV)."""
    states = [layer[k] for layer in caches for k in sorted(layer) if k not in KV]
    return states + [last_hidden, logps, entropies]


class SegmentOutputs(NamedTuple):
    """What forwarding one segment gives (:func:`trl_dta.walk.steps._compute_segment`)."""

    caches: list[LayerCache]  # per layer: its K/V [1, kv_heads, L, head_dim] and/or its final states
    last_hidden: torch.Tensor | None  # [1, 1, D]; None for a pending segment
    logps: torch.Tensor  # [n scored tokens]
    entropies: torch.Tensor | None
    router_term: torch.Tensor | None  # MoE: the segment's <v, softmax(router logits)> sum, with graph
    lp_from: int  # log-prob index of logps[0]
    pending: torch.Tensor | None  # state models: the token ids of a one-token segment not forwarded alone


@dataclass
class Frame:
    """A segment on the stack: its outputs (graph tensors, or no-graph tensors to recompute) and their
    handles, which its descendants and its sequences' losses read."""

    segment: Segment
    caches: list[LayerCache]
    last_hidden: torch.Tensor | None
    logps: torch.Tensor
    entropies: torch.Tensor | None
    states_in: list[LayerCache]  # handles of the caches' states (K/V: in the walk's PathKV)
    last_hidden_in: torch.Tensor | None
    logps_in: torch.Tensor
    entropies_in: torch.Tensor | None
    lp_from: int  # log-prob index of logps[0]: the segment scores lp indices [lp_from, segment.end - 1)
    kv_from: int  # cache position of its forward's first token (its K/V: [kv_from, segment.end))
    router_term: torch.Tensor | None = None
    # state models: a one-token segment is not forwarded on its own (see steps._compute_segment); its
    # token ids, forwarded at the head of each child's forward instead. No caches, no last hidden state.
    pending: torch.Tensor | None = None
    routed: bool = False  # MoE: a child's forward has already routed the pending token

    @classmethod
    def pushed(
        cls, segment: Segment, out: SegmentOutputs, kv_from: int, with_graph: bool, entropy_grad: bool = True
    ) -> Frame:
        return cls(
            segment,
            out.caches,
            out.last_hidden,
            out.logps,
            out.entropies,
            states_in=[{k: handle(t) for k, t in layer.items()} for layer in states_of(out.caches)],
            last_hidden_in=handle(out.last_hidden),
            logps_in=handle(out.logps),
            entropies_in=handle(out.entropies) if entropy_grad else out.entropies,  # (values only: no handle)
            lp_from=out.lp_from,
            kv_from=kv_from,
            router_term=out.router_term if with_graph else None,
            pending=out.pending,
        )

    def outputs(self) -> list[torch.Tensor | None]:
        return flat_outputs(self.caches, self.last_hidden, self.logps, self.entropies)

    def handles(self) -> list[torch.Tensor | None]:
        return flat_outputs(self.states_in, self.last_hidden_in, self.logps_in, self.entropies_in)


@dataclass
class CallCounts:
    """Model calls made by an executor's walks, cumulative: forwards, the backward calls through the model
    (a leaf batch's or a popped segment's; not the handle-only backward of a pushed segment's finished
    sequences), the token positions forwarded (padding included), and the forwards each attention kernel
    attended (:mod:`trl_dta.walk.attention.kernel`)."""

    forward: int = 0
    backward: int = 0
    tokens: int = 0
    attention: Counter = field(default_factory=Counter)  # forwards per attention kernel (its name)


@dataclass
class Walk:
    """One call's walk: what it computes, for which sequences, and the path it is on."""

    trie: PrefixTrie
    temperature: float
    entropies: bool  # compute entropies beside log-probs
    grad: bool  # backpropagate the losses on_sequence returns
    on_sequence: OnSequence
    kv: PathKV
    seq_from: list[int]  # per sequence, its first scored log-prob index
    node_from: dict[TrieNode, int] | None  # per node, the smallest over its sequences (None: all from 0)
    router: RouterGrad | RouterStats | None = None  # MoE: router terms to backpropagate, or to count
    scoring: bool = True  # False: no LM head at all (the router-counting pass)
    calls: CallCounts = field(default_factory=CallCounts)  # counted into the executor's
    lockstep: Lockstep = field(default_factory=Lockstep)  # runs the backward calls through the model
    stack: list[Frame] = field(default_factory=list)
    entropy_grad: bool = True  # entropies carry a graph (False: values only)
    inputs: WalkInputs | None = None  # every call's ids and packed-row index tensors, on the device
    peak: PeakMemory = field(default_factory=lambda: PeakMemory(torch.device("meta")))  # memory at its peaks
    head: Head = field(default_factory=LogProbs)  # what a scored position gives (trl_dta/walk/heads.py)

    def first_scored(self, node: TrieNode) -> int:
        return 0 if self.node_from is None else self.node_from[node]

    def pending(self) -> Frame | None:
        """The top frame if it is a pending one-token segment (state models), else None."""
        return self.stack[-1] if self.stack and self.stack[-1].pending is not None else None

    def parent_hidden(self) -> torch.Tensor | None:
        """The top segment's last hidden state (its handle), which scores a child's first token."""
        return self.stack[-1].last_hidden_in if self.stack else None

    def states(self, rows: int) -> list[LayerCache] | None:
        """The states the last forwarded segment left (their handles), expanded to ``rows`` rows (no copy):
        a forward starts from them (and attends to the path's K/V in :attr:`kv`)."""
        for frame in reversed(self.stack):
            if frame.pending is None:
                return expand_states(frame.states_in, rows)
        return None
