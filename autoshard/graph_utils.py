"""Small helpers over FX nodes shared by the passes: tensor inputs in flat order, shapes, dtypes, and where a node
comes from in the user's model (:func:`node_location`, for error messages)."""

from __future__ import annotations

import operator

import torch
import torch.fx

from autoshard import meta as M


def is_tensor_node(x) -> bool:
    return isinstance(x, torch.fx.Node) and isinstance(x.meta.get("val"), torch.Tensor)


def tensor_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The node's tensor-valued inputs, flattened from args then kwargs (the order rules index).

    The order is ``pytree.tree_flatten((node.args, node.kwargs))``'s (lists and tuples in order, dicts by
    insertion), walked directly: this runs for every node in every pass, and pytree's generic walk was the plan
    search's largest single cost after the solver."""
    leaves: list = []
    _node_leaves(node.args, leaves)
    _node_leaves(node.kwargs, leaves)
    return [x for x in leaves if is_tensor_node(x)]


def _node_leaves(a, out: list) -> None:
    if isinstance(a, torch.fx.Node):
        out.append(a)
    elif isinstance(a, (list, tuple)):
        for b in a:
            _node_leaves(b, out)
    elif isinstance(a, dict):
        for b in a.values():
            _node_leaves(b, out)


def out_vals(node: torch.fx.Node) -> list[torch.Tensor]:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [v for v in val if isinstance(v, torch.Tensor)]
    return []


def shape(node: torch.fx.Node) -> tuple[int, ...]:
    return tuple(int(s) for s in node.meta["val"].shape)


def itemsize(node: torch.fx.Node) -> int:
    return node.meta["val"].element_size()


def is_getitem(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def node_location(node: torch.fx.Node) -> str:
    """'node `name` (op) in module `path`, at file:line' for error messages."""
    parts = [f"node `{node.name}` ({node.target})" if node.op == "call_function" else f"node `{node.name}`"]
    path = M.module_path(node)
    if path:
        parts.append(f"in module `{path}`")
    trace = node.meta.get("stack_trace")
    if trace:
        lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip().startswith("File ")]
        if lines:
            parts.append(f"at {lines[-1]}")
    return " ".join(parts)
