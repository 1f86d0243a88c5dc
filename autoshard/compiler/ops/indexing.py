"""Indexing with tensors (index, gather, index_select) and diff: run whole (replicated) for now. Writes through
indices (index_put, scatter, scatter_add) keep the indexed dims whole and shard the others."""

from __future__ import annotations

import torch

from autoshard.compiler.ops.dimmap import DimMap, OpInfo, norm_dim, replicate_only
from autoshard.compiler.ops.registry import elementwise, op, zero

aten = torch.ops.aten

op(aten.index_select, aten.gather, aten.index, flops=zero, saves=())  # copies: bytes only
op(aten.diff, flops=elementwise, saves=())
op(aten.index.Tensor, aten.diff.default, aten.index_select.default, aten.gather.default, rule=replicate_only)
op(aten.index_put, aten.scatter, aten.scatter_add, flops=zero, saves=())


@op(aten.index_put.default)
def _index_put(info: OpInfo) -> DimMap:
    """``index_put(x, indices, values, accumulate)``: x's leading dims named by ``indices`` stay whole, its
    trailing dims keep their labels, and ``values`` (the indices' broadcast shape + x's trailing dims) carries
    them too. Linear in (x, values) together (a write or an add of values)."""
    shape = info.in_shapes[0]
    indices = [i for i in info.arg(1, "indices")]
    k = len(indices)
    labels = tuple(None if d < k else f"d{d}" for d in range(len(shape)))
    values = info.in_shapes[-1]
    trailing = len(shape) - k
    # only the last positional tensor is the values; index tensors between them stay whole
    n_idx = len(info.in_shapes) - 2
    if any(i is None for i in indices) or values is None or len(values) < trailing or tuple(
            values[len(values) - trailing:]) != tuple(shape[k:]):
        return replicate_only(info)
    vals = (None,) * (len(values) - trailing) + labels[k:]
    ins = (labels,) + tuple(None if s is None else (None,) * len(s) for s in info.in_shapes[1:1 + n_idx]) + (vals,)
    return DimMap(ins, (labels,), "sum", (0, len(ins) - 1))


def _scatter_rule(info: OpInfo, linear: bool) -> DimMap:
    """``scatter(x, dim, index, src)``: ``dim`` stays whole; another dim keeps its label where x, index and src
    all have the same size there (index may be smaller than x)."""
    shapes = [s for s in info.in_shapes if s is not None]
    n = len(shapes[0])
    dim = norm_dim(info.arg(1, "dim"), n)
    labels = tuple(None if d == dim or any(len(s) != n or s[d] != shapes[0][d] for s in shapes) else f"d{d}"
                   for d in range(n))
    ins = tuple(None if s is None else labels for s in info.in_shapes)
    src = (0, len(info.in_shapes) - 1) if linear and len(shapes) == 3 else (0,)
    return DimMap(ins, (labels,), "sum" if linear else "none", src)


@op(aten.scatter_add.default, aten.scatter.src)
def _scatter_add(info: OpInfo) -> DimMap:
    return _scatter_rule(info, True)


@op(aten.scatter.value)
def _scatter_value(info: OpInfo) -> DimMap:
    return _scatter_rule(info, False)
