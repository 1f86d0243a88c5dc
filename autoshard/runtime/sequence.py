"""Sequence parallelism's all-gather (Megatron-SP's *g-bar*): all-gather forward, reduce-scatter backward.

In a sequence-parallel region norms and residuals are sharded along the sequence on the model axis; before a
column-parallel linear the activation is all-gathered (``all_gather``) and, being a replicated tensor that feeds
sharded work, its gradient is summed over the axis (``grad_all_reduce``). Backward then runs an all-reduce and keeps
this rank's slice: twice the bytes of the reduce-scatter that computes the same slice. Codegen
(:func:`autoshard.codegen.localize`) fuses that pair into :func:`all_gather_sync`, so a sequence-parallel layer
moves exactly the bytes of a Megatron layer: reduce-scatter + all-gather forward, all-gather + reduce-scatter
backward. Sums run over the axes in the order of ``axes``, as the unfused pair does.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from autoshard.runtime.comm import Communicator, current

__all__ = ["all_gather_sync"]


class _AllGatherSync(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm: Communicator, axis: str, dim: int, axes: tuple[str, ...]):
        ctx.comm, ctx.axis, ctx.dim, ctx.axes = comm, axis, dim, axes
        return comm.all_gather(x, axis, dim)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        comm, axis = ctx.comm, ctx.axis
        k = ctx.axes.index(axis)
        for a in ctx.axes[:k]:
            grad = comm.all_reduce(grad, a, phase="backward")
        grad = comm.reduce_scatter(grad, axis, ctx.dim, phase="backward")
        for a in ctx.axes[k + 1 :]:
            grad = comm.all_reduce(grad, a, phase="backward")
        return grad, None, None, None, None


def all_gather_sync(x: torch.Tensor, axis: str, dim: int, axes: tuple[str, ...]) -> torch.Tensor:
    """Shard(dim) → Replicate on ``axis``; backward sums the gradient over ``axes`` (which holds ``axis``) and
    keeps this rank's chunk along ``dim``: a reduce-scatter on ``axis``, all-reduces on the others."""
    comm = current()
    axis = comm._axis(axis)
    axes = tuple(comm._axis(a) for a in ((axes,) if isinstance(axes, str) else axes))
    if dim < 0:
        dim += x.dim()
    return _AllGatherSync.apply(x, comm, axis, dim, axes)
