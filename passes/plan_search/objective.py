"""The plan search's objective for one assignment: estimated step time and per-rank memory.

For a choice (one option index per decision) and a recomputation set (units recomputed whole, or
``{unit: share of its copies}``):

* seconds ``T = Σ_d option_cost(d)[k_d] + Σ_terms term_cost`` (:func:`evaluate`): each option's compute (plus its
  forward again where recomputed, :func:`option_cost`), each redistribution bought once per (value, needed spec)
  and each gradient sync (:func:`term_cost`), the forward again of the redistributions between a recomputed
  region's ops (:func:`rerun_seconds`) — the same objective the program of :mod:`.ilp` minimises, less the
  tie-breaking seconds (:func:`ties`);
* bytes ``M``: the peak over the liveness points of :mod:`autoshard.cost_models.memory` (:func:`memory_points`:
  the end of forward, each backward segment boundary, the optimizer step) — the parameters' options' bytes per
  point, the saved activations of the chosen layouts (own outputs, and the copies redistributions make for
  readers that keep them), ZeRO-3's gathered layers and the temporaries — the same model and functions
  ``plan.cost()`` prices the compiled plan with. The program prices one point linearly (``memory``, the
  coefficients of :meth:`.problem.Problem.price_at`); :func:`transient_bytes` is what the peak adds to that row.

:func:`explain` turns a choice into the :class:`autoshard.meta.Decision` stored on every op (its cost share and the
best rejected option).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from autoshard.cost_models.compute import output_tensors
from autoshard.cost_models.memory import (SavedValue, largest_gradient, point_totals, recompute_region, saved_bytes,
                                          storage_key)
from autoshard.passes.plan_search.problem import DecisionVar, Problem, ValueTerm, canonical, output_spec_for

from autoshard import meta as M
from autoshard.frontend.graph_utils import is_getitem
from autoshard.placements import Shard


def _no_region(node) -> None:
    return None


INFEASIBLE = float("inf")


@dataclass(frozen=True)
class Candidate:
    """A plan the search met: one option per decision, the recomputed units (a set of units recomputed whole, or
    ``{unit: share of its copies}``), its seconds and bytes by :func:`evaluate`, the bytes the multiplier prices
    (``memory`` less :func:`transient_bytes`) and the multiplier λ it is optimal for (None: not a relaxed optimum,
    e.g. a repaired plan; inf: the least-memory plan)."""

    choice: tuple[int, ...]
    recompute: frozenset | dict
    time: float
    memory: float
    priced_memory: float
    multiplier: float | None = None

    @classmethod
    def of(cls, problem: Problem, choice, recompute, multiplier: float | None = None) -> Candidate:
        t, m = evaluate(problem, list(choice), recompute)
        return cls(tuple(choice), recompute, t, m, m - transient_bytes(problem, list(choice), recompute), multiplier)

# Added to the solver's objective (not to ``evaluate``) per free parameter sharded on the data axis: among plans of
# equal estimated step time (e.g. tensor parallelism on `data` with the batch gathered, or the same on `model`),
# the one that leaves the data axis to the batch. 1e-12 s is far below any real cost difference (alpha ~1e-6 s,
# one flop ~1e-14 s but ops are >1e3 flops) and above the solver's tolerances (the objective is solved in ns).
TIE_BREAK = 1e-12


def term_cost(term: ValueTerm, choice: list[int]) -> float:
    """Seconds of one value term for ``choice`` (times its multiplicity); :data:`INFEASIBLE` for an impossible
    redistribution."""
    ix = term.index()
    o = produced_spec(term, choice)
    wanted: dict = {}  # the specs consumers need (interned: one object per spec, so keyed by id)
    keys: dict = {}
    for d in ix.consumers:
        for i in ix.need.get((d, choice[d]), ()):
            wanted[id(i)] = i
        for key in ix.sync.get((d, choice[d]), ()):
            keys[id(key)] = key
    total = 0.0
    if term.outputs:
        for keep in term.outputs:
            spec = output_spec_for(o, keep)
            if not any(spec == i for i in wanted.values()):
                wanted[id(spec)] = spec
        for i in wanted.values():
            c = term.pair_cost[(o, i)]
            if c is None:
                return INFEASIBLE
            total += c
    else:  # every spec interned: look the pairs up by identity (ValueTerm.costs_by_id)
        pair_cost = term.costs_by_id()[0]
        for i in wanted:
            c = pair_cost[(id(o), i)]
            if c is None:
                return INFEASIBLE
            total += c
    syncs = term.costs_by_id()[2] if keys else None
    for key in keys:
        seconds, staged = syncs[key]
        total += seconds
        if staged is not None and any((d, choice[d]) in staged[1] for d in ix.producers):
            total -= staged[0]  # stored at stage 2/3: reduce-scattered, not all-reduced
    return term.multiplicity * total


def produced_spec(term: ValueTerm, choice: list[int]):
    """The spec ``term``'s value comes out in under ``choice``."""
    if term.fixed is not None:
        return term.fixed
    ix = term.index()
    return next(ix.out[(d, choice[d])] for d in ix.producers if (d, choice[d]) in ix.out)


