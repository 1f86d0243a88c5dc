"""Activation recomputation: regions whose activations backward recomputes instead of keeping.

A *region* is the set of call_function nodes carrying one :data:`autoshard.meta.RECOMPUTE` id. Three writers:

- the trace (:mod:`autoshard.frontend.trace`): every ``torch.utils.checkpoint.checkpoint(fn, ..., use_reentrant=False)``
  call of the model, id = the module path of its ops (``blocks.0``; ``#2`` for a module's second call);
- :class:`MarkRecompute` (plan phase, ``recompute="<glob>"``): every module instance whose path matches the glob
  (the outermost match of a node's module stack), id = its path (``model.layers.3``);
- the plan search under ``recompute="auto"``: the layers it picks, id = the layer's path. It prices a candidate
  with :func:`module_regions` (the candidates) and :func:`region_cost` (bytes saved with and without
  recomputation, the extra forward FLOPs and time).

:class:`Recompute` (rank phase, last: it sees the final local nodes, after the collective fusions) outlines each
region of the rank program into a child ``GraphModule`` and calls it through
:func:`autoshard.runtime.recompute.checkpoint` (``torch.utils.checkpoint.checkpoint``, ``use_reentrant=False``,
whole-region recomputation, dropout masks drawn again identical)::

    recompute_blocks_0 = self.recompute_blocks_0
    checkpoint = autoshard_runtime_recompute_checkpoint(recompute_blocks_0, add, blocks_0_ln1_weight, ...)
    getitem = checkpoint[0]

A region is made *convex* first: nodes the later passes inserted between its ops (collectives, local forms) that
lie on a path from one of its nodes to another join it — they run again in backward too, on every rank in the same
order (a region's collectives are part of it, so the rank programs still issue identical sequences, the child's
included: :func:`autoshard.passes.manager.collective_signature`). Nodes in the region's span that neither feed it
nor read it stay where they are; those that read it move after the call. A region that would contain an in-place
write (a buffer update such as BatchNorm's running statistics) is refused: recomputing it would apply the write twice.

Why the glob is marked in the plan phase, before ``plan_search`` and ``propagate``: the marks need only the traced
module paths, and the memory model (:func:`autoshard.cost_models.memory.activation_bytes`) must see fixed regions
when the search prices a plan under a memory limit.
"""

from __future__ import annotations

import fnmatch
import operator
import re
from dataclasses import dataclass

import torch
import torch.fx
from autoshard.cost_models.compute import compute_time, flops
from autoshard.cost_models.memory import activation_bytes

from autoshard import meta as M
from autoshard.compiler.context import Context
from autoshard.errors import PlanError
from autoshard.frontend.graph_utils import node_location, region_hull
from autoshard.runtime.recompute import checkpoint

__all__ = ["MarkRecompute", "Recompute", "RegionCost", "module_regions", "recompute_regions", "region_cost"]


# ---- regions -----------------------------------------------------------------------------------------------
def recompute_regions(gm: torch.fx.GraphModule) -> dict[str, list[torch.fx.Node]]:
    """{region id: its call_function nodes in graph order}, in the order regions first appear."""
    out: dict[str, list[torch.fx.Node]] = {}
    for n in gm.graph.nodes:
        region = n.meta.get(M.RECOMPUTE) if n.op == "call_function" else None
        if region is not None:
            out.setdefault(region, []).append(n)
    return out


def _stack_paths(node: torch.fx.Node) -> list[str]:
    """The module paths of a node's module stack, outermost first ('' for the model itself is left out)."""
    stack = node.meta.get("nn_module_stack") or {}
    return [p for p in (M.clean_path(v[0]) for v in stack.values()) if p]


