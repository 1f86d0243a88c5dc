"""In-process simulator of every rank of a mesh: one Python thread per rank, collectives through shared memory.

:class:`SimWorld` is the fast path of the tests and of ``autoshard run --simulate``: a plan's rank modules run
side by side in one process, forward and backward (for CPU tensors the autograd engine runs ``.backward()`` on
the calling thread, so collectives issued by backward functions run in the rank's own thread too).

How an exchange works: each group (one per axis and set of peers, plus the whole world for :meth:`barrier`)
has a :class:`_Rendezvous` with one slot per member. A rank deposits a private copy of its input and waits on
the group's condition until every member has deposited; the last one to arrive seals the round (a snapshot of
the slots) and wakes the others. Every member then computes its own result from the snapshot, in coordinate
order (sums are ``((x0 + x1) + x2) + ...``), so results are bit-identical on every rank and from run to run.

Failures never hang: a rank that waits longer than ``timeout`` raises
:class:`~autoshard.errors.CollectiveTimeoutError` naming the collective, the axis and the ranks that did not
arrive (and what those were doing), and aborts the world; :meth:`SimWorld.run` aborts the world as soon as one
rank raises, which wakes every waiting rank, and re-raises the first error with its rank in the message.

Point-to-point ``send`` is buffered (it returns at once, like a small eager send); ``recv`` blocks.

``SimWorld(mesh, serial=True)`` runs the ranks one at a time: a rank holds the world's turn while it computes and
hands it over only while it waits in a collective, so no two ranks execute Python at once. That is how to run
``torch.compile``'d rank programs here: dynamo's compilation is not thread-safe (concurrent compiles in one
process interfere), while each process of a real run compiles its one rank alone, as the turn makes every rank
here do.

For the length of a run, and only then, the process is set up for ranks that are threads
(:mod:`autoshard.runtime.sim_threads`): the simulator's lock serialises the rank threads' tracing, planning,
program building, initialisation and checkpoint I/O (the library's hook for it,
:data:`autoshard.runtime.torch_state.RANK_THREADS`) and DTensor's sharding propagation on FakeTensors, each
rank thread gets its own ``torch.distributed`` world (torch's threaded process group), and its own
``torch.compiler.is_compiling()`` (one rank's trace does not make the others "compiling"). Everything is put back
when the run ends; a process that never simulates (each process of a torchrun job) is never changed.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque

import torch

from autoshard.errors import AutoshardError, CollectiveTimeoutError, RuntimeShapeError
from autoshard.mesh import Mesh, as_mesh
from autoshard.runtime.communicator import Communicator, rank_thread
from autoshard.runtime.sim_threads import simulated_run

__all__ = ["SimCommunicator", "SimWorld"]


class _Aborted(AutoshardError):
    """Raised in ranks woken up because another rank failed (never the error :meth:`SimWorld.run` reports)."""


class _Rendezvous:
    """The shared slots of one group; rounds are numbered so a fast rank can enter round k+1 while slow ranks
    still read round k."""

    def __init__(self, world: SimWorld, axis: str, ranks: tuple[int, ...]):
        self.world = world
        self.axis = axis
        self.ranks = ranks
        self.cond = threading.Condition()
        self._reset()

    def _reset(self) -> None:
        self.slots: list[tuple | None] = [None] * len(self.ranks)
        self.round = 0
        self.sealed: dict[int, list] = {}  # round -> [snapshot, readers left]

    def exchange(self, pos: int, entry: tuple, what: str) -> list[tuple]:
        """Deposit ``entry`` at position ``pos``; return every member's entry in coordinate order."""
        world = self.world
        me = self.ranks[pos]
        with self.cond:
            world._check_alive(what, me)
            rnd = self.round
            self.slots[pos] = entry
            if all(s is not None for s in self.slots):
                self.sealed[rnd] = [self.slots, len(self.ranks)]
                self.slots = [None] * len(self.ranks)
                self.round += 1
                self.cond.notify_all()
            deadline = time.monotonic() + world.timeout
            while self.round == rnd:
                world._check_alive(what, me)
                left = deadline - time.monotonic()
                if left <= 0:
                    self.slots[pos] = None
                    missing = [r for r, s in zip(self.ranks, self.slots) if s is None and r != me]
                    break
                self.cond.wait(left)
            else:
                box = self.sealed[rnd]
                box[1] -= 1
                if box[1] == 0:
                    del self.sealed[rnd]
                return box[0]
        # Abort outside the condition: _abort takes every group's condition in turn.
        err = CollectiveTimeoutError(
            f"{what} (group of ranks {list(self.ranks)}) waited {world.timeout:g} s on rank {me}, but ranks "
            f"{missing} did not arrive ({world._describe(missing)}): every rank of the group must call the same "
            "collectives in the same order.")
        world._abort(me, err)
        raise err


