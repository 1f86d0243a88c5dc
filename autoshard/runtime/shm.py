"""Collectives between two processes on one host through shared memory (the gloo path on CPU).

Over loopback TCP, gloo's all-reduce of a few MiB is mostly copying through sockets and waking threads: between 2
processes on a 2-core machine, 9.3 ms for 8 MiB and 19 ms for 16 MiB, where writing the tensor into shared memory,
one tiny message to say so and one add of the peer's copy take 3.2 ms and 6.0 ms (less with the flags below). The
bytes each rank hands over are the same; they go through a shared mapping instead of a socket.

:class:`SharedMemoryPair` holds one mapping per pair of ranks: 2 halves x 2 ranks x a slot as large as the largest
tensor so far, at most ``chunk_bytes`` (4 MiB: the mapping stays within 16 MiB per pair; larger tensors go through
in chunks, one signal each). It is made on the first all-reduce that needs it and remade larger when a larger
tensor comes: a file in ``/dev/shm`` that rank 0 creates and reserves with ``posix_fallocate`` (so a full
``/dev/shm`` is an error here, not a ``SIGBUS`` later), both ranks ``mmap`` (the slots are a ``torch.frombuffer``
view of it), and rank 0 unlinks once both hold it. If any step fails on either rank (no ``/dev/shm``, not enough
space, ranks in different containers or on different hosts, so that rank 1 cannot open rank 0's file), both ranks
learn it in the same handshake and :meth:`SharedMemoryPair.all_reduce` returns None from then on: the caller falls
back to the backend's all-reduce.

One all-reduce (of each chunk): copy the tensor into this rank's slot, tell the peer so, wait until the peer has
said the same, then ``add(mine, theirs)``. Both ranks compute the same IEEE sum with the operands swapped, so the
result is bit for bit the same on both, and equal to gloo's. All-gather, reduce-scatter and all-to-all are the same
swap with another send and another use of the peer's slot: the shard itself, then both in rank order; the half the
peer keeps, then ``own half + theirs``; the piece addressed to the peer, then the peer's piece beside this rank's
own. Slots are double-buffered: swap ``k`` uses half ``k % 2``; a rank writes that half again only in swap
``k + 2``, after the peer's signal of ``k + 1``, which the peer gives only once it has read the half in ``k`` — so
one signal per rank and swap is enough.

Signals. On x86-64 (:data:`FLAGS_SYNC`) each rank's signal is a counter in the mapping's header, written after
the slot: x86-64 makes a core's stores visible in program order (libraries that use streaming stores for large
copies, glibc's ``memcpy``, fence them), so a peer that reads the new counter then reads the slot's new bytes.
The waiting rank spins for 100 µs, then naps 20 µs at a time (giving its core away); meeting costs microseconds
(2 processes, 2 cores: a 128 KiB all-reduce 0.2 ms, 8 MiB 3.6 ms, against gloo's 1.5 and 15 ms in the same run).
Every 50 ms of waiting it checks the timeout and that the peer process still runs (its pid, exchanged in the
handshake), so a dead peer is an error within 50 ms, not a hang. Elsewhere the signal is a token message over
the pair's process group (tens of microseconds of work, but ~0.4 ms of latency between 2 processes here), which
also carries the all-reduce's number: ranks whose programs issue different all-reduces get an error naming both
numbers instead of wrong sums; its timeouts and dead peers are the group's (gloo notices a closed socket at once).
"""

from __future__ import annotations

import itertools
import mmap
import os
import platform
import struct
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from autoshard.errors import AutoshardError

__all__ = ["FLAGS_SYNC", "SHM_DIR", "PeerExitedError", "SharedMemoryPair", "mapping_bytes"]

SHM_DIR = "/dev/shm"
#: Whether pairs synchronise through flags in the mapping (x86-64: stores become visible in program order, so a
#: flag written after the data is never seen before it) rather than a token message over the process group.
FLAGS_SYNC = platform.machine().lower() in ("x86_64", "amd64")
_ALIGN = 1 << 16  # slot sizes are multiples of this: every slot starts aligned for any dtype
_HEADER = _ALIGN  # the flags: rank 0's at byte 0, rank 1's at byte 128 (cache lines of their own)
_FLAG = struct.Struct("<q")
_SPIN_S = 100e-6  # a waiting rank spins this long, then sleeps in short naps (giving its core away)
_NAP_S = 20e-6
_serials = itertools.count()  # this process's mappings: with its pid, a file name no other mapping has


class PeerExitedError(RuntimeError):
    """The peer process of a pair exited while this rank waited for its signal (the communicator turns it into a
    :class:`~autoshard.errors.CollectiveTimeoutError` naming the collective, as it does a closed gloo socket)."""

    def __init__(self, peer: int, pid: int, number: int):
        super().__init__(f"peer rank {peer} (pid {pid}) exited during shared-memory all-reduce #{number}")
        self.peer, self.pid, self.number = peer, pid, number


