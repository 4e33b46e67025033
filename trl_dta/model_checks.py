"""Which models the tree walk computes exactly, decided when a :class:`~trl_dta.causal_lm.CausalLM` is made.

The walk runs a model on pieces of a sequence: a segment on top of its prefix's cached K/V, and sibling
leaves packed into one row with a hand-made block-diagonal mask. That equals the model's dense forward only
if nothing in the model depends on how the sequence was cut. What can break it, and what is done:

* an attention window or chunk (Mistral-style ``sliding_window``, ``layer_types``, Llama 4 chunked
  attention, GPT-Neo local attention): detected from the config the way transformers reads it; sequences
  longer than the window are refused at the call, and leaves are never packed (a hand-made 4-D mask
  replaces the model's windowed one, and some models slice the window by index in the packed row);
* attention biases built from key indices (ALiBi in MPT, Bloom, Falcon) or anything else a packed row
  changes: the probe compares packed sibling leaves with the model's own dense forwards and, if they
  differ or fail, the executor forwards leaves as a padded batch instead (exact, a little slower);
* RoPE whose frequencies depend on the call's length (dynamic NTK, longrope): refused for sequences longer
  than the original context, where the frequencies start to move;
* layers that keep state other than K/V (state-space, linear attention, short convolutions): their states are
  carried through transformers' cache API, which the probe checks on a two-segment path; kinds outside that
  API are refused, and sibling leaves are never packed (one leaf's state would run into the next);
* a cache the model ignores, an LM-head transform the walk does not reproduce, a model that is not causal:
  the probe refuses them, naming the cause.
"""

from __future__ import annotations

import contextlib
import logging

import torch

logger = logging.getLogger(__name__)

# max |walk - dense| / max |dense| of the probe's logits, per dtype. float64 is loose on purpose: HF computes
# eager softmax, RMSNorm and some attention variants in float32 even in a float64 model, which leaves ~1e-7
# between two exact computations; a structural mistake (ignored cache, wrong mask or bias) is >= 1e-3.
PROBE_TOLERANCE = {torch.float64: 1e-5, torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}
# transformers' state-layer kernels (chunked delta rule, Mamba2 scan) compute in float32 even in a float64
# model: two exact computations of a float64 hybrid differ like float32 ones (~1e-5 over 13 tokens)
STATE_DTYPE_FLOOR = torch.float32
# layer kinds (transformers' cache layer types) whose state is not a plain K/V cache
_STATEFUL_LAYERS = ("conv", "linear", "mamba", "hybrid", "recurrent", "ssm", "rwkv", "lstm", "deltanet")
# layer kinds that keep extra per-token caches next to K/V (sparse-attention indexers, compressed attention)
_INDEXED_LAYERS = ("indexed", "compressed")
# layer kinds whose conv / recurrent states transformers' cache API exposes and the walk carries
_CARRIED_STATES = ("conv", "linear_attention", "hybrid", "hybrid_sliding")


def layer_types(config) -> list[str]:
    """Per-layer attention kind, read as transformers builds its caches: ``layer_types`` if the config has
    it, otherwise every layer is windowed when ``sliding_window`` is set (Mistral, Mixtral, Starcoder2, Phi-3)
    unless ``use_sliding_window`` is False, chunked when ``attention_chunk_size`` is set, else full."""
    types = getattr(config, "layer_types", None)
    n = config.num_hidden_layers
    if types:
        return list(types)
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True) is not False:
        return ["sliding_attention"] * n
    if getattr(config, "attention_chunk_size", None):
        return ["chunked_attention"] * n
    return ["full_attention"] * n


def attention_window(config) -> tuple[int | None, str]:
    """The shortest attention window or chunk of any layer and its kind (for messages), or (None, "")."""
    windows = []
    for kind in set(layer_types(config)):
        if "sliding" in kind and getattr(config, "sliding_window", None):
            windows.append((int(config.sliding_window), "sliding window"))
        elif "chunk" in kind and getattr(config, "attention_chunk_size", None):
            windows.append((int(config.attention_chunk_size), "chunked attention"))
    local = [kind for kind in (getattr(config, "attention_layers", None) or []) if kind == "local"]
    if local and getattr(config, "window_size", None):  # GPT-Neo
        windows.append((int(config.window_size), "local attention window"))
    return min(windows) if windows else (None, "")


