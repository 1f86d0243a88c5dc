"""All-reduce between two processes on one host through shared memory (the gloo path on CPU).

Over loopback TCP, gloo's all-reduce of a few MiB is mostly copying through sockets and waking threads: between 2
processes on a 2-core machine, 9.3 ms for 8 MiB and 19 ms for 16 MiB, where writing the tensor into shared memory,
one tiny message to say so and one add of the peer's copy take 3.2 ms and 6.0 ms (``SHARED_MEMORY_MIN_BYTES`` in
:mod:`autoshard.runtime.dist` says from which size this path is used). The bytes each rank hands over are the
same; they go through a shared mapping instead of a socket.

:class:`SharedMemoryPair` holds one mapping per pair of ranks: 2 halves x 2 ranks x a slot as large as the largest
tensor so far, at most ``chunk_bytes`` (4 MiB: the mapping stays within 16 MiB per pair; larger tensors go through
in chunks, one token each). It is made on the first all-reduce that needs it and remade larger when a larger
tensor comes: a file in ``/dev/shm`` that rank 0 creates and reserves with
``posix_fallocate`` (so a full ``/dev/shm`` is an error here, not a ``SIGBUS`` later), both ranks map with
``torch.from_file(shared=True)``, and rank 0 unlinks once both hold it. If any step fails on either rank (no
``/dev/shm``, not enough space, ranks in different containers or on different hosts, so that rank 1 cannot open
rank 0's file), both ranks learn it in the same handshake and :meth:`SharedMemoryPair.all_reduce` returns None
from then on: the caller falls back to the backend's all-reduce.

One all-reduce (of each chunk): copy the tensor into this rank's slot, exchange a token with the peer over the pair's process
group (sent after the copy, so receiving the peer's token means its slot is written), then ``add(mine, theirs)``.
Both ranks compute the same IEEE sum with the operands swapped, so the result is bit for bit the same on both,
and equal to gloo's. Slots are double-buffered: all-reduce ``k`` uses half ``k % 2``; a rank writes that half
again only in all-reduce ``k + 2``, after the token of ``k + 1``, which the peer sends only once it has read the
half in ``k`` — so one token per all-reduce is enough. The token carries the all-reduce's number: ranks whose
programs issue different all-reduces get an error naming both numbers instead of wrong sums. Timeouts and a dead
peer are the pair group's (gloo notices a closed socket at once).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from autoshard.errors import AutoshardError

__all__ = ["SHM_DIR", "SharedMemoryPair"]

SHM_DIR = "/dev/shm"
_ALIGN = 1 << 16  # slot sizes are multiples of this: every slot starts aligned for any dtype
_serials = itertools.count()  # this process's mappings: with its pid, a file name no other mapping has


class SharedMemoryPair:
    """Sum all-reduces between this rank and ``peer`` (global rank) through a shared mapping.

    ``group``: a process group of the two ranks, used only for the tokens; ``first``: whether this rank is the
    pair's rank 0 (it creates the files); ``next_tag``: gives the tag of each token exchange (the same sequence on
    both ranks); ``chunk_bytes``: the largest slot (larger tensors go through in chunks of this size).
    """

    def __init__(self, group, peer: int, first: bool, next_tag: Callable[[], int], chunk_bytes: int = 4 << 20):
        self.group, self.peer, self.first, self.next_tag = group, peer, first, next_tag
        self.chunk_bytes = -(-chunk_bytes // _ALIGN) * _ALIGN
        self.slot_bytes = 0
        self.region: torch.Tensor | None = None  # uint8 (2 halves, 2 ranks, slot_bytes)
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
        size, region, why = 4 * slot, None, ""
        if self.first:
            serial = next(_serials)
            name = os.path.join(SHM_DIR, f"autoshard-{os.getpid()}-{serial}")
            try:
                try:
                    fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                    try:
                        os.posix_fallocate(fd, 0, size)  # reserve now: a full /dev/shm fails here, not as SIGBUS
                    finally:
                        os.close(fd)
                    region = torch.from_file(name, shared=True, size=size, dtype=torch.uint8)
                except (OSError, RuntimeError) as e:
                    why = f"rank {dist.get_rank()} could not make {name} ({size} bytes): {e}"
                self._swap([region is not None, os.getpid(), serial])
                mapped = self._swap([region is not None])[0]  # always swapped: rank 1 waits for it
                both = region is not None and bool(mapped)
            finally:
                try:
                    os.unlink(name)  # both ranks hold their mapping (or gave up): the name is not needed
                except FileNotFoundError:
                    pass
        else:
            made, pid, serial = self._swap([0, 0, 0])
            if made:
                name = os.path.join(SHM_DIR, f"autoshard-{pid}-{serial}")
                try:
                    region = torch.from_file(name, shared=True, size=size, dtype=torch.uint8)
                except (OSError, RuntimeError) as e:
                    why = f"rank {dist.get_rank()} could not map {name}: {e}"
            self._swap([region is not None])
            both = bool(made) and region is not None
        if not both:
            self.failed = why or "the peer rank could not share memory with this one"
            self.region = None
            return False
        self.region, self.slot_bytes = region.view(2, 2, slot), slot
        return True

    # ---- the all-reduce ---------------------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """The sum of ``t`` over the pair, written to ``out`` (contiguous, shaped like ``t``; may be ``t`` itself;
        default a new tensor); None if this pair cannot share memory (then nothing was exchanged: fall back, on
        both ranks alike)."""
        if self.failed is not None:
            return None
        size = t.element_size()
        chunk = self.chunk_bytes // size  # elements per chunk
        if min(t.numel(), chunk) * size > self.slot_bytes and not self._grow(min(t.numel(), chunk) * size):
            return None
        result = torch.empty(t.shape, dtype=t.dtype) if out is None else out
        source, target = t.reshape(-1), result.view(-1)  # source: a view where t is contiguous
        me = 0 if self.first else 1
        for start in range(0, t.numel(), chunk):
            n = min(chunk, t.numel() - start)
            half, number = self.calls % 2, self.calls
            self.calls += 1
            mine = self.region[half, me, : n * size].view(t.dtype)
            theirs = self.region[half, 1 - me, : n * size].view(t.dtype)
            mine.copy_(source[start : start + n])
            (peer_number,) = self._swap([number])  # after the copy: the peer's token means its slot is written
            if peer_number != number:
                raise AutoshardError(
                    f"shared-memory all-reduce #{number} on rank {dist.get_rank()} met all-reduce #{peer_number} "
                    f"of rank {self.peer}: the two ranks' programs issue different all-reduces (their rank modules "
                    "or inputs differ); every rank of a group must run the same collectives in the same order."
                )
            torch.add(mine, theirs, out=target[start : start + n])
        return result