def rerun_seconds(problem: Problem, choice: list[int]) -> tuple[float, dict]:
    """Seconds of the redistributions backward runs again under ``choice`` (they lie between the ops of a
    recomputed region, :attr:`.problem.ValueTerm.rerun`; each once per value copy and needed spec, as
    ``passes/insert_collectives.py`` shares it, priced by its forward seconds as ``plan.cost()`` prices it):
    (those in regions marked before the search, {unit: those inside its layer copies, every copy recomputed}).
    A unit's share of copies recomputed scales its seconds (:func:`evaluate`)."""
    fixed, per_unit = 0.0, {}
    for term in problem.rerun_terms:
        ix = term.index()
        o = produced_spec(term, choice)
        wanted: dict = {}  # id(spec) -> (spec, the (member, unit) pairs reading it again)
        for d, pairs in term.rerun.items():
            for i in ix.need.get((d, choice[d]), ()):
                wanted.setdefault(id(i), (i, set()))[1].update(pairs)
        for i, pairs in wanted.values():
            f = term.forward_cost.get((o, i), 0.0)
            if not f:
                continue
            marked = {j for j, unit in pairs if unit is None}
            fixed += f * len(marked)
            for j, unit in pairs:
                if unit is not None and j not in marked:
                    per_unit[unit] = per_unit.get(unit, 0.0) + f
    return fixed, per_unit


def unit_share(recompute, unit: int) -> float:
    """The share of ``unit``'s copies recomputed: ``recompute`` is a set of units or {unit: share}."""
    return recompute.get(unit, 0.0) if isinstance(recompute, dict) else float(unit in recompute)


def evaluate(problem: Problem, choice: list[int], recompute=frozenset()) -> tuple[float, float]:
    """(estimated step time in seconds, per-rank memory in bytes) of one option per decision, the units in
    ``recompute`` recomputed (seconds: what backward runs again included, :func:`rerun_seconds`; memory: the sum
    plus :func:`transient_bytes`)."""
    t = problem.fixed_seconds + sum(option_cost(d, recompute)[choice[i]] for i, d in enumerate(problem.decisions))
    t += sum(term_cost(term, choice) for term in problem.terms)
    if problem.rerun_terms:
        fixed, per_unit = rerun_seconds(problem, choice)
        t += fixed + sum(unit_share(recompute, u) * v for u, v in per_unit.items())
    return t, float(memory_points(problem, choice, recompute).max())


def recomputed_share(d: DecisionVar, recompute) -> float:
    """The share of ``d``'s copies recomputed: ``recompute`` is a set of units (all their copies) or a mapping
    {unit: share of its copies}."""
    return 0.0 if d.unit is None else unit_share(recompute, d.unit)


def option_cost(d: DecisionVar, recompute=frozenset()) -> list[float]:
    """Seconds of each option of ``d``, its unit's forward run again in backward when the unit is recomputed."""
    f = recomputed_share(d, recompute)
    return d.cost if not f else [c + f * x for c, x in zip(d.cost, d.forward)]


def option_memory(d: DecisionVar, recompute=frozenset()) -> list[float]:
    """Bytes of each option of ``d``: what a recomputed share keeps instead of its saved activations."""
    f = recomputed_share(d, recompute)
    return d.memory if not f else [(1 - f) * m + f * r for m, r in zip(d.memory, d.memory_recomputed)]


