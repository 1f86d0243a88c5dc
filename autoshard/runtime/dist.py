"""The ``torch.distributed`` communicator: one real process per rank (gloo on CPU, NCCL on GPUs).

:class:`DistCommunicator` maps each mesh axis to process groups: by default it calls ``dist.new_group`` for every
group of every axis (``Mesh.groups``, the same order on every rank, as ``new_group`` requires) and keeps the
groups that contain this rank; a ``DeviceMesh`` with the same axes may be passed instead and its
``get_group(axis)`` is used. Ranks are laid out row-major (``Mesh``), so group rank ``i`` is axis coordinate
``i``.

Transport. Every collective is one of ``torch.distributed``'s, on the axis's process group: ``all_reduce``,
``all_gather_into_tensor`` (or ``all_gather``), ``reduce_scatter_tensor``, ``all_to_all_single``, ``broadcast``;
point-to-point transfers are ``isend``/``irecv`` on the default group. autoshard puts nothing of its own on the
wire: what the backend checks (matching sizes, dtypes, a peer that is gone) it checks here too.

Which collectives are native. The tensor-form collectives (``all_gather_single``, ``reduce_scatter_single``,
formerly ``all_gather_into_tensor``/``reduce_scatter_tensor``, and ``all_to_all_single``) work along dim 0
only (and gloo accepts only the concatenated form of their outputs and inputs), so other dims are handled by
moving chunks: gather into ``(n * d0, ...)`` and concatenate the n pieces along the wanted dim; chunk along the
wanted dim and concatenate along dim 0 before reduce-scatter or all-to-all. NCCL and, on torch 2.13, gloo
support all three natively for every dtype autoshard uses (checked on CPU for float32/64, bfloat16, float16,
int8/32/64, uint8 and bool). For any other backend (``mpi``, ``ucc``, third-party) the communicator
falls back to what every backend has and still records the *logical* collective once:

* ``all_gather``     → ``dist.all_gather`` into a list, then ``torch.cat``;
* ``reduce_scatter`` → ``dist.all_reduce``, then keep this rank's chunk (twice the traffic, same values);
* ``all_to_all``     → ``dist.all_gather`` of every rank's pieces, then keep the pieces addressed to this rank.

``native_ops`` overrides the choice (tests run the fallbacks on gloo with ``native_ops=()``).

Async all-reduces (gradient buckets, the loss) are the backend's ``all_reduce(async_op=True)`` on the axis
group, in place; the :class:`~autoshard.runtime.communicator.Handle` waits on the backend's work.

Timeouts. ``timeout`` is passed to every ``new_group``; on gloo it bounds each collective on that group (a
peer that never arrives gives ``"Timed out waiting ... for recv"`` after ``timeout`` seconds, which this module
re-raises as :class:`~autoshard.errors.CollectiveTimeoutError`); it also bounds creating the groups, so ranks
that reach the communicator far apart need a ``timeout`` that covers the gap. A peer whose process is gone
closes its sockets, which gloo notices at once: that too becomes a ``CollectiveTimeoutError``, naming the
collective, its group and the peer. Point-to-point ops, ``barrier`` and the groups of a passed ``device_mesh``
use the default group's timeout, ``init_process_group(timeout=...)`` (which governs gloo there);
:func:`autoshard.runtime.launch.spawn` sets it from its own ``timeout``. With NCCL, timeouts are enforced by the
watchdog (``TORCH_NCCL_ASYNC_ERROR_HANDLING``) rather than raised from the call.

Shutdown. :func:`shutdown` ends a run cleanly, and scripts call it (in a ``finally``) instead of a bare
``destroy_process_group()``: it waits for every async collective still in flight on each live communicator,
destroys the groups the communicators created, then the default group, so that every gloo backend (two worker
threads and one socket loop thread each) is torn down *while the interpreter is fully alive*. A bare
``destroy_process_group()`` tears down nothing that something else still references — the communicator's
groups, and, in torch 2.13, the default group itself once ``torch.distributed.nn.functional`` has been imported
after ``init_process_group`` (its functions take ``group=group.WORLD`` as a default argument, evaluated at
import; ``torch.export`` imports it on the first trace, which the lazy path runs after ``init_process_group``).
Those backends then die during interpreter finalization, where their C++ threads may still release a finished
collective's tensors: a thread that takes the GIL once finalization has begun is ended by CPython with
``pthread_exit``, whose unwinding through a C++ ``noexcept`` destructor calls ``std::terminate`` — the
intermittent ``terminate called without an active exception`` (SIGABRT) under load. Scripts that end with a
bare destroy anyway (most do) are covered by an ``atexit`` hook, registered by the first communicator, that runs
:func:`shutdown` while the interpreter is still whole.
"""

