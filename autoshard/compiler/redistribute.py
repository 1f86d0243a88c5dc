"""Redistribution: the sequence of per-axis collectives that turns one spec into another.

Steps run in three phases so that no intermediate spec shards a dim on two axes:

1. ``Partial`` axes are reduced: ``reduce_scatter`` to the target ``Shard(d)`` when ``d`` is free, else
   ``all_reduce``;
2. ``Shard(d)`` axes whose target differs: ``all_to_all`` to ``Shard(e)`` when ``e`` is free, else ``all_gather``;
3. ``Replicate`` axes whose target is ``Shard(d)``: ``local_slice`` (no communication forward).

Turning a replicated or sharded tensor into a Partial one is never needed by the rules and is reported as
impossible (``None``). Byte counts are per rank, forward and backward (each collective's backward is its
conjugate: all_reduce ↔ identity, all_gather ↔ slice, reduce_scatter ↔ all_gather, all_to_all ↔ all_to_all,
local_slice ↔ all_gather), as the table of collective kinds (:mod:`autoshard.compiler.collective_kinds`) says.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from autoshard.mesh import Mesh
from autoshard.placements import Partial, Replicate, Shard, Spec


@dataclass(frozen=True)
class Step:
    kind: str  # all_reduce | reduce_scatter | all_gather | all_to_all | local_slice
    axis: str
    dims: tuple[int, ...]  # all_gather/reduce_scatter/local_slice: (dim,); all_to_all: (split_dim, cat_dim)
    before: Spec
    after: Spec


def steps_between(src: Spec, dst: Spec, mesh: Mesh) -> list[Step] | None:
    """The collectives that turn ``src`` into ``dst`` on ``mesh`` (None: impossible, e.g. to Partial)."""
    steps = _steps_between(tuple(src), tuple(dst), mesh)
    return None if steps is None else list(steps)


@functools.lru_cache(maxsize=1 << 14)
def _steps_between(src: Spec, dst: Spec, mesh: Mesh) -> tuple[Step, ...] | None:
    if src == dst:
        return ()
    cur = list(src)
    steps: list[Step] = []

    def used(d: int, skip: int) -> bool:
        return any(isinstance(p, Shard) and p.dim == d for a, p in enumerate(cur) if a != skip)

    def push(kind, a, dims, new):
        before = tuple(cur)
        cur[a] = new
        steps.append(Step(kind, mesh.names[a], dims, before, tuple(cur)))

    for a, (s, t) in enumerate(zip(src, dst)):
        if isinstance(t, Partial) and not isinstance(s, Partial):
            return None
    for a, (s, t) in enumerate(zip(src, dst)):
        if isinstance(s, Partial) and not isinstance(t, Partial):
            if isinstance(t, Shard) and not used(t.dim, a):
                push("reduce_scatter", a, (t.dim,), t)
            else:
                push("all_reduce", a, (), Replicate())
    for a, t in enumerate(dst):
        s = cur[a]
        if isinstance(s, Shard) and s != t:
            if isinstance(t, Shard) and not used(t.dim, a):
                push("all_to_all", a, (t.dim, s.dim), t)
            else:
                push("all_gather", a, (s.dim,), Replicate())
    for a, t in enumerate(dst):
        if isinstance(cur[a], Replicate) and isinstance(t, Shard):
            if used(t.dim, a):
                return None
            push("local_slice", a, (t.dim,), t)
    if tuple(cur) != tuple(dst):
        return None
    return tuple(steps)


def _local_numel(shape, spec: Spec, mesh: Mesh) -> int:
    n = math.prod(shape)
    for (_, size), p in zip(mesh.axes, spec):
        if isinstance(p, Shard):
            n //= size
    return n


def step_bytes(step: Step, shape, itemsize: int, mesh: Mesh, requires_grad: bool = True) -> tuple[float, float]:
    """(forward, backward) bytes each rank sends for one step, by the collective table's formulas."""
    from autoshard.compiler.collective_kinds import wire_bytes

    n = mesh.axis_size(step.axis)
    if n == 1:
        return 0.0, 0.0
    before = _local_numel(shape, step.before, mesh) * itemsize
    after = _local_numel(shape, step.after, mesh) * itemsize
    return wire_bytes(step.kind, max(before, after), n, requires_grad)


def cost_bytes(src: Spec, dst: Spec, shape, itemsize: int, mesh: Mesh, requires_grad: bool = True) -> float | None:
    steps = steps_between(src, dst, mesh)
    if steps is None:
        return None
    return sum(sum(step_bytes(s, shape, itemsize, mesh, requires_grad)) for s in steps)


def grad_sync_bytes(spec: Spec, axes: tuple[str, ...], shape, itemsize: int, mesh: Mesh) -> float:
    """Backward all-reduce bytes of the 'identity forward / all-reduce backward' operator over ``axes``."""
    from autoshard.compiler.collective_kinds import wire_bytes

    local = _local_numel(shape, spec, mesh) * itemsize
    return sum(wire_bytes("grad_all_reduce", local, mesh.axis_size(a))[1] for a in axes)
