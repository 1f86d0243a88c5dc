"""Group a layer's ZeRO-3 parameter gathers into one collective, as FSDP2 gathers one ``fully_shard`` unit at once.

After ``fuse_gather_grad_sync`` every parameter stored at ZeRO stage 3 reaches its users through its own
``all_gather_reshard`` node, placed before its first use: one all-gather forward, one re-gather and one
reduce-scatter backward per parameter — 16 of each per GPT block, each paying the collective's latency (on gloo
every call is a rendezvous of all ranks). This pass replaces the gathers of one *layer* that share an axis, an axis
size and a set of axes to sum the gradient over by one ``all_gather_reshard_group`` node
(:func:`autoshard.runtime.zero.gather_group`): the shards are concatenated into one flat buffer, gathered with one
all-gather per dtype and copied out into one tensor per parameter; backward gathers the whole group again at its
first use (:class:`autoshard.runtime.zero._GatheredGroup`) and reduce-scatters the concatenated gradients at once
(:func:`autoshard.runtime.zero.reduce_group`). Values and gradients are those of the separate gathers: the same
elements summed over the same ranks.

A parameter's *layer* is its name up to and including the first all-digit component (``blocks.3.attn.q.weight`` →
``blocks.3``, ``model.layers.0.mlp.up_proj.weight`` → ``model.layers.0``); parameters with none (embeddings, final
norm, head) form the root group, as FSDP2's root unit. The group's node is placed before the first of its gathers
(a parameter read later is read there instead: its ``get_attr`` moves up), so a layer's parameters are all gathered
when the layer starts, and each gathered copy is released after its last use. Only gathers of the top-level graph
are grouped (a recomputed region's, outlined by ``recompute``, stay as they are); groups of one gather are left
alone. Runs last in the rank phase; does nothing without ZeRO-3 parameters.

Prefetch (:func:`_prefetch_next`): each group node also gets the shards of the next group in graph order (its last
argument). Once its own all-gather is done, the runtime starts that group's all-gather asynchronously
(:meth:`~autoshard.runtime.communicator.Communicator.all_gather_async`) and the next group's op waits on it, so the
transfer overlaps the layer's compute; in backward, a group gathered again starts the gather of the group that
prefetched it in forward (the layer backward needs next). A layer's parameters are then held one layer earlier, as
FSDP2's prefetching holds them. Every rank runs the same program, so every rank starts the same collectives in the
same order.

Before (rank 0 of a GPT on ``Mesh(data=2)``, ``zero=3``)::

    all_gather_reshard_1 = torch.ops.autoshard.all_gather_reshard.default(blocks_0_ln1_weight, 'data', 0, 2, ['data'])
    all_gather_reshard_2 = torch.ops.autoshard.all_gather_reshard.default(blocks_0_ln1_bias, 'data', 0, 2, ['data'])
    layer_norm = torch.ops.aten.layer_norm.default(add, [64], all_gather_reshard_1, all_gather_reshard_2, 1e-05, False)
    all_gather_reshard_3 = torch.ops.autoshard.all_gather_reshard.default(blocks_0_attn_q_weight, 'data', 0, 2,
        ['data'])

After::

    all_gather_reshard_group_1 = torch.ops.autoshard.all_gather_reshard_group.default([blocks_0_ln1_weight,
        blocks_0_ln1_bias, blocks_0_attn_q_weight, ...], 'data', [0, 0, 0, ...], 2, ['data'], [blocks_1_ln1_weight,
        blocks_1_ln1_bias, ...])
    getitem_3 = all_gather_reshard_group_1[0]
    getitem_4 = all_gather_reshard_group_1[1]
    ...
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass

import torch
import torch.fx

from autoshard import meta as M
from autoshard.compiler.context import Context

__all__ = ["GroupGathers", "layer_of"]


def layer_of(name: str) -> str:
    """The layer a parameter belongs to: its name up to the first all-digit component ('' for none: the root)."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ""


def _param_name(node: torch.fx.Node) -> str | None:
    """The parameter a gather's input comes from, through precision casts (as ``stage_of`` follows them)."""
    seen = 0
    while isinstance(node, torch.fx.Node) and seen < 8:
        if node.op == "get_attr":
            return node.meta.get(M.PARAM, str(node.target))
        if node.op != "call_function" or not node.args:
            return None
        node = node.args[0]
        seen += 1
    return None


def _hoist(x: torch.fx.Node, before: torch.fx.Node, order: dict) -> bool:
    """Make ``x`` available before ``before``: nothing to do if it already is; a ``get_attr``, or a node whose inputs
    are all ``get_attr`` or already available (a precision cast of the parameter), moves up. False where it can't."""
    if order[x] < order[before]:
        return True
    if x.op == "get_attr":
        before.prepend(x)
        return True
    if x.op != "call_function" or x.kwargs and any(isinstance(v, torch.fx.Node) for v in x.kwargs.values()):
        return False
    inputs = x.all_input_nodes
    if not all(i.op == "get_attr" or order[i] < order[before] for i in inputs):
        return False
    for i in inputs:
        if order[i] > order[before]:
            before.prepend(i)
    before.prepend(x)
    return True


def _prefetch_next(graph: torch.fx.Graph, groups: list[torch.fx.Node]) -> None:
    """Give each group node the shards of the next group on the same axis (in graph order) to start gathering
    once its own gather is done; their ``get_attr`` nodes move up before it."""
    groups = sorted(groups, key=list(graph.nodes).index)
    for node, nxt in itertools.pairwise(groups):
        if nxt.args[1] != node.args[1] or nxt.args[3] != node.args[3]:
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}
        shards = list(nxt.args[0])
        if all(x.op == "get_attr" or order[x] < order[node] for x in shards):
            for x in shards:
                _hoist(x, node, order)
            node.args = (*node.args[:5], shards)


@dataclass(frozen=True)
class GroupGathers:
    name: str = "group_gathers"
    phase: str = "rank"

    def run(self, gm: torch.fx.GraphModule, ctx: Context) -> torch.fx.GraphModule:
        graph = gm.graph
        single = torch.ops.autoshard.all_gather_reshard.default
        groups: dict[tuple, list[torch.fx.Node]] = {}
        for node in graph.nodes:
            if node.op != "call_function" or node.target is not single:
                continue
            x, axis, _, size, axes = node.args
            name = _param_name(x)
            if name is None:
                continue
            groups.setdefault((layer_of(name), axis, size, tuple(axes)), []).append(node)
        made: list[torch.fx.Node] = []
        for (_, axis, size, axes), members in groups.items():
            if len(members) < 2:
                continue
            order = {n: i for i, n in enumerate(graph.nodes)}
            first = members[0]
            grouped = [m for m in members if _hoist(m.args[0], first, order)]
            if len(grouped) < 2:
                continue
            with graph.inserting_before(first):
                node = graph.create_node("call_function", torch.ops.autoshard.all_gather_reshard_group.default,
                                         ([m.args[0] for m in grouped], axis, [m.args[2] for m in grouped], size,
                                          list(axes), []), name="all_gather_reshard_group")
                for i, m in enumerate(grouped):
                    item = graph.call_function(operator.getitem, (node, i))
                    item.meta = {k: v for k, v in m.meta.items() if k != M.COLLECTIVE}
                    m.replace_all_uses_with(item)
            for m in grouped:
                graph.erase_node(m)
            made.append(node)
        _prefetch_next(graph, made)
        if made:
            graph.lint()
            gm.recompile()
            gm.meta.pop(M.RESHARDS, None)
        return gm