def transient_bytes(problem: Problem, choice: list[int], recompute=frozenset()) -> float:
    """What a plan's peak (:func:`memory_points`) adds to the bytes the program prices linearly at its point
    (``fixed_memory + Σ option_memory``): the other points' excess, ZeRO-3's gathered layers, backward's and the
    optimizer's temporaries, and what the redistributed copies and the readers' layouts change."""
    cols = option_columns(problem)
    at, shares = cols.at(choice), cols.shares(choice, recompute)
    p = problem.point
    linear = problem.fixed_memory + float((cols.points[at, p] + shares * cols.recomputed[at, p]).sum())
    return float(memory_points(problem, choice, recompute).max()) - linear


@dataclass
class OptionColumns:
    """Every option's bytes as arrays over the program's columns (built once per problem): ``points``
    (columns × liveness points), ``recomputed`` (what a recomputed share adds), ``parameter`` (1 for parameter
    and buffer options), the gradient and stored bytes, and the unit and ZeRO-3 layer of each column."""

    offsets: np.ndarray
    points: np.ndarray
    recomputed: np.ndarray
    parameter: np.ndarray
    gradient: np.ndarray
    stored: np.ndarray
    unit: np.ndarray  # -1: in no unit
    live: np.ndarray  # an op's end-of-forward bytes per copy (a recomputed copy's, alive again in its backward)
    layer: np.ndarray  # ZeRO-3 layer number, -1: not gathered at stage 3
    gathered: np.ndarray
    forward: np.ndarray  # an op option's forward seconds over every copy (what recomputing it costs again)
    stored_decisions: list = field(default_factory=list)  # the parameters' decisions (``stored`` bytes)

    def at(self, choice) -> np.ndarray:
        return self.offsets + np.asarray(choice)

    def shares(self, choice, recompute) -> np.ndarray:
        """The recomputed share of each chosen column's decision."""
        return self.unit_shares(recompute)[self.unit[self.at(choice)]]

    def unit_shares(self, recompute) -> np.ndarray:
        """The recomputed share of every unit, indexed by unit (index -1, no unit: 0)."""
        if isinstance(recompute, dict):
            table = [recompute.get(u, 0.0) for u in range(max(self.unit.max() + 1, 0))]
        else:
            table = [float(u in recompute) for u in range(max(self.unit.max() + 1, 0))]
        return np.array(table + [0.0])  # (unit -1 reads the trailing 0)

    def point_bytes(self, recompute) -> np.ndarray:
        """Bytes of every option column at every liveness point (columns × points), ``recompute``'s shares
        recomputed: the per-point form of :func:`option_memory`."""
        return self.points + self.unit_shares(recompute)[self.unit][:, None] * self.recomputed


def option_columns(problem: Problem) -> OptionColumns:
    """Every option's bytes, seconds and unit as arrays over the program's option columns (built once)."""
    if problem.columns is not None:
        return problem.columns
    n = sum(len(d.options) for d in problem.decisions)
    width = len(problem.fixed_points)
    cols = OptionColumns(np.zeros(len(problem.decisions), dtype=int), np.zeros((n, width)), np.zeros((n, width)),
                    np.zeros(n, dtype=bool), np.zeros(n), np.zeros(n), np.full(n, -1), np.zeros(n), np.full(n, -1),
                    np.zeros(n), np.zeros(n))
    layers: dict = {}
    c = 0
    for i, d in enumerate(problem.decisions):
        cols.offsets[i] = c
        for k in range(len(d.options)):
            cols.points[c + k] = d.points[k]
            if d.stored is not None:
                cols.parameter[c + k] = True
                cols.stored[c + k] = d.stored[k]
            else:
                cols.gradient[c + k] = d.gradient[k]
                cols.live[c + k] = live_bytes(d, d.points[k])
            if d.forward is not None:
                cols.forward[c + k] = d.forward[k]
            if d.unit is not None:
                cols.unit[c + k] = d.unit
                cols.recomputed[c + k] = d.points_recomputed[k] - d.points[k]
        if d.stored is not None:
            cols.stored_decisions.append(i)
        if i in problem.gathered:
            layer, gathered = problem.gathered[i]
            cols.layer[c: c + len(d.options)] = layers.setdefault(layer, len(layers))
            cols.gathered[c: c + len(d.options)] = gathered
        c += len(d.options)
    problem.columns = cols
    return cols


