"""Convolutions: priced (FLOPs, saved operands), not sharded yet (no rule: they run replicated on request)."""

from __future__ import annotations

import math

import torch

from autoshard.ops.registry import Shapes, op

aten = torch.ops.aten


def conv_flops(op: Shapes):
    """2·numel(out)·C_in/groups·∏kernel (weight ``[C_out, C_in/groups, *kernel]``)."""
    return 2 * op.out_numel() * math.prod(op.shape(1)[1:])


op(aten.convolution, aten.conv1d, aten.conv2d, aten.conv3d, flops=conv_flops, backward=2.0, saves=(0, 1))
