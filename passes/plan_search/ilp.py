"""The exact program of the plan search: a 0/1 integer linear program solved by HiGHS.

Variables and rows (built by :func:`build_program`, solved by :func:`solve_program`; :func:`solve` is both, with the
memory row):

* ``x[d, k] ∈ {0, 1}``: decision ``d`` takes option ``k``; ``Σ_k x[d, k] = 1`` (:meth:`_Builder.choose_one`).
* ``y[u, o] = Σ x[d, k]`` over the options that make value ``u`` come out as spec ``o`` (an expression).
* Values read by one position of each consumer use the tight "marginal" formulation (its LP is exact on
  tree-shaped parts of the graph; :meth:`_Builder.marginal`): per consumer ``c``, ``e[c, o, i] ≥ 0`` with
  ``Σ_i e[c, o, i] = y[o]`` and ``Σ_o e[c, o, i] = z[c, i]`` (the consumer's options that need ``i``); the
  redistribution ``o → i`` is bought once, ``w[o, i] ≥ e[c, o, i]`` for every ``c``.
* Otherwise (:meth:`_Builder.shared_redistributions`): ``r[u, i] ≥ x[c, k]`` for every consumer option that needs
  ``u`` as ``i`` (bought once, shared by every consumer, as ``passes/insert_collectives.py`` shares it) and
  ``q[u, o, i] ≥ y[u, o] + r[u, i] − 1`` paying ``time(o → i)``; impossible pairs get ``y[u, o] + r[u, i] ≤ 1``.
* ``g[u, i, axes] ≥ x[c, k]`` for consumer options that need the gradient of ``u`` all-reduced over ``axes``
  (:meth:`_Builder.syncs`); graph outputs add a cost per producer spec (:meth:`_Builder.outputs`).
* a redistribution between the ops of a recomputed region runs again in backward, at its forward seconds
  (:meth:`_Builder.rerun_cost`): on the column that buys it where every reader needing it runs it again alike
  (readers inside the region), else on a column the readers in the region buy alone.
* objective: ``Σ x·compute_time + Σ q·redistribution_time + Σ g·all_reduce_time`` (seconds, forward + backward;
  no overlap of communication and compute), plus the tie-breaking seconds of :func:`.objective.ties`;
* memory: per liveness point of :mod:`autoshard.cost_models.memory`, ``Σ x·bytes[point] + transients ≤ limit −
  fixed[point]`` (:func:`build_program` with ``memory_row``: :meth:`_Builder.memory_rows`); :func:`with_memory_row`
  adds the one row the Lagrangian walk prices to a program built without.

HiGHS solves the LP relaxation first (through ``highspy``, :mod:`.highs`): an integral LP optimum is an optimum of the
integer program; otherwise it branches (``mip_rel_gap = 0``). Objectives are solved in nanoseconds, since HiGHS also
stops at an absolute gap of 1e-6.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
from autoshard.cost_models.memory import largest_gradient
from autoshard.passes.plan_search.highs import highs_with, run
from autoshard.passes.plan_search.objective import live_bytes, option_vectors, recomputed_share, unit_share
from autoshard.passes.plan_search.problem import Problem, ValueTerm, output_spec_for

from autoshard import meta as M
from autoshard.errors import PlanError
from autoshard.placements import format_spec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Program:
    """The ILP of a problem for one recomputation set, built once and solved for many objectives."""

    c: np.ndarray  # seconds per variable (ties broken)
    mem: np.ndarray  # bytes per variable (option variables only)
    a: object  # scipy.sparse CSR constraint matrix
    lo: list
    hi: list
    integer: np.ndarray  # 1 for the option variables x[d, k], 0 for the auxiliary ones
    offsets: list[int]  # first column of each decision's options
    #: auxiliary column -> its bytes per liveness point (copies kept for backward): ``mem`` holds the priced point's
    extra: dict = field(default_factory=dict, compare=False)
    #: auxiliary column -> the unit whose recomputed share it is not kept for (kept only within its layer copy)
    within: dict = field(default_factory=dict, compare=False)
    #: auxiliary column -> (its seconds but for running again, forward seconds, (member, unit) pairs) of a
    #: redistribution backward runs again (:meth:`_Builder.rerun_cost`); for a recomputation set it costs the first
    #: plus :func:`rerun_copies` of the others times their forward seconds
    rerun: dict = field(default_factory=dict, compare=False)

    def choice(self, problem: Problem, x: np.ndarray) -> list[int]:
        """The option of each decision in the solution ``x``."""
        return [int(np.argmax(x[o: o + len(d.options)])) for o, d in zip(self.offsets, problem.decisions)]


@dataclass(frozen=True)
class SolveResult:
    """What :func:`solve_program` found: a choice (None: no plan in time, or none exists), whether it is proven
    optimal, HiGHS's relative gap, its message, and whether it stopped at the time limit."""

    choice: list[int] | None
    optimal: bool
    gap: float
    message: str
    timed_out: bool
    x: np.ndarray | None = None  # the solution (every column), None with ``choice``


