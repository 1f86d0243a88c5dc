"""Reductions: the reduced label disappears. Sharding it gives a Partial output for sums and means (a mean's
local form divides by the global count); max-like reductions keep their reduced dims whole. Scans and sorts
(cumsum, topk, sort) keep their dim whole."""

from __future__ import annotations

import math

import torch

from autoshard.frontend.graph_utils import tensor_inputs
from autoshard.compiler.ops.dimmap import DimMap, OpInfo, keep_dims_whole, out_labels, reduce_rule
from autoshard.compiler.ops.local import input_spec, scale_by
from autoshard.compiler.ops.registry import Shapes, op
from autoshard.placements import local_shape

aten = torch.ops.aten


def reduce_flops(op: Shapes):
    """One FLOP per input element."""
    return op.numel(0)


def moment_flops(op: Shapes):
    """var, std, logsumexp: 3 per input element."""
    return 3 * op.numel(0)


def mean_local(graph, new, old, mesh, rank):
    """A mean over a sharded dim: the local mean divides by the local count; the partial sum must divide by the
    global one, so scale by local/global count of the reduced elements."""
    x = tensor_inputs(old)[0]
    ndim = x.meta["val"].dim()
    dims = old.args[1] if old.target == aten.mean.dim and len(old.args) > 1 and old.args[1] else list(range(ndim))
    dims = [d % ndim for d in dims]
    gshape = x.meta["val"].shape
    lshape = local_shape(gshape, input_spec(old), mesh)
    return scale_by(graph, new, math.prod(lshape[d] for d in dims) / math.prod(gshape[d] for d in dims))


op(aten.sum, aten.mean, aten.amax, aten.amin, aten.max, aten.min, aten.prod, aten.argmax, aten.argmin, aten.any,
   aten.all, aten.linalg_vector_norm, aten.norm, aten.cumsum, aten.topk, aten.sort, flops=reduce_flops, saves=())
op(aten.var, aten.std, aten.var_mean, aten.std_mean, aten.logsumexp, flops=moment_flops, saves=())


def _sum_dim(info: OpInfo) -> DimMap:
    return reduce_rule(info, info.arg(1, "dim"), bool(info.arg(2, "keepdim", False)), linear=True)


def _sum_all(info: OpInfo) -> DimMap:
    return reduce_rule(info, None, False, linear=True)


op(aten.sum.dim_IntList, rule=_sum_dim)
op(aten.mean.dim, rule=_sum_dim, localize=mean_local)
op(aten.sum.default, rule=_sum_all)
op(aten.mean.default, rule=_sum_all, localize=mean_local)


@op(aten.amax.default, aten.amin.default, aten.argmax.default, aten.argmin.default, aten.max.dim, aten.min.dim,
    aten.logsumexp.default, aten.var.correction, aten.std.correction)
def _max_dim(info: OpInfo) -> DimMap:
    return reduce_rule(info, info.arg(1, "dim"), bool(info.arg(2, "keepdim", False)), linear=False)


@op(aten.topk.default)
def _topk(info: OpInfo) -> DimMap:
    return keep_dims_whole(info, [info.arg(2, "dim", -1)])


@op(aten.sort.default)
def _sort(info: OpInfo) -> DimMap:
    return keep_dims_whole(info, [info.arg(1, "dim", -1)])


@op(aten.cumsum.default)
def _cumsum(info: OpInfo) -> DimMap:
    return keep_dims_whole(info, [info.arg(1, "dim")], "sum")


# ---- cumulative ops and histograms (issue "Any model: op coverage") --------------------------------------
op(aten.cumprod, aten.cummax, aten.cummin, aten.logcumsumexp, aten.histc, flops=reduce_flops, saves=())


@op(aten.cumprod.default, aten.cummax.default, aten.cummin.default, aten.logcumsumexp.default)
def _scan(info: OpInfo) -> DimMap:
    """Scans keep their dim whole (nonlinear ones: no Partial through them)."""
    return keep_dims_whole(info, [info.arg(1, "dim")])


@op(aten.histc.default)
def _histc(info: OpInfo) -> DimMap:
    """``histc(x, bins, min, max)`` counts over all of x: any sharded dim of x gives a Partial histogram (the
    histograms of the shards add up), the bins dim stays whole."""
    n = len(info.in_shapes[0])
    return DimMap((tuple(out_labels(n)),), ((None,),))