class _Channel:
    """Buffered point-to-point messages from one rank to another, in send order."""

    def __init__(self):
        self.cond = threading.Condition()
        self.queue: deque[torch.Tensor] = deque()


# Device types whose autocast state a rank thread takes over from the caller of SimWorld.run.
_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "mtia", "maia", "privateuseone")


def _caller_state() -> tuple[bool, tuple[tuple[str, torch.dtype], ...]]:
    """The calling thread's grad mode and, per device type where it is on, its autocast dtype: thread-local state
    that a process running one rank would have from its own script, but that a new thread does not inherit."""
    autocast = []
    for device_type in _AUTOCAST_DEVICE_TYPES:
        try:
            if torch.is_autocast_enabled(device_type):
                autocast.append((device_type, torch.get_autocast_dtype(device_type)))
        except RuntimeError:  # a device type this build of torch does not know
            continue
    return torch.is_grad_enabled(), tuple(autocast)


@contextlib.contextmanager
def _in_state(state):
    """Run the body (a rank thread's function) in ``state`` of :func:`_caller_state`."""
    grad, autocast = state
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.set_grad_enabled(grad))
        for device_type, dtype in autocast:
            stack.enter_context(torch.autocast(device_type, dtype=dtype))
        yield


class SimWorld:
    """Every rank of ``mesh`` in this process. ``timeout``: seconds a collective may wait for its peers."""

    def __init__(self, mesh: Mesh, timeout: float = 60.0, serial: bool = False):
        self.mesh = as_mesh(mesh)
        self.serial = bool(serial)
        self._turn = threading.Lock()
        self._turn_owner: int | None = None
        if not timeout > 0:
            raise AutoshardError(f"SimWorld timeout is {timeout!r}, but must be a positive number of seconds.")
        self.timeout = float(timeout)
        self._lock = threading.Lock()
        self._groups: dict[tuple[str, tuple[int, ...]], _Rendezvous] = {}
        for axis in self.mesh.names:
            for ranks in self.mesh.groups(axis):
                self._groups[(axis, ranks)] = _Rendezvous(self, axis, ranks)
        everyone = tuple(range(self.mesh.size))
        self._world_group = _Rendezvous(self, "*", everyone)
        self._channels = {(s, d): _Channel() for s in everyone for d in everyone if s != d}
        self._comms = [SimCommunicator(self, r) for r in everyone]
        self._status = ["is running"] * self.mesh.size
        self._aborted: tuple[int, BaseException] | None = None
        self._aborted_at: float | None = None

    def communicator(self, rank: int) -> SimCommunicator:
        """The communicator of ``rank`` (one object per rank; its ``log`` accumulates over runs)."""
        self.mesh._check_rank(rank)
        return self._comms[rank]

    # ---- running every rank -----------------------------------------------------------------------------
    def run(self, fn, *args) -> list:
        """Run ``fn(rank, *args)`` on one thread per rank, each under ``rank_thread(its communicator)``; return the
        results in rank order. The first error of any rank aborts the others and is re-raised (same type where
        possible) with the rank in its message; the original is its ``__cause__``. The process is set up for rank
        threads for the run's length (:func:`autoshard.runtime.sim_threads.simulated_run`)."""
        self._restart()
        with simulated_run(process_groups=not self.serial) as store:
            return self._run(fn, args, store)

    def _run(self, fn, args: tuple, store) -> list:
        n = self.mesh.size
        results: list = [None] * n
        errors: list[tuple[int, BaseException]] = []
        caller_state = _caller_state()  # thread-local: a new thread would start without the caller's

        def main(rank: int) -> None:
            self._set_status(rank, "is running")
            try:
                self._take_turn(rank, "its function")
                try:
                    with (rank_thread(self._comms[rank]), self._process_group(rank, store),
                          _in_state(caller_state)):
                        results[rank] = fn(rank, *args)
                finally:
                    self._give_turn(rank)
                self._set_status(rank, "has returned from its function")
            except BaseException as e:  # noqa: BLE001 - every failure must reach the caller's thread
                self._set_status(rank, f"raised {type(e).__name__}")
                with self._lock:
                    errors.append((rank, e))
                self._abort(rank, e)

        threads = [threading.Thread(target=main, args=(r,), name=f"autoshard-sim-rank{r}", daemon=True)
                   for r in range(n)]
        for t in threads:
            t.start()
        try:
            self._join(threads)
        except BaseException as e:  # KeyboardInterrupt in the caller: do not leave ranks waiting forever
            self._abort(-1, e)
            raise
        real = [(r, e) for r, e in errors if not isinstance(e, _Aborted)] or errors
        if real:
            rank, err = real[0]
            raise _with_rank(err, rank) from err
        return results

    @contextlib.contextmanager
    def _process_group(self, rank: int, store):
        """This rank thread's own ``torch.distributed`` world (torch's threaded process group over ``store``), so
        DTensor code — ``clip_grad_norm_``, DCP, the state-dict helpers on a ShardedModule's DTensor parameters —
        runs on simulated ranks as on real ones. None (no process group; ``store`` None, see
        :func:`~autoshard.runtime.sim_threads.simulated_run`) in serial mode, whose turn-taking the threaded group's
        blocking collectives would deadlock, or when this process already runs a real one."""
        if store is None:
            yield
            return
        import torch.distributed as dist

        dist.init_process_group("threaded", rank=rank, world_size=self.mesh.size, store=store)
        try:
            yield
        finally:
            dist.destroy_process_group()

    def _join(self, threads: list[threading.Thread]) -> None:
        # After an abort every rank blocked in a collective wakes at once; a rank stuck elsewhere (a busy loop in
        # user code) is given one more timeout and then left behind as a daemon thread.
        while any(t.is_alive() for t in threads):
            for t in threads:
                t.join(0.05)
            aborted_at = self._aborted_at
            if aborted_at is not None and time.monotonic() - aborted_at > self.timeout:
                stuck = [i for i, t in enumerate(threads) if t.is_alive()]
                if stuck:
                    rank, err = self._aborted
                    raise AutoshardError(f"ranks {stuck} did not stop within {self.timeout:g} s after rank {rank} "
                                         f"failed ({type(err).__name__}: {err})") from err

    def _restart(self) -> None:
        with self._lock:
            self._aborted = None
            self._aborted_at = None
            for g in (*self._groups.values(), self._world_group):
                with g.cond:
                    g._reset()
            for ch in self._channels.values():
                with ch.cond:
                    ch.queue.clear()

    # ---- the turn of serial worlds ------------------------------------------------------------------------
    def _take_turn(self, rank: int, what: str) -> None:
        """Serial worlds: wait until no other rank computes (aborts and the caller's interrupts still get through)."""
        if not self.serial:
            return
        while not self._turn.acquire(timeout=0.05):
            self._check_alive(what, rank)
        self._turn_owner = rank

    def _give_turn(self, rank: int) -> None:
        if self.serial and self._turn_owner == rank:
            self._turn_owner = None
            self._turn.release()

    def _waiting(self, rank: int, what: str):
        """Around a blocking wait: a serial world's turn passes to the other ranks meanwhile."""
        world = self

        class _Wait:
            def __enter__(self):
                world._give_turn(rank)

            def __exit__(self, *exc):
                world._take_turn(rank, what)

        return _Wait()

    # ---- failure handling -------------------------------------------------------------------------------
    def _abort(self, rank: int, err: BaseException) -> None:
        with self._lock:
            if self._aborted is not None:
                return
            self._aborted = (rank, err)
            self._aborted_at = time.monotonic()
        for cond in [g.cond for g in (*self._groups.values(), self._world_group)] + \
                    [c.cond for c in self._channels.values()]:
            with cond:
                cond.notify_all()

    def _check_alive(self, what: str, rank: int) -> None:
        if self._aborted is None:
            return
        by, err = self._aborted
        if by == rank:
            raise _Aborted(f"{what} on rank {rank} cannot run: this rank's earlier error aborted the world "
                           f"({type(err).__name__}: {err})")
        who = f"rank {by}" if by >= 0 else "the caller"
        raise _Aborted(f"{what} on rank {rank} was aborted because {who} failed ({type(err).__name__}: {err})")

    def _set_status(self, rank: int, status: str) -> None:
        self._status[rank] = status

    def _describe(self, ranks: list[int]) -> str:
        return "; ".join(f"rank {r} {self._status[r]}" for r in ranks) or "none"


