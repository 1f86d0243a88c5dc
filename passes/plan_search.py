"""Exact plan search: choose every op's strategy to minimise estimated step time under a memory limit.

Formulation (an integer linear program solved by HiGHS through ``scipy.optimize.milp``; built by
:func:`build_problem`, solved by :func:`solve`, evaluated independently by :func:`evaluate`):

* ``x[d, k] ∈ {0, 1}``: decision ``d`` (a :class:`DecisionVar`: an op, or the layout of a free parameter) takes
  option ``k``;
  ``Σ_k x[d, k] = 1``. An op's options are the strategies of :func:`passes.propagate.node_strategies`.
* ``y[u, o] = Σ x[d, k]`` over the options that make value ``u`` come out as spec ``o`` (an expression).
* ``r[u, i] ≥ x[c, k]`` for every consumer option that needs ``u`` as spec ``i``: the redistribution of ``u`` to
  ``i`` is bought once and shared by every consumer, exactly as ``passes/collectives.py`` shares it.
* ``q[u, o, i] ≥ y[u, o] + r[u, i] − 1``: pays ``time(o → i)`` (alpha-beta collectives, forward + backward);
  impossible pairs get ``y[u, o] + r[u, i] ≤ 1``.
* ``g[u, i, axes] ≥ x[c, k]`` for consumer options that need the gradient of ``u`` all-reduced over ``axes``.
* objective: ``Σ x·compute_time + Σ q·redistribution_time + Σ g·all_reduce_time`` (seconds, forward + backward;
  no overlap of communication and compute);
* memory: ``Σ y[param, o]·(parameter + gradient + optimizer state bytes) + Σ x·saved activation bytes ≤ limit``.

Annotated parameters are hard constraints, as in propagation (:func:`passes.propagate.pinned_values`): an op
option that needs an annotated parameter in another layout is dropped, and a value computed only from annotated
parameters may not be gathered (its redistribution is marked impossible). An op left without options raises
:class:`~autoshard.errors.PlanError` naming the parameter and the op.

Repeated layers (same module structure, same shapes: ``blocks.0``, ``blocks.1``, ...) share their decision
variables: node ``n`` of every interior copy maps to node ``n`` of the second copy (:func:`find_layers`, on the
groups of :func:`autoshard.layer_reuse.find_groups`, the detector the trace uses too; the first and last copies,
which meet the prologue and epilogue, stay free), and the costs of all copies add up on the shared variables; terms of values are grouped by (canonical value, canonical consumers), with the number of copies as
multiplicity. The program's size is then independent of the depth. Solutions are exact (``mip_rel_gap = 0``) over
that space — every strategy of every op, interior copies of a layer choosing alike — and deterministic.

The pass hands its choices to propagation through node metadata only: ``autoshard.meta.PLANNED`` (the chosen
strategy, with ``PLANNED_BY = "plan_search"``) and ``autoshard.meta.DECISION`` (the explanation) on ops, the spec
on free parameters. A strategy some earlier step already put in ``PLANNED`` is the op's only option.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.fx
from autoshard.cost_models.memory import optimizer_state_bytes
from autoshard.cost_models.plan_cost import _local_numel, grad_sync_time, op_times, redistribution_time_of
from autoshard.cost_models.profile import HardwareProfile, load_profile
from autoshard.passes.propagate import (annotation_error, functionalize, keeps_layout, mark_requires_grad, node_strategies,
                                        pin_conflict, pinned_values, seed_specs)

from autoshard import meta as M
from autoshard.context import Context
from autoshard.errors import PlanError
from autoshard.graph_utils import is_getitem, is_tensor_node, itemsize, out_vals, shape, tensor_inputs
from autoshard.mesh import Mesh
from autoshard.placements import Replicate, Shard, Spec, format_spec
from autoshard.progress import slow_step

# ---------------------------------------------------------------------------------------------------------
# Repeated layers
# ---------------------------------------------------------------------------------------------------------
def find_layers(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, torch.fx.Node]:
    """Map every node of an interior copy of a repeated layer to the same node of the first interior copy.

    Which layers repeat is decided by :func:`autoshard.layer_reuse.find_groups` on the graph module (the detector
    the trace uses on the model); a layer is the set of nodes whose module path (get_attr: target) lies under
    ``prefix.<i>``. Copies are tied only if their node sequences have the same ops, shapes, argument structure,
    parameter names up to the layer index and annotations.
    """
    from autoshard.layer_reuse import find_groups
    from autoshard.meta import module_path

    groups = find_groups(gm, leaves=True)
    if not groups:
        return {}
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
    canon: dict[torch.fx.Node, torch.fx.Node] = {}
    for g, members in zip(groups, copies):
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
        sig.append((n.op, target, _shape_or_none(n), arg(n.args),
                    tuple(sorted((k, arg(v)) for k, v in n.kwargs.items())), annotated))
    return tuple(sig)


def _shape_or_none(n: torch.fx.Node):
    v = n.meta.get("val")
    return (tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor) else None


# ---------------------------------------------------------------------------------------------------------
# The problem
# ---------------------------------------------------------------------------------------------------------
@dataclass
class DecisionVar:
    """One decision of the program (its 0/1 variables ``x[d, k]``): an op's strategy or a free parameter's layout.
    Not to be confused with :class:`autoshard.meta.Decision`, the explanation of a choice stored on a node."""

    node: torch.fx.Node  # canonical node
    options: list  # Strategy (ops) or Spec (free parameters)
    cost: list[float]  # summed over every copy
    memory: list[float]  # per-rank bytes, summed over every copy
    copies: int = 1


@dataclass
class ValueTerm:
    """The cost terms of one group of equivalent values: redistributions and gradient syncs they need."""

    value: torch.fx.Node  # canonical value
    multiplicity: int
    out: list  # (decision index, option index, spec) triples that produce each spec; or a fixed spec
    fixed: Spec | None
    needs: dict  # spec i -> list of (decision, option) requiring it
    syncs: dict  # (spec, axes) -> list of (decision, option)
    outputs: list  # keep-flags of every graph output this value is (see output_spec_for)
    pair_cost: dict  # (o, i) -> seconds or None (impossible)
    sync_cost: dict  # (spec, axes) -> seconds


@dataclass
class Problem:
    mesh: Mesh
    decisions: list[DecisionVar]
    index: dict  # canonical node -> decision index
    terms: list[ValueTerm]
    memory_limit: float | None
    fixed_memory: float = 0.0
    canon: dict = field(default_factory=dict)
    data_axis: str | None = None  # ties between plans are broken against parameters sharded on this axis


def _canon(canon, n):
    return canon.get(n, n)


def build_problem(gm: torch.fx.GraphModule, ctx: Context, profile: HardwareProfile, memory_limit, optimizer: str,
                  tie_layers: bool = True) -> Problem:
    mesh = ctx.mesh
    canon = find_layers(gm) if tie_layers else {}
    pinned = pinned_values(gm)
    strict = {x: True for x, s in pinned.items() if s}  # annotated parameters: their layout is known now
    decisions: list[DecisionVar] = []
    index: dict[torch.fx.Node, int] = {}
    fixed_memory = 0.0
    copies: dict[torch.fx.Node, int] = {}
    for n in gm.graph.nodes:
        c = _canon(canon, n)
        copies[c] = copies.get(c, 0) + 1

    def state_bytes(x: torch.fx.Node, spec: Spec) -> float:
        b = _local_numel(shape(x), spec, mesh) * itemsize(x)
        if not x.meta.get(M.REQUIRES_GRAD):
            return float(b)
        return float(2 * b + optimizer_state_bytes(b, optimizer))

    # decisions for ops
    for n in gm.graph.nodes:
        if n.op != "call_function" or is_getitem(n) or _canon(canon, n) is not n:
            continue
        planned = n.meta.get(M.PLANNED)
        strats = [planned] if planned is not None else node_strategies(n, ctx)
        inputs = tensor_inputs(n)
        conflicts = [pin_conflict(inputs, s, strict) for s in strats]
        if all(c is not None for c in conflicts):
            x = conflicts[0][0]
            raise annotation_error(n, x, [w for b, w in conflicts if b is x], pinned)
        strats = [s for s, c in zip(strats, conflicts) if c is None]
        k = copies[n]
        cost = [k * t for t in op_times(n, strats, mesh, profile)]
        mem = []
        for s in strats:
            outs = s.output_spec if isinstance(s.output_spec[0], tuple) else (s.output_spec,)
            act = 0.0
            if n.meta.get(M.REQUIRES_GRAD):
                for v, spec in zip(out_vals(n), outs):
                    act += _local_numel(v.shape, spec, mesh) * v.element_size()
            mem.append(k * act)
        index[n] = len(decisions)
        decisions.append(DecisionVar(n, strats, cost, mem, k))

    # decisions for free parameters: any spec a consumer asks for (replicated first)
    wanted: dict[torch.fx.Node, list] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or is_getitem(n) or n not in index:
            continue
        for pos, x in enumerate(tensor_inputs(n)):
            if x.op == "get_attr" and x.meta.get(M.SPEC) is None:
                for s in decisions[index[n]].options:  # never Partial: node_strategies keeps parameters whole
                    lst = wanted.setdefault(_canon(canon, x), [])
                    if s.input_specs[pos] not in lst:
                        lst.append(s.input_specs[pos])
    for n in gm.graph.nodes:
        if n.op == "get_attr" and is_tensor_node(n):
            if n.meta.get(M.SPEC) is not None:
                fixed_memory += state_bytes(n, n.meta[M.SPEC])
                continue
            c = _canon(canon, n)
            if c is not n:
                continue
            specs = sorted(wanted.get(n, []), key=lambda s: (sum(not isinstance(p, type(s[0])) for p in s),
                                                              format_spec(s)))
            repl = tuple(p for p in specs[0]) if specs else None
            options = specs or [repl]
            index[n] = len(decisions)
            decisions.append(DecisionVar(n, options, [0.0] * len(options),
                                      [copies[n] * state_bytes(n, s) for s in options], copies[n]))

    # value terms: group actual values by (canonical value, canonical consumers)
    groups: dict[tuple, list[torch.fx.Node]] = {}
    consumers_of: dict[torch.fx.Node, list[tuple]] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and not is_getitem(n):
            for pos, x in enumerate(tensor_inputs(n)):
                consumers_of.setdefault(x, []).append((n, pos))
        elif n.op == "output":
            for pos, x in enumerate(tensor_inputs(n)):
                consumers_of.setdefault(x, []).append((n, pos))
    for u, cons in consumers_of.items():
        key = (_canon(canon, u), tuple(sorted({(_canon(canon, c).name, p) for c, p in cons})))
        groups.setdefault(key, []).append(u)

    out_req = _output_requirements(gm, ctx)
    terms: list[ValueTerm] = []
    pair_costs: dict = {}  # (src, dst, (shape, itemsize, requires_grad)) -> seconds: many values share a shape
    for (cu, _), members in groups.items():
        u = members[0]
        term = ValueTerm(cu, len(members), [], None, {}, {}, [], {}, {})
        _producer_options(u, cu, canon, index, decisions, term)
        for c, pos in consumers_of[u]:
            if c.op == "output":
                term.outputs.append(out_req[(c, pos)])
                continue
            d = index[_canon(canon, c)]
            for k, s in enumerate(decisions[d].options):
                i = s.input_specs[pos]
                users = term.needs.setdefault(i, [])
                if (d, k) not in users:  # copies of a tied layer read a shared value through the same variables
                    users.append((d, k))
                axes = tuple(s.grad_sync[pos]) if s.grad_sync else ()
                if axes and u.meta.get(M.REQUIRES_GRAD):
                    users = term.syncs.setdefault((i, axes), [])
                    if (d, k) not in users:
                        users.append((d, k))
        outs = [term.fixed] if term.fixed is not None else sorted({o for _, _, o in term.out}, key=format_spec)
        value = (shape(u), itemsize(u), bool(u.meta.get(M.REQUIRES_GRAD)))
        for o in outs:
            targets = set(term.needs) | {output_spec_for(o, keep) for keep in term.outputs}
            for i in targets:
                key = (o, i, value)
                if key not in pair_costs:
                    pair_costs[key] = redistribution_time_of(o, i, *value, mesh, profile)
                term.pair_cost[(o, i)] = pair_costs[key]
                if u in pinned and i in term.needs and not keeps_layout(o, i, pinned[u]):
                    term.pair_cost[(o, i)] = None  # computed only from annotated parameters: never gathered
        for (i, axes) in term.syncs:
            term.sync_cost[(i, axes)] = grad_sync_time(i, axes, u, mesh, profile)
        terms.append(term)
    data_axis = ctx.options.data_axis if ctx.options.data_axis in mesh.names else None
    return Problem(mesh, decisions, index, terms, memory_limit, fixed_memory, canon, data_axis)


def _output_requirements(gm, ctx: Context) -> dict:
    """Per graph output: which mesh axes may keep a batch shard (the data axis, as with DDP)."""
    mesh, opts = ctx.mesh, ctx.options
    keep = tuple(opts.output_keep_data_shard and name == opts.data_axis for name in mesh.names)
    return {(n, pos): keep for n in gm.graph.nodes if n.op == "output" for pos, _ in enumerate(tensor_inputs(n))}


def output_spec_for(src: Spec, keep: tuple[bool, ...]) -> Spec:
    return tuple(p if (k and isinstance(p, Shard) and p.dim == 0) else Replicate() for p, k in zip(src, keep))


def _producer_options(u, cu, canon, index, decisions, term: ValueTerm) -> None:
    if u.op in ("placeholder",) or (u.op == "get_attr" and u.meta.get(M.SPEC) is not None):
        term.fixed = u.meta[M.SPEC]
        return
    if u.op == "get_attr":
        d = index[cu]
        term.out = [(d, k, s) for k, s in enumerate(decisions[d].options)]
        return
    if is_getitem(u):
        producer = u.args[0]
        d = index[_canon(canon, producer)]
        term.out = [(d, k, s.output_spec[u.args[1]]) for k, s in enumerate(decisions[d].options)]
        return
    d = index[cu]
    term.out = [(d, k, s.output_spec) for k, s in enumerate(decisions[d].options)]




# ---------------------------------------------------------------------------------------------------------
# Evaluating an assignment (the same objective the ILP minimises; used by tests and the explanations)
# ---------------------------------------------------------------------------------------------------------
INFEASIBLE = float("inf")
_DISP = bool(__import__("os").environ.get("AUTOSHARD_SOLVER_LOG"))


def term_cost(term: ValueTerm, choice: list[int]) -> float:
    if term.fixed is not None:
        o = term.fixed
    else:
        o = next(spec for d, k, spec in term.out if choice[d] == k)
    total = 0.0
    wanted = {i for i, users in term.needs.items() if any(choice[d] == k for d, k in users)}
    wanted |= {output_spec_for(o, keep) for keep in term.outputs}
    for i in wanted:
        c = term.pair_cost[(o, i)]
        if c is None:
            return INFEASIBLE
        total += c
    for key, users in term.syncs.items():
        if any(choice[d] == k for d, k in users):
            total += term.sync_cost[key]
    return term.multiplicity * total


def evaluate(problem: Problem, choice: list[int]) -> tuple[float, float]:
    """(estimated step time in seconds, per-rank memory in bytes) of one option per decision."""
    t = sum(d.cost[choice[i]] for i, d in enumerate(problem.decisions))
    t += sum(term_cost(term, choice) for term in problem.terms)
    mem = problem.fixed_memory + sum(d.memory[choice[i]] for i, d in enumerate(problem.decisions))
    return t, mem


# ---------------------------------------------------------------------------------------------------------
# The ILP
# ---------------------------------------------------------------------------------------------------------
def solve(problem: Problem, time_limit: float = 120.0, info: dict | None = None) -> list[int]:
    """One option per decision. ``info`` (when given) receives ``optimal`` (False when HiGHS stopped at
    ``time_limit`` seconds with a feasible plan that is not proven optimal), ``gap`` and ``message``."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    offsets, nvar = [], 0
    for d in problem.decisions:
        offsets.append(nvar)
        nvar += len(d.options)
    cost: list[float] = []
    for d in problem.decisions:
        cost.extend(d.cost)
    _break_ties(problem, cost)
    integer = [1] * nvar
    rows, cols, vals, lo, hi = [], [], [], [], []
    r = 0

    def new_var(c: float) -> int:
        nonlocal nvar
        cost.append(c)
        integer.append(0)
        nvar += 1
        return nvar - 1

    def constraint(entries, lb, ub):
        nonlocal r
        for col, v in entries:
            rows.append(r)
            cols.append(col)
            vals.append(v)
        lo.append(lb)
        hi.append(ub)
        r += 1

    for i, d in enumerate(problem.decisions):
        constraint([(offsets[i] + k, 1.0) for k in range(len(d.options))], 1.0, 1.0)

    for term in problem.terms:
        m = term.multiplicity
        if term.fixed is not None:
            y = {term.fixed: []}  # constant: always this spec
        else:
            y = {}
            for d, k, spec in term.out:
                y.setdefault(spec, []).append(offsets[d] + k)
        consumers = sorted({d for users in term.needs.values() for d, _ in users})
        if term.fixed is None and consumers and _single_position(term):
            # The tight "marginal" formulation (its LP is exact on tree-shaped parts of the graph): per consumer c,
            # e[c, o, i] >= 0 with sum_i e[c, o, i] = y[o] and sum_o e[c, o, i] = z[c, i] (the consumer's options
            # that need spec i); a redistribution o -> i is bought once, w[o, i] >= e[c, o, i] for every c.
            ylist = list(y.items())
            needed_by: dict = {}  # consumer -> specs it may need
            for i, users in term.needs.items():
                for d, _ in users:
                    needed_by.setdefault(d, set()).add(i)
            spec_id: dict = {}
            bought: dict = {}  # (producer spec index, needed spec id) -> variable
            for c in consumers:
                needs = sorted(needed_by[c], key=format_spec)
                ids = [spec_id.setdefault(i, len(spec_id)) for i in needs]
                evars: dict = {}  # (producer spec index, needs index) -> variable
                for oi, (o, _) in enumerate(ylist):
                    for ii, i in enumerate(needs):
                        pc = term.pair_cost[(o, i)]
                        if pc is None:
                            continue
                        if len(consumers) == 1:
                            evars[(oi, ii)] = new_var(m * pc)
                            continue
                        ev = evars[(oi, ii)] = new_var(0.0)
                        if pc > 0:
                            bv = bought.get((oi, ids[ii]))
                            if bv is None:
                                bv = bought[(oi, ids[ii])] = new_var(m * pc)
                            constraint([(bv, 1.0), (ev, -1.0)], 0.0, np.inf)
                for oi, (o, ys) in enumerate(ylist):
                    constraint([(evars[(oi, ii)], 1.0) for ii in range(len(needs)) if (oi, ii) in evars]
                               + [(v, -1.0) for v in ys], 0.0, 0.0)
                for ii, i in enumerate(needs):
                    constraint([(evars[(oi, ii)], 1.0) for oi in range(len(ylist)) if (oi, ii) in evars]
                               + [(offsets[d] + k, -1.0) for d, k in term.needs[i] if d == c], 0.0, 0.0)
            needs_items = []
        else:
            needs_items = sorted(term.needs.items(), key=lambda kv: format_spec(kv[0]))
        # redistributions wanted by consumers, shared between them
        for i, users in needs_items:
            costs = {o: term.pair_cost[(o, i)] for o in y}
            if all(c == 0 for c in costs.values()):
                continue
            rv = new_var(0.0)
            for d, ks in _by_decision(users).items():  # a consumer's options exclude each other: sum them
                constraint([(rv, 1.0)] + [(offsets[d] + k, -1.0) for k in ks], 0.0, np.inf)
            for o, ys in y.items():
                c = costs[o]
                if c == 0:
                    continue
                if term.fixed is not None:  # y is the constant 1
                    if c is None:
                        constraint([(rv, 1.0)], 0.0, 0.0)
                    else:
                        cost[rv] += m * c
                    continue
                if c is None:
                    constraint([(rv, 1.0)] + [(v, 1.0) for v in ys], -np.inf, 1.0)
                    continue
                qv = new_var(m * c)
                constraint([(qv, 1.0), (rv, -1.0)] + [(v, -1.0) for v in ys], -1.0, np.inf)
        # graph outputs: a cost that depends on the producer's spec only
        if term.outputs:
            for o, ys in y.items():
                c = sum((term.pair_cost[(o, output_spec_for(o, keep))] or 0.0) for keep in term.outputs)
                if any(term.pair_cost[(o, output_spec_for(o, keep))] is None for keep in term.outputs):
                    for v in ys:
                        constraint([(v, 1.0)], 0.0, 0.0)
                    continue
                if term.fixed is not None:
                    continue  # constant
                for v in ys:
                    cost[v] += m * c
        for key, users in sorted(term.syncs.items(), key=lambda kv: (format_spec(kv[0][0]), kv[0][1])):
            gv = new_var(m * term.sync_cost[key])
            for d, ks in _by_decision(users).items():
                constraint([(gv, 1.0)] + [(offsets[d] + k, -1.0) for k in ks], 0.0, np.inf)

    if problem.memory_limit is not None:
        entries = []
        for i, d in enumerate(problem.decisions):
            entries.extend((offsets[i] + k, mem) for k, mem in enumerate(d.memory) if mem)
        constraint(entries, -np.inf, problem.memory_limit - problem.fixed_memory)

    a = coo_matrix((vals, (rows, cols)), shape=(r, nvar)).tocsr()
    upper = np.ones(nvar)
    # HiGHS also stops at an absolute gap of 1e-6: in seconds that hides real differences, so solve in nanoseconds.
    c, cons, bounds = np.array(cost) * 1e9, LinearConstraint(a, lo, hi), Bounds(np.zeros(nvar), upper)
    integer = np.array(integer)
    # The LP relaxation first: the marginal formulation is usually tight, and an integral LP optimum is an optimum of
    # the integer program (it is feasible there, and no integer point beats the relaxation). Otherwise branch.
    res = milp(c, constraints=cons, integrality=np.zeros_like(integer), bounds=bounds,
               options={"time_limit": time_limit, "presolve": False, "disp": _DISP})
    if res.x is None or not _integral(res.x[integer == 1]):
        res = milp(c, constraints=cons, integrality=integer, bounds=bounds,
                   options={"mip_rel_gap": 0.0, "time_limit": time_limit, "presolve": False, "disp": _DISP})
    if res.x is None:
        limit = f" under the memory limit of {problem.memory_limit:.0f} bytes per rank" if problem.memory_limit else ""
        raise PlanError(f"the plan search found no valid plan{limit} ({res.message}). Raise memory_limit, use a "
                        "larger mesh, or relax the annotations.")
    if info is not None:
        info.update(optimal=res.status == 0, gap=float(getattr(res, "mip_gap", None) or 0.0), message=res.message)
    choice = []
    for i, d in enumerate(problem.decisions):
        vals_d = res.x[offsets[i]: offsets[i] + len(d.options)]
        choice.append(int(np.argmax(vals_d)))
    return choice


