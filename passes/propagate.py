"""Sharding propagation: give every tensor node a spec and every op a strategy.

Inputs to the pass: user annotations on parameters (globs over FQNs) and inputs, plus the default that the
batch dim (dim 0) of every input is sharded on the data axis. Parameters without annotation are *free*: the
first op that consumes one fixes its layout to whatever that op's chosen strategy wants.

The walk is greedy in topological order: for each op, every strategy the rule table allows
(:func:`autoshard.compiler.strategies.strategies_for`) is priced by the communication bytes it causes — redistributing
each input from its current spec to the spec the strategy needs (forward and backward,
:mod:`autoshard.compiler.redistribute`), plus the backward all-reduce of replicated inputs feeding sharded work — and
the cheapest wins (ties: rule order, which lists the all-replicated strategy first, so nothing is sharded
without a reason). The backward all-reduce of *parameters* (data-parallel gradient sync) is not priced here: it
is the price of data parallelism itself, and trading it against activation traffic op by op would undo the
batch sharding the user asked for. The plan search over the cost models prices everything together.
Annotated parameters are hard constraints (:func:`pinned_values`, shared with the plan search): a strategy that
needs an annotated parameter in another layout is not a candidate, and neither is one that gathers (all-gather,
all-to-all) a value computed only from annotated parameters (its transpose, say) — either would undo the memory
and compute split the annotation asked for. When no strategy is left, :class:`~autoshard.errors.PlanError` names
the parameter and the op. A free parameter already laid out by an earlier consumer (a tied weight) may still be
redistributed, as a last resort. The chosen :class:`~autoshard.meta.Strategy` and a
:class:`~autoshard.meta.Decision` (with the best rejected alternative) go into ``node.meta``.

A strategy decided before this pass — by the plan search (``passes/plan_search/``), or by a test — is read from
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
from autoshard.compiler import redistribute
from autoshard.compiler.context import Context
from autoshard.errors import PlanError, UnsupportedOpError
from autoshard.frontend.graph_utils import (is_getitem, is_tensor_node, itemsize, node_location, out_vals, shape,
                                           tensor_inputs)
from autoshard.compiler.ops import OpInfo, replicate_only, rule_for
from autoshard.placements import Partial, Replicate, Shard, check_spec, format_spec
from autoshard.compiler.strategies import strategies_for

_MOVE_PARAMETER = 1e18  # bytes-equivalent price of redistributing a parameter: a last resort


@dataclass(frozen=True)
class Propagate:
    name: str = "propagate"

    def run(self, gm: torch.fx.GraphModule, ctx: Context) -> torch.fx.GraphModule:
        # (the graph is functional, its inputs and annotated parameters seeded and its gradients marked by the
        # passes before this one: passes/prepare.py)
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
            _choose(node, ctx, paid, pinned)
            decisions += 1
        for node in gm.graph.nodes:  # parameters nobody consumed stay replicated
            if node.op == "get_attr" and node.meta.get(M.SPEC) is None:
                node.meta[M.SPEC] = (Replicate(),) * ctx.mesh.ndim
        report = M.plan_report(gm)
        report[self.name] = {"ops": decisions}
        unsupported = {n.name: n.meta[M.NO_RULE] for n in gm.graph.nodes if M.NO_RULE in n.meta}
        if unsupported:
            report["unsupported"] = unsupported
            lines = "\n".join(f"  - {where}" for where in unsupported.values())
            ctx.warn(f"{len(unsupported)} op(s) have no sharding rule and run replicated (inputs gathered, result "
                     f"replicated on every rank; on_unsupported='error' refuses them instead):\n{lines}")
        warn_axis_use(gm, ctx)
        return gm


# ---------------------------------------------------------------------------------------------------------
# In-place ops: functional forms before planning
# ---------------------------------------------------------------------------------------------------------
#: views through which an in-place write reaches its base, and how to write the result back: the view's
#: ``*_scatter`` twin (base, value, then the view's own arguments after the input)
_VIEW_SCATTER = {torch.ops.aten.slice.Tensor: torch.ops.aten.slice_scatter.default,
                 torch.ops.aten.select.int: torch.ops.aten.select_scatter.default}
_ALIASES = {torch.ops.aten.alias.default, torch.ops.aten.detach.default}


def mutates_first_arg(target) -> bool:
    """Whether ``target`` (an aten overload) writes its first argument in place (``add_``, ``copy_``, ``fill_``)."""
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.arguments:
        return False
    alias = schema.arguments[0].alias_info
    return alias is not None and alias.is_write


#: ops whose schema marks no argument written although they update running statistics in place when their
#: ``training`` argument (position 5) is true: positions of running_mean and running_var
_WRITES_RUNNING_STATS = {torch.ops.aten.batch_norm.default, torch.ops.aten.native_batch_norm.default,
                         torch.ops.aten.cudnn_batch_norm.default, torch.ops.aten.miopen_batch_norm.default}


def written_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The inputs ``node`` writes in place: arguments its schema marks written (``add_``'s self,
    ``_native_batch_norm_legit``'s running statistics) and BatchNorm's running statistics in training mode (its
    schema marks none). Such an input must be read in the layout it is stored in: a redistributed copy would take
    the write, and the stored tensor would keep its old value."""
    target = node.target
    schema = getattr(target, "_schema", None)
    if node.op != "call_function" or schema is None:
        return []
    positions = [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
    if target in _WRITES_RUNNING_STATS and len(node.args) > 5 and node.args[5]:
        positions += [3, 4]
    return [node.args[i] for i in positions
            if i < len(node.args) and isinstance(node.args[i], torch.fx.Node)]


def functional_twin(target):
    """``aten.add_.Tensor`` → ``aten.add.Tensor`` (None when there is none)."""
    name = target._schema.name.split("::")[-1]
    if not name.endswith("_") or name.startswith("_"):
        return None
    packet = getattr(torch.ops.aten, name[:-1], None)
    twin = getattr(packet, target._overloadname, None) if packet is not None else None
    return None if twin is None or mutates_first_arg(twin) else twin


def functionalize(gm: torch.fx.GraphModule) -> list[str]:
    """Rewrite in-place ops on activations (``x.add_(y)``, ``x[..., 1:] = y`` as ``copy_`` into a slice,
    ``x[:, 0] = v`` as ``fill_`` into a select, ``masked_fill_``) into their functional forms, so every value is
    written once and a sharded plan cannot lose a write to a redistributed copy: ``y = op(x, ...)``; a write
    into a slice/select view of a base becomes ``base' = slice_scatter(base, y, ...)``; later readers of the
    written tensor (and of its base) read the new value. Writes into parameters and buffers (BatchNorm's
    ``num_batches_tracked.add_(1)``) stay in place: the buffer is updated on every rank as on one device, and
    propagation keeps its layout (:func:`_choose`). Returns the names of in-place nodes left as they were (no
    functional form, or an alias of the base read after the write)."""
    g = gm.graph
    order = {n: i for i, n in enumerate(g.nodes)}
    left = []
    rewritten = False
    for node in list(g.nodes):
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if not mutates_first_arg(node.target):
            continue
        chain, cur = [], node.args[0]
        while isinstance(cur, torch.fx.Node) and cur.op == "call_function" and (
                cur.target in _VIEW_SCATTER or cur.target in _ALIASES):
            chain.append(cur)
            cur = cur.args[0]
        twin = functional_twin(node.target)
        if not isinstance(cur, torch.fx.Node) or cur.op == "get_attr" or twin is None:
            if not (isinstance(cur, torch.fx.Node) and cur.op == "get_attr" and not chain):
                left.append(node.name)
            continue
        at = order[node]
        # every alias of the base made before the write and read after it would read the old value
        aliases = _aliases_of(cur)
        if any(a is not node.args[0] and a not in chain and any(order[u] > at for u in a.users) for a in aliases
               if order[a] < at):
            left.append(node.name)
            continue
        with g.inserting_before(node):
            if node.target == torch.ops.aten.copy_.default:
                # aten.copy has no derivative: dst.copy_(src) is src cast to dst's dtype, expanded to its shape
                dst, src = node.args[0], node.args[1]
                dval = dst.meta["val"]
                cast = g.call_function(torch.ops.aten._to_copy.default, (src,), {"dtype": dval.dtype})
                cast.meta.update(node.meta)
                cast.meta["val"] = src.meta["val"].to(dval.dtype) if isinstance(src, torch.fx.Node) else dval
                value = g.call_function(torch.ops.aten.expand.default, (cast, list(dval.shape)))
            else:
                value = g.call_function(twin, node.args, dict(node.kwargs))
            value.meta.update(node.meta)
            new = value
            for view in chain:
                base = view.args[0]
                if view.target in _ALIASES:
                    continue
                new = g.call_function(_VIEW_SCATTER[view.target], (base, new) + tuple(view.args[1:]),
                                      dict(view.kwargs))
                new.meta.update({k: v for k, v in view.meta.items() if k != "val"})
                new.meta["val"] = base.meta["val"]
        node.replace_all_uses_with(value)
        written = [node.args[0]] + chain
        for old, fresh in ((node.args[0], value), (cur, new)):
            for user in list(old.users):
                if user in order and order[user] > at and user not in written:
                    user.replace_input_with(old, fresh)
        g.erase_node(node)
        order = {n: i for i, n in enumerate(g.nodes)}
        rewritten = True
    if g.eliminate_dead_code() or rewritten:  # (regenerating a large graph's code costs ~0.1 s: only on change)
        gm.recompile()
    return left


def _aliases_of(base: torch.fx.Node) -> list[torch.fx.Node]:
    """Views of ``base`` (transitively) made by view ops of the graph."""
    out, stack = [], [base]
    while stack:
        n = stack.pop()
        for u in n.users:
            if u.op == "call_function" and getattr(u.target, "_schema", None) is not None and u.target._schema.returns \
                    and u.target._schema.returns[0].alias_info is not None and not mutates_first_arg(u.target) \
                    and u.args and u.args[0] is n:
                out.append(u)
                stack.append(u)
    return out


def axis_use(gm: torch.fx.GraphModule, mesh) -> dict[str, tuple[int, int]]:
    """Per mesh axis: (FLOPs of ops whose work is split on it, FLOPs of ops every rank of it runs whole)."""
    from autoshard.cost_models.compute import flops

    use = {name: [0, 0] for name in mesh.names}
    for n in gm.graph.nodes:
        strat = n.meta.get(M.STRATEGY)
        if n.op != "call_function" or strat is None or is_getitem(n):
            continue
        work = flops(n)
        if not work:
            continue
        outs = strat.output_spec if strat.output_spec and isinstance(strat.output_spec[0], tuple) else (
            strat.output_spec,)
        specs = [s for s in (*strat.input_specs, *outs) if s]
        for a, name in enumerate(mesh.names):
            split = any(not isinstance(s[a], Replicate) for s in specs)
            use[name][0 if split else 1] += work
    return {k: (v[0], v[1]) for k, v in use.items()}


def warn_axis_use(gm: torch.fx.GraphModule, ctx: Context) -> None:
    """One warning when the plan leaves a mesh axis unused, or runs more of the work whole than split on it:
    every rank of that axis then repeats that work (a plan that says what it does)."""
    notes, named = [], []
    use = M.plan_report(gm)["axis_use"] = axis_use(gm, ctx.mesh)
    for name, (split, whole) in use.items():
        size = ctx.mesh.axis_size(name)
        if size == 1 or split + whole == 0:
            continue
        if split == 0 or whole > split:
            named.append(name)
        if split == 0:
            notes.append(f"axis `{name}` (size {size}) is unused: its {size} ranks all run the whole model on the "
                         "same data")
        elif whole > split:
            notes.append(f"axis `{name}` (size {size}) replicates more than it shards: "
                         f"{100 * whole / (split + whole):.0f}% of the forward FLOPs run whole on each of its "
                         f"{size} ranks")
    if notes:
        from autoshard.compiler.advice import axis_advice

        ctx.warn("plan: " + "; ".join(notes) + ". " + axis_advice(gm, ctx, named, use))


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
    by_name = {a: n for n in params for a in n.meta.get(M.ALIASES, (str(n.target),))}
    # fixed like an annotation, but not pinned for compute (no M.ANNOTATED)
    for name, spec in (ctx.pinned.layouts if ctx.pinned is not None else ()):
        n = by_name.get(name)
        if n is None:
            raise PlanError(f"layout given for `{name}`, but the model has no parameter of that name.")
        n.meta[M.SPEC] = check_spec(spec, shape(n), mesh, f"layout of `{name}`")
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


def _choose(node: torch.fx.Node, ctx: Context, paid: set[tuple], pinned: dict[torch.fx.Node, bool]) -> None:
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
    for written in written_inputs(node):
        if written.op != "get_attr" or written.meta.get(M.SPEC) is None:
            continue  # (an input's write never reaches the caller's tensor: each rank holds its own shard)
        # a buffer written in place keeps its layout: a redistributed copy would take the write
        have, pos = written.meta[M.SPEC], inputs.index(written)
        kept = [s for s in candidates if s.input_specs[pos] == have]
        if not kept:
            raise PlanError(f"{node_location(node)} writes `{written.name}` in place, laid out as "
                            f"{format_spec(have)}, but no strategy of its rule takes it so; a redistributed copy "
                            "would take the write. Annotate it (annotations=...) in a layout the op can write.")
        candidates = kept
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
    gathers = _batch_gathers(inputs, ctx)
    if ctx.options.sequence_parallel:
        # Sequence parallelism: at equal bytes, keep activations sharded (less activation memory per rank).
        def order(cs):
            return gathers(cs[1]), cs[0], _replicated_axes(cs[1].output_spec)
    else:
        def order(cs):
            return gathers(cs[1]), cs[0]
    scored.sort(key=order)
    best_cost, best = scored[0]
    rest = sorted(scored[1:] + forbidden, key=order)
    alt = next(((c, s) for c, s in rest if s.output_spec != best.output_spec), None)
    for x, spec, sync in zip(inputs, best.input_specs, best.grad_sync):
        if x.meta.get(M.SPEC) is None:  # a free parameter takes the layout its first consumer wants
            x.meta[M.SPEC] = spec
        paid.add((x, spec))
        paid.add((x, spec, tuple(sync)))
    if M.NO_RULE in node.meta:
        best = M.Strategy(best.input_specs, best.output_spec, best.grad_sync, f"{best.note} (no rule: replicated)")
    node.meta[M.STRATEGY] = best
    node.meta[M.SPEC] = best.output_spec
    if planned is not None and M.DECISION in node.meta:
        return  # the planner's own explanation (the search's) stays
    node.meta[M.DECISION] = M.Decision(best_cost, alt[1] if alt else None, alt[0] if alt else None,
                                       "fewest bytes communicated")


def _batch_gathers(inputs, ctx: Context):
    """``strategy -> 0/1``: 1 when the strategy runs the op whole on the data axis although an input arrives
    sharded on it — it would gather the batch and repeat the op's work on every data rank. The greedy walk
    ranks such strategies last whatever the bytes (fewer bytes never buy the loss of data parallelism); inputs
    the user laid out replicated on the data axis are not sharded there, so nothing is forced."""
    mesh, axis = ctx.mesh, ctx.options.data_axis
    if axis not in mesh.names or mesh.axis_size(axis) == 1:
        return lambda strat: 0
    a = mesh.index(axis)
    sharded = any(isinstance((x.meta.get(M.SPEC) or (None,) * mesh.ndim)[a], Shard) for x in inputs
                  if x.op != "get_attr")
    if not sharded:
        return lambda strat: 0

    def gathers(strat) -> int:
        outs = strat.output_spec if strat.output_spec and isinstance(strat.output_spec[0], tuple) else (
            strat.output_spec,)
        specs = [s for s in (*strat.input_specs, *outs) if s]
        return int(all(isinstance(s[a], Replicate) for s in specs))

    return gathers


def _replicated_axes(spec) -> int:
    specs = spec if spec and isinstance(spec[0], tuple) else (spec,)
    return sum(isinstance(p, Replicate) for s in specs for p in (s or ()))


#: (input, dim) pairs an op's local form reads as contiguous chunks at this rank's offset: the vocabulary-parallel
#: loss compares labels against its class range. Head-tail balancing puts chunks r and 2n-1-r on a rank, so these are
#: never sharded on a balanced context axis (the plan's numbers would be wrong, not refused).
_GLOBAL_OFFSET_DIMS = {torch.ops.aten.cross_entropy_loss.default: ((0, 1),)}


def node_strategies(node: torch.fx.Node, ctx: Context) -> list[M.Strategy]:
    """Every strategy the rule table allows for ``node`` on ``ctx.mesh`` (the search space of one op)."""
    inputs = tensor_inputs(node)
    info = OpInfo([shape(x) for x in inputs], [tuple(v.shape) for v in out_vals(node)], node.args,
                  dict(node.kwargs), [v.dtype for v in out_vals(node)])
    rule = rule_for(node.target)
    in_place = mutates_first_arg(node.target)
    if in_place:
        written = node.args[0] if node.args else None
        if not (isinstance(written, torch.fx.Node) and written.op == "get_attr"):
            # functionalize() left it: no functional form, or an alias of the base is read after the write. Run
            # replicated, a redistributed copy would take the write and the original keep the old value.
            raise UnsupportedOpError(
                f"{node_location(node)} writes its input in place, and autoshard could not rewrite it as a "
                "functional op (no out-of-place form, or a view of the written tensor is read after the write), "
                "so no plan can guarantee the write reaches every reader. Write it out of place (y = x.op(...) "
                "instead of x.op_(...)), or register a rule for it in autoshard/compiler/ops.")
        if rule is None and functional_twin(node.target) is not None:
            rule = rule_for(functional_twin(node.target))  # a buffer written in place: its layout is kept
    if rule is None:
        if ctx.options.on_unsupported != "replicate":
            raise UnsupportedOpError(
                f"{node_location(node)} has no sharding rule, so autoshard cannot tell how to shard it. Register a "
                "rule for this op in autoshard/compiler/ops (op(..., rule=...)), or pass on_unsupported='replicate' "
                "to run it unsharded.")
        node.meta.setdefault(M.NO_RULE, node_location(node))
        rule = replicate_only
    strategies = strategies_for(rule(info), info.in_shapes, info.out_shapes, ctx.mesh)
    # A parameter is never Partial: every rank would compute its whole gradient while holding a share of it.
    params = [i for i, x in enumerate(inputs) if x.op == "get_attr"]
    strategies = [s for s in strategies
                  if not any(s.input_specs[i] is not None and any(isinstance(p, Partial) for p in s.input_specs[i])
                             for i in params)]
    # The context axis shards the sequence: a parameter sharded on it would make it a tensor-parallel axis (and
    # cannot hold head-tail balancing's reordered chunks), so no strategy reads one sharded there.
    # With head-tail balancing every dim sharded there is cut in 2n chunks, so it must divide by 2n (what
    # passes/context_parallel.py checks of the plan, made a constraint of the search space).
    cp = ctx.options.context_parallel
    if cp is not None and cp.axis in ctx.mesh.names and ctx.mesh.axis_size(cp.axis) > 1:
        a, chunks = ctx.mesh.index(cp.axis), 2 * ctx.mesh.axis_size(cp.axis)

        def fits(s: M.Strategy) -> bool:
            if any(s.input_specs[i] is not None and isinstance(s.input_specs[i][a], Shard) for i in params):
                return False
            if not cp.balance:
                return True
            for i, d in _GLOBAL_OFFSET_DIMS.get(node.target, ()):  # a shard whose local form needs its offset
                if s.input_specs[i] is not None and s.input_specs[i][a] == Shard(d):
                    return False
            outs = s.output_spec if s.output_spec and isinstance(s.output_spec[0], tuple) else (s.output_spec,)
            pairs = [*zip(s.input_specs, info.in_shapes), *zip(outs, info.out_shapes)]
            return not any(spec is not None and shp is not None and isinstance(spec[a], Shard)
                           and shp[spec[a].dim] % chunks for spec, shp in pairs)

        strategies = [s for s in strategies if fits(s)]
    return strategies


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
    """Outputs leave replicated, except on the data axis, as with DDP: an output whose dim 0 is the batch
    (:func:`batch_outputs`) is this rank's chunk of it (``Shard(0)``, whatever layout computed it), and any other
    batch shard (``Shard(0)`` on the data axis) stays local."""
    wants = [tuple(output_spec(x.meta[M.SPEC], keep))
             for x, keep in zip(tensor_inputs(node), output_keeps(node, ctx))]
    node.meta[M.STRATEGY] = M.Strategy(tuple(wants), (), tuple(() for _ in wants), "outputs")


#: what an output keeps on an axis (:func:`output_keeps`): nothing (replicated), a dim-0 shard where it has one,
#: this rank's chunk of dim 0 (a batch-shaped output on the data axis), or, on an axis of size 1, the layout it is
#: made in (Replicate and Shard hold the same whole tensor on one rank: a redistribution would only copy it)
KEEP_NONE, KEEP_SHARD, KEEP_BATCH, KEEP_AS_MADE = 0, 1, 2, 3


def output_keeps(node: torch.fx.Node, ctx: Context) -> list[tuple[int, ...]]:
    """Per tensor of the output node, per mesh axis, what the output keeps there (``KEEP_*``)."""
    mesh, opts = ctx.mesh, ctx.options
    single = [size == 1 for _, size in mesh.axes]
    if opts.data_axis not in mesh.names:
        return [tuple(KEEP_AS_MADE if single[a] else KEEP_NONE for a in range(mesh.ndim))
                for _ in tensor_inputs(node)]
    axis = mesh.names.index(opts.data_axis)
    batches = batch_sizes(node.graph, ctx)
    out = []
    for x in tensor_inputs(node):
        dims = shape(x)
        keep = KEEP_BATCH if dims and dims[0] in batches else KEEP_SHARD
        out.append(tuple(KEEP_AS_MADE if single[a] else keep if a == axis else KEEP_NONE for a in range(mesh.ndim)))
    return out


def batch_sizes(graph: torch.fx.Graph, ctx: Context) -> set[int]:
    """The global batch sizes of the graph: dim 0 of every input split over the data axis (``Shard(0)`` there)."""
    mesh, opts = ctx.mesh, ctx.options
    axis = mesh.names.index(opts.data_axis)
    out = set()
    for n in graph.nodes:
        spec = n.meta.get(M.SPEC) if n.op == "placeholder" else None
        if spec is not None and isinstance(spec[axis], Shard) and spec[axis].dim == 0 and shape(n):
            out.add(shape(n)[0])
    return out


def output_spec(src, keep: tuple[int, ...]) -> tuple:
    """The layout an output of layout ``src`` leaves in, given what it keeps per axis (:func:`output_keeps`)."""
    return tuple(Shard(0) if k == KEEP_BATCH else p if (k == KEEP_SHARD and isinstance(p, Shard) and p.dim == 0)
                 or (k == KEEP_AS_MADE and not isinstance(p, Partial)) else Replicate() for p, k in zip(src, keep))


__all__ = ["Propagate", "keeps_layout", "mark_requires_grad", "node_strategies", "pin_conflict", "pinned_values",
           "seed_specs"]
