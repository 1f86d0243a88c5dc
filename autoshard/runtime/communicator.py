"""The communicator interface that per-rank code talks to, and the "current communicator" of a thread.

Generated rank modules never see a process group. They call the autograd collectives of
:mod:`autoshard.runtime.collective_ops`, which look up the communicator of the calling thread with :func:`current`
(set by :func:`use`) and call its *raw* collectives. Two implementations exist: the in-process simulator
(:mod:`autoshard.runtime.sim`, one thread per rank) and ``torch.distributed`` (:mod:`autoshard.runtime.dist`).

Every raw collective takes a mesh axis *name* and works inside the group of ranks that share every other
coordinate with this rank (``Mesh.group_of``); within a group, coordinate ``i`` on the axis holds chunk ``i``
of a sharded dimension (chunks are contiguous and even, which the compiler guarantees; the communicator still
checks divisibility and raises :class:`~autoshard.errors.RuntimeShapeError`). Every call appends one
:class:`CollectiveRecord` to ``comm.log``, so tests and the CLI can count the collectives a plan really runs::

    >>> world = SimWorld(Mesh(x=2))
    >>> world.run(lambda r: current().all_reduce(torch.ones(3), "x"))
    [tensor([2., 2., 2.]), tensor([2., 2., 2.])]
    >>> world.communicator(0).log
    [CollectiveRecord(kind='all_reduce', axis='x', numel=3, dtype=torch.float32, phase='forward')]

The base class validates arguments, normalises dims, makes inputs contiguous and records; subclasses implement
the ``_all_reduce`` ... ``_recv`` hooks on already-validated, detached, contiguous tensors.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from autoshard.errors import AutoshardError, RuntimeShapeError
from autoshard.mesh import Mesh, as_mesh

__all__ = ["KINDS", "PHASES", "CollectiveRecord", "Communicator", "Handle", "backward_uses", "current", "in_backward",
           "p2p_axis", "rank_thread", "use"]

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send", "recv", "broadcast")
PHASES = ("forward", "backward")


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective as this rank executed it. ``numel`` counts the elements of this rank's *input*."""

    kind: str
    axis: str
    numel: int
    dtype: torch.dtype
    phase: str

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def p2p_axis(mesh: Mesh, a: int, b: int) -> str:
    """The axis name recorded for a send/recv between ranks ``a`` and ``b``: the axes whose coordinates differ,
    joined by ``+`` (a pipeline axis gives just its name; ``""`` when ``a == b``)."""
    ca, cb = mesh.coords(a), mesh.coords(b)
    return "+".join(n for n in mesh.names if ca[n] != cb[n])


