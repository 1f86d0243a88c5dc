"""One plan for every rank, and every rank in the same call: what ranks agree on before their program's collectives.

Each process of a job plans for itself (a ShardedModule compiles on its first call). Two things can make ranks run
different programs, and ranks running different programs hang or, where the shapes happen to agree, compute wrong
numbers:

* **a decision that depends on time or load** — the plan search stops at a time limit, so two ranks can stop at
  different plans. :func:`decide_once` makes such a decision on rank 0 and hands it to every rank (the other ranks
  skip the work and wait for it).
* **a call on some ranks only** — the DDP habit ``if rank == 0: evaluate()`` runs the eval program on rank 0 while
  the others run the training program: their collectives pair up with the wrong peers (gloo aborts the process with
  "Received data size doesn't match expected size"; NCCL hangs). :func:`check_call` runs first in every call of a
  ShardedModule: every rank sends (its plan's digest, its mode, its grad mode) and every rank compares
  all of them, so a mismatch is an :class:`~autoshard.errors.AutoshardError` on every rank naming what differs,
  before any collective of the program runs.

Both are built on the communicator's own exchanges (a world-wide one is one exchange along each mesh axis in turn),
so they run the same on ``torch.distributed`` and in the simulator, and they are left out of the communicator's log
(they are not the plan's collectives). The check before each call is one sum of 6 numbers over the world
(:func:`_all_equal`), on the host (:meth:`Communicator.all_reduce_host`: under NCCL a gloo group, so it never waits
for the GPU); only when something differs does every rank gather every rank's values to name it.
"""

from __future__ import annotations

import hashlib
import pickle
from contextlib import contextmanager

import torch

from autoshard.errors import AutoshardError, PlanError
from autoshard.runtime.communicator import Communicator

__all__ = ["check_call", "decide_once", "gather_objects"]


@contextmanager
def _unrecorded(comm: Communicator):
    was, comm.recording = comm.recording, False
    try:
        yield
    finally:
        comm.recording = was


