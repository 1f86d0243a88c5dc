"""A result still on its way: the all-reduce of a value that leaves the rank program (the loss).

In data parallelism the loss is a Partial sum over the batch axis, so the program ends with an all-reduce whose
backward is the identity: backward never needs its value. Waiting for it in forward stalls every step on the
slowest rank for a number nobody has read yet. :func:`autoshard.runtime.collectives.all_reduce_output` starts it
asynchronously instead and returns a :class:`PendingTensor`: any op that reads its values (``.item()``,
``print``, ``loss + aux``, ``detach()``) first waits for the collective and then runs on the plain result;
ops that only need its shape (``ones_like``: autograd's seed gradient in ``loss.backward()``) do not wait. The
gradient bucketer waits for it at the end of backward with the gradient buckets, so in a training step it
overlaps the whole backward pass.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map_only

from autoshard.runtime.comm import Handle

aten = torch.ops.aten
# Ops that read only shape, dtype and device: they run without waiting.
_SHAPE_ONLY = frozenset({aten.ones_like.default, aten.zeros_like.default, aten.empty_like.default,
                         aten.full_like.default})


class PendingTensor(torch.Tensor):
    """A tensor whose value an in-flight collective is still writing; reading it waits for the collective."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, like: torch.Tensor, handle: Handle, finish=None):
        """``like``: a tensor with the result's shape, dtype and device (its values are never read);
        ``finish``: what turns the collective's result into the value (default: the result itself)."""
        out = torch.Tensor._make_wrapper_subclass(cls, like.shape, strides=like.stride(), dtype=like.dtype,
                                                  device=like.device, requires_grad=False)
        out._buffer, out._handle, out._finish, out._value = like, handle, finish, None
        return out

    def wait(self) -> torch.Tensor:
        """The value, as a plain tensor (waits for the collective once)."""
        if self._value is None:
            result = self._handle.wait()
            self._value = result if self._finish is None else self._finish(result)
        return self._value

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in _SHAPE_ONLY:
            unwrap = lambda t: t._buffer  # noqa: E731 - shape only: the values are not read
        else:
            unwrap = PendingTensor.wait
        args, kwargs = tree_map_only(PendingTensor, unwrap, (args, kwargs or {}))
        return func(*args, **kwargs)

    def __repr__(self) -> str:
        return repr(self.wait())