def memory_points(problem: Problem, choice: list[int], recompute=frozenset()) -> np.ndarray:
    """Bytes per liveness point of one plan by the memory model (:class:`autoshard.cost_models.memory.GraphMemory`):
    annotated parameters and buffers, each parameter option's stored state, gradient and kept gathered copy, the
    saved activations of the chosen layouts (:func:`activations`), a recomputed share's change
    (:func:`recomputation_change`), ZeRO-3's two gathered layers, backward's first temporaries (the largest
    activation gradient and the largest recomputed copy's activations) and the optimizer's (its largest stored
    tensor)."""
    cols = option_columns(problem)
    at = cols.at(choice)
    shares = cols.shares(choice, recompute)
    params = at[cols.parameter[at]]
    varying = problem.fixed_points + cols.points[params].sum(0)
    stored = max(float(problem.fixed_stored), float(cols.stored[at].max(initial=0.0)))
    zero3 = cols.layer[at] >= 0
    gathered = np.bincount(cols.layer[at][zero3], cols.gathered[at][zero3]).max(initial=0.0) if zero3.any() else 0.0
    acts, copies_gradient, per_unit, _, _ = activations(problem, choice)
    recomputed = {int(u) for u in cols.unit[at][shares > 0]}
    # the largest region's activations while its backward runs: a recomputed unit's copy, or a region marked before
    # the search (keyed by its id)
    live = max([per_unit.get(u, 0.0) for u in recomputed] + [v for u, v in per_unit.items() if isinstance(u, str)],
               default=0.0)
    unit_share = dict(zip(cols.unit[at].tolist(), shares.tolist()))
    for u, vec in recomputation_change(problem, choice).items():
        if unit_share.get(u, 0.0):
            acts = acts + unit_share[u] * vec
    # what the chosen ops allocate besides their outputs, as plan_memory counts it: the transients, and each kept
    # storage once (an attention's float mask per mask and layout read: GraphMemory.kept_storage)
    kept = []
    for d, k in zip(problem.decisions, choice):
        if d.workspace is not None:
            acts = acts + d.transient[k]
            kept.extend(d.kept[k])
    if kept:
        acts = acts + problem.memory_model.kept_points(kept)
    for i, per_option in problem.receive.items():  # a pipeline's receive buffers of the crossing values
        acts = acts + per_option[choice[i]]
    timeline = problem.memory_model.timeline if problem.memory_model is not None else None
    if problem.stage_sets is None:
        return point_totals(0.0, varying + acts, 2 * gathered,
                            max(float(cols.gradient[at].max(initial=0.0)), float(copies_gradient.max())) + live,
                            stored,
                            timeline.forward_ends if timeline is not None else (0,))
    # a pipeline's stages: each stage's end of forward holds its own ops' largest gradient and (accumulating: an
    # earlier microbatch made every gradient) its own parameters' largest new gradient, besides the copies' largest
    # gradient and the largest recomputed copy's activations (over every stage: an upper bound)
    out = point_totals(0.0, varying + acts, 2 * gathered, 0.0, stored, ())
    owner = timeline.owner()
    for end in timeline.forward_ends:
        mine = problem.stage_sets[int(owner[end])]
        grad = float(cols.gradient[at][mine].max(initial=0.0))
        new = float(cols.stored[at][mine].max(initial=0.0)) if timeline.accumulates(end) else 0.0
        out[end] += max(grad, float(copies_gradient[int(owner[end])])) + live + new
    return out


def live_bytes(d, points) -> float:
    """Bytes one copy of op decision ``d`` keeps at the end of its forward, from its option's ``points`` (every copy
    added up): at the point where the most copies are alive, divided by how many (the end of forward, every copy,
    on one timeline; a stage's own end of forward, its copies weighted by the microbatches in flight, under
    :class:`autoshard.cost_models.memory.StagedTimeline`)."""
    if d.alive is None:
        return float(points[0]) / (d.copies or 1)
    p = int(np.argmax(d.alive))
    return float(points[p]) / d.alive[p] if d.alive[p] > 0 else 0.0


def recomputation_change(problem: Problem, choice: list[int]) -> dict:
    """{unit: bytes per point its saved activations change by with every copy of it recomputed}: its values keep
    only what leaves their copy, and its copies keep their inputs whether or not their ops save them (a share of
    the copies recomputed scales it)."""
    _, _, _, inputs, change = activations(problem, choice)
    return {u: change.get(u, 0.0) + inputs.get(u, 0.0) for u in set(change) | set(inputs)}


