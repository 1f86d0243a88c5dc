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

Memory options (``Options.zero`` and ``Options.recompute``, read by the pass):

* ``zero="auto"``: a parameter's options repeat each layout at ZeRO stages 0, 2 and 3 (where
  :func:`passes.shard_storage.stored_spec` can shard it): bytes by
  :func:`cost_models.memory.zero_state_bytes` (stage 2 keeps the gathered copy), seconds added to the gradient
  all-reduce the value terms already price: stage 2 ``all_gather_sync`` − all-reduce, stage 3
  ``all_gather_reshard`` − all-reduce (exact where the consumer syncs over the data axis, which it does whenever
  the batch is sharded there). The choice goes to ``shard_storage`` as ``meta[PLANNED_ZERO]`` on every copy.
  ``zero=1|2|3``: every shardable parameter's bytes are its stored state at that stage.
* ``recompute="auto"``: every copy of a repeated layer is a candidate (:class:`Unit`: the tied interior copies
  form one unit, a share of whose copies may be recomputed). Recomputed, a copy keeps only the outputs that leave
  it and costs its forward again. Chosen copies get ``meta[RECOMPUTE] = <the copy's module path>``.
* Fixed terms besides the sum (:func:`transient_bytes`): twice the largest layer's ZeRO-3 gathered copy, and the
  largest recomputed copy's activations while its backward runs.

What the sum does not model: it adds every saved activation and every gradient as if all were alive at once (a
peak per liveness point would not: gradients appear as activations are freed), counts each requires-grad op's
outputs whole (not only what autograd saves), and prices no allocator fragmentation or communication buffers. It
is an upper bound of a step's peak for what it counts.

Under a memory limit the search (:func:`search`) relaxes the memory row into the objective (Lagrangian
relaxation, ``min T + λ·M``, each λ solved from the previous HiGHS basis, two λ at a time), walks λ along the
breakpoints of the dual, repairs the plans it met with stage and recomputation moves that keep every layout
(:func:`_repair`), and reports the gap of the best plan to the best dual bound (for the recomputed layers it chose:
:func:`lp_bound` bounds every recomputation choice); HiGHS's exact ILP with the memory row runs only when a gap is
left, for ``exact_seconds``. A plan not proven optimal is reported (report ``optimal``, ``gap``) and warned about,
never silently used.

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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.fx
from autoshard.collectives import time as kind_time
from autoshard.cost_models.compute import compute_time
from autoshard.cost_models.memory import optimizer_state_bytes, zero_state_bytes
from autoshard.cost_models.plan_cost import (_link, _local_numel, grad_sync_time, op_times, redistribution_time_of,
                                             shard_factor)
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
    repeated layers of :func:`autoshard.layer_reuse.find_groups`."""
    from autoshard.layer_reuse import find_groups
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
    stages: list[int] | None = None  # parameters: the ZeRO stage of each option (options repeat a spec per stage)
    forward: list[float] | None = None  # ops: forward seconds of each option (what recomputing it costs again)
    memory_recomputed: list[float] | None = None  # ops in a recomputation unit: bytes when the unit is recomputed
    unit: int | None = None  # the recomputation unit (Problem.units) the op lies in


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
    by_option: tuple | None = field(default=None, repr=False, compare=False)  # term_cost's index, built once

    def index(self) -> tuple:
        """(producer decisions, {(d, k): spec out}, consumer decisions, {(d, k): specs needed}, {(d, k): sync keys}):
        what :func:`term_cost` looks up for a choice instead of scanning every option's users."""
        if self.by_option is None:
            out = {(d, k): spec for d, k, spec in self.out}
            need: dict = {}
            for i, users in self.needs.items():
                for dk in users:
                    need.setdefault(dk, []).append(i)
            sync: dict = {}
            for key, users in self.syncs.items():
                for dk in users:
                    sync.setdefault(dk, []).append(key)
            producers = sorted({d for d, _, _ in self.out})
            consumers = sorted({d for d, _ in need} | {d for d, _ in sync})
            self.by_option = (producers, out, consumers, need, sync)
        return self.by_option


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
    units: list = field(default_factory=list)  # recomputation candidates (Unit), when recompute="auto"
    gathered: dict = field(default_factory=dict)  # decision -> (layer key, compute bytes of one copy per option)


@dataclass
class Unit:
    """Copies of one layer that are recomputed alike (the interior copies of a tied layer, or one copy): each
    copy's module path (its own region id) and call_function nodes."""

    copies: dict[str, list[torch.fx.Node]] = field(default_factory=dict)


def _canon(canon, n):
    return canon.get(n, n)


