"""Helpers the ``localize`` facets share: reading a node's plan, replacing a node by a local kernel's call.

A localizer (:data:`autoshard.compiler.ops.registry.Localizer`) gets the rank-local graph being built, the copied node
``new`` (its args already point into that graph) and the global node ``old`` (its meta holds the plan: the output
spec, the chosen strategy, the global ``val``), and returns the node that stands for ``old`` on this rank.
"""

from __future__ import annotations

import operator

import torch.fx

from autoshard import meta as M
from autoshard.mesh import Mesh
from autoshard.placements import Partial, Spec


def out_spec(old: torch.fx.Node) -> Spec:
    return old.meta[M.SPEC]


def input_spec(old: torch.fx.Node, i: int = 0) -> Spec:
    return old.meta[M.STRATEGY].input_specs[i]


def partial_axes(spec: Spec, mesh: Mesh) -> list[int]:
    return [a for a, p in enumerate(spec) if isinstance(p, Partial)]


def arg(node: torch.fx.Node, i: int, name: str, default=None):
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def replace_node(graph: torch.fx.Graph, new: torch.fx.Node, fn, args) -> torch.fx.Node:
    """Replace ``new`` by ``fn(*args)``."""
    with graph.inserting_before(new):
        repl = graph.call_function(fn, tuple(args))
    repl.meta.update(new.meta)
    new.replace_all_uses_with(repl)
    graph.erase_node(new)
    return repl


def replace_first(graph: torch.fx.Graph, new: torch.fx.Node, op, args) -> torch.fx.Node:
    """Replace ``new`` by element 0 of ``op(*args)`` (an op that also returns what its backward needs)."""
    with graph.inserting_before(new):
        call = graph.create_node("call_function", op, tuple(args), name=op.__name__.split(".")[0])
        first = graph.call_function(operator.getitem, (call, 0))
    first.meta.update(new.meta)
    new.replace_all_uses_with(first)
    graph.erase_node(new)
    return first


def scale_by(graph: torch.fx.Graph, new: torch.fx.Node, ratio: float) -> torch.fx.Node:
    """``new * ratio`` after ``new`` (a local mean rescaled to the global count); ``new`` itself when 1."""
    if ratio == 1:
        return new
    with graph.inserting_after(new):
        return graph.call_function(torch.ops.aten.mul.Tensor, (new, ratio))
