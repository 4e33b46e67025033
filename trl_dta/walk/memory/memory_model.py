"""The walk's memory model: the bytes a walk holds per token, and the token budgets that fit a memory budget.

Memory model, per optimizer step's walk (bytes)::

    peak = position x (path + call)                        # path K/V and its float32 gradient
         + (token + scored) x block                        # the stack's graphs
         + (token + scored) x call + transient x head_rows # the running call, its LM-head transients
         + key x gathered keys                             # attention per segment: each segment's keys
         + fixed                                           # autocast's weight copies

``path`` is the trie's longest path above a leaf (unknown: ``block``). ``scored`` counts the LM head's saved
log-softmax (and the entropy's, when it has a gradient) for every token, as if every token were scored: an
upper bound for prompts the loss does not read. A call that attends per segment
(:mod:`trl_dta.walk.attention.segment_attention`) through sdpa keeps a copy of every segment's keys (its
path's K/V up to its end) for the backward: the plan counts them against the call's budget (``key_weight``);
a flash varlen kernel (CUDA) recomputes them in the backward instead (what each kernel keeps:
:meth:`~trl_dta.walk.attention.kernel.AttentionKernel.kept_bytes`). Under autocast over
float32 weights (TRL's bf16 mixed precision), the residual stream stays float32 and each linear layer keeps
its own low-precision copy of its input (``autocast``: 11 bytes per hidden unit and layer more, and a float32
K, measured on CPU with ``SavedTensorMeter``), and autocast keeps a low-precision copy of every trainable
weight while the walk runs (``fixed``). :func:`plan_peak` applies the same bytes to a plan, step by step
(checked against what a GPU measured: ``tests/test_memory_model.py``, docs/memory.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..adapter.checks import check_count
from ..attention.sdpa import SDPA_SEGMENTS
from ..cost.costs import device_costs
from ..heads import HEAD_ROWS, LogProbs
from ..plan import Pop, Push, Step, capacity

MIN_CALL_TOKENS = 512  # below this, calls are too small to keep a GPU busy: rather recompute


@dataclass(frozen=True)
class TokenBudgets:
    """The walk's token budgets, named as :class:`~trl_dta.walk.executor.TreeExecutor`'s arguments:
    ``TreeExecutor(model, **vars(budgets))``."""

    block_size: int
    batch_tokens: int
    subtree_tokens: int

    def halved(self) -> TokenBudgets:
        """Each budget halved (the block at least 1 token)."""
        return TokenBudgets(max(1, self.block_size // 2), self.batch_tokens // 2, self.subtree_tokens // 2)


# Without a memory budget (None, or "auto" off CUDA): the budgets measured fastest on a 2-core CPU.
FIXED = TokenBudgets(block_size=2048, batch_tokens=2048, subtree_tokens=512)


@dataclass(frozen=True)
class ActivationBytes:
    """Bytes the walk holds per token (:func:`activation_bytes`)."""

    token: float  # decoder: what autograd saves per token forwarded with a graph (K/V excluded)
    scored: float  # LM head: what autograd saves per scored token (log-softmax, entropy)
    transient: float  # LM head: logits and their gradients alive while a call scores a row
    position: float  # the path's K/V and their float32 gradients, per cache position
    key: float = 0.0  # attention per segment: a gathered key position's K and V in every layer

    def key_weight(self) -> float:
        """A gathered key position in tokens of a call (what the plan counts it as against a budget)."""
        return self.key / (self.position + self.token + self.scored)


def _width(config, name: str, default: int) -> int:
    value = getattr(config, name, None)
    return int(value) if value else default


def _has_qk_norm(config) -> bool:
    """Whether attention normalises queries and keys per head (Qwen3, OLMo-2, Gemma-3: two more norms)."""
    return config.model_type.split("_")[0] in ("qwen3", "olmo2", "olmo3", "gemma3", "cohere2")


def activation_bytes(
    config,
    dtype: torch.dtype,
    entropy_grad: bool = True,
    outputs: int | None = None,
    autocast: bool = False,
    head=None,
) -> ActivationBytes:
    """Per-token bytes of a walk through a model of ``config`` (a ``transformers`` config; multimodal ones
    give their text config) in ``dtype``, counted as PyTorch's autograd saves them in a pre-norm decoder
    layer (RMSNorm, attention, gated MLP; MoE: the routed experts' share):

    * each RMSNorm of width ``w``: its float32 input (``4w``), normalised value and output (``2 e w``);
    * per-head q/k norms where the model has them (``(4 + e)`` per element), the rotated queries and the
      attention output (``2 e q``), the log-sum-exp (``4`` per head);
    * gated MLP: gate, activation, up and product (``4 e i``);
    * K/V: in the path buffer (``position``), ``2 e kv`` per layer, with a float32 gradient ``8 kv``.

    The LM head saves its float32 log-softmax (``4 V`` per scored token, ``8 V`` when entropies have a
    gradient) and, while a call scores its rows, the logits and their gradient (``8 V``). ``outputs``: the
    head's width ``V`` where it is not the vocabulary (1: a value model's head). ``autocast``: ``dtype`` is
    autocast's over float32 weights (module docstring: ``11 d + kv`` more per layer, a float32 K). ``head``:
    the walk's :class:`~trl_dta.walk.heads.Head` (default: log-probs), which says what it keeps per scored
    position and per row of its chunk."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    e = torch.empty((), dtype=dtype).element_size()
    d = config.hidden_size
    heads = getattr(config, "num_attention_heads", None) or 0  # (0: a state-space model)
    head_dim = _width(config, "head_dim", d // heads if heads else 0)
    q = heads * head_dim
    kv = _width(config, "num_key_value_heads", heads) * head_dim
    inner = _width(config, "intermediate_size", 4 * d)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if experts:  # the experts each token is routed to, and the shared ones
        top_k = _width(config, "num_experts_per_tok", 1)
        inner = top_k * _width(config, "moe_intermediate_size", inner)
        inner += _width(config, "shared_expert_intermediate_size", 0)
    norm = lambda w: 4 * w + 2 * e * w  # noqa: E731
    layer = 2 * norm(d) + 2 * e * q + 4 * heads + 4 * e * inner
    if _has_qk_norm(config):
        layer += (4 + e) * (q + kv)
    layers = config.num_hidden_layers
    vocab = config.vocab_size if outputs is None else outputs
    if autocast:  # (float32 norms and residual, a copy of each linear's input per linear; measured)
        layer += 11 * d + kv
    token = layers * layer + norm(d) + 8  # the final norm, the token id
    head = head or LogProbs()
    scored = head.scored_bytes(vocab, d, e, entropy_grad)  # (log-probs: the log-softmax, entropy, input)
    position = layers * kv * ((4 if autocast else e) + e + 8)  # K, V (K float32 under autocast), gradients
    return ActivationBytes(token, scored, head.chunk_bytes(vocab), position, key=layers * 2 * kv * e)


def token_budgets(
    config,
    dtype: torch.dtype,
    memory_bytes: float,
    device_type: str = "cuda",
    path_tokens: int | None = None,
    entropy_grad: bool = True,
    outputs: int | None = None,
    autocast: bool = False,
    fixed_bytes: float = 0.0,
    head=None,
) -> TokenBudgets:
    """The token budgets a walk through a model of ``config`` in ``dtype`` may use within ``memory_bytes``
    of activation memory on a ``device_type`` ("cuda", "cpu", ...), by the priorities of the module
    docstring. ``path_tokens``: the most tokens on any path above a leaf (the executor passes its trie's;
    the path's K/V are held for all of them); unknown, the memory is split 2:1 between the stack and the
    call. ``outputs``, ``autocast``, ``head``: as in :func:`activation_bytes`; ``fixed_bytes``: held
    whatever the budgets (autocast's weight copies). Pure: no device is touched, so a CPU can show what a
    GPU would pick."""
    if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, int | float) or not memory_bytes > 0:
        raise ValueError(f"memory_bytes must be a positive number of bytes, got {memory_bytes!r}")
    if path_tokens is not None:
        path_tokens = check_count("path_tokens", path_tokens)
    per = activation_bytes(config, dtype, entropy_grad, outputs, autocast, head)
    costs = device_costs(device_type)
    stack = per.token + per.scored + (per.position if path_tokens is None else 0)  # per token on the stack
    call = per.position + per.token + per.scored  # per token of the running call
    room = memory_bytes - per.transient * HEAD_ROWS - fixed_bytes - per.position * (path_tokens or 0)
    if room < (stack + call) * 2:
        raise ValueError(
            f"memory budget {memory_bytes / 2**30:.2f} GiB is too small for the walk of this model "
            f"({(stack + call + per.transient * HEAD_ROWS + fixed_bytes) / 2**20:.0f} MiB for one token on "
            "the stack and one in a call, with the LM head's working space and autocast's weight copies, "
            f"beside {per.position * (path_tokens or 0) / 2**20:.0f} MiB of the path's K/V)"
        )
    block = None
    if path_tokens is not None and room - stack * path_tokens >= call * MIN_CALL_TOKENS:
        block = max(1, path_tokens)
    if block is None:
        block = max(1, int(room * 2 / 3 / stack))
    calls = max(1, min(int((room - stack * block) / call), costs.max_call_tokens))
    return TokenBudgets(block_size=block, batch_tokens=calls, subtree_tokens=calls)


