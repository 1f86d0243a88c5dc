"""The plan search's problem: decisions, their options' seconds and bytes, and the value terms between them.

Built by :func:`build_problem` from an annotated graph (after ``functionalize``, ``mark_requires_grad`` and
``seed_specs``):

* a :class:`DecisionVar` per op (its options: the strategies of :func:`passes.propagate.node_strategies` that
  keep every annotated parameter's layout; :func:`_op_decisions`) and per free parameter (its options: every
  layout a consumer asks for, replicated first, each at the ZeRO stages it may be stored at;
  :func:`_parameter_decisions`, priced by :class:`ParameterPricing`);
* a :class:`ValueTerm` per group of equivalent values (same canonical value, same canonical consumers): which
  option makes the value come out as which spec, which consumer options need which spec or a gradient sync,
  and the seconds of every redistribution (:func:`_value_terms`).

Repeated layers share variables (:func:`.layers.find_layers`): the costs of every tied copy add up on the
canonical node's decision, and a value term counts its copies as ``multiplicity``. ``recompute="auto"`` puts
every op of a repeated layer in a recomputation :class:`.layers.Unit` (its forward seconds and the bytes it keeps
when recomputed). How the program over this problem reads is in :mod:`.ilp`; the seconds and bytes of one
assignment are :func:`.objective.evaluate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.fx
from autoshard.compiler.collective_kinds import time as kind_time
from autoshard.cost_models.memory import GraphMemory, keeps, recompute_region
from autoshard.cost_models.plan_cost import (forward_times, grad_sync_time, link, local_numel, op_times,
                                             optimizer_time, redistribution_forward_time_of, redistribution_time_of,
                                             rerun_nodes, step_overhead, trains)
from autoshard.cost_models.profile import HardwareProfile
from autoshard.passes.plan_search.layers import LayerUnits, copy_paths, find_layers, recompute_units
from autoshard.passes.plan_search.precision import ComputeCopies
from autoshard.passes.propagate import (annotation_error, keeps_layout, node_strategies, pin_conflict, pinned_values,
                                        written_inputs)

from autoshard import meta as M
from autoshard.compiler.context import Context, zero_axis
from autoshard.frontend.graph_utils import is_getitem, is_tensor_node, itemsize, rerun_in_backward, shape, tensor_inputs
from autoshard.mesh import Mesh
from autoshard.placements import Spec, format_spec


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
    #: bytes of each option at every liveness point (:class:`autoshard.cost_models.memory.Timeline`), summed over
    #: every copy; ``memory`` (and ``memory_recomputed``) are these at the point the program prices
    #: (:meth:`Problem.price_at`)
    points: list | None = None
    points_recomputed: list | None = None
    gradient: list[int] | None = None  # ops: bytes of the gradient of each option's output (backward's temporaries)
    alive: object = None  # ops: the liveness of their outputs as activations (tied copies added up)
    #: ops: bytes per point each option allocates besides its outputs, over every copy (GraphMemory.workspace:
    #: attention's kept float mask, ring attention's score blocks; the program's linear term); None where no option
    #: has any
    workspace: list | None = None
    #: ops with a ``workspace``: per option the bytes it holds only while it runs (GraphMemory.transient) and the
    #: storages it keeps (GraphMemory.kept: one per mask and layout, counted once per plan by
    #: :func:`.objective.memory_points`)
    transient: list | None = None
    kept: list | None = None
    stored: list[int] | None = None  # parameters: bytes of each option's stored tensor (the optimizer's temporaries)
    #: ops whose output is kept only by readers that keep it (:meth:`GraphMemory.kept_only_by_readers`): ``points``
    #: leave it out, and the program counts it where a keeping reader reads the layout it is produced in
    own_output: bool = False


@dataclass(frozen=True)
class OptionIndex:
    """A value term looked up by option (built once per term): what :func:`.objective.term_cost` reads for a
    choice instead of scanning every option's users."""

    producers: list[int]  # decisions whose options set the value's spec
    out: dict  # (d, k) -> spec out
    consumers: list[int]  # decisions whose options need a spec or a sync
    need: dict  # (d, k) -> specs needed
    sync: dict  # (d, k) -> sync keys (spec, axes)


