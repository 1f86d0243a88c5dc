"""ZeRO-3 at run time: parameters gathered for forward are not kept for backward, but gathered again there.

A parameter stored at ZeRO stage 3 (:class:`autoshard.meta.Storage`) reaches its consumers through
``torch.ops.autoshard.all_gather_reshard``. Autograd would keep the gathered copy alive from its forward use to its
backward use (a matmul saves its weight), so every gathered parameter of the model would be alive at the end of
forward — ZeRO-2's peak, not ZeRO-3's. :func:`reshard_after_forward` (the runtime wraps each program call in it)
installs ``saved_tensors_hooks``: a saved tensor that is a gathered parameter, or a view of one, is packed as a
recipe (this rank's shard, the axis, the view's geometry) instead; the first unpack in backward gathers the shard
again, later unpacks of the same parameter reuse that copy, and the last one lets it go. FSDP2 gets the same effect
by resizing the gathered storage to zero after forward and re-gathering in a pre-backward hook.

Identity, not addresses: a saved tensor is matched to a gathered parameter by object identity (the tensor, or its
``_base`` for a view), through a weak reference — an address could be reused by an activation once the gathered
copy is freed. Backward runs the re-gathers in autograd's order, which is the same on every rank of a plan.

Grouped gathers (``all_gather_reshard_group``, made by :mod:`autoshard.passes.group_gathers`): a layer's
parameters are gathered with one all-gather per dtype into one flat buffer (:func:`gather_group`) and their
gradients reduce-scattered at once (:func:`reduce_group`); in backward the first use of any member gathers the whole
group again (:class:`_GatheredGroup`). Each group op may start the next group's all-gather asynchronously once its
own is done (``prefetch``), and a group re-gathered in backward starts the one that prefetched it in forward.
Under ``no_sync()`` a group's backward holds its parameters' full gradients instead of reduce-scattering them, and
the next synced backward adds them before it does (:mod:`autoshard.runtime.grad_sync`); the re-gathers run either
way.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager, nullcontext

import torch
import torch.fx

from autoshard import meta as M
from autoshard.runtime.communicator import Handle, current, use
from autoshard.runtime.grad_sync import note_site, unsynced
from autoshard.runtime.primitives import chunk, comm_of, keep_comm, raw_all_gather, raw_reduce_scatter, sum_over

__all__ = ["gather_group", "reduce_group", "remember_gathered", "remember_gathered_group", "reshard_after_forward",
           "running"]

_LOCAL = threading.local()


class _Gathered:
    """A gathered parameter: how to gather it again, and the copy of the current backward while it is needed."""

    __slots__ = ("axis", "comm", "copy", "dim", "packs", "ref", "shard", "size")

    def __init__(self, out: torch.Tensor, shard: torch.Tensor, axis: str, dim: int, size: int, comm):
        self.shard, self.axis, self.dim, self.size, self.comm = shard.detach(), axis, dim, size, comm
        self.ref = weakref.ref(out)
        self.packs = 0
        self.copy: torch.Tensor | None = None

    def full(self) -> torch.Tensor:
        if self.copy is None:
            with use(self.comm):
                self.copy = raw_all_gather(self.shard, self.axis, self.dim, self.size, "backward")
        return self.copy


class _Recipe:
    __slots__ = ("gathered", "offset", "requires_grad", "size", "stride")

    def __init__(self, gathered: _Gathered, t: torch.Tensor):
        self.gathered, self.size, self.stride, self.offset = gathered, t.size(), t.stride(), t.storage_offset()
        self.requires_grad = t.requires_grad


def _session():
    return getattr(_LOCAL, "session", None)


def remember_gathered(out: torch.Tensor, shard: torch.Tensor, axis: str, dim: int, size: int) -> torch.Tensor:
    """Called by ``all_gather_reshard``'s kernel: note ``out`` as a gathered copy of ``shard`` (when a program runs
    under :func:`reshard_after_forward` in this thread; otherwise autograd simply keeps it)."""
    session = _session()
    if session is not None:  # (grad mode is off inside a custom op's forward: no check of it here)
        session[id(out)] = _Gathered(out, shard, axis, dim, size, current())
    return out


def _pack(session: dict):
    def pack(t: torch.Tensor):
        for candidate in (t, t._base):
            if candidate is None:
                continue
            g = session.get(id(candidate))
            if g is not None and g.ref() is candidate:
                g.packs += 1
                return _Recipe(g, t)
        return t

    return pack


def _unpack(saved):
    if not isinstance(saved, _Recipe):
        return saved
    g = saved.gathered
    full = g.full()
    view = full.as_strided(saved.size, saved.stride, saved.offset)
    g.packs -= 1
    if g.packs == 0:
        g.copy = None  # the last use of this backward: let it go (the view keeps it while autograd needs it)
    return view


def running(program: torch.fx.GraphModule):
    """The context to call ``program`` in: :func:`reshard_after_forward` where it gathers ZeRO-3 parameters
    (``all_gather_reshard`` nodes; looked up once per program), else nothing."""
    flag = program.meta.get(M.RESHARDS)
    if flag is None:
        ops = (torch.ops.autoshard.all_gather_reshard.default, torch.ops.autoshard.all_gather_reshard_group.default)
        flag = program.meta[M.RESHARDS] = any(n.target in ops for n in program.graph.nodes)
    return reshard_after_forward() if flag else nullcontext()


@contextmanager
def reshard_after_forward():
    """Run a program's forward so that the ZeRO-3 parameters it gathers are gathered again in backward instead of
    being kept. Re-entrant per thread (a nested call shares the outer session)."""
    if _session() is not None:
        yield
        return
    session: dict[int, _Gathered] = {}
    _LOCAL.session = session
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack(session), _unpack):
            yield
    finally:
        _LOCAL.session = None


# ---- grouped gathers: one collective per layer (passes/group_gathers.py) --------------------------------------
def _by_dtype(dtypes) -> list[list[int]]:
    """Indices of ``dtypes`` grouped by dtype, groups in order of first appearance (the same on every rank)."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, dt in enumerate(dtypes):
        groups.setdefault(dt, []).append(i)
    return list(groups.values())