def build_problem(gm: torch.fx.GraphModule, ctx: Context, profile: HardwareProfile, memory_limit, optimizer: str,
                  tie_layers: bool = True, zero: int | str = 0, recompute: str | None = None) -> Problem:
    """The program for ``gm``. ``zero``: 0 (parameters stored in their compute layout), 1-3 (every parameter that
    :func:`~autoshard.passes.shard_storage.stored_spec` can shard is stored at that stage: its memory counts the
    stored state) or "auto" (each parameter's options repeat each spec at stages 0, 2 and 3).
    ``recompute="auto"``: every copy of a repeated layer is a recomputation candidate (:class:`Unit`)."""
    from autoshard.passes.shard_storage import stored_spec

    mesh = ctx.mesh
    canon = find_layers(gm) if tie_layers else {}
    data_axis = ctx.options.data_axis if ctx.options.data_axis in mesh.names else None
    nd = mesh.axis_size(data_axis) if data_axis else 1
    link = _link(profile, mesh, data_axis) if data_axis else None
    units, unit_of, layer_of, copy_of = _units(gm, canon) if recompute == "auto" or zero in ("auto", 3) \
        else ([], {}, {}, {})
    if recompute != "auto":
        units, unit_of = [], {}
    pinned = pinned_values(gm)
    strict = {x: True for x, s in pinned.items() if s}  # annotated parameters: their layout is known now
    decisions: list[DecisionVar] = []
    index: dict[torch.fx.Node, int] = {}
    fixed_memory = 0.0
    gathered: dict = {}
    copies: dict[torch.fx.Node, int] = {}
    for n in gm.graph.nodes:
        c = _canon(canon, n)
        copies[c] = copies.get(c, 0) + 1

    def state_bytes(x: torch.fx.Node, spec: Spec, stage: int = 0) -> float:
        numel = _local_numel(shape(x), spec, mesh)
        if not x.meta.get(M.REQUIRES_GRAD):
            return float(numel * itemsize(x))
        if stage == 0:
            b = numel * itemsize(x)
            return float(2 * b + optimizer_state_bytes(b, optimizer))
        return float(sum(zero_state_bytes(numel, stage, nd, x.meta["val"].dtype, optimizer).values()))

    def stage_options(x: torch.fx.Node, specs: list) -> tuple[list, list[int]]:
        """Each spec at every stage it can be stored at (stage 0 alone for buffers and unshardable layouts)."""
        if zero == 0 or not x.meta.get(M.REQUIRES_GRAD) or data_axis is None:
            return specs, [0] * len(specs)
        wanted = (0, 2, 3) if zero == "auto" else (int(zero),)
        opts, stages = [], []
        for spec in specs:
            ok = stored_spec(spec, shape(x), mesh, data_axis) is not None
            for st in (wanted if ok else (0,)):
                opts.append(spec)
                stages.append(st)
        return opts, stages

    def stage_time(x: torch.fx.Node, spec: Spec, stage: int) -> float:
        """Seconds a stage adds to the data axis's gradient all-reduce (priced by the value terms): stage 2 an
        all-gather forward and a reduce-scatter backward in its place, stage 3 one more all-gather in backward."""
        if stage == 0:
            return 0.0
        b = _local_numel(shape(x), spec, mesh) * itemsize(x)
        kind = {1: "all_gather", 2: "all_gather_sync", 3: "all_gather_reshard"}[stage]
        extra = sum(kind_time(kind, b, nd, link))
        if stage > 1:
            extra -= kind_time("grad_all_reduce", b, nd, link)[1]
        return max(0.0, extra)

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
        dv = DecisionVar(n, strats, cost, mem, k)
        u = unit_of.get(n)
        if u is not None:
            # Recomputed, a unit keeps only what leaves it (its output, which the next layer saves as its input)
            dv.unit = u
            dv.memory_recomputed = mem if leaves_unit(n, copy_of[n]) else [0.0] * len(mem)
            fwd = compute_time(n, profile, 1)
            vals = [x.meta["val"] for x in tensor_inputs(n)] + out_vals(n)
            dv.forward = [k * fwd / shard_factor(n, s, mesh, vals) for s in strats]
        decisions.append(dv)

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
            c = _canon(canon, n)
            if c is not n:
                continue
            if n.meta.get(M.SPEC) is not None:  # annotated: its layout is fixed, its stage may not be
                options, stages = stage_options(n, [n.meta[M.SPEC]])
                if len(options) == 1:
                    fixed_memory += copies[n] * state_bytes(n, options[0], stages[0])
                    continue
            else:
                specs = sorted(wanted.get(n, []), key=lambda s: (sum(not isinstance(p, type(s[0])) for p in s),
                                                                  format_spec(s)))
                repl = tuple(p for p in specs[0]) if specs else None
                options, stages = stage_options(n, specs or [repl])
            index[n] = len(decisions)
            decisions.append(DecisionVar(n, options, [copies[n] * stage_time(n, s, st) for s, st in zip(options, stages)],
                                         [copies[n] * state_bytes(n, s, st) for s, st in zip(options, stages)],
                                         copies[n], stages=stages))
            if 3 in stages:
                gathered[len(decisions) - 1] = (layer_of.get(n, str(n.target)), [_local_numel(shape(n), s, mesh) * itemsize(n)
                                                              if st == 3 else 0 for s, st in zip(options, stages)])

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
    pair_costs: dict = {}  # (shape, itemsize, requires_grad) -> {(id(src), id(dst)): seconds}: values share shapes
    # Specs are interned (one object per distinct spec): the terms' dicts are keyed by spec pairs, and tuples of
    # DTensor placements compare element by element in Python unless they are the same objects.
    pool: dict = {}

    def intern(spec):
        return pool.setdefault(spec, spec)

    for (cu, _), members in groups.items():
        u = members[0]
        term = ValueTerm(cu, len(members), [], None, {}, {}, [], {}, {})
        _producer_options(u, cu, canon, index, decisions, term)
        if term.fixed is not None:
            term.fixed = intern(term.fixed)
        term.out = [(d, k, intern(o)) for d, k, o in term.out]
        seen: set = set()  # (spec, decision, option) and (spec, axes, decision, option) already listed
        for c, pos in consumers_of[u]:
            if c.op == "output":
                term.outputs.append(out_req[(c, pos)])
                continue
            d = index[_canon(canon, c)]
            for k, s in enumerate(decisions[d].options):
                i = intern(s.input_specs[pos])
                if (i, d, k) not in seen:  # copies of a tied layer read a shared value through the same variables
                    seen.add((i, d, k))
                    term.needs.setdefault(i, []).append((d, k))
                axes = tuple(s.grad_sync[pos]) if s.grad_sync else ()
                if axes and u.meta.get(M.REQUIRES_GRAD) and (i, axes, d, k) not in seen:
                    seen.add((i, axes, d, k))
                    term.syncs.setdefault((i, axes), []).append((d, k))
        outs = [term.fixed] if term.fixed is not None else sorted({o for _, _, o in term.out}, key=format_spec)
        value = (shape(u), itemsize(u), bool(u.meta.get(M.REQUIRES_GRAD)))
        costs = pair_costs.setdefault(value, {})
        needed = list(term.needs)
        for o in outs:
            targets = needed
            if term.outputs:
                extra = {id(x): x for x in (intern(output_spec_for(o, keep)) for keep in term.outputs)}
                targets = needed + [x for x in extra.values() if x not in term.needs]
            for i in targets:
                pc = costs.get((id(o), id(i)), costs)  # interned and kept alive by the pool: ids are keys
                if pc is costs:
                    pc = costs[(id(o), id(i))] = redistribution_time_of(o, i, *value, mesh, profile)
                if u in pinned and i in term.needs and not keeps_layout(o, i, pinned[u]):
                    pc = None  # computed only from annotated parameters: never gathered
                term.pair_cost[(o, i)] = pc
        for (i, axes) in term.syncs:
            term.sync_cost[(i, axes)] = grad_sync_time(i, axes, u, mesh, profile)
        terms.append(term)
    return Problem(mesh, decisions, index, terms, memory_limit, fixed_memory, canon, data_axis, units, gathered)