@dataclass(frozen=True)
class _Terms:
    """What :meth:`_Builder.terms` adds to a program, kept for the next program of the same problem: the rows, the
    auxiliary columns' seconds but for :meth:`_Builder.rerun_cost`'s, the seconds the graph outputs add to option
    columns in order, and the columns' bytes, gradients, units and redistributions run again."""

    options: int  # option columns (the auxiliary ones follow)
    rows: list
    cols: list
    vals: list
    lo: list
    hi: list
    cost: list
    option_adds: list
    extra: dict
    gradients: list
    within: dict
    reruns: dict


class _Builder:
    """Columns and rows of the program, appended in order (a sparse matrix in coordinate form)."""

    def __init__(self, problem: Problem, recompute):
        self.problem, self.recompute = problem, recompute
        self.offsets, n = [], 0
        for d in problem.decisions:
            self.offsets.append(n)
            n += len(d.options)
        self.cost, self.memory = option_vectors(problem, recompute)
        self.integer = [1] * n
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.lo: list[float] = []
        self.hi: list[float] = []
        self.extra: dict[int, np.ndarray] = {}  # auxiliary column -> bytes per liveness point (kept copies)
        self.gradients: list[tuple[int, float]] = []  # (column, bytes of the gradient of the copy it makes)
        #: (id(term), id(spec)) -> (gradient bytes, bytes per point, the spec) of that copy; the entry holds its spec
        #: (and the problem its term), so an identity is not reused while the cache lives: a graph output's spec is
        #: made per call (output_spec_for), not interned, and a later one could otherwise get a freed one's id
        self._copies: dict = {}
        self.within: dict[int, int] = {}  # auxiliary column -> the unit it is kept only within (keep)
        self.reruns: dict[int, tuple] = {}  # auxiliary column -> (seconds, forward seconds, pairs) (rerun_cost)
        self._rerun_copies = RerunCopies(recompute)
        self.option_adds: list[tuple[int, float]] = []  # (option column, seconds added to it) by outputs

    def terms(self) -> None:
        """The rows of :meth:`choose_one` and of every value term (:meth:`term`) with their auxiliary columns. They
        are the same for every recomputation set but for the seconds :meth:`rerun_cost` adds, so they are built once
        per problem (:class:`_Terms`) and copied, those seconds added again for this builder's set."""
        done = self.problem.program_terms
        if done is None:
            n = len(self.cost)
            self.choose_one()
            for term in self.problem.terms:
                self.term(term)
            cost = self.cost[n:]
            for col, (seconds, _, _) in self.reruns.items():
                cost[col - n] = seconds
            self.problem.program_terms = _Terms(n, list(self.rows), list(self.cols), list(self.vals), list(self.lo),
                                                list(self.hi), cost, list(self.option_adds), dict(self.extra),
                                                list(self.gradients), dict(self.within), dict(self.reruns))
            return
        assert not self.lo and len(self.cost) == done.options
        self.rows, self.cols, self.vals = list(done.rows), list(done.cols), list(done.vals)
        self.lo, self.hi = list(done.lo), list(done.hi)
        for col, seconds in done.option_adds:  # in the order outputs added them: the same sums
            self.cost[col] += seconds
        self.cost += done.cost
        self.integer += [0] * len(done.cost)
        self.extra, self.gradients, self.within = dict(done.extra), list(done.gradients), dict(done.within)
        for col, (_, forward, pairs) in done.reruns.items():
            self.rerun_cost(col, forward, pairs)

    def copy_gradient(self, term: ValueTerm, spec, cols) -> None:
        """The gradient of a redistributed activation exists in backward (backward's temporaries): ``cols`` make
        it. (A parameter's copy's gradient goes to its ``.grad``, counted with the parameter.)"""
        g = self._copy(term, spec)[0]
        if g is not None:
            self.gradients += [(col, g) for col in cols]

    def copy_points(self, term: ValueTerm, spec, keepers) -> np.ndarray | None:
        """Bytes per point of the copy of ``term``'s value that a redistribution to ``spec`` makes, when one of
        ``keepers`` (consumer decisions) keeps it for backward and the memory model counts the value (an
        activation, or a parameter's kept copy); None otherwise."""
        if not any(term.kept.get(d) for d in keepers):
            return None
        return self._copy(term, spec)[1]

    def keep(self, col: int, kept: np.ndarray, term: ValueTerm, keepers) -> None:
        """Column ``col`` holds ``kept`` (a copy's bytes per point) of ``term``'s value for ``keepers``. When every
        keeper that keeps it reads it inside the value's own layer copy, a recomputed copy makes it again in
        backward instead (:func:`.objective.activations` counts it so): ``within`` names the unit, and the memory
        rows keep it for the unit's share not recomputed (:func:`kept_copies`)."""
        unit = self.problem.decisions[term.out[0][0]].unit if term.fixed is None and term.out else None
        within = all(term.within.get(d, False) for d in keepers if term.kept.get(d))
        self._keep(col, kept, unit if unit is not None and within else None)

    def _keep(self, col: int, kept: np.ndarray, unit: int | None) -> None:
        """:meth:`keep` with its unit found (None: kept outside its layer copy, or in no unit)."""
        self.extra[col] = kept
        if unit is not None:
            self.within[col] = unit

    def _copy(self, term: ValueTerm, spec) -> tuple:
        """(its gradient's bytes, None for a value the memory model does not count; bytes per point when kept, None
        for neither an activation nor a parameter's copy) of the copy of ``term``'s value in ``spec``: the same for
        every column that makes it (the program's largest loop asks once per producer spec and consumer)."""
        key = (id(term), id(spec))
        if key not in self._copies:
            u = term.members[0]
            memory = self.problem.memory_model
            value = memory.is_value(u)
            size = memory.copy_bytes(u, spec) if value or u.op == "get_attr" else 0
            g = largest_gradient(size // max(1, u.meta["val"].element_size()), u.meta["val"].dtype) if value else None
            kept = size * term.alive if value or (u.op == "get_attr" and u.meta.get(M.REQUIRES_GRAD)) else None
            self._copies[key] = (g, kept, spec)
        return self._copies[key][:2]

    def new_var(self, c: float) -> int:
        self.cost.append(c)
        self.integer.append(0)
        return len(self.cost) - 1

    def constraint(self, entries, lb: float, ub: float) -> None:
        self.rows += [len(self.lo)] * len(entries)
        self.cols += [col for col, _ in entries]
        self.vals += [v for _, v in entries]
        self.lo.append(lb)
        self.hi.append(ub)

    def _pair(self, a: int, b: int, lb: float, ub: float) -> None:
        """The row ``lb ≤ a − b ≤ ub`` (:meth:`constraint` of two entries: the program's most common row)."""
        r = len(self.lo)
        self.rows += (r, r)
        self.cols += (a, b)
        self.vals += (1.0, -1.0)
        self.lo.append(lb)
        self.hi.append(ub)

    def choose_one(self) -> None:
        for i, d in enumerate(self.problem.decisions):
            self.constraint([(self.offsets[i] + k, 1.0) for k in range(len(d.options))], 1.0, 1.0)

    def term(self, term: ValueTerm) -> None:
        if term.fixed is not None:
            y = {term.fixed: []}  # constant: always this spec
        else:
            y = {}
            for d, k, spec in term.out:
                y.setdefault(spec, []).append(self.offsets[d] + k)
        consumers = sorted({d for users in term.needs.values() for d, _ in users})
        own = self.own_output(term, y)
        if term.fixed is None and consumers and _single_position(term):
            self.marginal(term, y, consumers, own)
        else:
            self.shared_redistributions(term, y)
            for o, ys in y.items():  # an upper bound: kept in every layout it is produced in
                if o in own:
                    self.constraint([(own[o], 1.0)] + [(v, -1.0) for v in ys], 0.0, np.inf)
        self.outputs(term, y)
        self.syncs(term)

    def rerun_cost(self, col: int, forward: float, pairs) -> None:
        """Column ``col`` buys a redistribution of ``forward`` seconds forward (``term.forward_cost``), which the
        copies ``pairs`` ((member, unit) pairs: readers in its recomputed region, ``term.rerun``) run again in
        backward: it also costs its forward seconds per such copy (:func:`rerun_copies`, for this program's
        recomputation set)."""
        if forward and pairs:
            self.reruns[col] = (self.cost[col], forward, pairs)
            self.cost[col] += forward * self._rerun_copies(pairs)

    def own_output(self, term: ValueTerm, y: dict) -> dict:
        """{spec: column} holding the bytes per point of the value in the layout its op produces it in, for an op
        whose output is kept only by readers (``DecisionVar.own_output``; its options' ``points`` leave it out).
        The caller bounds each column below by what keeps it: a keeping reader reading that layout."""
        if term.fixed is not None or not term.out:
            return {}
        d = term.out[0][0]
        if not self.problem.decisions[d].own_output:
            return {}
        u = term.members[0]
        memory = self.problem.memory_model
        cols = {}
        for o in y:
            cols[o] = self.new_var(0.0)
            self.keep(cols[o], memory.copy_bytes(u, o) * term.alive, term, term.kept)
        return cols

    def marginal(self, term: ValueTerm, y: dict, consumers: list[int], own: dict | None = None) -> None:
        m = term.multiplicity
        ylist = list(y.items())
        inf = np.inf
        new_var, pair = self.new_var, self._pair
        # build_problem interns specs (one object per spec): look them up by identity, not by hashing placements
        # (the program's largest loop: a pair per producer spec, needed spec and consumer); term.needs keeps them
        needed_by: dict = {}  # consumer -> specs it may need
        columns: dict = {}  # (id(needed spec), consumer) -> the consumer's option columns needing it, in order
        for i, users in term.needs.items():
            for d, k in users:
                cols = columns.get((id(i), d))
                if cols is None:
                    cols = columns[(id(i), d)] = []
                    needed_by.setdefault(d, set()).add(i)
                cols.append(self.offsets[d] + k)
        order = {id(i): format_spec(i) for i in term.needs}  # (ids as above)
        spec_id: dict = {}  # id(needed spec) -> its number (ids as above)
        bought: dict = {}  # (producer spec index, needed spec number) -> variable
        pair_cost, forward_cost, _ = term.costs_by_id()
        cost, integer = self.cost, self.integer
        producers = [(oi, o, id(o), [(v, -1.0) for v in ys]) for oi, (o, ys) in enumerate(ylist)]
        # redistributions run again in backward (term.rerun): per needed spec, the (member, unit) pairs of the
        # readers that may need it, and whether every such reader runs it again alike (then the column buying it
        # for all of them carries the forward again; else a column bought by those readers alone does)
        again: dict = {}
        if term.rerun:
            for i in term.needs:
                sets = [term.rerun.get(d, frozenset()) for d in consumers if (id(i), d) in columns]
                pairs = frozenset().union(*sets)
                again[id(i)] = (pairs, all(x == pairs for x in sets))
        nothing = (frozenset(), True)
        # a consumer's kept copy is held within the value's layer copy (keep): the unit, else None
        unit = self.problem.decisions[term.out[0][0]].unit if term.out else None
        for c in consumers:
            needs = sorted(needed_by[c], key=lambda s: order[id(s)])
            keeps_c = term.kept.get(c)
            within = unit if unit is not None and term.within.get(c, False) else None
            reruns_c = term.rerun.get(c)
            numbers = [spec_id.setdefault(id(i), len(spec_id)) for i in needs]
            rerun = [again.get(id(i), nothing) for i in needs]
            copies = [None] * len(needs)  # per needed spec: (gradient bytes, kept bytes) of its copy (_copy)
            by_producer = [[] for _ in ylist]  # evars per producer spec, in needed spec order
            by_need = [[] for _ in needs]  # evars per needed spec, in producer spec order
            for oi, o, io, _ in producers:
                for ii, i in enumerate(needs):
                    pc = pair_cost[(io, id(i))]
                    if pc is None:
                        continue
                    copy = copies[ii]
                    if o is not i and copy is None:
                        copy = copies[ii] = self._copy(term, i)
                    kept = copy[1] if keeps_c and o is not i else None  # (copy_points)
                    keeps_own = own and o is i and o in own and keeps_c
                    ev = len(cost)  # (new_var)
                    cost.append(m * pc if len(consumers) == 1 else 0.0)
                    integer.append(0)
                    by_producer[oi].append(ev)
                    by_need[ii].append(ev)
                    pairs, alike = rerun[ii]
                    if len(consumers) == 1:
                        if pairs and (forward := forward_cost.get((io, id(i)))):
                            self.rerun_cost(ev, forward, pairs)
                        if o is not i and copy[0] is not None:  # (copy_gradient)
                            self.gradients.append((ev, copy[0]))
                        if kept is not None:
                            self._keep(ev, kept, within)
                        if keeps_own:
                            pair(own[o], ev, 0.0, inf)
                        continue
                    if keeps_own:
                        pair(own[o], ev, 0.0, inf)
                    if pc > 0:
                        bv = bought.get((oi, numbers[ii]))
                        if bv is None:
                            bv = bought[(oi, numbers[ii])] = new_var(m * pc)
                            if alike and pairs:
                                self.rerun_cost(bv, forward_cost.get((io, id(i)), 0.0), pairs)
                        pair(bv, ev, 0.0, inf)
                        if not alike and reruns_c:
                            av = bought.get(("again", oi, numbers[ii]))
                            if av is None:
                                av = bought[("again", oi, numbers[ii])] = new_var(0.0)
                                self.rerun_cost(av, forward_cost.get((io, id(i)), 0.0), pairs)
                            pair(av, ev, 0.0, inf)
                    if o is not i and copy[0] is not None:  # (copy_gradient)
                        self.gradients.append((ev, copy[0]))
                    if kept is not None:  # the copy a keeping consumer holds, made once for all of them
                        kv = bought.get(("kept", oi, numbers[ii]))
                        if kv is None:
                            kv = bought[("kept", oi, numbers[ii])] = new_var(0.0)
                            self._keep(kv, kept, within)
                        pair(kv, ev, 0.0, inf)
            for oi, _, _, minus in producers:
                self.constraint([(ev, 1.0) for ev in by_producer[oi]] + minus, 0.0, 0.0)
            for ii, i in enumerate(needs):
                self.constraint([(ev, 1.0) for ev in by_need[ii]] + [(v, -1.0) for v in columns[(id(i), c)]], 0.0,
                                0.0)

    def shared_redistributions(self, term: ValueTerm, y: dict) -> None:
        """Redistributions wanted by consumers, shared between them."""
        m = term.multiplicity
        for i, users in sorted(term.needs.items(), key=lambda kv: format_spec(kv[0])):
            costs = {o: term.pair_cost[(o, i)] for o in y}
            if all(c == 0 for c in costs.values()):
                continue
            rv = self.new_var(0.0)
            readers = _by_decision(users)
            for d, ks in readers.items():  # a consumer's options exclude each other: sum them
                self.constraint([(rv, 1.0)] + [(self.offsets[d] + k, -1.0) for k in ks], 0.0, np.inf)
            # run again in backward by readers in the value's recomputed region (term.rerun): when every reader
            # does alike, the column buying it carries the forward again; else a column those readers buy (sv, av)
            sets = [term.rerun.get(d, frozenset()) for d in readers] if term.rerun else []
            pairs = frozenset().union(*sets)
            alike = all(x == pairs for x in sets)
            sv = None
            if pairs and not alike:
                sv = self.new_var(0.0)
                for d, ks in readers.items():
                    if term.rerun.get(d):
                        self.constraint([(sv, 1.0)] + [(self.offsets[d] + k, -1.0) for k in ks], 0.0, np.inf)
            # the copy, where a consumer keeps it (priced as if every consumer needing it did: an upper bound)
            keepers = {d for d, _ in users}
            kept = self.copy_points(term, i, keepers)
            for o, ys in y.items():
                c = costs[o]
                if c == 0:
                    continue
                if term.fixed is not None:  # y is the constant 1 (an input or annotated parameter: never run again)
                    if c is None:
                        self.constraint([(rv, 1.0)], 0.0, 0.0)
                    else:
                        self.cost[rv] += m * c
                        if kept is not None and o is not i:
                            self.keep(rv, kept, term, keepers)
                        if o is not i:
                            self.copy_gradient(term, i, [rv])
                    continue
                if c is None:
                    self.constraint([(rv, 1.0)] + [(v, 1.0) for v in ys], -np.inf, 1.0)
                    continue
                qv = self.new_var(m * c)
                self.constraint([(qv, 1.0), (rv, -1.0)] + [(v, -1.0) for v in ys], -1.0, np.inf)
                if alike:
                    self.rerun_cost(qv, term.forward_cost.get((o, i), 0.0) if pairs else 0.0, pairs)
                elif sv is not None:
                    av = self.new_var(0.0)
                    self.constraint([(av, 1.0), (sv, -1.0)] + [(v, -1.0) for v in ys], -1.0, np.inf)
                    self.rerun_cost(av, term.forward_cost.get((o, i), 0.0) if pairs else 0.0, pairs)
                if kept is not None and o is not i:
                    self.keep(qv, kept, term, keepers)
                if o is not i:
                    self.copy_gradient(term, i, [qv])

    def outputs(self, term: ValueTerm, y: dict) -> None:
        """Graph outputs: a cost that depends on the producer's spec only."""
        if not term.outputs:
            return
        for o, ys in y.items():
            costs = [term.pair_cost[(o, output_spec_for(o, keep))] for keep in term.outputs]
            if any(c is None for c in costs):
                for v in ys:
                    self.constraint([(v, 1.0)], 0.0, 0.0)
                continue
            for keep in term.outputs:
                if output_spec_for(o, keep) != o:
                    self.copy_gradient(term, output_spec_for(o, keep), ys)
            if term.fixed is not None:
                continue  # constant
            for v in ys:
                self.option_adds.append((v, term.multiplicity * sum(costs)))
                self.cost[v] += self.option_adds[-1][1]

    def syncs(self, term: ValueTerm) -> None:
        """A column per gradient sync (≥ each reader option needing it); where the parameter stored at stage 2/3
        makes it a reduce-scatter, a column of the saving (negative seconds) ≤ the sync and ≤ those options. When
        one decision reads the parameter, its syncs exclude each other: the savings together are ≤ the staged
        options too (else the relaxation stores it half at stage 2 and takes half of every sync's saving)."""
        savings, staged_all = [], set()
        for key, users in sorted(term.syncs.items(), key=lambda kv: (format_spec(kv[0][0]), kv[0][1])):
            gv = self.new_var(term.multiplicity * term.sync_cost[key])
            for d, ks in _by_decision(users).items():
                self.constraint([(gv, 1.0)] + [(self.offsets[d] + k, -1.0) for k in ks], 0.0, np.inf)
            if key in term.zero_syncs:
                saving, staged = term.zero_syncs[key]
                sv = self.new_var(-term.multiplicity * saving)
                self.constraint([(sv, 1.0), (gv, -1.0)], -np.inf, 0.0)
                self.constraint([(sv, 1.0)] + [(self.offsets[d] + k, -1.0) for d, k in sorted(staged)], -np.inf, 0.0)
                savings.append(sv)
                staged_all |= staged
        readers = {d for users in term.syncs.values() for d, _ in users}
        if len(savings) > 1 and len(readers) == 1:
            self.constraint([(sv, 1.0) for sv in savings]
                            + [(self.offsets[d] + k, -1.0) for d, k in sorted(staged_all)], -np.inf, 0.0)

    def memory_rows(self, recompute, room: float | None, scale: float | None = None) -> int | None:
        """One row per liveness point (:func:`.objective.memory_points` as a linear program): the options' bytes at
        that point, ZeRO-3's two gathered layers (every point but the step), backward's first temporaries (the end
        of forward) and the optimizer's (the step) as variables bounded below by what every chosen option needs
        (``v ≥ Σ_k bytes[k]·x[d, k]`` per decision, per layer, per recomputed unit). The copies redistributions
        make for readers that keep them are columns of their own (:meth:`copy_points`). ``room`` None: the rows
        bound a peak variable instead (bytes / ``scale``; returned), which the caller minimises."""
        problem = self.problem
        last = len(problem.fixed_points) - 1
        # the variables are in [0, 1]: bytes / scale (more than the room never fits)
        scale = max(room if room is not None else scale, 1.0)
        peak = self.new_var(0.0) if room is None else None

        def at_least(var: int, parts) -> None:  # var ≥ Σ bytes·x over ``parts`` [(decision, bytes per option)]
            entries = [(self.offsets[i] + k, -b) for i, per in parts for k, b in enumerate(per) if b]
            if entries:
                self.constraint([(var, scale)] + entries, 0.0, np.inf)

        gradient, stored, zero3, live = (self.new_var(0.0) for _ in range(4))
        self.constraint([(stored, scale)], problem.fixed_stored, np.inf)
        layers: dict = {}
        for i, d in enumerate(problem.decisions):
            if d.stored is not None:
                at_least(stored, [(i, d.stored)])
            else:
                at_least(gradient, [(i, d.gradient)])
        for col, g in self.gradients:
            self.constraint([(gradient, scale), (col, -g)], 0.0, np.inf)
        for i, (layer, gathered) in problem.gathered.items():
            layers.setdefault(layer, []).append((i, gathered))
        for parts in layers.values():
            at_least(zero3, parts)
        units: dict = {}
        for i, d in enumerate(problem.decisions):
            if recomputed_share(d, recompute):
                units.setdefault(d.unit, []).append((i, [live_bytes(d, v) for v in d.points]))
        for parts in units.values():
            at_least(live, parts)
        kept = kept_copies(self.extra, self.within, recompute)
        timeline = problem.memory_model.timeline if problem.memory_model is not None else None
        starts = set(timeline.forward_ends) if timeline is not None else {0}
        # a pipeline's stages: each stage's end of forward holds its own largest gradients (.objective.memory_points)
        own: dict[int, tuple[int, int]] = {}  # end of forward -> (its stage's gradient, its new parameter gradient)
        if problem.stage_sets is not None:
            owner = timeline.owner()
            for end in timeline.forward_ends:
                mine = problem.stage_sets[int(owner[end])]
                grad_s, new_s = self.new_var(0.0), self.new_var(0.0)
                for i, d in enumerate(problem.decisions):
                    if not mine[i]:
                        continue
                    if d.stored is not None:
                        at_least(new_s, [(i, d.stored)])
                    else:
                        at_least(grad_s, [(i, d.gradient)])
                for col, g in self.gradients:
                    self.constraint([(grad_s, scale), (col, -g)], 0.0, np.inf)
                own[end] = (grad_s, new_s)
        for p in range(last + 1):
            entries = []
            for i, d in enumerate(problem.decisions):
                f = recomputed_share(d, recompute)
                for k, v in enumerate(d.points):
                    b = (1 - f) * v[p] + f * d.points_recomputed[k][p] if f else v[p]
                    if b:
                        entries.append((self.offsets[i] + k, b))
            entries += [(col, b) for col, v in kept.items() if (b := v[p])]
            entries += [(zero3, 2.0 * scale)] if p < last else [(stored, scale)]
            if p in own:
                grad_s, new_s = own[p]
                entries += [(grad_s, scale), (live, scale)] + ([(new_s, scale)] if timeline.accumulates(p) else [])
            elif p in starts:
                entries += [(gradient, scale), (live, scale)]
            if peak is None:
                self.constraint(entries, -np.inf, room - float(problem.fixed_points[p]))
            else:
                self.constraint(entries + [(peak, -scale)], -np.inf, -float(problem.fixed_points[p]))
        return peak

    def program(self) -> Program:
        from scipy.sparse import coo_matrix

        n = len(self.cost)
        a = coo_matrix((self.vals, (self.rows, self.cols)), shape=(len(self.lo), n)).tocsr()
        mem = np.zeros(n)
        mem[:len(self.memory)] = self.memory
        for col, v in kept_copies(self.extra, self.within, self.recompute).items():
            mem[col] = v[self.problem.point]
        return Program(np.array(self.cost), mem, a, self.lo, self.hi, np.array(self.integer), self.offsets,
                       self.extra, self.within, self.reruns)


def rerun_copies(pairs, recompute) -> float:
    """How many copies run a redistribution again in backward with ``recompute``'s units recomputed (a column of
    :meth:`_Builder.rerun_cost` adds its forward seconds per copy): each copy in a region marked before the search,
    and the recomputed share of each unit's copies."""
    marked = {j for j, unit in pairs if unit is None}
    return len(marked) + sum(unit_share(recompute, unit) for j, unit in pairs if unit is not None and j not in marked)


class RerunCopies:
    """:func:`rerun_copies` for one recomputation set, once per ``pairs`` object: a program reuses one frozenset of
    pairs for every column buying the same redistribution (thousands of columns on a large model). Keyed by
    identity, each entry holding its ``pairs`` so that the identity is not reused while the cache lives."""

    def __init__(self, recompute):
        self.recompute = recompute
        self._seen: dict[int, tuple] = {}

    def __call__(self, pairs) -> float:
        hit = self._seen.get(id(pairs))
        if hit is None:
            hit = self._seen[id(pairs)] = (pairs, rerun_copies(pairs, self.recompute))
        return hit[1]


def kept_copies(extra: dict, within: dict, recompute) -> dict:
    """{auxiliary column: bytes per point} of the kept copies with ``recompute``'s units recomputed: a copy kept
    only within its layer copy (``within``: column -> unit) keeps the share of its unit not recomputed."""
    out = {}
    for col, v in extra.items():
        u = within.get(col)
        f = 0.0 if u is None else (recompute.get(u, 0.0) if isinstance(recompute, dict) else float(u in recompute))
        out[col] = v * (1.0 - f) if f else v
    return out


def build_program(problem: Problem, recompute=frozenset(), reserve: float = 0.0, memory_row: bool = True) -> Program:
    """The ILP of ``problem`` with the units in ``recompute`` recomputed; with ``memory_row`` (and a limit) the
    memory row ``Σ x·bytes ≤ memory_limit − fixed − reserve``."""
    b = _Builder(problem, recompute)
    b.terms()
    if problem.memory_limit is not None and memory_row:
        b.memory_rows(recompute, problem.memory_limit - reserve)
    return b.program()


def least_peak_program(problem: Problem, recompute, scale: float, seconds_scale: float) -> Program:
    """The program whose optimum is the plan of least peak by the point rows of :meth:`_Builder.memory_rows`
    (bytes up to ``scale``), its seconds (in units of ``seconds_scale``) breaking ties."""
    b = _Builder(problem, recompute)
    b.terms()
    peak = b.memory_rows(recompute, None, scale)
    prog = b.program()
    cost = prog.c * 1e-6 / max(seconds_scale, 1e-30)
    cost[peak] = 1.0
    return with_costs(prog, cost, prog.mem)


def with_memory_row(prog: Program, room: float) -> Program:
    """``prog`` plus the row ``Σ mem·x ≤ room``."""
    from scipy.sparse import csr_matrix, vstack

    return Program(prog.c, prog.mem, vstack([prog.a, csr_matrix(prog.mem)]).tocsr(), [*prog.lo, -np.inf],
                   [*prog.hi, room], prog.integer, prog.offsets, prog.extra, prog.within, prog.rerun)


def with_costs(prog: Program, cost: np.ndarray, mem: np.ndarray) -> Program:
    """``prog``'s rows with other seconds and bytes per column (another recomputation set)."""
    return Program(cost, mem, prog.a, prog.lo, prog.hi, prog.integer, prog.offsets, prog.extra, prog.within,
                   prog.rerun)


def solve_program(problem: Problem, prog: Program, cost: np.ndarray, time_limit: float,
                  start: list[int] | None = None) -> SolveResult:
    """The least-``cost`` integer point of ``prog``: the LP relaxation first (an integral LP optimum is an optimum
    of the integer program: it is feasible there, and no integer point beats the relaxation), else branch and
    bound within what is left of ``time_limit`` seconds (HiGHS through :mod:`.highs`)."""
    # HiGHS also stops at an absolute gap of 1e-6: in seconds that hides real differences, so solve in nanoseconds.
    c, integer = cost * 1e9, prog.integer
    started = time.perf_counter()
    res = run(highs_with(prog.a, prog.lo, prog.hi, c), time_limit, mip=False)
    logger.debug("LP relaxation: %s, integral %s", res.message,
                 None if res.x is None else integral(res.x[integer == 1]))
    if res.x is None or not integral(res.x[integer == 1]):
        left = max(0.1, time_limit - (time.perf_counter() - started))  # one time limit for both runs
        highs = highs_with(prog.a, prog.lo, prog.hi, c, integer)
        if start is not None:  # a known plan (an option per decision) as HiGHS's first incumbent
            cols = np.array([prog.offsets[d] + k for d, k in enumerate(start)], dtype=np.int32)
            highs.setSolution(len(cols), cols, np.ones(len(cols)))
        res = run(highs, left, mip=True)
        logger.debug("MILP: %s after %.2f s", res.message, time.perf_counter() - started)
    choice = prog.choice(problem, res.x) if res.x is not None else None
    return SolveResult(choice, res.optimal, res.gap, res.message, res.timed_out, res.x)


def solve(problem: Problem, time_limit: float = 120.0, info: dict | None = None, recompute=frozenset(),
          reserve: float = 0.0) -> list[int]:
    """One option per decision: the exact optimum of the ILP with the memory row (``memory_limit`` less
    ``reserve`` bytes, less the fixed memory). ``info`` (when given) receives ``optimal`` (False when HiGHS stopped
    at ``time_limit`` seconds with a feasible plan that is not proven optimal), ``gap`` and ``message``. Raises
    :class:`~autoshard.errors.PlanError` when HiGHS finds no plan."""
    prog = build_program(problem, recompute, reserve)
    res = solve_program(problem, prog, prog.c, time_limit)
    if res.choice is None:
        limit = f" under the memory limit of {problem.memory_limit:.0f} bytes per rank" if problem.memory_limit else ""
        raise PlanError(f"the plan search found no valid plan{limit} ({res.message}). Raise memory_limit, use a "
                        "larger mesh, or relax the annotations.")
    if info is not None:
        info.update(optimal=res.optimal, gap=res.gap, message=res.message)
    return res.choice


def integral(values: np.ndarray, tol: float = 1e-9) -> bool:
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
