"""Autograd-aware collectives: the functions generated rank modules call, one per redistribution.

Each is a plain module-level function of a tensor and simple arguments (axis names as ``str``, dims as ``int``,
``axes`` as a tuple of ``str``), so FX graphs call it as a ``call_function`` node. Each looks up the calling
thread's communicator with :func:`~autoshard.runtime.comm.current` once, at forward time, and its backward uses
that same communicator (backward may run after the ``use`` block has ended). Backward collectives are recorded
with ``phase="backward"``.

The gradient convention (DESIGN.md, "Gradients"): the gradient of a *replicated* tensor is complete on every
rank, the gradient of a *sharded* tensor is this rank's slice, the gradient of a *partial* tensor is the full
gradient of the sum. Hence each backward is the conjugate of its forward:

=====================  ===============================  =========================================
function               forward                          backward
=====================  ===============================  =========================================
``all_reduce``         Partial → Replicate (sum)        identity
``grad_all_reduce``    identity (Megatron's *f*)        sum-all-reduce over each axis in ``axes``
``all_gather``         Shard(dim) → Replicate           keep this rank's slice (no communication)
``reduce_scatter``     Partial → Shard(dim)             all-gather along ``dim``
``all_to_all``         Shard(cat_dim) → Shard(split)    the inverse all-to-all
``local_slice``        Replicate → Shard(dim), no comm  all-gather along ``dim``
=====================  ===============================  =========================================

Backwards are ``once_differentiable``: their collectives are raw, so double backward raises instead of silently
losing terms.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch
from torch.autograd.function import once_differentiable

from autoshard.errors import AutoshardError
from autoshard.runtime.comm import PHASES, CollectiveRecord, Communicator, current
from autoshard.runtime.pending import PendingTensor

__all__ = [
    "all_gather",
    "all_reduce",
    "all_reduce_",
    "all_reduce_output",
    "all_to_all",
    "collective_counts",
    "grad_all_reduce",
    "linears_grad_all_reduce",
    "local_slice",
    "reduce_scatter",
]


def _chunk(comm: Communicator, t: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
    """This rank's contiguous chunk of ``t`` along ``dim`` (a view)."""
    dim = comm._dim(t, dim, "local_slice", axis, divisible=True)
    size = t.shape[dim] // comm.axis_size(axis)
    return t.narrow(dim, comm.axis_index(axis) * size, size)


class _AllReduce(torch.autograd.Function):
    """Partial → Replicate; backward is the identity. ``mode``: ``"copy"`` (a new tensor), ``"inplace"`` (the sum
    written into x's memory, x returned as a view — not marked dirty: codegen only uses it where x is read by
    nothing else and its producer's backward does not keep it, a matmul or add; were one kept, autograd's version
    check would raise, never compute wrong), ``"deferred"`` (started asynchronously, a PendingTensor returned)."""

    @staticmethod
    def forward(ctx, x, comm: Communicator, axis: str, mode: str = "copy"):
        if mode == "inplace":
            comm.all_reduce_(x.detach(), axis)
            return x.view_as(x)
        if mode == "deferred":
            buffer = x.detach().clone()
            handle = comm.all_reduce_async(buffer, axis, phase="forward")
            if handle.is_completed():  # the simulator's collectives complete at once
                return handle.wait()
            comm.pending.append(handle)
            return PendingTensor(buffer, handle)
        return comm.all_reduce(x, axis)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return grad, None, None, None


class _GradAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm: Communicator, axes: tuple[str, ...]):
        ctx.comm, ctx.axes = comm, axes
        # A view, not a copy: free, and autograd refuses in-place ops on it rather than computing wrong grads.
        return x.view_as(x)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        for axis in ctx.axes:
            grad = ctx.comm.all_reduce(grad, axis, phase="backward")
        return grad, None, None


