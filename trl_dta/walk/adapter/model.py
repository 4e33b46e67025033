"""What the walk needs from a Hugging Face causal LM: a decoder forward on a cached path, and an LM head.

:class:`CausalLM` wraps a ``transformers`` causal LM (plain or PEFT-wrapped) and offers two operations:

* :meth:`CausalLM.forward`: run the decoder on new tokens on top of the path before them (its K/V in the
  walk's :class:`~trl_dta.walk.path_kv.PathKV`; for hybrid and state-space models, the last segment's conv /
  recurrent states) and return the final hidden states and what the new tokens leave in each layer's cache
  (:mod:`trl_dta.walk.adapter.cache`), with their autograd graph when grad is enabled;
* :meth:`CausalLM.logits`: the LM head, with the model's logit scale and soft-capping (the same transform
  TRL's fused LM head applies), divided by a temperature, in at least float32.

A value model (a critic: a ``*ForTokenClassification``, or a ``*ForSequenceClassification`` whose head is
applied per token, with ``num_labels=1``) is walked the same way, its d -> 1 ``score`` head in the LM head's
place (:attr:`CausalLM.value_head`): :meth:`CausalLM.logits` then gives one value per position.

Models it cannot run exactly are refused with :class:`~trl_dta.walk.errors.UnsupportedModelError` when
wrapped, or at a call for limits that depend on the sequences (attention windows, length-dependent RoPE):
:mod:`trl_dta.walk.adapter.checks` holds the checks, :mod:`trl_dta.walk.adapter.probe` the probe that compares
the walk's operations with the model's own dense forward.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from typing import NamedTuple

import torch
from torch import nn

from ..attention.kernel import AttentionKernel
from ..attention.kernels import head_shape, model_kernel, own_attention
from ..attention.segment_attention import attending
from ..attention.segment_layout import SegmentLayout
from ..distributed.sharding import gathered_for_check, is_fsdp1
from ..errors import UnsupportedModelError
from ..path_kv import PathKV
from . import checks
from .cache import LayerCache, RecordingCache, cache_kinds
from .determinism import check_deterministic
from .probe import kept_verdict
from .probe import probe as run_probe

logger = logging.getLogger(__name__)


class ForwardResult(NamedTuple):
    """What one decoder forward gives: hidden states [B, L, D], per layer what it leaves
    (:data:`~trl_dta.walk.adapter.cache.LayerCache`), and (when asked) each router layer's logits [B * L,
    E]."""

    hidden: torch.Tensor
    caches: list[LayerCache]
    routers: list[torch.Tensor] | None


def _base_model(model: nn.Module) -> nn.Module:
    """The ``transformers`` model under a PEFT wrapper (LoRA-style adapters; prompt learning is refused)."""
    if hasattr(model, "get_base_model") and hasattr(model, "peft_config"):
        if getattr(model.active_peft_config, "is_prompt_learning", False):
            raise UnsupportedModelError(
                "PEFT prompt-learning methods add virtual tokens and are not supported; use LoRA."
            )
        return model.get_base_model()
    return model


def _full_shape(param: torch.Tensor) -> torch.Size:
    """A parameter's shape, also while DeepSpeed ZeRO-3 has it partitioned (outside a walk's gather)."""
    return getattr(param, "ds_shape", param.shape)


def output_head(base: nn.Module) -> tuple[nn.Module | None, bool]:
    """``base``'s output layer and whether it is a value head: the LM head (output embeddings) of a causal
    LM, else the ``score`` (or ``classifier``) layer of a token- or sequence-classification model."""
    lm_head = base.get_output_embeddings()
    if lm_head is not None:
        return lm_head, False
    for name in ("score", "classifier"):
        head = getattr(base, name, None)
        if isinstance(head, nn.Module) and isinstance(getattr(head, "weight", None), torch.Tensor):
            return head, True
    return None, False


class CausalLM:
    """A causal LM seen as ``forward(tokens, path) -> hidden, new caches`` plus an LM head.

    Value models: a ``*ForTokenClassification`` (or ``*ForSequenceClassification``) with a d -> 1 head
    (``num_labels=1``) is walked as a causal LM whose LM head is that head (:attr:`value_head` True):
    :meth:`logits` gives [..., 1] values (no logit scale, soft-capping or temperature), the probe compares
    them with the model's own dense ``.logits``, and its input embeddings alone bound the token ids. Other
    classification heads are refused.

    Args:
        model: a ``transformers`` causal LM or value model, or a PEFT model wrapping one (LoRA-style adapters;
            prompt learning methods are refused).
        lm_head_fp32: run the LM head (or value head) projection in float32 (TRL's ``cast_lm_head_to_fp32``).
        probe: run the probe now, or take the verdict a :func:`~trl_dta.walk.adapter.preflight.preflight` of
        the same,
            unchanged model kept (recommended; a few forwards of at most 13 tokens). Without it, sibling
            leaves are never packed, since only the probe shows that packing is exact for the model, and a
            model without weights (on the meta device) is accepted: only its structure is checked
            (:mod:`trl_dta.walk.adapter.preflight`).
        kernel: the attention kernel its calls attend with (:mod:`trl_dta.walk.attention.kernel`); None:
            its ``attn_implementation``'s (:func:`~trl_dta.walk.attention.kernels.model_kernel`). One that
            attends per segment is used where the probe finds the model exact through it (a given one: else
            an error); :attr:`kernel` holds the one in use.
    """

    def __init__(
        self,
        model: nn.Module,
        lm_head_fp32: bool = False,
        probe: bool = True,
        kernel: AttentionKernel | None = None,
    ):
        if is_fsdp1(model):
            raise UnsupportedModelError(
                "the model is wrapped by FSDP1 (FullyShardedDataParallel), which the tree walk does not "
                "support; shard it with FSDP2 (torch.distributed.fsdp.fully_shard; accelerate: "
                "fsdp_version: 2)."
            )
        self.model = model
        self.base = base = _base_model(model)
        self.name = type(base).__name__
        if probe and any(p.is_meta for p in model.parameters()):
            raise ValueError(
                f"{self.name} has parameters on the meta device (built without weights, e.g. under "
                "init_empty_weights or device_map with offloading): load its weights, or materialize it "
                "with model.to_empty(device=...) and initialize them, before walking it."
            )
        self.config = base.config.get_text_config()
        self.decoder = base.get_decoder()
        if self.decoder is base:  # e.g. Llama 4: base_model_prefix names an attribute the text model lacks
            self.decoder = getattr(base, "model", None)
        self.lm_head_fp32 = lm_head_fp32
        if self.decoder is None or self.decoder is base:
            raise UnsupportedModelError(f"{self.name} is not a decoder + LM head causal LM; not supported.")
        self.logit_scale = checks.logit_scale(self.config)
        self.softcap = getattr(self.config, "final_logit_softcapping", None)
        self.cache_kinds = cache_kinds(self.config)
        self.has_states = any(k in ("state", "hybrid") for k in self.cache_kinds)
        # MoE: the router's expert count and top-k, as TRL's load-balancing loss reads them (None if dense)
        self.num_experts = getattr(self.config, "num_experts", None) if self.is_moe else None
        self.top_k = getattr(self.config, "num_experts_per_tok", None) if self.is_moe else None
        self.cache_keyword = self._cache_keyword()
        # attention window or chunk: longer sequences are refused at the call
        self.attention_window, self.window_kind = checks.attention_window(self.config)
        # RoPE whose frequencies depend on the call's length: exact up to this many tokens
        self.rope_limit, self.rope_kind = checks.rope_length_limit(base)
        self.position_limit = checks.learned_position_limit(self.decoder)
        self._warned_checkpointing = False
        self._deterministic_in: set[bool] = set()  # the modes (training flag) found deterministic
        checks.check_stateful_layers(self.config, self.name)
        self._probed = probe
        self._given_kernel = kernel
        self._bind()

    def _bind(self) -> None:
        """Take the model's current LM head and attention backend, and probe them (construction, and a call
        that finds either replaced)."""
        checks.check_attention_implementation(self.config)
        self.lm_head, self.value_head = self._output_embeddings()
        self._bound = self._binding()
        # Packing sibling leaves into one row needs a custom 4-D additive mask (eager, sdpa) that the model
        # applies as given (no window of its own, no index-based bias: the probe checks the latter). State
        # layers would carry one leaf's state into the next leaf of a packed row.
        impl = getattr(self.config, "_attn_implementation", None) or "eager"
        if impl == "flex_attention" and self.device.type == "cpu" and self._probed:  # (unprobed: not placed)
            raise UnsupportedModelError(
                "attn_implementation='flex_attention' is supported on CUDA only: torch's flex attention has "
                "no backward on CPU, and its compiled CPU kernels failed on the walk's calls (torch 2.13). "
                "Use 'sdpa' on CPU."
            )
        masks = ("eager", "sdpa", "flex_attention")  # backends that take the walk's masks
        self._may_pack = impl in masks and self.attention_window is None and not self.has_states
        # a kernel that attends per segment (segment_attention.py) is used where the probe finds it exact
        self.kernel = self._given_kernel or model_kernel(impl)
        self._may_segment = self.kernel.per_segment and self.attention_window is None and not self.has_states
        self.segment_attention = False  # (until the probe finds it exact)
        kept = kept_verdict(self) if self._probed else (False, False)  # (unprobed: never packs)
        self.can_pack, self.segment_attention = self.probe() if kept is None else kept
        if self.kernel.per_segment and not self.segment_attention:
            if self._given_kernel is not None and self._probed:
                raise UnsupportedModelError(
                    f"{self.name} cannot attend per segment with the kernel {self.kernel.name}: an attention "
                    "window, state layers, or calls the probe did not find exact (logged)."
                )
            self.kernel = own_attention(impl)

    def walk_kernel(self, dtype: torch.dtype | None = None) -> AttentionKernel:
        """The kernel the next walk's calls attend with: :attr:`kernel` resolved for the model's device, the
        attention dtype (``dtype``; None: autocast's where it is on, else the input embeddings') and its head
        shape (:meth:`~trl_dta.walk.attention.kernel.AttentionKernel.resolve`; the model's own attention:
        itself, its config's shape not read, which some configs hold per layer)."""
        if not self.kernel.per_segment:
            return self.kernel
        if dtype is None:
            embeddings = self.decoder.get_input_embeddings()
            dtype = (self.lm_head if embeddings is None else embeddings).weight.dtype
            if torch.is_autocast_enabled(self.device.type):
                dtype = torch.get_autocast_dtype(self.device.type)
        return self.kernel.resolve(self.device, dtype, head_shape(self.config))

    def _binding(self) -> tuple:
        lm_head, _ = output_head(self.base)
        shape = None if lm_head is None else tuple(_full_shape(lm_head.weight))
        return lm_head, shape, getattr(self.config, "_attn_implementation", None)

    @property
    def is_moe(self) -> bool:
        """Whether the model can return router logits (TRL's test for an MoE model)."""
        return hasattr(self.config, "output_router_logits")

    @property
    def device(self) -> torch.device:
        """Where token ids, positions and masks go: the input embeddings' device."""
        embeddings = self.decoder.get_input_embeddings()
        return (self.lm_head if embeddings is None else embeddings).weight.device

    # ---------------------------------------------------------------- checks
    def _cache_keyword(self) -> str:
        params = inspect.signature(self.decoder.forward).parameters
        for name in ("cache", "past_key_values"):  # transformers >= 5.24 / older
            if name in params:
                return name
        raise UnsupportedModelError(
            f"{type(self.decoder).__name__}.forward takes no KV cache; the tree walk needs one."
        )

    def _output_embeddings(self) -> tuple[nn.Module, bool]:
        lm_head, value_head = output_head(self.base)
        if lm_head is None:
            raise UnsupportedModelError(f"{self.name} is not a decoder + LM head causal LM; not supported.")
        outputs = _full_shape(lm_head.weight)[0]
        if value_head and outputs != 1:
            raise UnsupportedModelError(
                f"{self.name} has a classification head with {outputs} outputs: the tree walk runs a value "
                "model only with one output per token (a d -> 1 head, num_labels=1); not supported."
            )
        if self.lm_head_fp32 and type(lm_head) is not nn.Linear:
            raise ValueError("lm_head_fp32=True needs a plain nn.Linear LM head (no adapter on it).")
        return lm_head, value_head

    @property
    def vocab_size(self) -> int:
        """Ids the model can both embed and score (the smaller of its current input and output embeddings; a
        value model's input embeddings alone: it scores no ids)."""
        embeddings, (head, _) = self.base.get_input_embeddings(), output_head(self.base)
        sizes = [] if self.value_head else [_full_shape((head or self.lm_head).weight)[0]]
        if embeddings is not None:
            sizes.append(_full_shape(embeddings.weight)[0])
        return min(sizes)

    def check_sequences(self, trie) -> None:
        """Checks of a call's sequences (a :class:`~trl_dta.PrefixTrie`), before any forward: every id has an
        embedding and a logit, and no sequence exceeds a learned position table or a length limit."""
        checks.check_vocabulary(trie, self.vocab_size)
        checks.check_positions(trie, self.position_limit)
        checks.check_length(self, trie.max_depth)

    def check_model(self) -> None:
        """Checks of the model's current state and mode at a call: the LM head and attention backend are those
        the executor probed (bound and probed again if either was replaced, e.g. by
        ``resize_token_embeddings``), and no randomness is on (by setting; by behaviour at the first call in
        each mode)."""
        binding = self._binding()
        if binding[0] is not self._bound[0] or binding[1:] != self._bound[1:]:
            logger.info("%s: its LM head or attention backend changed; binding and probing again.", self.name)
            self._bind()
        checks.check_no_randomness(self.model)
        if self.model.training not in self._deterministic_in:
            check_deterministic(self.model, self.base, self.device, self.name)
            self._deterministic_in.add(self.model.training)

    def check_call(self, trie) -> None:
        """Both checks of a call: :meth:`check_model` and :meth:`check_sequences`."""
        self.check_model()
        self.check_sequences(trie)

    @contextlib.contextmanager
    def no_gradient_checkpointing(self):
        """Switch gradient checkpointing off for the walk (HF layers drop a passed cache under it); restore it
        after."""
        switched = [m for m in self.model.modules() if getattr(m, "gradient_checkpointing", False) is True]
        if switched and self.model.training and not self._warned_checkpointing:
            self._warned_checkpointing = True
            logger.warning(
                "Gradient checkpointing is on: it makes decoder layers drop the KV cache, so it is switched "
                "off during the tree walk and restored afterwards (the walk bounds activation memory itself)."
            )
        for m in switched:
            m.gradient_checkpointing = False
        try:
            yield
        finally:
            for m in switched:
                m.gradient_checkpointing = True

    def probe(self) -> tuple[bool, bool]:
        """Compare the walk's operations with the model's own dense forward
        (:func:`trl_dta.walk.adapter.probe.probe`); raise if they differ, return whether packing leaves is
        exact and whether attention per segment is. It
        runs in eval mode (no dropout), in the weights' dtype with autocast off: under bf16 autocast two exact
        methods already differ by ~1e-2, which would hide a wrong cache. The walk itself runs under whatever
        autocast the caller set."""
        modes = [(m, m.training) for m in self.model.modules()]
        self.model.eval()
        try:
            with (
                torch.autocast(self.device.type, enabled=False),
                gathered_for_check(self.model),
            ):
                verdict = run_probe(self, try_packing=self._may_pack, try_segments=self._may_segment)
                self._deterministic_in.add(False)  # (the probe's first check)
                return verdict
        finally:
            for m, mode in modes:
                m.training = mode

    # ---------------------------------------------------------------- compute
    def forward(
        self,
        input_ids: torch.Tensor,
        start: int,
        kv: PathKV,
        states: list[LayerCache] | None = None,
        positions: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        router_logits: bool = False,
        layout: SegmentLayout | None = None,
    ) -> ForwardResult:
        """Decode ``input_ids`` ([B, L], positions ``start..start+L-1`` unless ``positions`` are given) on top
        of the path's K/V at positions ``[0, start)`` of ``kv`` and the ``states`` its last segment left (each
        with B rows: :func:`~trl_dta.walk.adapter.cache.expand_states`), causally, or with a 4-D additive
        ``attention_mask`` [B, 1, L, start + L]. The new K/V are written into ``kv`` too (when B is 1).
        ``router_logits``: also return every router layer's logits (MoE models). ``layout``: the call's
        segments (one row), attended per segment where :attr:`segment_attention` (``attention_mask`` is then
        not used: pass None)."""
        if router_logits and not self.is_moe:
            raise ValueError(f"{self.name} has no MoE router.")
        batch, length = input_ids.shape
        if length == 1 and states and self.has_states:
            raise RuntimeError(
                "internal: a one-token forward on carried states would run the model's decode kernels, which "
                "may differ from its multi-token kernels or have no backward; the executor forwards such a "
                "token with the next ones instead."
            )
        cache = RecordingCache(states, self.cache_kinds, start, kv)
        if positions is None:
            positions = torch.arange(start, start + length, device=input_ids.device).expand(batch, length)
        if attention_mask is None and layout is None:  # (flex attention: the walk's own causal BlockMask)
            attention_mask = self.kernel.causal_mask(length, start, input_ids.device)
        extra = {} if attention_mask is None else {"attention_mask": attention_mask}
        if self.is_moe:  # ask explicitly: the config's own flag must not decide what the walk computes
            extra["output_router_logits"] = router_logits
        per_segment = layout is not None and self.segment_attention
        with attending(self.config, layout) if per_segment else contextlib.nullcontext():
            out = self.decoder(
                input_ids=input_ids,
                position_ids=positions,
                use_cache=True,
                **{self.cache_keyword: cache},
                **extra,
            )
        if per_segment:
            layout.check_used(self.cache_kinds.count("attention"), self.name)
        cache.finish(self.name)
        cache.check_written(self.name, self.cache_keyword)
        routers = None
        if router_logits:
            routers = list(getattr(out, "router_logits", None) or ())
            if not routers:
                raise UnsupportedModelError(f"{self.name} returned no router logits.")
        return ForwardResult(out.last_hidden_state, cache.new, routers)

    def logits(self, hidden: torch.Tensor, temperature: float) -> torch.Tensor:
        """LM head logits of ``hidden`` in float32 (float64 for a float64 model), scaled, soft-capped, / T; a
        value model's values [..., 1] (its head alone: ``temperature`` is the executor's to refuse)."""
        dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        if self.lm_head_fp32:
            with torch.autocast(hidden.device.type, enabled=False):
                bias = None if self.lm_head.bias is None else self.lm_head.bias.float()
                z = nn.functional.linear(hidden.float(), self.lm_head.weight.float(), bias)
        else:  # in the head's dtype, as models whose residual stream is float32 (Mamba2) cast it
            z = self.lm_head(hidden.to(self.lm_head.weight.dtype))
        z = z.to(dtype)
        if self.value_head:
            return z
        if self.logit_scale != 1.0:
            z = z * self.logit_scale
        if self.softcap is not None:
            z = self.softcap * torch.tanh(z / self.softcap)
        return z / temperature if temperature != 1.0 else z
