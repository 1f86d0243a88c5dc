"""Collectives as torch operators: the ``torch.ops.autoshard.*`` ops that generated rank programs call.

Every redistribution in a rank program is a ``torch.library`` custom op with a fake (meta) kernel and an autograd
formula, so ``torch.compile(rank_program, fullgraph=True)`` sees one graph with the collectives as opaque nodes, and
the IR names operators, not Python functions of this runtime. The eager kernel of an op looks up the calling
thread's communicator (:func:`~autoshard.runtime.communicator.current`) and runs its raw collective: the in-process
simulator or ``torch.distributed`` (gloo, NCCL) — the ops do not depend on which.

Two layers:

* **primitives** (``autoshard::_all_reduce``, ``_all_gather``, ``_reduce_scatter``, ``_all_to_all``, ``_chunk``;
  :mod:`autoshard.runtime.primitives`):
  one raw collective each, no autograd (backward through one raises), the ``phase`` recorded in the
  communicator's log. Autograd formulas are written with them.
* **graph collectives**, each the conjugate pair of the gradient convention (DESIGN.md, "Gradients"): the
  gradient of a *replicated* tensor is complete on every rank, of a *sharded* one this rank's slice, of a
  *partial* one the full gradient of the sum.

=============================  ===============================  ============================================
op                             forward                          backward
=============================  ===============================  ============================================
``all_reduce``                 Partial → Replicate (sum)        identity
``grad_all_reduce``            identity (Megatron's *f*)        sum over each axis of ``axes``, in order
``all_gather``                 Shard(dim) → Replicate           this rank's slice (no communication)
``reduce_scatter``             Partial → Shard(dim)             all-gather along ``dim``
``all_to_all``                 Shard(cat) → Shard(split)        the inverse all-to-all
``local_slice``                Replicate → Shard(dim), no comm  all-gather along ``dim``
``all_gather_sync``            all-gather (sequence parallel)   reduce-scatter on ``axis``, all-reduce others
``all_gather_reshard``         all-gather of a ZeRO-3 shard     as ``all_gather_sync``; the gathered copy is not
                               (FSDP's reshard after forward)   saved for backward but gathered again there
                                                                (:mod:`autoshard.runtime.zero`)
``linears_grad_all_reduce``    ``linear(f(x), w_i, b_i)``       input grad's all-reduce overlapped with the
                                                                weight grads (Megatron's async column-parallel)
=============================  ===============================  ============================================

Under ``no_sync()`` (:mod:`autoshard.runtime.grad_sync`), the backward of ``grad_all_reduce``, ``all_gather_sync``
and ``all_gather_reshard`` whose input is a parameter (through views and casts, or ZeRO-1's ``all_gather``) holds the
gradient unreduced and returns none; the next synced backward adds what was held before it reduces.

Ops that change a shape take the axis size as an argument (``size``), so their fake kernels need no
communicator. The compiler's table of collective kinds (:mod:`autoshard.compiler.collective_kinds`) names these ops; the
Python functions at the end of this module (``all_reduce(x, axis)``, ...) call them with the size filled in from the
current communicator, for tests and hand-written code.

The communicator of a backward: autograd may run backward on another thread (CUDA's device threads), where the
forward's ``use`` block is not active, so each op keeps the forward's communicator on its autograd context and
makes it current for the backward's primitives (eager); a process that runs one rank
(:class:`~autoshard.runtime.dist.DistCommunicator`) also serves as the fallback of :func:`current` in any thread.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch

from autoshard.errors import AutoshardError
from autoshard.runtime.communicator import PHASES, CollectiveRecord, current
from autoshard.runtime.grad_sync import note_site, unsynced
from autoshard.runtime.primitives import (AUTOCAST_LOWER, all_to_all_shape, chunk, comm_of, define_op, fresh,
                                          gathered_shape, keep_comm, raw_all_gather, raw_all_to_all,
                                          raw_reduce_scatter, scattered_shape, sum_over)
from autoshard.runtime.zero import remember_gathered

__all__ = [
    "all_gather",
    "all_gather_sync",
    "all_reduce",
    "all_to_all",
    "collective_counts",
    "grad_all_reduce",
    "linears_grad_all_reduce",
    "local_slice",
    "reduce_scatter",
]


# ---- graph collectives ------------------------------------------------------------------------------------
@define_op("all_reduce", "(Tensor x, str axis) -> Tensor")
def _all_reduce_op(x, axis):
    return fresh(current().all_reduce(x, axis, phase="forward"), x)  # (raw_all_reduce's body: no second op call)


_all_reduce_op.register_fake(lambda x, axis: torch.empty_like(x, memory_format=torch.contiguous_format))
_all_reduce_op.register_autograd(lambda ctx, grad: (grad, None))


@define_op("grad_all_reduce", "(Tensor x, str[] axes) -> Tensor")
def _grad_all_reduce_op(x, axes):
    return x.clone()


def _grad_all_reduce_backward(ctx, grad):
    grads = unsynced(ctx, [grad])  # a parameter's gradient under no_sync: held, not reduced (grad_sync.py)
    if grads is None:
        return None, None
    with comm_of(ctx):
        return sum_over(grads[0], ctx.axes), None


def _setup_grad_all_reduce(ctx, inputs, output):
    keep_comm(ctx)
    ctx.axes = tuple(inputs[1])
    if ctx.axes:
        note_site(ctx, inputs[:1], "grad_all_reduce", ctx.axes)


_grad_all_reduce_op.register_fake(lambda x, axes: torch.empty_like(x))
_grad_all_reduce_op.register_autograd(_grad_all_reduce_backward, setup_context=_setup_grad_all_reduce)


def _setup_dims(ctx, inputs, output):
    """For ops ``(x, axis, *ints)``: keep the axis and the int arguments."""
    keep_comm(ctx)
    ctx.axis, ctx.ints = inputs[1], tuple(inputs[2:])


@define_op("all_gather", "(Tensor x, str axis, int dim, int size) -> Tensor")
def _all_gather_op(x, axis, dim, size):
    return current().all_gather(x, axis, dim, phase="forward")


def _all_gather_backward(ctx, grad):
    dim, size = ctx.ints
    with comm_of(ctx):
        return chunk(grad, ctx.axis, dim, size), None, None, None


_all_gather_op.register_fake(lambda x, axis, dim, size: x.new_empty(gathered_shape(x, dim, size)))
_all_gather_op.register_autograd(_all_gather_backward, setup_context=_setup_dims)


@define_op("reduce_scatter", "(Tensor x, str axis, int dim, int size) -> Tensor")
def _reduce_scatter_op(x, axis, dim, size):
    return current().reduce_scatter(x, axis, dim, phase="forward")


def _gather_the_gradient(ctx, grad):
    """Backward of ops whose output is this rank's slice (reduce_scatter, local_slice): all-gather the gradient."""
    dim, size = ctx.ints
    with comm_of(ctx):
        return raw_all_gather(grad, ctx.axis, dim, size, "backward"), None, None, None