@dataclass
class ValueTerm:
    """The cost terms of one group of equivalent values: redistributions and gradient syncs they need."""

    value: torch.fx.Node  # canonical value
    multiplicity: int
    out: list = field(default_factory=list)  # (decision, option, spec) triples that produce each spec
    fixed: Spec | None = None  # the spec of an input or annotated parameter (no producer decision)
    needs: dict = field(default_factory=dict)  # spec i -> list of (decision, option) requiring it
    syncs: dict = field(default_factory=dict)  # (spec, axes) -> list of (decision, option)
    outputs: list = field(default_factory=list)  # keep-flags of every graph output this value is (output_spec_for)
    pair_cost: dict = field(default_factory=dict)  # (o, i) -> seconds or None (impossible)
    sync_cost: dict = field(default_factory=dict)  # (spec, axes) -> seconds
    #: (spec, axes) -> (seconds saved, the producer options (decision, option) storing the parameter at stage 2 or
    #: 3 in that spec): the sync is then a reduce-scatter over the data axis (:func:`_zero_syncs`)
    zero_syncs: dict = field(default_factory=dict)
    #: the liveness of the group's values as activations (their segments' points added up: tied copies)
    alive: np.ndarray | None = None
    members: list = field(default_factory=list, repr=False)  # the group's values (one per tied copy)
    #: consumer decision -> whether it keeps the value for its backward (:func:`autoshard.cost_models.memory.keeps`)
    kept: dict = field(default_factory=dict, repr=False)
    #: consumer decision -> whether it reads the value inside the value's own layer copy (its recomputation
    #: region when that copy is recomputed: a copy made for it is then made again in backward, not kept)
    within: dict = field(default_factory=dict, repr=False)
    #: the recomputation region the value lies in when it was marked before the search (the ``recompute=`` glob,
    #: the model's own checkpoint), else None; for such a value, per consumer decision: whether it keeps the value
    #: for its backward were nothing recomputed (``kept_plain``: what the region holds again while its backward
    #: runs) and whether it lies in the same region (``same_region``)
    region: str | None = None
    kept_plain: dict = field(default_factory=dict, repr=False)
    same_region: dict = field(default_factory=dict, repr=False)
    #: consumer decision -> the redistributions to it that backward runs again (they lie between the ops of a
    #: recomputed region: :func:`autoshard.frontend.graph_utils.rerun_in_backward`), as (member index, unit) pairs: unit
    #: None where the region was marked before the search, else the unit whose layer copy holds both ends (run
    #: again when that copy is recomputed)
    rerun: dict = field(default_factory=dict, repr=False)
    #: (o, i) -> forward seconds of that redistribution of one member (what running it again costs), where ``rerun``
    forward_cost: dict = field(default_factory=dict, repr=False)
    by_option: OptionIndex | None = field(default=None, repr=False, compare=False)
    by_id: tuple | None = field(default=None, repr=False, compare=False)

    def index(self) -> OptionIndex:
        if self.by_option is None:
            need: dict = {}
            for i, users in self.needs.items():
                for dk in users:
                    need.setdefault(dk, []).append(i)
            sync: dict = {}
            for key, users in self.syncs.items():
                for dk in users:
                    sync.setdefault(dk, []).append(key)
            self.by_option = OptionIndex(
                producers=sorted({d for d, _, _ in self.out}), out={(d, k): spec for d, k, spec in self.out},
                consumers=sorted({d for d, _ in need} | {d for d, _ in sync}), need=need, sync=sync)
        return self.by_option

    def costs_by_id(self) -> tuple[dict, dict, dict]:
        """``pair_cost`` and ``forward_cost`` keyed by ``(id(o), id(i))``, and {id(key): (``sync_cost[key]``,
        ``zero_syncs.get(key)``)} per key of ``syncs``, built once the problem is built: its specs are interned
        (:class:`_SpecPool`: one object per spec, kept alive by these dicts' own keys, as ``syncs`` keeps its keys),
        so the program and the objective look them up by identity instead of hashing placements (torch's, in
        Python)."""
        if self.by_id is None:
            self.by_id = ({(id(o), id(i)): v for (o, i), v in self.pair_cost.items()},
                          {(id(o), id(i)): v for (o, i), v in self.forward_cost.items()},
                          {id(key): (self.sync_cost[key], self.zero_syncs.get(key)) for key in self.syncs})
        return self.by_id


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
    units: list = field(default_factory=list)  # recomputation candidates (layers.Unit), when recompute="auto"
    gathered: dict = field(default_factory=dict)  # decision -> (layer key, compute bytes of one copy per option)
    #: the memory model (:class:`autoshard.cost_models.memory.GraphMemory`) the bytes come from
    memory_model: GraphMemory | None = None
    fixed_points: np.ndarray | None = None  # bytes per liveness point of annotated parameters and buffers
    point: int = 0  # the liveness point the program's memory row prices (``memory`` of every decision)
    fixed_stored: int = 0  # the largest stored tensor of the annotated parameters (the optimizer's temporaries)
    #: seconds every plan pays whatever it chooses: mixed precision's casts of the inputs and annotated parameters
    fixed_seconds: float = 0.0
    #: a pipeline's stages fixed before the search (:class:`autoshard.cost_models.memory.StagedTimeline`): per
    #: decision, the stages its copies lie in (a parameter: those of its first and last use), as a (stages ×
    #: decisions) boolean array; None: one timeline
    stage_sets: np.ndarray | None = None
    #: a pipeline's receive buffers (``plan_search.receive_buffers``): {op decision: bytes per point, per option} of
    #: the values it makes that cross a stage cut (in the option columns' points too)
    receive: dict = field(default_factory=dict, repr=False)
    #: the terms with redistributions backward may run again (``ValueTerm.rerun``)
    rerun_terms: list = field(default_factory=list, repr=False)
    #: (layouts, answer) of the last :func:`.objective.activations`: a repair changes no layout
    activations_cache: tuple | None = field(default=None, repr=False, compare=False)
    columns: object = field(default=None, repr=False, compare=False)  # .objective._Columns, built once
    #: the rows and columns of its value terms in a program (.ilp._Terms): built once, for every recomputation set
    program_terms: object = field(default=None, repr=False, compare=False)

    def price_at(self, point: int) -> None:
        """Price the program's memory row at liveness ``point``: every decision's ``memory`` (and
        ``memory_recomputed``) and ``fixed_memory`` become their bytes at that point."""
        self.point = point
        for d in self.decisions:
            d.memory = [float(v[point]) for v in d.points]
            if d.points_recomputed is not None:
                d.memory_recomputed = [float(v[point]) for v in d.points_recomputed]
        self.fixed_memory = float(self.fixed_points[point])


