"""Attention: scaled_dot_product_attention shards batch and heads (queries too when not causal)."""

from __future__ import annotations

import math

import torch

from autoshard.ops.dimmap import DimMap, OpInfo, broadcast_labels
from autoshard.ops.registry import OUTPUT, Shapes, op

aten = torch.ops.aten


def sdpa_flops(op: Shapes):
    """2·b·h·s_q·s_kv·(d + d_v); causal attention counted in full (the math and CPU kernels compute it)."""
    q, k, v = op.shape(0), op.shape(1), op.shape(2)
    return 2 * math.prod(q[:-1]) * k[-2] * (q[-1] + v[-1])


# Backward ≈ 2.5× (FlashAttention recomputes the scores: 5 matmuls against 2); q, k, v, the output and its
# log-sum-exp are kept.
op(aten.scaled_dot_product_attention, aten._scaled_dot_product_flash_attention,
   aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_flash_attention_for_cpu,
   aten._scaled_dot_product_cudnn_attention, flops=sdpa_flops, backward=2.5, saves=(0, 1, 2, OUTPUT))


@op(aten.scaled_dot_product_attention.default)
def _sdpa(info: OpInfo) -> DimMap:
    q, k, _v = info.in_shapes[:3]
    causal = bool(info.arg(5, "is_causal", False))
    batch = [f"b{i}" for i in range(len(q) - 3)]
    head = "h"  # with GQA both head counts must divide by the axis: local groups stay aligned
    sq = None if causal else "s"
    out = tuple(batch) + (head, sq, None)
    ins = [tuple(batch) + (head, sq, None), tuple(batch) + (head, None, None), tuple(batch) + (head, None, None)]
    if len(info.in_shapes) > 3 and info.in_shapes[3] is not None:
        full = (*batch, head, sq, None)
        ins.append(broadcast_labels(info.in_shapes[3], (*q[:-1], k[-2]), full))
    return DimMap(tuple(ins), (out,))