def _start_gather(shards, axis: str, size: int, phase: str, early: bool) -> list:
    """Per dtype of ``shards`` (in order of first appearance): its indices and the :class:`Handle` of one
    all-gather of their concatenation; ``early``: started asynchronously (:meth:`Communicator.all_gather_async`)."""
    pending = []
    for idx in _by_dtype([s.dtype for s in shards]):
        flat = torch.cat([shards[i].detach().reshape(-1) for i in idx])
        handle = current().all_gather_async(flat, axis, phase) if early else Handle(
            raw_all_gather(flat, axis, 0, size, phase))
        pending.append((idx, handle))
    return pending


def _finish_gather(pending, shards, dims, size: int) -> list[torch.Tensor]:
    outs: list[torch.Tensor | None] = [None] * len(shards)
    for idx, handle in pending:
        total = sum(shards[i].numel() for i in idx)
        gathered = handle.wait().view(size, total)
        offset = 0
        for i in idx:
            x, d = shards[i], dims[i]
            n = x.numel()
            full = list(x.shape)
            full[d] *= size
            out = gathered[:, offset:offset + n].reshape(size, *x.shape).movedim(0, d).reshape(full).contiguous()
            if len(idx) > 1 and out.untyped_storage().data_ptr() == gathered.untyped_storage().data_ptr():
                out = out.clone()  # outputs of one op may not share storage
            outs[i] = out
            offset += n
    return outs