def activations(problem: Problem, choice: list[int]) -> tuple:
    """What the chosen layouts keep for backward, and what recomputing a unit changes of it: (saved activation bytes
    per point with nothing recomputed, the largest gradient of a redistributed copy (an array: one entry per pipeline
    stage, one without stages), {unit: what one recomputed copy holds while its backward runs; region id: the same
    of a region marked before the search}, {unit: bytes per point of the inputs its copies keep as regions, that no
    op of theirs saves}, {unit: bytes per point its copies' values keep recomputed less what they keep otherwise});
    the last two are for every copy of the unit recomputed (a share scales them). The first is
    :func:`autoshard.cost_models.memory.saved_bytes` of every value group — its own output where a reader that
    keeps it reads the layout it is produced in, a copy per other layout a keeping reader needs, the outputs of
    multi-output ops that save them — as ``plan_memory`` counts the compiled graph; recomputed, a value keeps only
    the layouts read outside its own layer copy (by a reader that keeps them, or by another copy of its unit: a
    region's input). Layouts do not change while a plan is repaired: the last answer is kept for the same
    layouts."""
    key = list(choice)  # ops: their option; parameters: their spec (a stage is not a layout)
    for i in option_columns(problem).stored_decisions:
        key[i] = id(problem.decisions[i].options[choice[i]])
    key = tuple(key)
    cached = problem.activations_cache  # (read once: two HiGHS copies evaluate plans in two threads)
    if cached is None or cached[0] != key:
        cached = problem.activations_cache = (key, _layout_activations(problem, choice))
    acts, copies_gradient, live, region_inputs, change, parameter_copies = cached[1]
    for producers, vec in parameter_copies:  # a parameter stored sharded (ZeRO): its gathers count as ``gathered``
        if not any(problem.decisions[d].stages and problem.decisions[d].stages[choice[d]] for d in producers):
            acts = acts + vec
    return acts, copies_gradient, live, region_inputs, change


