"""Indexing with tensors (index, gather, index_select) and diff: run whole (replicated) for now."""

from __future__ import annotations

import torch

from autoshard.ops.dimmap import replicate_only
from autoshard.ops.registry import elementwise, op, zero

aten = torch.ops.aten

op(aten.index_select, aten.gather, aten.index, flops=zero, saves=())  # copies: bytes only
op(aten.diff, flops=elementwise, saves=())
op(aten.index.Tensor, aten.diff.default, aten.index_select.default, aten.gather.default, rule=replicate_only)