def _units(gm: torch.fx.GraphModule, canon: dict) -> tuple[list[Unit], dict, dict, dict]:
    """Recomputation units of the repeated layers (the interior copies tied by ``canon`` form one unit; every
    other copy one each), {canonical call_function node: unit index}, and {get_attr node: its layer copy's path}
    (what ZeRO-3 gathers at once), {canonical node: the nodes of its own copy}."""
    units: list[Unit] = []
    copy_of: dict[torch.fx.Node, frozenset] = {}
    unit_of: dict[torch.fx.Node, int] = {}
    layer_of: dict[torch.fx.Node, str] = {}
    targets = set(canon.values())
    for g, members in layer_copies(gm):
        tied: Unit | None = None
        for i, nodes in members.items():
            path = f"{g.prefix}.{i}" if g.prefix else i
            layer_of.update({n: path for n in nodes if n.op == "get_attr"})
            ops = [n for n in nodes if n.op == "call_function"]
            if not ops:
                continue
            if ops[0] in canon or ops[0] in targets:
                if tied is None:
                    tied = Unit()
                    units.append(tied)
                unit = tied
            else:
                unit = Unit()
                units.append(unit)
            unit.copies[path] = ops
            copy = frozenset(ops)
            for n in ops:
                if canon.get(n, n) is n:
                    unit_of[n] = next(k for k, x in enumerate(units) if x is unit)
                    copy_of[n] = copy
    return units, unit_of, layer_of, copy_of


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
_DEBUG = bool(__import__("os").environ.get("AUTOSHARD_SEARCH_DEBUG"))


def term_cost(term: ValueTerm, choice: list[int]) -> float:
    producers, out, consumers, need, sync = term.index()
    o = term.fixed if term.fixed is not None else next(out[(d, choice[d])] for d in producers if (d, choice[d]) in out)
    wanted: dict = {}  # the specs consumers need (interned: one object per spec, so keyed by id)
    keys: dict = {}
    for d in consumers:
        for i in need.get((d, choice[d]), ()):
            wanted[id(i)] = i
        for key in sync.get((d, choice[d]), ()):
            keys[id(key)] = key
    for keep in term.outputs:
        spec = output_spec_for(o, keep)
        if not any(spec == i for i in wanted.values()):
            wanted[id(spec)] = spec
    total = 0.0
    for i in wanted.values():
        c = term.pair_cost[(o, i)]
        if c is None:
            return INFEASIBLE
        total += c
    for key in keys.values():
        total += term.sync_cost[key]
    return term.multiplicity * total


def evaluate(problem: Problem, choice: list[int], recompute=frozenset()) -> tuple[float, float]:
    """(estimated step time in seconds, per-rank memory in bytes) of one option per decision, the units in
    ``recompute`` recomputed (memory: the sum plus :func:`transient_bytes`)."""
    t = sum(option_cost(d, recompute)[choice[i]] for i, d in enumerate(problem.decisions))
    t += sum(term_cost(term, choice) for term in problem.terms)
    mem = problem.fixed_memory + sum(option_memory(d, recompute)[choice[i]] for i, d in enumerate(problem.decisions))
    return t, mem + transient_bytes(problem, choice, recompute)


# ---------------------------------------------------------------------------------------------------------
# The ILP
# ---------------------------------------------------------------------------------------------------------
def _share(d: DecisionVar, recompute) -> float:
    """The share of ``d``'s copies recomputed: ``recompute`` is a set of units (all their copies) or a mapping
    {unit: share of its copies}."""
    if d.unit is None:
        return 0.0
    if isinstance(recompute, dict):
        return recompute.get(d.unit, 0.0)
    return 1.0 if d.unit in recompute else 0.0


def option_cost(d: DecisionVar, recompute=frozenset()) -> list[float]:
    """Seconds of each option of ``d``, its unit's forward run again in backward when the unit is recomputed."""
    f = _share(d, recompute)
    return d.cost if not f else [c + f * x for c, x in zip(d.cost, d.forward)]


def option_memory(d: DecisionVar, recompute=frozenset()) -> list[float]:
    f = _share(d, recompute)
    return d.memory if not f else [(1 - f) * m + f * r for m, r in zip(d.memory, d.memory_recomputed)]


def transient_bytes(problem: Problem, choice: list[int], recompute=frozenset()) -> float:
    """Bytes alive at the peak besides the sum: the ZeRO-3 copies of the largest layer gathered at once (twice: one
    layer prefetched while the other computes) and, with recomputation, the activations of the largest recomputed
    layer copy, alive again while its backward runs."""
    per_layer: dict = {}
    for d, (layer, gathered) in problem.gathered.items():
        per_layer[layer] = per_layer.get(layer, 0.0) + gathered[choice[d]]
    peak = 2 * max(per_layer.values(), default=0.0)
    live: dict = {}
    for i, d in enumerate(problem.decisions):
        if _share(d, recompute):
            live[d.unit] = live.get(d.unit, 0.0) + d.memory[choice[i]] / (d.copies or 1)
    return peak + max(live.values(), default=0.0)


@dataclass
class _Program:
    """The ILP of a problem for one recomputation set, built once and solved for many objectives."""

    c: np.ndarray  # seconds per variable (ties broken)
    mem: np.ndarray  # bytes per variable (option variables only)
    a: object
    lo: list
    hi: list
    integer: np.ndarray
    offsets: list[int]


def solve(problem: Problem, time_limit: float = 120.0, info: dict | None = None, recompute=frozenset(),
          reserve: float = 0.0) -> list[int]:
    """One option per decision: the exact optimum of the ILP with the memory row (``memory_limit`` less
    ``reserve`` bytes, less the fixed memory). ``info`` (when given) receives ``optimal`` (False when HiGHS stopped
    at ``time_limit`` seconds with a feasible plan that is not proven optimal), ``gap`` and ``message``."""
    prog = _program(problem, recompute, reserve)
    return _solve_program(problem, prog, prog.c, True, time_limit, info)


def _option_vectors(problem: Problem, recompute) -> tuple[list[float], list[float]]:
    """Seconds (ties broken) and bytes of every option variable, in column order."""
    cost: list[float] = []
    memory: list[float] = []
    for d in problem.decisions:
        cost.extend(option_cost(d, recompute))
        memory.extend(option_memory(d, recompute))
    _break_ties(problem, cost)
    return cost, memory