_reduce_scatter_op.register_fake(lambda x, axis, dim, size: x.new_empty(scattered_shape(x, dim, size)))
_reduce_scatter_op.register_autograd(_gather_the_gradient, setup_context=_setup_dims)


@define_op("all_to_all", "(Tensor x, str axis, int split_dim, int cat_dim, int size) -> Tensor")
def _all_to_all_op(x, axis, split_dim, cat_dim, size):
    return fresh(current().all_to_all(x, axis, split_dim, cat_dim, phase="forward"), x)


def _all_to_all_backward(ctx, grad):
    split_dim, cat_dim, size = ctx.ints
    with comm_of(ctx):
        return raw_all_to_all(grad, ctx.axis, cat_dim, split_dim, size, "backward"), None, None, None, None


@_all_to_all_op.register_fake
def _(x, axis, split_dim, cat_dim, size):
    return all_to_all_shape(x, split_dim, cat_dim, size)


_all_to_all_op.register_autograd(_all_to_all_backward, setup_context=_setup_dims)


@define_op("local_slice", "(Tensor x, str axis, int dim, int size) -> Tensor")
def _local_slice_op(x, axis, dim, size):
    return chunk(x, axis, dim, size)


_local_slice_op.register_fake(lambda x, axis, dim, size: x.new_empty(scattered_shape(x, dim, size)))
_local_slice_op.register_autograd(_gather_the_gradient, setup_context=_setup_dims)


