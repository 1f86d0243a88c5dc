"""Mixture-of-Experts graph ops (:mod:`autoshard.runtime.moe.graph_ops`, emitted by ``passes/expert_rewrite.py``).

The routing group ``"g"`` is the only shardable label: tokens live sharded on groups, the expert buffer
``[E, G, C, h]`` on groups too, and the expert matmuls (bmm/baddbmm) shard E — the redistribution between them is
one all-to-all. Routing and bookkeeping are cheap next to the experts: one FLOP per output element, nothing
counted as saved.
"""

from __future__ import annotations

from autoshard.runtime.moe import graph_ops as moe
from autoshard.compiler.ops.dimmap import DimMap, Labels, OpInfo
from autoshard.compiler.ops.registry import elementwise, op


def _g(shape, at: int = 0) -> Labels:
    return tuple("g" if d == at else None for d in range(len(shape)))


@op(moe.route_groups, flops=elementwise, saves=())
def _route(info: OpInfo) -> DimMap:
    return DimMap((_g(info.in_shapes[0]),), tuple(_g(s) for s in info.out_shapes))


@op(moe.dispatch_groups, flops=elementwise, saves=())
def _dispatch(info: OpInfo) -> DimMap:
    return DimMap(tuple(_g(s) for s in info.in_shapes), (_g(info.out_shapes[0], 1),))


@op(moe.combine_groups, flops=elementwise, saves=())
def _combine(info: OpInfo) -> DimMap:
    # linear in the expert outputs: a Partial y (row-parallel experts) is combined before it is reduced
    ins = (_g(info.in_shapes[0], 1),) + tuple(_g(s) for s in info.in_shapes[1:])
    return DimMap(ins, (_g(info.out_shapes[0]),), "multi", (0,))


@op(moe.gate_groups, moe.first_fraction, moe.routing_stats, moe.aux_terms, moe.attach, flops=elementwise, saves=())
def _grouped(info: OpInfo) -> DimMap:
    # every input and output with a leading group dim carries "g"; [E]/stats vectors stay whole (a sharded group
    # contracted away gives a Partial sum, as these ops' local values are shares of the global one)
    def labels(s, leading: bool) -> Labels:
        return _g(s) if leading else (None,) * len(s)

    ins = tuple(None if s is None else labels(s, len(s) >= 2) for s in info.in_shapes)
    outs = tuple(labels(s, len(s) >= 2) for s in info.out_shapes)
    return DimMap(ins, outs)
