"""Views and shape ops: a dim-grouping map from the two shapes (``[2,16,64] -> [32,64]`` merges b,s; only the
outermost factor of a merged dim may carry a shard), permutations, slices, splits, concatenation, padding.

Ops that write a shape into the program (view, reshape, expand, unflatten) have a local form that writes the
rank's local shape instead.
"""

from __future__ import annotations

import operator

import torch

from autoshard.compiler.ops.dimmap import (
    DimMap,
    OpInfo,
    broadcast_labels,
    keep_dims_whole,
    norm_dim,
    out_labels,
    permute_rule,
    pointwise,
    view_rule,
)
from autoshard.compiler.ops.local import out_spec
from autoshard.compiler.ops.registry import elementwise, op, zero
from autoshard.placements import local_shape

aten = torch.ops.aten


def local_shape_arg(graph, new, old, mesh, rank):
    """``view(x, shape)``, ``expand(x, shape)``: the shape written into the code is the local one."""
    new.args = (new.args[0], list(local_shape(old.meta["val"].shape, out_spec(old), mesh))) + tuple(new.args[2:])
    return new


def unflatten_local(graph, new, old, mesh, rank):
    out = local_shape(old.meta["val"].shape, out_spec(old), mesh)
    ndim = old.args[0].meta["val"].dim()
    dim = old.args[1] % ndim
    sizes = list(out[dim: dim + len(old.args[2])])
    new.args = (new.args[0], new.args[1], sizes) + tuple(new.args[3:])
    return new


# ---- cost: views move nothing (0 FLOPs, 0 bytes, no backward); copies move bytes ---------------------------
op(operator.getitem, aten.view, aten._unsafe_view, aten.reshape, aten.transpose, aten.t, aten.permute, aten.expand,
   aten.expand_as, aten.view_as, aten.slice, aten.select, aten.narrow, aten.unsqueeze, aten.squeeze, aten.split,
   aten.split_with_sizes, aten.chunk, aten.unbind, aten.tensor_split, aten.alias, aten.detach, aten.as_strided,
   aten.flatten, aten.unflatten, aten.movedim, aten.diagonal, aten.real, aten.view_as_real, aten.lift_fresh,
   aten._assert_tensor_metadata, aten.sym_size, aten.sym_numel, aten.sym_stride,
   flops=zero, backward=0.0, bytes="view", saves=())
op(aten.cat, aten.stack, aten.repeat, aten.constant_pad_nd, aten.pad, aten.roll, aten.flip, flops=zero, saves=())
op(aten.broadcast_tensors, flops=elementwise, saves=())

# ---- rules -----------------------------------------------------------------------------------------------
op(aten.view.default, aten.reshape.default, aten._unsafe_view.default, rule=view_rule, localize=local_shape_arg)
op(aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.flatten.using_ints,
   rule=view_rule)
op(aten.unflatten.int, rule=view_rule, localize=unflatten_local)
op(aten.alias.default, aten.detach.default, rule=pointwise("sum", linear_inputs=(0,)))


@op(aten.expand.default, localize=local_shape_arg)
def _expand(info: OpInfo) -> DimMap:
    out = info.out_shapes[0]
    labels = out_labels(len(out))
    return DimMap((broadcast_labels(info.in_shapes[0], out, labels),), (tuple(labels),), "sum")


@op(aten.transpose.int)
def _transpose(info: OpInfo) -> DimMap:
    n = len(info.in_shapes[0])
    perm = list(range(n))
    a, b = norm_dim(info.arg(1, "dim0"), n), norm_dim(info.arg(2, "dim1"), n)
    perm[a], perm[b] = perm[b], perm[a]
    return permute_rule(info, perm)


@op(aten.t.default)
def _t(info: OpInfo) -> DimMap:
    return permute_rule(info, list(reversed(range(len(info.in_shapes[0])))))


@op(aten.permute.default)
def _permute(info: OpInfo) -> DimMap:
    n = len(info.in_shapes[0])
    return permute_rule(info, [norm_dim(d, n) for d in info.arg(1, "dims")])


@op(aten.slice.Tensor)
def _slice(info: OpInfo) -> DimMap:
    n = len(info.in_shapes[0])
    dim = norm_dim(info.arg(1, "dim", 0), n)
    whole = info.in_shapes[0][dim] == info.out_shapes[0][dim]
    return keep_dims_whole(info, [] if whole else [dim], "sum")


@op(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int)
def _split(info: OpInfo) -> DimMap:
    n = len(info.in_shapes[0])
    unbind = len(info.out_shapes[0]) < n
    dim = norm_dim(info.arg(1, "dim", 0) if unbind else info.arg(2, "dim", 0), n)
    labels = tuple(None if d == dim else f"d{d}" for d in range(n))
    if unbind:  # unbind drops the dim
        outs = tuple(tuple(lab for d, lab in enumerate(labels) if d != dim) for _ in info.out_shapes)
    else:
        outs = tuple(labels for _ in info.out_shapes)
    return DimMap((labels,), outs, "sum")


