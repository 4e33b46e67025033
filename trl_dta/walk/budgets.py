"""The walk's token budgets, derived from the memory it may use.

A walk holds, at its peak, the autograd graph of the tokens on its stack (at most ``block_size`` of them)
plus the graph of the call it is running (a leaf batch or a packed subtree, at most ``batch_tokens`` /
``subtree_tokens``), and the path's K/V with a float32 gradient buffer beside it. Each of these is a number
of tokens times a number of bytes per token, which depends only on the model's shapes and dtype
(:func:`activation_bytes`, an analytic count of what autograd saves in a pre-norm decoder layer, checked in
``tests/test_budgets.py`` against the bytes measured on CPU). So a memory budget gives token budgets
(:func:`token_budgets`), in this order of priority:

1. no recompute: the stack keeps the graph of the longest path (the tokens above a leaf), if that leaves
   room for a call of at least ``MIN_CALL_TOKENS`` tokens; otherwise the memory is split 2:1 between the
   stack and the call (the paper's "larger backward block": the recompute falls as the block grows);
2. the largest calls that fit in the rest, capped where larger calls no longer pay on the device kind
   (:data:`DEVICE_COSTS`; the plan then decides, call by call, whether merging pays: :mod:`.costs`).

Memory model, per optimizer step's walk (bytes)::

    peak = position x (block + call)                       # path K/V and its float32 gradient
         + (token + scored) x block                        # the stack's graphs
         + (token + scored) x call + transient x head_rows # the running call, its LM-head transients

``scored`` counts the LM head's saved log-softmax (and the entropy's, when it has a gradient) for every
token, as if every token were scored: an upper bound for prompts the loss does not read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .checks import check_count

AUTO_FRACTION = 0.9  # memory_budget="auto" on CUDA: this share of the free memory at the first walk
MIN_CALL_TOKENS = 512  # below this, calls are too small to keep a GPU busy: rather recompute
HEAD_ROWS = 1024  # the LM head runs on at most this many positions at once (scoring.py)


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


def check_memory_budget(value):
    """A ``memory_budget`` argument: None, "auto", or a positive number of bytes."""
    if value is None or value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f'memory_budget must be "auto", None or a positive number of bytes, got {value!r}')
    return value


@dataclass(frozen=True)
class ActivationBytes:
    """Bytes the walk holds per token (:func:`activation_bytes`)."""

    token: float  # decoder: what autograd saves per token forwarded with a graph (K/V excluded)
    scored: float  # LM head: what autograd saves per scored token (log-softmax, entropy)
    transient: float  # LM head: logits and their gradients alive while a call scores a row
    position: float  # the path's K/V and their float32 gradients, per cache position


@dataclass(frozen=True)
class DeviceCosts:
    """What a model call costs on a device kind (:mod:`trl_dta.walk.costs` turns it into seconds per call for
    a given model): a fixed host cost per decoder layer and call (kernel launches on a GPU, Python and
    dispatch on a CPU), the rate at which it runs FLOPs, and the call size past which larger calls no longer
    pay."""

    layer_call_s: float  # seconds per decoder layer per forward + backward call, whatever its size
    flop_rate: float  # FLOP/s of the decoder's matmuls and attention
    max_call_tokens: int


# Per device kind. CUDA: benchmarks/launch_model.py's assumptions (a 28-layer forward + backward launches
# ~5.1k kernels, ~182 per layer, at 5 µs each; FLOPs at 40% of an H200's 989 TFLOP/s bf16 peak) until a GPU
# measures them (benchmarks/gpu.sh). CPU: fitted on the project's 2-core machine by
# benchmarks/call_costs.py (docs/benchmarks.md, "Call sizes").
DEVICE_COSTS = {
    "cuda": DeviceCosts(layer_call_s=182 * 5e-6, flop_rate=0.4 * 989e12, max_call_tokens=1 << 16),
    "cpu": DeviceCosts(layer_call_s=1.0e-3, flop_rate=3.0e10, max_call_tokens=2048),
}


def device_costs(device_type: str) -> DeviceCosts:
    """The constants of ``device_type``; an unknown accelerator gets CUDA's."""
    return DEVICE_COSTS.get(device_type, DEVICE_COSTS["cuda"])


def _width(config, name: str, default: int) -> int:
    value = getattr(config, name, None)
    return int(value) if value else default


def _has_qk_norm(config) -> bool:
    """Whether attention normalises queries and keys per head (Qwen3, OLMo-2, Gemma-3: two more norms)."""
    return config.model_type.split("_")[0] in ("qwen3", "olmo2", "olmo3", "gemma3", "cohere2")


