"""Losses. A mean/sum reduction contracts every batch label: a sharded batch gives a Partial loss, and the local
form rescales a local mean to the global count. Cross-entropy may also shard its class dim (vocab-parallel,
Megatron: ``torch.ops.autoshard.vocab_parallel_cross_entropy``)."""

from __future__ import annotations

import math

import torch

from autoshard.frontend.graph_utils import tensor_inputs
from autoshard.compiler.ops.dimmap import DimMap, OpInfo, out_labels, replicate_only
from autoshard.compiler.ops.local import arg, input_spec, out_spec, partial_axes, replace_first, replace_node, scale_by
from autoshard.compiler.ops.registry import Shapes, op
from autoshard.placements import Shard, local_shape
from autoshard.runtime import ops as local_kernels

aten = torch.ops.aten


def cross_entropy_flops(op: Shapes):
    return 5 * op.numel(0) + op.numel(1)


def nll_flops(op: Shapes):
    return op.numel(1)


def pointwise_loss_flops(op: Shapes):
    return 3 * op.numel(0)


# ---- local forms ------------------------------------------------------------------------------------------
def elementwise_loss_local(graph, new, old, mesh, rank):
    reduction = arg(old, 2, "reduction", 1)
    x = tensor_inputs(old)[0]
    ratio = math.prod(local_shape(x.meta["val"].shape, input_spec(old), mesh)) / math.prod(x.meta["val"].shape)
    return new if reduction != 1 else scale_by(graph, new, ratio)


def nll_loss_local(graph, new, old, mesh, rank):
    axes = tuple(mesh.names[a] for a in partial_axes(out_spec(old), mesh))
    if not axes or arg(old, 3, "reduction", 1) != 1:
        return new
    a = list(new.args) + [None] * (5 - len(new.args))
    weight = a[2] if a[2] is not None else new.kwargs.get("weight")
    ignore = arg(old, 4, "ignore_index", -100)
    return replace_node(graph, new, local_kernels.cross_entropy_partial_mean,
                        (a[0], a[1], weight, ignore, 0.0, axes, True))


def cross_entropy_local(graph, new, old, mesh, rank):
    axes = tuple(mesh.names[a] for a in partial_axes(out_spec(old), mesh))
    reduction = arg(old, 3, "reduction", 1)
    x_spec = input_spec(old)
    vocab = [mesh.names[a] for a, p in enumerate(x_spec) if isinstance(p, Shard) and p.dim == 1]
    ignore = arg(old, 4, "ignore_index", -100)
    if vocab:
        batch_axes = tuple(mesh.names[a] for a, p in enumerate(x_spec) if isinstance(p, Shard) and p.dim == 0)
        return replace_first(graph, new, torch.ops.autoshard.vocab_parallel_cross_entropy.default,
                             (new.args[0], new.args[1], ignore, reduction, vocab[0], mesh.axis_size(vocab[0]),
                              list(batch_axes)))
    if not axes or reduction != 1:
        return new  # sum reduction is already a correct partial sum; 'none' has no reduction
    a = list(new.args) + [None] * (6 - len(new.args))
    weight = a[2] if a[2] is not None else new.kwargs.get("weight")
    smoothing = a[5] if len(old.args) > 5 else old.kwargs.get("label_smoothing", 0.0)
    return replace_node(graph, new, local_kernels.cross_entropy_partial_mean,
                        (a[0], a[1], weight, ignore, smoothing, axes))


# ---- cost and saved tensors -------------------------------------------------------------------------------
op(aten.cross_entropy_loss, flops=cross_entropy_flops, saves=(0, 1))
op(aten.nll_loss, aten.nll_loss_forward, flops=nll_flops, saves=(0, 1))
op(aten.nll_loss2d_forward, flops=nll_flops)
op(aten.nll_loss_nd, flops=nll_flops, saves=())  # its target is kept in fact; the memory model never counted it
op(aten.mse_loss, aten.l1_loss, aten.binary_cross_entropy_with_logits, flops=pointwise_loss_flops, saves=(0, 1))
op(aten.smooth_l1_loss, aten.huber_loss, aten.binary_cross_entropy, aten.kl_div, flops=pointwise_loss_flops)


# ---- rules ------------------------------------------------------------------------------------------------
@op(aten.mse_loss.default, aten.l1_loss.default, localize=elementwise_loss_local)
def _elementwise_loss(info: OpInfo) -> DimMap:
    # reduction 'none' keeps the shape; 'mean'/'sum' contract every dim (a sharded dim gives a Partial loss,
    # and the local form rescales the local mean to the global count).
    labels = tuple(out_labels(len(info.in_shapes[0])))
    reduction = info.arg(2, "reduction", 1)
    return DimMap((labels, labels), (labels if reduction == 0 else (),))


@op(aten.cross_entropy_loss.default, localize=cross_entropy_local)
def _cross_entropy(info: OpInfo) -> DimMap:
    x, t = info.in_shapes[:2]
    reduction = info.arg(3, "reduction", 1)
    batch = tuple(f"n{i}" for i in range(len(t)))
    # The class dim may be sharded (vocab-parallel loss, runtime.ops.vocab_parallel_cross_entropy) for unweighted,
    # unsmoothed 2-D losses; the kernel returns a Partial value over that axis.
    vocab_ok = len(x) == 2 and len(info.in_shapes) == 2 and not info.arg(5, "label_smoothing", 0.0)
    x_labels = (batch[0], "c" if vocab_ok else None) + batch[1:] if len(x) == len(t) + 1 else (None,) * len(x)
    extra = tuple(None if s is None else (None,) * len(s) for s in info.in_shapes[2:])
    if len(x) != len(t) + 1:
        return replicate_only(info)
    # mean/sum reductions contract the batch labels: a sharded batch gives a Partial loss (the local form divides
    # the local sum by the global count of non-ignored targets).
    out = batch if reduction == 0 else ()
    return DimMap((x_labels, batch) + extra, (out,))


@op(aten.nll_loss_nd.default, aten.nll_loss.default, localize=nll_loss_local)
def _nll_loss(info: OpInfo) -> DimMap:
    # as cross-entropy, but the class dim stays whole (no vocab-parallel kernel for log-probabilities)
    dm = _cross_entropy(info)
    x_labels = tuple(None if lab == "c" else lab for lab in dm.inputs[0])
    return DimMap((x_labels,) + dm.inputs[1:], dm.outputs, dm.linear, dm.linear_inputs, dm.bias, dm.replicate_only)