class SharedMemoryPair:
    """Sum all-reduces between this rank and ``peer`` (global rank) through a shared mapping.

    ``group``: a process group of the two ranks, for the handshake and the token messages; ``first``: whether this
    rank is the pair's rank 0 (it creates the files); ``next_tag``: gives the tag of each message (the same sequence
    on both ranks); ``chunk_bytes``: the largest slot (larger tensors go through in chunks of this size);
    ``flags``: signal through counters in the mapping (default on x86-64) rather than token messages; ``timeout``:
    seconds a rank waits for the peer's signal (flags; token messages have the group's).
    """

    def __init__(self, group, peer: int, first: bool, next_tag: Callable[[], int], chunk_bytes: int = 4 << 20,
                 flags: bool = FLAGS_SYNC, timeout: float = 300.0):
        self.group, self.peer, self.first, self.next_tag = group, peer, first, next_tag
        self.chunk_bytes = -(-chunk_bytes // _ALIGN) * _ALIGN
        self.flags, self.timeout = flags, timeout
        self.slot_bytes = 0
        self.region: torch.Tensor | None = None  # uint8 (2 halves, 2 ranks, slot_bytes)
        self._map: mmap.mmap | None = None  # the mapping behind region (its first _HEADER bytes: the flags)
        self._peer_pid = 0
        self.failed: str | None = None  # why shared memory is off for this pair (the same on both ranks)
        self.calls = 0

    # ---- the handshake ----------------------------------------------------------------------------------
    def _swap(self, mine: list[int]) -> list[int]:
        """Send ``mine`` to the peer and receive its list of the same length."""
        tag = self.next_tag()
        out, theirs = torch.tensor(mine, dtype=torch.int64), torch.empty(len(mine), dtype=torch.int64)
        for work in (dist.isend(out, self.peer, group=self.group, tag=tag),
                     dist.irecv(theirs, self.peer, group=self.group, tag=tag)):
            work.wait()
        return theirs.tolist()

    def _grow(self, nbytes: int) -> bool:
        """Map a region with slots of at least ``nbytes`` on both ranks; False (and ``failed`` set) if impossible.
        Two token exchanges: rank 0 says whether (and under which name) it made the file, rank 1 whether it
        mapped it; rank 0 unlinks the file after the second, or when either fails."""
        slot = -(-nbytes // _ALIGN) * _ALIGN
        size, mapping, why = _HEADER + 4 * slot, None, ""
        if self.first:
            serial = next(_serials)
            name = os.path.join(SHM_DIR, f"autoshard-{os.getpid()}-{serial}")
            try:
                try:
                    fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                    try:
                        os.posix_fallocate(fd, 0, size)  # reserve now: a full /dev/shm fails here, not as SIGBUS
                        mapping = mmap.mmap(fd, size)
                    finally:
                        os.close(fd)
                except (OSError, ValueError) as e:
                    why = f"rank {dist.get_rank()} could not make {name} ({size} bytes): {e}"
                self._swap([mapping is not None, os.getpid(), serial])
                mapped, peer_pid = self._swap([mapping is not None, 0])  # always swapped: rank 1 waits for it
                both = mapping is not None and bool(mapped)
            finally:
                try:
                    os.unlink(name)  # both ranks hold their mapping (or gave up): the name is not needed
                except FileNotFoundError:
                    pass
        else:
            made, peer_pid, serial = self._swap([0, 0, 0])
            if made:
                name = os.path.join(SHM_DIR, f"autoshard-{peer_pid}-{serial}")
                try:
                    fd = os.open(name, os.O_RDWR)
                    try:
                        mapping = mmap.mmap(fd, size)
                    finally:
                        os.close(fd)
                except (OSError, ValueError) as e:
                    why = f"rank {dist.get_rank()} could not map {name}: {e}"
            self._swap([mapping is not None, os.getpid()])
            both = bool(made) and mapping is not None
        if not both:
            self.failed = why or "the peer rank could not share memory with this one"
            self.region = self._map = None
            return False
        self._peer_pid = peer_pid if _alive(peer_pid) else 0  # 0: its pid is not ours to see (another namespace)
        self._map = mapping
        self.region = torch.frombuffer(mapping, dtype=torch.uint8, offset=_HEADER).view(2, 2, slot)
        self.slot_bytes = slot
        return True

    def _meet(self, number: int) -> None:
        """Tell the peer this rank's slot of all-reduce ``number`` is written; return once the peer's is."""
        if not self.flags:
            (peer_number,) = self._swap([number])
            if peer_number != number:
                raise AutoshardError(
                    f"shared-memory all-reduce #{number} on rank {dist.get_rank()} met all-reduce #{peer_number} "
                    f"of rank {self.peer}: the two ranks' programs issue different all-reduces (their rank modules "
                    "or inputs differ); every rank of a group must run the same collectives in the same order."
                )
            return
        mapping, want = self._map, number + 1
        mine, theirs = (0, 128) if self.first else (128, 0)
        _FLAG.pack_into(mapping, mine, want)  # after the slot's stores: x86-64 makes them visible first
        if _FLAG.unpack_from(mapping, theirs)[0] >= want:
            return
        start = time.perf_counter()
        check = start + 0.05
        while _FLAG.unpack_from(mapping, theirs)[0] < want:
            now = time.perf_counter()
            if now - start > _SPIN_S:
                time.sleep(_NAP_S)
            if now > check:
                check = now + 0.05
                if now - start > self.timeout:  # "timed out": the communicator's timeout error
                    raise RuntimeError(f"timed out after {self.timeout:g} s waiting for rank {self.peer}'s signal of "
                                       f"shared-memory all-reduce #{number}")
                if self._peer_pid and not _alive(self._peer_pid):
                    raise PeerExitedError(self.peer, self._peer_pid, number)

    # ---- the all-reduce ---------------------------------------------------------------------------------
    def _swap_chunks(self, send: torch.Tensor, receive: Callable[[int, int, torch.Tensor, torch.Tensor], None]) -> bool:
        """Hand the flat, contiguous ``send`` to the peer through the slots, a chunk at a time: once both ranks have
        written a chunk, ``receive(start, n, mine, theirs)`` gets this rank's and the peer's elements
        ``[start, start + n)`` (views of the slots, valid during the call only). False if this pair cannot share
        memory (then nothing was exchanged: fall back, on both ranks alike)."""
        if self.failed is not None:
            return False
        size, total = send.element_size(), send.numel()
        chunk = self.chunk_bytes // size  # elements per chunk
        if min(total, chunk) * size > self.slot_bytes and not self._grow(min(total, chunk) * size):
            return False
        me = 0 if self.first else 1
        for start in range(0, total, chunk):
            n = min(chunk, total - start)
            half, number = self.calls % 2, self.calls
            self.calls += 1
            mine = self.region[half, me, : n * size].view(send.dtype)
            theirs = self.region[half, 1 - me, : n * size].view(send.dtype)
            mine.copy_(send[start : start + n])
            self._meet(number)
            receive(start, n, mine, theirs)
        return True

    # ---- the collectives (None: this pair cannot share memory; fall back) ----------------------------------
    def all_reduce(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """The sum of ``t`` over the pair, written to ``out`` (contiguous, shaped like ``t``; may be ``t`` itself;
        default a new tensor)."""
        result = torch.empty(t.shape, dtype=t.dtype) if out is None else out
        target = result.view(-1)

        def add(start, n, mine, theirs):
            torch.add(mine, theirs, out=target[start : start + n])

        return result if self._swap_chunks(t.reshape(-1), add) else None

    def all_gather(self, t: torch.Tensor) -> torch.Tensor | None:
        """Both ranks' ``t`` concatenated along dim 0, the pair's rank 0 first."""
        me, m = (0 if self.first else 1), t.numel()
        result = t.new_empty((2 * t.shape[0], *t.shape[1:]))
        flat = result.view(-1)
        flat[me * m : (me + 1) * m].copy_(t.reshape(-1))
        peer = flat[(1 - me) * m : (2 - me) * m]

        def take(start, n, mine, theirs):
            peer[start : start + n].copy_(theirs)

        return result if self._swap_chunks(t.reshape(-1), take) else None

    def reduce_scatter(self, t: torch.Tensor) -> torch.Tensor | None:
        """This rank's half (along dim 0, the pair's rank 0 first) of the sum of ``t`` over the pair."""
        me, half = (0 if self.first else 1), t.shape[0] // 2
        flat = t.reshape(-1)
        m = flat.numel() // 2
        own = flat[me * m : (me + 1) * m]
        result = t.new_empty((half, *t.shape[1:]))
        target = result.view(-1)

        def add(start, n, mine, theirs):  # mine: the half this rank sends; own: the half it keeps
            torch.add(own[start : start + n], theirs, out=target[start : start + n])

        return result if self._swap_chunks(flat[(1 - me) * m : (2 - me) * m], add) else None

    def all_to_all(self, t: torch.Tensor) -> torch.Tensor | None:
        """``t`` stacked as ``(2, ...)``, piece ``j`` addressed to the pair's rank ``j``: the pieces addressed to
        this rank, stacked in the same way (its own piece stays, the peer's arrives)."""
        me = 0 if self.first else 1
        result = torch.empty_like(t, memory_format=torch.contiguous_format)
        result[me].copy_(t[me])
        arriving = result[1 - me].view(-1)

        def take(start, n, mine, theirs):
            arriving[start : start + n].copy_(theirs)

        return result if self._swap_chunks(t[1 - me].reshape(-1), take) else None


def mapping_bytes(pair: SharedMemoryPair) -> int:
    """Bytes of the pair's current mapping (header and slots; 0 before its first collective or after a failure)."""
    return 0 if pair.region is None else _HEADER + pair.region.numel()


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (and is not a zombie) as this process sees it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True