def activation_dtype(lm) -> torch.dtype:
    """The activations' dtype of a walk through ``lm`` (a :class:`~trl_dta.walk.adapter.model.CausalLM`):
    autocast's where it is on, else the LM head's weights'."""
    if torch.is_autocast_enabled(lm.device.type):
        return torch.get_autocast_dtype(lm.device.type)
    return lm.lm_head.weight.dtype


def autocast_copies(lm) -> tuple[bool, float]:
    """Whether a walk through ``lm`` runs under autocast over wider weights (float32 master weights in
    bf16/fp16 mixed precision), and the bytes of the low-precision copies autocast keeps of its trainable
    weights for the walk's duration (each matrix cast once and cached)."""
    if not torch.is_autocast_enabled(lm.device.type):
        return False, 0.0
    low = torch.get_autocast_dtype(lm.device.type)
    size = torch.empty((), dtype=low).element_size()
    wider = [p for p in lm.model.parameters() if p.requires_grad and p.dim() >= 2 and p.element_size() > size]
    return bool(wider), float(sum(p.numel() for p in wider) * size)


class PlanPeak(NamedTuple):
    """:func:`plan_peak`'s estimate (bytes): ``total`` = ``graphs`` (the stack's and the running call's, at
    the plan's step where they peak) + ``path_kv`` (the path's K/V buffer and gradients, ``capacity``
    positions) + ``head`` (the LM head's transients)."""

    total: float
    graphs: float
    path_kv: float
    head: float
    capacity: int