def _layout_activations(problem: Problem, choice: list[int]) -> tuple:
    """:func:`activations` for the layouts of ``choice`` (a repair changes ZeRO stages, not layouts: cached), the
    copies of each parameter apart, with the decisions whose stage decides whether they count."""
    memory = problem.memory_model
    parameter_copies = []
    values, live, region_inputs = [], {}, {}
    # the largest gradient of a redistributed copy, per pipeline stage (one entry without stages): a copy's gradient
    # exists in the backward of the stages of the value's producers and readers, not in every stage's
    stage_sets = problem.stage_sets
    copies_gradient = np.zeros(1 if stage_sets is None else stage_sets.shape[0])
    recomputed: dict = {}  # unit -> {index in values: the value as its unit's recomputed copy keeps it}
    unit_of: dict = {}  # value node -> the unit it lies in
    for d, k in zip(problem.decisions, choice):
        if d.stored is None and len(output_tensors(d.node)) > 1 and memory.is_value(d.node):
            own, numel = memory.own_bytes(d.node, d.options[k].output_spec)
            region = recompute_region(d.node)  # marked before the search: what it saves itself, again in backward
            if region is not None:
                one = saved_bytes([SavedValue(d.node, own, [], np.ones(1), numel)], _no_region)[1]
                live[region] = live.get(region, 0.0) + one
            if d.unit is not None:
                unit_of[d.node] = d.unit
                recomputed.setdefault(d.unit, {})[len(values)] = SavedValue(d.node, own, [], d.alive, numel)
            values.append(SavedValue(d.node, own, [], d.alive, numel))
    for term in problem.terms:
        u = term.members[0]
        parameter = u.op == "get_attr" and bool(u.meta.get(M.REQUIRES_GRAD))
        if not parameter and (not memory.is_value(u) or len(output_tensors(u)) != 1):
            continue
        ix = term.index()
        ends = [*ix.producers, *ix.consumers]
        here = slice(None) if stage_sets is None or not ends else stage_sets[:, ends].any(axis=1)
        o = term.fixed if term.fixed is not None else next(ix.out[(d, choice[d])] for d in ix.producers
                                                           if (d, choice[d]) in ix.out)
        dtype = u.meta["val"].dtype
        unit = problem.decisions[ix.producers[0]].unit if ix.producers else None

        def own_bytes(spec, u=u):
            return memory.copy_bytes(u, spec)
        reads, seen, inside = [], set(), []  # inside: what the value's unit keeps of it while recomputed
        regions: dict = {}  # unit -> {spec id: bytes} read by a unit that keeps it only as its region's input
        #: what the value's own copy keeps of it when recomputed: the layouts read outside that copy by a reader
        #: that keeps them or lies in another copy of its unit (recomputed too: it keeps its inputs)
        leaving = []
        for d in ix.consumers:
            du = problem.decisions[d].unit
            within = term.within.get(d, False)
            if not term.kept.get(d):
                if du is not None and du != unit and not parameter:
                    for i in ix.need.get((d, choice[d]), ()):
                        regions.setdefault(du, {})[id(i)] = own_bytes(i)
                if unit is not None and du == unit and not within:
                    leaving.extend(ix.need.get((d, choice[d]), ()))
                continue
            if not within:
                leaving.extend(ix.need.get((d, choice[d]), ()))
            for i in ix.need.get((d, choice[d]), ()):
                if i == o:
                    reads.append((None, u, None))
                    inside.append(reads[-1])
                elif id(i) not in seen:
                    seen.add(id(i))
                    reads.append((None, u, (("copy", id(term), id(i)), memory.copy_bytes(u, i))))
                    if within:
                        inside.append(reads[-1])
        wanted = {id(i): i for d in ix.consumers for i in ix.need.get((d, choice[d]), ())}
        for keep in term.outputs:
            spec = output_spec_for(o, keep)
            wanted.setdefault(id(spec), spec)
        for i in wanted.values():  # every copy's gradient exists in backward, kept or not (parameters': .grad)
            if i != o and not parameter:
                t = memory.copy_bytes(u, i) // max(1, u.meta["val"].element_size())
                copies_gradient[here] = np.maximum(copies_gradient[here], largest_gradient(t, dtype))
        if parameter:  # its copies alone (its own bytes are its decision's), unless stored sharded
            parameter_copies.append((ix.producers, saved_bytes([SavedValue(u, [0], reads, term.alive, 0)])[0]))
            continue
        own, numel = memory.own_bytes(u, o)
        # (a getitem's: ops' are decisions')
        copies_gradient[here] = np.maximum(copies_gradient[here], largest_gradient(numel, dtype))
        if unit is not None:
            unit_of[u] = unit
            kept_again, done = [], set()
            for i in leaving:
                if id(i) not in done:
                    done.add(id(i))
                    kept_again.append((None, u, None) if i == o
                                      else (None, u, (("copy", id(term), id(i)), memory.copy_bytes(u, i))))
            recomputed.setdefault(unit, {})[len(values)] = SavedValue(u, own, kept_again, term.alive, numel)
        values.append(SavedValue(u, own, reads, term.alive, numel))
        kept_layouts = {id(o)} if any(c is None for _, _, c in reads) else set()
        kept_layouts |= {c[0][2] for _, _, c in reads if c is not None}
        for du, layouts in regions.items():  # (a layout some reader keeps anyway counts once)
            extra = sum(b for i, b in layouts.items() if i not in kept_layouts)
            if extra:
                region_inputs[du] = region_inputs.get(du, 0.0) + extra * term.alive
        if unit is not None:
            one = saved_bytes([SavedValue(u, own, inside, np.ones(1), numel)], _no_region)[1]
            live[unit] = live.get(unit, 0.0) + one
        if term.region is not None:  # in a region marked before the search: what it holds while its backward runs
            again = []  # (as plan_memory's region_part: its own layout for any reader, copies for readers inside)
            for d in ix.consumers:
                if term.kept_plain.get(d):
                    again.extend((None, u, None) if i == o else
                                 (None, u, (("copy", id(term), id(i)), memory.copy_bytes(u, i)))
                                 for i in ix.need.get((d, choice[d]), ()) if i == o or term.same_region.get(d))
            one = saved_bytes([SavedValue(u, own, again, np.ones(1), numel)], _no_region)[1]
            live[term.region] = live.get(term.region, 0.0) + one

    def copied(view, source) -> bool:  # the view reads its source in another layout than the one it is made in
        index = None
        if is_getitem(source) and not is_getitem(view):  # a multi-output op's output: that op's layout of it
            source, index = source.args[0], source.args[1]
        dv, ds = (problem.index.get(canonical(problem.canon, x)) for x in (view, source))
        if dv is None or ds is None or problem.decisions[dv].stored is not None \
                or problem.decisions[ds].stored is not None:
            return False
        made = problem.decisions[ds].options[choice[ds]].output_spec
        if index is not None and isinstance(made, tuple) and made and isinstance(made[0], tuple):
            made = made[index] if isinstance(index, int) and index < len(made) else made[0]
        return problem.decisions[dv].options[choice[dv]].input_specs[0] != made

    keys: dict = {}

    def storage_of(node):
        if node not in keys:
            keys[node] = storage_key(node, copied)
        return keys[node]

    acts = saved_bytes(values, memory.region_of, storage_of)[0] if values else 0.0
    # each unit's recomputed copies keep only what leaves them: the change, all of a unit's copies recomputed
    change = {}
    for unit, replaced in recomputed.items():
        again = [replaced.get(j, v) for j, v in enumerate(values)]
        region = lambda n, unit=unit: unit if unit_of.get(n) == unit else None  # noqa: E731
        change[unit] = saved_bytes(again, region, storage_of)[0] - acts
    return acts, copies_gradient, live, region_inputs, change, parameter_copies