def _no_region(node: torch.fx.Node) -> None:
    return None


def canonical(canon: dict, n: torch.fx.Node) -> torch.fx.Node:
    return canon.get(n, n)


@dataclass(frozen=True)
class ParameterPricing:
    """Bytes and seconds of storing a parameter in a layout at a ZeRO stage (``zero``: 0, 1-3 or "auto")."""

    mesh: Mesh
    data_axis: str | None
    data_link: object  # cost_models.plan_cost.link of the data axis (None without one)
    optimizer: str
    zero: int | str
    profile: HardwareProfile | None = None  # prices the optimizer step (None: not priced)

    @property
    def data_size(self) -> int:
        return self.mesh.axis_size(self.data_axis) if self.data_axis else 1

    def state_points(self, memory: GraphMemory, nodes: list, spec: Spec, stage: int = 0) -> np.ndarray:
        """Bytes per liveness point of parameter (or buffer) ``nodes`` (a decision's tied copies) in ``spec``
        stored at ``stage`` (:meth:`GraphMemory.parameter`, :meth:`GraphMemory.buffer`)."""
        x = nodes[0]
        if not x.meta.get(M.REQUIRES_GRAD):
            return np.full(memory.timeline.points, float(len(nodes) * memory.buffer(x, spec)))
        return memory.parameter(nodes, spec, stage, self.data_size)

    def stored(self, memory: GraphMemory, x: torch.fx.Node, spec: Spec, stage: int = 0) -> int:
        """Bytes of one copy's stored tensor (what the optimizer's per-parameter temporaries are the size of)."""
        if not x.meta.get(M.REQUIRES_GRAD):
            return 0
        return memory.parameter_state(x, spec, stage, self.data_size)["parameters"]

    def stage_options(self, x: torch.fx.Node, specs: list) -> tuple[list, list[int]]:
        """Each spec at every stage it can be stored at (stage 0 alone for buffers and unshardable layouts)."""
        from autoshard.passes.shard_storage import stored_spec

        if self.zero == 0 or not x.meta.get(M.REQUIRES_GRAD) or self.data_axis is None:
            return specs, [0] * len(specs)
        wanted = (0, 2, 3) if self.zero == "auto" else (int(self.zero),)
        opts, stages = [], []
        for spec in specs:
            ok = stored_spec(spec, shape(x), self.mesh, self.data_axis) is not None
            for st in (wanted if ok else (0,)):
                opts.append(spec)
                stages.append(st)
        return opts, stages

    def cast_spec(self, x: torch.fx.Node, spec: Spec | None, stage: int) -> Spec | None:
        """The layout mixed precision's cast of ``x`` runs in: the stored shard at stages 1-3 (``shard_storage``
        moves it there), else ``spec``."""
        from autoshard.passes.shard_storage import stored_spec

        if stage == 0 or spec is None:
            return spec
        return stored_spec(spec, shape(x), self.mesh, self.data_axis)

    def optimizer_time(self, x: torch.fx.Node, spec: Spec | None, stage: int) -> float:
        """Seconds of the optimizer step over ``x`` stored in ``spec`` at ``stage``
        (:func:`autoshard.cost_models.plan_cost.optimizer_time`, as ``plan.cost()`` prices it)."""
        if self.profile is None or spec is None:
            return 0.0
        return optimizer_time(x, spec, stage, self.data_size, self.mesh, self.profile, self.optimizer)

    def stage_time(self, x: torch.fx.Node, spec: Spec, stage: int) -> float:
        """Seconds a stage adds: the all-gather of the stored shard forward, at stage 3 again in backward. What it
        changes in the gradient's sync (at stage 2 and 3 a reduce-scatter in place of the data axis's all-reduce,
        where the readers' layouts sync it over that axis at all) is the value term's (:func:`_zero_syncs`)."""
        if stage == 0:
            return 0.0
        gather = kind_time("all_gather", local_numel(shape(x), spec, self.mesh) * itemsize(x), self.data_size,
                           self.data_link)[0]
        return 2 * gather if stage == 3 else gather

    def sync_saving(self, x: torch.fx.Node, spec: Spec) -> float:
        """Seconds a parameter stored at stage 2 or 3 saves on its gradient's sync over the data axis (gathered to
        ``spec``): a reduce-scatter instead of the all-reduce (:func:`autoshard.cost_models.plan_cost.plan_cost`
        prices the same)."""
        b = local_numel(shape(x), spec, self.mesh) * itemsize(x)
        nd, ln = self.data_size, self.data_link
        return max(0.0, kind_time("grad_all_reduce", b, nd, ln)[1] - kind_time("all_gather_sync", b, nd, ln)[1])