def module_regions(gm: torch.fx.GraphModule, glob: str) -> dict[str, list[torch.fx.Node]]:
    """{module path: its call_function nodes} for every module instance whose path matches ``glob``
    (``fnmatch``; ``*`` also matches dots): a node belongs to the outermost matching module of its stack."""
    out: dict[str, list[torch.fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        path = next((p for p in _stack_paths(n) if fnmatch.fnmatchcase(p, glob)), None)
        if path is not None:
            out.setdefault(path, []).append(n)
    return out


@dataclass(frozen=True)
class RegionCost:
    """What recomputing one region changes on one rank: activation bytes kept for backward by the region and its
    inputs without (``saved``) and with recomputation (``saved_recomputed``: its inputs), the bytes its ops keep
    alive while its backward runs (``peak_extra``: the region's own activations, live again during recomputation),
    and the extra forward run in backward (``extra_flops``, ``extra_time`` in seconds when a profile is given)."""

    saved: int
    saved_recomputed: int
    peak_extra: int
    extra_flops: int
    extra_time: float = 0.0

    @property
    def saving(self) -> int:
        return self.saved - self.saved_recomputed


def region_cost(nodes: list[torch.fx.Node], local_numel=None, profile=None, shard_factor=None) -> RegionCost:
    """Price recomputing ``nodes`` as one region (whatever RECOMPUTE they carry now; other nodes keep theirs).

    ``local_numel(node) -> int | None``: elements of a node's output one rank holds (default: global sizes);
    ``profile`` (a :class:`HardwareProfile`) with ``shard_factor(node) -> float`` (default 1): the extra forward's
    roofline time."""
    members = set(nodes)

    def numel(n):
        return None if local_numel is None else local_numel(n)

    def as_region(n):
        return "candidate" if n in members else (n.meta.get(M.RECOMPUTE) if n.op == "call_function" else None)

    def without(n):
        return None if n in members else (n.meta.get(M.RECOMPUTE) if n.op == "call_function" else None)

    touched = list(dict.fromkeys([*nodes, *(x for n in nodes for x in n.all_input_nodes if x not in members)]))
    saved = sum(activation_bytes(n, numel(n), region_of=without) for n in touched)
    recomputed = sum(activation_bytes(n, numel(n), region_of=as_region) for n in touched)
    peak = sum(activation_bytes(n, numel(n), region_of=lambda _: None) for n in nodes)
    extra = sum(flops(n) for n in nodes)
    seconds = 0.0
    if profile is not None:
        seconds = sum(compute_time(n, profile, shard_factor(n) if shard_factor else 1) for n in nodes)
    return RegionCost(saved, recomputed, peak, extra, seconds)


# ---- plan phase: the recompute= glob -----------------------------------------------------------------------------
@dataclass(frozen=True)
class MarkRecompute:
    """``recompute="<glob>"``: mark the nodes of every module instance whose path matches as one region (id: the
    path). A module's own checkpoint region inside it becomes part of it."""

    glob: str
    name: str = "mark_recompute"
    phase: str = "plan"

    def run(self, gm: torch.fx.GraphModule, ctx: Context) -> torch.fx.GraphModule:
        regions = module_regions(gm, self.glob)
        if not regions:
            paths = list(dict.fromkeys(p for n in gm.graph.nodes if n.op == "call_function" for p in _stack_paths(n)))
            shown = ", ".join(repr(p) for p in paths[:8]) + (", ..." if len(paths) > 8 else "")
            raise PlanError(f"option recompute={self.glob!r} matches no module of the traced model; its module paths "
                            f"are {shown or 'none (the model has no submodules)'}. Give a glob over these paths, e.g. "
                            f"{_example_glob(paths)!r} (fnmatch: '*' also matches dots), or recompute=None.")
        for path, nodes in regions.items():
            for n in nodes:
                n.meta[M.RECOMPUTE] = path
        return gm


def _example_glob(paths: list[str]) -> str:
    for p in paths:
        m = re.match(r"^(.*?\.)\d+$", p)
        if m:
            return m.group(1) + "*"
    return paths[0] if paths else "layers.*"


# ---- rank phase: outline and checkpoint ----------------------------------------------------------------------
@dataclass(frozen=True)
class Recompute:
    """Each region of the rank program becomes a child module called through
    :func:`autoshard.runtime.recompute.checkpoint`: backward recomputes its activations instead of keeping them."""

    name: str = "recompute"
    phase: str = "rank"

    def run(self, gm: torch.fx.GraphModule, ctx: Context) -> torch.fx.GraphModule:
        regions = recompute_regions(gm)
        if not regions:
            return gm
        for region, nodes in regions.items():  # outlining one region leaves the others' nodes as they are
            _outline(gm, region, nodes)
        gm.graph.lint()
        gm.recompile()
        return gm


def _convex(gm: torch.fx.GraphModule, region: str, nodes: list[torch.fx.Node]) -> tuple[list, list, torch.fx.Node]:
    """The region's nodes closed under paths between them (and the getitems of its multi-output nodes), in graph
    order; the nodes of its span that read it without being in it (they move after the call); and its last node
    before the getitems joined (the call goes after it)."""
    everything = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(everything)}
    hull = region_hull(everything, nodes, order)  # (plan_cost prices the same nodes again: rerun_in_backward)
    span = everything[order[hull[0]]: order[hull[-1]] + 1]
    down = set(hull)
    for n in span:
        if any(x in down for x in n.all_input_nodes):
            down.add(n)
    last_node = hull[-1]
    inside = set(hull)
    for n in list(hull):
        for u in n.users:
            if u.op == "call_function" and u.target is operator.getitem and u not in inside:
                hull.append(u)
                inside.add(u)
                down.add(u)
    for n in hull:
        other = n.meta.get(M.RECOMPUTE)
        if n.op != "call_function":
            raise PlanError(f"recompute region '{region}' encloses {node_location(n)} ({n.op}), which cannot be "
                            "recomputed; exclude it from the region (recompute= glob or torch.utils.checkpoint).")
        if other is not None and other != region:
            raise PlanError(f"recompute regions '{region}' and '{other}' interleave at {node_location(n)}: one "
                            "region's ops lie between the other's. Recompute whole modules (recompute='layers.*' "
                            "marks each layer) or checkpoint them as one call.")
        schema = getattr(n.target, "_schema", None)
        if schema is not None and schema.is_mutable:
            raise PlanError(f"recompute region '{region}' contains the in-place write {node_location(n)}: recomputing "
                            "the region in backward would apply it twice (eager PyTorch applies it once). Leave this "
                            "module out of the recompute= glob or the torch.utils.checkpoint call (e.g. a BatchNorm "
                            "updating running statistics in training).")
    hull.sort(key=order.__getitem__)
    readers = [n for n in span if n in down and n not in inside]
    return hull, readers, last_node


def _outline(gm: torch.fx.GraphModule, region: str, nodes: list[torch.fx.Node]) -> None:
    graph = gm.graph
    body, readers, last = _convex(gm, region, nodes)
    inside = set(body)
    inputs = list(dict.fromkeys(x for n in body for x in n.all_input_nodes if x not in inside))
    outputs = [n for n in body if any(u not in inside for u in n.users)]

    sub = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for x in inputs:
        env[x] = sub.placeholder(x.name)
        env[x].meta = dict(x.meta)
    for n in body:
        env[n] = sub.node_copy(n, env.__getitem__)
    sub.output(tuple(env[n] for n in outputs))
    child = torch.fx.GraphModule(torch.nn.Module(), sub, class_name="Recompute")
    attr = _free_name(gm, "recompute_" + re.sub(r"\W", "_", region))
    gm.add_submodule(attr, child)

    with graph.inserting_after(last):
        fetch = graph.get_attr(attr)
    with graph.inserting_after(fetch):
        call = graph.call_function(checkpoint, (fetch, *inputs))
    call.meta["val"] = tuple(n.meta.get("val") for n in outputs)
    anchor = call
    for k, n in enumerate(outputs):
        with graph.inserting_after(anchor):
            item = graph.call_function(operator.getitem, (call, k))
        item.meta = {key: n.meta[key] for key in _KEPT_META if key in n.meta}
        n.replace_all_uses_with(item, delete_user_cb=lambda u: u not in inside)
        anchor = item
    for r in readers:  # readers inside the span (in graph order) run after the region
        anchor.append(r)
        anchor = r
    for n in reversed(body):
        graph.erase_node(n)


_KEPT_META = ("val", "tensor_meta", "nn_module_stack", "stack_trace", M.REQUIRES_GRAD)


def _free_name(gm: torch.nn.Module, base: str) -> str:
    name, k = base, 1
    while hasattr(gm, name):
        k += 1
        name = f"{base}_{k}"
    return name
