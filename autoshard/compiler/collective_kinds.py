"""The one table of collective kinds: what each redistribution node runs forward and backward, which torch operator
generated code calls for it, and what it moves and costs.

Every place that needs to know about a collective reads this table: collective insertion
(:mod:`autoshard.passes.insert_collectives`) builds nodes with :func:`emit`, the per-rank rewrites recognise them with
:func:`kind_of`, the cost model prices them with :func:`wire_bytes` / :func:`time` (alpha-beta formulas of the
primitives in :mod:`autoshard.cost_models.alpha_beta`), and the pipeline split and the report do the same.

A *kind* is what appears in the graph; a *primitive* is what goes on the wire (``all_reduce``, ``all_gather``,
``reduce_scatter``, ``all_to_all``, ``send_recv``). Each kind runs at most one primitive forward and one backward
(``all_gather_sync`` and ``grad_all_reduce`` over several axes run one per axis: ``per_axis``).

``b``, the buffer a primitive's formula is written in, is the larger of the node's local input and output
(the gathered output of an all-gather, the unscattered input of a reduce-scatter, the tensor of an all-reduce).

To add a collective kind: add its ``torch.ops.autoshard`` op with fake kernel and autograd formula in
:mod:`autoshard.runtime.collective_ops`, then one :class:`CollectiveKind` row here; insertion, pricing, the pipeline
split and the report pick it up from the row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

import autoshard.runtime.collective_ops  # noqa: F401  (registers the torch.ops.autoshard collectives)
import autoshard.runtime.zero  # noqa: F401  (registers all_gather_reshard_group)
from autoshard.mesh import Mesh

__all__ = ["KINDS", "CollectiveKind", "emit", "kind_of", "time", "wire_bytes"]


@dataclass(frozen=True)
class CollectiveKind:
    name: str
    #: ``torch.ops.autoshard.<op>``: what the graph node calls
    op: str
    #: the primitive run forward / backward (None: no communication)
    forward: str | None
    backward: str | None
    #: argument layout after the tensor: the axis argument, then ``dims``, then the axis size where ``sized``
    sized: bool = True
    doc: str = ""
    #: backward runs the forward primitive again first (ZeRO-3: the gathered parameter is gathered again)
    regather: bool = False
    #: backward reduces a replicated value's gradient (a parameter's data-parallel sync, Megatron's f, the ZeRO
    #: reduce-scatter): what a link's ``overlap`` hides behind backward compute
    gradient_reduction: bool = False

    @property
    def overload(self) -> torch._ops.OpOverload:
        return getattr(torch.ops.autoshard, self.op).default


KINDS: dict[str, CollectiveKind] = {k.name: k for k in (
    CollectiveKind("all_reduce", "all_reduce", "all_reduce", None, sized=False,
                   doc="Partial → Replicate; backward identity"),
    CollectiveKind("grad_all_reduce", "grad_all_reduce", None, "all_reduce", sized=False, gradient_reduction=True,
                   doc="identity; backward sums over each axis (Megatron's f)"),
    CollectiveKind("all_gather", "all_gather", "all_gather", None,
                   doc="Shard(d) → Replicate; backward keeps this rank's slice"),
    CollectiveKind("reduce_scatter", "reduce_scatter", "reduce_scatter", "all_gather",
                   doc="Partial → Shard(d); backward all-gathers"),
    CollectiveKind("all_to_all", "all_to_all", "all_to_all", "all_to_all",
                   doc="Shard(i) → Shard(j); backward the inverse all-to-all"),
    CollectiveKind("local_slice", "local_slice", None, "all_gather",
                   doc="Replicate → Shard(d) without communication; backward all-gathers"),
    CollectiveKind("all_gather_sync", "all_gather_sync", "all_gather", "reduce_scatter", gradient_reduction=True,
                   doc="all_gather + grad_all_reduce fused (sequence parallel): backward one reduce-scatter"),
    CollectiveKind("all_gather_reshard", "all_gather_reshard", "all_gather", "reduce_scatter", regather=True,
                   gradient_reduction=True,
                   doc="all_gather_sync of a ZeRO-3 parameter: not kept for backward, gathered again there"),
    CollectiveKind("all_gather_reshard_group", "all_gather_reshard_group", "all_gather", "reduce_scatter",
                   regather=True, gradient_reduction=True,
                   doc="all_gather_reshard of a layer's parameters at once: one flat all-gather, one "
                       "reduce-scatter (passes/group_gathers.py)"),
    CollectiveKind("linears_grad_all_reduce", "linears_grad_all_reduce", None, "all_reduce", sized=False,
                   gradient_reduction=True,
                   doc="grad_all_reduce feeding linears: backward all-reduce overlapped with weight grads"),
)}

_BY_OP = {k.op: k for k in KINDS.values()}


def kind_of(node: torch.fx.Node) -> CollectiveKind | None:
    """The kind of a graph node that calls a collective operator, else None."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    if node.target.namespace != "autoshard":
        return None
    return _BY_OP.get(node.target.__name__.split(".")[0])


def is_kind(node: torch.fx.Node, name: str) -> bool:
    k = kind_of(node)
    return k is not None and k.name == name


def emit(graph: torch.fx.Graph, kind: str, x: torch.fx.Node, axis, dims: tuple[int, ...], mesh: Mesh
         ) -> torch.fx.Node:
    """A node calling ``kind``'s operator on ``x``: ``(x, axis, *dims[, size])``. ``axis`` is one axis name, or a
    tuple of them for ``grad_all_reduce``."""
    k = KINDS[kind]
    if kind == "grad_all_reduce":
        return graph.create_node("call_function", k.overload, (x, list(axis)), name=k.name)
    args = (x, axis, *dims) + ((mesh.axis_size(axis),) if k.sized else ())
    return graph.create_node("call_function", k.overload, args, name=k.name)


def wire_bytes(kind: str, b: float, n: int, requires_grad: bool = True) -> tuple[float, float]:
    """(forward, backward) bytes each rank sends for one node of ``kind`` on a group of ``n`` ranks, ``b`` the
    larger of its local input and output in bytes (per axis for multi-axis kinds)."""
    from autoshard.cost_models.alpha_beta import collective_bytes_on_wire

    k = KINDS[kind]
    fwd = collective_bytes_on_wire(k.forward, b, n) if k.forward else 0.0
    bwd = collective_bytes_on_wire(k.backward, b, n) if k.backward and requires_grad else 0.0
    if k.regather and requires_grad:
        bwd += fwd
    return float(fwd), float(bwd)


def time(kind: str, b: float, n: int, link, requires_grad: bool = True) -> tuple[float, float]:
    """(forward, backward) seconds of one node of ``kind`` by the alpha-beta model on ``link`` (the link's own
    measurement for the primitive where it has one); a gradient reduction's backward (``gradient_reduction``) pays
    ``1 - link.overlap`` of its time, the rest hidden behind backward compute."""
    from autoshard.cost_models.alpha_beta import collective_time

    k = KINDS[kind]
    fwd = collective_time(k.forward, b, n, link) if k.forward else 0.0
    bwd = collective_time(k.backward, b, n, link) if k.backward and requires_grad else 0.0
    if k.gradient_reduction:
        bwd *= 1.0 - link.overlap  # the share the link hides behind backward compute
    if k.regather and requires_grad:
        bwd += fwd
    return fwd, bwd
