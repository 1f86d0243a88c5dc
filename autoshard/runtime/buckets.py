"""Data-parallel gradient sync like DDP's: bucketed, and launched asynchronously while backward still runs.

Without bucketing, every parameter's gradient sync is a ``grad_all_reduce`` node of the rank program (identity
forward, blocking all-reduce backward): one collective per parameter, each one stalling backward. A rank module
made with ``Plan.rank_program(rank, bucket_grads=True)`` leaves those nodes out and lists the parameters instead in
``module.meta[GRAD_SYNC]`` as ``((attribute name, axes), ...)``; :class:`GradBucketer` then does the sync:

* **Buckets** are fixed once, at construction: the parameters in reverse graph order (the order backward makes
  their gradients ready, as DDP assumes with reverse registration order), grouped by (axes, dtype), and cut as DDP
  cuts them: a bucket closes as soon as it holds at least its limit — ``first_bucket_mb`` for the first bucket
  of each group, then ``bucket_cap_mb``. The sizes follow DDP's rule (torch 2.13 ``_BucketCapacityConfig``):
  with ``bucket_cap_mb`` left at its default (25 MiB) the first bucket is 1 MiB (``_DEFAULT_FIRST_BUCKET_BYTES``),
  so the first all-reduce starts early in backward and overlaps the rest of it; a ``bucket_cap_mb`` given
  explicitly sizes the first bucket too — the same buckets as ``DistributedDataParallel(bucket_cap_mb=...)``.
* **Hooks**: a tensor hook on every listed parameter (it runs when the parameter's gradient of this backward is
  complete, just before it is accumulated into ``.grad``) copies the gradient into its slice of its bucket's flat
  buffer and hands autograd a view of that slice to store as ``.grad``, so each gradient is held once, in its
  bucket. The hook is the bucketer's whole per-gradient cost in Python, so it only copies and counts.
  When a bucket is full it is launched with :meth:`Communicator.all_reduce_async` (in place) — buckets strictly in index
  order, so every rank of a group issues the same collectives in the same order whatever the hook order.
* **End of backward** (an autograd engine callback queued by the first hook): the buckets not yet launched are
  launched, every handle is waited on, axes after the first are all-reduced in turn, and each ``.grad`` is set
  to its slice of the reduced buffer (a view, like DDP's ``gradient_as_bucket_view``); the buffer is reused by
  the next backward once nothing else holds it (the gradients were set to None), else a new one is made.

Identical to unbucketed sync: each element is summed over the same ranks in the same order (axes in the node's
order), and a gradient that already existed (accumulation over micro-batches without ``zero_grad``) gets the
reduced new gradient added exactly as ``AccumulateGrad`` would add it — the hook moves the old ``.grad`` aside
before autograd accumulates, so the all-reduce only ever sees this backward's gradient.

**Sync off** (``no_sync()``; :mod:`autoshard.runtime.grad_sync`): :attr:`GradBucketer.sync` is the flag of the
module's latest forward made with grad enabled, read once per backward (at its first hook). A backward with it off
launches nothing: each hook adds the local gradient to the parameter's unsynced sum (``_unsynced``, a tensor of its
local shape) and ``.grad`` is put back as it was at the end of backward, so an already-reduced gradient is never
summed over the ranks again. The next backward with it on adds each parameter's unsynced sum to its gradient in
the bucket before the all-reduce (a parameter with a sum but no gradient this time joins with the sum alone), so
the reduced result is added to ``.grad`` once, as above. :attr:`GradBucketer.unsynced` holds, for the same
module, the gradients that the ops of the program held (:class:`~autoshard.runtime.grad_sync.Unsynced`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from autoshard import meta as M
from autoshard.errors import AutoshardError
from autoshard.runtime.parameters import like, local_of
from autoshard.runtime.communicator import Communicator, Handle, current
from autoshard.runtime.grad_sync import Unsynced

__all__ = ["DEFAULT_BUCKET_CAP_MB", "DEFAULT_FIRST_BUCKET_MB", "GRAD_SYNC", "GradBucketer"]

#: Key of ``GraphModule.meta`` under which codegen lists the parameters whose gradient sync was left out.
GRAD_SYNC = M.GRAD_SYNC
DEFAULT_BUCKET_CAP_MB = 25.0
DEFAULT_FIRST_BUCKET_MB = 1.0


@dataclass
class _Bucket:
    axes: tuple[str, ...]
    dtype: torch.dtype
    limit: int  # bytes: the bucket closes once it holds at least this many
    names: list[str] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    numel: int = 0
    # per backward
    flat: torch.Tensor | None = None
    views: list[torch.Tensor] | None = None  # the parameters' slices of flat, shaped like them
    ready: set[str] = field(default_factory=set)
    handle: Handle | None = None
    # the buffer of the last backward (its slices became the .grad views) and its storage's user count when only
    # the bucket held it
    spare: torch.Tensor | None = None
    spare_views: list[torch.Tensor] | None = None
    spare_users: int = 0


class GradBucketer:
    """Bucketed, overlapped gradient all-reduce for the parameters of ``module`` listed in ``syncs``.

    ``syncs``: ``((parameter name, axes), ...)``, default ``module.meta[GRAD_SYNC]``. ``comm``: the communicator
    (default: the current one, :func:`~autoshard.runtime.communicator.current`). ``bucket_cap_mb``: bucket size in MiB
    (default 25); ``first_bucket_mb``: size of the first bucket of each axis set (default as DDP's: 1 MiB when
    ``bucket_cap_mb`` is left at its default, else ``bucket_cap_mb``).
    ``public``: {parameter name: the tensor that stands for it outside the program} — a ShardedModule's DTensor
    parameters, whose ``to_local()`` the program reads (:mod:`autoshard.runtime.parameters`): the hooks go on those, and
    gradients are handed back as DTensors of the parameter's layout. Default: the module's own parameters.
    Call :meth:`remove` to take the hooks off again.

    ``sync``: whether the next backward all-reduces (set per forward by
    :func:`~autoshard.runtime.grad_sync.syncing`); ``unsynced``: the program ops' held gradients of the same
    module (see the module docstring).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        syncs=None,
        comm: Communicator | None = None,
        bucket_cap_mb: float | None = None,
        first_bucket_mb: float | None = None,
        public: dict[str, torch.Tensor] | None = None,
    ):
        if syncs is None:
            meta = getattr(module, "meta", {})
            if GRAD_SYNC not in meta:
                raise AutoshardError(
                    "GradBucketer got a module without a gradient-sync list: make the rank module "
                    "with plan.rank_program(rank, bucket_grads=True), or pass syncs=."
                )
            syncs = meta[GRAD_SYNC]
        if first_bucket_mb is None:
            first_bucket_mb = DEFAULT_FIRST_BUCKET_MB if bucket_cap_mb is None else bucket_cap_mb
        if bucket_cap_mb is None:
            bucket_cap_mb = DEFAULT_BUCKET_CAP_MB
        for name, value in (("bucket_cap_mb", bucket_cap_mb), ("first_bucket_mb", first_bucket_mb)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise AutoshardError(f"{name} is {value!r}, but must be a positive number of MiB.")
        self.comm = comm if comm is not None else current()
        self.cap_bytes = int(bucket_cap_mb * 2**20)
        first_bytes = min(self.cap_bytes, int(first_bucket_mb * 2**20))
        self.params: dict[str, torch.nn.Parameter] = {}
        self.buckets: list[_Bucket] = []
        self._where: dict[str, tuple[int, int]] = {}  # name -> (bucket index, position in bucket)
        open_: dict[tuple, int | None] = {}  # (axes, dtype) -> index of its open bucket (None: closed)
        for name, axes in reversed(tuple(syncs)):
            p = public[name] if public is not None and name in public else module.get_parameter(name)
            if not p.requires_grad or name in self.params:
                continue
            self.params[name] = p
            key = (tuple(axes), p.dtype)
            b = open_.get(key)
            if b is None:
                limit = first_bytes if key not in open_ else self.cap_bytes
                b = open_[key] = len(self.buckets)
                self.buckets.append(_Bucket(tuple(axes), p.dtype, limit=limit))
            bucket = self.buckets[b]
            self._where[name] = (b, len(bucket.names))
            bucket.names.append(name)
            bucket.offsets.append(bucket.numel)
            bucket.numel += local_of(p).numel()
            if bucket.numel * p.element_size() >= bucket.limit:
                open_[key] = None
        self._old: dict[str, torch.Tensor | None] = {}
        self._next = 0  # index of the next bucket to launch
        self._queued = False
        self.sync = True
        self._syncing = True  # the flag of the backward running now, read at its first hook
        self._unsynced: dict[str, torch.Tensor] = {}  # name -> this rank's unreduced local gradient sum
        self.unsynced = Unsynced()
        self._hooks = [p.register_hook(self._hook(name)) for name, p in self.params.items()]

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # ---- during backward --------------------------------------------------------------------------------
    # The hook runs once per parameter and backward: its Python is the bucketer's whole per-gradient cost (DDP's
    # reducer does this in C++), so everything it can look up is looked up here, once.
    def _hook(self, name: str):
        b, i = self._where[name]
        bucket, p = self.buckets[b], self.params[name]
        size = len(bucket.names)

        def hook(grad: torch.Tensor) -> torch.Tensor:
            if not self._queued:
                self._queued, self._syncing = True, self.sync
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            if not self._syncing:  # no_sync: add to the unsynced sum; .grad is put back as it was by _finish
                self._old[name] = p.grad
                p.grad = None
                held = self._unsynced.get(name)
                if held is None:
                    self._unsynced[name] = local_of(grad).detach().clone()
                else:
                    held.add_(local_of(grad))
                return grad
            if p.grad is not None:  # accumulation: keep the old gradient out of this backward's all-reduce
                self._old[name] = p.grad
                p.grad = None
            views = bucket.views
            if views is None:
                views = self._fill(bucket, grad.device)
            view = views[i]
            view.copy_(local_of(grad))
            held = self._unsynced.pop(name, None) if self._unsynced else None
            if held is not None:
                view.add_(held)
            bucket.ready.add(name)
            if len(bucket.ready) == size:
                self._launch_ready()
            # autograd stores a tensor the hook returns as .grad without copying it when nothing else holds it:
            # a fresh alias of the bucket slice, so the gradient is held once, in its bucket, from now on
            return like(view.detach(), grad)

        return hook

    def _launch_ready(self) -> None:
        """Launch the full buckets at the head of the queue — strictly in index order, so every rank of a group
        issues the same collectives in the same order whatever order the hooks run in."""
        while self._next < len(self.buckets) and len(self.buckets[self._next].ready) == len(
            self.buckets[self._next].names
        ):
            self._launch(self.buckets[self._next])
            self._next += 1

    def _fill(self, bucket: _Bucket, device) -> list[torch.Tensor]:
        """Give ``bucket`` its flat buffer for this backward and the parameter-shaped views into it: last step's
        again when nothing but the bucket holds it any more (the gradients were set to None, as ``zero_grad()``
        does), else a new one — a fresh large tensor costs page faults on every step; reusing it is what DDP's
        persistent buckets do."""
        spare = bucket.spare
        if spare is None or spare.device != device or _storage_users(spare) != bucket.spare_users:
            spare = torch.empty(bucket.numel, dtype=bucket.dtype, device=device)
            bucket.spare_views = [
                spare[off : off + local_of(self.params[name]).numel()].view(local_of(self.params[name]).shape)
                for name, off in zip(bucket.names, bucket.offsets)
            ]
            bucket.spare, bucket.spare_users = spare, _storage_users(spare)
        bucket.flat, bucket.views = spare, bucket.spare_views
        return bucket.views

    def _launch(self, bucket: _Bucket) -> None:
        bucket.handle = self.comm.all_reduce_async(bucket.flat, bucket.axes[0], phase="backward")

    def _finish(self) -> None:
        if not self._syncing:
            self._put_back()
            return
        try:
            self._join_unsynced()
            for bucket in self.buckets[self._next :]:
                if bucket.ready:  # a bucket no gradient reached this time is skipped (on every rank alike)
                    for name, view in zip(bucket.names, bucket.views):
                        if name not in bucket.ready:
                            view.zero_()
                    self._launch(bucket)
            for bucket in self.buckets:
                if bucket.handle is None:
                    continue
                flat = bucket.handle.wait()
                views = bucket.views
                if len(bucket.axes) > 1 or flat is not bucket.flat:
                    for axis in bucket.axes[1:]:
                        flat = self.comm.all_reduce(flat, axis, phase="backward")
                    views = [flat[off : off + v.numel()].view(v.shape) for off, v in zip(bucket.offsets, views)]
                for name, g in zip(bucket.names, views):
                    if name not in bucket.ready:
                        continue
                    p = self.params[name]
                    old = self._old.pop(name, None)
                    if old is None:
                        have = p.grad
                        if have is None or local_of(have).data_ptr() != g.data_ptr():  # else: the hook's, reduced
                            p.grad = like(g, p)
                    else:
                        local_of(old).add_(g)
                        p.grad = old
        finally:
            for bucket in self.buckets:
                bucket.flat, bucket.views, bucket.handle = None, None, None
                bucket.ready = set()
            self._old.clear()
            self._next = 0
            self._queued = False

    def _put_back(self) -> None:
        """End of a backward with sync off: every ``.grad`` as it was before it."""
        try:
            for name, old in self._old.items():
                self.params[name].grad = old
        finally:
            self._old.clear()
            self._queued = False

    def _join_unsynced(self) -> None:
        """Put the unsynced sum of each parameter that got no gradient in this (synced) backward into its bucket
        as its gradient, so it is reduced now too (its bucket is not launched yet: it was not complete)."""
        for name in list(self._unsynced):
            b, i = self._where[name]
            bucket = self.buckets[b]
            if name in bucket.ready:
                continue
            p = self.params[name]
            if p.grad is not None:
                self._old[name] = p.grad
                p.grad = None
            views = bucket.views if bucket.views is not None else self._fill(bucket, self._unsynced[name].device)
            views[i].copy_(self._unsynced.pop(name))
            bucket.ready.add(name)

    def __repr__(self) -> str:
        sizes = ", ".join(
            f"{len(b.names)} params/{b.numel * torch.empty((), dtype=b.dtype).element_size()} B over {'+'.join(b.axes)}"
            for b in self.buckets
        )
        return f"GradBucketer({len(self.buckets)} buckets: {sizes})"


def _storage_users(t: torch.Tensor) -> int:
    """How many tensors share ``t``'s storage (views such as the .grad slices included)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)