# ---------------------------------------------------------------------------------------------------------
# The pass
# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanSearch:
    """Choose every free strategy by the exact search above; propagation then applies the choices."""

    profile: object = "cpu-gloo"
    memory_limit: float | None = None
    optimizer: str = "adam"
    tie_layers: bool = True
    name: str = "plan_search"

    def run(self, gm: torch.fx.GraphModule, ctx: Context) -> torch.fx.GraphModule:
        profile = self.profile if isinstance(self.profile, HardwareProfile) else load_profile(self.profile)
        t0 = time.perf_counter()
        functionalize(gm)  # in-place writes on activations as functional ops, as propagation sees them
        mark_requires_grad(gm)
        seed_specs(gm, ctx)
        problem = build_problem(gm, ctx, profile, self.memory_limit, self.optimizer, self.tie_layers)
        t1 = time.perf_counter()
        with slow_step(f"autoshard: searching the best plan ({len(problem.decisions)} decisions)"):
            status: dict = {}
            choice = solve(problem, info=status)
        t2 = time.perf_counter()
        total, memory = evaluate(problem, choice)
        why = explain(problem, choice)
        for n in gm.graph.nodes:
            d = problem.index.get(_canon(problem.canon, n))
            if d is None or n.op not in ("call_function", "get_attr") or is_getitem(n):
                continue
            option = problem.decisions[d].options[choice[d]]
            if n.op == "get_attr":
                n.meta[M.SPEC] = option
                continue
            if n.meta.get(M.PLANNED) is None:  # planned before the search: propagation still checks it
                n.meta[M.PLANNED] = option
                n.meta[M.PLANNED_BY] = self.name
            n.meta[M.DECISION] = why[d]
        ctx.report[self.name] = {
            "step_time": total, "memory_per_rank": memory, "memory_limit": self.memory_limit,
            "profile": profile.name, "decisions": len(problem.decisions), "terms": len(problem.terms),
            "tied_nodes": len(problem.canon), "build_seconds": t1 - t0, "solve_seconds": t2 - t1,
            "binding": _binding(problem, memory),
            "optimal": status["optimal"], "gap": status["gap"],  # not optimal: HiGHS's time limit was reached
        }
        return gm