def activation_bytes(config, dtype: torch.dtype, entropy_grad: bool = True) -> ActivationBytes:
    """Per-token bytes of a walk through a model of ``config`` (a ``transformers`` config; multimodal ones
    give their text config) in ``dtype``, counted as PyTorch's autograd saves them in a pre-norm decoder
    layer (RMSNorm, attention, gated MLP; MoE: the routed experts' share):

    * each RMSNorm of width ``w``: its float32 input (``4w``), normalised value and output (``2 e w``);
    * per-head q/k norms where the model has them (``(4 + e)`` per element), the rotated queries and the
      attention output (``2 e q``), the log-sum-exp (``4`` per head);
    * gated MLP: gate, activation, up and product (``4 e i``);
    * K/V: in the path buffer (``position``), ``2 e kv`` per layer, with a float32 gradient ``8 kv``.

    The LM head saves its float32 log-softmax (``4 V`` per scored token, ``8 V`` when entropies have a
    gradient) and, while a call scores its rows, the logits and their gradient (``8 V``)."""
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
    vocab = config.vocab_size
    token = layers * layer + norm(d) + 8  # the final norm, the token id
    scored = (8 if entropy_grad else 4) * vocab + e * d  # log-softmax (+ entropy), the head's input
    return ActivationBytes(token, scored, 8 * vocab, layers * 2 * kv * (e + 4))


def token_budgets(
    config,
    dtype: torch.dtype,
    memory_bytes: float,
    device_type: str = "cuda",
    path_tokens: int | None = None,
    entropy_grad: bool = True,
) -> TokenBudgets:
    """The token budgets a walk through a model of ``config`` in ``dtype`` may use within ``memory_bytes``
    of activation memory on a ``device_type`` ("cuda", "cpu", ...), by the priorities of the module
    docstring. ``path_tokens``: the most tokens on any path above a leaf (the executor passes its trie's);
    unknown, the memory is split 2:1 between the stack and the call. Pure: no device is touched, so a CPU can
    show what a GPU would pick."""
    if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, int | float) or not memory_bytes > 0:
        raise ValueError(f"memory_bytes must be a positive number of bytes, got {memory_bytes!r}")
    if path_tokens is not None:
        path_tokens = check_count("path_tokens", path_tokens)
    per = activation_bytes(config, dtype, entropy_grad)
    costs = device_costs(device_type)
    stack = per.position + per.token + per.scored  # per token on the stack
    call = per.position + per.token + per.scored  # per token of the running call
    room = memory_bytes - per.transient * HEAD_ROWS
    if room < (stack + call) * 2:
        raise ValueError(
            f"memory budget {memory_bytes / 2**30:.2f} GiB is too small for the walk of this model "
            f"({(stack + call + per.transient * HEAD_ROWS) / 2**20:.0f} MiB for one token on the stack and "
            "one in a call, with the LM head's working space)"
        )
    block = None
    if path_tokens is not None and room - stack * path_tokens >= call * MIN_CALL_TOKENS:
        block = max(1, path_tokens)
    if block is None:
        block = max(1, int(room * 2 / 3 / stack))
    calls = max(1, min(int((room - stack * block) / call), costs.max_call_tokens))
    return TokenBudgets(block_size=block, batch_tokens=calls, subtree_tokens=calls)


def auto_memory_bytes(model: torch.nn.Module, device: torch.device, fraction: float) -> float | None:
    """``memory_budget="auto"``: on CUDA, ``fraction`` of the device's free memory now (what the driver has
    free and what PyTorch's allocator holds unused), less what the first
    optimizer step will still allocate (each trainable parameter's gradient if it has none yet, and two Adam
    states); None elsewhere (the device kind's fixed defaults apply)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)  # (its cache)
    later = 0
    for p in model.parameters():
        if p.requires_grad:
            # the full size (ZeRO-3 partitions hold ds_numel; FSDP2's DTensors count their global size)
            size = (getattr(p, "ds_numel", None) or p.numel()) * p.element_size()
            later += 2 * size + (size if p.grad is None else 0)
    budget = fraction * free - later
    if budget <= 0:
        raise RuntimeError(
            f"memory_budget='auto': {free / 2**30:.2f} GiB free on {device}, of which {fraction:.0%} leaves "
            f"nothing after the first optimizer step's gradients and Adam states ({later / 2**30:.2f} GiB); "
            "pass memory_budget in bytes, or the token budgets."
        )
    return budget