def _program(problem: Problem, recompute=frozenset(), reserve: float = 0.0, memory_row: bool = True) -> _Program:
    from scipy.sparse import coo_matrix

    offsets, nvar = [], 0
    for d in problem.decisions:
        offsets.append(nvar)
        nvar += len(d.options)
    cost, memory = _option_vectors(problem, recompute)
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
            # build_problem interns specs (one object per spec): look pairs up by identity, not by hashing
            # placements (the program's largest loop: a pair per producer spec, needed spec and consumer)
            pair_cost = {(id(o), id(i)): v for (o, i), v in term.pair_cost.items()}
            for c in consumers:
                needs = sorted(needed_by[c], key=format_spec)
                ids = [spec_id.setdefault(i, len(spec_id)) for i in needs]
                evars: dict = {}  # (producer spec index, needs index) -> variable
                for oi, (o, _) in enumerate(ylist):
                    for ii, i in enumerate(needs):
                        pc = pair_cost[(id(o), id(i))]
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

    if problem.memory_limit is not None and memory_row:
        entries = [(col, m) for col, m in enumerate(memory) if m]
        constraint(entries, -np.inf, problem.memory_limit - problem.fixed_memory - reserve)

    a = coo_matrix((vals, (rows, cols)), shape=(r, nvar)).tocsr()
    mem = np.zeros(nvar)
    mem[:len(memory)] = memory
    return _Program(np.array(cost), mem, a, lo, hi, np.array(integer), offsets)


def _solve_program(problem: Problem, prog: _Program, cost: np.ndarray, raise_infeasible: bool, time_limit: float,
                   info: dict | None = None) -> list[int] | None:
    from scipy.optimize import Bounds, LinearConstraint, milp

    nvar = len(cost)
    # HiGHS also stops at an absolute gap of 1e-6: in seconds that hides real differences, so solve in nanoseconds.
    c, cons, bounds = cost * 1e9, LinearConstraint(prog.a, prog.lo, prog.hi), Bounds(np.zeros(nvar), np.ones(nvar))
    integer = prog.integer
    started = time.perf_counter()
    # The LP relaxation first: the marginal formulation is usually tight, and an integral LP optimum is an optimum of
    # the integer program (it is feasible there, and no integer point beats the relaxation). Otherwise branch.
    res = milp(c, constraints=cons, integrality=np.zeros_like(integer), bounds=bounds,
               options={"time_limit": time_limit, "presolve": False, "disp": _DISP})
    if _DEBUG:
        print("LP", res.status, None if res.x is None else _integral(res.x[integer == 1]), time.perf_counter())
    if res.x is None or not _integral(res.x[integer == 1]):
        left = max(0.1, time_limit - (time.perf_counter() - started))  # one time limit for both calls
        res = milp(c, constraints=cons, integrality=integer, bounds=bounds,
                   options={"mip_rel_gap": 0.0, "time_limit": left, "presolve": False, "disp": _DISP})
        if _DEBUG:
            print("MILP", res.status, time.perf_counter())
    if res.x is None:
        if not raise_infeasible:
            return None
        limit = f" under the memory limit of {problem.memory_limit:.0f} bytes per rank" if problem.memory_limit else ""
        raise PlanError(f"the plan search found no valid plan{limit} ({res.message}). Raise memory_limit, use a "
                        "larger mesh, or relax the annotations.")
    if info is not None:
        info.update(optimal=res.status == 0, gap=float(getattr(res, "mip_gap", None) or 0.0), message=res.message)
    choice = []
    for i, d in enumerate(problem.decisions):
        vals_d = res.x[prog.offsets[i]: prog.offsets[i] + len(d.options)]
        choice.append(int(np.argmax(vals_d)))
    return choice


# ---------------------------------------------------------------------------------------------------------
# Under a memory limit: Lagrangian relaxation of the memory row, then the exact ILP only if a gap is left
# ---------------------------------------------------------------------------------------------------------
#: relative gap below which a plan counts as optimal (the solver's own tolerances are ~1e-9 of the objective)
GAP_TOLERANCE = 1e-6


DEFAULT_TIME_LIMIT = 120.0