@define_op("all_gather_sync", "(Tensor x, str axis, int dim, int size, str[] axes) -> Tensor")
def _all_gather_sync_op(x, axis, dim, size, axes):
    return current().all_gather(x, axis, dim, phase="forward")


def _setup_gather_sync(ctx, inputs, output):
    keep_comm(ctx)
    _, ctx.axis, ctx.dim, ctx.size, axes = inputs
    ctx.axes = tuple(axes)
    if ctx.axes:
        note_site(ctx, inputs[:1], "all_gather_sync", ctx.axis, ctx.dim, ctx.size, ctx.axes)


def _all_gather_sync_backward(ctx, grad):
    # all_gather + grad_all_reduce on the same axis, fused: the sum over ``axis`` and the slice are one
    # reduce-scatter (half the bytes of all-reduce + slice); the other axes are summed in the order of ``axes``
    grads = unsynced(ctx, [grad])  # a parameter's gradient under no_sync: held, not reduced (grad_sync.py)
    if grads is None:
        return None, None, None, None, None
    grad = grads[0]
    k = ctx.axes.index(ctx.axis)
    with comm_of(ctx):
        grad = sum_over(grad, ctx.axes[:k])
        grad = raw_reduce_scatter(grad, ctx.axis, ctx.dim, ctx.size, "backward")
        grad = sum_over(grad, ctx.axes[k + 1:])
    return grad, None, None, None, None


_all_gather_sync_op.register_fake(lambda x, axis, dim, size, axes: x.new_empty(gathered_shape(x, dim, size)))
_all_gather_sync_op.register_autograd(_all_gather_sync_backward, setup_context=_setup_gather_sync)


@define_op("all_gather_reshard", "(Tensor x, str axis, int dim, int size, str[] axes) -> Tensor")
def _all_gather_reshard_op(x, axis, dim, size, axes):
    return remember_gathered(current().all_gather(x, axis, dim, phase="forward"), x, axis, dim, size)


def _all_gather_reshard_backward(ctx, grad):
    # the gradient as all_gather_sync's (reduce-scatter on ``axis``, all-reduce over the other axes); where ``axis``
    # is not summed over (replicated compute), this rank's slice as all_gather's
    if ctx.axis in ctx.axes:
        return _all_gather_sync_backward(ctx, grad)
    grads = unsynced(ctx, [grad])
    if grads is None:
        return None, None, None, None, None
    with comm_of(ctx):
        return chunk(sum_over(grads[0], ctx.axes), ctx.axis, ctx.dim, ctx.size), None, None, None, None


_all_gather_reshard_op.register_fake(lambda x, axis, dim, size, axes: x.new_empty(gathered_shape(x, dim, size)))
_all_gather_reshard_op.register_autograd(_all_gather_reshard_backward, setup_context=_setup_gather_sync)


# ---- linear(f(x), w_i, b_i) for several i, with an overlapped backward ------------------------------------
def _linears(x, weights, biases, has_bias):
    it = iter(biases)
    return [torch.nn.functional.linear(x, w, next(it) if h else None) for w, h in zip(weights, has_bias)]


