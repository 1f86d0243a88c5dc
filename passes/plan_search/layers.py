"""Repeated layers in the plan search: which nodes share decision variables, and which copies may be recomputed.

* :func:`find_layers` ties the interior copies of a repeated layer (``blocks.1`` … ``blocks.{n-2}``) to the
  second copy, node by node: the program then has one set of variables per layer however deep the model is
  (:func:`autoshard.frontend.layer_reuse.find_groups` says which layers repeat; the first and last copies, which meet
  the prologue and epilogue, stay free). Copies are tied only when their node sequences match
  (:func:`_signature`: ops, shapes, argument structure, parameter names up to the layer index, annotations, and
  whether a recomputation region marked before the search holds them).
* :func:`recompute_units` groups the copies into :class:`Unit` s for ``recompute="auto"``: the tied interior
  copies form one unit (a share of whose copies may be recomputed), every other copy one unit of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from autoshard import meta as M
from autoshard.frontend.graph_utils import is_getitem


def find_layers(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, torch.fx.Node]:
    """Map every node of an interior copy of a repeated layer to the same node of the first interior copy.

    Which layers repeat is decided by :func:`autoshard.frontend.layer_reuse.find_groups` on the graph module (the
    detector the trace uses on the model); a layer is the set of nodes whose module path (get_attr: target) lies under
    ``prefix.<i>``. Copies are tied only if their node sequences have the same ops, shapes, argument structure,
    parameter names up to the layer index and annotations.
    """
    canon: dict[torch.fx.Node, torch.fx.Node] = {}
    for g, members in layer_copies(gm):
        # The first and last copies meet the prologue and epilogue and may want other layouts: they stay free;
        # the interior copies share the variables of the second copy.
        indices = [i for i in (g.first, *g.copies) if i in members][1:-1]
        if len(indices) < 2:
            continue
        first = members[indices[0]]
        sig0 = _signature(first, g.prefix, indices[0])
        for i in indices[1:]:
            if len(members[i]) == len(first) and _signature(members[i], g.prefix, i) == sig0:
                for a, b in zip(members[i], first):
                    canon[a] = b
    return canon


def layer_copies(gm: torch.fx.GraphModule) -> list[tuple]:
    """``[(group, {index: the copy's call_function and get_attr nodes in graph order})]`` for every group of
    repeated layers of :func:`autoshard.frontend.layer_reuse.find_groups`."""
    from autoshard.frontend.layer_reuse import find_groups
    from autoshard.meta import module_path

    groups = find_groups(gm, leaves=True)
    if not groups:
        return []
    owner: dict[str, tuple[int, str]] = {}  # "prefix.i" -> (group number, i)
    for gi, g in enumerate(groups):
        for i in (g.first, *g.copies):
            owner[f"{g.prefix}.{i}" if g.prefix else i] = (gi, i)
    copies: list[dict[str, list[torch.fx.Node]]] = [{} for _ in groups]
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "get_attr"):
            continue
        path = module_path(node) if node.op != "get_attr" else str(node.target)
        parts = path.split(".") if path else []
        for k in range(1, len(parts) + 1):  # the outermost layer the path lies in
            hit = owner.get(".".join(parts[:k]))
            if hit is not None:
                copies[hit[0]].setdefault(hit[1], []).append(node)
                break
    return list(zip(groups, copies))


def _signature(nodes: list[torch.fx.Node], prefix: str, index: int) -> tuple:
    pos = {n: k for k, n in enumerate(nodes)}
    own = f"{prefix}.{index}." if prefix else f"{index}."

    def arg(a):
        if isinstance(a, torch.fx.Node):
            return ("local", pos[a]) if a in pos else ("outside", _shape_or_none(a))
        if isinstance(a, (list, tuple)):
            return tuple(arg(b) for b in a)
        return repr(a)

    sig = []
    for n in nodes:
        target = str(n.target).replace(own, "") if n.op == "get_attr" else str(n.target)
        annotated = (M.ANNOTATED in n.meta, n.meta.get(M.SPEC)) if n.op == "get_attr" else None
        # a copy recomputed (a recompute= glob or checkpoint marked it) keeps other activations than one that is not
        recomputed = n.meta.get(M.RECOMPUTE) is not None
        sig.append((n.op, target, _shape_or_none(n), arg(n.args),
                    tuple(sorted((k, arg(v)) for k, v in n.kwargs.items())), annotated, recomputed))
    return tuple(sig)


def _shape_or_none(n: torch.fx.Node):
    v = n.meta.get("val")
    return (tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor) else None


@dataclass
class Unit:
    """Copies of one layer that are recomputed alike (the interior copies of a tied layer, or one copy): each
    copy's module path (its own region id) and call_function nodes."""

    copies: dict[str, list[torch.fx.Node]] = field(default_factory=dict)


@dataclass(frozen=True)
class LayerUnits:
    """What :func:`recompute_units` finds: the units, ``{canonical call_function node: unit index}``,
    ``{get_attr node: its layer copy's path}`` (what ZeRO-3 gathers at once) and ``{canonical node: the nodes of
    its own copy}``."""

    units: list[Unit] = field(default_factory=list)
    unit_of: dict = field(default_factory=dict)
    layer_of: dict = field(default_factory=dict)
    copy_of: dict = field(default_factory=dict)


def copy_paths(units: list[Unit]) -> dict:
    """{call_function node: the module path of its unit's copy} (its recomputation region when recomputed)."""
    return {x: path for unit in units for path, nodes in unit.copies.items() for x in nodes}


def recompute_units(gm: torch.fx.GraphModule, canon: dict) -> LayerUnits:
    """Recomputation units of the repeated layers: the interior copies tied by ``canon`` form one unit, every other
    copy one each."""
    found = LayerUnits()
    targets = set(canon.values())
    for g, members in layer_copies(gm):
        tied: Unit | None = None
        for i, nodes in members.items():
            path = f"{g.prefix}.{i}" if g.prefix else i
            found.layer_of.update({n: path for n in nodes if n.op == "get_attr"})
            ops = [n for n in nodes if n.op == "call_function"]
            if not ops:
                continue
            if ops[0] in canon or ops[0] in targets:
                if tied is None:
                    tied = Unit()
                    found.units.append(tied)
                unit = tied
            else:
                unit = Unit()
                found.units.append(unit)
            unit.copies[path] = ops
            copy = frozenset(ops)
            number = next(k for k, x in enumerate(found.units) if x is unit)
            for n in ops:
                if canon.get(n, n) is n:
                    found.unit_of[n] = number
                    found.copy_of[n] = copy
    return found


def leaves_unit(n: torch.fx.Node, inside: frozenset) -> bool:
    """Some user of ``n`` (through getitems) lies outside ``inside`` (``n``'s own layer copy): ``n`` is an output
    of it, which the next layer (or the epilogue) keeps whether or not this one is recomputed."""
    for u in n.users:
        if is_getitem(u):
            if leaves_unit(u, inside):
                return True
        elif u not in inside:
            return True
    return False
