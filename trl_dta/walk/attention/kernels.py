"""Which kernel a model attends with (:func:`model_kernel`), and every kernel by name (:func:`named`).

By the model's ``attn_implementation``:

=======================================  =============================================================
``sdpa``                                 torch's flash varlen kernel on CUDA in bf16/fp16, else sdpa per
                                         segment (:mod:`.torch_varlen`, :mod:`.sdpa`)
``flash_attention_2`` / ``_3``           flash-attn's varlen kernel, per segment (:mod:`.flash_attn_varlen`)
``eager``                                its own attention with the walk's masks (:mod:`.masked`)
``flex_attention``                       flex attention's tiles (:mod:`.flex`)
=======================================  =============================================================

A kernel that attends per segment is used where the construction probe finds the model's calls exact
through it (:mod:`trl_dta.walk.adapter.probe`); elsewhere the model attends with its own attention
(:func:`own_attention`).
"""

from __future__ import annotations

from .flash_attn_varlen import MODULES, FlashAttnVarlen
from .flex import FLEX_TILES
from .kernel import AttentionKernel
from .masked import ModelAttention
from .sdpa import SDPA_SEGMENTS
from .torch_varlen import TORCH_VARLEN

_FLASH_ATTN = {impl: FlashAttnVarlen(module) for impl, module in MODULES.items()}


def model_kernel(implementation: str) -> AttentionKernel:
    """The kernel a model loaded with ``attn_implementation=implementation`` attends with (module
    docstring)."""
    if implementation == "sdpa":
        return TORCH_VARLEN
    if implementation in _FLASH_ATTN:
        return _FLASH_ATTN[implementation]
    return own_attention(implementation)


def own_attention(implementation: str) -> AttentionKernel:
    """The model's own attention, with the walk's masks where it takes them."""
    return FLEX_TILES if implementation == "flex_attention" else ModelAttention(implementation)


def head_shape(config) -> tuple[int, int, int]:
    """A model's attention heads, K/V heads and head dim, by its (text) ``config`` (zeros: no attention)."""
    heads = getattr(config, "num_attention_heads", None) or 0
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else 0)
    return heads, getattr(config, "num_key_value_heads", None) or heads, head_dim


def named(name: str) -> AttentionKernel:
    """A kernel by its :attr:`~trl_dta.walk.attention.kernel.AttentionKernel.name` (benchmarks' records)."""
    kernels = [SDPA_SEGMENTS, TORCH_VARLEN, FLEX_TILES, *_FLASH_ATTN.values()]
    kernels += [ModelAttention(impl) for impl in ("eager", "sdpa", *MODULES)]
    for kernel in kernels:
        if kernel.name == name:
            return kernel
    raise ValueError(f"no attention kernel {name!r}: one of {[k.name for k in kernels]}")