@op(aten.cat.default)
def _cat(info: OpInfo) -> DimMap:
    out = info.out_shapes[0]
    dim = norm_dim(info.arg(1, "dim", 0), len(out))
    labels = tuple(None if d == dim else f"d{d}" for d in range(len(out)))
    ins = tuple(None if s is None else (labels if len(s) == len(out) else (None,) * len(s)) for s in info.in_shapes)
    return DimMap(ins, (labels,), "sum")


@op(aten.stack.default)
def _stack(info: OpInfo) -> DimMap:
    out = info.out_shapes[0]
    dim = norm_dim(info.arg(1, "dim", 0), len(out))
    labels = [f"d{d}" for d in range(len(out))]
    ins = tuple(None if s is None else tuple(lab for d, lab in enumerate(labels) if d != dim) for s in info.in_shapes)
    labels[dim] = None
    return DimMap(ins, (tuple(labels),), "sum")


@op(aten.pad.default, aten.constant_pad_nd.default)
def _pad(info: OpInfo) -> DimMap:
    n = len(info.in_shapes[0])
    pads = info.arg(1, "pad")
    whole = [n - 1 - i // 2 for i in range(len(pads))]
    return keep_dims_whole(info, whole)


@op(aten.broadcast_tensors.default)
def _broadcast_tensors(info: OpInfo) -> DimMap:
    out = info.out_shapes[0]
    labels = out_labels(len(out))
    ins = tuple(broadcast_labels(s, out, labels) for s in info.in_shapes)
    return DimMap(ins, tuple(tuple(labels) for _ in info.out_shapes), "sum")


# ---- select, scatters into slices, repeats, roll, flip (issue "Any model: op coverage") ---------------------
op(aten.repeat_interleave, aten.select_scatter, aten.slice_scatter, flops=zero, saves=())


@op(aten.select.int)
def _select(info: OpInfo) -> DimMap:
    """``x.select(dim, i)``: the selected dim stays whole and disappears; the others keep their labels."""
    n = len(info.in_shapes[0])
    dim = norm_dim(info.arg(1, "dim"), n)
    labels = tuple(None if d == dim else f"d{d}" for d in range(n))
    return DimMap((labels,), (tuple(lab for d, lab in enumerate(labels) if d != dim),), "sum")


@op(aten.select_scatter.default)
def _select_scatter(info: OpInfo) -> DimMap:
    """``select_scatter(base, src, dim, i)``: base with ``base.select(dim, i)`` replaced by src (the functional
    form of ``base[..., i] = src``): linear in (base, src) together."""
    n = len(info.in_shapes[0])
    dim = norm_dim(info.arg(2, "dim"), n)
    labels = tuple(None if d == dim else f"d{d}" for d in range(n))
    src = tuple(lab for d, lab in enumerate(labels) if d != dim)
    return DimMap((labels, src), (labels,), "sum")


@op(aten.slice_scatter.default)
def _slice_scatter(info: OpInfo) -> DimMap:
    """``slice_scatter(base, src, dim, start, end, step)``: the sliced dim stays whole (unless the slice is all of
    it); linear in (base, src) together."""
    n = len(info.in_shapes[0])
    dim = norm_dim(info.arg(2, "dim", 0), n)
    whole = info.in_shapes[0][dim] == info.in_shapes[1][dim]
    labels = tuple(None if d == dim and not whole else f"d{d}" for d in range(n))
    return DimMap((labels, labels), (labels,), "sum")


@op(aten.repeat.default)
def _repeat(info: OpInfo) -> DimMap:
    """``x.repeat(r0, r1, ...)``: a dim repeated once keeps its label; a repeated dim and new leading dims stay
    whole. The repeat counts are the same on every rank (a sharded dim is repeated once)."""
    n, out = len(info.in_shapes[0]), info.out_shapes[0]
    reps = list(info.arg(1, "repeats"))
    off = len(out) - n
    labels = [f"d{d}" if reps[off + d] == 1 else None for d in range(n)]
    return DimMap((tuple(labels),), (tuple([None] * off + labels),), "sum")


@op(aten.repeat_interleave.self_int, aten.repeat_interleave.self_Tensor)
def _repeat_interleave(info: OpInfo) -> DimMap:
    """``x.repeat_interleave(r, dim)``: the repeated dim stays whole; without a dim (flattened) all of x does."""
    dim = info.arg(2, "dim")
    if dim is None:
        return DimMap(tuple(None if s is None else (None,) * len(s) for s in info.in_shapes),
                      ((None,),), "sum", (0,))
    return keep_dims_whole(info, [dim], "sum")


@op(aten.roll.default)
def _roll(info: OpInfo) -> DimMap:
    """``x.roll(shifts, dims)``: rolled dims stay whole; a roll of the flattened tensor (no dims) keeps all whole."""
    n = len(info.in_shapes[0])
    dims = list(info.arg(2, "dims", []) or [])
    return keep_dims_whole(info, dims if dims else list(range(n)), "sum")


@op(aten.flip.default)
def _flip(info: OpInfo) -> DimMap:
    return keep_dims_whole(info, list(info.arg(1, "dims")), "sum")
