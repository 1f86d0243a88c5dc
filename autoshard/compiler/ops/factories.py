"""Tensors made from nothing (arange, full, new_ones) and masks (tril, triu): replicated; their consumers slice
them locally for free. Generated code names no device: factories follow the rank's device."""

from __future__ import annotations

import torch

from autoshard.compiler.ops.dimmap import factory
from autoshard.compiler.ops.registry import op, zero

aten = torch.ops.aten

op(aten.zeros, aten.ones, aten.full, aten.empty, aten.arange, aten.zeros_like, aten.ones_like, aten.full_like,
   aten.empty_like, aten.new_zeros, aten.new_ones, aten.new_full, aten.new_empty, aten.scalar_tensor, aten.tril,
   aten.triu, flops=zero, saves=())
op(aten.arange.default, aten.arange.start, aten.arange.start_step, aten.full.default, aten.zeros.default,
   aten.ones.default, aten.empty.memory_format, aten.scalar_tensor.default, aten.new_ones.default,
   aten.new_zeros.default, aten.new_full.default, aten.new_empty.default, aten.zeros_like.default,
   aten.ones_like.default, aten.full_like.default, aten.empty_like.default, aten.tril.default, aten.triu.default,
   rule=factory)