from __future__ import annotations

import atexit
import gc
import sys
import weakref
from collections.abc import Collection
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from autoshard.errors import AutoshardError, CollectiveTimeoutError, MeshError, PeerDiedError
from autoshard.mesh import Mesh, as_mesh
from autoshard.runtime.communicator import Communicator, Handle

__all__ = ["NATIVE_OPS", "DistCommunicator", "shutdown"]

_ALL = frozenset({"all_gather", "reduce_scatter", "all_to_all"})
# Collectives called natively per backend (all_reduce, broadcast, send/recv are native everywhere).
NATIVE_OPS: dict[str, frozenset[str]] = {"nccl": _ALL, "gloo": _ALL, "mpi": frozenset({"all_to_all"})}

# What gloo says when the other end of a connection is gone (the peer process died or tore down its group).
_PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe")

# torch 2.13 renamed the tensor-form collectives (the old names still work but warn on every call).
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

#: options of a sum all-reduce, for the process group's own ``allreduce``
_SUM = dist.AllreduceOptions()
_SUM.reduceOp = dist.ReduceOp.SUM

#: Every DistCommunicator of this process that has not been closed (what shutdown() closes).
_LIVE: weakref.WeakSet = weakref.WeakSet()


class DistCommunicator(Communicator):
    """This process's rank of ``mesh`` over the initialised default process group.

    ``timeout`` (seconds) is given to every process group created here. ``native_ops``: which of
    ``all_gather``, ``reduce_scatter``, ``all_to_all`` to call natively (default: :data:`NATIVE_OPS` of the
    backend).
    """

    one_rank_per_process = True

    def __init__(self, mesh: Mesh, device_mesh=None, timeout: float = 300.0,
                 native_ops: Collection[str] | None = None):
        mesh = as_mesh(mesh)
        if not dist.is_available() or not dist.is_initialized():
            raise MeshError(f"DistCommunicator for mesh {mesh} needs torch.distributed, but no process group is "
                            "initialised: call torch.distributed.init_process_group(...) in every process first "
                            "(torchrun does it from its environment), or use autoshard.runtime.launch.spawn.")
        world = dist.get_world_size()
        if world != mesh.size:
            raise MeshError(f"mesh {mesh} has {mesh.size} ranks, but the process group has world size {world}: "
                            f"launch {mesh.size} processes (torchrun --nproc-per-node {mesh.size}) or use a mesh "
                            f"whose axis sizes multiply to {world}.")
        super().__init__(mesh, dist.get_rank(), timeout)
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._owned: list[dist.ProcessGroup] = []  # the groups created here, which close() destroys
        self._on_close: list = []  # weak references to callbacks that let go of this communicator's groups
        self.closed = False
        delta = timedelta(seconds=self.timeout)
        if device_mesh is not None:
            self._groups = self._groups_of_device_mesh(device_mesh)
        else:
            for axis in mesh.names:
                for ranks in mesh.groups(axis):
                    pg = dist.new_group(list(ranks), timeout=delta)
                    if self.rank in ranks:
                        self._groups[axis] = pg
                        self._owned.append(pg)
        self.backend = str(dist.get_backend()).lower()
        #: a gloo group of every rank for the small host-side exchanges before each call (all_reduce_host,
        #: all_gather_host): one collective over the world, which never synchronises with the device (the default
        #: group where it is gloo's already)
        self._host_group = dist.group.WORLD
        if "gloo" not in self.backend:
            self._host_group = dist.new_group(backend="gloo", timeout=delta)
            self._owned.append(self._host_group)
        if native_ops is None:
            native_ops = next((ops for name, ops in NATIVE_OPS.items() if name in self.backend), frozenset())
        unknown = set(native_ops) - _ALL
        if unknown:
            raise MeshError(f"native_ops has {sorted(unknown)}, but only {sorted(_ALL)} can be chosen.")
        self.native_ops = frozenset(native_ops)
        _LIVE.add(self)
        _register_exit_hook()

    def close(self) -> None:
        """Wait for this rank's async collectives still in flight, then destroy the process groups this
        communicator created (not those of a passed ``device_mesh``) and let go of them. Idempotent; collectives
        afterwards raise :class:`~autoshard.errors.AutoshardError`."""
        if self.closed:
            return
        try:
            self.wait_all()
        finally:
            self.closed = True
            _LIVE.discard(self)
            for ref in self._on_close:
                fn = ref()
                if fn is not None:
                    fn()
            self._on_close = []
            owned, self._owned, self._groups = self._owned, [], {}
            self._host_group = None  # a reference would keep its gloo backend, and its threads, alive
            if dist.is_initialized():
                for pg in owned:
                    dist.destroy_process_group(pg)
            del owned

    def on_close(self, method) -> None:
        """Call the bound ``method`` when this communicator closes, before its groups are destroyed: objects that
        keep one of its groups (a pipeline schedule's stages) let go of it there, or the group's backend and its
        threads would outlive the destroy. Held weakly: registering keeps nothing alive."""
        self._on_close.append(weakref.WeakMethod(method))

    def _groups_of_device_mesh(self, device_mesh) -> dict[str, dist.ProcessGroup]:
        theirs = Mesh.from_device_mesh(device_mesh)
        if theirs != self.mesh:
            raise MeshError(f"device_mesh has axes {theirs}, but the communicator's mesh is {self.mesh}: create "
                            f"it with init_device_mesh(..., {self.mesh.shape}, mesh_dim_names={self.mesh.names}).")
        layout = device_mesh.mesh.flatten().tolist()
        if layout != list(range(self.mesh.size)):
            raise MeshError(f"device_mesh lays out ranks as {device_mesh.mesh.tolist()}, but autoshard places "
                            "ranks row-major (rank = flattened coordinate): build the DeviceMesh over "
                            "torch.arange(world_size).reshape(shape).")
        return {axis: device_mesh.get_group(axis) for axis in self.mesh.names}

    def process_group(self, axis: str) -> dist.ProcessGroup:
        """The process group of this rank along ``axis``."""
        self._check_open(f"process_group({axis!r})")
        return self._groups[self._axis(axis)]

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise AutoshardError(f"{what} on rank {self.rank}: this communicator was closed "
                                 "(autoshard.runtime.shutdown() or close()) and its process groups destroyed; "
                                 "make a new one after init_process_group to communicate again.")

    # ---- errors -----------------------------------------------------------------------------------------
    @contextmanager
    def _guard(self, what: str, axis: str | None, peers: list[int] | None = None):
        """Re-raise the backend's error for a dead or missing peer as :class:`CollectiveTimeoutError` naming
        ``what``, the group of ``axis`` (None: the whole world, or ``peers`` for a point-to-point transfer) and
        the peer; other errors (a size mismatch gloo detects, a bad argument) pass through unchanged."""
        self._check_open(what)
        try:
            yield
        except RuntimeError as e:
            text = str(e)
            low = text.lower()
            where = f" (group of ranks {list(self.group(axis))})" if axis else ""
            first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
            if any(s in low for s in _PEER_GONE):
                # gloo notices a dead peer at once (its socket closes): say so instead of waiting for a timeout.
                if peers is None:
                    peers = [r for r in (self.group(axis) if axis else range(self.mesh.size)) if r != self.rank]
                peer = f"peer rank {peers[0]}" if len(peers) == 1 else f"one of peer ranks {peers}"
                raise PeerDiedError(
                    f"{what}{where} did not complete on rank {self.rank}: {peer} closed its connection: that "
                    f"process died or left the collective (nothing timed out). Backend said: {first}") from e
            if "timed out" not in low and "timeout" not in low:
                raise
            raise CollectiveTimeoutError(
                f"{what}{where} did not complete within {self.timeout:g} s on rank {self.rank}: a peer died, "
                f"hangs or skipped this collective. Backend said: {first}") from e

    # ---- collectives ------------------------------------------------------------------------------------
    def _all_reduce(self, t, axis):
        out = t.clone()
        self._all_reduce_inplace(out, axis)
        return out

    def _all_reduce_inplace(self, t, axis):
        with self._guard(f"all_reduce on axis `{axis}`", axis):
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self._groups[axis])

    def _all_reduce_async(self, t, axis):
        # in place: all_reduce_async hands the buffer over (no copy of a 25 MiB bucket), which is contiguous
        what = f"all_reduce on axis `{axis}`"
        with self._guard(what, axis):
            work = dist.all_reduce(t, op=dist.ReduceOp.SUM, async_op=True, group=self._groups[axis])

        def wait():
            with self._guard(what, axis):
                work.wait()

        return Handle(t, wait)

    def _all_gather_async(self, t, axis):
        if "all_gather" not in self.native_ops:
            return super()._all_gather_async(t, axis)
        n, group = self.mesh.axis_size(axis), self._groups[axis]
        flat = t.new_empty((n * t.shape[0], *t.shape[1:]))
        what = f"all_gather on axis `{axis}`"
        with self._guard(what, axis):
            work = _all_gather_tensor(flat, t, group=group, async_op=True)

        def wait(t=t):  # (t: the input stays alive until the collective is done)
            with self._guard(what, axis):
                work.wait()

        return Handle(flat, wait)

    def _all_gather(self, t, axis, dim):
        n, group = self.mesh.axis_size(axis), self._groups[axis]
        with self._guard(f"all_gather on axis `{axis}`", axis):
            if "all_gather" in self.native_ops:
                # gloo accepts only the concatenated output form, (n * t.shape[0], ...).
                flat = t.new_empty((n * t.shape[0], *t.shape[1:]))
                _all_gather_tensor(flat, t, group=group)
                if dim == 0:
                    return flat  # already the concatenation along dim 0: no second copy
                pieces = list(flat.chunk(n, 0))
            else:
                pieces = [torch.empty_like(t) for _ in range(n)]
                dist.all_gather(pieces, t, group=group)
        return torch.cat(pieces, dim=dim)

    def _reduce_scatter(self, t, axis, dim):
        n, group = self.mesh.axis_size(axis), self._groups[axis]
        with self._guard(f"reduce_scatter on axis `{axis}`", axis):
            if "reduce_scatter" in self.native_ops:
                chunks = t.chunk(n, dim)
                out = t.new_empty(chunks[0].shape)
                # along dim 0 the (contiguous) input is already the concatenated form; gloo does not write to it
                _reduce_scatter_tensor(out, t if dim == 0 else torch.cat(chunks, 0), op=dist.ReduceOp.SUM,
                                       group=group)
                return out
            total = t.clone()
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total.chunk(n, dim)[self._coords[axis]].clone()

    def _all_to_all(self, t, axis, split_dim, cat_dim):
        n, group = self.mesh.axis_size(axis), self._groups[axis]
        stacked = torch.stack(t.chunk(n, split_dim))  # stacked[j] goes to coordinate j
        with self._guard(f"all_to_all on axis `{axis}`", axis):
            if "all_to_all" in self.native_ops:
                received = torch.empty_like(stacked)
                dist.all_to_all_single(received, stacked, group=group)
                pieces = list(received.unbind(0))
            else:
                everything = stacked.new_empty((n, *stacked.shape))
                parts = list(everything.unbind(0))
                dist.all_gather(parts, stacked, group=group)
                pieces = [p[self._coords[axis]] for p in parts]
        return torch.cat(pieces, dim=cat_dim)

    def _broadcast(self, t, axis, src):
        out = t.clone()
        with self._guard(f"broadcast on axis `{axis}`", axis):
            dist.broadcast(out, src=self.group(axis)[src], group=self._groups[axis])
        return out

    def _send(self, t, dst_rank):
        with self._guard(f"send to rank {dst_rank}", None, peers=[dst_rank]):
            dist.isend(t, dst=dst_rank).wait()

    def _recv(self, shape, dtype, src_rank):
        out = torch.empty(shape, dtype=dtype, device=self._device())
        with self._guard(f"recv from rank {src_rank}", None, peers=[src_rank]):
            dist.irecv(out, src=src_rank).wait()
        return out

    def barrier(self) -> None:
        if self._pending is not None:
            self.settle()
        with self._guard("barrier", None):
            dist.barrier()

    @property
    def device(self) -> torch.device:
        return self._device()

    def all_reduce_host(self, t: torch.Tensor) -> torch.Tensor:
        if self._pending is not None:
            self.settle()
        out = t.clone()
        with self._guard("all_reduce_host", None):
            dist.all_reduce(out, group=self._host_group)
        return out

    def all_reduce_host_(self, t: torch.Tensor) -> torch.Tensor:
        if self._pending is not None:
            self.settle()
        self._check_open("all_reduce_host")
        with self._guard("all_reduce_host", None):
            self._host_group.allreduce([t], _SUM).wait()  # (the process group's own call, as all_reduce_host_async)
        return t

    def all_reduce_host_async(self, t: torch.Tensor) -> Handle:
        """:meth:`all_reduce_host` started on the host group (``async_op``): the call's agreement check runs while
        its forward computes."""
        if self._pending is not None:
            self.settle()
        out = t.clone()
        self._check_open("all_reduce_host")
        with self._guard("all_reduce_host", None):
            # the process group's own call: torch.distributed.all_reduce's Python checks and logging cost as much
            # as the collective's launch, on every call of a ShardedModule
            work = self._host_group.allreduce([out], _SUM)

        def wait():
            with self._guard("all_reduce_host", None):
                work.wait()

        return self._track(Handle(out, wait))

    def all_gather_host(self, t: torch.Tensor) -> torch.Tensor:
        if self._pending is not None:
            self.settle()
        out = [torch.empty_like(t) for _ in range(self.mesh.size)]
        with self._guard("all_gather_host", None):
            dist.all_gather(out, t, group=self._host_group)
        return torch.stack(out)

    def _device(self) -> torch.device:
        if "nccl" in self.backend and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def shutdown() -> None:
    """End this process's part of a distributed run cleanly; call it once, when training is done (in a
    ``finally``), in place of ``torch.distributed.destroy_process_group()``.

    Waits for every async collective still in flight on each live :class:`DistCommunicator` (gradient buckets,
    ZeRO-3 prefetches), destroys the process groups they created and then the default group, so that no gloo
    backend, and none of its threads, outlives this call (see the module docstring for why a bare
    ``destroy_process_group()`` is not enough). It does not wait for the other ranks: each rank calls it when it
    is done. Safe to call when nothing was initialised, and more than once.
    """
    from autoshard.runtime.parameters import forget_meshes

    for comm in list(_LIVE):
        comm.close()
    forget_meshes()  # the DeviceMeshes of DTensor parameters name this run's groups
    if dist.is_initialized():
        dist.destroy_process_group()
    # also after a bare destroy_process_group(): the groups are shut down but still referenced from here
    _drop_import_time_defaults()
    gc.collect()  # a group caught in a reference cycle (a module that holds its communicator) is freed now