def search(problem: Problem, time_limit: float | None = None, info: dict | None = None, exact_limit: float = np.inf,
           accept_gap: float = 0.0) -> tuple[list[int], frozenset | dict]:
    """(option per decision, recomputed units): the least estimated step time with ``evaluate``'s memory within
    ``problem.memory_limit``.

    Without a limit, or when the unconstrained optimum fits, that is the exact ILP of :func:`solve`. Otherwise the
    memory row is relaxed into the objective, ``min T(x) + λ·M(x)`` (the program without the memory row keeps its
    tight structure and solves like the unconstrained one, from the previous HiGHS basis), and λ moves along the
    breakpoints of the concave dual ``L(λ) = min T + λ(M − limit)``: from the least-time (infeasible) plan and a
    feasible one, λ is the slope between the plans nearest the limit on either side, until no plan lies below that
    line. Each round solves two multipliers at once on two HiGHS copies (HiGHS releases the GIL): beside the slope,
    the midpoint of the multipliers those two plans were found at (and, in the first round, half the first λ).
    Recomputation units are chosen per λ by coordinate descent (a unit is recomputed when λ times the bytes it
    frees exceeds its extra forward time; the first guess is what the feasible plan would recompute). Every plan
    met is repaired to fit (:func:`_repair`) and the best kept; the loop stops once it is within ``accept_gap`` of
    the best ``L(λ)``. That bound holds for the recomputed units the walk chose at each λ, not for every
    recomputation choice (:func:`lp_bound` is one for every choice, ~3× slower per λ; ``bench/search_plans.py``
    prints both). Only when the gap exceeds ``accept_gap`` does HiGHS solve the exact ILP with the memory row (for
    the best plan's units) for ``exact_limit``, when that budget is worth at least ten relaxed solves (a program
    whose LP takes 1 s needs far longer to branch); a gap still left is reported (``info``: optimal, gap, bound,
    multiplier, method).
    """
    start = time.perf_counter()
    info = info if info is not None else {}
    limit = problem.memory_limit
    total = DEFAULT_TIME_LIMIT if time_limit is None else time_limit
    if limit is None:  # (no time_limit: solve's own default, 120 s)
        choice = solve(problem, info=info) if time_limit is None else solve(problem, time_limit=time_limit, info=info)
        info.update(method="ilp", bound=evaluate(problem, choice)[0])
        return choice, frozenset()
    programs: dict = {}
    base_options = None

    def program_for(units) -> _Program:
        # one program for every recomputation choice: only the option columns' seconds and bytes depend on it
        nonlocal base_options
        if not programs:
            prog = _program(problem, frozenset(), memory_row=False)
            programs["warm"] = (prog, _WarmLP.create(prog))
            programs[frozenset()] = prog
            base_options = np.array(_option_vectors(problem, frozenset())[0])
        base = programs["warm"][0]
        key = tuple(sorted(units.items())) if isinstance(units, dict) else units
        if key not in programs:
            c, mem = _option_vectors(problem, units)
            cost = base.c.copy()  # (option columns also carry costs of graph outputs: add the difference)
            cost[:len(c)] += np.array(c) - base_options
            memory = np.zeros(len(cost))
            memory[:len(mem)] = mem
            programs[key] = _Program(cost, memory, base.a, base.lo, base.hi, base.integer, base.offsets)
        return programs[key]

    copies: list = []  # a second HiGHS copy of the program: two multipliers solve at once (HiGHS releases the GIL)

    def relaxed(lam: float, units, memory_only: float = 0.0, solver: int = 0) -> list[int]:
        prog = program_for(units)
        warm = programs["warm"][1] if solver == 0 else copies[0]
        left = max(1.0, total - (time.perf_counter() - start))
        cost = prog.c + lam * prog.mem if not memory_only else prog.mem / memory_only + prog.c * 1e-6 / lo[2]
        x = warm.solve(cost, left) if warm is not None else None
        if x is not None and _integral(x[prog.integer == 1]):  # an integral LP optimum is an ILP optimum
            return [int(np.argmax(x[o: o + len(d.options)])) for o, d in zip(prog.offsets, problem.decisions)]
        return _solve_program(problem, prog, cost, True, left)

    def point(lam: float, units=frozenset(), solver: int = 0):
        for _ in range(4):  # coordinate descent over the recomputed units
            choice = relaxed(lam, units, solver=solver)
            better = _best_units(problem, choice, lam)
            if better == units:
                break
            units = better
        t, m = evaluate(problem, choice, units)
        # (m less the transient bytes is what λ multiplies)
        return choice, units, t, m, m - transient_bytes(problem, choice, units), lam

    def points(first: tuple, second: tuple | None) -> list:
        """``point(*first)`` and, on the second HiGHS copy at the same time, ``point(*second)``."""
        if second is None or not copies:
            return [point(*first)]
        with ThreadPoolExecutor(max_workers=1) as pool:
            other = pool.submit(point, *second, 1)
            return [point(*first), other.result()]

    lp_start = time.perf_counter()
    lo = point(0.0)
    one_solve = time.perf_counter() - lp_start  # what one relaxed solve of this program costs
    if lo[3] <= limit:
        info.update(optimal=True, gap=0.0, bound=lo[2], method="unconstrained optimum within the limit")
        return lo[0], lo[1]
    warm = programs["warm"][1]
    if warm is not None:  # the second copy starts from the first's optimal basis
        copies.append(warm.copy(programs["warm"][0]))
    seen = [lo]

    def closest(candidates):
        """(lo, hi): the plan over the limit with the least memory and the plan within it with the most (the
        neighbours of the limit on the lower hull of the plans seen)."""
        over = [p for p in candidates if p[3] > limit]
        within = [p for p in candidates if p[3] <= limit]
        return (min(over, key=lambda p: p[3]) if over else None), (max(within, key=lambda p: p[3]) if within else None)

    # λ in units of the least-time plan's seconds per byte, raised until memory outweighs time enough to fit; a
    # second probe at half that λ brackets the limit from below (a plan over the limit, but nearer to it than lo)
    everything = frozenset(range(len(problem.units)))
    hi = None
    for scale in (1.0, 10.0, 100.0, 1e3, 1e4):
        lam = scale * lo[2] / lo[4]
        seen += points((lam, everything), (lam / 2, everything))
        lo, hi = closest(seen)
        if hi is not None:
            break
    else:  # the least memory any plan needs (time only breaks ties), for the message
        choice = relaxed(0.0, everything, memory_only=seen[0][4])
        t, m = evaluate(problem, choice, everything)
        hi = (choice, everything, t, m, m, np.inf)
    if hi[3] > limit:
        error = PlanError(
            f"option memory_limit is {_fmt_bytes(limit)} per rank, but the least memory any plan needs is "
            f"{_fmt_bytes(hi[3])} per rank ({_fmt_bytes(problem.fixed_memory)} of it fixed by annotations and "
            f"buffers). Raise memory_limit to at least {_fmt_bytes(hi[3])}, or use a larger mesh"
            + ("" if problem.units else ", recompute='auto' (recompute layers in backward)")
            + ("" if any(d.stages and max(d.stages) > 0 for d in problem.decisions)
               else ", zero='auto' (store parameters sharded over the data axis)") + ".")
        error.least_memory = hi[3]  # bytes per rank, by the search's memory model
        raise error
    best, bound, solves, multiplier = hi, -np.inf, len(seen), hi[5]

    def repaired(p) -> None:
        # every plan met is repaired at once (cheap next to a solve), so that accept_gap can stop the loop early
        nonlocal best
        fixed = _repair(problem, p[0], p[1])
        if fixed is not None and fixed[2] < best[2]:
            best = (*fixed, None, None)

    for p in seen:
        repaired(p)
    while time.perf_counter() - start < total:
        lam = (hi[2] - lo[2]) / max(lo[4] - hi[4], 1e-30)
        if not lam > 0:
            break  # (a plan over the limit that is slower than one within it: the walk has nothing left to cut)
        # beside the cutting-plane multiplier, the midpoint of the multipliers lo and hi were found at
        mid = (lo[5] + hi[5]) / 2 if np.isfinite(hi[5]) else None
        second = (mid, _best_units(problem, hi[0], mid)) if mid and abs(mid - lam) > 0.1 * lam else None
        xs = points((lam, _best_units(problem, hi[0], lam)), second)  # the units hi's plan would recompute
        solves += len(xs)
        x = xs[0]
        for p in xs:
            b = min(p[2] + p[5] * p[4], lo[2] + p[5] * lo[4]) - p[5] * limit
            if b > bound:
                bound, multiplier = b, p[5]
            repaired(p)
        if _DEBUG:
            for p in xs:
                print(f"λ={p[5]:.3e} t={p[2]:.6f} m={p[3]:.4e} bound={bound:.6f} best={best[2]:.6f}")
        line = lo[2] + lam * lo[4]
        if x[2] + lam * x[4] >= line - GAP_TOLERANCE * abs(line):
            break  # nothing below the segment: λ is the best multiplier
        lo, hi = (q if q is not None else old for q, old in zip(closest([lo, hi, *xs]), (lo, hi)))
        best = min([best, *(p for p in xs if p[3] <= limit)], key=lambda p: p[2])
        if best[2] > 0 and (best[2] - bound) / best[2] <= accept_gap:
            break  # close enough to the lower bound (accept_gap): no more multipliers
    gap = max(0.0, (best[2] - bound) / best[2]) if best[2] > 0 else 0.0
    info.update(optimal=gap <= GAP_TOLERANCE, gap=gap, bound=bound, method=f"lagrangian ({solves} solves) + repair",
                lagrangian_seconds=time.perf_counter() - start, multiplier=multiplier)
    left = min(total - (time.perf_counter() - start), exact_limit)
    # The exact ILP branches on top of the LP: a budget under ~10 relaxed solves of this program closes no gap
    if gap <= accept_gap and gap > GAP_TOLERANCE:
        info.update(method=info["method"] + f" (gap within accept_gap={accept_gap:.0%}: no exact ILP)")
    elif gap > GAP_TOLERANCE and left > max(0.5, 10 * one_solve):
        exact: dict = {}
        # the relaxed program plus the memory row (less the transient bytes of the best plan), for best's units
        prog = program_for(best[1])
        from scipy.sparse import csr_matrix, vstack

        room = limit - problem.fixed_memory - transient_bytes(problem, best[0], best[1])
        with_row = _Program(prog.c, prog.mem, vstack([prog.a, csr_matrix(prog.mem)]).tocsr(), [*prog.lo, -np.inf],
                            [*prog.hi, room], prog.integer, prog.offsets)
        choice = _solve_program(problem, with_row, with_row.c, False, left, exact)
        if choice is None:
            info.update(method=info["method"] + f" + exact ILP (no better plan in {left:.1f} s)")
        else:
            t, m = evaluate(problem, choice, best[1])
            if exact.get("optimal"):
                bound = max(bound, t)  # the optimum for this recomputation choice
            else:
                bound = max(bound, t * (1 - exact.get("gap", 1.0)))
            if m <= limit and t <= best[2] * (1 + 1e-12):  # on a tie, the exact one: it breaks ties (_break_ties)
                best = (choice, best[1], t, m)
            gap = max(0.0, (best[2] - bound) / best[2]) if best[2] > 0 else 0.0
            info.update(optimal=gap <= GAP_TOLERANCE, gap=gap, bound=bound, method=info["method"] + " + exact ILP",
                        message=exact.get("message"))
    if problem.units and info.get("optimal"):
        # proven for the recomputed units the walk chose, not over every recomputation choice (lp_bound is)
        info.update(optimal=False, method=info["method"] + " (optimal for the recomputed layers chosen)")
    return best[0], best[1]