def _world_broadcast(comm: Communicator, t: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``t`` on every rank (same shape everywhere): a broadcast from coordinate 0 along each axis in turn;
    after axis k every rank holds the tensor of the rank with coordinate 0 on axes 0..k and its own elsewhere."""
    for axis in comm.mesh.names:
        t = comm.broadcast(t, axis, 0)
    return t


def decide_once(comm: Communicator, decide):
    """``decide()`` computed on rank 0 and received by every rank (the others do not call it): a decision that may
    differ from process to process is made once for the job. The value must pickle."""
    with _unrecorded(comm):
        if comm.mesh.size == 1:
            return decide()
        value = decide() if comm.rank == 0 else None
        data = pickle.dumps(value) if comm.rank == 0 else b""
        n = int(_world_broadcast(comm, torch.tensor([len(data)], dtype=torch.int64, device=comm.device))[0])
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if comm.rank == 0
               else torch.zeros(n, dtype=torch.uint8))
        buf = _world_broadcast(comm, buf.to(comm.device)).cpu()
        return value if comm.rank == 0 else pickle.loads(buf.numpy().tobytes())


def gather_objects(comm: Communicator, obj) -> list:
    """Every rank's ``obj`` (picklable), in rank order, on every rank."""
    with _unrecorded(comm):
        data = pickle.dumps(obj)
        sizes = comm.all_gather_host(torch.tensor([len(data)], dtype=torch.int64)).view(-1).tolist()
        buf = torch.zeros(max(sizes), dtype=torch.uint8)
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        rows = comm.all_gather_host(buf)
        return [pickle.loads(rows[r, :sizes[r]].numpy().tobytes()) for r in range(len(sizes))]


def digest_number(digest: str) -> int:
    """A plan digest (hex text) as a non-negative int64, what :func:`check_call` exchanges."""
    return int(hashlib.sha256(digest.encode()).hexdigest()[:15], 16)


def _all_equal(comm: Communicator, digest: int, training: bool, grad: bool) -> bool:
    """Whether every rank passed the same values, by one small sum over the world (the price of every call, the
    same for any world size): a flag is the same on every rank exactly when its sum is 0 or the world size, and a
    number x exactly when n·Σx² = (Σx)² (Cauchy-Schwarz). The digest goes as two 20-bit pieces (their squares summed
    over 2^22 ranks stay within int64): two plans pass as one only if both pieces agree, 1 in 2^40."""
    pieces = (digest & 0xFFFFF, (digest >> 20) & 0xFFFFF)
    mine = torch.tensor([pieces[0], pieces[0] ** 2, pieces[1], pieces[1] ** 2, int(training), int(grad)],
                        dtype=torch.int64)
    s = comm.all_reduce_host(mine).tolist()
    n = comm.mesh.size
    return (n * s[1] == s[0] ** 2 and n * s[3] == s[2] ** 2 and s[4] in (0, n) and s[5] in (0, n))


def check_call(comm: Communicator, digest: str, training: bool, describe=None) -> None:
    """Before a call of a sharded module's program: every rank must be in the same mode, with gradients on or off
    alike (a forward under ``no_grad`` runs no backward), with the same plan (``digest`` of the plan the program was
    made from). Otherwise raise on every rank, naming what differs; ``describe()`` (picklable, e.g. {node: layout})
    is exchanged only then, to name the first thing the plans disagree on. A call on some ranks only meets the other
    ranks' next call here, which differs in one of the three (an evaluation on rank 0 alone is an eval-mode or
    ``no_grad`` call meeting training calls)."""
    if comm.mesh.size == 1:
        return
    number, grad = digest_number(digest), torch.is_grad_enabled()
    with _unrecorded(comm):
        if _all_equal(comm, number, training, grad):
            return
        # something differs: every rank learns what, from every rank's values (the rare path pays O(world))
        rows = comm.all_gather_host(torch.tensor([number, int(training), int(grad)], dtype=torch.int64)).tolist()
    train, evals = _split(rows, 1)
    if train and evals:
        raise AutoshardError(
            f"the sharded module was called in train mode on ranks {_ranks(train)} and in eval mode on ranks "
            f"{_ranks(evals)} at once: the two modes run different programs, so every rank must switch with "
            "model.train()/model.eval() together and call the module on every rank (evaluate on every rank, print "
            "on rank 0).")
    on, off = _split(rows, 2)
    if on and off:
        raise AutoshardError(
            f"the sharded module was called with gradients on ranks {_ranks(on)} and under torch.no_grad() on ranks "
            f"{_ranks(off)} at once: a forward without gradients runs no backward, so the ranks' collectives would "
            "pair with the wrong peers. Call the module on every rank with the same grad mode (evaluate on every "
            "rank, print on rank 0).")
    described = gather_objects(comm, describe() if describe is not None else None)
    differs = _first_difference(described)
    call = _first_difference([d.get("call") if isinstance(d, dict) else None for d in described])
    if call:
        raise AutoshardError(
            f"the sharded module was called differently on its ranks{call.replace('first difference: ', '')}: "
            "every rank must call it with inputs of the same shapes and with gradient sync set alike (no_sync() / "
            "set_requires_gradient_sync on every rank), or their collectives pair with the wrong peers.")
    digests: dict = {}
    for r, row in enumerate(rows):
        digests.setdefault(row[0], []).append(r)
    groups = "; ".join(f"ranks {_ranks(rs)}" for rs in digests.values())
    raise PlanError(
        f"ranks planned differently ({groups} each run one plan){differs}: ranks running different programs hang or "
        "compute wrong numbers. Every rank must compile the same model with the same options and example shapes; "
        "a searched plan is decided on rank 0 when the module compiles on its first call (or with example inputs "
        "once torch.distributed is initialised), so compile on every rank at the same point of the script.")


def _split(rows: list, column: int) -> tuple[list[int], list[int]]:
    """(ranks whose flag in ``column`` is set, ranks whose flag is not)."""
    return [r for r, row in enumerate(rows) if row[column]], [r for r, row in enumerate(rows) if not row[column]]


def _first_difference(described: list) -> str:
    if not described or any(d is None for d in described) or not all(isinstance(d, dict) for d in described):
        return ""
    keys = [k for k in dict.fromkeys(k for d in described for k in d) if k != "call"]
    for key in keys:
        values = [d.get(key) for d in described]
        if any(v != values[0] for v in values):
            seen = {}
            for r, v in enumerate(values):
                seen.setdefault(repr(v), []).append(r)
            return f"; first difference: `{key}` is " + ", ".join(f"{v} on ranks {_ranks(rs)}" for v, rs in
                                                                    seen.items())
    return ""


def _ranks(ranks: list[int]) -> str:
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))
