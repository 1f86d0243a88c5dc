"""The ``torch.distributed`` communicator: one real process per rank (gloo on CPU, NCCL on GPUs).

:class:`DistCommunicator` maps each mesh axis to process groups: by default it calls ``dist.new_group`` for every
group of every axis (``Mesh.groups``, the same order on every rank, as ``new_group`` requires) and keeps the
groups that contain this rank; a ``DeviceMesh`` with the same axes may be passed instead and its
``get_group(axis)`` is used. Ranks are laid out row-major (``Mesh``), so group rank ``i`` is axis coordinate
``i``.

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

Two-rank all-reduce. gloo's all-reduce takes several round trips even for a few KiB, and pushes every byte
through loopback sockets: between 2 processes on this 2-core machine, 1.5 ms for 128 KiB and 10-15 ms for 8 MiB.
When the two ranks of a 2-rank group share a host, autoshard's all-reduces (and all-gathers, reduce-scatters and
all-to-alls: the same swap of slots) go through shared memory instead
(:mod:`autoshard.runtime.shm`: copy into a shared slot, signal, one add of the peer's slot: 0.2 ms and 3.6 ms),
signalled by counters in the mapping on x86-64 — every blocking all-reduce then takes that path — and elsewhere
by token messages, whose ~0.4 ms latency makes one exchange (``isend`` + ``irecv`` of the whole tensor, then one
add: 0.7 ms for 128 KiB, the same bytes as an all-reduce over 2 ranks) the faster way up to
:data:`SHARED_MEMORY_MIN_BYTES`. Where the two ranks cannot share memory (different hosts or containers, no room
in ``/dev/shm``), both learn it at the first attempt and use the exchange up to :data:`PAIR_EXCHANGE_MAX_BYTES`,
gloo above. The pair's messages go over a process group of its own (so they never interleave with the axis
group's collectives), with a tag per message (every rank counts them alike). Both ranks compute ``a + b`` with
the operands swapped, which IEEE addition gives bit for bit: the result is the same on both, and equal to gloo's.
Async all-reduces that would go through shared memory (gradient buckets) are done at once — that path is this
rank's CPU work either way; small *async* all-reduces (left in flight while the rank computes: the loss, the
target count) keep gloo's all-reduce, on the side group: in the background an isend/irecv pair slowed a 50 ms
compute loop by 2.5-3.7 ms, gloo's all-reduce not measurably. Groups of other sizes and other backends use the
backend's all-reduce on the axis group; ``shared_memory=False`` turns shared memory off, ``pair_exchange=False``
both.

Timeouts. ``timeout`` is passed to every ``new_group``; on gloo it bounds each collective on that group (a
peer that never arrives gives ``"Timed out waiting ... for recv"`` after ``timeout`` seconds, which this module
re-raises as :class:`~autoshard.errors.CollectiveTimeoutError`); it also bounds creating the groups, so ranks
that reach the communicator far apart need a ``timeout`` that covers the gap. Point-to-point ops, ``barrier``
and the groups of a passed ``device_mesh`` use the default group's timeout, ``init_process_group(timeout=...)``
(which governs gloo there); :func:`autoshard.runtime.launch.spawn` sets
it from its own ``timeout``. With NCCL, timeouts are enforced by the watchdog (``TORCH_NCCL_ASYNC_ERROR_HANDLING``)
rather than raised from the call.
"""

from __future__ import annotations

from collections.abc import Collection
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from autoshard.errors import CollectiveTimeoutError, MeshError
from autoshard.mesh import Mesh, as_mesh
from autoshard.runtime.comm import Communicator, Handle
from autoshard.runtime.shm import PeerExitedError, SharedMemoryPair

__all__ = ["IN_FLIGHT_MAX_BYTES", "NATIVE_OPS", "PAIR_EXCHANGE_MAX_BYTES", "SHARED_MEMORY_MIN_BYTES",
           "DistCommunicator"]

_ALL = frozenset({"all_gather", "reduce_scatter", "all_to_all"})
# Collectives called natively per backend (all_reduce, broadcast, send/recv are native everywhere).
NATIVE_OPS: dict[str, frozenset[str]] = {"nccl": _ALL, "gloo": _ALL, "mpi": frozenset({"all_to_all"})}

