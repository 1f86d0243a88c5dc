"""Convolutions (1-D/2-D/3-D): the batch dim and the output channels shard; the input channels are a contraction
(a Partial output, the bias added once); grouped convolutions shard their batch, depthwise ones (groups = input
channels) their channels too, each rank running its channels' groups. Spatial dims stay whole (a halo exchange
is not modelled)."""

from __future__ import annotations

import math

import torch

from autoshard.compiler.ops.dimmap import DimMap, OpInfo
from autoshard.compiler.ops.local import input_spec, out_spec, partial_axes
from autoshard.compiler.ops.registry import Shapes, op
from autoshard.placements import Shard
from autoshard.runtime import ops as local_kernels

aten = torch.ops.aten


def conv_flops(op: Shapes):
    """2·numel(out)·C_in/groups·∏kernel (weight ``[C_out, C_in/groups, *kernel]``)."""
    return 2 * op.out_numel() * math.prod(op.shape(1)[1:])


op(aten.convolution, aten.conv1d, aten.conv2d, aten.conv3d, flops=conv_flops, backward=2.0, saves=(0, 1),
   compute_kind="matmul")

_CONVS = (aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, aten.conv1d.padding, aten.conv2d.padding,
          aten.conv3d.padding, aten.convolution.default)


def _groups_pos(args) -> int:
    """``groups`` is argument 6 of conv1d/2d/3d and 8 of ``convolution`` (which has ``transposed`` at 6)."""
    return 8 if len(args) >= 9 else 6


def _arg(args, kwargs, pos, name, default):
    return args[pos] if len(args) > pos else kwargs.get(name, default)


def conv_local(graph, new, old, mesh, rank):
    """The bias of a Partial output (input channels sharded) is added on coordinate 0 only; a depthwise
    convolution with sharded channels runs its local groups."""
    args, kwargs = list(new.args), dict(new.kwargs)
    axes = partial_axes(out_spec(old), mesh)
    if axes and len(args) > 2 and args[2] is not None:
        coords = mesh.coords(rank)
        keep = all(coords[mesh.names[a]] == 0 for a in axes)
        with graph.inserting_before(new):
            args[2] = graph.call_function(local_kernels.bias_once, (args[2], keep))
    pos = _groups_pos(args)
    groups = _arg(args, kwargs, pos, "groups", 1)
    if groups != 1:
        split = math.prod(mesh.shape[a] for a, p in enumerate(input_spec(old, 0)) if isinstance(p, Shard)
                          and p.dim == 1)
        if len(args) > pos:
            args[pos] = groups // split
        else:
            kwargs["groups"] = groups // split
    new.args, new.kwargs = tuple(args), kwargs
    return new


@op(*_CONVS, localize=conv_local)
def _conv(info: OpInfo) -> DimMap:
    x, w = info.in_shapes[0], info.in_shapes[1]
    bias = info.in_shapes[2] if len(info.in_shapes) > 2 else None
    spatial = (None,) * (len(x) - 2)
    kernel = (None,) * (len(w) - 2)
    args = info.args
    transposed = len(args) >= 9 and bool(args[6])
    groups = _arg(args, info.kwargs, _groups_pos(args), "groups", 1)
    c_in, c_out = x[1], w[0]
    if transposed:  # weight [C_in, C_out/groups, *k]: the batch only
        xl, wl, ol, bl = ("n", None) + spatial, (None, None) + kernel, ("n", None) + spatial, (None,)
    elif groups == 1:
        xl, wl, ol, bl = ("n", "i") + spatial, ("o", "i") + kernel, ("n", "o") + spatial, ("o",)
    elif groups == c_in and c_out % c_in == 0:  # depthwise: output channel o reads input channel o // (c_out/c_in)
        xl, wl, ol, bl = ("n", "c") + spatial, ("c", None) + kernel, ("n", "c") + spatial, ("c",)
    else:
        xl, wl, ol, bl = ("n", None) + spatial, (None, None) + kernel, ("n", None) + spatial, (None,)
    ins = (xl, wl) + ((bl,) if bias is not None else ())
    return DimMap(ins, (ol,), "multi", (0, 1), (2,) if bias is not None else ())
