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
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager, nullcontext

import torch
import torch.fx

__all__ = ["remember_gathered", "reshard_after_forward", "running"]

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
            from autoshard.runtime.collectives import _all_gather
            from autoshard.runtime.comm import use

            with use(self.comm):
                self.copy = _all_gather(self.shard, self.axis, self.dim, self.size, "backward")
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
        from autoshard.runtime.comm import current

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
    flag = program.meta.get("autoshard.reshards")
    if flag is None:
        op = torch.ops.autoshard.all_gather_reshard.default
        flag = program.meta["autoshard.reshards"] = any(n.target is op for n in program.graph.nodes)
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