def _cast_seconds(gm, problem: Problem, copies: ComputeCopies) -> None:
    """Mixed precision's casts not priced with a parameter's options: each cast input's (every plan pays it), and
    with ``output_dtype`` each floating output's, run in the layout its producer's option gives it."""
    if copies.precision is None:
        return
    for n in copies.values:
        if n.op == "placeholder":
            problem.fixed_seconds += copies.cast_seconds(n, n.meta[M.SPEC])
    dtype = copies.precision.output_dtype
    if dtype is None:
        return
    from autoshard.frontend.precision import fake_like

    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    with copies.read():
        for x in dict.fromkeys(tensor_inputs(out)):
            val = x.meta["val"]
            if not val.is_floating_point() or val.dtype == dtype:
                continue
            rg, low = bool(x.meta.get(M.REQUIRES_GRAD)), fake_like(val, dtype)
            producer = x.args[0] if is_getitem(x) else x
            d = problem.index.get(canonical(problem.canon, producer))
            if d is None:  # an input or an annotated parameter: its spec is fixed
                problem.fixed_seconds += copies.cast_time(val, low, rg, x.meta[M.SPEC])
                continue
            dv = problem.decisions[d]
            for k, s in enumerate(dv.options):
                spec = s.output_spec[x.args[1]] if is_getitem(x) else (s if x.op == "get_attr" else s.output_spec)
                dv.cost[k] += copies.cast_time(val, low, rg, spec) if spec is not None else 0.0


def build_problem(gm: torch.fx.GraphModule, ctx: Context, profile: HardwareProfile, memory_limit, optimizer: str,
                  tie_layers: bool = True, zero: int | str = 0, recompute: str | None = None,
                  timeline=None) -> Problem:
    """The program for ``gm``. ``zero``: 0 (parameters stored in their compute layout), 1-3 (every parameter that
    :func:`~autoshard.passes.shard_storage.stored_spec` can shard is stored at that stage: its memory counts the
    stored state) or "auto" (each parameter's options repeat each spec at stages 0, 2 and 3).
    ``recompute="auto"``: every copy of a repeated layer is a recomputation candidate (:class:`.layers.Unit`).
    ``timeline``: the liveness points (default the whole model's; a pipeline's stages:
    :class:`autoshard.cost_models.memory.StagedTimeline`)."""
    mesh = ctx.mesh
    canon = find_layers(gm) if tie_layers else {}
    data_axis = zero_axis(ctx.options, mesh)  # the axis ZeRO stores over (the data axis, or the context axis)
    data_axis = data_axis if data_axis in mesh.names else None
    layers = recompute_units(gm, canon) if recompute == "auto" or zero in ("auto", 3) else LayerUnits()
    if recompute != "auto":
        layers = LayerUnits(layer_of=layers.layer_of, copy_of=layers.copy_of)
    copies: dict[torch.fx.Node, int] = {}
    members: dict[torch.fx.Node, list] = {}  # canonical node -> every copy
    for n in gm.graph.nodes:
        c = canonical(canon, n)
        copies[c] = copies.get(c, 0) + 1
        members.setdefault(c, []).append(n)
    precision = ctx.options.precision
    memory = GraphMemory(gm, mesh, optimizer, precision.param_dtype if precision is not None else None,
                         timeline=timeline)
    problem = Problem(mesh, [], {}, [], memory_limit, 0.0, canon, data_axis, layers.units, {}, memory,
                      np.zeros(memory.timeline.points))
    copies = ComputeCopies.of(gm, precision, profile, mesh)
    rerun = _Rerun.of(gm, layers)
    _op_decisions(gm, ctx, profile, problem, members, layers, copies, rerun.marked)
    pricing = ParameterPricing(mesh, data_axis, link(profile, mesh, data_axis) if data_axis else None, optimizer, zero,
                               profile)
    problem.fixed_seconds += step_overhead(gm, profile)
    _parameter_decisions(gm, problem, members, pricing, copies)
    problem.terms = _value_terms(gm, ctx, profile, problem, copies, rerun)
    problem.rerun_terms = [t for t in problem.terms if t.rerun]
    with copies.read():
        _zero_syncs(problem, pricing, copies)
    _cast_seconds(gm, problem, copies)
    for term in problem.terms:
        term.alive = memory.alive(term.members)
    stage_of = getattr(memory.timeline, "stage_of", None)
    if stage_of:
        tl = memory.timeline
        problem.stage_sets = np.zeros((max(stage_of) + 1, len(problem.decisions)), dtype=bool)
        for i, d in enumerate(problem.decisions):
            for n in members[d.node]:
                for segment in tl.uses(n) if n.op == "get_attr" else (tl.segment(n),):
                    problem.stage_sets[stage_of[segment], i] = True
    problem.price_at(0)
    return problem