def ties(problem: Problem, d: DecisionVar) -> list[float]:
    """The tie-breaking seconds added to each option of ``d``: a parameter sharded on the data axis, or stored at a
    ZeRO stage that costs no time (keep the parameter whole)."""
    if problem.data_axis is None or d.node.op != "get_attr":
        return [0.0] * len(d.options)
    axis = problem.mesh.names.index(problem.data_axis)
    return [TIE_BREAK * d.copies * (isinstance(spec[axis], Shard) + (d.stages[k] if d.stages else 0))
            for k, spec in enumerate(d.options)]


def option_vectors(problem: Problem, recompute) -> tuple[list[float], list[float]]:
    """Seconds (ties broken) and bytes of every option variable, in column order."""
    cost: list[float] = []
    memory: list[float] = []
    for d in problem.decisions:
        cost.extend(c + tie for c, tie in zip(option_cost(d, recompute), ties(problem, d)))
        memory.extend(option_memory(d, recompute))
    return cost, memory


def binding(problem: Problem, limited: bool | None) -> str:
    """The report's binding constraint: ``limited`` is whether the memory limit changed the plan (the least-time
    plan exceeds it; None: not known, the search's time ran out before it found the least-time plan)."""
    if problem.memory_limit is None:
        return "step time"
    if limited is None:
        return "not known (the search's time limit ran out before it found the least-time plan)"
    return "memory limit" if limited else "step time (memory limit not binding)"


def format_bytes(b: float) -> str:
    if b >= 2**30:
        return f"{b / 2**30:.2f} GiB"
    return f"{b / 2**20:.2f} MiB" if b >= 2**20 else f"{b / 2**10:.1f} KiB"


def terms_touching(problem: Problem) -> dict[int, list[ValueTerm]]:
    """{decision: the value terms whose seconds depend on its option}."""
    touching: dict[int, list[ValueTerm]] = {}
    for term in problem.terms:
        ds = {d for d, _, _ in term.out} | {d for users in term.needs.values() for d, _ in users}
        ds |= {d for users in term.syncs.values() for d, _ in users}
        for d in ds:
            touching.setdefault(d, []).append(term)
    return touching


def explain(problem: Problem, choice: list[int]) -> list[M.Decision]:
    """Per decision: its cost share and the best rejected option (cost if only this decision changed)."""
    touching = terms_touching(problem)
    decisions: list[M.Decision] = []
    for i, d in enumerate(problem.decisions):
        terms = touching.get(i, [])
        here = _local_cost(d, i, choice[i], choice, terms)
        best_alt, best_cost = None, None
        for k in range(len(d.options)):
            if k == choice[i]:
                continue
            c = _local_cost(d, i, k, choice, terms)
            if c != INFEASIBLE and (best_cost is None or c < best_cost):
                best_alt, best_cost = d.options[k], c
        decisions.append(M.Decision(here, best_alt if isinstance(best_alt, M.Strategy) else None,
                                    best_cost, "least estimated step time"))
    return decisions


def _local_cost(d: DecisionVar, i: int, k: int, choice: list[int], terms: list[ValueTerm]) -> float:
    """Seconds of decision ``i`` at option ``k`` and of the terms it touches, every other decision as chosen."""
    trial = list(choice)
    trial[i] = k
    return d.cost[k] + sum(term_cost(t, trial) for t in terms)