#: All-reduces of at most this many bytes over a 2-rank gloo group run as one exchange (measured on 2 processes,
#: 2 cores: 128 KiB 2.4 → 0.7 ms, 512 KiB 3.2 → 1.4 ms, 1 MiB 2.9 → 2.3 ms; 8 MiB 20 → 27 ms, so not beyond).
PAIR_EXCHANGE_MAX_BYTES = 1 << 20
#: Where shared memory is signalled by token messages (not x86-64), all-reduces of more than this many bytes go
#: through it (:mod:`autoshard.runtime.shm`); below, the exchange is as fast or faster (its one message carries
#: the data, where shared memory needs a token message and two copies). Async ones up to this size stay in flight
#: on gloo's all-reduce. Measured as PAIR_EXCHANGE_MAX_BYTES, exchange / shared memory with tokens: 128 KiB
#: 0.6 / 0.7 ms, 512 KiB 0.7-1.0 / 1.1-1.5 ms, 1 MiB 1.6-2.0 / 0.8-1.0 ms,
#: 4 MiB 5.6-6.3 / 2.4-2.7 ms, 8 MiB 9.4-12.6 / 4.5-5.1 ms (gloo's all-reduce: 9.8 ms).
SHARED_MEMORY_MIN_BYTES = 512 << 10
#: Where shared memory is signalled by flags, async all-reduces of at most this many bytes (the loss, the target
#: count) stay in flight on gloo's all-reduce while the rank computes on; larger ones (gradient buckets) go through
#: shared memory at once (128 KiB: 0.2 ms through shared memory, 1.5 ms by gloo's all-reduce).
IN_FLIGHT_MAX_BYTES = 4 << 10

# What gloo says when the other end of a connection is gone (the peer process died or tore down its group).
_PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe")

