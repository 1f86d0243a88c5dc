"""Collective insertion: make every redistribution an explicit graph node.

For each op input whose producer's spec differs from the spec the op's strategy needs, the steps of
:func:`autoshard.compiler.redistribute.steps_between` become ``call_function`` nodes calling the collective operators of
the table in :mod:`autoshard.compiler.collective_kinds` (``torch.ops.autoshard.*``, each with an autograd formula that
is its conjugate). Then every replicated input that feeds sharded or partial work (``Strategy.grad_sync``) and requires
grad goes through ``grad_all_reduce`` — identity forward, all-reduce backward (Megatron's *f*), which is also how
data-parallel gradient all-reduce of parameters arises.

Inserted nodes are shared: one redistribution per (tensor, target spec) and one ``grad_all_reduce`` per
(tensor, axes), so q/k/v projections reading the same activation cost one backward all-reduce, not three.

Entry point: :class:`InsertCollectives`. Nodes inserted carry ``meta[autoshard.collective]`` (a
:class:`~autoshard.meta.CollectiveInfo`), ``meta["val"]`` (the global value, unchanged) and their output spec.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx
from torch.utils import _pytree as pytree

from autoshard import meta as M
from autoshard.compiler import redistribute
from autoshard.compiler.context import Context
from autoshard.errors import PlanError
from autoshard.frontend.graph_utils import is_tensor_node, itemsize, node_location, shape
from autoshard.placements import format_spec
from autoshard.compiler.collective_kinds import emit
from autoshard.passes.propagate import written_inputs


@dataclass(frozen=True)
class InsertCollectives:
    name: str = "insert_collectives"

    def run(self, gm: torch.fx.GraphModule, ctx: Context) -> torch.fx.GraphModule:
        graph = gm.graph
        redistributed: dict[tuple, torch.fx.Node] = {}
        synced: dict[tuple, torch.fx.Node] = {}
        count = {"redistributions": 0, "grad_all_reduce": 0}
        for node in list(graph.nodes):
            strat = node.meta.get(M.STRATEGY)
            if strat is None:
                continue
            written = [x for x in written_inputs(node) if x.op == "get_attr"]  # buffers written in place
            leaves, spec = pytree.tree_flatten((node.args, node.kwargs))
            k = 0
            new_leaves = []
            for leaf in leaves:
                if not is_tensor_node(leaf):
                    new_leaves.append(leaf)
                    continue
                want, sync = strat.input_specs[k], strat.grad_sync[k] if strat.grad_sync else ()
                k += 1
                value = leaf
                have = leaf.meta[M.SPEC]
                if have != want and leaf in written:
                    raise PlanError(
                        f"{node_location(node)} writes `{leaf.name}` in place, stored as {format_spec(have)}, but "
                        f"its strategy reads it as {format_spec(want)}: the write would land in a redistributed "
                        "copy and the stored tensor keep its old value. This is a planner bug; annotate the "
                        f"tensor (plan={{'{leaf.target}': ...}}) in the layout the op reads it in meanwhile.")
                if have != want:
                    key = (leaf, want)
                    if key not in redistributed:
                        with graph.inserting_before(node):
                            redistributed[key] = self._redistribute(graph, leaf, have, want, ctx, node)
                        count["redistributions"] += 1
                    value = redistributed[key]
                if sync and leaf.meta.get(M.REQUIRES_GRAD):
                    key = (value, tuple(sync))
                    if key not in synced:
                        with graph.inserting_before(node):
                            synced[key] = self._grad_sync(graph, value, tuple(sync), ctx)
                        count["grad_all_reduce"] += 1
                    value = synced[key]
                new_leaves.append(value)
            args, kwargs = pytree.tree_unflatten(new_leaves, spec)
            node.args, node.kwargs = tuple(args), dict(kwargs)
        graph.lint()
        gm.recompile()
        M.plan_report(gm)[self.name] = count
        return gm

    def _redistribute(self, graph, x, have, want, ctx: Context, consumer) -> torch.fx.Node:
        mesh = ctx.mesh
        steps = redistribute.steps_between(have, want, mesh)
        if steps is None:
            raise PlanError(f"{node_location(consumer)} needs input `{x.name}` as {format_spec(want)}, but it is "
                            f"{format_spec(have)} and no collective turns one into the other.")
        cur = x
        rg = bool(x.meta.get(M.REQUIRES_GRAD))
        for step in steps:
            fwd, bwd = redistribute.step_bytes(step, shape(x), itemsize(x), mesh, rg)
            new = emit(graph, step.kind, cur, step.axis, step.dims, mesh)
            new.meta.update({"val": x.meta["val"], M.SPEC: step.after, M.REQUIRES_GRAD: rg,
                             M.COLLECTIVE: M.CollectiveInfo(step.kind, (step.axis,), step.dims, step.before,
                                                            step.after, int(fwd), int(bwd))})
            if "nn_module_stack" in consumer.meta:
                new.meta["nn_module_stack"] = consumer.meta["nn_module_stack"]
            cur = new
        return cur

    def _grad_sync(self, graph, x, axes, ctx: Context) -> torch.fx.Node:
        spec = x.meta[M.SPEC]
        nbytes = redistribute.grad_sync_bytes(spec, axes, shape(x), itemsize(x), ctx.mesh)
        new = emit(graph, "grad_all_reduce", x, axes, (), ctx.mesh)
        new.meta.update({"val": x.meta["val"], M.SPEC: spec, M.REQUIRES_GRAD: True,
                         M.COLLECTIVE: M.CollectiveInfo("grad_all_reduce", axes, (), spec, spec, 0, int(nbytes))})
        return new
