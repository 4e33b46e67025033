"""What the tree executor needs from a Hugging Face causal LM, and the checks that make it safe to use.

:class:`CausalLM` wraps a ``transformers`` causal LM (plain or PEFT-wrapped) and offers two operations:

* :meth:`CausalLM.forward`: run the decoder on new tokens on top of the caches of the path before them
  (every segment's K/V; for hybrid and state-space models, the last segment's conv / recurrent states) and
  return the final hidden states and what the new tokens leave in each layer's cache (with their autograd
  graph when grad is enabled);
* :meth:`CausalLM.logits`: the LM head, with the model's logit scale and soft-capping (the same transform
  TRL's fused LM head applies), divided by a temperature, in at least float32.

States go through transformers' own cache API (``get_conv_state``, ``update_recurrent_state``, ...), so the
model's own kernels run (PyTorch fallbacks on CPU; flash-linear-attention / causal-conv1d / mamba-ssm on GPU,
which take an initial state): a conv state is the last kernel-width inputs, joined with the new ones; a
recurrent state is handed in as the kernel's initial state, and its final state is recorded.

Models it cannot run exactly are rejected with a ``ValueError`` when wrapped, or at a call for limits that
depend on the sequences (attention windows, length-dependent RoPE); :mod:`trl_dta.model_checks` holds the
checks and the probe that compares the walk's operations with the model's own dense forward.
"""

from __future__ import annotations

import contextlib
import inspect
import logging

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import (
    Cache,
    DummyLayer,
    DynamicLayer,
    LinearAttentionCacheLayerMixin,
    get_layer_types_and_kwargs,
)

from . import model_checks
from .path_kv import PathKV

logger = logging.getLogger(__name__)

SUPPORTED_ATTENTION = ("eager", "sdpa", "flash_attention_2", "flash_attention_3")


# What a forward leaves to the tokens after it, per layer, every tensor [B, ...] (batch first):
# * attention layers: "k", "v" [B, kv_heads, L, head_dim], the new tokens' K/V only (a later forward
#   attends to the K/V of every segment on its path);
# * state layers (linear attention, state-space, short convolutions): the layer's states after the last
#   token, "conv0", "recurrent0" (more indices if the layer keeps several), in transformers' cache layout
#   (a later forward starts from the last segment's states only);
# * hybrid layers (both in one layer, e.g. Falcon-H1): both.
LayerCache = dict[str, torch.Tensor]
# The path under a forward: each segment's per-layer caches, root first.
Path = list[list[LayerCache]]

_KV = ("k", "v")


class _PathLayer(DynamicLayer):
    """One attention layer of the walk's cache: the path's K/V, either in the walk's per-layer buffer
    (:class:`~trl_dta.path_kv.PathKV`: no copy of the past) or as per-segment pieces, joined with the new
    tokens' K/V in a single concatenation (a pre-filled DynamicCache would copy the path twice more: once to
    fill, once to append). Pieces kept in float32 for gradient accumulation are cast to the new K/V's dtype
    in the same step."""

    def __init__(self, pieces: list[tuple[torch.Tensor, torch.Tensor]], past_length: int, kv=None, index=0):
        super().__init__()
        self.pieces = pieces
        self.past_length = past_length
        self.kv, self.index = kv, index

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.kv is not None:
            self.keys, self.values = self.kv.join(self.index, key_states, value_states, self.past_length)
        else:
            self.keys = torch.cat([k.to(key_states.dtype) for k, _ in self.pieces] + [key_states], dim=-2)
            self.values = torch.cat([v.to(value_states.dtype) for _, v in self.pieces] + [value_states], -2)
        self.pieces = []
        self.past_length = self.keys.shape[-2]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.past_length


class _StatePathLayer(_PathLayer, LinearAttentionCacheLayerMixin):
    """A layer with conv / recurrent states (and K/V if it also attends): transformers' cache API for them is
    answered by :class:`_RecordingCache` itself, from the last segment's states."""

    def __init__(self, pieces, past_length: int, kv=None, index=0):
        _PathLayer.__init__(self, pieces, past_length, kv, index)
        LinearAttentionCacheLayerMixin.__init__(self)
        self.record_past = True  # keeps models off their in-place single-token conv update

    def lazy_initialization(self, *args, **kwargs):  # K/V only: states never go through the layer
        if len(args) == 2:
            _PathLayer.lazy_initialization(self, *args)

    def update_conv_state(self, *args, **kwargs):  # pragma: no cover - the cache answers these
        raise NotImplementedError

    update_recurrent_state = update_conv_state


