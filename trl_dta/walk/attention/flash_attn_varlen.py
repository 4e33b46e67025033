"""flash-attn's own kernel for variable-length batches, ``flash_attn_varlen_func``: the kernel of a model
loaded with ``attn_implementation="flash_attention_2"`` (the ``flash-attn`` package, the ``gpu`` extra) or
``"flash_attention_3"`` (``flash_attn_interface``, flash-attn's Hopper build), as TRL's GPU recipes load
them (:mod:`.varlen`: what the flash kernels share).

Its causal mask is aligned bottom-right (flash-attn >= 2.1), grouped-query attention takes fewer K/V heads as
they are, cumulative lengths are int32: the layout's. FA3's function returns the output, or the output and
the softmax's log-sum-exp (older builds): the output is taken. Where the package is not importable (a model
switched to ``flash_attention_2`` on a machine without it), the walk attends with torch's kernel, with a
warning.
"""

from __future__ import annotations

import importlib

from .torch_varlen import TORCH_VARLEN
from .varlen import VarlenKernel, warn_once

MODULES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}


class FlashAttnVarlen(VarlenKernel):
    """``flash_attn_varlen_func`` of flash-attn's ``module`` (``flash_attn``: FA2, ``flash_attn_interface``:
    FA3), or ``function`` with its signature (a stand-in: :mod:`trl_dta.testing.varlen`) on ``devices``."""

    def __init__(self, module: str = "flash_attn", function=None, devices=("cuda",)):
        self.module, self._function, self.devices = module, function, devices
        self.name = "flash_attn_varlen" if module == "flash_attn" else "flash_attn3_varlen"

    def function(self):
        if self._function is None:
            try:
                self._function = importlib.import_module(self.module).flash_attn_varlen_func
            except (ImportError, AttributeError):
                return None
        return self._function

    def resolve(self, device, dtype, shape):
        if self.function() is None and (self.devices is None or device.type in self.devices):
            warn_once(self, f"needs the {self.module} package, not installed: torch's varlen kernel runs")
            return TORCH_VARLEN.resolve(device, dtype, shape)
        return super().resolve(device, dtype, shape)

    def run(self, q, k, v, layout, scale: float):
        max_q, max_k = max(layout.q_lens), max(layout.k_lens)
        kernel = self.function()
        out = kernel(q, k, v, layout.q_cu, layout.k_cu, max_q, max_k, softmax_scale=scale, causal=True)
        return out[0] if isinstance(out, tuple) else out