def lp_bound(problem: Problem, lam: float) -> float:
    """A lower bound of the least estimated step time of every plan within ``problem.memory_limit``, every
    recomputation choice included: ``L(λ) = min T + λ·(M − room)`` over the LP relaxation of the program with each
    unit's recomputed share a variable (``r[u] ∈ [0, 1]``; per op ``d`` of the unit and option ``k`` a share
    ``z[d, k] ≤ x[d, k]`` with ``Σ_k z[d, k] = r[u]``, costing the option's forward again and freeing
    ``memory[k] − memory_recomputed[k]`` bytes: where ``x`` is integral that is the product ``r[u]·x[d, k]``,
    linear), less the most the tie-breaking costs add. :func:`search`'s own bound fixes the recomputed units at each
    λ (coordinate descent) and so may overstate this one; solving this program takes ~3× longer per λ, so the
    search does not (``bench/search_plans.py`` prints both)."""
    from scipy.sparse import coo_matrix, hstack, vstack

    base = _program(problem, memory_row=False)
    n0 = base.a.shape[1]
    cost, mem = list(base.c), list(base.mem)
    rows, cols, vals, lo, hi = [], [], [], [], []

    def new_var(c: float, m: float) -> int:
        cost.append(c)
        mem.append(m)
        return len(cost) - 1

    def constraint(entries, lb, ub):
        for col, v in entries:
            rows.append(len(lo))
            cols.append(col)
            vals.append(v)
        lo.append(lb)
        hi.append(ub)

    share = {u: new_var(0.0, 0.0) for u in range(len(problem.units))}
    for i, d in enumerate(problem.decisions):
        if d.unit is None:
            continue
        zs = []
        for k in range(len(d.options)):
            zs.append(new_var(d.forward[k], d.memory_recomputed[k] - d.memory[k]))
            constraint([(zs[-1], 1.0), (base.offsets[i] + k, -1.0)], -np.inf, 0.0)
        constraint([(z, 1.0) for z in zs] + [(share[d.unit], -1.0)], 0.0, 0.0)
    n = len(cost)
    extra = coo_matrix((vals, (rows, cols)), shape=(len(lo), n))
    a = vstack([hstack([base.a, coo_matrix((base.a.shape[0], n - n0))]), extra]).tocsr()
    prog = _Program(np.array(cost), np.array(mem), a, [*base.lo, *lo], [*base.hi, *hi],
                    np.zeros(n, dtype=int), base.offsets)
    warm = _WarmLP.create(prog)
    objective = prog.c + lam * prog.mem
    x = warm.solve(objective, DEFAULT_TIME_LIMIT) if warm is not None else None
    if x is None:
        raise PlanError("lp_bound: HiGHS did not solve the program (it needs scipy.optimize._highspy)")
    ties = sum(max(_ties(problem, d), default=0.0) for d in problem.decisions)  # the most they add to a plan
    return float(objective @ x) - lam * (problem.memory_limit - problem.fixed_memory) - ties


