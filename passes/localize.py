"""Localisation: the pass that turns the annotated global program into rank ``r``'s program.

The global graph (after propagation and collective insertion) says, for every node, its global shape and its
spec. Localising it for rank ``r`` means:

* shapes written into the code (``view``/``reshape``/``expand`` targets) become the local shapes of their outputs;
* ops whose local form differs from their global one are rewritten by the op's local form (the ``localize``
  facet of its entry in the op registry, :mod:`autoshard.compiler.ops`): a mean over a sharded dim divides by the
  *global* count; a bias added to a Partial output is added once; a mean cross-entropy over a sharded batch divides by
  the global count of targets; dropout draws one global mask;
* every ``get_attr`` holds rank ``r``'s shard of the original weight, copied (no full copy is kept).

The result keeps the original calling convention (the exported pytree in/out specs) and prints as readable Python
(``Plan.code(rank)``); the same plan always gives byte-identical code. Collectives stay the operators the
collective pass emitted (``torch.ops.autoshard.*``); local kernels are :mod:`autoshard.runtime.ops`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from autoshard import meta as M
from autoshard.compiler.context import Context
from autoshard.mesh import Mesh
from autoshard.compiler.ops import entry
from autoshard.placements import Spec, shard_tensor
from autoshard.frontend.trace import fetch_attr


@dataclass(frozen=True)
class Localize:
    """Rank ``ctx.rank``'s GraphModule from the global program: local shapes, local forms, local weights (this
    rank's slices of ``ctx.weights``, default the graph module itself; or, with ``ctx.local_weights``, that rank
    program's own tensors, shared — another program of the same rank, e.g. its eval-mode one). Graph-level
    metadata (``gm.meta``) is carried over."""

    name: str = "localize"
    phase: str = "rank"

    def run(self, gm: torch.fx.GraphModule, ctx: Context) -> torch.fx.GraphModule:
        mesh, rank = ctx.mesh, ctx.rank
        weights = gm if ctx.weights is None else ctx.weights
        graph = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        attrs: dict[str, torch.Tensor] = {}
        for old in gm.graph.nodes:
            new = graph.node_copy(old, lambda n: env[n])
            new.meta = {k: v for k, v in old.meta.items() if k != "val"}
            if old.op == "get_attr" and ctx.local_weights is not None:
                attrs[old.target] = fetch_attr(ctx.local_weights, old.target)
            elif old.op == "get_attr":
                attrs[old.target] = _local_attr(fetch_attr(weights, old.target), old.meta.get(M.SPEC), mesh, rank)
            elif old.op == "call_function" and (localize := entry(old.target).localize) is not None:
                new = localize(graph, new, old, mesh, rank)
            env[old] = new
        graph._codegen = gm.graph._codegen  # the pytree calling convention; never mutated
        out = torch.fx.GraphModule(attrs, graph, class_name=f"Rank{rank}Module")
        for name in ("_in_spec", "_out_spec"):
            if hasattr(gm, name):
                setattr(out, name, getattr(gm, name))
        out.meta.update(gm.meta)
        return out


def _local_attr(full, spec: Spec | None, mesh: Mesh, rank: int):
    if not isinstance(full, torch.Tensor):
        return full
    local = full.detach() if spec is None else shard_tensor(full.detach(), spec, mesh, rank)
    if isinstance(full, torch.nn.Parameter):
        return torch.nn.Parameter(local.clone(), requires_grad=full.requires_grad)
    return local.clone()