def plan_peak(plan: list[Step], config, per: ActivationBytes, scored_from, kernel=SDPA_SEGMENTS) -> PlanPeak:
    """The activation memory a walk of ``plan`` peaks at, by ``per`` (:func:`activation_bytes`), step by
    step: each push kept with its graph adds its tokens to the stack until its pop; each call adds its own
    (and a push recomputed at pop, its tokens again) on top of the stack. ``scored_from``: per trie node, its
    first scored log-prob index (``trl_dta.walk.scoring.scored_from``'s second value; None: every token).
    ``kernel``: the walk's attention kernel, which says what a call keeps beyond its tokens'
    (:meth:`~trl_dta.walk.attention.kernel.AttentionKernel.kept_bytes`: sdpa per segment a packed row's
    gathered keys, the model's own sdpa with a mask its repeated K/V heads and mask, a flash kernel nothing).
    Autocast's weight copies are the caller's (:func:`autocast_copies`)."""

    def scored(s) -> int:
        first = 0 if scored_from is None else scored_from[s.node]
        return max(0, (s.end - 1) - max(s.start - 1, first, 0))

    def call(segments, row: bool) -> float:
        size = sum(s.num_tokens for s in segments) * per.token + sum(scored(s) for s in segments) * per.scored
        return size + kernel.kept_bytes(segments, row, per, config)

    stack, best = [], 0.0
    for step in plan:
        if isinstance(step, Push):
            size = call([step.segment], False) if step.keep_graph else 0.0
            best = max(best, sum(stack) + size)
            stack.append(size)
        elif isinstance(step, Pop):
            stack.pop()
            if not step.keep_graph:  # (recomputed with its graph, on the stack below it)
                best = max(best, sum(stack) + call([step.segment], False))
        else:
            best = max(best, sum(stack) + call(list(step.segments), len(step.segments) > 1))
    positions = capacity(plan, True)
    head = per.transient * HEAD_ROWS
    return PlanPeak(best + positions * per.position + head, best, positions * per.position, head, positions)