# torch 2.13 renamed the tensor-form collectives (the old names still work but warn on every call).
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class DistCommunicator(Communicator):
    """This process's rank of ``mesh`` over the initialised default process group.

    ``timeout`` (seconds) is given to every process group created here. ``native_ops``: which of
    ``all_gather``, ``reduce_scatter``, ``all_to_all`` to call natively (default: :data:`NATIVE_OPS` of the
    backend). ``pair_exchange``: run small all-reduces over 2-rank groups as one exchange (default: on gloo).
    ``shared_memory``: run collectives over 2-rank groups through shared memory when the two ranks share a host
    (default: as ``pair_exchange``; it needs the pair's process groups that ``pair_exchange`` makes).
    """

    def __init__(self, mesh: Mesh, device_mesh=None, timeout: float = 300.0,
                 native_ops: Collection[str] | None = None, pair_exchange: bool | None = None,
                 shared_memory: bool | None = None):
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
        if device_mesh is not None:
            self._groups = self._groups_of_device_mesh(device_mesh)
        else:
            delta = timedelta(seconds=self.timeout)
            for axis in mesh.names:
                for ranks in mesh.groups(axis):
                    pg = dist.new_group(list(ranks), timeout=delta)
                    if self.rank in ranks:
                        self._groups[axis] = pg
        self.backend = str(dist.get_backend()).lower()
        if pair_exchange is None:
            pair_exchange = "gloo" in self.backend
        # axis -> (process group for the exchanges, the peer's global rank), for the 2-rank axes
        self._pairs: dict[str, tuple[dist.ProcessGroup, int]] = {}
        self._shared: dict[str, SharedMemoryPair] = {}  # axis -> its shared mapping (made on first use)
        self._exchanges = 0  # messages exchanged so far on the pair groups: their tags (equal on every rank)
        if shared_memory is None:
            shared_memory = pair_exchange
        if pair_exchange:
            delta = timedelta(seconds=self.timeout)
            for axis in mesh.names:
                if mesh.axis_size(axis) != 2:
                    continue
                for ranks in mesh.groups(axis):
                    pg = dist.new_group(list(ranks), timeout=delta)
                    if self.rank in ranks:
                        peer = next(r for r in ranks if r != self.rank)
                        self._pairs[axis] = (pg, peer)
                        if shared_memory:
                            self._shared[axis] = SharedMemoryPair(pg, peer, self.rank < peer, self._next_tag,
                                                                 timeout=self.timeout)
        if native_ops is None:
            native_ops = next((ops for name, ops in NATIVE_OPS.items() if name in self.backend), frozenset())
        unknown = set(native_ops) - _ALL
        if unknown:
            raise MeshError(f"native_ops has {sorted(unknown)}, but only {sorted(_ALL)} can be chosen.")
        self.native_ops = frozenset(native_ops)

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
        return self._groups[self._axis(axis)]

    # ---- collectives ------------------------------------------------------------------------------------
    @contextmanager
    def _guard(self, what: str, axis: str | None):
        try:
            yield
        except RuntimeError as e:
            text = str(e)
            low = text.lower()
            where = f" (group of ranks {list(self.group(axis))})" if axis else ""
            first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
            if isinstance(e, PeerExitedError):  # seen through shared memory: the peer's process is gone
                raise CollectiveTimeoutError(
                    f"{what}{where} did not complete on rank {self.rank} (timeout {self.timeout:g} s): peer rank "
                    f"{e.peer} exited (pid {e.pid}): that process died or was killed.") from e
            if any(s in low for s in _PEER_GONE):
                # gloo notices a dead peer at once (its socket closes): say so instead of waiting for a timeout.
                others = [r for r in (self.group(axis) if axis else range(self.mesh.size)) if r != self.rank]
                peer = f"peer rank {others[0]}" if len(others) == 1 else f"one of peer ranks {others}"
                raise CollectiveTimeoutError(
                    f"{what}{where} did not complete on rank {self.rank} (timeout {self.timeout:g} s): {peer} "
                    f"closed its connection: that process died or left the collective. Backend said: {first}") from e
            if "timed out" not in low and "timeout" not in low:
                raise
            raise CollectiveTimeoutError(
                f"{what}{where} did not complete within {self.timeout:g} s on rank {self.rank}: a peer died, "
                f"hangs or skipped this collective. Backend said: {first}") from e

    def _next_tag(self) -> int:
        tag = self._exchanges % (1 << 24)
        self._exchanges += 1
        return tag

    def _route(self, t, axis, in_flight: bool = False) -> str:
        """How an all-reduce of ``t`` over ``axis`` travels: ``"shared"`` (shared memory), ``"exchange"`` (one
        isend/irecv), ``"side"`` (gloo's all-reduce on the pair's side group: small ones left ``in_flight``) or
        ``"group"`` (the backend's all-reduce on the axis group). The same on every rank of the pair: it depends on
        the tensor and on what both ranks agreed about shared memory."""
        if axis not in self._pairs:
            return "group"
        nbytes = t.numel() * t.element_size()
        if self._shared_for(t, axis, sums=True, at_any_size=True) is None:
            small = t.is_contiguous() and nbytes <= PAIR_EXCHANGE_MAX_BYTES
            return ("side" if in_flight else "exchange") if small else "group"
        if in_flight:  # reduced in place: a non-contiguous one goes to the backend as it is
            if not t.is_contiguous():
                return "group"
            stays = IN_FLIGHT_MAX_BYTES if self._shared[axis].flags else SHARED_MEMORY_MIN_BYTES
            return "side" if nbytes <= stays else "shared"
        if nbytes > SHARED_MEMORY_MIN_BYTES or self._shared[axis].flags or not t.is_contiguous():
            return "shared"
        return "exchange"

    def _shared_for(self, t, axis, sums: bool = False, at_any_size: bool = False) -> SharedMemoryPair | None:
        """The axis pair's shared memory, where a collective of ``t`` (summing it: ``sums``) should go through it:
        a CPU tensor of a pair that shares memory, of more than SHARED_MEMORY_MIN_BYTES unless signalled by flags
        (or ``at_any_size``); None: the backend's collective."""
        shared = self._shared.get(axis)
        if shared is None or shared.failed or t.device.type != "cpu" or (sums and t.dtype == torch.bool):
            return None
        if not (at_any_size or shared.flags or t.numel() * t.element_size() > SHARED_MEMORY_MIN_BYTES):
            return None
        return shared

    def _exchange(self, t, axis) -> torch.Tensor:
        """Send ``t`` to the axis peer and receive the peer's tensor (blocking)."""
        pg, peer = self._pairs[axis]
        tag = self._next_tag()
        theirs = torch.empty_like(t)
        for work in (dist.isend(t, peer, group=pg, tag=tag), dist.irecv(theirs, peer, group=pg, tag=tag)):
            work.wait()
        return theirs

    def _all_reduce(self, t, axis):
        return self._sum(t, axis, into=None)

    def _all_reduce_inplace(self, t, axis):
        self._sum(t, axis, into=t)

    def _sum(self, t, axis, into):
        """Blocking all-reduce of ``t`` over ``axis`` by its route, into ``into`` (``t`` itself) or a new tensor."""
        with self._guard(f"all_reduce on axis `{axis}`", axis):
            route = self._route(t, axis)
            if route == "shared":
                out = self._shared[axis].all_reduce(t, out=into)
                if out is not None:
                    return out
                route = self._route(t, axis)  # shared memory turned out impossible (on both ranks)
            if route == "exchange":
                theirs = self._exchange(t, axis)
                return theirs.add_(t) if into is None else into.add_(theirs)
            out = t.clone() if into is None else into
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self._groups[axis])
        return out

    def _all_reduce_async(self, t, axis):
        # in place: all_reduce_async hands the buffer over (no copy of a 25 MiB bucket), which is contiguous
        what = f"all_reduce on axis `{axis}`"
        # Small ones (the loss, the target count) stay in flight while this rank computes: gloo's all-reduce costs
        # nothing measurable in the background where an isend/irecv pair cost 2.5-3.7 ms of a 50 ms loop, so they
        # keep gloo's all-reduce, on the 2-rank side group: not queued behind (or in front of) the gradient buckets
        # on the axis's group. Through shared memory (the buckets) it is this rank's CPU work either way: done now,
        # handed back complete.
        route = self._route(t, axis, in_flight=True)
        if route == "shared":
            with self._guard(what, axis):
                if self._shared[axis].all_reduce(t, out=t) is not None:
                    return Handle(t)
            route = self._route(t, axis, in_flight=True)
        with self._guard(what, axis):
            work = dist.all_reduce(t, op=dist.ReduceOp.SUM, async_op=True,
                                   group=self._pairs[axis][0] if route == "side" else self._groups[axis])

        def wait():
            with self._guard(what, axis):
                work.wait()

        return Handle(t, wait)

    def _all_gather(self, t, axis, dim):
        n, group = self.mesh.axis_size(axis), self._groups[axis]
        with self._guard(f"all_gather on axis `{axis}`", axis):
            shared = self._shared_for(t, axis)
            flat = shared.all_gather(t) if shared is not None and t.dim() > 0 else None
            if flat is not None:
                pieces = list(flat.chunk(n, 0))
            elif "all_gather" in self.native_ops:
                # gloo accepts only the concatenated output form, (n * t.shape[0], ...).
                flat = t.new_empty((n * t.shape[0], *t.shape[1:]))
                _all_gather_tensor(flat, t, group=group)
                pieces = list(flat.chunk(n, 0))
            else:
                pieces = [torch.empty_like(t) for _ in range(n)]
                dist.all_gather(pieces, t, group=group)
        return torch.cat(pieces, dim=dim)

    def _reduce_scatter(self, t, axis, dim):
        n, group = self.mesh.axis_size(axis), self._groups[axis]
        with self._guard(f"reduce_scatter on axis `{axis}`", axis):
            shared = self._shared_for(t, axis, sums=True)
            if shared is not None and t.shape[dim] % n == 0:
                out = shared.reduce_scatter(torch.cat(t.chunk(n, dim), 0))
                if out is not None:
                    return out
            if "reduce_scatter" in self.native_ops:
                chunks = t.chunk(n, dim)
                out = t.new_empty(chunks[0].shape)
                _reduce_scatter_tensor(out, torch.cat(chunks, 0), op=dist.ReduceOp.SUM, group=group)
                return out
            total = t.clone()
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total.chunk(n, dim)[self._coords[axis]].clone()

    def _all_to_all(self, t, axis, split_dim, cat_dim):
        n, group = self.mesh.axis_size(axis), self._groups[axis]
        stacked = torch.stack(t.chunk(n, split_dim))  # stacked[j] goes to coordinate j
        with self._guard(f"all_to_all on axis `{axis}`", axis):
            shared = self._shared_for(stacked, axis)
            received = shared.all_to_all(stacked) if shared is not None else None
            if received is not None:
                pieces = list(received.unbind(0))
            elif "all_to_all" in self.native_ops:
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
        with self._guard(f"send to rank {dst_rank}", None):
            dist.send(t, dst=dst_rank)

    def _recv(self, shape, dtype, src_rank):
        out = torch.empty(shape, dtype=dtype, device=self._device())
        with self._guard(f"recv from rank {src_rank}", None):
            dist.recv(out, src=src_rank)
        return out

    def barrier(self) -> None:
        with self._guard("barrier", None):
            dist.barrier()

    def _device(self) -> torch.device:
        if "nccl" in self.backend and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