# under torch.autocast it is cast as aten.linear is (AUTOCAST_LOWER): x, weights and biases to the autocast dtype,
# the casts recorded by autograd, so forward, saved tensors and backward all run in that dtype and the gradients of
# fp32 inputs come back fp32 through the casts, as eager autocast's linear gives them
@define_op("linears_grad_all_reduce",
           "(Tensor x, str[] axes, Tensor[] weights, Tensor[] biases, bool[] has_bias) "
                                "-> Tensor[]", autocast=AUTOCAST_LOWER)
def _linears_grad_all_reduce_op(x, axes, weights, biases, has_bias):
    return _linears(x, weights, biases, has_bias)


@_linears_grad_all_reduce_op.register_fake
def _(x, axes, weights, biases, has_bias):
    return [x.new_empty((*x.shape[:-1], w.shape[0])) for w in weights]


@define_op("_linears_backward",
           "(Tensor[] grads, Tensor x, Tensor[] weights, str[] axes, bool[] has_bias) "
                          "-> (Tensor, Tensor[], Tensor[])")
def _linears_backward(grads, x, weights, axes, has_bias):
    """The input gradient first (accumulated by addmm_), its all-reduce started, then the weight and bias
    gradients while it travels; then the wait and the remaining axes."""
    comm = current()
    g2s = [g.reshape(-1, g.shape[-1]) for g in grads]
    gx = torch.mm(g2s[0], weights[0])
    for g2, w in zip(g2s[1:], weights[1:]):
        gx.addmm_(g2, w)
    handle = comm.all_reduce_async(gx, axes[0], phase="backward")
    x2 = x.reshape(-1, x.shape[-1])
    gws = [g2.t().mm(x2) for g2 in g2s]
    gbs = [g2.sum(0) for g2, h in zip(g2s, has_bias) if h]
    gx = handle.wait().view(x.shape)
    for axis in axes[1:]:
        gx = comm.all_reduce(gx, axis, phase="backward")
    return gx, gws, gbs


@_linears_backward.register_fake
def _(grads, x, weights, axes, has_bias):
    return (torch.empty_like(x), [torch.empty_like(w) for w in weights],
            [g.new_empty(g.shape[-1]) for g, h in zip(grads, has_bias) if h])


def _setup_linears(ctx, inputs, output):
    keep_comm(ctx)
    x, axes, weights, _, has_bias = inputs
    ctx.save_for_backward(x, *weights)
    ctx.axes, ctx.has_bias = tuple(axes), tuple(has_bias)


def _linears_backward_formula(ctx, grads):
    x, *weights = ctx.saved_tensors
    grads = [torch.zeros((*x.shape[:-1], w.shape[0]), dtype=x.dtype, device=x.device) if g is None else g
             for g, w in zip(grads, weights)]
    with comm_of(ctx):
        gx, gws, gbs = _linears_backward(grads, x, weights, list(ctx.axes), list(ctx.has_bias))
    return gx, None, list(gws), list(gbs), None


_linears_grad_all_reduce_op.register_autograd(_linears_backward_formula, setup_context=_setup_linears)


