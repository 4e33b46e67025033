"""What the tree executor needs from a Hugging Face causal LM, and the checks that make it safe to use.

:class:`CausalLM` wraps a ``transformers`` causal LM (plain or PEFT-wrapped) and offers two operations:

* :meth:`CausalLM.forward`: run the decoder on new tokens on top of given past K/V and return the final
  hidden states and the new tokens' own K/V (with their autograd graph when grad is enabled);
* :meth:`CausalLM.logits`: the LM head, with the model's logit scale and soft-capping (the same transform
  TRL's fused LM head applies), divided by a temperature, in at least float32.

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
from transformers.cache_utils import Cache, DynamicLayer

from . import model_checks

logger = logging.getLogger(__name__)

SUPPORTED_ATTENTION = ("eager", "sdpa", "flash_attention_2", "flash_attention_3")


# Per layer, the path's K/V: one (K, V) pair [B, kv_heads, length, head_dim], or a list of such pieces (one
# per segment on the walk's stack, in order), concatenated only when the forward needs them.
Past = list["tuple[torch.Tensor, torch.Tensor] | list[tuple[torch.Tensor, torch.Tensor]]"]


class _PathLayer(DynamicLayer):
    """One layer of the walk's cache: the path's K/V kept as the stack's pieces, joined with the new tokens'
    K/V in a single concatenation when the layer runs (a pre-filled DynamicCache would copy the path twice
    more: once to fill, once to append). Pieces kept in float32 for gradient accumulation are cast to the
    new K/V's dtype in the same step."""

    def __init__(self, pieces: list[tuple[torch.Tensor, torch.Tensor]]):
        super().__init__()
        self.pieces = pieces
        self.past_length = sum(k.shape[-2] for k, _ in pieces)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = torch.cat([k.to(key_states.dtype) for k, _ in self.pieces] + [key_states], dim=-2)
        self.values = torch.cat([v.to(value_states.dtype) for _, v in self.pieces] + [value_states], dim=-2)
        self.pieces = []
        self.past_length = self.keys.shape[-2]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.past_length


class _RecordingCache(DynamicCache):
    """A cache holding the path's K/V (per layer, as pieces) that records each layer's new K/V as they
    arrive."""

    def __init__(self, past: Past | None, num_layers: int):
        layers = []
        for layer in past if past else [[]] * num_layers:
            pieces = [layer] if isinstance(layer, tuple) else list(layer)
            layers.append(_PathLayer(pieces))
        Cache.__init__(self, layers=layers)
        self.new: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.new[layer_idx] = (key_states, value_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


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
        self.can_pack = impl in ("eager", "sdpa") and self.attention_window is None
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
    def forward(
        self,
        input_ids: torch.Tensor,
        start: int,
        past: Past | None,
        positions: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Decode ``input_ids`` ([B, L], positions ``start..start+L-1`` unless ``positions`` are given) on
        top of ``past`` (per layer K, V of shape [B, kv_heads, start, head_dim], or a list of pieces that
        together cover positions ``0..start-1``), causally, or with a 4-D additive ``attention_mask``
        [B, 1, L, start + L]. Returns hidden states [B, L, D] and the new K/V per layer."""
        hidden, kv, _ = self._decode(input_ids, start, past, positions, attention_mask, False)
        return hidden, kv

    def forward_routed(
        self,
        input_ids: torch.Tensor,
        start: int,
        past: Past | None,
        positions: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
        """:meth:`forward`, plus the MoE router logits of every router layer, each [B * L, num_experts]."""
        if not self.is_moe:
            raise ValueError(f"{type(self.base).__name__} has no MoE router.")
        return self._decode(input_ids, start, past, positions, attention_mask, True)

    def _decode(self, input_ids, start, past, positions, attention_mask, router_logits: bool):
        batch, length = input_ids.shape
        cache = _RecordingCache(past, self.num_layers)
        if positions is None:
            positions = torch.arange(start, start + length, device=input_ids.device).expand(batch, length)
        extra = {} if attention_mask is None else {"attention_mask": attention_mask}
        if self.is_moe:  # ask explicitly: the config's own flag must not decide what the walk computes
            extra["output_router_logits"] = router_logits
        out = self.decoder(
            input_ids=input_ids,
            position_ids=positions,
            use_cache=True,
            **{self.cache_keyword: cache},
            **extra,
        )
        if not cache.new:
            raise ValueError(
                f"{type(self.base).__name__} ignores the passed KV cache (keyword {self.cache_keyword!r}); "
                "the tree walk needs a model that attends to a given past."
            )
        if len(cache.new) != self.num_layers:
            raise ValueError(
                f"{type(self.base).__name__}: {len(cache.new)} of {self.num_layers} layers wrote to the KV "
                "cache; "
                "models that share or skip K/V across layers are not supported."
            )
        routers = None
        if router_logits:
            routers = list(getattr(out, "router_logits", None) or ())
            if not routers:
                raise ValueError(f"{type(self.base).__name__} returned no router logits.")
        return out.last_hidden_state, [cache.new[i] for i in range(self.num_layers)], routers

    def logits(self, hidden: torch.Tensor, temperature: float) -> torch.Tensor:
        """LM head logits of ``hidden`` in float32 (float64 for a float64 model), scaled, soft-capped, / T."""
        dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        if self.lm_head_fp32:
            with torch.autocast(hidden.device.type, enabled=False):
                bias = None if self.lm_head.bias is None else self.lm_head.bias.float()
                z = nn.functional.linear(hidden.float(), self.lm_head.weight.float(), bias)
        else:
            z = self.lm_head(hidden)
        z = z.to(dtype)
        if self.logit_scale != 1.0:
            z = z * self.logit_scale
        if self.softcap is not None:
            z = self.softcap * torch.tanh(z / self.softcap)
        return z / temperature if temperature != 1.0 else z