@dataclass(frozen=True)
class _Rerun:
    """What backward runs again, on the graph the search plans (before collectives are inserted): ``marked``
    ({node: region id}) the nodes of the regions marked before the search (the ``recompute=`` glob, the model's
    own checkpoint) and those between their ops (:func:`autoshard.frontend.graph_utils.rerun_in_backward`, as
    ``plan.cost()`` prices the compiled graph); ``copies`` ({node: (unit, copy path)}) the same of every copy of a
    recomputation unit, were it recomputed. Empty for a graph without a backward."""

    marked: dict
    copies: dict

    @classmethod
    def of(cls, gm: torch.fx.GraphModule, layers: LayerUnits) -> _Rerun:
        marked = rerun_nodes(gm)
        if not layers.units or not trains(gm):
            return cls(marked, {})
        unit_of = {path: k for k, unit in enumerate(layers.units) for path in unit.copies}
        hulls = rerun_in_backward(gm.graph, {path: ops for unit in layers.units for path, ops in unit.copies.items()})
        return cls(marked, {n: (unit_of[path], path) for n, path in hulls.items()})

    def pair(self, u: torch.fx.Node, c: torch.fx.Node):
        """Whether a redistribution from ``u`` to its reader ``c`` runs again in backward: (True, None) in a region
        marked before the search, (True, unit) when that unit's copy holding both is recomputed, else None."""
        region = self.marked.get(u)
        if region is not None and self.marked.get(c) == region:
            return True, None
        copy = self.copies.get(u)
        if copy is not None and self.copies.get(c) == copy:
            return True, copy[0]
        return None


def _op_decisions(gm, ctx: Context, profile: HardwareProfile, problem: Problem, members: dict,
                  layers: LayerUnits, copies: ComputeCopies, rerun: dict) -> None:
    """A decision per canonical op: its strategies (those that keep every annotated parameter's layout), their
    seconds and saved activation bytes over every copy (:meth:`GraphMemory.op_option` at each copy's liveness
    points), and, in a recomputation unit, what recomputing costs and what it keeps then (every unit's copy its
    own region, as when the layers around it are recomputed too). A copy already in a recomputation region (the
    ``recompute=`` glob, the model's own ``torch.utils.checkpoint``) pays its forward again in every option, as
    ``plan.cost()`` prices it (:func:`~autoshard.cost_models.plan_cost.forward_times`)."""
    mesh, canon, memory = problem.mesh, problem.canon, problem.memory_model
    regions = copy_paths(layers.units)
    pinned = pinned_values(gm)
    strict = {x: True for x, s in pinned.items() if s}  # annotated parameters: their layout is known now
    for n in gm.graph.nodes:
        if n.op != "call_function" or is_getitem(n) or canonical(canon, n) is not n:
            continue
        planned = n.meta.get(M.PLANNED)
        strats = [planned] if planned is not None else node_strategies(n, ctx)
        conflicts = [pin_conflict(tensor_inputs(n), s, strict) for s in strats]
        if all(c is not None for c in conflicts):
            x = conflicts[0][0]
            raise annotation_error(n, x, [w for b, w in conflicts if b is x], pinned)
        strats = [s for s, c in zip(strats, conflicts) if c is None]
        k = len(members[n])
        alive = memory.alive(members[n])
        # copies recomputed whatever the search chooses (their region was marked before it: ``rerun``)
        again = sum(1 for x in members[n] if x in rerun)
        u = layers.unit_of.get(n)
        with copies.read(n.all_input_nodes):  # the op reads mixed precision's copies
            seconds = op_times(n, strats, mesh, profile)
            forward = forward_times(n, strats, mesh, profile) if u is not None or again else None
        cost = [k * t + again * f for t, f in zip(seconds, forward)] if again else [k * t for t in seconds]
        dv = DecisionVar(n, strats, cost, [], k,
                         points=[memory.op_option(n, s.output_spec) * alive for s in strats],
                         gradient=[memory.gradient(n, s.output_spec) for s in strats], alive=alive)
        workspace = [memory.workspace(members[n], s) for s in strats]
        if any(w.any() for w in workspace):
            dv.workspace = workspace
            dv.transient = [memory.transient(members[n], s) for s in strats]
            dv.kept = [memory.kept(members[n], s) for s in strats]
            dv.points = [p + w for p, w in zip(dv.points, workspace)]
        if u is None and memory.kept_only_by_readers(n):
            dv.own_output = True
            dv.points = [p - memory.op_option(n, s.output_spec) * alive for p, s in zip(dv.points, strats)]
        if u is not None:
            # Recomputed, a unit keeps only what leaves it (its output, which the next layer saves as its input)
            dv.unit = u
            dv.points_recomputed = [memory.op_option(n, s.output_spec, regions.get) * alive + w
                                    for s, w in zip(strats, workspace)]
            dv.forward = [(k - again) * f for f in forward]  # (copies recomputed already pay it in cost)
        problem.index[n] = len(problem.decisions)
        problem.decisions.append(dv)


