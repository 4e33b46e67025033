"""The flash varlen kernels stood in for on a CPU: the walk's CUDA attention path, run where no GPU is.

On CUDA the walk attends per segment with torch's ``varlen_attn`` (:mod:`trl_dta.walk.attention.
torch_varlen`) or flash-attn's ``flash_attn_varlen_func`` (:mod:`trl_dta.walk.attention.flash_attn_varlen`),
which have no CPU kernel. :func:`reference_varlen_attn` computes what the first computes, written plainly
(each segment's queries against its keys, causal aligned bottom-right for ``window_size=(-1, 0)``), and checks
its arguments as the kernel takes them (``(T, H, D)`` tensors, int32 cumulative lengths, the longest lengths);
:func:`reference_flash_attn_varlen_func` is the same with flash-attn's signature. :func:`flash_on_cpu` and
:func:`flash_attn_on_cpu` are the walk's two flash kernels on a CPU with such a function, so that tests check
that path's layout (the gathered keys, the cumulative lengths, the heads, the output's shape) exactly in
float64, and benchmarks count what a GPU walk dispatches: :func:`counted_varlen_attn` is the same kernel as
one operator forward and one backward, as the flash kernel launches.

``gqa_flag``: the kernel takes an ``enable_gqa`` argument (torch >= 2.12), or takes fewer K/V heads as they
are (torch 2.11); both are checked.
"""

from __future__ import annotations

import torch

from ..walk.attention.flash_attn_varlen import FlashAttnVarlen
from ..walk.attention.torch_varlen import TorchVarlen


def _check(query, key, cu_seq_q, cu_seq_k, max_q, max_k, window_size) -> None:
    assert query.dim() == 3 and key.dim() == 3, "varlen_attn takes (T, H, D) tensors"
    assert query.stride(-1) == 1 and key.stride(-1) == 1, "the kernel needs a contiguous last dimension"
    assert cu_seq_q.dtype == cu_seq_k.dtype == torch.int32, "cumulative lengths are int32"
    assert cu_seq_q.numel() == cu_seq_k.numel(), "as many key runs as query runs"
    q_lens, k_lens = cu_seq_q.diff().tolist(), cu_seq_k.diff().tolist()
    assert cu_seq_q[-1] == query.shape[0] and cu_seq_k[-1] == key.shape[0], "runs cover the tensors"
    assert max(q_lens) == max_q and max(k_lens) == max_k, "max_q and max_k are the longest runs"
    assert tuple(window_size) in ((-1, -1), (-1, 0)), "the walk asks for full or causal attention"
    assert query.shape[1] % key.shape[1] == 0, "query heads are a multiple of K/V heads"


def _attend(q, k, v, scale, causal):
    """One run: q [n, H, D], k/v [m, Hkv, D] -> [n, H, D], causal aligned bottom-right; in bf16/fp16 with
    float32 accumulation and the output rounded once, as the flash kernel computes (float32/64 as given)."""
    dtype = q.dtype
    q, k, v = (t.to(torch.promote_types(dtype, torch.float32)) for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    scores = torch.einsum("nhd,mhd->hnm", q, k) * scale
    if causal:
        n, m = q.shape[0], k.shape[0]
        visible = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n)
        scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hnm,mhd->nhd", scores.softmax(-1), v).to(dtype)


def reference_varlen_attn(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
):
    """What ``varlen_attn`` computes (torch 2.11's signature), on any device, differentiable by autograd."""
    _check(query, key, cu_seq_q, cu_seq_k, max_q, max_k, window_size)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    q_cu, k_cu = cu_seq_q.tolist(), cu_seq_k.tolist()
    outs = [
        _attend(query[a:b], key[c:d], value[c:d], scale, tuple(window_size) == (-1, 0))
        for a, b, c, d in zip(q_cu, q_cu[1:], k_cu, k_cu[1:], strict=False)
    ]
    return torch.cat(outs)


def reference_varlen_attn_gqa(
    query,
    key,
    value,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    *,
    return_aux=None,
    scale=None,
    window_size=(-1, -1),
    enable_gqa=False,
):
    """The same with torch >= 2.12's signature: fewer K/V heads only with ``enable_gqa=True``."""
    assert enable_gqa == (query.shape[1] != key.shape[1]), "enable_gqa exactly where K/V heads are fewer"
    return reference_varlen_attn(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size
    )


