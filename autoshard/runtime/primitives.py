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

__all__ = ["AUTOCAST_FP32", "AUTOCAST_LOWER", "all_to_all_shape", "chunk", "comm_of", "define_op", "fresh",
           "gathered_shape", "keep_comm", "raw_all_gather", "raw_all_reduce", "raw_all_to_all", "raw_reduce_scatter",
           "scattered_shape", "sum_over"]

# ---- autocast policies of custom ops ----------------------------------------------------------------------
# A torch.library custom op has no Autocast kernel: under ``torch.autocast`` it falls through, gets its inputs in
# whatever dtype they come, and the aten ops of its eager kernel are then autocast one by one -- but its autograd
# formula runs outside the region, on the saved (uncast) inputs, so forward and backward disagree on dtypes. An op
# that stands for an aten op autocast casts (linear, scaled_dot_product_attention, cross_entropy) gets that op's
# policy here, as an Autocast kernel above autograd: its floating inputs are cast (recorded by autograd, so the
# gradients of fp32 inputs come back fp32, as eager's), then the op runs with autocast off, as aten's autocast
# kernels run theirs. Collectives need none: they keep their input's dtype, like the view or sum they stand for.
AUTOCAST_LOWER = "lower"  # autocast's lower_precision_fp list (linear, mm, sdpa): inputs to the autocast dtype
AUTOCAST_FP32 = "fp32"    # autocast's fp32 list (nll_loss, log_softmax on CPU): inputs to float32
_AUTOCAST_DEVICES = ("cpu", "cuda")
_autocast_lib = torch.library.Library("autoshard", "FRAGMENT")  # noqa: TOR901 (kernels of ops defined here)


def _autocast_cast(value, device_type: str, dtype: torch.dtype):
    # as autocast's cached_cast: floating tensors of this device type, float64 left alone
    if isinstance(value, torch.Tensor):
        eligible = value.is_floating_point() and value.device.type == device_type and value.dtype != torch.float64
        return value.to(dtype) if eligible else value
    if isinstance(value, (list, tuple)):
        return type(value)(_autocast_cast(v, device_type, dtype) for v in value)
    return value


def _register_autocast(qualname: str, policy: str) -> None:
    overload = torch._library.utils.lookup_op(qualname)
    for device_type in _AUTOCAST_DEVICES:
        key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
        excluded = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

        def kernel(_keyset, *args, device_type=device_type, excluded=excluded):
            dtype = torch.get_autocast_dtype(device_type) if policy == AUTOCAST_LOWER else torch.float32
            with torch._C._ExcludeDispatchKeyGuard(excluded):
                return overload(*_autocast_cast(args, device_type, dtype))

        _autocast_lib.impl(qualname.split("::")[1], kernel, key, with_keyset=True)


def define_op(name: str, schema: str, autocast: str | None = None):
    """A ``torch.library`` custom op ``autoshard::name`` (no mutated arguments) from the decorated function;
    ``autocast``: its policy under ``torch.autocast`` (:data:`AUTOCAST_LOWER`, :data:`AUTOCAST_FP32`; None: the
    inputs' dtypes kept, as collectives want)."""
    if autocast not in (None, AUTOCAST_LOWER, AUTOCAST_FP32):
        raise ValueError(f"define_op autocast={autocast!r}, but it is None, {AUTOCAST_LOWER!r} or {AUTOCAST_FP32!r}.")

    def wrap(fn):
        op = torch.library.custom_op(f"autoshard::{name}", mutates_args=(), schema=schema)(fn)
        if autocast is not None:
            _register_autocast(f"autoshard::{name}", autocast)
        return op

    return wrap


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
