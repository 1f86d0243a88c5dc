"""Dropout: elementwise, but random. Replicated copies must draw the same mask and shards their piece of one
global mask, so the local form draws one global mask per call (seeded by the node) and slices it per rank."""

from __future__ import annotations

import zlib

import torch

from autoshard.errors import UnsupportedOpError
from autoshard.frontend.graph_utils import node_location
from autoshard.compiler.ops.dimmap import pointwise
from autoshard.compiler.ops.local import out_spec, replace_first
from autoshard.compiler.ops.registry import MASK, elementwise, op
from autoshard.placements import shard_offsets
from autoshard.runtime import ops as _kernels  # noqa: F401  (registers torch.ops.autoshard.dropout)

aten = torch.ops.aten


def dropout_local(graph, new, old, mesh, rank):
    # Per-process RNG would give replicated copies different masks: use one global mask, sliced per rank.
    p, train = old.args[1], old.args[2]
    if not train or p == 0:
        return new  # no randomness: the op is the identity
    val = old.meta["val"]
    seed = zlib.crc32(old.name.encode())
    offsets = list(shard_offsets(val.shape, out_spec(old), mesh, rank))
    return replace_first(graph, new, torch.ops.autoshard.dropout.default,
                         (new.args[0], float(p), list(val.shape), offsets, seed))


def native_dropout_local(graph, new, old, mesh, rank):
    p, train = old.args[1], old.args[2] if len(old.args) > 2 else True
    if train and p:
        raise UnsupportedOpError(f"{node_location(old)} is native_dropout with p={p} in training mode; autoshard "
                                 "reproduces dropout masks across ranks only for aten.dropout. Use "
                                 "torch.nn.functional.dropout (or nn.Dropout), or p=0.")
    return new


op(aten.dropout, aten.native_dropout, aten.feature_dropout, flops=elementwise, saves=(MASK,))
op(aten.dropout.default, rule=pointwise(), localize=dropout_local)
op(aten.native_dropout.default, rule=pointwise(), localize=native_dropout_local)