class _RecordingCache(DynamicCache):
    """The cache a forward of the walk runs on: the path's K/V (per layer, as pieces) and the last segment's
    states; records what each layer writes (new K/V, new states).

    States are handed to the model as fresh copies (autograd still reaches the segment they came from), so a
    model that updates a state it was given in place never touches the path's tensors."""

    def __init__(self, path: Path | None, kinds: list[str], start: int, kv=None):
        layers = []
        self.incoming: list[LayerCache] = []
        for i, kind in enumerate(kinds):
            pieces = [(seg[i]["k"], seg[i]["v"]) for seg in path or () if "k" in seg[i]]
            state = {k: t for k, t in path[-1][i].items() if k not in _KV} if path else {}
            self.incoming.append(state)
            if kind == "attention":
                layers.append(_PathLayer(pieces, start, kv, i))
            elif kind in ("state", "hybrid"):
                layers.append(_StatePathLayer(pieces, start, kv, i))
            else:
                layers.append(DummyLayer())
        Cache.__init__(self, layers=layers)
        self.new: list[LayerCache] = [{} for _ in kinds]
        self.handed: dict[tuple[int, str], torch.Tensor] = {}  # state copies given out, not written back
        self.handed_versions: dict[tuple[int, str], int] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.new[layer_idx].update(k=key_states, v=value_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    # transformers' state API (linear attention, state-space and convolution layers)
    def _state(self, layer_idx: int, key: str) -> torch.Tensor | None:
        state = self.incoming[layer_idx].get(key)
        if state is None:
            return None
        copy = state.clone()
        self.handed[(layer_idx, key)] = copy
        self.handed_versions[(layer_idx, key)] = copy._version
        return copy

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        return self._state(layer_idx, f"conv{state_idx}")

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        return self._state(layer_idx, f"recurrent{state_idx}")

    def update_conv_state(self, conv_states, layer_idx: int, state_idx: int = 0, conv_kernel_size=None, **kw):
        key = f"conv{state_idx}"
        previous = self.incoming[layer_idx].get(key)
        full = conv_states
        if previous is not None:
            full = torch.cat([previous.to(conv_states.dtype), conv_states], -1)
        width = conv_kernel_size or (conv_states.shape[-1] if previous is None else previous.shape[-1])
        if full.shape[-1] < width:  # as transformers keeps it: left-padded with zeros to the kernel width
            full = nn.functional.pad(full, (width - full.shape[-1], 0))
        self.new[layer_idx][key] = full[..., -width:]
        self.handed.pop((layer_idx, key), None)
        return full

    def update_recurrent_state(self, recurrent_states, layer_idx: int, state_idx: int = 0, **kwargs):
        key = f"recurrent{state_idx}"
        self.new[layer_idx][key] = recurrent_states
        self.handed.pop((layer_idx, key), None)
        return recurrent_states

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return any(self.incoming)

    def is_recording_past(self, layer_idx: int) -> bool:
        return True  # models then run their multi-token path, which calls update_conv_state

    def finish(self, name: str) -> None:
        """States a model read and updated in place (as decode kernels do; the walk never runs those, but a
        model's multi-token path might) without writing them back are the new states; a state read and
        neither written back nor updated is an error."""
        for (layer_idx, key), copy in self.handed.items():
            if copy._version == self.handed_versions[(layer_idx, key)]:
                raise ValueError(
                    f"{name}: layer {layer_idx} read its {key} state from the cache but neither wrote a new "
                    "one through the cache API nor updated it in place; the tree walk cannot carry its state."
                )
            if copy.requires_grad and copy.grad_fn is not None and "Clone" in type(copy.grad_fn).__name__:
                raise ValueError(
                    f"{name}: layer {layer_idx} updated its {key} state in place with a kernel autograd does "
                    "not see (e.g. an inference-only decode kernel): gradients through the state would be "
                    "lost. Not supported with this kernel; uninstall it to use transformers' PyTorch path."
                )
            self.new[layer_idx][key] = copy


_STATE_KINDS = {"conv": "state", "linear_attention": "state", "hybrid": "hybrid", "hybrid_sliding": "hybrid"}


def layer_kinds(config) -> list[str]:
    """Per layer, what its cache holds, read the way transformers builds a model's cache: "attention" (K/V),
    "state" (conv / recurrent states), "hybrid" (both) or "none" (a layer without cache, e.g. MLP-only)."""
    types, _ = get_layer_types_and_kwargs(config)
    return [_STATE_KINDS.get(t, "none" if t == "dummy" else "attention") for t in types]


def _logit_scale(config) -> float:
    """The multiplier a model applies to its logits (same lookup as TRL's fused LM head)."""
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        value = getattr(config, name, None)
        if value is not None:
            return float(value)
    scaling = getattr(config, "logits_scaling", None)
    if scaling is not None:
        return float(scaling) if config.model_type == "hyperclovax" else 1.0 / float(scaling)
    return 1.0


class CausalLM:
    """A causal LM seen as ``forward(tokens, past K/V) -> hidden, new K/V`` plus an LM head.

    Args:
        model: a ``transformers`` causal LM, or a PEFT model wrapping one (LoRA-style adapters; prompt
            learning methods are rejected).
        lm_head_fp32: run the LM head projection in float32 (TRL's ``cast_lm_head_to_fp32``).
        probe: run the probe now (recommended; a few forwards of at most 13 tokens). Without it, sibling
            leaves are never packed, since only the probe shows that packing is exact for the model.
    """

    def __init__(self, model: nn.Module, lm_head_fp32: bool = False, probe: bool = True):
        self.model = model
        base = model
        if hasattr(model, "get_base_model") and hasattr(model, "peft_config"):
            if getattr(model.active_peft_config, "is_prompt_learning", False):
                raise ValueError(
                    "PEFT prompt-learning methods add virtual tokens and are not supported; use LoRA."
                )
            base = model.get_base_model()
        self.base = base
        self.config = base.config.get_text_config()
        self.decoder = base.get_decoder()
        if self.decoder is base:  # e.g. Llama 4: base_model_prefix names an attribute the text model lacks
            self.decoder = getattr(base, "model", None)
        self.lm_head = base.get_output_embeddings()
        if self.decoder is None or self.decoder is base or self.lm_head is None:
            raise ValueError(
                f"{type(base).__name__} is not a decoder + LM head causal LM; it is not supported."
            )
        self.lm_head_fp32 = lm_head_fp32
        if lm_head_fp32 and type(self.lm_head) is not nn.Linear:
            raise ValueError("lm_head_fp32=True needs a plain nn.Linear LM head (no adapter on it).")
        self.logit_scale = _logit_scale(self.config)
        self.softcap = getattr(self.config, "final_logit_softcapping", None)
        self.num_layers = self.config.num_hidden_layers
        # per layer what its cache holds: "attention" (K/V), "state" (conv / recurrent states), "hybrid"
        # (both), "none" (no cache, e.g. an MLP-only layer)
        self.layer_kinds = layer_kinds(self.config)
        self.has_states = any(k in ("state", "hybrid") for k in self.layer_kinds)
        # MoE: the router's expert count and top-k, as TRL's load-balancing loss reads them (None if dense)
        self.num_experts = getattr(self.config, "num_experts", None) if self.is_moe else None
        self.top_k = getattr(self.config, "num_experts_per_tok", None) if self.is_moe else None
        self.cache_keyword = self._cache_keyword()
        # attention window or chunk: longer sequences are refused at the call
        self.attention_window, self.window_kind = model_checks.attention_window(self.config)
        # RoPE whose frequencies depend on the call's length: exact up to this many tokens
        self.rope_limit, self.rope_kind = model_checks.rope_length_limit(base)
        self._warned_checkpointing = False
        model_checks.check_stateful_layers(self.config, type(base).__name__)
        self._check_static()
        # Packing sibling leaves into one row needs a custom 4-D additive mask (eager, sdpa) that the model
        # applies as given (no window of its own, no index-based bias): the probe checks the latter.
        impl = getattr(self.config, "_attn_implementation", "eager")
        # State layers would carry one leaf's state into the next leaf of a packed row.
        self.can_pack = impl in ("eager", "sdpa") and self.attention_window is None and not self.has_states
        self.can_pack = self.probe() if probe else False

    @property
    def is_moe(self) -> bool:
        """Whether the model can return router logits (TRL's test for an MoE model)."""
        return hasattr(self.config, "output_router_logits")

    # ---------------------------------------------------------------- checks
    def _cache_keyword(self) -> str:
        params = inspect.signature(self.decoder.forward).parameters
        for name in ("cache", "past_key_values"):  # transformers >= 5.24 / older
            if name in params:
                return name
        raise ValueError(f"{type(self.decoder).__name__}.forward takes no KV cache; the tree walk needs one.")

    def _check_static(self) -> None:
        impl = getattr(self.config, "_attn_implementation", None) or "eager"
        if impl not in SUPPORTED_ATTENTION:
            raise ValueError(
                f"attention implementation {impl!r} is not supported by the tree walk; use one of "
                f"{SUPPORTED_ATTENTION} (attn_implementation=... in from_pretrained)."
            )

    def check_call(self, max_length: int) -> None:
        """Checks that depend on the model's current mode and on the sequences of a call."""
        if self.model.training:
            dropouts = [n for n, m in self.model.named_modules() if isinstance(m, nn.Dropout) and m.p > 0]
            if dropouts or getattr(self.config, "attention_dropout", 0.0):
                where = dropouts[0] if dropouts else "config.attention_dropout"
                raise ValueError(
                    f"dropout is active ({where}): a shared prefix would share one dropout mask, so the "
                    "tree walk "
                    "would not equal the dense computation. Put the model in eval mode or disable dropout "
                    "(TRL's disable_dropout=True)."
                )
        if self.attention_window is not None and max_length > self.attention_window:
            raise ValueError(
                f"a sequence of {max_length} tokens exceeds the model's {self.window_kind} "
                f"({self.attention_window} tokens); windowed or chunked attention over a cached prefix is "
                "not "
                "supported."
            )
        if self.rope_limit is not None and max_length > self.rope_limit:
            raise ValueError(
                f"a sequence of {max_length} tokens exceeds the model's original context ({self.rope_limit}) "
                f"with {self.rope_kind!r} RoPE: past it the rotary frequencies depend on each forward call's "
                "length, so a cached prefix is encoded differently from a dense pass; not supported."
            )

    @contextlib.contextmanager
    def no_gradient_checkpointing(self):
        """Switch gradient checkpointing off for the walk (HF layers drop a passed cache under it); restore it
        after."""
        switched = [m for m in self.model.modules() if getattr(m, "gradient_checkpointing", False) is True]
        if switched and self.model.training and not self._warned_checkpointing:
            self._warned_checkpointing = True
            logger.warning(
                "Gradient checkpointing is on: it makes decoder layers drop the KV cache, so it is "
                "switched off "
                "during the tree walk and restored afterwards (the walk bounds activation memory itself)."
            )
        for m in switched:
            m.gradient_checkpointing = False
        try:
            yield
        finally:
            for m in switched:
                m.gradient_checkpointing = True

    def probe(self) -> bool:
        """Compare the walk's operations with the model's own dense forward (see
        :func:`trl_dta.model_checks.probe`); raise if they differ, return whether packing leaves is exact.
        It runs in eval mode (no dropout), in the weights' dtype with autocast off: under bf16 autocast two
        exact methods already differ by ~1e-2, which would hide a wrong cache. The walk itself runs under
        whatever autocast the caller set."""
        modes = [(m, m.training) for m in self.model.modules()]
        self.model.eval()
        try:
            with torch.autocast(self.lm_head.weight.device.type, enabled=False):
                return model_checks.probe(self, try_packing=self.can_pack)
        finally:
            for m, mode in modes:
                m.training = mode

    # ---------------------------------------------------------------- compute
    @staticmethod
    def expand(path: Path | None, rows: int) -> Path | None:
        """The path seen by ``rows`` rows at once (a batch of sibling leaves): every tensor expanded, no
        copy."""
        if not path:
            return path
        return [
            [{k: t.expand(rows, *t.shape[1:]) for k, t in layer.items()} for layer in seg] for seg in path
        ]

    def forward(
        self,
        input_ids: torch.Tensor,
        start: int,
        path: Path | None,
        positions: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        kv: PathKV | None = None,
    ) -> tuple[torch.Tensor, list[LayerCache]]:
        """Decode ``input_ids`` ([B, L], positions ``start..start+L-1`` unless ``positions`` are given) on
        top of ``path`` (the caches of the segments that cover positions ``0..start-1``, root first, each
        with B rows: see :meth:`expand`), causally, or with a 4-D additive ``attention_mask``
        [B, 1, L, start + L]. Returns hidden states [B, L, D] and what the forward leaves per layer (its K/V,
        its final states: :data:`LayerCache`).

        ``kv``: the path's K/V in the walk's buffers (:class:`~trl_dta.path_kv.PathKV`) instead of in
        ``path``, which then holds only states; the new K/V are written there too (B = 1)."""
        hidden, caches, _ = self._decode(input_ids, start, path, positions, attention_mask, False, kv)
        return hidden, caches

    def forward_routed(
        self,
        input_ids: torch.Tensor,
        start: int,
        path: Path | None,
        positions: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        kv: PathKV | None = None,
    ) -> tuple[torch.Tensor, list[LayerCache], list[torch.Tensor]]:
        """:meth:`forward`, plus the MoE router logits of every router layer, each [B * L, num_experts]."""
        if not self.is_moe:
            raise ValueError(f"{type(self.base).__name__} has no MoE router.")
        return self._decode(input_ids, start, path, positions, attention_mask, True, kv)

    def _decode(self, input_ids, start, path, positions, attention_mask, router_logits: bool, kv=None):
        batch, length = input_ids.shape
        cache = _RecordingCache(path, self.layer_kinds, start, kv)
        if positions is None:
            positions = torch.arange(start, start + length, device=input_ids.device).expand(batch, length)
        extra = {} if attention_mask is None else {"attention_mask": attention_mask}
        if self.is_moe:  # ask explicitly: the config's own flag must not decide what the walk computes
            extra["output_router_logits"] = router_logits
        if length == 1 and path and self.has_states:
            raise ValueError(
                "a one-token forward on carried states would run the model's decode kernels, which may "
                "differ from its multi-token kernels or have no backward; the executor forwards such a token "
                "with the next ones instead."
            )
        out = self.decoder(
            input_ids=input_ids,
            position_ids=positions,
            use_cache=True,
            **{self.cache_keyword: cache},
            **extra,
        )
        name = type(self.base).__name__
        cache.finish(name)
        if not any(cache.new):
            raise ValueError(
                f"{name} ignores the passed KV cache (keyword {self.cache_keyword!r}); the tree walk needs a "
                "model that attends to a given past."
            )
        carried = torch.is_grad_enabled() and any(t.requires_grad for s in cache.incoming for t in s.values())
        for i, (kind, new) in enumerate(zip(self.layer_kinds, cache.new, strict=True)):
            # a recurrent state always depends on the one it started from: no graph means no backward
            lost = [k for k, t in new.items() if k.startswith("recurrent") and not t.requires_grad]
            lost = lost if carried else []
            if lost:
                raise ValueError(
                    f"{name}: layer {i} returned its {lost[0]} state without an autograd graph (a kernel "
                    "without backward): gradients through the state would be lost; not supported with this "
                    "kernel."
                )
            if kind in ("attention", "hybrid") and "k" not in new:
                raise ValueError(
                    f"{name}: layer {i} wrote no K/V to the passed cache; models that share or skip K/V "
                    "across layers are not supported."
                )
            if kind in ("state", "hybrid") and not set(new) - set(_KV):
                raise ValueError(
                    f"{name}: layer {i} keeps a recurrent or convolution state but wrote none through "
                    "transformers' cache API (update_conv_state / update_recurrent_state); not supported."
                )
        routers = None
        if router_logits:
            routers = list(getattr(out, "router_logits", None) or ())
            if not routers:
                raise ValueError(f"{name} returned no router logits.")
        return out.last_hidden_state, cache.new, routers

    def logits(self, hidden: torch.Tensor, temperature: float) -> torch.Tensor:
        """LM head logits of ``hidden`` in float32 (float64 for a float64 model), scaled, soft-capped, / T."""
        dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        if self.lm_head_fp32:
            with torch.autocast(hidden.device.type, enabled=False):
                bias = None if self.lm_head.bias is None else self.lm_head.bias.float()
                z = nn.functional.linear(hidden.float(), self.lm_head.weight.float(), bias)
        else:  # in the head's dtype, as models whose residual stream is float32 (Mamba2) cast it
            z = self.lm_head(hidden.to(self.lm_head.weight.dtype))
        z = z.to(dtype)
        if self.logit_scale != 1.0:
            z = z * self.logit_scale
        if self.softcap is not None:
            z = self.softcap * torch.tanh(z / self.softcap)
        return z / temperature if temperature != 1.0 else z