# Added to the solver's objective (not to ``evaluate``) per free parameter sharded on the data axis: among plans of
# equal estimated step time (e.g. tensor parallelism on `data` with the batch gathered, or the same on `model`),
# the one that leaves the data axis to the batch. 1e-12 s is far below any real cost difference (alpha ~1e-6 s,
# one flop ~1e-14 s but ops are >1e3 flops) and above the solver's tolerances (the objective is solved in ns).
TIE_BREAK = 1e-12


def _break_ties(problem: Problem, cost: list[float]) -> None:
    if problem.data_axis is None:
        return
    axis = problem.mesh.names.index(problem.data_axis)
    col = 0
    for d in problem.decisions:
        if d.node.op == "get_attr":
            for k, spec in enumerate(d.options):
                if isinstance(spec[axis], Shard):
                    cost[col + k] += TIE_BREAK * d.copies
        col += len(d.options)


def _integral(values: np.ndarray, tol: float = 1e-9) -> bool:
    return bool(np.all(np.minimum(np.abs(values), np.abs(values - 1.0)) <= tol))


def _by_decision(users) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for d, k in users:
        out.setdefault(d, []).append(k)
    return out


def _single_position(term: ValueTerm) -> bool:
    """Every consumer option needs exactly one spec of the value (no consumer reads it at two positions)."""
    seen = {}
    for i, users in term.needs.items():
        for d, k in users:
            if (d, k) in seen:
                return False
            seen[(d, k)] = i
    return True