def _repair(problem: Problem, choice: list[int], units) -> tuple | None:
    """A plan within the limit from ``choice`` by local moves that keep every layout: a parameter's ZeRO stage, or
    one more (or one fewer) copy of a unit recomputed. Infeasible: apply the move of least seconds added per byte
    freed until it fits; then take the moves that save time most while it still fits, then pairs of moves (one
    saving time, one freeing the bytes it needs). (The Lagrangian plans are optimal for their λ, but their memory
    jumps in steps; these moves fill the slack between the steps.) ``units``: a set of units recomputed whole, or
    {unit: share of its copies}. Returns (choice, shares, seconds, bytes) or None."""
    limit = problem.memory_limit
    choice = list(choice)
    share = {u: (float(units.get(u, 0.0)) if isinstance(units, dict) else float(u in units))
             for u in range(len(problem.units))}
    members: dict = {}
    for i, d in enumerate(problem.decisions):
        if d.unit is not None:
            members.setdefault(d.unit, []).append(i)
    staged = [i for i, d in enumerate(problem.decisions) if d.stages]

    def moves():
        for i in staged:
            d, k = problem.decisions[i], choice[i]
            for k2, spec in enumerate(d.options):
                if k2 != k and spec == d.options[k]:
                    yield ("stage", i, k2), d.cost[k2] - d.cost[k], d.memory[k2] - d.memory[k]
        for u, ds in members.items():
            step = 1.0 / len(problem.units[u].copies)
            dt = step * sum(problem.decisions[i].forward[choice[i]] for i in ds)
            dm = step * sum(problem.decisions[i].memory_recomputed[choice[i]] - problem.decisions[i].memory[choice[i]]
                            for i in ds)
            if share[u] < 1.0 - 1e-9:
                yield ("unit", u, min(1.0, share[u] + step)), dt, dm
            if share[u] > 1e-9:
                yield ("unit", u, max(0.0, share[u] - step)), -dt, -dm

    def apply(move):
        kind, a, b = move
        old = choice[a] if kind == "stage" else share[a]
        if kind == "stage":
            choice[a] = b
        else:
            share[a] = b
        return kind, a, old

    def undo(saved):
        kind, a, old = saved
        if kind == "stage":
            choice[a] = old
        else:
            share[a] = old

    comm = sum(term_cost(term, choice) for term in problem.terms)  # the moves keep every layout

    def evaluate_(choice, share):
        # evaluate() with the communication fixed: option_cost/option_memory of the chosen option only (this runs
        # hundreds of times per repair; building every option's list each time was its cost)
        t, m = comm, problem.fixed_memory
        for i, d in enumerate(problem.decisions):
            k = choice[i]
            f = share[d.unit] if d.unit is not None else 0.0
            if f:
                t += d.cost[k] + f * d.forward[k]
                m += (1 - f) * d.memory[k] + f * d.memory_recomputed[k]
            else:
                t += d.cost[k]
                m += d.memory[k]
        return t, m + transient_bytes(problem, choice, share)

    t, m = evaluate_(choice, share)
    while m > limit:
        freeing = [(dt / -dm, mv) for mv, dt, dm in moves() if dm < 0]
        if not freeing:
            return None
        apply(min(freeing, key=lambda x: x[0])[1])
        t, m = evaluate_(choice, share)
    improved = True
    while improved:
        improved = False
        listed = list(moves())
        for _, mv in sorted((dt, mv) for mv, dt, dm in listed if dt < 0):
            saved = apply(mv)
            t2, m2 = evaluate_(choice, share)
            if m2 <= limit and t2 < t:
                t, m, improved = t2, m2, True
                break
            undo(saved)
        if improved:
            continue
        # pairs: a move saving time whose bytes another frees (linear estimate first, then evaluated exactly)
        saving = sorted((dt, dm, mv) for mv, dt, dm in listed if dt < 0)
        freeing = sorted((dt, dm, mv) for mv, dt, dm in listed if dm < 0 and dt >= 0)
        for dt1, dm1, mv1 in saving:
            for dt2, dm2, mv2 in freeing:
                if dt1 + dt2 >= 0 or m + dm1 + dm2 > limit or mv1[:2] == mv2[:2]:
                    continue
                saved1, saved2 = apply(mv1), apply(mv2)
                t2, m2 = evaluate_(choice, share)
                if m2 <= limit and t2 < t:
                    t, m, improved = t2, m2, True
                    break
                undo(saved2)
                undo(saved1)
            if improved:
                break
    return choice, share, t, m


class _WarmLP:
    """The LP relaxation of one program kept inside HiGHS, so that a new objective (another λ) is solved from the
    previous optimal basis: a few simplex pivots instead of a solve from scratch. Uses the HiGHS object that scipy
    ships (``scipy.optimize._highspy``); where that is missing, :meth:`create` returns None and every λ is solved
    anew by ``milp``."""

    def __init__(self, highs, n: int):
        self.highs, self.n = highs, n

    @classmethod
    def create(cls, prog: _Program):
        try:
            from scipy.optimize._highspy import _core as h
        except ImportError:
            return None
        a = prog.a.tocsc()
        n = a.shape[1]
        lp = h.HighsLp()
        lp.num_col_, lp.num_row_ = n, a.shape[0]
        lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = n, a.shape[0]
        lp.a_matrix_.format_ = h.MatrixFormat.kColwise
        lp.col_cost_ = prog.c * 1e9
        lp.col_lower_, lp.col_upper_ = np.zeros(n), np.ones(n)
        inf = h.kHighsInf
        lp.row_lower_ = np.array([max(x, -inf) for x in prog.lo], dtype=float)
        lp.row_upper_ = np.array([min(x, inf) for x in prog.hi], dtype=float)
        lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = a.indptr, a.indices, a.data
        highs = h._Highs()
        highs.setOptionValue("output_flag", _DISP)
        highs.setOptionValue("presolve", "off")
        highs.passModel(lp)
        return cls(highs, n)

    def copy(self, prog: _Program) -> _WarmLP:
        """Another HiGHS object for the same program, starting from this one's current basis."""
        other = type(self).create(prog)
        other.highs.setBasis(self.highs.getBasis())
        return other

    def solve(self, cost: np.ndarray, time_limit: float) -> np.ndarray | None:
        from scipy.optimize._highspy import _core as h

        self.highs.changeColsCost(self.n, np.arange(self.n, dtype=np.int32), cost * 1e9)
        self.highs.setOptionValue("time_limit", float(time_limit))
        self.highs.run()
        if _DEBUG:
            print("warm LP", self.highs.getModelStatus(), self.highs.getInfo().simplex_iteration_count, time.perf_counter())
        if self.highs.getModelStatus() != h.HighsModelStatus.kOptimal:
            return None
        return np.array(self.highs.getSolution().col_value)