def check_stateful_layers(config, name: str) -> None:
    """Refuse layers whose cache the walk does not carry: sparse-attention indexers and compressed
    attention, and any state-keeping layer kind other than those of transformers' linear-attention cache
    (convolution, linear attention / state-space, hybrid), whose states the walk carries."""
    types = layer_types(config)
    indexed = sorted({k for k in types if any(s in str(k).lower() for s in _INDEXED_LAYERS)})
    if indexed:
        raise ValueError(
            f"{name} has layers of kind {indexed}: sparse or compressed attention keeps extra caches next "
            "to K/V (a top-k indexer's keys, compressed blocks) that the tree walk does not manage; not "
            "supported."
        )
    kinds = sorted(
        {k for k in types if any(s in str(k).lower() for s in _STATEFUL_LAYERS) and k not in _CARRIED_STATES}
    )
    if kinds:
        raise ValueError(
            f"{name} has layers of kind {kinds}: they keep a state that transformers' linear-attention "
            "cache does not describe (the tree walk carries the states of layers of kind "
            f"{sorted(_CARRIED_STATES)}); not supported."
        )


def rope_length_limit(model) -> tuple[int | None, str]:
    """Longest sequence for which RoPE frequencies do not depend on the call's length, and the RoPE type.

    Dynamic NTK rescales once a call's largest position passes the original context; longrope switches to its
    long factors there. A cached prefix would then be encoded with other frequencies than a dense pass."""
    limits = []
    for module in model.modules():
        kinds = getattr(module, "rope_type", None)
        if kinds is None or not hasattr(module, "inv_freq"):
            continue
        for kind in kinds.values() if isinstance(kinds, dict) else [kinds]:
            if "dynamic" in str(kind):
                limits.append((int(module.original_max_seq_len), str(kind)))
            elif kind == "longrope":
                params = getattr(module.config, "rope_parameters", None) or {}
                params = next(iter(params.values())) if "rope_type" not in params and params else params
                original = params.get("original_max_position_embeddings") or getattr(
                    module.config, "original_max_position_embeddings", None
                )
                limits.append((int(original or module.original_max_seq_len), "longrope"))
    return min(limits) if limits else (None, "")