class SimCommunicator(Communicator):
    """One rank of a :class:`SimWorld`; create it with ``world.communicator(rank)``."""

    def __init__(self, world: SimWorld, rank: int):
        super().__init__(world.mesh, rank, world.timeout)
        self.world = world

    def _exchange(self, kind: str, axis: str, t: torch.Tensor, **params) -> list[torch.Tensor]:
        ranks = self.mesh.group_of(self.rank, axis)
        pos = self._coords[axis]
        what = f"{kind} on axis `{axis}`"
        world = self.world
        world._set_status(self.rank, f"is waiting in {what}")
        entry = (kind, tuple(t.shape), t.dtype, params, t.clone())
        try:
            with world._waiting(self.rank, what):
                entries = world._groups[(axis, ranks)].exchange(pos, entry, what)
        finally:
            if world._status[self.rank].startswith("is waiting"):
                world._set_status(self.rank, "is running")
        self._check_match(what, ranks, entries)
        return [e[4] for e in entries]

    def _check_match(self, what: str, ranks, entries) -> None:
        def sig(e):
            kind, shape, dtype, params, _ = e
            extra = "".join(f", {k}={v}" for k, v in params.items())
            return f"{kind}(shape {list(shape)}, {str(dtype).removeprefix('torch.')}{extra})"

        first = sig(entries[0])
        if all(sig(e) == first for e in entries[1:]):
            return
        calls = ", ".join(f"rank {r} called {sig(e)}" for r, e in zip(ranks, entries))
        err_type = RuntimeShapeError if len({e[0] for e in entries}) == 1 else AutoshardError
        raise err_type(f"{what} has mismatched calls across its group: {calls}; every rank of a group must call "
                       "the same collective with the same shapes in the same order.")

    def _all_reduce(self, t, axis):
        vals = self._exchange("all_reduce", axis, t)
        return _sum(vals)

    def _all_gather(self, t, axis, dim):
        return torch.cat(self._exchange("all_gather", axis, t, dim=dim), dim=dim)

    def _reduce_scatter(self, t, axis, dim):
        vals = self._exchange("reduce_scatter", axis, t, dim=dim)
        n, c = len(vals), self._coords[axis]
        return _sum([v.chunk(n, dim)[c] for v in vals])

    def _all_to_all(self, t, axis, split_dim, cat_dim):
        vals = self._exchange("all_to_all", axis, t, split_dim=split_dim, cat_dim=cat_dim)
        n, c = len(vals), self._coords[axis]
        return torch.cat([v.chunk(n, split_dim)[c] for v in vals], dim=cat_dim)

    def _broadcast(self, t, axis, src):
        return self._exchange("broadcast", axis, t, src=src)[src].clone()

    def process_group(self, axis: str):
        """Refused: the simulator's ranks share torch's threaded process group, which has collectives but no
        point-to-point transfers, and torch.distributed.pipelining's schedules exchange activations by them."""
        raise AutoshardError(f"a pipelined plan asked for the process group of axis `{axis}` on simulated rank "
                             f"{self.rank}, but the simulator has none with point-to-point transfers (torch's "
                             "threaded process group has collectives only), so torch.distributed.pipelining's "
                             "schedules cannot run on it. Run pipelines on real processes: torchrun, or "
                             "autoshard.runtime.spawn on one machine.")

    def barrier(self) -> None:
        if self._pending is not None:
            self.settle()
        world = self.world
        world._set_status(self.rank, "is waiting in barrier")
        entry = ("barrier", (), torch.float32, {}, torch.empty(0))
        try:
            with world._waiting(self.rank, "barrier"):
                world._world_group.exchange(self.rank, entry, "barrier")
        finally:
            world._set_status(self.rank, "is running")

    def _send(self, t, dst_rank):
        world = self.world
        world._check_alive(f"send to rank {dst_rank}", self.rank)
        ch = world._channels[(self.rank, dst_rank)]
        with ch.cond:
            ch.queue.append(t.clone())
            ch.cond.notify_all()

    def _recv(self, shape, dtype, src_rank):
        world = self.world
        what = f"recv from rank {src_rank}"
        ch = world._channels[(src_rank, self.rank)]
        deadline = time.monotonic() + world.timeout
        world._set_status(self.rank, f"is waiting in {what}")
        t = None
        try:
            with world._waiting(self.rank, what), ch.cond:
                while not ch.queue:
                    world._check_alive(what, self.rank)
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    ch.cond.wait(left)
                else:
                    t = ch.queue.popleft()
        finally:
            world._set_status(self.rank, "is running")
        if t is None:
            err = CollectiveTimeoutError(
                f"{what} on rank {self.rank} waited {world.timeout:g} s, but rank {src_rank} sent nothing "
                f"({world._describe([src_rank])}): every recv needs a matching send.")
            world._abort(self.rank, err)
            raise err
        if t.shape != shape or t.dtype != dtype:
            raise RuntimeShapeError(f"{what} on rank {self.rank} expected shape {list(shape)} {dtype}, but rank "
                                    f"{src_rank} sent shape {list(t.shape)} {t.dtype}.")
        return t


def _sum(vals: list[torch.Tensor]) -> torch.Tensor:
    """Sum in coordinate order, the same on every rank (bit-identical results)."""
    acc = vals[0].clone()
    for v in vals[1:]:
        acc.add_(v)
    return acc


def _with_rank(err: BaseException, rank: int) -> BaseException:
    """A copy of ``err`` whose message starts with the rank (the same type where the constructor allows)."""
    msg = f"rank {rank}: {err}"
    try:
        new = type(err)(msg)
    except Exception:  # noqa: BLE001 - exception types with unusual constructors
        new = None
    if type(new) is not type(err):
        new = AutoshardError(f"rank {rank} raised {type(err).__name__}: {err}")
    return new
