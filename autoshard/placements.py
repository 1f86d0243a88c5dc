"""Placements and sharding specs.

A tensor's *spec* is a tuple with one placement per mesh axis, in mesh-axis order. The placements are
``torch.distributed.tensor``'s own ``Shard(dim)``, ``Replicate()`` and ``Partial("sum")``, so a plan exports
directly as DTensor placements. autoshard adds one restriction that keeps every redistribution a single
collective on one axis: a tensor dimension is sharded by at most one mesh axis.

Shards are contiguous and even (static shapes): on an axis of size n, the rank at coordinate i holds
``[i*d/n, (i+1)*d/n)`` of the dimension.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autoshard.errors import PlanError
from autoshard.mesh import Mesh

__all__ = ["Placement", "Shard", "Replicate", "Partial", "Spec", "replicated", "check_spec", "local_shape",
           "shard_offsets", "shard_tensor", "assemble", "format_spec", "format_placement", "parse_placement"]

Spec = tuple[Placement, ...]


def replicated(mesh: Mesh) -> Spec:
    return (Replicate(),) * mesh.ndim


def is_shard(p: Placement) -> bool:
    return isinstance(p, Shard)


def is_partial(p: Placement) -> bool:
    return isinstance(p, Partial)


def sharded_dims(spec: Spec) -> dict[int, int]:
    """{tensor dim: mesh axis index} for every sharded dim."""
    return {p.dim: a for a, p in enumerate(spec) if isinstance(p, Shard)}


def check_spec(spec: Spec, shape: tuple[int, ...], mesh: Mesh, what: str) -> Spec:
    """Validate ``spec`` for a tensor of ``shape``; normalise negative Shard dims. Raises PlanError."""
    spec = tuple(spec)
    if len(spec) != mesh.ndim:
        raise PlanError(f"{what} has a placement tuple of length {len(spec)}, but mesh {mesh} has {mesh.ndim} "
                        f"axes {list(mesh.names)}: give one placement per axis, e.g. (Replicate(), Shard(0)).")
    out = []
    used: dict[int, str] = {}
    for (axis, size), p in zip(mesh.axes, spec):
        if not isinstance(p, (Shard, Replicate, Partial)):
            raise PlanError(f"{what} has placement {p!r} on axis `{axis}`, but placements are Shard(d), "
                            "Replicate() or Partial().")
        if isinstance(p, Shard):
            d = p.dim + len(shape) if p.dim < 0 else p.dim
            if not 0 <= d < len(shape):
                raise PlanError(f"{what} has Shard({p.dim}) on axis `{axis}`, but the tensor has shape "
                                f"{list(shape)} ({len(shape)} dims): use a dim in [{-len(shape)}, {len(shape) - 1}].")
            if d in used:
                raise PlanError(f"{what} shards dim {d} on both axes `{used[d]}` and `{axis}`, but a dim may be "
                                "sharded on one mesh axis only.")
            if shape[d] % size:
                raise PlanError(f"{what} has dim {d} of size {shape[d]} sharded on axis `{axis}` of size {size}, "
                                f"but {shape[d]} is not divisible by {size}: shard another dim or use Replicate().")
            used[d] = axis
            p = Shard(d)
        out.append(p)
    return tuple(out)


def local_shape(shape, spec: Spec, mesh: Mesh) -> tuple[int, ...]:
    local = list(shape)
    for (_, size), p in zip(mesh.axes, spec):
        if isinstance(p, Shard):
            local[p.dim] //= size
    return tuple(local)


def shard_offsets(shape, spec: Spec, mesh: Mesh, rank: int) -> tuple[int, ...]:
    """Start index of ``rank``'s shard along every dim."""
    coords = mesh.coords(rank)
    offs = [0] * len(shape)
    for (axis, size), p in zip(mesh.axes, spec):
        if isinstance(p, Shard):
            offs[p.dim] = coords[axis] * (shape[p.dim] // size)
    return tuple(offs)


def shard_tensor(full: torch.Tensor, spec: Spec, mesh: Mesh, rank: int) -> torch.Tensor:
    """The local piece of ``full`` held by ``rank`` (a copy). Partial puts the value on coordinate 0."""
    out = full
    coords = mesh.coords(rank)
    for (axis, size), p in zip(mesh.axes, spec):
        if isinstance(p, Shard):
            out = out.chunk(size, dim=p.dim)[coords[axis]]
        elif isinstance(p, Partial) and coords[axis] != 0:
            out = torch.zeros_like(out)
    return out.detach().clone()


def assemble(locals_by_rank: dict[int, torch.Tensor] | list[torch.Tensor], spec: Spec, mesh: Mesh) -> torch.Tensor:
    """Rebuild the global tensor from every rank's local tensor (inverse of :func:`shard_tensor`)."""
    locals_by_rank = dict(enumerate(locals_by_rank)) if isinstance(locals_by_rank, list) else locals_by_rank
    # Fold the mesh one axis at a time, innermost first: combine the pieces of each group along that axis.
    pieces = {tuple(mesh.coords(r).values()): t for r, t in locals_by_rank.items()}
    for a in reversed(range(mesh.ndim)):
        p = spec[a]
        merged = {}
        for key in sorted({k[:a] + k[a + 1:] for k in pieces}):
            group = [pieces[key[:a] + (i,) + key[a:]] for i in range(mesh.shape[a])]
            if isinstance(p, Shard):
                merged[key] = torch.cat(group, dim=p.dim)
            elif isinstance(p, Partial):
                merged[key] = torch.stack(group).sum(0)
            else:
                merged[key] = group[0]
        pieces = merged
    return pieces[()]


def format_placement(p: Placement) -> str:
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Partial):
        return "P" if p.reduce_op == "sum" else f"P({p.reduce_op})"
    return "R"


def format_spec(spec: Spec | None) -> str:
    if spec is None:
        return "-"
    return "(" + ", ".join(format_placement(p) for p in spec) + ")"


def parse_placement(text: str) -> Placement:
    """'R', 'S(1)', 'P' (plan files and the CLI) → placement."""
    t = text.strip().replace(" ", "")
    if t in ("R", "Replicate()", "Replicate"):
        return Replicate()
    if t in ("P", "Partial()", "Partial", "P(sum)", 'Partial("sum")', "Partial('sum')"):
        return Partial()
    for prefix in ("S(", "Shard("):
        if t.startswith(prefix) and t.endswith(")") and t[len(prefix):-1].lstrip("-").isdigit():
            return Shard(int(t[len(prefix):-1]))
    raise PlanError(f"placement text {text!r} is not one of R, P, S(d) (or Replicate(), Partial(), Shard(d)).")