def gather_group(shards, axis: str, dims, size: int, phase: str) -> list[torch.Tensor]:
    """Every shard of ``shards`` gathered along its dim of ``dims`` over ``axis``, with one all-gather per dtype:
    the shards are concatenated into one flat buffer, gathered into ``(size, total)`` (row r: rank r's buffer), and
    each parameter's columns are copied out into its own tensor, rank chunks concatenated along its dim."""
    return _finish_gather(_start_gather(shards, axis, size, phase, False), shards, dims, size)


def _key(shards) -> tuple:
    # the parameters' storage and version: an optimizer step in between makes a prefetched copy stale
    return tuple((s.data_ptr(), tuple(s.shape), s.dtype, s._version) for s in shards)


def _take_prefetched(shards):
    """The pending gather of ``shards`` started by the previous group op of this thread, if it was theirs."""
    entry = getattr(_LOCAL, "prefetched", None)
    _LOCAL.prefetched = None
    if entry is None:
        return None
    key, pending = entry
    if key != _key(shards):
        for _, handle in pending:  # started on every rank alike: complete it, then drop it
            handle.wait()
        return None
    return pending


def reduce_group(grads, shapes, dtypes, axis: str, dims, size: int, axes) -> list[torch.Tensor]:
    """The gradients of :func:`gather_group`'s outputs to its shards, with one collective per dtype and axis: the
    full gradients laid out as ``(size, total)`` (row r: every parameter's chunk r along its dim), summed over the
    axes of ``axes`` before ``axis``, reduce-scattered on ``axis``, summed over the axes after it — as
    ``all_gather_sync``'s backward per parameter; where ``axis`` is not in ``axes``, summed over ``axes`` and this
    rank's row kept (``all_gather_reshard``'s backward with replicated compute)."""

    out: list[torch.Tensor | None] = [None] * len(shapes)
    for idx in _by_dtype(dtypes):
        rows = []
        for i in idx:
            d, shard = dims[i], shapes[i]
            full = list(shard)
            full[d] *= size
            g = grads[i]
            if g is None:
                g = torch.zeros(full, dtype=dtypes[i], device=next((x.device for x in grads if x is not None), None))
            rows.append(g.reshape(full).unflatten(d, (size, shard[d])).movedim(d, 0).reshape(size, -1))
        flat = torch.cat(rows, 1)
        if axis in axes:
            k = axes.index(axis)
            flat = sum_over(flat, axes[:k])
            row = raw_reduce_scatter(flat, axis, 0, size, "backward")
            row = sum_over(row, axes[k + 1:])
        else:
            row = chunk(sum_over(flat, axes), axis, 0, size)
        row = row.reshape(-1)
        offset = 0
        for i in idx:
            n = torch.Size(shapes[i]).numel()
            out[i] = row[offset:offset + n].view(shapes[i])
            offset += n
    return out


@torch.library.custom_op("autoshard::all_gather_reshard_group", mutates_args=(),
                         schema="(Tensor[] xs, str axis, int[] dims, int size, str[] axes, Tensor[] prefetch) "
                                "-> Tensor[]")
def _all_gather_reshard_group_op(xs, axis, dims, size, axes, prefetch):
    """``prefetch``: the shards of the group gathered next (the next layer): their all-gather is started here,
    asynchronously, once this group's has completed, and that group's op waits on it instead of gathering."""
    xs, dims = list(xs), list(dims)
    prefetched = _take_prefetched(xs)
    outs = _finish_gather(prefetched or _start_gather(xs, axis, size, "forward", False), xs, dims, size)
    if prefetch:
        _LOCAL.prefetched = (_key(prefetch), _start_gather(list(prefetch), axis, size, "forward", True))
    return remember_gathered_group(outs, xs, axis, dims, size, prefetched is not None)


@_all_gather_reshard_group_op.register_fake
def _(xs, axis, dims, size, axes, prefetch):
    outs = []
    for x, d in zip(xs, dims):
        shape = list(x.shape)
        shape[d] *= size
        outs.append(x.new_empty(shape))
    return outs