def packed_inputs(
    lengths: list[int], start: int, dtype, device, parents=None, starts=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [1, T] and additive 4-D mask [1, 1, T, start + T] that pack segments of the given lengths
    into one row on a shared past of ``start`` tokens: each token sees the past, the earlier tokens of its
    own segment and every token of the segment's ancestors. Sibling leaves (``parents`` None): no ancestors,
    positions restart at ``start`` for every leaf. A packed subtree: ``parents[k]`` is segment ``k``'s parent
    index (-1: none in the row; parents come first) and ``starts[k]`` its first position."""
    n = len(lengths)
    segment = torch.repeat_interleave(torch.arange(n, device=device), torch.tensor(lengths, device=device))
    offsets = torch.cat([torch.arange(k, device=device) for k in lengths])
    index = torch.arange(segment.numel(), device=device)
    ancestor = torch.eye(n, dtype=torch.bool, device=device)  # [k, j]: j is k or an ancestor of k
    for k, parent in enumerate(parents or ()):
        if parent >= 0:
            ancestor[k] |= ancestor[parent]
    visible = ancestor[segment][:, segment] & (index[None, :] <= index[:, None])  # ancestors come first
    visible = torch.cat([visible.new_ones(segment.numel(), start), visible], dim=1)
    mask = torch.zeros(visible.shape, dtype=dtype, device=device)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    first = torch.tensor(starts if starts is not None else [start] * n, device=device)
    return (first[segment] + offsets)[None], mask[None, None]


@contextlib.contextmanager
def _unsupported_on_failure(name: str):
    """Turn a model's failure on a given cache into a refusal; refusals raised by CausalLM pass unchanged."""
    try:
        yield
    except Exception as e:
        tb = e.__traceback__
        while tb.tb_next is not None:
            tb = tb.tb_next
        if isinstance(e, ValueError) and tb.tb_frame.f_code.co_filename.endswith("causal_lm.py"):
            raise
        raise ValueError(
            f"{name} fails when run on a given KV cache ({type(e).__name__}: {e}). Models whose layers "
            "keep another state than K/V (state-space, linear attention), or that cannot take a cache, are "
            "not supported."
        ) from e


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


@torch.no_grad()
def probe(lm, try_packing: bool) -> bool:
    """Run the walk's operations on a tiny input and compare with the model's own dense forwards.

    A 6-token prefix is forwarded as two segments, the second on the first's cache (checks causality, the
    LM-head transform, and that K/V and states carry from segment to segment); three sibling leaves of 2-4
    tokens on the prefix's cache one by one and as a padded batch (checks the cache is read); then packed
    into one row (checks the model applies the hand-made mask and nothing index-based). Raises
    ``ValueError`` naming the cause if an unpacked path differs; returns whether packing is exact (only tried
    if asked)."""
    name = type(lm.base).__name__
    device = lm.lm_head.weight.device
    dtype = lm.lm_head.weight.dtype
    tolerance = PROBE_TOLERANCE.get(dtype, 5e-2)
    if lm.has_states and dtype == torch.float64:
        tolerance = PROBE_TOLERANCE[STATE_DTYPE_FLOOR]
    vocab = lm.lm_head.weight.shape[0]
    seq = ((torch.arange(13, device=device) * 7919 + 11) % vocab).tolist()
    prefix, leaves = seq[:6], [seq[6:8], seq[8:11], seq[9:13]]
    where = f"(relative; tolerance {tolerance:g} for {dtype}, autocast off)"

    def ids(tokens):
        return torch.tensor(tokens, device=device)[None]

    def dense(tokens):
        # the class's own forward: accelerate (mixed precision) and TRL (fused LM head) patch the instance's
        # forward, and accelerate's patch turns autocast back on inside it
        out = type(lm.base).forward(lm.base, input_ids=ids(tokens), use_cache=False)
        return out.logits[0].to(torch.float64)

    def logits(hidden):
        return lm.logits(hidden, 1.0)[0].to(torch.float64)

    try:
        dense_leaves = [dense(prefix + leaf) for leaf in leaves]
        dense_prefix = dense(prefix)
    except Exception as e:
        raise ValueError(
            f"{name}'s own forward fails on a plain input of token ids ({type(e).__name__}: {e}); "
            "not supported."
        ) from e
    err = _rel(dense_prefix, dense_leaves[0][: len(prefix)])
    if not err <= tolerance:
        raise ValueError(
            f"{name} is not causal: its outputs at a position change with later tokens ({err:.2e} "
            f"{where}), as in an encoder or a model configured without a causal mask (e.g. "
            "is_decoder=False); not supported."
        )
    with _unsupported_on_failure(name):
        hidden, first = lm.forward(ids(prefix[:4]), 0, None)
    err = _rel(logits(hidden), dense_prefix[:4])
    if not err <= tolerance:
        raise ValueError(
            f"{name}: its decoder + LM head (with the config's logit scale and soft-capping) differs from "
            f"the dense forward by {err:.2e} {where}: the model transforms its logits in a way the tree walk "
            "does not reproduce; not supported."
        )
    errs = []
    with _unsupported_on_failure(name):
        hidden, second = lm.forward(ids(prefix[4:]), 4, [first])
        errs.append(_rel(logits(hidden), dense_prefix[4:]))
        path = [first, second]
        for leaf, ref in zip(leaves, dense_leaves, strict=True):  # one leaf at a time, then a padded batch
            hidden, _ = lm.forward(ids(leaf), len(prefix), path)
            errs.append(_rel(logits(hidden), ref[len(prefix) :]))
        batch = torch.zeros(len(leaves), max(map(len, leaves)), dtype=torch.long, device=device)
        for row, leaf in enumerate(leaves):
            batch[row, : len(leaf)] = torch.tensor(leaf, device=device)
        hidden, _ = lm.forward(batch, len(prefix), lm.expand(path, len(leaves)))
        for row, (leaf, ref) in enumerate(zip(leaves, dense_leaves, strict=True)):
            errs.append(_rel(logits(hidden[row : row + 1, : len(leaf)]), ref[len(prefix) :]))
    err = max(errs)
    if not err <= tolerance:
        cause = (
            "its multi-token kernel does not start from the given state (e.g. Mamba-1 layers restart from "
            "zero), or it ignores the passed cache"
            if lm.has_states
            else f"the model ignores the passed cache (keyword {lm.cache_keyword!r})"
        )
        raise ValueError(
            f"{name}: a forward on a cached prefix differs from the model's dense forward by {err:.2e} "
            f"{where}: {cause}, or computes something that depends on how the sequence is cut into calls; "
            "not supported."
        )
    return try_packing and _packing_is_exact(lm, path, prefix, leaves, dense_leaves, tolerance)


def _packing_is_exact(lm, path, prefix, leaves, dense_leaves, tolerance) -> bool:
    device = lm.lm_head.weight.device
    name = type(lm.base).__name__
    try:
        positions, mask = packed_inputs(
            [len(x) for x in leaves], len(prefix), lm.lm_head.weight.dtype, device
        )
        tokens = torch.tensor([t for leaf in leaves for t in leaf], device=device)[None]
        hidden, _ = lm.forward(tokens, len(prefix), path, positions=positions, attention_mask=mask)
        got = lm.logits(hidden, 1.0)[0].to(torch.float64).split([len(x) for x in leaves])
        err = max(_rel(g, ref[len(prefix) :]) for g, ref in zip(got, dense_leaves, strict=True))
    except Exception as e:  # noqa: BLE001 - e.g. ALiBi built from a 2-D mask fails on a 4-D one
        logger.info("%s: sibling leaves are forwarded as a padded batch; packing them fails: %r", name, e)
        return False
    if not err <= tolerance:
        logger.info(
            "%s: sibling leaves are forwarded as a padded batch; packed into one row they differ from the "
            "dense forward by %.2e (positions or an attention bias built from key indices, e.g. ALiBi).",
            name,
            err,
        )
        return False
    return True
