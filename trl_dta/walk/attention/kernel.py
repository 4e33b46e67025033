"""The attention-kernel interface: the one object a walk asks how its calls attend.

A kernel is chosen for a model once (:mod:`trl_dta.walk.attention.kernels`: by its ``attn_implementation``,
or the kernel the executor was given) and held by the model adapter. At each walk's plan the executor
*resolves* it for the calls about to run (:meth:`AttentionKernel.resolve`: the device, the attention dtype,
the head shape), and that resolved kernel is what every part of the walk asks:

* the plan and the cost model: :meth:`~AttentionKernel.pairs`, the query-key pairs a packed call computes;
* the memory model: :meth:`~AttentionKernel.kept_bytes`, what a call keeps for its backward beyond its
  tokens' own activations (and :attr:`~AttentionKernel.keeps_keys`, whether the plan counts a packed call's
  gathered keys against its budget);
* the model call: :meth:`~AttentionKernel.attend` (a kernel that attends per segment, through the walk's
  attention function, :mod:`trl_dta.walk.attention.segment_attention`), or the masks the model's own
  attention takes (:meth:`~AttentionKernel.row_mask`, :meth:`~AttentionKernel.causal_mask`);
* the metrics: :attr:`~AttentionKernel.name`, per model call (``tree/attention_calls/<name>``).

So the kernel a plan is priced for is the kernel its calls run. Adding one is one file: a subclass that says
where it runs (``resolve``), how it attends, what it computes and keeps; docs/development.md, "Add a kernel".
"""

from __future__ import annotations

import torch


class AttentionKernel:
    """How a walk's calls attend (module docstring). The defaults are those of a kernel that attends per
    segment, computes only the pairs the tree needs and keeps nothing for its backward."""

    name: str = ""  # in metrics (tree/attention_calls/<name>) and the cost model's key
    per_segment: bool = True  # attends a call's SegmentLayout (else: the model's own attention, with masks)
    keeps_keys: bool = False  # a packed call keeps its segments' gathered keys for the backward

    def resolve(self, device: torch.device, dtype: torch.dtype, shape: tuple[int, ...]) -> AttentionKernel:
        """The kernel that runs calls on ``device`` attending in ``dtype`` with ``shape`` (heads, K/V heads,
        head dim): this one, or the one it falls back to where it cannot (saying why, once)."""
        return self

    def takes(self, q: torch.Tensor, dtype: torch.dtype) -> bool:
        """Whether a call's queries ``q`` attending in ``dtype`` are what it was resolved for (the dispatch
        asks; a call that is not is attended by the sdpa kernel, with a warning)."""
        return True

    def attend(self, q, k, v, layout, scale: float, dtype: torch.dtype) -> torch.Tensor:
        """Each segment's queries ``q`` [T, H, D] against the keys it sees in ``k``, ``v`` [start + T, Hkv, D]
        (the path's and the call's; ``layout``, the call's :class:`~trl_dta.walk.attention.segment_layout.
        SegmentLayout`, gathers a segment's), causal aligned
        bottom-right, attending in ``dtype`` → [T, H, D]."""
        raise NotImplementedError(f"{type(self).__name__} does not attend per segment")

    def pairs(self, past: int, tokens: int, needed: int) -> int:
        """The query-key pairs one packed call computes: ``tokens`` on a past of ``past``, the tree needing
        ``needed`` of them."""
        return needed

    def kept_bytes(self, segments, row: bool, per, config) -> float:
        """Bytes one call of ``segments`` (a packed ``row``, or a lone segment) keeps for its backward beyond
        its tokens' own activations, by ``per`` (:class:`~trl_dta.walk.memory.memory_model.ActivationBytes`)
        for a model of ``config``."""
        if self.keeps_keys and len(segments) > 1:
            return per.key * sum(s.end for s in segments)
        return 0.0

    def row_mask(self, row, start: int, dtype: torch.dtype):
        """The mask a packed row is forwarded with through the model's own attention (None: per segment)."""
        return None

    def causal_mask(self, tokens: int, start: int, device):
        """The mask a one-row call is forwarded with through the model's own attention (None: the model's)."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"