# ---------------------------------------------------------------------- one operator each way (op counts)
@torch.library.custom_op("trl_dta_testing::varlen", mutates_args=())
def _varlen_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, scale: float
) -> torch.Tensor:
    with torch.no_grad():
        return reference_varlen_attn(
            q, k, v, cu_q, cu_k, *_longest(cu_q, cu_k), scale=scale, window_size=(-1, 0)
        )


@_varlen_op.register_fake
def _(q, k, v, cu_q, cu_k, scale):
    return torch.empty_like(q)


@torch.library.custom_op("trl_dta_testing::varlen_backward", mutates_args=())
def _varlen_backward_op(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    groups = q.shape[1] // k.shape[1]
    q_cu, k_cu = cu_q.tolist(), cu_k.tolist()
    for a, b, c, d in zip(q_cu, q_cu[1:], k_cu, k_cu[1:], strict=False):
        # the attention backward, per run: P = softmax(S), dS = P * (dP - rowsum(dO * O))
        kk, vv = (t[c:d].repeat_interleave(groups, dim=1) for t in (k, v))
        n, m = b - a, d - c
        scores = torch.einsum("nhd,mhd->hnm", q[a:b], kk) * scale
        scores = scores.masked_fill(
            ~torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n), float("-inf")
        )
        p = scores.softmax(-1)
        out = torch.einsum("hnm,mhd->nhd", p, vv)
        dp = torch.einsum("nhd,mhd->hnm", grad[a:b], vv)
        ds = p * (dp - (grad[a:b] * out).sum(-1).transpose(0, 1)[..., None])
        dq[a:b] = torch.einsum("hnm,mhd->nhd", ds, kk) * scale
        dkk = torch.einsum("hnm,nhd->mhd", ds, q[a:b]) * scale
        dvv = torch.einsum("hnm,nhd->mhd", p, grad[a:b])
        dk[c:d] = dkk.unflatten(1, (k.shape[1], groups)).sum(2)
        dv[c:d] = dvv.unflatten(1, (k.shape[1], groups)).sum(2)
    return dq, dk, dv


@_varlen_backward_op.register_fake
def _(grad, q, k, v, cu_q, cu_k, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, scale = inputs
    ctx.save_for_backward(q, k, v, cu_q, cu_k)
    ctx.scale = scale


def _backward(ctx, grad):
    q, k, v, cu_q, cu_k = ctx.saved_tensors
    return (*_varlen_backward_op(grad.contiguous(), q, k, v, cu_q, cu_k, ctx.scale), None, None, None)


_varlen_op.register_autograd(_backward, setup_context=_setup)


def _longest(cu_q, cu_k) -> tuple[int, int]:
    return int(cu_q.diff().max()), int(cu_k.diff().max())


def counted_varlen_attn(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
):
    """:func:`reference_varlen_attn` (causal) as one operator forward and one backward."""
    assert tuple(window_size) == (-1, 0)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return _varlen_op(query, key, value, cu_seq_q, cu_seq_k, scale)


def flash_on_cpu(function=reference_varlen_attn) -> TorchVarlen:
    """torch's flash kernel with ``function`` (``varlen_attn``'s signature) in place of ``varlen_attn``, on
    any device and dtype and not checked first (tests break it on purpose): an executor's
    ``attention_kernel``."""
    return TorchVarlen(function, devices=None)


def reference_flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, **kwargs):
    """What flash-attn's ``flash_attn_varlen_func`` computes (its signature: ``softmax_scale``, ``causal``
    aligned bottom-right)."""
    scale, causal = kwargs.pop("softmax_scale", None), kwargs.pop("causal", False)
    assert dropout_p == 0.0 and not kwargs, "the walk asks for no dropout and no other option"
    window = (-1, 0) if causal else (-1, -1)
    return reference_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window)


def flash_attn_on_cpu(function=reference_flash_attn_varlen_func, module="flash_attn") -> FlashAttnVarlen:
    """flash-attn's kernel (``module``: FA2's or FA3's) with ``function`` in its place, as
    :func:`flash_on_cpu`."""
    return FlashAttnVarlen(module, function, devices=None)
