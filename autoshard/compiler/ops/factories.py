"""Tensors made from nothing (arange, full, new_ones) and masks (tril, triu): replicated; their consumers slice
them locally for free. Generated code names no device: factories follow the rank's device.

``x.new_empty(size)``, ``new_zeros``, ``new_ones``, ``new_full`` are the exception: their values do not depend on
where an element sits, so any dim of the output may be sharded, each rank making its local shape. A model that
builds a large tensor so (Hugging Face's DeepSeek-V3 attention assembles its keys in ``kv.new_empty(b, heads, s,
d)``) would otherwise hold it whole on every rank, and gather ``x``, which only lends its dtype and device."""

from __future__ import annotations

import torch

from autoshard.compiler.ops.dimmap import DimMap, OpInfo, factory, out_labels
from autoshard.compiler.ops.registry import op, zero
from autoshard.compiler.ops.views import local_shape_arg

aten = torch.ops.aten

op(aten.zeros, aten.ones, aten.full, aten.empty, aten.arange, aten.zeros_like, aten.ones_like, aten.full_like,
   aten.empty_like, aten.new_zeros, aten.new_ones, aten.new_full, aten.new_empty, aten.scalar_tensor, aten.tril,
   aten.triu, flops=zero, saves=())
op(aten.arange.default, aten.arange.start, aten.arange.start_step, aten.full.default, aten.zeros.default,
   aten.ones.default, aten.empty.memory_format, aten.scalar_tensor.default, aten.zeros_like.default,
   aten.ones_like.default, aten.full_like.default, aten.empty_like.default, aten.tril.default, aten.triu.default,
   rule=factory)


@op(aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default,
    localize=local_shape_arg)
def _new_factory(info: OpInfo) -> DimMap:
    # every output dim may be sharded (the local form writes the local size); ``x``'s leading dims of the output's
    # sizes carry the output's labels, so an ``x`` sharded as the output is taken as it is (its values are not read:
    # a dim of ``x`` without a label is only asked whole on an axis that shards an output dim it lacks)
    out = info.out_shapes[0]
    labels = out_labels(len(out))
    x = info.in_shapes[0]
    same = 0
    while same < min(len(x), len(out)) and x[same] == out[same]:
        same += 1
    return DimMap((tuple(labels[d] if d < same else None for d in range(len(x))),), (tuple(labels),))