def _wanted_specs(gm, problem: Problem) -> dict[torch.fx.Node, list]:
    """{canonical free parameter: every spec a consumer option asks for it in}."""
    wanted: dict[torch.fx.Node, list] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or is_getitem(n) or n not in problem.index:
            continue
        for pos, x in enumerate(tensor_inputs(n)):
            if x.op == "get_attr" and x.meta.get(M.SPEC) is None:
                for s in problem.decisions[problem.index[n]].options:  # never Partial: parameters stay whole
                    lst = wanted.setdefault(canonical(problem.canon, x), [])
                    if s.input_specs[pos] not in lst:
                        lst.append(s.input_specs[pos])
    return wanted


def _parameter_decisions(gm, problem: Problem, members: dict, pricing: ParameterPricing,
                         copies: ComputeCopies) -> None:
    """A decision per canonical free parameter (any spec a consumer asks for, replicated first, at every ZeRO stage
    it may be stored at), and per annotated one with a stage to choose; the rest is fixed memory. Each option's
    seconds: its stage's all-gathers, and under mixed precision the cast of what it stores (:class:`ComputeCopies`)."""
    wanted = _wanted_specs(gm, problem)
    memory = problem.memory_model

    def seconds(n, spec, stage: int) -> float:
        with copies.read([n]):  # the all-gather moves the param_dtype copy
            gather = pricing.stage_time(n, spec, stage)
        return gather + copies.cast_seconds(n, pricing.cast_spec(n, spec, stage)) + pricing.optimizer_time(n, spec,
                                                                                                           stage)

    for n in gm.graph.nodes:
        if n.op != "get_attr" or not is_tensor_node(n) or canonical(problem.canon, n) is not n:
            continue
        k = len(members[n])
        if n.meta.get(M.SPEC) is not None:  # annotated: its layout is fixed, its stage may not be
            options, stages = pricing.stage_options(n, [n.meta[M.SPEC]])
            if len(options) == 1:
                problem.fixed_points += pricing.state_points(memory, members[n], options[0], stages[0])
                problem.fixed_stored = max(problem.fixed_stored, pricing.stored(memory, n, options[0], stages[0]))
                problem.fixed_seconds += k * seconds(n, options[0], stages[0])
                continue
        else:
            specs = sorted(wanted.get(n, []), key=lambda s: (sum(not isinstance(p, type(s[0])) for p in s),
                                                              format_spec(s)))
            options, stages = pricing.stage_options(n, specs or [None])  # consumed by no op: one option
        problem.index[n] = len(problem.decisions)
        problem.decisions.append(DecisionVar(
            n, options, [k * seconds(n, s, st) for s, st in zip(options, stages)], [], k, stages=stages,
            points=[pricing.state_points(memory, members[n], s, st) for s, st in zip(options, stages)],
            stored=[pricing.stored(memory, n, s, st) for s, st in zip(options, stages)]))
        if 3 in stages:
            layer = memory.zero3_gathered(n, options[stages.index(3)])[0]
            problem.gathered[len(problem.decisions) - 1] = (layer, [memory.zero3_gathered(n, s)[1] if st == 3 else 0
                                                                    for s, st in zip(options, stages)])


def _consumers(gm) -> dict[torch.fx.Node, list[tuple]]:
    """{value: [(consumer, input position)]}, the graph's output node included."""
    consumers_of: dict[torch.fx.Node, list[tuple]] = {}
    for n in gm.graph.nodes:
        if (n.op == "call_function" and not is_getitem(n)) or n.op == "output":
            for pos, x in enumerate(tensor_inputs(n)):
                consumers_of.setdefault(x, []).append((n, pos))
    return consumers_of


class _SpecPool:
    """Specs interned (one object per distinct spec): the terms' dicts are keyed by spec pairs, and tuples of
    DTensor placements compare element by element in Python unless they are the same objects."""

    def __init__(self):
        self.pool: dict = {}

    def __call__(self, spec):
        return self.pool.setdefault(spec, spec)