def _drop_import_time_defaults() -> None:
    """``torch.distributed.nn.functional`` (torch 2.13) declares ``group=group.WORLD`` as default arguments, so
    importing it after ``init_process_group`` pins the default group for good; put back the ``None`` the defaults
    have when it is imported before (``group=None`` means the default group in every call it makes). Every process
    group found there is that import-time WORLD (no default names another group), live or already destroyed."""
    module = sys.modules.get("torch.distributed.nn.functional")
    if module is None:
        return
    for fn in vars(module).values():
        defaults = getattr(fn, "__defaults__", None)
        if defaults and any(isinstance(d, dist.ProcessGroup) for d in defaults):
            fn.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d for d in defaults)


_exit_hook_registered = False  # by the first DistCommunicator of the process


def _register_exit_hook() -> None:
    global _exit_hook_registered
    if not _exit_hook_registered:
        atexit.register(_shutdown_at_exit)
        _exit_hook_registered = True


def _shutdown_at_exit() -> None:
    """:func:`shutdown` at interpreter exit, for scripts that end with a bare ``destroy_process_group()`` (or with
    nothing): ``atexit`` hooks run while the interpreter is still whole, so the gloo backends this process still
    references are torn down there and not during finalization (the module docstring says why that aborts).

    After an uncaught exception (``sys.last_value``) with a collective still in flight it does nothing: waiting
    for a collective whose peers have stopped at another one would hang the exit until the groups' timeout, where
    the process would otherwise end at once."""
    if getattr(sys, "last_value", None) is not None and any(comm._in_flight for comm in list(_LIVE)):
        return
    shutdown()