class _LinearsGradAllReduce(torch.autograd.Function):
    """``linear(grad_all_reduce(x, axes), w_i, b_i)`` for every i, with an overlapped backward."""

    @staticmethod
    def forward(ctx, x, comm: Communicator, axes: tuple[str, ...], *params):
        ctx.comm, ctx.axes, ctx.k = comm, axes, len(params) // 2
        weights, biases = params[0::2], params[1::2]
        ctx.has_bias = [b is not None for b in biases]
        ctx.save_for_backward(x, *weights)
        return tuple(torch.nn.functional.linear(x, w, b) for w, b in zip(weights, biases))

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        grads = [torch.zeros(x.shape[:-1] + w.shape[:1], dtype=x.dtype, device=x.device) if g is None else g
                 for g, w in zip(grads, weights)]
        # the input gradient first (accumulated in one buffer by addmm_), its all-reduce started, then the weight
        # gradients while it travels
        g2s = [g.reshape(-1, g.shape[-1]) for g in grads]
        gx = handle = None
        if ctx.needs_input_grad[0]:
            gx = torch.mm(g2s[0], weights[0])
            for g2, w in zip(g2s[1:], weights[1:]):
                gx.addmm_(g2, w)
            gx = gx.view(x.shape)
            handle = ctx.comm.all_reduce_async(gx, ctx.axes[0], phase="backward")
        out = []
        x2 = x.reshape(-1, x.shape[-1])
        for i, g2 in enumerate(g2s):
            out.append(g2.t().mm(x2) if ctx.needs_input_grad[3 + 2 * i] else None)
            out.append(g2.sum(0) if ctx.has_bias[i] and ctx.needs_input_grad[4 + 2 * i] else None)
        if handle is not None:
            gx = handle.wait()
            for axis in ctx.axes[1:]:
                gx = ctx.comm.all_reduce(gx, axis, phase="backward")
        return (gx, None, None, *out)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm: Communicator, axis: str, dim: int):
        ctx.comm, ctx.axis, ctx.dim = comm, axis, dim
        return comm.all_gather(x, axis, dim)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return _chunk(ctx.comm, grad, ctx.axis, ctx.dim), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm: Communicator, axis: str, dim: int):
        ctx.comm, ctx.axis, ctx.dim = comm, axis, dim
        return comm.reduce_scatter(x, axis, dim)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return ctx.comm.all_gather(grad, ctx.axis, ctx.dim, phase="backward"), None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm: Communicator, axis: str, split_dim: int, cat_dim: int):
        ctx.comm, ctx.axis, ctx.split_dim, ctx.cat_dim = comm, axis, split_dim, cat_dim
        return comm.all_to_all(x, axis, split_dim, cat_dim)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        out = ctx.comm.all_to_all(grad, ctx.axis, split_dim=ctx.cat_dim, cat_dim=ctx.split_dim, phase="backward")
        return out, None, None, None, None


class _LocalSlice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm: Communicator, axis: str, dim: int):
        ctx.comm, ctx.axis, ctx.dim = comm, axis, dim
        # A copy: the shard is a new local tensor, so later in-place ops on it must not touch the replica.
        return _chunk(comm, x, axis, dim).clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return ctx.comm.all_gather(grad, ctx.axis, ctx.dim, phase="backward"), None, None, None


