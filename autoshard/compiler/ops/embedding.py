"""Embedding: sharding the vocabulary (``"v"``, contracted) gives a Partial output; the local form looks up the
ids this rank holds and zeros the rest (``runtime.ops.masked_embedding``)."""

from __future__ import annotations

import torch

from autoshard.compiler.ops.dimmap import DimMap, OpInfo, out_labels
from autoshard.compiler.ops.local import arg, input_spec, replace_node
from autoshard.compiler.ops.registry import Shapes, op, zero
from autoshard.placements import Shard
from autoshard.runtime import ops as local_kernels

aten = torch.ops.aten


def embedding_backward_flops(op: Shapes):
    """A scatter-add of the output's gradient into the table."""
    return op.out_numel()


def embedding_local(graph, new, old, mesh, rank):
    spec = input_spec(old)
    vocab_axes = [a for a, p in enumerate(spec) if isinstance(p, Shard) and p.dim == 0]
    if not vocab_axes:
        return new
    rows = old.args[0].meta["val"].shape[0] // mesh.shape[vocab_axes[0]]
    offset = mesh.coords(rank)[mesh.names[vocab_axes[0]]] * rows
    padding_idx = arg(new, 2, "padding_idx", -1)
    return replace_node(graph, new, local_kernels.masked_embedding, (new.args[0], new.args[1], offset, padding_idx))


# A lookup moves bytes (indices + 2·output) and computes nothing; it keeps its indices for the backward.
op(aten.embedding, flops=zero, bytes="embedding", backward_flops=embedding_backward_flops, saves=(1,))


@op(aten.embedding.default, localize=embedding_local)
def _embedding(info: OpInfo) -> DimMap:
    _, idx = info.in_shapes
    labels = out_labels(len(idx))
    return DimMap((("v", "h"), tuple(labels)), (tuple(labels) + ("h",),), "multi", (0,))