def _setup_group(ctx, inputs, output):

    keep_comm(ctx)
    xs, ctx.axis, dims, ctx.size, axes, prefetch = inputs
    ctx.dims, ctx.axes, ctx.prefetched = tuple(dims), tuple(axes), len(prefetch)
    ctx.shapes, ctx.dtypes = [tuple(x.shape) for x in xs], [x.dtype for x in xs]
    if ctx.axes:
        note_site(ctx, xs, "all_gather_reshard_group", ctx.axis, ctx.dims, ctx.size, ctx.axes)


def _group_backward(ctx, grads):
    # (autograd matches the structure of list arguments: an empty list, or a list of tensors, as a list)
    rest = None, None, None, None if ctx.axes else [], [None] * ctx.prefetched
    grads = unsynced(ctx, list(grads))  # the parameters' gradients under no_sync: held, not reduced (grad_sync.py)
    if grads is None:
        return [None] * len(ctx.shapes), *rest
    with comm_of(ctx):
        out = reduce_group(grads, ctx.shapes, ctx.dtypes, ctx.axis, ctx.dims, ctx.size, ctx.axes)
    return out, *rest


_all_gather_reshard_group_op.register_autograd(_group_backward, setup_context=_setup_group)


class _GatheredGroup:
    """The shards of one ``all_gather_reshard_group`` call: the first member that backward needs gathers the whole
    group again (one collective per dtype), the members still saved for backward keep their copies until their
    last use (FSDP2 re-gathers a layer's parameters at once in its pre-backward hook)."""

    __slots__ = ("axis", "comm", "dims", "members", "pending", "prev", "shards", "size")

    def __init__(self, shards, axis, dims, size, comm, prev=None):
        self.shards, self.axis, self.dims, self.size, self.comm = [s.detach() for s in shards], axis, dims, size, comm
        self.members: list[_GroupMember] = []
        self.prev = prev  # the group gathered before this one in forward: backward needs it next
        self.pending = None

    def _needed(self) -> bool:
        return self.pending is None and any(m.packs > 0 and m.copy is None for m in self.members)

    def gather(self) -> None:
        """Gather the group again (or wait for its prefetch), then start the previous group's gather early."""
        with use(self.comm):
            pending, self.pending = self.pending, None
            if pending is None:
                pending = _start_gather(self.shards, self.axis, self.size, "backward", False)
            outs = _finish_gather(pending, self.shards, self.dims, self.size)
            prev = self.prev
            if prev is not None and prev._needed():
                prev.pending = _start_gather(prev.shards, prev.axis, prev.size, "backward", True)
        for member, out in zip(self.members, outs):
            if member.packs > 0:
                member.copy = out


class _GroupMember:
    """One gathered parameter of a group, with :class:`_Gathered`'s interface for ``_pack``/``_unpack``."""

    __slots__ = ("copy", "group", "packs", "ref")

    def __init__(self, group: _GatheredGroup, out: torch.Tensor):
        self.group, self.ref, self.packs, self.copy = group, weakref.ref(out), 0, None

    def full(self) -> torch.Tensor:
        if self.copy is None:
            self.group.gather()
        return self.copy


def remember_gathered_group(outs, shards, axis: str, dims, size: int, prefetched: bool = False):
    """Called by ``all_gather_reshard_group``'s kernel: note each of ``outs`` as a gathered copy of its shard, to
    be gathered again with its group in backward (under :func:`reshard_after_forward`). ``prefetched``: the
    previous group op started this gather; in backward, this group starts that one's gather again early."""
    session = _session()
    if session is not None:
        chain = getattr(_LOCAL, "chain", None)  # (session, its last group): this forward's previous group
        prev = chain[1] if prefetched and chain is not None and chain[0] is session else None
        group = _GatheredGroup(shards, axis, list(dims), size, current(), prev)
        _LOCAL.chain = (session, group)
        for out in outs:
            member = _GroupMember(group, out)
            group.members.append(member)
            session[id(out)] = member
    return outs
