"""``sequence_cut``: where a whole-sequence input becomes sequence-sharded on the context axis.

In the global program it is the identity; its rule lets the output's dim ``dim`` be sharded while the input
stays whole on that axis, and its local form cuts this rank's chunks (head-tail when the axis is balanced,
``gm.meta[autoshard.meta.CONTEXT]``). Inserted by ``passes/context_parallel.py`` after each input that carries
the sequence; nothing else creates it.
"""

from __future__ import annotations

import torch

from autoshard import meta as M
from autoshard.compiler.ops.dimmap import DimMap, OpInfo
from autoshard.compiler.ops.local import replace_node
from autoshard.compiler.ops.registry import op, zero
from autoshard.placements import Shard


def sequence_cut(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The global program's view: the whole tensor."""
    return x


def _rule(info: OpInfo) -> DimMap:
    shape = info.in_shapes[0]
    dim = info.arg(1, "dim")
    labels = [f"d{i}" for i in range(len(shape))]
    inp = tuple(None if i == dim else lab for i, lab in enumerate(labels))
    return DimMap((inp,), (tuple(labels),))


def _localize(graph: torch.fx.Graph, new: torch.fx.Node, old: torch.fx.Node, mesh, rank: int) -> torch.fx.Node:
    from autoshard.runtime.context import sequence_slice

    dim = old.args[1]
    spec = old.meta[M.SPEC]
    axes = [a for a, p in enumerate(spec) if isinstance(p, Shard) and p.dim == dim]
    if not axes or isinstance(old.meta[M.STRATEGY].input_specs[0][axes[0]], Shard):
        return replace_node(graph, new, torch.ops.aten.alias.default, (new.args[0],))
    layout = old.graph.owning_module.meta.get(M.CONTEXT)
    axis = mesh.names[axes[0]]
    balanced = bool(layout is not None and layout.axis == axis and layout.balance)
    return replace_node(graph, new, sequence_slice, (new.args[0], axis, dim, mesh.shape[axes[0]], balanced))


op(sequence_cut, rule=_rule, localize=_localize, flops=zero, bytes="view", backward=0.0, saves=())
