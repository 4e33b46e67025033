"""Torch's flash kernel for variable-length batches, ``torch.nn.attention.varlen.varlen_attn``: the kernel of
an sdpa model on CUDA in bf16/fp16 (:mod:`.varlen`: what the flash kernels share).

torch >= 2.11: causal as ``window_size=(-1, 0)`` (aligned bottom-right); grouped-query attention as it is in
2.11, with ``enable_gqa`` from 2.12; the signature is read at run time. torch 2.10's kernel (``is_causal``,
no scale) is not used.
"""

from __future__ import annotations

import functools
import inspect

from .varlen import VarlenKernel

try:  # torch >= 2.10
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - torch < 2.10
    varlen_attn = None


class TorchVarlen(VarlenKernel):
    """torch's ``varlen_attn``, or ``function`` with its signature (a stand-in: :mod:`trl_dta.testing.varlen`)
    on ``devices`` (None: any device and dtype)."""

    name = "torch_flash_varlen"

    def __init__(self, function=None, devices=("cuda",)):
        self._function, self.devices = function, devices

    def function(self):
        return self._function or varlen_attn

    def unavailable(self) -> str | None:
        if self.function() is None:
            return "is not in this torch (2.11 or later has it)"
        if _kwargs(self.function(), gqa=False) is None:
            return "takes no scale or causal window in this torch (2.11 or later)"
        return None

    def run(self, q, k, v, layout, scale: float):
        kwargs = _kwargs(self.function(), gqa=q.shape[1] != k.shape[1])
        max_q, max_k = max(layout.q_lens), max(layout.k_lens)
        return self.function()(q, k, v, layout.q_cu, layout.k_cu, max_q, max_k, scale=scale, **kwargs)


TORCH_VARLEN = TorchVarlen()


def _kwargs(function, gqa: bool) -> dict | None:
    """The keyword arguments of ``function`` (``varlen_attn``'s signature) for causal attention with a scale;
    None where it has no scale or causal switch (torch 2.10)."""
    params = _parameters(function)
    if "scale" not in params or "window_size" not in params:
        return None
    kwargs = {"window_size": (-1, 0)}  # causal, aligned bottom-right
    if "enable_gqa" in params:  # (torch >= 2.12; 2.11's kernel takes fewer K/V heads as they are)
        kwargs["enable_gqa"] = gqa
    return kwargs


@functools.lru_cache(maxsize=8)
def _parameters(function) -> frozenset:
    return frozenset(inspect.signature(function).parameters)