def _value_terms(gm, ctx: Context, profile: HardwareProfile, problem: Problem, copies: ComputeCopies,
                 rerun: _Rerun) -> list[ValueTerm]:
    """One term per group of values with the same canonical value and canonical consumers (``rerun``: what backward
    runs again, :meth:`_Rerun.pair`)."""
    canon = problem.canon
    consumers_of = _consumers(gm)
    groups: dict[tuple, list[torch.fx.Node]] = {}
    for u, cons in consumers_of.items():
        key = (canonical(canon, u), tuple(sorted({(canonical(canon, c).name, p) for c, p in cons})))
        groups.setdefault(key, []).append(u)
    out_req = _output_requirements(gm, ctx)
    pinned = pinned_values(gm)
    written = {x for n in gm.graph.nodes for x in written_inputs(n) if x.op == "get_attr"}  # buffers
    intern = _SpecPool()
    copy_of = copy_paths(problem.units)
    pair_costs: dict = {}  # (shape, itemsize, requires_grad) -> {(id(src), id(dst)): seconds}: values share shapes
    priced: dict = {}  # terms' redistribution seconds by value and spec pairs (_price_term)
    terms = []
    for (cu, _), members in groups.items():
        u = members[0]
        term = ValueTerm(cu, len(members), members=members)
        _producer_options(u, cu, problem, term, intern)
        _consumer_options(u, consumers_of[u], problem, term, intern, out_req, copy_of)
        _rerun_readers(members, consumers_of, problem, term, rerun)
        with copies.read([u]):  # redistributions and syncs move the param_dtype copies
            _price_term(u, term, problem.mesh, profile, pinned, intern, pair_costs, u in written,
                        copies.sync_size(u), priced)
        for key in term.sync_cost:
            term.sync_cost[key] += copies.sync_casts(u, key[0])
        terms.append(term)
    return terms


def _rerun_readers(members: list, consumers_of: dict, problem: Problem, term: ValueTerm, rerun: _Rerun) -> None:
    """Fill ``term.rerun``: per consumer decision, the (member, unit) pairs whose redistribution to it backward runs
    again (:meth:`_Rerun.pair`)."""
    if not rerun.marked and not rerun.copies:
        return
    found: dict = {}
    for j, u in enumerate(members):
        for c, _ in consumers_of[u]:
            again = rerun.pair(u, c) if c.op != "output" else None
            if again is not None:
                found.setdefault(problem.index[canonical(problem.canon, c)], set()).add((j, again[1]))
    term.rerun = {d: frozenset(pairs) for d, pairs in found.items()}


def _zero_syncs(problem: Problem, pricing: ParameterPricing, copies: ComputeCopies) -> None:
    """Fill ``term.zero_syncs`` of every parameter's term: a gradient synced over the data axis in the layout the
    parameter is gathered to is reduce-scattered instead of all-reduced when the parameter is stored at stage 2 or
    3 (``shard_storage``'s ``all_gather_sync``); the saving holds only for that pair of choices (the parameter's
    option, the readers' layouts), so the term prices it, not the parameter's options. Not where mixed precision
    syncs the gradient in a ``reduce_dtype`` other than ``param_dtype``: ``reduce_precision`` then casts around the
    sync, which stays an all-reduce (as ``plan.cost()`` prices it)."""
    if problem.data_axis is None:
        return
    for term in problem.terms:
        if term.fixed is not None or not term.out or term.value.op != "get_attr":
            continue
        if term.value in copies.values and copies.precision.grad_reduce_dtype != copies.precision.param_dtype:
            continue
        d = problem.decisions[term.out[0][0]]
        if not d.stages or max(d.stages) < 2:
            continue
        for key in term.syncs:
            spec, axes = key
            if problem.data_axis not in axes:
                continue
            staged = frozenset((dd, k) for dd, k, o in term.out if o == spec and d.stages[k] >= 2)
            if staged:
                term.zero_syncs[key] = (pricing.sync_saving(term.value, spec), staged)


def _consumer_options(u, consumers: list, problem: Problem, term: ValueTerm, intern: _SpecPool, out_req: dict,
                      copy_of: dict):
    """Fill ``term.needs`` (spec -> consumer options needing it), ``term.syncs``, ``term.outputs``, and
    ``term.kept`` and ``term.within`` per consumer (``copy_of``: {node: the path of its recomputation unit's copy});
    for a value in a region marked before the search, ``term.region``, ``term.kept_plain`` and
    ``term.same_region``."""
    seen: set = set()  # (spec, decision, option) and (spec, axes, decision, option) already listed
    term.region = recompute_region(u)
    for c, pos in consumers:
        if c.op == "output":
            term.outputs.append(out_req[(c, pos)])
            continue
        d = problem.index[canonical(problem.canon, c)]
        term.kept[d] = term.kept.get(d, False) or keeps(c, u, u)
        if term.region is not None:
            term.kept_plain[d] = term.kept_plain.get(d, False) or keeps(c, u, u, _no_region)
            term.same_region[d] = term.same_region.get(d, True) and recompute_region(c) == term.region
        term.within[d] = term.within.get(d, True) and copy_of.get(u) is not None and copy_of.get(u) == copy_of.get(c)
        for k, s in enumerate(problem.decisions[d].options):
            i = intern(s.input_specs[pos])
            if (i, d, k) not in seen:  # copies of a tied layer read a shared value through the same variables
                seen.add((i, d, k))
                term.needs.setdefault(i, []).append((d, k))
            axes = tuple(s.grad_sync[pos]) if s.grad_sync else ()
            if axes and u.meta.get(M.REQUIRES_GRAD) and (i, axes, d, k) not in seen:
                seen.add((i, axes, d, k))
                term.syncs.setdefault((i, axes), []).append((d, k))


