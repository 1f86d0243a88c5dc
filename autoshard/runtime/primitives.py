"""The raw collectives under the graph collectives: one ``torch.library`` op each, no autograd.

``autoshard::_all_reduce``, ``_all_gather``, ``_reduce_scatter``, ``_all_to_all`` and ``_chunk`` run one
collective of the calling thread's communicator (:func:`~autoshard.runtime.communicator.current`) and record the
``phase`` in its log; backward through one raises. The autograd formulas of :mod:`autoshard.runtime.collective_ops`,
:mod:`autoshard.runtime.zero` and :mod:`autoshard.runtime.ops` are written with them, and with the helpers here
that keep the forward's communicator for the backward (:func:`keep_comm`, :func:`comm_of`).

This module imports no other collective module, so those three import it and not each other's internals.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from autoshard.errors import AutoshardError
from autoshard.runtime.communicator import current, use

__all__ = ["all_to_all_shape", "chunk", "comm_of", "define_op", "fresh", "gathered_shape", "keep_comm",
           "raw_all_gather", "raw_all_reduce", "raw_all_to_all", "raw_reduce_scatter", "scattered_shape",
           "sum_over"]


def define_op(name: str, schema: str):
    """A ``torch.library`` custom op ``autoshard::name`` (no mutated arguments) from the decorated function."""
    return torch.library.custom_op(f"autoshard::{name}", mutates_args=(), schema=schema)


def fresh(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # a custom op's output may not alias its input (the simulator may hand back the input's storage)
    return out.clone() if out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() else out


def gathered_shape(x: torch.Tensor, dim: int, size: int) -> list[int]:
    shape = list(x.shape)
    shape[dim] *= size
    return shape


def scattered_shape(x: torch.Tensor, dim: int, size: int) -> list[int]:
    shape = list(x.shape)
    shape[dim] //= size
    return shape


def all_to_all_shape(x: torch.Tensor, split_dim: int, cat_dim: int, size: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[split_dim] //= size
    shape[cat_dim] *= size
    return x.new_empty(shape)


# ---- primitives: one raw collective, no autograd ----------------------------------------------------------
@define_op("_all_reduce", "(Tensor x, str axis, str phase) -> Tensor")
def raw_all_reduce(x, axis, phase):
    return fresh(current().all_reduce(x, axis, phase=phase), x)


@raw_all_reduce.register_fake
def _(x, axis, phase):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@define_op("_all_gather", "(Tensor x, str axis, int dim, int size, str phase) -> Tensor")
def raw_all_gather(x, axis, dim, size, phase):
    return current().all_gather(x, axis, dim, phase=phase)


@raw_all_gather.register_fake
def _(x, axis, dim, size, phase):
    return x.new_empty(gathered_shape(x, dim, size))


@define_op("_reduce_scatter", "(Tensor x, str axis, int dim, int size, str phase) -> Tensor")
def raw_reduce_scatter(x, axis, dim, size, phase):
    return current().reduce_scatter(x, axis, dim, phase=phase)


@raw_reduce_scatter.register_fake
def _(x, axis, dim, size, phase):
    return x.new_empty(scattered_shape(x, dim, size))


@define_op("_all_to_all", "(Tensor x, str axis, int split_dim, int cat_dim, int size, str phase) -> Tensor")
def raw_all_to_all(x, axis, split_dim, cat_dim, size, phase):
    return fresh(current().all_to_all(x, axis, split_dim, cat_dim, phase=phase), x)


@raw_all_to_all.register_fake
def _(x, axis, split_dim, cat_dim, size, phase):
    return all_to_all_shape(x, split_dim, cat_dim, size)


@define_op("_chunk", "(Tensor x, str axis, int dim, int size) -> Tensor")
def chunk(x, axis, dim, size):
    """This rank's contiguous chunk of ``x`` along ``dim`` on ``axis`` (a copy: later in-place ops on the shard
    must not touch the replica)."""
    comm = current()
    dim = comm._dim(x, dim, "local_slice", comm._axis(axis), divisible=True)
    n = x.shape[dim] // size
    return x.narrow(dim, comm.axis_index(axis) * n, n).clone()


@chunk.register_fake
def _(x, axis, dim, size):
    return x.new_empty(scattered_shape(x, dim, size))


# ---- autograd helpers -------------------------------------------------------------------------------------
def keep_comm(ctx) -> None:
    try:
        ctx.comm = current()
    except AutoshardError:
        ctx.comm = None


def comm_of(ctx):
    """The forward's communicator, current for the backward's primitives (eager backward on another thread)."""
    comm = getattr(ctx, "comm", None)
    return use(comm) if comm is not None and not torch.compiler.is_compiling() else nullcontext()


def sum_over(grad: torch.Tensor, axes) -> torch.Tensor:
    for axis in axes:
        grad = raw_all_reduce(grad, axis, "backward")
    return grad