def _binding(problem: Problem, memory: float) -> str:
    if problem.memory_limit is not None and memory >= 0.999 * problem.memory_limit:
        return "memory limit"
    return "step time (memory limit not binding)" if problem.memory_limit is not None else "step time"


def explain(problem: Problem, choice: list[int]) -> list[M.Decision]:
    """Per decision: its cost share and the best rejected option (cost if only this decision changed)."""
    touching: dict[int, list[ValueTerm]] = {}
    for term in problem.terms:
        ds = {d for d, _, _ in term.out} | {d for users in term.needs.values() for d, _ in users}
        ds |= {d for users in term.syncs.values() for d, _ in users}
        for d in ds:
            touching.setdefault(d, []).append(term)
    decisions: list[M.Decision] = []
    for i, d in enumerate(problem.decisions):
        terms = touching.get(i, [])

        def local(k):
            trial = list(choice)
            trial[i] = k
            return d.cost[k] + sum(term_cost(t, trial) for t in terms)

        here = local(choice[i])
        best_alt, best_cost = None, None
        for k in range(len(d.options)):
            if k == choice[i]:
                continue
            c = local(k)
            if c != INFEASIBLE and (best_cost is None or c < best_cost):
                best_alt, best_cost = d.options[k], c
        decisions.append(M.Decision(here, best_alt if isinstance(best_alt, M.Strategy) else None,
                                    best_cost, "least estimated step time"))
    return decisions
