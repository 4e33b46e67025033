"""What a model call costs, so that the plan can decide which calls to merge.

One forward + backward call of the walk costs about::

    seconds = fixed + per_token x tokens + per_pair x attention pairs computed

* ``fixed``: per decoder layer, the host's cost of a call whatever its size (kernel launches on a GPU,
  Python and dispatch on a CPU): :data:`DEVICE_COSTS`;
* ``per_token``: the decoder's matmuls, ``6 x`` the parameters a token runs through (forward + backward),
  at the device's FLOP rate (the LM head scores the same positions however calls are cut: left out);
* ``per_pair``: attention, ``12 x`` the query width per query-key pair and layer, for the pairs the walk's
  attention kernel computes in a packed row (:meth:`~trl_dta.walk.attention.kernel.AttentionKernel.pairs`):
  the model's own attention with a dense additive mask (eager) every pair of its ``tokens x (past + tokens)``
  rectangle, masked or not (also the price of a call with no kernel given); flex attention's block-sparse
  mask the tiles that hold a visible pair, about what the tree needs plus a tile's width per row; a flash
  varlen kernel the pairs the tree needs; sdpa per segment those where splitting the row pays, else the
  rectangle.

Merging two calls saves one ``fixed`` and, with a dense mask, costs the pairs between them that the mask
hides (per segment, nothing). A GPU's launches are expensive next to its FLOPs: it merges far more than a CPU
does.

On a CPU the host computes: a walk costs the sum of its calls' costs (what ``benchmarks/call_costs.py``
fitted, and the plan measured fastest there). On a GPU the host launches the next kernels while the device
computes the ones queued before (the walk has no host sync inside: :mod:`trl_dta.walk.inputs`), so a walk
takes about the larger of its summed ``fixed`` and its summed compute (``overlap``, :meth:`CallCost.walk`):
once the compute hides the launches, merging more only adds the masked pairs. The plan therefore weighs
``fixed`` by a ``launch_price`` in its merge decisions and keeps the fastest walk over several prices
(:func:`trl_dta.walk.plan.build_plan`); ``benchmarks/launch_model.py`` checks the result on paper
(docs/benchmarks.md, "The GPU plan on paper").
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ...trie import TrieNode

if TYPE_CHECKING:  # (annotations only)
    from ..attention.kernel import AttentionKernel


@dataclass(frozen=True)
class DeviceCosts:
    """What a model call costs on a device kind (:class:`CallCost` turns it into seconds per call for a given
    model): a fixed host cost per decoder layer and call (kernel launches on a GPU, Python and
    dispatch on a CPU), the rate at which it runs FLOPs, the call size past which larger calls no longer
    pay, and whether the host's cost overlaps the device's compute (a GPU runs the kernels the host queued
    while the host launches the next ones; a CPU computes on the host's own threads)."""

    layer_call_s: float  # seconds per decoder layer per forward + backward call, whatever its size
    flop_rate: float  # FLOP/s of the decoder's matmuls and attention
    max_call_tokens: int
    overlap: bool = False


# Per device kind. CUDA: the host's cost of a decoder layer's forward + backward call as the first GPU run
# measured it (one H200, 2026-12-04: benchmarks/call_costs.py, 4.48 ms whatever the call's size; the walk
# times of docs/gpu-2026-12-04.json predicted within 20% by it, tests/test_memory_model.py; the launch
# model's 182 kernels at 5 µs, 0.91 ms, had predicted 0.08-0.14x of the measured steps); FLOPs at 40% of an
# H200's 989 TFLOP/s bf16 peak (not measured yet in bf16). CPU: fitted on the project's 2-core machine by
# benchmarks/call_costs.py (docs/benchmarks.md, "Call sizes").
DEVICE_COSTS = {
    "cuda": DeviceCosts(layer_call_s=4.5e-3, flop_rate=0.4 * 989e12, max_call_tokens=1 << 16, overlap=True),
    # fitted 2026-12-01 (SmolLM2-wide 8-layer Llama, fp32, 2 threads): 1.8 ms per layer-call, 1.6e11 FLOP/s
    "cpu": DeviceCosts(layer_call_s=1.8e-3, flop_rate=1.6e11, max_call_tokens=2048),
}


def device_costs(device_type: str) -> DeviceCosts:
    """The constants of ``device_type``; an unknown accelerator gets CUDA's."""
    return DEVICE_COSTS.get(device_type, DEVICE_COSTS["cuda"])


def needed_pairs(nodes) -> int:
    """Query-key pairs the tree needs for ``nodes`` (trie nodes, or segments with ``start``/``end``): each
    token attends every token before it on its path."""
    total = 0
    for n in nodes:
        length = n.end - n.start
        total += length * n.start + length * (length + 1) // 2
    return total


@dataclass(frozen=True)
class CallCost:
    """Seconds of one forward + backward call of a given model on a given device kind (module docstring).

    ``kernel``: the walk's attention kernel (resolved: :meth:`~trl_dta.walk.adapter.model.CausalLM.
    walk_kernel`), which says the pairs a packed call computes (None: its rectangle). ``overlap``: the device
    computes while the host launches (a GPU): a walk then takes about the larger of its calls' summed
    ``fixed`` and summed compute (:meth:`walk`), not their sum. ``launch_price``: the
    weight of ``fixed`` against compute in the merge decisions of :meth:`row` and :meth:`padded` (1: their
    sum; :func:`trl_dta.walk.plan.build_plan` searches it where costs overlap)."""

    fixed: float
    per_token: float
    per_pair: float
    kernel: AttentionKernel | None = None
    overlap: bool = False
    launch_price: float = 1.0

    @classmethod
    def for_model(cls, config, device_type: str, kernel: AttentionKernel | None = None) -> CallCost:
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        device = device_costs(device_type)
        d, heads = config.hidden_size, getattr(config, "num_attention_heads", None) or 0  # (0: state models)
        head_dim = getattr(config, "head_dim", None) or (d // heads if heads else 0)
        q = heads * head_dim
        kv = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
        inner = getattr(config, "intermediate_size", None) or 4 * d
        experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
        if experts:
            inner = (getattr(config, "num_experts_per_tok", None) or 1) * (
                getattr(config, "moe_intermediate_size", None) or inner
            )
        layers = config.num_hidden_layers
        params = 2 * d * q + 2 * d * kv + 3 * d * inner  # per layer: attention projections, gated MLP
        return cls(
            fixed=device.layer_call_s * layers,
            per_token=6 * params * layers / device.flop_rate,
            per_pair=12 * q * layers / device.flop_rate,
            kernel=kernel,
            overlap=device.overlap,
        )

    def priced(self, launch_price: float) -> CallCost:
        """The same costs, with ``fixed`` weighed by ``launch_price`` in merge decisions."""
        return replace(self, launch_price=launch_price)

    def row_pairs(self, past: int, tokens: int, needed: int) -> int:
        """The query-key pairs one packed call computes: ``tokens`` on a past of ``past`` tokens, the tree
        needing ``needed`` of them (the fitted model, :mod:`trl_dta.walk.cost.cost_fit`, counts the same)."""
        rectangle = tokens * (past + tokens)
        return rectangle if self.kernel is None else min(self.kernel.pairs(past, tokens, needed), rectangle)

    def row_compute(self, past: int, tokens: int, needed: int) -> float:
        """The device's seconds for one call forwarding ``tokens`` packed tokens on a past of ``past`` tokens,
        the tree needing ``needed`` of their query-key pairs."""
        return self.per_token * tokens + self.per_pair * self.row_pairs(past, tokens, needed)

    def padded_compute(self, past: int, rows: int, width: int) -> float:
        """The device's seconds for one call forwarding ``rows`` right-padded rows of ``width`` tokens."""
        return rows * (self.per_token * width + self.per_pair * width * (past + width))

    def row(self, past: int, tokens: int, needed: int) -> float:
        """One packed call, priced for merge decisions: ``launch_price x fixed`` + its compute."""
        return self.launch_price * self.fixed + self.row_compute(past, tokens, needed)

    def padded(self, past: int, rows: int, width: int) -> float:
        """One call of right-padded rows, priced for merge decisions."""
        return self.launch_price * self.fixed + self.padded_compute(past, rows, width)

    def walked(self, nodes: list[TrieNode]) -> float:
        """The walk of a subtree (``nodes``) node by node: a call per node, each on its own path."""
        return sum(self.row(n.start, n.num_tokens, needed_pairs([n])) for n in nodes)

    def walk(self, calls: float, compute: float) -> float:
        """Seconds of a walk of ``calls`` forward + backward calls computing for ``compute`` seconds: the
        larger of the host's and the device's where they overlap, else their sum."""
        launch = calls * self.fixed
        return max(launch, compute) if self.overlap else launch + compute
