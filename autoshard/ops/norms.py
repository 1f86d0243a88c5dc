"""Normalisations: softmax keeps its dim whole; layer_norm / rms_norm keep the normalised (trailing) dims whole,
with weight and bias replicated."""

from __future__ import annotations

import torch

from autoshard.ops.dimmap import DimMap, OpInfo, keep_dims_whole
from autoshard.ops.registry import OUTPUT, Shapes, op

aten = torch.ops.aten


def softmax_flops(op: Shapes):
    return 5 * op.numel(0)


def norm_flops(op: Shapes):
    return 8 * op.numel(0)


def rms_norm_flops(op: Shapes):
    return 4 * op.numel(0)


op(aten.softmax, aten._softmax, aten.log_softmax, aten._log_softmax, flops=softmax_flops, saves=(OUTPUT,))
op(aten.special_softmax, aten.special_log_softmax, flops=softmax_flops)
op(aten.layer_norm, aten.native_layer_norm, aten.group_norm, aten.batch_norm, aten.native_batch_norm,
   flops=norm_flops, saves=(0,))
op(aten.native_group_norm, aten._native_batch_norm_legit, aten._native_batch_norm_legit_no_training,
   aten.instance_norm, flops=norm_flops)
op(aten.rms_norm, flops=rms_norm_flops, saves=(0,))
op(aten._fused_rms_norm, flops=rms_norm_flops)


@op(aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default)
def _softmax(info: OpInfo) -> DimMap:
    return keep_dims_whole(info, [info.arg(1, "dim")])


@op(aten.layer_norm.default, aten.rms_norm.default)
def _layer_norm(info: OpInfo) -> DimMap:
    n = len(info.in_shapes[0])
    k = len(info.arg(1, "normalized_shape"))
    labels = tuple(None if d >= n - k else f"d{d}" for d in range(n))
    ins = (labels,) + tuple(None if s is None else (None,) * len(s) for s in info.in_shapes[1:])
    return DimMap(ins, (labels,))