def _tensor(x, fn: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise AutoshardError(f"autoshard.runtime.{fn} got a {type(x).__name__}, but takes a torch.Tensor.")
    return x


def all_reduce(x: torch.Tensor, axis: str) -> torch.Tensor:
    """Partial → Replicate on ``axis``: sum over the group. Backward: identity."""
    comm = current()
    return _AllReduce.apply(_tensor(x, "all_reduce"), comm, comm._axis(axis))


def all_reduce_(x: torch.Tensor, axis: str) -> torch.Tensor:
    """``all_reduce`` written into ``x`` itself (codegen uses it where ``x`` is a matmul's result read only here): no
    output buffer to allocate. Falls back to ``all_reduce`` for leaves and non-contiguous tensors."""
    comm = current()
    x = _tensor(x, "all_reduce")
    if x.is_leaf or not x.is_contiguous() or torch.compiler.is_compiling():
        return _AllReduce.apply(x, comm, comm._axis(axis))
    return _AllReduce.apply(x, comm, comm._axis(axis), "inplace")


def all_reduce_output(x: torch.Tensor, axis: str) -> torch.Tensor:
    """``all_reduce`` of a value the program returns (the loss): started asynchronously, waited when the value is
    read or when the gradient bucketer finishes backward (:mod:`autoshard.runtime.pending`). Backward: identity."""
    comm = current()
    x = _tensor(x, "all_reduce")
    if torch.compiler.is_compiling():
        return _AllReduce.apply(x, comm, comm._axis(axis))
    comm.wait_pending()  # at most one step's outputs in flight
    return _AllReduce.apply(x, comm, comm._axis(axis), "deferred")


def grad_all_reduce(x: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
    """Identity forward; backward sums the gradient over each axis of ``axes`` in order (Megatron's *f*)."""
    comm = current()
    if isinstance(axes, str):
        axes = (axes,)
    axes = tuple(comm._axis(a) for a in axes)
    return _GradAllReduce.apply(_tensor(x, "grad_all_reduce"), comm, axes)


def linears_grad_all_reduce(x: torch.Tensor, axes: tuple[str, ...], *params) -> tuple[torch.Tensor, ...]:
    """``linear(grad_all_reduce(x, axes), w_i, b_i)`` for each ``(w_i, b_i)`` in ``params`` (flat pairs, ``b_i``
    may be None): the same values and gradients, but backward starts the input gradient's all-reduce before it
    computes the weight gradients, so the collective overlaps them (Megatron's asynchronous column-parallel
    all-reduce). Codegen uses it where every consumer of a ``grad_all_reduce`` is such a linear."""
    comm = current()
    if isinstance(axes, str):
        axes = (axes,)
    axes = tuple(comm._axis(a) for a in axes)
    return _LinearsGradAllReduce.apply(_tensor(x, "linears_grad_all_reduce"), comm, axes, *params)


def all_gather(x: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
    """Shard(dim) → Replicate on ``axis``. Backward: this rank's slice of the (complete) gradient."""
    comm = current()
    x = _tensor(x, "all_gather")
    return _AllGather.apply(x, comm, comm._axis(axis), _norm_dim(x, dim))


def reduce_scatter(x: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
    """Partial → Shard(dim) on ``axis``. Backward: all-gather of the gradient along ``dim``."""
    comm = current()
    x = _tensor(x, "reduce_scatter")
    return _ReduceScatter.apply(x, comm, comm._axis(axis), _norm_dim(x, dim))


def all_to_all(x: torch.Tensor, axis: str, split_dim: int, cat_dim: int) -> torch.Tensor:
    """Shard(cat_dim) → Shard(split_dim) on ``axis``. Backward: the inverse all-to-all."""
    comm = current()
    x = _tensor(x, "all_to_all")
    return _AllToAll.apply(x, comm, comm._axis(axis), _norm_dim(x, split_dim), _norm_dim(x, cat_dim))


def local_slice(x: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
    """Replicate → Shard(dim) on ``axis`` without communication. Backward: all-gather of the gradient."""
    comm = current()
    x = _tensor(x, "local_slice")
    return _LocalSlice.apply(x, comm, comm._axis(axis), _norm_dim(x, dim))


def _norm_dim(x: torch.Tensor, dim: int) -> int:
    # Backward gradients have the forward's rank, so a negative dim would mean the same; normalising once keeps
    # the backward independent of that. Out-of-range dims are left for the communicator's error message.
    if isinstance(dim, int) and not isinstance(dim, bool) and x.dim() and -x.dim() <= dim < 0:
        return dim + x.dim()
    return dim


def collective_counts(log: Iterable[CollectiveRecord], phase: str | None = None) -> Counter:
    """``Counter`` of ``(kind, axis)`` over ``log``, optionally only records of one ``phase``."""
    if phase is not None and phase not in PHASES:
        raise AutoshardError(f"collective_counts got phase={phase!r}, but phase is None, 'forward' or 'backward'.")
    return Counter((r.kind, r.axis) for r in log if phase is None or r.phase == phase)
