"""Small helpers over FX nodes shared by the passes: tensor inputs in flat order, shapes, dtypes, where a node
comes from in the user's model (:func:`node_location`, for error messages), the tensor at a get_attr target
(:func:`fetch_attr`), and :class:`NodeBuilder` for rewrites that add nodes with fake values."""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch.utils import _pytree as pytree

from autoshard import meta as M


def is_tensor_node(x) -> bool:
    return isinstance(x, torch.fx.Node) and isinstance(x.meta.get("val"), torch.Tensor)


def node_leaves(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Every Node among ``node``'s arguments, flattened from args then kwargs in :func:`tensor_inputs`' order
    (``pytree.tree_leaves((node.args, node.kwargs))``'s Nodes), repeats included."""
    leaves: list = []
    _node_leaves(node.args, leaves)
    _node_leaves(node.kwargs, leaves)
    return leaves


def tensor_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The node's tensor-valued inputs, flattened from args then kwargs (the order rules index).

    The order is ``pytree.tree_flatten((node.args, node.kwargs))``'s (lists and tuples in order, dicts by
    insertion), walked directly: this runs for every node in every pass, and pytree's generic walk was the plan
    search's largest single cost after the solver."""
    return [x for x in node_leaves(node) if is_tensor_node(x)]


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


def fetch_attr(gm: torch.nn.Module, target: str):
    """The parameter/buffer/constant at a get_attr target (``blocks.0.attn.q.weight``)."""
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


class NodeBuilder:
    """Adds nodes before an anchor, each with a FakeTensor ``val`` computed in ``fake_mode`` and the module stack
    and source line of the code it replaces (the MoE rewrites build their subgraphs with it)."""

    def __init__(self, gm, anchor, fake_mode, stack, trace):
        self.gm, self.graph, self.anchor, self.fake_mode = gm, gm.graph, anchor, fake_mode
        self.stack, self.trace = stack, trace

    def _meta(self, node, val):
        node.meta["val"] = val
        if self.stack is not None:
            node.meta["nn_module_stack"] = dict(self.stack)
        if self.trace:
            node.meta["stack_trace"] = self.trace
        return node

    def call(self, target, *args, **kwargs):
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(target, args, kwargs)
        fa, fk = pytree.tree_map(lambda a: a.meta["val"] if isinstance(a, torch.fx.Node) else a, (args, kwargs))
        with self.fake_mode:
            val = target(*fa, **fk)
        return self._meta(node, val)

    def items(self, node, count):
        out = []
        for i in range(count):
            with self.graph.inserting_before(self.anchor):
                item = self.graph.call_function(operator.getitem, (node, i))
            out.append(self._meta(item, node.meta["val"][i]))
        return out

    def copy(self, old, env, src=lambda a: a):
        with self.graph.inserting_before(self.anchor):
            node = self.graph.node_copy(old, lambda a: env[src(a)])
        fa, fk = pytree.tree_map(lambda a: a.meta["val"] if isinstance(a, torch.fx.Node) else a,
                                 (node.args, node.kwargs))
        with self.fake_mode:
            val = old.target(*fa, **fk)
        keep = {k: v for k, v in old.meta.items() if k in ("nn_module_stack", "stack_trace")}
        node.meta = keep
        node.meta["val"] = val
        return node

    def param(self, fqn: str, value: torch.Tensor):
        set_param(self.gm, fqn, torch.nn.Parameter(value, requires_grad=True))
        with self.graph.inserting_before(self.anchor):
            node = self.graph.get_attr(fqn)
        node.meta["val"] = self.fake_mode.from_tensor(fetch_attr(self.gm, fqn), static_shapes=True)
        node.meta[M.PARAM] = fqn
        node.meta[M.ALIASES] = (fqn,)
        return node


def set_param(gm: torch.nn.Module, fqn: str, param: torch.nn.Parameter) -> None:
    """Register ``param`` at ``fqn`` on ``gm``, adding empty modules for missing parents."""
    *parents, leaf = fqn.split(".")
    mod = gm
    for part in parents:
        if not hasattr(mod, part):
            mod.add_module(part, torch.nn.Module())
        mod = getattr(mod, part)
    mod.register_parameter(leaf, param)


def region_hull(nodes: list[torch.fx.Node], members, index: dict | None = None) -> list[torch.fx.Node]:
    """The convex closure of one recomputation region: the nodes of ``nodes`` (a graph's nodes in order; ``index``:
    {node: its position}, when the caller has it) that lie on a path from one of ``members`` to another,
    ``members`` included, in graph order. What ``passes/recompute.py`` outlines into the region's checkpoint call:
    backward runs every one of them again, the collectives inserted between the region's ops included."""
    members = set(members)
    index = index if index is not None else {n: i for i, n in enumerate(nodes)}
    span = nodes[min(index[n] for n in members): max(index[n] for n in members) + 1]
    down: set = set()
    for n in span:
        if n in members or any(x in down for x in n.all_input_nodes):
            down.add(n)
    up: set = set()
    for n in reversed(span):
        if n in members or any(u in up for u in n.users):
            up.add(n)
    return [n for n in span if n in down and n in up]


def rerun_in_backward(graph: torch.fx.Graph, regions: dict | None = None) -> dict[torch.fx.Node, str]:
    """{node: region id} of every node backward runs again: each recomputation region's (:data:`autoshard.meta.
    RECOMPUTE`; ``regions``: {id: its nodes} instead) :func:`region_hull` and the getitems of the multi-output
    nodes in it (a node in two hulls keeps the first)."""
    nodes = list(graph.nodes)
    if regions is None:
        regions = {}
        for n in nodes:
            region = n.meta.get(M.RECOMPUTE) if n.op == "call_function" else None
            if region is not None:
                regions.setdefault(region, []).append(n)
    out: dict[torch.fx.Node, str] = {}
    index = {n: i for i, n in enumerate(nodes)}
    for region, members in regions.items():
        for n in region_hull(nodes, members, index):
            out.setdefault(n, region)
            for u in n.users:
                if is_getitem(u):
                    out.setdefault(u, region)
    return out


def verify_traced(gm: torch.fx.GraphModule, step: str) -> torch.fx.GraphModule:
    """The frontend's invariants for the graph ``step`` (``trace``, ``layer_reuse``, ``precision``) left, as the
    pass manager's verifier checks each pass (the passes rely on them): the graph lints; every placeholder,
    get_attr and call_function node carries ``meta["val"]`` (its FakeTensor, or what it returns); every get_attr names
    a tensor (or, for a higher-order op's body, a submodule) of the module. Returns ``gm``; a broken graph is an
    :class:`~autoshard.errors.AutoshardError` naming the step and the node (a bug in autoshard's frontend, not the
    model's)."""
    from autoshard.errors import AutoshardError

    try:
        gm.graph.lint()
    except Exception as e:  # lint raises RuntimeError and others: all mean a malformed graph
        raise AutoshardError(f"frontend step '{step}' left a malformed graph: {e}") from e
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "call_function") and "val" not in node.meta:
            raise AutoshardError(f"frontend step '{step}' left node `{node.name}` ({node.target}) without "
                                 "meta['val']: every traced value carries its FakeTensor.")
        if node.op == "get_attr":
            owner, _, leaf = str(node.target).rpartition(".")
            try:
                value = getattr(gm.get_submodule(owner), leaf)
            except AttributeError:
                value = None
            if not isinstance(value, (torch.Tensor, torch.nn.Module)):  # a module: a higher-order op's body
                raise AutoshardError(f"frontend step '{step}' left node `{node.name}` reading `{node.target}`, "
                                     "which is neither a tensor nor a submodule of the traced module.")
    return gm