class Communicator(abc.ABC):
    """One rank's view of the mesh: its coordinates, its groups, and the collectives over them.

    Attributes: ``mesh``, ``rank``, ``log`` (list of :class:`CollectiveRecord`), ``timeout`` (seconds a
    collective may wait for its peers), ``recording`` (set False to stop appending to ``log`` in long runs).
    """

    #: True where a process runs this one rank (torch.distributed): :func:`current` falls back to it in threads
    #: without a ``use`` block of their own. False for the simulator, whose ranks are threads of one process.
    one_rank_per_process: bool = False

    def __init__(self, mesh: Mesh, rank: int, timeout: float):
        self.mesh = as_mesh(mesh)
        self.mesh._check_rank(rank)
        if not timeout > 0:
            raise AutoshardError(f"communicator timeout is {timeout!r}, but must be a positive number of seconds.")
        self.rank = rank
        self.timeout = float(timeout)
        self.log: list[CollectiveRecord] = []
        self.recording = True
        self._coords = self.mesh.coords(rank)
        #: How many random ops (dropout) this rank has run: every rank runs the same program, so the count is the
        #: same on all ranks and seeds their generators alike (runtime.ops.dropout).
        self.random_calls = 0
        #: The async collectives started and not yet waited on, in the order they were started (see wait_all).
        self._in_flight: dict[int, Handle] = {}
        self._in_flight_lock = threading.Lock()
        #: the agreement check of the call now running, started and not yet settled (see expect)
        self._pending = None

    # ---- the agreement check of a call, overlapped with its forward (autoshard.runtime.agreement) ---------
    def expect(self, check) -> None:
        """Hold ``check`` (the agreement check of the call starting now: its ``settle()`` waits for the check's
        exchange and raises where the ranks differ; its ``carry(t, axis)`` may do the call's first all-reduce in that
        exchange) until :meth:`settle`, which every collective of this communicator calls first (an all-reduce
        :meth:`carry`): no collective runs before the check has passed."""
        if self._pending is not None:
            self.settle()
        self._pending = check

    def settle(self) -> None:
        """Finish the check held by :meth:`expect`, if any (raising its error); a no-op otherwise."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.settle()

    def forget_pending(self) -> None:
        """Drop the held check without waiting for it (a call interrupted by KeyboardInterrupt or the like: its
        exchange stays in flight, and :meth:`wait_all` waits for it at shutdown)."""
        self._pending = None

    # ---- coordinates ------------------------------------------------------------------------------------
    def axis_index(self, axis: str | int) -> int:
        """This rank's coordinate on ``axis``."""
        return self._coords[self._axis(axis)]

    def axis_size(self, axis: str | int) -> int:
        return self.mesh.axis_size(self._axis(axis))

    def group(self, axis: str | int) -> tuple[int, ...]:
        """The global ranks of this rank's group along ``axis``, in coordinate order."""
        return self.mesh.group_of(self.rank, self._axis(axis))

    @property
    def device(self) -> torch.device:
        """Where tensors this communicator's collectives take must live (NCCL: this process's GPU)."""
        return torch.device("cpu")

    def all_gather_host(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's small 1-d CPU tensor ``t``, as a CPU tensor ``[world size, len(t)]`` in rank order: what the
        agreement checks exchange to name what differs (:mod:`autoshard.runtime.agreement`). Here one all-gather
        along each mesh axis, the last axis first (ranks number coordinates row-major); a communicator whose
        collectives run on a device exchanges on the host instead, so it never waits for the device."""
        if self._pending is not None:
            self.settle()
        out = t.to(self.device)
        for axis in reversed(self.mesh.names):
            out = self.all_gather(out, axis, 0)
        return out.cpu().view(self.mesh.size, -1)

    def all_reduce_host(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over every rank of a small 1-d CPU tensor ``t``, as a CPU tensor: the agreement check before
        every call. Here one all-reduce along each mesh axis; on the host where the collectives run on a device."""
        if self._pending is not None:
            self.settle()
        out = t.to(self.device)
        for axis in self.mesh.names:
            out = self.all_reduce(out, axis)
        return out.cpu()

    def all_reduce_host_(self, t: torch.Tensor) -> torch.Tensor:
        """:meth:`all_reduce_host` written into ``t`` (a contiguous CPU tensor); returns ``t``."""
        return t.copy_(self.all_reduce_host(t))

    def all_reduce_host_async(self, t: torch.Tensor) -> Handle:
        """:meth:`all_reduce_host` started, its :class:`Handle` waited on for the sum (here computed at once, left
        out of :attr:`log`; a communicator of real processes overlaps it with what the caller does meanwhile)."""
        was, self.recording = self.recording, False
        try:
            return Handle(self.all_reduce_host(t))
        finally:
            self.recording = was

    # ---- raw collectives (no autograd) ------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, axis: str, phase: str = "forward") -> torch.Tensor:
        """Sum of ``t`` over the group along ``axis`` (every rank gets the same new tensor)."""
        axis, t = self._axis(axis), self._input(t, "all_reduce")
        if self._pending is not None:
            pending, self._pending = self._pending, None
            out = pending.carry(t, axis)  # the call's check settled first, or this all-reduce done in its exchange
            if out is not None:
                self._record("all_reduce", axis, t, phase)
                return out
        out = self._all_reduce(t, axis)
        self._record("all_reduce", axis, t, phase)
        return out

    def all_reduce_(self, t: torch.Tensor, axis: str, phase: str = "forward") -> torch.Tensor:
        """Sum of ``t`` over the group along ``axis``, written into ``t`` (contiguous); returns ``t``. Saves the
        output buffer: a fresh large tensor costs page faults that can exceed the collective itself."""
        if self._pending is not None:
            self.settle()
        axis = self._axis(axis)
        if not isinstance(t, torch.Tensor) or not t.is_contiguous():
            raise AutoshardError(f"all_reduce_ on rank {self.rank} needs a contiguous torch.Tensor.")
        self._all_reduce_inplace(t.detach(), axis)
        self._record("all_reduce", axis, t, phase)
        return t

    def _all_reduce_inplace(self, t: torch.Tensor, axis: str) -> None:
        t.copy_(self._all_reduce(t, axis))

    def all_gather(self, t: torch.Tensor, axis: str, dim: int, phase: str = "forward") -> torch.Tensor:
        """Concatenation along ``dim`` of every group member's ``t``, in axis-coordinate order."""
        if self._pending is not None:
            self.settle()
        axis, t = self._axis(axis), self._input(t, "all_gather")
        dim = self._dim(t, dim, "all_gather", axis)
        out = self._all_gather(t, axis, dim)
        self._record("all_gather", axis, t, phase)
        return out

    def reduce_scatter(self, t: torch.Tensor, axis: str, dim: int, phase: str = "forward") -> torch.Tensor:
        """Sum over the group, then this rank's contiguous chunk along ``dim`` (chunk i on coordinate i)."""
        if self._pending is not None:
            self.settle()
        axis, t = self._axis(axis), self._input(t, "reduce_scatter")
        dim = self._dim(t, dim, "reduce_scatter", axis, divisible=True)
        out = self._reduce_scatter(t, axis, dim)
        self._record("reduce_scatter", axis, t, phase)
        return out

    def all_to_all(self, t: torch.Tensor, axis: str, split_dim: int, cat_dim: int,
                   phase: str = "forward") -> torch.Tensor:
        """Chunk ``t`` along ``split_dim`` into n pieces, send piece j to coordinate j, concatenate the received
        pieces along ``cat_dim`` in coordinate order. Shard(i) → Shard(j) is ``all_to_all(t, axis, j, i)``."""
        if self._pending is not None:
            self.settle()
        axis, t = self._axis(axis), self._input(t, "all_to_all")
        split_dim = self._dim(t, split_dim, "all_to_all", axis, divisible=True)
        cat_dim = self._dim(t, cat_dim, "all_to_all", axis)
        out = self._all_to_all(t, axis, split_dim, cat_dim)
        self._record("all_to_all", axis, t, phase)
        return out

    def broadcast(self, t: torch.Tensor, axis: str, src: int = 0, phase: str = "forward") -> torch.Tensor:
        """The ``t`` of the group member at coordinate ``src`` on ``axis``, on every member (a new tensor)."""
        if self._pending is not None:
            self.settle()
        axis, t = self._axis(axis), self._input(t, "broadcast")
        n = self.mesh.axis_size(axis)
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < n:
            raise AutoshardError(f"broadcast on axis `{axis}` has src={src!r}, but src is a coordinate on the "
                                 f"axis, an int in [0, {n - 1}].")
        out = self._broadcast(t, axis, src)
        self._record("broadcast", axis, t, phase)
        return out

    def send(self, t: torch.Tensor, dst_rank: int, phase: str = "forward") -> None:
        """Point-to-point send of ``t`` to global rank ``dst_rank`` (matched by a ``recv`` there)."""
        if self._pending is not None:
            self.settle()
        t = self._input(t, "send")
        self._peer(dst_rank, "send")
        self._send(t, dst_rank)
        self._record("send", p2p_axis(self.mesh, self.rank, dst_rank), t, phase)

    def recv(self, shape: Sequence[int], dtype: torch.dtype, src_rank: int, phase: str = "forward") -> torch.Tensor:
        """Receive a tensor of ``shape`` and ``dtype`` sent by global rank ``src_rank``."""
        if self._pending is not None:
            self.settle()
        self._peer(src_rank, "recv")
        shape = torch.Size(shape)
        out = self._recv(shape, dtype, src_rank)
        self._record("recv", p2p_axis(self.mesh, self.rank, src_rank), out, phase)
        return out

    def all_reduce_async(self, t: torch.Tensor, axis: str, phase: str = "backward") -> Handle:
        """Start a sum all-reduce of ``t`` over ``axis`` and return a :class:`Handle` whose ``wait()`` gives the
        result. Every rank of the group must start its async collectives on that group in the same order (as with
        the blocking ones). Used by the gradient bucketer (:mod:`autoshard.runtime.buckets`) to overlap gradient
        sync with backward compute. The caller hands ``t`` over: it may be reduced in place, and must not be read
        or modified before ``wait()``."""
        if self._pending is not None:
            self.settle()
        axis, t = self._axis(axis), self._input(t, "all_reduce")
        handle = self._track(self._all_reduce_async(t, axis))
        self._record("all_reduce", axis, t, phase)
        return handle

    def all_gather_async(self, t: torch.Tensor, axis: str, phase: str = "forward") -> Handle:
        """Start an all-gather of ``t`` along dim 0 over ``axis``; the :class:`Handle`'s ``wait()`` gives the
        gathered tensor. Same ordering rule as :meth:`all_reduce_async`; ``t`` must not be modified before
        ``wait()``. Used to gather the next layer's ZeRO-3 parameters early (:mod:`autoshard.runtime.zero`)."""
        if self._pending is not None:
            self.settle()
        axis, t = self._axis(axis), self._input(t, "all_gather")
        self._dim(t, 0, "all_gather", axis)
        handle = self._track(self._all_gather_async(t, axis))
        self._record("all_gather", axis, t, phase)
        return handle

    def _track(self, handle: Handle) -> Handle:
        """Keep ``handle`` in :attr:`_in_flight` until it is waited on: a collective nobody waits for (a prefetch
        a changed program never consumed) must still complete before the process groups go away."""
        if handle.is_completed():
            return handle
        key = id(handle)
        with self._in_flight_lock:
            self._in_flight[key] = handle

        def forget():
            with self._in_flight_lock:
                self._in_flight.pop(key, None)

        handle._on_done = forget
        return handle

    def wait_all(self) -> int:
        """Wait for every async collective this rank started and has not waited on yet, oldest first (every rank
        started them in the same order, so this completes wherever the ranks' programs agree). Returns how many
        there were. :func:`autoshard.runtime.shutdown` calls it before the process groups are destroyed."""
        with self._in_flight_lock:
            pending = list(self._in_flight.values())
        for handle in pending:
            handle.wait()
        return len(pending)

    def _all_gather_async(self, t: torch.Tensor, axis: str) -> Handle:
        return Handle(self._all_gather(t, axis, 0))  # default: blocking, already complete

    def _all_reduce_async(self, t: torch.Tensor, axis: str) -> Handle:
        # Default: blocking, already complete (the simulator: its ranks are threads that meet at once anyway), and
        # in place, as the real backends do it.
        self._all_reduce_inplace(t, axis)
        return Handle(t)

    @abc.abstractmethod
    def barrier(self) -> None:
        """Wait until every rank of the mesh reaches the barrier."""

    # ---- hooks for implementations ----------------------------------------------------------------------
    @abc.abstractmethod
    def _all_reduce(self, t: torch.Tensor, axis: str) -> torch.Tensor: ...

    @abc.abstractmethod
    def _all_gather(self, t: torch.Tensor, axis: str, dim: int) -> torch.Tensor: ...

    @abc.abstractmethod
    def _reduce_scatter(self, t: torch.Tensor, axis: str, dim: int) -> torch.Tensor: ...

    @abc.abstractmethod
    def _all_to_all(self, t: torch.Tensor, axis: str, split_dim: int, cat_dim: int) -> torch.Tensor: ...

    @abc.abstractmethod
    def _broadcast(self, t: torch.Tensor, axis: str, src: int) -> torch.Tensor: ...

    @abc.abstractmethod
    def _send(self, t: torch.Tensor, dst_rank: int) -> None: ...

    @abc.abstractmethod
    def _recv(self, shape: torch.Size, dtype: torch.dtype, src_rank: int) -> torch.Tensor: ...

    # ---- validation -------------------------------------------------------------------------------------
    def _axis(self, axis: str | int) -> str:
        return self.mesh.names[self.mesh.index(axis)]

    def _input(self, t, kind: str) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise AutoshardError(f"{kind} on rank {self.rank} got a {type(t).__name__}, but takes a torch.Tensor.")
        return t.detach().contiguous()

    def _dim(self, t: torch.Tensor, dim: int, kind: str, axis: str, divisible: bool = False) -> int:
        nd = t.dim()
        if isinstance(dim, bool) or not isinstance(dim, int) or not -nd <= dim < max(nd, 1):
            raise RuntimeShapeError(f"{kind} on axis `{axis}` got dim={dim!r}, but the tensor of rank {self.rank} "
                                    f"has shape {list(t.shape)}: use a dim in [{-nd}, {nd - 1}].")
        if nd == 0:
            raise RuntimeShapeError(f"{kind} on axis `{axis}` got a 0-dim tensor on rank {self.rank}, but needs "
                                    "a tensor with at least one dimension.")
        dim %= nd
        n = self.mesh.axis_size(axis)
        if divisible and t.shape[dim] % n:
            raise RuntimeShapeError(f"{kind} on axis `{axis}` of size {n} splits dim {dim} of shape "
                                    f"{list(t.shape)} on rank {self.rank}, but {t.shape[dim]} is not divisible by "
                                    f"{n}: the plan must only split dims divisible by the axis size.")
        return dim

    def _peer(self, peer: int, kind: str) -> None:
        if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < self.mesh.size:
            raise AutoshardError(f"{kind} on rank {self.rank} names peer rank {peer!r}, but mesh {self.mesh} has "
                                 f"ranks 0..{self.mesh.size - 1}.")
        if peer == self.rank:
            raise AutoshardError(f"{kind} on rank {self.rank} names itself as the peer, but point-to-point "
                                 "transfers need two different ranks.")

    def _record(self, kind: str, axis: str, t: torch.Tensor, phase: str) -> None:
        if phase not in PHASES:
            raise AutoshardError(f"{kind} got phase={phase!r}, but phase is 'forward' or 'backward'.")
        if self.recording:
            self.log.append(CollectiveRecord(kind, axis, t.numel(), t.dtype, phase))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(mesh={self.mesh}, rank={self.rank})"


class Handle:
    """An in-flight collective: ``wait()`` blocks until it completes and returns its result (idempotent)."""

    def __init__(self, result: torch.Tensor, wait=None):
        self._result = result
        self._wait = wait
        self._on_done = None  # set by Communicator._track: forget this handle once it is waited on

    def wait(self) -> torch.Tensor:
        if self._wait is not None:
            wait, self._wait = self._wait, None
            try:
                wait()
            finally:
                if self._on_done is not None:
                    self._on_done()
        return self._result

    def is_completed(self) -> bool:
        return self._wait is None


# ---- the current communicator of a thread -----------------------------------------------------------------
_local = threading.local()


@dataclass(frozen=True)
class _Scope:
    comm: Communicator
    #: True for the scope a simulator thread runs its rank's function in (:func:`rank_thread`): the stand-in for a
    #: process that *is* this rank. A real rank has no communicator active outside a ``use`` block (a ShardedModule's
    #: call), so neither does the simulator's rank thread inside a backward pass (module doc of sim).
    rank_thread: bool = False


def _stack() -> list[_Scope]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


@contextmanager
def use(comm: Communicator) -> Iterator[Communicator]:
    """Make ``comm`` the communicator of the calling thread inside the ``with`` block (nestable)."""
    if not isinstance(comm, Communicator):
        raise AutoshardError(f"use() got a {type(comm).__name__}, but needs an autoshard.runtime Communicator "
                             "(SimWorld(mesh).communicator(rank) or DistCommunicator(mesh)).")
    with _scope(_Scope(comm)):
        yield comm


@contextmanager
def rank_thread(comm: Communicator) -> Iterator[Communicator]:
    """The scope a simulator thread runs one rank's function in: ``comm`` is current for the function's own code
    (its forward calls, raw collectives), but not inside a backward pass the function starts, where a process
    running that rank would have no communicator unless the backward's own code makes one current (an op's kept
    communicator, a recomputation's)."""
    with _scope(_Scope(comm, rank_thread=True)):
        yield comm


@contextmanager
def _scope(scope: _Scope):
    stack = _stack()
    stack.append(scope)
    if scope.comm.one_rank_per_process:
        _process_wide.append(scope.comm)
    try:
        yield scope.comm
    finally:
        stack.pop()
        if scope.comm.one_rank_per_process:
            _process_wide.remove(scope.comm)


#: Communicators of processes that run one rank (``one_rank_per_process``) inside a ``use`` block of any thread:
#: autograd may run backward (a compiled one too) on a thread of its own (CUDA's device threads), which sees them.
_process_wide: list[Communicator] = []


def in_backward() -> bool:
    """Whether the calling thread is running an autograd backward pass."""
    return torch._C._current_graph_task_id() != -1


#: {autograd graph task id: the communicator of the forward whose outputs that backward pass differentiates},
#: set by :func:`backward_uses` as the backward reaches those outputs, dropped when the pass ends.
_backward_comms: dict[int, Communicator] = {}
_backward_lock = threading.Lock()


def _entered_backward(comm: Communicator) -> None:
    """Record ``comm`` as the communicator of the calling thread's backward pass (the first time it reaches a
    forward's outputs); the pass's end forgets it."""
    task = torch._C._current_graph_task_id()
    with _backward_lock:
        known = _backward_comms.setdefault(task, comm)
    if known is not comm:
        raise AutoshardError(f"one backward pass differentiates the outputs of two calls run by different "
                             f"communicators ({known!r} and {comm!r}), so its collectives have no one group to run "
                             "in: call backward() on each sharded module's loss separately.")
    torch.autograd.Variable._execution_engine.queue_callback(lambda: _forget_backward(task))


def _forget_backward(task: int) -> None:
    with _backward_lock:
        _backward_comms.pop(task, None)


def backward_uses(outputs, comm: Communicator):
    """Make ``comm`` current for every backward pass through ``outputs`` (any pytree), from its first step through
    them (:func:`current`): a hook before each output's autograd node, so the outputs stay the program's own
    tensors. What a ShardedModule's call returns; returns ``outputs``."""
    from torch.utils import _pytree as pytree

    if not torch.is_grad_enabled():
        return outputs
    leaves = (outputs,) if type(outputs) is torch.Tensor else pytree.tree_leaves(outputs)
    nodes = {id(x.grad_fn): x.grad_fn for x in leaves if isinstance(x, torch.Tensor) and x.grad_fn is not None}
    for node in nodes.values():
        node.register_prehook(lambda grads: _entered_backward(comm))
    return outputs


def current() -> Communicator:
    """The communicator of the calling thread's innermost :func:`use` block. Inside a backward pass with none: the
    communicator of the forward whose outputs the pass differentiates (:func:`backward_uses`), else that of a process
    running one rank (:class:`~autoshard.runtime.dist.DistCommunicator`) while it is in a ``use`` block of any
    thread. A simulator rank's thread (:func:`rank_thread`) counts as in no block inside a backward pass, as a real
    rank's process is after its module's call has returned."""
    stack = _stack()
    backward = in_backward()
    if stack and not (stack[-1].rank_thread and backward):
        return stack[-1].comm
    if backward:
        comm = _backward_comms.get(torch._C._current_graph_task_id())
        if comm is not None:
            return comm
    if _process_wide:
        return _process_wide[-1]
    where = (" in this backward pass (it differentiates no ShardedModule call's outputs, and no use() block is "
             "active)") if backward else ""
    raise AutoshardError(f"no communicator is active{where}: run the rank module under "
                         "autoshard.runtime.use(comm) or through a ShardedModule / simulator (SimWorld.run).")
