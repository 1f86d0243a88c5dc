"""Sharding propagation: give every tensor node a spec and every op a strategy.

Inputs to the pass: user annotations on parameters (globs over FQNs) and inputs, plus the default that the
batch dim (dim 0) of every input is sharded on the data axis. Parameters without annotation are *free*: the
first op that consumes one fixes its layout to whatever that op's chosen strategy wants.

The walk is greedy in topological order: for each op, every strategy the rule table allows
(:func:`autoshard.strategies.strategies_for`) is priced by the communication bytes it causes — redistributing
each input from its current spec to the spec the strategy needs (forward and backward,
:mod:`autoshard.redistribute`), plus the backward all-reduce of replicated inputs feeding sharded work — and the
cheapest wins (ties: rule order, which lists the all-replicated strategy first, so nothing is sharded
without a reason). The backward all-reduce of *parameters* (data-parallel gradient sync) is not priced here: it
is the price of data parallelism itself, and trading it against activation traffic op by op would undo the
batch sharding the user asked for. The exact search of the cost models prices everything together.
Annotated parameters are hard constraints (:func:`pinned_values`, shared with the plan search): a strategy that
needs an annotated parameter in another layout is not a candidate, and neither is one that gathers (all-gather,
all-to-all) a value computed only from annotated parameters (its transpose, say) — either would undo the memory
and compute split the annotation asked for. When no strategy is left, :class:`~autoshard.errors.PlanError` names
the parameter and the op. A free parameter already laid out by an earlier consumer (a tied weight) may still be
redistributed, as a last resort. The chosen :class:`~autoshard.meta.Strategy` and a
:class:`~autoshard.meta.Decision` (with the best rejected alternative) go into ``node.meta``.

A strategy decided before this pass — by the exact search (``passes/plan_search.py``), or by a test — is read from
``node.meta[autoshard.meta.PLANNED]`` and applied instead of the walk's choice (checked against the node's rule
unless ``node.meta[autoshard.meta.PLANNED_BY]`` says the search drew it from those very options).

Entry point: :class:`Propagate` (``run(gm, ctx) -> gm``).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch
import torch.fx

from autoshard import meta as M
from autoshard import redistribute
from autoshard.context import Context
from autoshard.errors import PlanError, UnsupportedOpError
from autoshard.graph_utils import is_getitem, is_tensor_node, itemsize, node_location, out_vals, shape, tensor_inputs
from autoshard.ops import OpInfo, replicate_only, rule_for
from autoshard.placements import Partial, Replicate, Shard, check_spec, format_spec
from autoshard.strategies import strategies_for

_MOVE_PARAMETER = 1e18  # bytes-equivalent price of redistributing a parameter: a last resort


@dataclass(frozen=True)
class Propagate:
    name: str = "propagate"

    def run(self, gm: torch.fx.GraphModule, ctx: Context) -> torch.fx.GraphModule:
        mark_requires_grad(gm)
        fixed = seed_specs(gm, ctx)
        pinned = pinned_values(gm)
        paid: set[tuple] = set()  # (node, spec) redistributions and (node, spec, axes) grad syncs already bought
        decisions = 0
        for node in gm.graph.nodes:
            if node.op in ("placeholder", "get_attr"):
                continue
            if node.op == "output":
                _require_outputs(node, ctx)
                continue
            if is_getitem(node):
                src = node.args[0].meta[M.SPEC]
                node.meta[M.SPEC] = src[node.args[1]] if isinstance(src, tuple) and src and isinstance(
                    src[0], tuple) else src
                continue
            if node.op != "call_function":
                raise UnsupportedOpError(f"{node_location(node)} is a {node.op} node, but autoshard only handles "
                                         "aten call_function nodes after tracing.")
            _choose(node, ctx, fixed, paid, pinned)
            decisions += 1
        for node in gm.graph.nodes:  # parameters nobody consumed stay replicated
            if node.op == "get_attr" and node.meta.get(M.SPEC) is None:
                node.meta[M.SPEC] = (Replicate(),) * ctx.mesh.ndim
        ctx.report[self.name] = {"ops": decisions}
        return gm


def mark_requires_grad(gm: torch.fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "get_attr":
            node.meta[M.REQUIRES_GRAD] = isinstance(val, torch.Tensor) and bool(val.requires_grad)
        elif node.op == "placeholder":
            node.meta[M.REQUIRES_GRAD] = isinstance(val, torch.Tensor) and bool(val.requires_grad)
        elif node.op == "call_function":
            vals = out_vals(node)
            floating = any(v.dtype.is_floating_point or v.dtype.is_complex for v in vals)
            # all_input_nodes, not tensor_inputs: a getitem reads a multi-output node whose value is a tuple
            node.meta[M.REQUIRES_GRAD] = floating and any(
                x.meta.get(M.REQUIRES_GRAD, False) for x in node.all_input_nodes)


def seed_specs(gm: torch.fx.GraphModule, ctx: Context) -> set[torch.fx.Node]:
    """Specs fixed before the walk: annotated parameters and every input. Returns the fixed nodes."""
    mesh, opts = ctx.mesh, ctx.options
    fixed: set[torch.fx.Node] = set()
    params = [n for n in gm.graph.nodes if n.op == "get_attr" and isinstance(n.meta.get("val"), torch.Tensor)]
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n in params + inputs:
        n.meta.pop(M.ANNOTATED, None)
    for pattern, spec in gm.meta.get(M.IMPLIED_ANNOTATIONS, ()) + tuple(opts.annotations):  # user's last: win
        hits = [n for n in params
                if any(fnmatch.fnmatchcase(a, pattern) for a in n.meta.get(M.ALIASES, (str(n.target),)))]
        hits += [n for n in inputs if n.name == pattern or n.target == pattern]
        if not hits:
            sample = ", ".join(n.meta.get(M.PARAM, str(n.target)) for n in params[:4])
            raise PlanError(f"annotation {pattern!r} names no parameter or input of the model, but every "
                            f"annotation must match at least one. Parameters look like: {sample}, ...; inputs are "
                            f"{[n.name for n in inputs]}.")
        for n in hits:
            n.meta[M.SPEC] = check_spec(spec, shape(n), mesh, f"annotation {pattern!r} on `{n.name}`")
            if n.op == "get_attr" and any(isinstance(p, Partial) for p in n.meta[M.SPEC]):
                raise PlanError(f"annotation {pattern!r} on `{n.name}` has Partial(), but a parameter cannot be "
                                "Partial (every rank would hold a share of it and compute its whole gradient): use "
                                "Shard(d) or Replicate().")
            n.meta[M.ANNOTATED] = pattern
            fixed.add(n)
    for n in inputs:
        if n in fixed or not isinstance(n.meta.get("val"), torch.Tensor):
            continue
        spec = [Replicate()] * mesh.ndim
        s = shape(n)
        if opts.data_axis in mesh.names and len(s) >= 1:
            size = mesh.axis_size(opts.data_axis)
            if s[0] % size == 0:
                spec[mesh.index(opts.data_axis)] = Shard(0)
            else:
                ctx.warn(f"input `{n.name}` has batch size {s[0]}, not divisible by axis `{opts.data_axis}` of "
                         f"size {size}: it is replicated on that axis (every rank passes the whole batch).")
        n.meta[M.SPEC] = tuple(spec)
        fixed.add(n)
    return fixed


# ---------------------------------------------------------------------------------------------------------
# Annotated parameters are hard constraints (both planners)
# ---------------------------------------------------------------------------------------------------------
def pinned_values(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, bool]:
    """Values whose layout an annotation fixes: annotated parameters (True: taken only as annotated) and values
    computed only from them (False: never gathered; see :func:`keeps_layout`). Run after :func:`seed_specs`."""
    pinned: dict[torch.fx.Node, bool] = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr" and M.ANNOTATED in n.meta and is_tensor_node(n):
            pinned[n] = True
        elif n.op == "call_function":
            srcs = n.all_input_nodes
            if srcs and all(x in pinned for x in srcs):
                pinned[n] = False
    return pinned


def keeps_layout(have, want, strict: bool) -> bool:
    """Whether a consumer needing ``want`` respects a pinned value laid out as ``have``: exactly (an annotated
    parameter), or without gathering any of its shards (a value computed only from annotated parameters: its
    Partial sums may still be reduced, and replicated copies sliced locally)."""
    if have is None or want is None:
        return True
    if strict:
        return have == want
    return all(not isinstance(h, Shard) or w == h for h, w in zip(have, want))


def pin_conflict(inputs, strat: M.Strategy, pinned: dict) -> tuple[torch.fx.Node, object] | None:
    """The first pinned input ``strat`` would need in another layout (with that layout), or None."""
    for x, want in zip(inputs, strat.input_specs):
        if x in pinned and not keeps_layout(x.meta.get(M.SPEC), want, pinned[x]):
            return x, want
    return None


def annotation_error(node: torch.fx.Node, x: torch.fx.Node, wants: list, pinned: dict) -> PlanError:
    """No strategy of ``node`` takes the pinned value ``x`` as it is laid out."""
    param = x if x.op == "get_attr" else next(
        (a for a in _pinned_sources(x, pinned)), x)
    pattern = param.meta.get(M.ANNOTATED, "?")
    name = param.meta.get(M.PARAM, str(param.target))
    what = f"parameter `{name}`" if x is param else f"`{x.name}` (computed only from parameter `{name}`)"
    needs = ", ".join(sorted({format_spec(w) for w in wants if w is not None})) or "another layout"
    return PlanError(
        f"{node_location(node)} cannot take {what} as annotated: annotation {pattern!r} fixes "
        f"{format_spec(param.meta.get(M.SPEC))}, but every strategy of this op needs {needs}, and an annotated "
        f"parameter is never redistributed for compute. Annotate `{name}` with one of {needs}, or drop the "
        f"annotation {pattern!r} and let the planner choose.")


def _pinned_sources(x: torch.fx.Node, pinned: dict):
    seen, stack = set(), [x]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "get_attr" and pinned.get(n):
            yield n
        stack.extend(a for a in n.all_input_nodes if a in pinned)


def _choose(node: torch.fx.Node, ctx: Context, fixed: set[torch.fx.Node], paid: set[tuple],
            pinned: dict[torch.fx.Node, bool]) -> None:
    inputs = tensor_inputs(node)
    planned = node.meta.get(M.PLANNED)
    if planned is not None and node.meta.get(M.PLANNED_BY) == "plan_search":
        candidates = [planned]  # one of this node's (or its tied twin's) own rule options
    else:
        candidates = node_strategies(node, ctx)
        if planned is not None:
            if planned not in candidates:
                raise PlanError(f"{node_location(node)} was given strategy {planned}, but its rule does not "
                                "allow it.")
            candidates = [planned]
    blocked = []  # (pinned input, layout a rejected strategy wanted)
    scored, forbidden = [], []  # forbidden: priced only to be named as the rejected alternative
    for strat in candidates:
        conflict = pin_conflict(inputs, strat, pinned)
        if conflict is not None:
            blocked.append(conflict)
        cost = _price(node, inputs, strat, ctx, paid)
        if cost is not None:
            (scored if conflict is None else forbidden).append((cost, strat))
    if not scored:
        if blocked:
            x = blocked[0][0]
            raise annotation_error(node, x, [w for b, w in blocked if b is x], pinned)
        specs = ", ".join(f"`{x.name}` {format_spec(x.meta.get(M.SPEC))}" for x in inputs)
        raise PlanError(f"{node_location(node)} has inputs {specs}, but no strategy of its rule accepts them. "
                        "Check the annotations feeding this op.")
    if ctx.options.sequence_parallel:
        # Sequence parallelism: at equal bytes, keep activations sharded (less activation memory per rank).
        def order(cs):
            return cs[0], _replicated_axes(cs[1].output_spec)
    else:
        def order(cs):
            return cs[0]
    scored.sort(key=order)
    best_cost, best = scored[0]
    rest = sorted(scored[1:] + forbidden, key=order)
    alt = next(((c, s) for c, s in rest if s.output_spec != best.output_spec), None)
    for x, spec, sync in zip(inputs, best.input_specs, best.grad_sync):
        if x.meta.get(M.SPEC) is None:  # a free parameter takes the layout its first consumer wants
            x.meta[M.SPEC] = spec
        paid.add((x, spec))
        paid.add((x, spec, tuple(sync)))
    node.meta[M.STRATEGY] = best
    node.meta[M.SPEC] = best.output_spec
    if planned is not None and M.DECISION in node.meta:
        return  # the planner's own explanation (the search's) stays
    node.meta[M.DECISION] = M.Decision(best_cost, alt[1] if alt else None, alt[0] if alt else None,
                                       "fewest bytes communicated")


def _replicated_axes(spec) -> int:
    specs = spec if spec and isinstance(spec[0], tuple) else (spec,)
    return sum(isinstance(p, Replicate) for s in specs for p in (s or ()))


def node_strategies(node: torch.fx.Node, ctx: Context) -> list[M.Strategy]:
    """Every strategy the rule table allows for ``node`` on ``ctx.mesh`` (the search space of one op)."""
    inputs = tensor_inputs(node)
    info = OpInfo([shape(x) for x in inputs], [tuple(v.shape) for v in out_vals(node)], node.args,
                  dict(node.kwargs), [v.dtype for v in out_vals(node)])
    rule = rule_for(node.target)
    if rule is None:
        if ctx.options.on_unsupported != "replicate":
            raise UnsupportedOpError(
                f"{node_location(node)} has no sharding rule, so autoshard cannot tell how to shard it. Register a "
                "rule for this op in autoshard/ops (op(..., rule=...)), or pass on_unsupported='replicate' to run it "
                "unsharded.")
        if node.name not in ctx.report.setdefault("unsupported", []):
            ctx.report["unsupported"].append(node.name)
            ctx.warn(f"{node_location(node)} has no sharding rule: it runs replicated (on_unsupported='replicate').")
        rule = replicate_only
    strategies = strategies_for(rule(info), info.in_shapes, info.out_shapes, ctx.mesh)
    # A parameter is never Partial: every rank would compute its whole gradient while holding a share of it.
    params = [i for i, x in enumerate(inputs) if x.op == "get_attr"]
    return [s for s in strategies
            if not any(s.input_specs[i] is not None and any(isinstance(p, Partial) for p in s.input_specs[i])
                       for i in params)]


def _price(node, inputs, strat: M.Strategy, ctx: Context, paid: set[tuple]) -> float | None:
    """Bytes this strategy adds; a redistribution or grad sync another consumer already bought is free (the
    collectives pass shares it)."""
    mesh = ctx.mesh
    total = 0.0
    for x, want, sync in zip(inputs, strat.input_specs, strat.grad_sync):
        have = x.meta.get(M.SPEC)
        rg = bool(x.meta.get(M.REQUIRES_GRAD))
        if have is None:  # free parameter: any layout is free to choose
            have = want
        cost = redistribute.cost_bytes(have, want, shape(x), itemsize(x), mesh, rg)
        if cost is None:
            return None
        if (x, want) not in paid:
            total += cost
        if x.op == "get_attr" and have != want:
            total += _MOVE_PARAMETER
        if rg and sync and x.op != "get_attr" and (x, want, tuple(sync)) not in paid:
            total += redistribute.grad_sync_bytes(want, sync, shape(x), itemsize(x), mesh)
    return total


def _require_outputs(node: torch.fx.Node, ctx: Context) -> None:
    """Outputs leave replicated, except a batch shard on the data axis that stays local (as with DDP)."""
    mesh, opts = ctx.mesh, ctx.options
    wants = []
    for x in tensor_inputs(node):
        have = x.meta[M.SPEC]
        want = []
        for a, p in enumerate(have):
            keep = (opts.output_keep_data_shard and mesh.names[a] == opts.data_axis and isinstance(p, Shard)
                    and p.dim == 0)
            want.append(p if keep else Replicate())
        wants.append(tuple(want))
    node.meta[M.STRATEGY] = M.Strategy(tuple(wants), (), tuple(() for _ in wants), "outputs")


__all__ = ["Propagate", "keeps_layout", "mark_requires_grad", "node_strategies", "pin_conflict", "pinned_values",
           "seed_specs"]