def _price_term(u, term: ValueTerm, mesh: Mesh, profile: HardwareProfile, pinned: dict, intern: _SpecPool,
                pair_costs: dict, written: bool = False, sync_size: int | None = None,
                priced: dict | None = None) -> None:
    """Seconds of every redistribution (producer spec -> needed spec; None where a value computed only from
    annotated parameters would be gathered, or where a buffer some op writes in place would be read through a
    copy, which would take the write) and of every gradient sync (``sync_size`` bytes per element; default the
    value's). ``priced``: the ``pair_cost`` and ``forward_cost`` of terms priced before, by value and spec pairs."""
    outs = [term.fixed] if term.fixed is not None else sorted({o for _, _, o in term.out}, key=format_spec)
    value = (shape(u), itemsize(u), bool(u.meta.get(M.REQUIRES_GRAD)))
    needed = list(term.needs)
    grid = []  # (producer spec, the specs it is redistributed to)
    for o in outs:
        targets = needed
        if term.outputs:
            extra = {id(x): x for x in (intern(output_spec_for(o, keep)) for keep in term.outputs)}
            targets = needed + [x for x in extra.values() if x not in term.needs]
        grid.append((o, targets))
    # terms of values of one shape often have the same specs (tied layers' values, q/k/v): their dicts are equal, and
    # copying one reuses its keys' hashes (hashing a pair of specs runs torch's placement __hash__ in Python). The
    # specs are interned and kept alive by the pool, so their ids name them while ``priced`` lives.
    plain = u not in pinned and not written
    key = (value, bool(term.rerun), tuple((id(o), tuple(map(id, targets))) for o, targets in grid)) if plain else None
    hit = priced.get(key) if priced is not None and plain else None
    if hit is not None:
        term.pair_cost.update(hit[0])
        term.forward_cost.update(hit[1])
    else:
        costs = pair_costs.setdefault(value, {})
        for o, targets in grid:
            for i in targets:
                pc = costs.get((id(o), id(i)), costs)  # interned and kept alive by the pool: ids are keys
                if pc is costs:
                    pc = costs[(id(o), id(i))] = redistribution_time_of(o, i, *value, mesh, profile)
                if u in pinned and i in term.needs and not keeps_layout(o, i, pinned[u]):
                    pc = None  # computed only from annotated parameters: never gathered
                if written and o != i:
                    pc = None  # written in place (running statistics): read in the layout it is stored in
                term.pair_cost[(o, i)] = pc
        if term.rerun:  # run again in backward: their forward seconds
            forward = pair_costs.setdefault(("forward", value[:2]), {})  # ids as above
            for o, i in term.pair_cost:
                f = forward.get((id(o), id(i)))
                if f is None:
                    f = forward[(id(o), id(i))] = redistribution_forward_time_of(o, i, value[0], value[1], mesh,
                                                                                 profile) or 0.0
                term.forward_cost[(o, i)] = f
        if priced is not None and plain:
            priced[key] = (term.pair_cost, term.forward_cost)
    for (i, axes) in term.syncs:
        term.sync_cost[(i, axes)] = grad_sync_time(i, axes, u, mesh, profile, sync_size)


def _output_requirements(gm, ctx: Context) -> dict:
    """Per graph output: what it keeps per mesh axis (:func:`autoshard.passes.propagate.output_keeps`: a batch-shaped
    output is this rank's chunk on the data axis, as with DDP; otherwise replicated but for a batch shard)."""
    from autoshard.passes.propagate import output_keeps

    return {(n, pos): keep for n in gm.graph.nodes if n.op == "output"
            for pos, keep in enumerate(output_keeps(n, ctx))}


def output_spec_for(src: Spec, keep: tuple[int, ...]) -> Spec:
    from autoshard.passes.propagate import output_spec

    return output_spec(src, keep)


def _producer_options(u, cu, problem: Problem, term: ValueTerm, intern: _SpecPool) -> None:
    """Fill ``term.fixed`` (inputs, annotated parameters) or ``term.out`` (the options making each spec)."""
    decisions = problem.decisions
    if u.op == "placeholder" or (u.op == "get_attr" and u.meta.get(M.SPEC) is not None):
        term.fixed = intern(u.meta[M.SPEC])
    elif u.op == "get_attr":
        d = problem.index[cu]
        term.out = [(d, k, intern(s)) for k, s in enumerate(decisions[d].options)]
    elif is_getitem(u):
        d = problem.index[canonical(problem.canon, u.args[0])]
        term.out = [(d, k, intern(s.output_spec[u.args[1]])) for k, s in enumerate(decisions[d].options)]
    else:
        d = problem.index[cu]
        term.out = [(d, k, intern(s.output_spec)) for k, s in enumerate(decisions[d].options)]
