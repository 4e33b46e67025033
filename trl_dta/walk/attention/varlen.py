"""What every flash kernel for variable-length batches shares (:class:`VarlenKernel`): the CUDA side of
attention per segment.

A call laid out as runs of queries, each with its own keys (:class:`~trl_dta.walk.attention.segment_layout.
SegmentLayout`), is one kernel per layer forward and one backward, on every segment's keys gathered into one
tensor. Segments that share a past each get a copy of its K/V for the kernel: the gather is checkpointed, not
kept for the backward but gathered again there with the kernel's forward (one more attention forward per
packed call); a lone segment reads the path's buffer in place. So a call keeps nothing for its backward
beyond its tokens' own, and computes only the pairs the tree needs.

Where it runs (:meth:`VarlenKernel.resolve`): CUDA, bf16/fp16 (the activations', or autocast's), the
kernel's function importable, and the kernel checked once against sdpa for the head shape
(:mod:`trl_dta.walk.attention.check`); elsewhere, the sdpa kernel (:mod:`trl_dta.walk.attention.sdpa`).
Subclasses say which function runs (:meth:`VarlenKernel.function`) and how it is called
(:meth:`VarlenKernel.run`): torch's (:mod:`.torch_varlen`), flash-attn's (:mod:`.flash_attn_varlen`).
"""

from __future__ import annotations

import logging

import torch
from torch.utils.checkpoint import checkpoint

from . import check
from .kernel import AttentionKernel
from .sdpa import SDPA_SEGMENTS

logger = logging.getLogger(__name__)

HALF = (torch.float16, torch.bfloat16)


class VarlenKernel(AttentionKernel):
    """A flash kernel for variable-length batches (module docstring). ``devices``: the device kinds it runs
    on (None: any, with any dtype, not checked first: a stand-in on a CPU, :mod:`trl_dta.testing.varlen`,
    which tests break on purpose)."""

    devices: tuple[str, ...] | None = ("cuda",)

    def function(self):
        """The kernel's function, or None where it is not available (the package or torch too old)."""
        raise NotImplementedError

    def run(self, q, k, v, layout, scale: float) -> torch.Tensor:
        """The function on queries [T, H, D] and gathered keys and values [sum(k_lens), Hkv, D]."""
        raise NotImplementedError

    def unavailable(self) -> str | None:
        """Why this kernel cannot run here at all (None: it can)."""
        return None if self.function() is not None else "is not installed"

    def resolve(self, device, dtype, shape):
        if self.devices is not None and (device.type not in self.devices or dtype not in HALF):
            return SDPA_SEGMENTS  # (the kernel's domain: no warning)
        why = self.unavailable()
        if why is not None:
            warn_once(self, f"{why}: the walk attends per segment with sdpa instead")
            return SDPA_SEGMENTS
        if self.devices is None:
            return self
        return self if check.passes(self, device, dtype, shape) else SDPA_SEGMENTS

    def takes(self, q, dtype) -> bool:
        return self.devices is None or (q.device.type in self.devices and dtype in HALF)

    def attend(self, q, k, v, layout, scale: float, dtype) -> torch.Tensor:
        """The kernel on the gathered keys, the gather recomputed in the backward (checkpointed): what is
        kept is the path buffer's views, not a copy of the past for every segment that shares it."""

        def attend(q, k, v):
            q, k, v = (t.to(dtype) for t in (q, *layout.gather(k, v)))
            _check_covered(q, k, v, layout)
            return self.run(q, k, v, layout, scale)

        if layout.key_index is None or not torch.is_grad_enabled():  # (a lone segment: the buffer in place)
            return attend(q, k, v)
        return checkpoint(attend, q, k, v, use_reentrant=False, preserve_rng_state=False)


_WARNED: set = set()


def warn_once(kernel, message: str) -> None:
    if kernel.name not in _WARNED:
        _WARNED.add(kernel.name)
        logger.warning("The attention kernel %s %s.", kernel.name, message)


def _check_covered(q, k, v, layout) -> None:
    """Refuse a call whose ``q``, ``k`` or ``v`` is not exactly as long as its last cumulative length: torch's
    varlen backward returns NaN without an error where a tensor is longer (pytorch issue 176793, no check up
    to torch 2.13), and reads past a shorter one. The lengths are the layout's host ones (no device sync).
    The walk's calls meet it by construction: the attention function checks the call's keys against
    ``start + tokens`` and a lone segment's keys are that view of the path buffer, whatever its capacity."""
    queries, keys = layout.tokens, sum(layout.k_lens)
    if q.shape[0] != queries or k.shape[0] != keys or v.shape[0] != keys:
        raise RuntimeError(
            f"internal: the flash kernel would get {q.shape[0]} queries and {k.shape[0]}/{v.shape[0]} keys/"
            f"values for runs of {queries} and {keys} (its backward returns NaN where a tensor is longer)"
        )
