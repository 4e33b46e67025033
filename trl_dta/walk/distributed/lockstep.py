"""Per-layer gathering across ranks (FSDP2, ``gather_per_layer=True``): every rank makes the same collectives.

In the per-layer mode (:mod:`trl_dta.walk.distributed.sharding`) FSDP2 gathers a decoder layer for each
forward and each backward call through it, and reduce-scatters its gradients after each backward call. Those
are collectives: every rank must make them in the same order. But each rank walks its own trie, so ranks make
different calls. The lock-step makes them agree:

* **Rounds.** Every plan step is one round: exactly one forward call, then (in a gradient walk) exactly one
  backward call through the model. A rank whose step has no forward (a pop whose graph was kept) or no
  backward (a push) makes a dummy call of two tokens in its place: a no-grad forward through the decoder, or
  a zero backward through a graph kept for the purpose (``retain_graph``). Ranks with fewer steps make dummy
  rounds at the end; then one more zero backward on every rank, with the root's set's gradient sync on,
  reduces what the root's set (root, embeddings, norm, LM head) accumulated through the walk: it reduces
  nothing before, since the LM head's unit would reduce inside the backward calls that reach it and at the
  end of the others, in an order that differs between ranks. Dummy calls add zero gradients.
* **Same collectives in a round.** A forward gathers the layers in order. A backward gathers and reduces
  them from the last layer down (autograd runs the nodes created last first). Two things would make a
  rank's backward differ from another's, and both are removed: FSDP2's implicit backward prefetch (its
  target depends on each rank's call history; it is switched off) and gradients that enter a layer through
  its K/V or states rather than its output, where FSDP2's pre-backward hook never fires (a hook on those
  tensors gathers the layer). Every round ends with the layers resharded.

The cost: up to twice the calls of the rank with the most steps, each gathering every layer, plus one
reduce-scatter per layer and backward call. It buys memory: one layer's parameters and gradients at a time.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


class Lockstep:
    """A walk's calls, padded into rounds (module docstring). Without per-layer gathering across ranks it is
    inactive and only runs the backward calls."""

    def __init__(
        self, decoder: nn.Module | None = None, layers: list | None = None, device=None, pad=False, roots=None
    ):
        self.decoder, self.device = decoder, device  # decoder: None when nothing is gathered per layer
        self.layers = layers or []  # the FSDP2 unit of each decoder layer (None: gathered with the root)
        self.roots = roots or []  # the root's set of units: gathered through the walk, reduced at its end
        self.pad = pad  # several ranks: pad the calls into rounds
        self.forwards = self.backwards = 0
        self.grad = False
        self._graph = None  # the dummy graph, for dummy backward calls

    @property
    def active(self) -> bool:
        return self.decoder is not None

    def start(self, steps: int, grad: bool) -> None:
        """Agree on the number of rounds (the most steps of any rank); keep a dummy graph for backward."""
        if not self.active:
            return
        self.steps = self.rounds = steps
        self.grad = grad
        if self.pad:
            import torch.distributed as dist

            count = torch.tensor([steps], device=self.device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
            self.rounds = int(count)
        if grad:
            with torch.enable_grad():
                self._graph = self._dummy_forward()
        self._reshard()

    def _dummy_forward(self) -> torch.Tensor:
        ids = torch.zeros(1, 2, dtype=torch.long, device=self.device)
        return self.decoder(input_ids=ids, use_cache=False).last_hidden_state

    def _dummy_backward(self) -> None:
        torch.autograd.backward(self._graph, torch.zeros_like(self._graph), retain_graph=True)

    def _reshard(self) -> None:
        for unit in dict.fromkeys(u for u in self.layers if u is not None):
            unit.reshard()

    def forward(self, caches) -> None:
        """A forward call of the walk; ``caches``: what it left per layer (its K/V and states). Gradients that
        reach a layer through them must find the layer gathered."""
        self.forwards += 1
        if not self.active or not torch.is_grad_enabled():
            return
        for unit, layer in zip(self.layers, caches, strict=False):
            if unit is None:
                continue
            for t in layer.values():
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda grad, unit=unit: (unit.unshard(), grad)[1])

    def backward(self, outputs, grads=None) -> None:
        """A backward call through the model (after a dummy forward if the round has had none)."""
        if self.pad and self.forwards == 0:
            self.forwards += 1
            with torch.no_grad():
                self._dummy_forward()
        self.backwards += 1
        torch.autograd.backward(outputs, grads)

    @contextlib.contextmanager
    def round(self):
        """One plan step: at most one forward and one backward, padded to exactly one of each."""
        self.forwards = self.backwards = 0
        yield
        if not self.pad:
            if self.active:
                self._reshard()
            return
        if self.forwards > 1 or self.backwards > 1:
            raise RuntimeError(
                "gather_per_layer across ranks needs at most one forward and one backward call per walk step "
                "(a loss_fn that walks another trie is not supported in this mode)."
            )
        self._pad()

    def _pad(self) -> None:
        if self.forwards == 0:
            with torch.no_grad():
                self._dummy_forward()
        if self.grad and self.backwards == 0:
            self._dummy_backward()
        self._reshard()

    def finish(self) -> None:
        """Dummy rounds up to the agreed number, a last zero backward (the LM head's gradients), free the
        dummy graph."""
        if self.active:
            for _ in range(self.rounds - self.steps):
                self.forwards = self.backwards = 0
                self._pad()
            if self.grad:
                for unit in self.roots:  # their gradients, accumulated through the walk, reduced now
                    unit.set_requires_gradient_sync(True, recurse=False)
                self._dummy_backward()
                self._reshard()
        self._graph = None
