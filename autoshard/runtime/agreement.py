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

**Overlapped with the forward** (``check_call(..., overlap=True)``, what a ShardedModule call uses): the sum is
started asynchronously (:meth:`Communicator.all_reduce_host_async`) and the communicator settles it — waits, and
raises the check's error where the ranks differ — before its next collective of any kind (the program's first,
a planning exchange, a barrier) and before a random op draws (the dropout op, before ``comm.random_calls`` moves);
the call settles it at the end of its forward at the latest, and on any error of the forward. So a mismatched call
never reaches a collective of its program, as before, while a matching one pays only the wait for a sum that ran
during the compute before the first collective. Programs that may change state before their first collective
otherwise (an in-place op on a buffer such as BatchNorm's counter, an opaque function: :func:`quiet_until_collective`
is False) settle before they run, as the check did before every call.
"""

from __future__ import annotations

import hashlib
import pickle
from contextlib import contextmanager

import torch

from autoshard.errors import AutoshardError, PlanError
from autoshard.meta import FIRST_COLLECTIVE_CARRIES, QUIET_UNTIL_COLLECTIVE
from autoshard.runtime.communicator import Communicator

__all__ = ["can_carry", "check_call", "decide_once", "first_collective_carries", "gather_objects",
           "quiet_until_collective"]


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


#: What every check exchanges: a sum over the world, the same size on every rank whatever it carries (a rank
#: that carries and one that does not still pair up, and differ).
#:
#: * two ranks: int64 ``[digest << 3 | flags, carried]`` — each rank learns the other's values from the sum (sum
#:   minus its own, modulo 2^64), so the digest (60 bits) and the flags (mode, grad mode, carrying) compare exactly,
#:   and the carried value (one value of the program's first all-reduce, as its bits) comes back as the other
#:   rank's, added to this rank's in its own dtype: the very sum the collective computes. Two values: gloo sums a
#:   few values in one step where more take its ring's two.
#: * more ranks: float64 ``[p0, p0², p1, p1², flags, flags²]`` (the digest as two 20-bit pieces), compared by
#:   Cauchy-Schwarz (:func:`_sums_agree`); nothing carried.
_CARRY = 1


def _pieces(digest: int, training: bool, grad: bool, carrying: bool = False, ranks: int = 3) -> torch.Tensor:
    """What each rank adds up (see above)."""
    flags = int(training) + 2 * int(grad) + 4 * int(carrying)
    if ranks == 2:
        return torch.tensor([(digest << 3) | flags, 0], dtype=torch.int64)
    p0, p1 = digest & 0xFFFFF, (digest >> 20) & 0xFFFFF
    return torch.tensor([p0, p0 * p0, p1, p1 * p1, flags, flags * flags], dtype=torch.float64)


#: each call's values to add up, made once per (digest, mode, grad mode, carrying, ranks): read, never written
_PIECES: dict[tuple, torch.Tensor] = {}


def _mine(number: int, training: bool, grad: bool, carrying: bool, ranks: int) -> torch.Tensor:
    key = (number, training, grad, carrying, ranks == 2)
    found = _PIECES.get(key)
    if found is None:
        if len(_PIECES) > 64:
            _PIECES.clear()
        found = _PIECES[key] = _pieces(number, training, grad, carrying, ranks)
    return found


def _sums_agree(s: list, n: int, mine: int | None = None) -> bool:
    """Every rank sent the same values: two ranks, the sum is twice ``mine`` (the first value this rank sent),
    modulo 2^64; more, for each number x, n·Σx² = (Σx)² (Cauchy-Schwarz), exactly (float64 sums of integers below
    2^53: squares of 20-bit pieces over fewer than 2^13 ranks)."""
    if n == 2:
        return (int(s[0]) - 2 * mine) % 2**64 == 0
    s = [int(x) for x in s[:6]]
    return all(n * s[i + 1] == s[i] ** 2 for i in range(0, 6, 2))


def _all_equal(comm: Communicator, digest: int, training: bool, grad: bool) -> bool:
    """Whether every rank passed the same values, by one small sum over the world (the price of every call, the
    same for any world size). Two ranks compare exactly (each learns the other's values from the sum); more ranks:
    a number x is the same on every rank exactly when n·Σx² = (Σx)² (Cauchy-Schwarz), the digest as two 20-bit
    pieces (float64 sums of their squares stay exact over 2^13 ranks): two plans pass as one only if both pieces
    agree, 1 in 2^40."""
    n = comm.mesh.size
    mine = _pieces(digest, training, grad, ranks=n)
    with _unrecorded(comm):
        return _sums_agree(comm.all_reduce_host(mine).tolist(), n, int(mine[0]))


class _Check:
    """One call's check, held by the communicator until settled (:meth:`Communicator.expect`): started at once
    (``handle``: overlapped with the forward) or not yet (deferred: the program's first collective carries it)."""

    __slots__ = ("comm", "describe", "grad", "handle", "mine", "number", "training")  # mine: what it sends

    def __init__(self, comm, number, training, grad, mine, describe, handle):
        self.comm, self.number, self.training, self.grad = comm, number, training, grad
        self.mine, self.describe, self.handle = mine, describe, handle

    def settle(self) -> None:
        comm = self.comm
        if self.handle is not None:
            sums = self.handle.wait().tolist()
        else:
            with _unrecorded(comm):
                sums = comm.all_reduce_host(self.mine).tolist()
        self._verdict(sums, self.mine)

    def carry(self, t: torch.Tensor, axis: str) -> torch.Tensor | None:
        """The program's all-reduce of ``t`` over ``axis``, done by this check's exchange where it was deferred for
        it and can carry it exactly; else None, the check settled on its own."""
        comm = self.comm
        if self.handle is not None or not _carries(comm, t, axis):
            self.settle()
            return None
        # carrying is in the flags: every rank must carry (a rank that did not would add zeros, then run it again)
        sent = _mine(self.number, self.training, self.grad, True, 2)
        bits = t.reshape(1).view(torch.int64) if t.dtype == torch.float64 else \
            t.reshape(1).view(torch.int32).to(torch.int64)
        exchange = torch.cat([sent[:1], bits])
        with _unrecorded(comm):
            comm.all_reduce_host_(exchange)
        self._verdict(exchange.tolist(), sent)  # raises before the carried value is read where the ranks differ
        theirs = exchange[1:] - bits  # the other rank's bits (modulo 2^64)
        theirs = theirs.view(torch.float64) if t.dtype == torch.float64 else theirs.to(torch.int32).view(torch.float32)
        return (t.reshape(1) + theirs).view(t.shape)  # the collective's own sum of the two values

    def _verdict(self, sums: list, sent: torch.Tensor) -> None:
        if not _sums_agree(sums, self.comm.mesh.size, int(sent[0]) if self.comm.mesh.size == 2 else None):
            _name_the_difference(self.comm, self.number, self.training, self.grad, self.describe)


def can_carry(comm: Communicator) -> bool:
    """Whether ``comm``'s checks may carry a small all-reduce at all (two ranks, collectives on the host)."""
    return comm.mesh.size == 2 and comm.device.type == "cpu"


def _carries(comm: Communicator, t: torch.Tensor, axis: str) -> bool:
    """Whether the check's exchange can carry the all-reduce of ``t`` over ``axis`` with the very result the
    collective gives: an all-reduce over the whole world of two ranks (each then adds the other's value to its own,
    the one addition the collective makes), of one float32 or float64 value, on the host."""
    return (t.dtype in _FLOATS and t.numel() <= _CARRY and t.device.type == "cpu" and comm.mesh.size == 2
            and comm.mesh.axis_size(axis) == 2 and comm.device.type == "cpu")


_FLOATS = (torch.float32, torch.float64)


def check_call(comm: Communicator, digest: str | int, training: bool, describe=None, overlap: bool = False,
               carry: bool = False) -> None:
    """Before a call of a sharded module's program: every rank must be in the same mode, with gradients on or off
    alike (a forward under ``no_grad`` runs no backward), with the same plan (``digest`` of the plan the program was
    made from, or :func:`digest_number` of it). Otherwise raise on every rank, naming what differs; ``describe()``
    (picklable, e.g. {node: layout}) is exchanged only then, to name the first thing the plans disagree on. A call on
    some ranks only meets the other ranks' next call here, which differs in one of the three (an evaluation on rank 0
    alone is an eval-mode or ``no_grad`` call meeting training calls).

    ``overlap=True``: start the exchange and return; ``comm`` settles it (raising the same errors) before its next
    collective, or when :meth:`Communicator.settle` is called — which the caller must do before its call returns, and
    on any error of the call (see the module docstring). ``carry=True`` (with ``overlap``): start nothing yet; the
    program's first collective, a small all-reduce the exchange can carry (:func:`first_collective_carries`), is done
    by the check's own exchange — one exchange where there were two — or the check runs on its own before it."""
    if comm.mesh.size == 1:
        return
    number = digest if isinstance(digest, int) else digest_number(digest)
    grad = torch.is_grad_enabled()
    mine = _mine(number, training, grad, False, comm.mesh.size)
    # (the exchange is not in the communicator's log: it is no collective of the plan)
    handle = None if overlap and carry else comm.all_reduce_host_async(mine)
    check = _Check(comm, number, training, grad, mine, describe, handle)
    if overlap:
        comm.expect(check)
    else:
        check.settle()


_CARRY_KEY = FIRST_COLLECTIVE_CARRIES


def _numel_of(node) -> int | None:
    """How many values ``node`` holds (its global shape, an upper bound of any rank's), where its meta says."""
    if not isinstance(node, torch.fx.Node):
        return None
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val.numel()
    shape = getattr(node.meta.get("tensor_meta"), "shape", None)
    return None if shape is None else int(torch.Size(shape).numel())


def first_collective_carries(program: torch.fx.GraphModule) -> bool:
    """Whether the first collective ``program``'s forward runs is a small all-reduce the check's exchange may carry
    (:meth:`_Check.carry`): the first node that communicates is an ``all_reduce`` of at most ``_CARRY`` values (a
    data-parallel loss), or a partial cross-entropy mean (whose first exchange is its one-value target count). Other
    nodes that communicate first (a gather, a dropout's draw, ...) leave the check overlapped instead. Looked up once
    per program; the communicator decides again at the collective (:func:`_carries`)."""
    found = program.meta.get(_CARRY_KEY)
    if found is not None:
        return found
    from autoshard.runtime import ops

    silent = {"grad_all_reduce", "linears_grad_all_reduce", "local_slice", "_chunk"}  # nothing sent in forward
    carries = False
    for n in program.graph.nodes:
        if n.op != "call_function":
            continue
        t = n.target
        if isinstance(t, torch._ops.OpOverload) and t.namespace == "autoshard":
            name = t._schema.name.split("::")[-1]
            if name in silent:
                continue
            if name == "all_reduce":
                numel = _numel_of(n.args[0])
                # small, or (no shape noted on a node a pass made) what the program returns: its loss
                carries = numel <= _CARRY if numel is not None else any(u.op == "output" for u in n.users)
            break
        if t is ops.cross_entropy_partial_mean:
            axes = n.args[5] if len(n.args) > 5 else n.kwargs.get("axes", ())
            if axes:
                carries = True
                break
        elif t in (ops.dropout, ops.vocab_parallel_cross_entropy):
            break
    program.meta[_CARRY_KEY] = carries
    return carries


#: the ops of autoshard's runtime whose only effect beyond their output is through the communicator (collectives,
#: which settle the check first; dropout's random count, which settles it too) or state local to the call
_QUIET_OPS = frozenset({
    "_all_reduce", "_all_gather", "_reduce_scatter", "_all_to_all", "_chunk", "vocab_parallel_cross_entropy",
    "dropout", "all_reduce", "grad_all_reduce", "all_gather", "reduce_scatter", "all_to_all", "local_slice",
    "all_gather_sync", "all_gather_reshard", "all_gather_reshard_group", "linears_grad_all_reduce",
    "_linears_backward", "context_attention", "_context_attention_backward",
})
_QUIET_KEY = QUIET_UNTIL_COLLECTIVE


def _quiet_functions() -> frozenset:
    """The plain functions rank programs call that compute their output and nothing else (or call the ops above)."""
    import builtins
    import operator

    from autoshard.runtime import ops

    return frozenset({builtins.getattr, operator.getitem, operator.add, operator.sub, operator.mul,
                      operator.floordiv, operator.truediv, operator.mod, operator.neg, ops.bias_once,
                      ops.masked_embedding, ops.cross_entropy_partial_mean, ops.additive_mask, ops.dropout,
                      ops.vocab_parallel_cross_entropy})


def _draws_no_random(node: torch.fx.Node, op: torch._ops.OpOverload) -> bool:
    """An aten op tagged as drawing random numbers that draws none here: its dropout probability is 0
    (``scaled_dot_product_attention`` without dropout) or it is not training (``dropout(x, p, False)``)."""
    values = {}
    for i, arg in enumerate(op._schema.arguments):
        values[arg.name] = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name, arg.default_value)
    if values.get("train", True) is False:
        return True
    p = values.get("dropout_p", values.get("p"))
    return p is not None and p == 0


def quiet_until_collective(program: torch.fx.GraphModule) -> bool:
    """Whether ``program`` changes nothing outside its outputs before its first collective, so the check of its call
    may run during that compute (``check_call(..., overlap=True)``): every node a pure op — an aten op that mutates
    no argument and draws no random numbers, one of the runtime's own ops (:data:`_QUIET_OPS`) or of its plain
    functions (:func:`_quiet_functions`) — never an in-place op (a buffer's update), another function or a submodule
    call. Looked up once per program."""
    found = program.meta.get(_QUIET_KEY)
    if found is not None:
        return found
    quiet, functions = True, _quiet_functions()
    for n in program.graph.nodes:
        if n.op in ("placeholder", "get_attr", "output"):
            continue
        t = n.target
        if n.op != "call_function":
            quiet = False
        elif isinstance(t, torch._ops.OpOverload):
            if t.namespace == "autoshard":
                quiet = t._schema.name.split("::")[-1] in _QUIET_OPS
            else:
                quiet = t.namespace in ("aten", "prims") and not t._schema.is_mutable and (
                    torch.Tag.nondeterministic_seeded not in t.tags or _draws_no_random(n, t))
        else:
            quiet = t in functions
        if not quiet:
            break
    program.meta[_QUIET_KEY] = quiet
    return quiet


def _name_the_difference(comm: Communicator, number: int, training: bool, grad: bool, describe) -> None:
    """The check found that the ranks differ: every rank learns what from every rank's values (the rare path pays
    O(world)), and raises."""
    with _unrecorded(comm):
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
    if len(digests) == 1 and not differs:
        raise AutoshardError("the ranks made the same call, but not all of them carried its first all-reduce in the "
                             "agreement check's exchange (autoshard's runtime disagrees with itself; please report "
                             "it): the call was stopped before its collectives.")
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
