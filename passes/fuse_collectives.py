"""Per-rank-program fusions of collectives with their neighbours: same values and gradients, fewer bytes or more
overlap. Each is a pass of its own in the one pass list (:mod:`autoshard.passes.manager`).

* :class:`FuseGatherGradSync` — ``grad_all_reduce(all_gather(x, axis, dim), axes)`` with ``axis`` in ``axes`` (a
  sequence-parallel region's all-gather before a column-parallel linear) becomes ``all_gather_sync``, whose
  backward is one reduce-scatter instead of an all-reduce and a slice (Megatron-SP's *g-bar*: half the bytes).
* :class:`FuseLinearsGradSync` — a ``grad_all_reduce(x)`` read only by linears (column-parallel q/k/v, fc1) becomes
  one ``linears_grad_all_reduce`` whose backward starts the input gradient's all-reduce before it computes the
  weight gradients (Megatron's asynchronous column-parallel all-reduce).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace

import torch
import torch.fx
from autoshard.passes.shard_storage import stage_of

from autoshard import meta as M
from autoshard.compiler.collective_kinds import KINDS, is_kind
from autoshard.compiler.context import Context, zero_axis


@dataclass(frozen=True)
class FuseGatherGradSync:
    name: str = "fuse_gather_grad_sync"
    phase: str = "rank"

    def run(self, gm: torch.fx.GraphModule, ctx: Context) -> torch.fx.GraphModule:
        graph = gm.graph
        for node in list(graph.nodes):
            if not _is_gather_then_sync(node):
                continue
            gathered = node.args[0]
            x, axis, dim, size = gathered.args
            stage = stage_of(x) if axis == zero_axis(ctx.options, ctx.mesh) else 0
            if stage == 1:
                continue  # ZeRO-1: the gradient is all-reduced, then sliced (passes/shard_storage.py)
            kind = KINDS["all_gather_reshard" if stage == 3 else "all_gather_sync"]
            with graph.inserting_after(gathered):
                fused = graph.create_node("call_function", kind.overload,
                                          (x, axis, dim, size, list(node.args[1])), name=kind.name)
            fused.meta = dict(node.meta)
            if M.COLLECTIVE in node.meta:
                info = gathered.meta[M.COLLECTIVE]
                bwd = node.meta[M.COLLECTIVE].bytes_backward + (info.bytes_forward if kind.regather else 0)
                fused.meta[M.COLLECTIVE] = replace(info, kind=kind.name, axes=tuple(node.args[1]), bytes_backward=bwd)
            node.replace_all_uses_with(fused)
            graph.erase_node(node)
            graph.erase_node(gathered)
        _reshard_unsynced_gathers(graph, ctx)
        gm.recompile()
        return gm


def _reshard_unsynced_gathers(graph: torch.fx.Graph, ctx: Context) -> None:
    """A ZeRO-3 parameter's all-gather with no gradient sync after it (its users compute replicated over the data
    axis) is still not kept for backward: ``all_gather_reshard`` with no axes to sum (backward: this rank's slice)."""
    axis_of_zero = zero_axis(ctx.options, ctx.mesh)
    for node in list(graph.nodes):
        if not is_kind(node, "all_gather") or node.args[1] != axis_of_zero or stage_of(node.args[0]) != 3:
            continue
        x, axis, dim, size = node.args
        kind = KINDS["all_gather_reshard"]
        with graph.inserting_after(node):
            new = graph.create_node("call_function", kind.overload, (x, axis, dim, size, []), name=kind.name)
        new.meta = dict(node.meta)
        if M.COLLECTIVE in node.meta:
            info = node.meta[M.COLLECTIVE]
            new.meta[M.COLLECTIVE] = replace(info, kind=kind.name, bytes_backward=info.bytes_forward)
        node.replace_all_uses_with(new)
        graph.erase_node(node)


def _is_gather_then_sync(node: torch.fx.Node) -> bool:
    if not is_kind(node, "grad_all_reduce"):
        return False
    src = node.args[0]
    return (isinstance(src, torch.fx.Node) and is_kind(src, "all_gather") and len(src.users) == 1
            and src.args[1] in tuple(node.args[1]))


@dataclass(frozen=True)
class FuseLinearsGradSync:
    name: str = "fuse_linears_grad_sync"
    phase: str = "rank"

    def run(self, gm: torch.fx.GraphModule, ctx: Context) -> torch.fx.GraphModule:
        graph = gm.graph
        order = {n: i for i, n in enumerate(graph.nodes)}
        fused_any = False
        for node in list(graph.nodes):
            if not is_kind(node, "grad_all_reduce"):
                continue
            users = sorted(node.users, key=lambda u: order.get(u, len(order)))
            if not users or not all(_is_linear_of(u, node) for u in users):
                continue
            weights = [u.args[1] for u in users]
            biases = [u.args[2] if len(u.args) > 2 else None for u in users]
            first = users[0]
            late = [p for pair in zip(weights, biases) for p in pair  # in graph order: weight, bias, weight, ...
                    if isinstance(p, torch.fx.Node) and order[p] > order[first]]
            if any(p.op != "call_function" or any(order.get(a, len(order)) > order[first] for a in p.all_input_nodes)
                   for p in late):
                continue  # a weight computed from values made after the first linear: leave the graph as it is
            for p in late:  # a weight's own sync (grad_all_reduce of a parameter): move it up, before the linears
                first.prepend(p)
            with graph.inserting_before(first):
                fused = graph.create_node("call_function", KINDS["linears_grad_all_reduce"].overload,
                                          (node.args[0], list(node.args[1]), weights,
                                           [b for b in biases if b is not None], [b is not None for b in biases]),
                                          name="linears_grad_all_reduce")
                fused.meta = {k: v for k, v in node.meta.items() if k != M.COLLECTIVE}
                if M.COLLECTIVE in node.meta:
                    fused.meta[M.COLLECTIVE] = replace(node.meta[M.COLLECTIVE], kind="linears_grad_all_reduce")
                for i, u in enumerate(users):
                    item = graph.call_function(operator.getitem, (fused, i))
                    item.meta = dict(u.meta)
                    u.replace_all_uses_with(item)
            for u in users:
                graph.erase_node(u)
            graph.erase_node(node)
            fused_any = True
        if fused_any:  # an unchanged graph keeps the code it has
            gm.recompile()
        return gm


def _is_linear_of(user: torch.fx.Node, x: torch.fx.Node) -> bool:
    return (user.op == "call_function" and user.target is torch.ops.aten.linear.default and user.args[0] is x
            and x not in user.args[1:] and not user.kwargs)
