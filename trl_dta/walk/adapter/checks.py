"""Which models the tree walk computes exactly, decided when a :class:`~trl_dta.walk.adapter.model.CausalLM`
is made.

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
* layers that keep state other than K/V (state-space, linear attention, short convolutions): their states
  are carried through transformers' cache API, which the probe checks on a two-segment path; layer types
  outside that API are refused, and sibling leaves are never packed (one leaf's state would run into the
  next);
* a cache the model ignores, an LM-head transform the walk does not reproduce, a model that is not causal:
  the probe (:mod:`trl_dta.walk.adapter.probe`) refuses them, naming the cause.

Every refusal of a model (or of a call's sequences on it) is an
:class:`~trl_dta.walk.errors.UnsupportedModelError`. What the caller can fix is a plain ``ValueError`` at
the call: randomness left on in a training model (:mod:`trl_dta.walk.adapter.determinism`: a shared prefix
would share one dropout mask), a token id outside the vocabulary, a sequence longer than a learned position
table.
"""

from __future__ import annotations

import numbers

from torch import nn

from ..errors import ArgumentTypeError, UnsupportedModelError
from .determinism import stochastic_settings

SUPPORTED_ATTENTION = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")

# layer types (transformers' per-layer strings) whose state is not a plain K/V cache
_STATEFUL_LAYERS = ("conv", "linear", "mamba", "hybrid", "recurrent", "ssm", "rwkv", "lstm", "deltanet")
# layer types that keep extra per-token caches next to K/V (sparse-attention indexers, compressed attention)
_INDEXED_LAYERS = ("indexed", "compressed")
# layer types whose conv / recurrent states transformers' cache API exposes and the walk carries
_CARRIED_STATES = ("conv", "linear_attention", "hybrid", "hybrid_sliding")


def layer_types(config) -> list[str]:
    """Per-layer type (the attention pattern: full, sliding, chunked, ...), read as transformers builds its
    caches: ``layer_types`` if the config has it, otherwise every layer is windowed when ``sliding_window`` is
    set (Mistral, Mixtral, Starcoder2, Phi-3) unless ``use_sliding_window`` is False, chunked when
    ``attention_chunk_size`` is set, else full."""
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


def logit_scale(config) -> float:
    """The multiplier a model applies to its logits (same lookup as TRL's fused LM head)."""
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        value = getattr(config, name, None)
        if value is not None:
            return float(value)
    scaling = getattr(config, "logits_scaling", None)
    if scaling is not None:
        return float(scaling) if config.model_type == "hyperclovax" else 1.0 / float(scaling)
    return 1.0


