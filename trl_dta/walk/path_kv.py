"""The K/V of the walk's current path: per attention layer, one preallocated buffer instead of a copy per
forward.

A forward on the path attends to the K/V of every segment below it. Kept as one tensor per segment, they
would be joined (copied) for every forward, and every forward with a graph would keep its own copy of the
path for backward. Here each attention layer has one buffer ``[1, kv_heads, capacity, head_dim]``: a forward
writes its new tokens' K/V at their cache positions ``[start, start + n)`` and attends to the view of
positions ``[0, start + n)``. The gradients a forward sends into the past K/V are added into a float32
gradient buffer of the same shape, where a segment finds its own when it is popped (:meth:`PathKV.take_grad`,
which also clears them for the next segment at those positions).

Why the views stay valid: the walk is depth-first. A forward at cache position ``start`` writes positions
``start`` and up; every graph still alive (the stack's segments, each attending to positions below its own
end, which is at most ``start``) reads only below. So the buffer is never written where a live graph reads.
Writes go through an alias with its own version counter, so autograd's guard against in-place changes of
saved tensors (which would count every write to the buffer) does not fire.

A batch of B > 1 rows (padded sibling leaves) shares the past but has its own new K/V per row: their keys
are the past, expanded (a view), joined with the new ones: one copy, of the batch's rows.
"""

from __future__ import annotations

import torch


class _Join(torch.autograd.Function):
    """``cat([past K or V at [0, start)], new], dim=-2)`` without copying the past when there is one row."""

    @staticmethod
    def forward(ctx, new, buffer, writer, grad_buffer, start):
        ctx.start, ctx.grad_buffer, ctx.new_dtype = start, grad_buffer, new.dtype
        rows, n = new.shape[0], new.shape[-2]
        if rows == 1:
            writer[..., start : start + n, :].copy_(new)
            return buffer[..., : start + n, :]
        past = buffer[..., :start, :].expand(rows, -1, -1, -1)
        return torch.cat([past.to(new.dtype), new], dim=-2)

    @staticmethod
    def backward(ctx, grad):
        start = ctx.start
        if start:
            past = grad[..., :start, :]
            ctx.grad_buffer[..., :start, :].add_(past.sum(0, keepdim=True) if past.shape[0] > 1 else past)
        return grad[..., start:, :].to(ctx.new_dtype), None, None, None, None


class PathKV:
    """Per attention layer, the K and V of the path's positions ``[0, capacity)`` and their gradients.

    Args:
        capacity: the most cache positions any forward of the walk reaches (its start + its new tokens).
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.buffers: dict[int, list[torch.Tensor]] = {}  # layer: [K, V]
        self.writers: dict[int, list[torch.Tensor]] = {}  # layer: aliases of [K, V] for writing
        self.grads: dict[int, list[torch.Tensor]] = {}  # layer: gradients of [K, V], at least float32
        self.dirty = 0  # positions at or above this have no gradient yet

    def join(self, layer: int, keys: torch.Tensor, values: torch.Tensor, start: int):
        """The keys and values a forward at cache position ``start`` attends to: the path's, then ``keys`` /
        ``values`` ([B, kv_heads, n, head_dim], the new tokens'), which are written at ``[start, start + n)``
        when B is 1."""
        if start + keys.shape[-2] > self.capacity:
            raise RuntimeError(
                f"internal: a forward reaches cache position {start + keys.shape[-2]}, past the walk's "
                f"capacity {self.capacity}"
            )
        if layer not in self.buffers:  # (uninitialised: a position is always written before it is read)
            shape = (1, keys.shape[1], self.capacity, keys.shape[-1])
            self.buffers[layer] = [keys.new_empty(shape), values.new_empty(*shape[:-1], values.shape[-1])]
            self.writers[layer] = [b.data for b in self.buffers[layer]]  # own version counters
        grads = [None, None]
        if torch.is_grad_enabled() and start:  # (no-grad walks, and forwards on no past, never need them)
            if layer not in self.grads:
                dtype = torch.float64 if keys.dtype == torch.float64 else torch.float32
                self.grads[layer] = [torch.zeros_like(b, dtype=dtype) for b in self.buffers[layer]]
            grads = self.grads[layer]
            self.dirty = max(self.dirty, start)
        return tuple(
            _Join.apply(new, buffer, writer, grad, start)
            for new, buffer, writer, grad in zip(
                (keys, values), self.buffers[layer], self.writers[layer], grads, strict=True
            )
        )

    def take_grad(self, layer: int, begin: int, end: int) -> list[torch.Tensor | None]:
        """The gradients collected so far for positions ``[begin, end)`` of ``layer``'s K and V (copies), and
        clear them there; None for a layer that never ran with gradients (e.g. a model's no-grad cycles)."""
        if layer not in self.grads:
            return [None, None]
        taken = []
        for grad in self.grads[layer]:
            taken.append(grad[..., begin:end, :].clone())
            grad[..., begin:end, :].zero_()
        return taken

    def has_grad(self, begin: int) -> bool:
        """Whether some forward may have sent gradients into positions ``begin`` and up."""
        return self.dirty > begin

    def popped(self, begin: int) -> None:
        """Positions ``begin`` and up hold no gradients any more (their segments were popped)."""
        self.dirty = min(self.dirty, begin)