# ---- Python entry points (tests, hand-written per-rank code) ----------------------------------------------
def _tensor(x, fn: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise AutoshardError(f"autoshard.runtime.{fn} got a {type(x).__name__}, but takes a torch.Tensor.")
    return x


def _norm_dim(x: torch.Tensor, dim: int, kind: str, axis: str, divisible: bool = False) -> int:
    return current()._dim(x, dim, kind, axis, divisible)


def _axes(axes) -> list[str]:
    comm = current()
    return [comm._axis(a) for a in ((axes,) if isinstance(axes, str) else axes)]


def all_reduce(x: torch.Tensor, axis: str) -> torch.Tensor:
    """Partial → Replicate on ``axis``: sum over the group. Backward: identity."""
    return torch.ops.autoshard.all_reduce(_tensor(x, "all_reduce"), current()._axis(axis))


def grad_all_reduce(x: torch.Tensor, axes) -> torch.Tensor:
    """Identity forward; backward sums the gradient over each axis of ``axes`` in order (Megatron's *f*)."""
    return torch.ops.autoshard.grad_all_reduce(_tensor(x, "grad_all_reduce"), _axes(axes))


def all_gather(x: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
    """Shard(dim) → Replicate on ``axis``. Backward: this rank's slice of the (complete) gradient."""
    comm, x = current(), _tensor(x, "all_gather")
    axis = comm._axis(axis)
    return torch.ops.autoshard.all_gather(x, axis, _norm_dim(x, dim, "all_gather", axis), comm.axis_size(axis))


def reduce_scatter(x: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
    """Partial → Shard(dim) on ``axis``. Backward: all-gather of the gradient along ``dim``."""
    comm, x = current(), _tensor(x, "reduce_scatter")
    axis = comm._axis(axis)
    dim = _norm_dim(x, dim, "reduce_scatter", axis, divisible=True)
    return torch.ops.autoshard.reduce_scatter(x, axis, dim, comm.axis_size(axis))


def all_to_all(x: torch.Tensor, axis: str, split_dim: int, cat_dim: int) -> torch.Tensor:
    """Shard(cat_dim) → Shard(split_dim) on ``axis``. Backward: the inverse all-to-all."""
    comm, x = current(), _tensor(x, "all_to_all")
    axis = comm._axis(axis)
    split_dim = _norm_dim(x, split_dim, "all_to_all", axis, divisible=True)
    cat_dim = _norm_dim(x, cat_dim, "all_to_all", axis)
    return torch.ops.autoshard.all_to_all(x, axis, split_dim, cat_dim, comm.axis_size(axis))


def local_slice(x: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
    """Replicate → Shard(dim) on ``axis`` without communication. Backward: all-gather of the gradient."""
    comm, x = current(), _tensor(x, "local_slice")
    axis = comm._axis(axis)
    dim = _norm_dim(x, dim, "local_slice", axis, divisible=True)
    return torch.ops.autoshard.local_slice(x, axis, dim, comm.axis_size(axis))


def all_gather_sync(x: torch.Tensor, axis: str, dim: int, axes) -> torch.Tensor:
    """Shard(dim) → Replicate on ``axis``; backward sums the gradient over ``axes`` (which holds ``axis``) and
    keeps this rank's chunk along ``dim``: a reduce-scatter on ``axis``, all-reduces on the others."""
    comm, x = current(), _tensor(x, "all_gather_sync")
    axis = comm._axis(axis)
    dim = _norm_dim(x, dim, "all_gather", axis)
    return torch.ops.autoshard.all_gather_sync(x, axis, dim, comm.axis_size(axis), _axes(axes))


def linears_grad_all_reduce(x: torch.Tensor, axes, *params) -> list[torch.Tensor]:
    """``linear(grad_all_reduce(x, axes), w_i, b_i)`` for each ``(w_i, b_i)`` in ``params`` (flat pairs, ``b_i``
    may be None): the same values and gradients, but backward starts the input gradient's all-reduce before it
    computes the weight gradients, so the collective overlaps them."""
    weights, biases = list(params[0::2]), list(params[1::2])
    return torch.ops.autoshard.linears_grad_all_reduce(_tensor(x, "linears_grad_all_reduce"), _axes(axes), weights,
                                                      [b for b in biases if b is not None],
                                                      [b is not None for b in biases])


def collective_counts(log: Iterable[CollectiveRecord], phase: str | None = None) -> Counter:
    """``Counter`` of ``(kind, axis)`` over ``log``, optionally only records of one ``phase``."""
    if phase is not None and phase not in PHASES:
        raise AutoshardError(f"collective_counts got phase={phase!r}, but phase is None, 'forward' or 'backward'.")
    return Counter((r.kind, r.axis) for r in log if phase is None or r.phase == phase)