def _best_units(problem: Problem, choice: list[int], lam: float) -> frozenset:
    saving: dict = {}
    extra: dict = {}
    for i, d in enumerate(problem.decisions):
        if d.unit is None:
            continue
        k = choice[i]
        saving[d.unit] = saving.get(d.unit, 0.0) + d.memory[k] - d.memory_recomputed[k]
        extra[d.unit] = extra.get(d.unit, 0.0) + d.forward[k]
    return frozenset(u for u in saving if lam * saving[u] > extra[u])


def _fmt_bytes(b: float) -> str:
    if b >= 2**30:
        return f"{b / 2**30:.2f} GiB"
    return f"{b / 2**20:.2f} MiB" if b >= 2**20 else f"{b / 2**10:.1f} KiB"


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
    time_limit: float | None = None  # seconds for the whole search (None: 120); a plan stopped by it reports its gap
    #: under a memory limit: seconds for the exact ILP after the Lagrangian search, when that leaves a gap
    exact_seconds: float = 2.0
    #: under a memory limit: a Lagrangian plan this close to the lower bound is taken without the exact ILP (like a
    #: MIP gap tolerance; the gap is reported and warned about all the same). 2 s of exact ILP did not close the
    #: Llama-3-8B/70B gaps (0.81%, 0.48%) in bench/search_plans.py; 0 always tries it.
    accept_gap: float = 0.01
    name: str = "plan_search"

    def run(self, gm: torch.fx.GraphModule, ctx: Context) -> torch.fx.GraphModule:
        profile = self.profile if isinstance(self.profile, HardwareProfile) else load_profile(self.profile)
        t0, cpu0 = time.perf_counter(), time.process_time()
        functionalize(gm)  # in-place writes on activations as functional ops, as propagation sees them
        mark_requires_grad(gm)
        seed_specs(gm, ctx)
        zero, recompute = ctx.options.zero, ctx.options.recompute
        problem = build_problem(gm, ctx, profile, self.memory_limit, self.optimizer, self.tie_layers,
                                zero=zero if zero in (0, 1, 2, 3, "auto") else 0, recompute=recompute)
        t1 = time.perf_counter()
        with slow_step(f"autoshard: searching the best plan ({len(problem.decisions)} decisions)"):
            status: dict = {}
            choice, units = search(problem, self.time_limit, status, self.exact_seconds, self.accept_gap)
        t2 = time.perf_counter()
        total, memory = evaluate(problem, choice, units)
        why = explain(problem, choice)
        if not status["optimal"]:
            scope = ("every plan" if not problem.units else "the plans recomputing the layers the walk chose (the "
                     "bound does not range over other recomputation choices)")
            ctx.warn(f"plan_search: the plan is not proven optimal under memory_limit: its estimated step time is at "
                     f"most {status['gap']:.2%} above the Lagrangian lower bound of {scope} ({status['method']}; the "
                     "exact ILP gets "
                     f"exact_seconds={self.exact_seconds:g} s of time_limit="
                     f"{self.time_limit or DEFAULT_TIME_LIMIT:g} s, only when the gap exceeds accept_gap="
                     f"{self.accept_gap:.0%} and the budget is worth ten LP solves); it is used as it is.")
        stages: dict[str, int] = {}
        for n in gm.graph.nodes:
            if n.op != "get_attr" or not n.meta.get(M.REQUIRES_GRAD) or not is_tensor_node(n):
                continue
            d = problem.index.get(_canon(problem.canon, n))
            dv = problem.decisions[d] if d is not None else None
            stage = dv.stages[choice[d]] if dv is not None and dv.stages else 0
            if zero == "auto":
                n.meta[M.PLANNED_ZERO] = stage
            stages[str(n.target)] = stage
        regions = []
        shares = units if isinstance(units, dict) else {u: 1.0 for u in units}
        for u, share in sorted(shares.items()):
            paths = list(problem.units[u].copies)
            regions.extend(paths[:round(share * len(paths))])
        if recompute == "auto":
            for u in problem.units:
                for path, nodes in u.copies.items():
                    if path in regions:
                        for n in nodes:
                            n.meta[M.RECOMPUTE] = path
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
            "cpu_seconds": time.process_time() - cpu0,  # this process's CPU time: what a busy machine does not inflate
            "binding": _binding(problem, memory),
            "optimal": status["optimal"], "gap": status["gap"],  # not optimal: the time limit was reached
            "method": status.get("method"), "lower_bound": status.get("bound"),
            "multiplier": status.get("multiplier"),  # λ (seconds per byte) of the lower bound
            "zero_stages": {st: sum(1 for v in stages.values() if v == st) for st in sorted(set(stages.values()))},
            "recomputed": regions,
        }
        return gm


# Added to the solver's objective (not to ``evaluate``) per free parameter sharded on the data axis: among plans of
# equal estimated step time (e.g. tensor parallelism on `data` with the batch gathered, or the same on `model`),
# the one that leaves the data axis to the batch. 1e-12 s is far below any real cost difference (alpha ~1e-6 s,
# one flop ~1e-14 s but ops are >1e3 flops) and above the solver's tolerances (the objective is solved in ns).
TIE_BREAK = 1e-12


def _ties(problem: Problem, d: DecisionVar) -> list[float]:
    """The tie-breaking seconds added to each option of ``d``: a parameter sharded on the data axis, or stored at a
    ZeRO stage that costs no time (keep the parameter whole)."""
    if problem.data_axis is None or d.node.op != "get_attr":
        return [0.0] * len(d.options)
    axis = problem.mesh.names.index(problem.data_axis)
    return [TIE_BREAK * d.copies * (isinstance(spec[axis], Shard) + (d.stages[k] if d.stages else 0))
            for k, spec in enumerate(d.options)]


def _break_ties(problem: Problem, cost: list[float]) -> None:
    col = 0
    for d in problem.decisions:
        for k, tie in enumerate(_ties(problem, d)):
            cost[col + k] += tie
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