def check_stateful_layers(config, name: str) -> None:
    """Refuse layers whose cache the walk does not carry: sparse-attention indexers and compressed
    attention, and any state-keeping layer type other than those of transformers' linear-attention cache
    (convolution, linear attention / state-space, hybrid), whose states the walk carries."""
    types = layer_types(config)
    indexed = sorted({k for k in types if any(s in str(k).lower() for s in _INDEXED_LAYERS)})
    if indexed:
        raise UnsupportedModelError(
            f"{name} has layers of type {indexed}: sparse or compressed attention keeps extra caches next "
            "to K/V (a top-k indexer's keys, compressed blocks) that the tree walk does not manage; not "
            "supported."
        )
    kinds = sorted(
        {k for k in types if any(s in str(k).lower() for s in _STATEFUL_LAYERS) and k not in _CARRIED_STATES}
    )
    if kinds:
        raise UnsupportedModelError(
            f"{name} has layers of type {kinds}: they keep a state that transformers' linear-attention "
            "cache does not describe (the tree walk carries the states of layers of type "
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


def check_count(name: str, value, minimum: int = 0) -> int:
    """A whole-number setting (a token budget, a block size) at least ``minimum``, as an int."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(f"{name} must be an int >= {minimum}, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_attention_implementation(config) -> None:
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl not in SUPPORTED_ATTENTION:
        raise UnsupportedModelError(
            f"attention implementation {impl!r} is not supported by the tree walk; use one of "
            f"{SUPPORTED_ATTENTION} (attn_implementation=... in from_pretrained)."
        )


def check_no_randomness(model: nn.Module, training: bool | None = None) -> None:
    """Refuse a training model with randomness switched on by a setting
    (:func:`~trl_dta.walk.adapter.determinism.stochastic_settings`: dropout modules, dropout probabilities
    held on modules, layer drop, router jitter): a shared prefix would share one random draw. ``training``:
    check as if the model were in that mode (a trainer's model at construction, before the Trainer puts it in
    train mode); None: its current mode."""
    if not (model.training if training is None else training):
        return
    found = stochastic_settings(model, as_training=training is not None)
    if found:
        more = f" and {len(found) - 3} more" if len(found) > 3 else ""
        raise ValueError(
            f"randomness is on in train mode ({', '.join(found[:3])}{more}): a shared prefix would share one "
            "dropout mask or random draw among all the sequences through it, so the tree walk would not "
            "equal the dense computation. Put the model in eval mode or set these to 0 (TreePPOTrainer does "
            "with disable_dropout=True; trl_dta.walk.adapter.determinism.disable_randomness(model) does it "
            "by hand)."
        )


def check_vocabulary(trie, vocab: int) -> None:
    """Refuse a token id the model has no embedding or logit for, naming the sequence."""
    for i, seq in enumerate(trie.sequences):
        top = int(seq.max())
        if top >= vocab:
            raise ValueError(
                f"sequence {i} has token id {top}, but the model's vocabulary has {vocab} ids "
                f"(0..{vocab - 1}); was it tokenized with another tokenizer, or were tokens added without "
                "resizing the model's embeddings?"
            )


def learned_position_limit(decoder: nn.Module) -> int | None:
    """Most positions a model with learned absolute position embeddings (GPT-2's ``wpe``, OPT's
    ``embed_positions``) can encode: its position table's size, less the table's offset. None without one.
    Only tables at the top of the decoder count (``wpe``, ``embeddings.position_embeddings``): a vision or
    audio tower deeper inside has position tables of its own that do not limit the text."""
    limits = []
    for name, module in decoder.named_modules():
        leaf = name.rsplit(".", 1)[-1].lower()
        if isinstance(module, nn.Embedding) and name.count(".") <= 1 and ("pos" in leaf or leaf == "wpe"):
            limits.append(module.num_embeddings - int(getattr(module, "offset", 0) or 0))
    return min(limits) if limits else None


def check_positions(trie, limit: int | None) -> None:
    """Refuse sequences longer than a learned position table, naming the first such sequence."""
    if limit is None or trie.max_depth <= limit:
        return
    i = next(i for i in range(len(trie)) if trie.sequence_length(i) > limit)
    raise ValueError(
        f"sequence {i} has {trie.sequence_length(i)} tokens, but the model's learned position embeddings "
        f"cover {limit} positions; truncate the sequences (e.g. max_completion_length) to at most {limit} "
        "tokens."
    )


def check_length(lm, max_length: int, what: str | None = None, hint: str = "") -> None:
    """Refuse sequences longer than the model's attention window or the limit of its length-dependent RoPE
    (``lm``: a :class:`~trl_dta.walk.adapter.model.CausalLM`, or anything with its ``attention_window``,
    ``window_kind``, ``rope_limit`` and ``rope_kind``). ``what``: the sequences in the message (default: "a
    sequence of N tokens"; a caller that checks a configured bound names its setting); ``hint``: appended."""
    what = what or f"a sequence of {max_length} tokens"
    if lm.attention_window is not None and max_length > lm.attention_window:
        raise UnsupportedModelError(
            f"{what} exceeds the model's {lm.window_kind} ({lm.attention_window} tokens); windowed or "
            f"chunked attention over a cached prefix is not supported.{hint}"
        )
    if lm.rope_limit is not None and max_length > lm.rope_limit:
        raise UnsupportedModelError(
            f"{what} exceeds the model's original context ({lm.rope_limit}) with {lm.rope_kind!r} RoPE: past "
            "it the rotary frequencies depend on each forward call's length, so a cached prefix is encoded "
            f"differently from a dense pass; not supported.{hint}"
        )


def check_position_limit(limit: int | None, max_length: int, what: str, option: str) -> None:
    """Refuse a configured bound ``max_length`` (described by ``what``) longer than a learned position
    table: :func:`check_positions` before any sequence exists; ``option`` is the setting to lower."""
    if limit is not None and max_length > limit:
        raise ValueError(
            f"{what} exceeds the {limit} positions the model's learned position embeddings cover; lower "
            f"{option} so that sequences fit in {limit} tokens."
        )


def check_tokenizer_size(tokens: int, vocab: int) -> None:
    """Refuse a tokenizer with more ids than the model can embed and score (:func:`check_vocabulary` before
    any sequence exists: the ids past the model's vocabulary would fail in generation or in the walk)."""
    if tokens > vocab:
        raise ValueError(
            f"the tokenizer has {tokens} ids, but the model's vocabulary has {vocab} (0..{vocab - 1}): ids "
            f"{vocab}..{tokens - 1} have no embedding or logit. Was the model paired with another tokenizer, "
            "or were tokens added without resizing the model's embeddings "
            "(model.resize_token_embeddings(len(tokenizer)))?"
        )
