"""Repair: a plan within the memory limit from a plan of the Lagrangian walk, by moves that keep every layout.

The walk's plans are optimal for their multiplier λ, but their memory jumps in steps between λs; the repair fills
the slack between the steps (:func:`repair`). A :class:`Move` changes one parameter's ZeRO stage (another option
of the same spec) or recomputes one more (or one fewer) copy of a unit; layouts never change, so the
communication seconds stay those of the starting plan (but for a stage move's gradient sync: a reduce-scatter at
stage 2/3 where the readers sync over the data axis, :attr:`.problem.ValueTerm.zero_syncs`) and each move's seconds
and bytes are exact deltas.

1. While the plan is over the limit: apply the move of least seconds added per byte freed (:func:`_fit`).
2. Then, while the plan improves: the move saving the most seconds that still fits, else a pair of moves (one
   saving seconds, one freeing the bytes it needs; estimated linearly, then evaluated exactly) (:func:`_improve`).

With neither ZeRO stages nor recomputation to choose (``zero=0``, no ``recompute="auto"``) there is no move: a plan
over the limit stays over it.

When the search's time runs out before the walk met a plan within the limit, :func:`fallback_plan` makes one without
a solver, in time linear in the program: the memory is a sum over decisions (plus the transient bytes), so the
option of least bytes per decision, every unit recomputed, is the least-memory plan (:func:`least_memory_plan`);
coordinate descent over layouts (:func:`improve_layouts`: per decision the option of fewest seconds, its value
terms included, that keeps the plan within the limit) and :func:`repair` then buy back time. Without a limit (HiGHS
out of time on the unconstrained program) the descent starts from :func:`quickest_plan`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from autoshard.passes.plan_search.objective import (Candidate, evaluate, memory_points, option_cost, option_memory,
                                                    recomputation_change, rerun_seconds, term_cost, terms_touching,
                                                    transient_bytes)
from autoshard.passes.plan_search.problem import Problem


@dataclass(frozen=True)
class Move:
    """A parameter's option ``index`` set to ``value`` (kind "stage": another stage of the same spec), or unit
    ``index``'s recomputed share set to ``value`` (kind "unit")."""

    kind: str
    index: int
    value: float | int


@dataclass(frozen=True)
class PricedMove:
    move: Move
    seconds: float  # added (negative: saved)
    bytes: float  # added (negative: freed)


class _Plan:
    """The plan being repaired: its choice and recomputed shares, with the seconds and bytes of moves."""

    def __init__(self, problem: Problem, choice, units):
        self.problem = problem
        self.choice = list(choice)
        self.share = {u: (float(units.get(u, 0.0)) if isinstance(units, dict) else float(u in units))
                      for u in range(len(problem.units))}
        self.members: dict = {}
        for i, d in enumerate(problem.decisions):
            if d.unit is not None:
                self.members.setdefault(d.unit, []).append(i)
        self.staged = [i for i, d in enumerate(problem.decisions) if d.stages]
        # moves keep every layout; the seconds every plan pays count here too
        self.comm = problem.fixed_seconds + sum(term_cost(term, self.choice) for term in problem.terms)
        # ... and the redistributions backward runs again: fixed, or per unit's share (rerun_seconds)
        rerun, self.rerun = rerun_seconds(problem, self.choice) if problem.rerun_terms else (0.0, {})
        self.comm += rerun
        # ... but a stage move changes a gradient sync over the data axis (all-reduce or reduce-scatter)
        touching = terms_touching(problem)
        self.syncs = {i: [t for t in touching.get(i, ()) if t.zero_syncs] for i in self.staged}
        self.synced: dict = {}  # (decision, option) -> seconds of those terms (sync_seconds)
        self.same: dict = {}  # (decision, option) -> its other options of the same spec (stage moves)

    def moves(self) -> list[PricedMove]:
        out = []
        for i in self.staged:
            d, k = self.problem.decisions[i], self.choice[i]
            same = self.same.get((i, k))
            if same is None:  # (options never change: compared once)
                same = self.same[(i, k)] = [k2 for k2, spec in enumerate(d.options) if k2 != k and spec == d.options[k]]
            for k2 in same:
                dt = d.cost[k2] - d.cost[k] + self.sync_change(i, k2)
                out.append(PricedMove(Move("stage", i, k2), dt, d.memory[k2] - d.memory[k]))
        change = recomputation_change(self.problem, self.choice)  # (layouts fixed: cached)
        p = self.problem.point
        for u, ds in self.members.items():
            step = 1.0 / len(self.problem.units[u].copies)
            decisions = [(self.problem.decisions[i], self.choice[i]) for i in ds]
            dt = step * (sum(d.forward[k] for d, k in decisions) + self.rerun.get(u, 0.0))
            dm = step * float(change[u][p]) if u in change else 0.0  # bytes, at the priced point
            if self.share[u] < 1.0 - 1e-9:
                out.append(PricedMove(Move("unit", u, min(1.0, self.share[u] + step)), dt, dm))
            if self.share[u] > 1e-9:
                out.append(PricedMove(Move("unit", u, max(0.0, self.share[u] - step)), -dt, -dm))
        return out

    def sync_change(self, i: int, k: int) -> float:
        """Seconds the gradient syncs of parameter decision ``i`` change by at its option ``k``."""
        return self.sync_seconds(i, k) - self.sync_seconds(i, self.choice[i]) if self.syncs[i] else 0.0

    def sync_seconds(self, i: int, k: int) -> float:
        """Seconds of the terms of parameter decision ``i`` that price a ZeRO sync, at its option ``k``: they depend
        on ``i`` and on its readers' options, which no move changes, so they are computed once per option."""
        key = (i, k)
        if key not in self.synced:
            k0, self.choice[i] = self.choice[i], k
            self.synced[key] = sum(term_cost(t, self.choice) for t in self.syncs[i])
            self.choice[i] = k0
        return self.synced[key]

    def apply(self, move: Move) -> Move:
        """Apply ``move``; returns the move that undoes it."""
        if move.kind == "stage":
            undo = Move("stage", move.index, self.choice[move.index])
            self.comm += self.sync_change(move.index, move.value)
            self.choice[move.index] = move.value
        else:
            undo = Move("unit", move.index, self.share[move.index])
            self.share[move.index] = move.value
        return undo

    def evaluate(self) -> tuple[float, float]:
        """:func:`.objective.evaluate` with the communication fixed: the chosen option's seconds and bytes only
        (this runs hundreds of times per repair; building every option's list each time was its cost). The bytes
        are the peak of :func:`.objective.memory_points` (its liveness points, the layouts' activations cached)."""
        t = self.comm
        for i, d in enumerate(self.problem.decisions):
            k = self.choice[i]
            f = self.share[d.unit] if d.unit is not None else 0.0
            t += d.cost[k] + f * d.forward[k] if f else d.cost[k]
        t += sum(self.share[u] * v for u, v in self.rerun.items())
        return t, float(memory_points(self.problem, self.choice, self.share).max())


def repair(problem: Problem, choice, units) -> Candidate | None:
    """A plan within ``problem.memory_limit`` from ``choice`` with ``units`` recomputed (a set of units recomputed
    whole, or {unit: share of its copies}) by moves that keep every layout, or None when no move makes it fit.
    The candidate's ``recompute`` is the {unit: share} it ends with."""
    plan = _Plan(problem, choice, units)
    if not _fit(plan, problem.memory_limit):
        return None
    t, m = _improve(plan, problem.memory_limit)
    return Candidate(tuple(plan.choice), plan.share, t, m, m - transient_bytes(problem, plan.choice, plan.share))


def _fit(plan: _Plan, limit: float) -> bool:
    """Apply the move of least seconds added per byte freed until the plan fits; False when no move is left."""
    t, m = plan.evaluate()
    while m > limit:
        freeing = [(pm.seconds / -pm.bytes, pm.move) for pm in plan.moves() if pm.bytes < 0]
        if not freeing:
            return False
        plan.apply(min(freeing, key=lambda x: x[0])[1])
        t, m = plan.evaluate()
    return True


def _improve(plan: _Plan, limit: float) -> tuple[float, float]:
    """Take the moves that save seconds most while the plan still fits, then pairs of moves; (seconds, bytes)."""
    t, m = plan.evaluate()
    improved = True
    while improved:
        listed = plan.moves()
        better = _best_single(plan, listed, limit, t) or _best_pair(plan, listed, limit, t, m)
        improved = better is not None
        if improved:
            t, m = better
    return t, m


def _best_single(plan: _Plan, listed: list[PricedMove], limit: float, t: float) -> tuple[float, float] | None:
    for pm in sorted((pm for pm in listed if pm.seconds < 0), key=lambda pm: (pm.seconds, _order(pm.move))):
        undo = plan.apply(pm.move)
        t2, m2 = plan.evaluate()
        if m2 <= limit and t2 < t:
            return t2, m2
        plan.apply(undo)
    return None


def _best_pair(plan: _Plan, listed: list[PricedMove], limit: float, t: float, m: float) -> tuple[float, float] | None:
    """A move saving seconds whose bytes another frees (linear estimate first, then evaluated exactly)."""
    saving = sorted((pm for pm in listed if pm.seconds < 0), key=_key)
    freeing = sorted((pm for pm in listed if pm.bytes < 0 and pm.seconds >= 0), key=_key)
    for a in saving:
        for b in freeing:
            if (a.seconds + b.seconds >= 0 or m + a.bytes + b.bytes > limit
                    or (a.move.kind, a.move.index) == (b.move.kind, b.move.index)):
                continue
            undo_a = plan.apply(a.move)
            undo_b = plan.apply(b.move)
            t2, m2 = plan.evaluate()
            if m2 <= limit and t2 < t:
                return t2, m2
            plan.apply(undo_b)
            plan.apply(undo_a)
    return None


def _order(move: Move) -> tuple:
    return (move.kind, move.index, move.value)


def _key(pm: PricedMove) -> tuple:
    """The order the moves were tried in before (seconds, bytes, then the move itself): deterministic."""
    return (pm.seconds, pm.bytes, _order(pm.move))


def least_memory_plan(problem: Problem) -> Candidate:
    """Per decision the option of fewest bytes (fewest seconds among equals), every unit recomputed."""
    every = frozenset(range(len(problem.units)))
    choice = []
    for d in problem.decisions:
        mem, cost = option_memory(d, every), option_cost(d, every)
        choice.append(min(range(len(d.options)), key=lambda k: (mem[k], cost[k], k)))
    return Candidate.of(problem, choice, every, float("inf"))


def improve_layouts(problem: Problem, start: Candidate, deadline: float) -> Candidate:
    """Coordinate descent from ``start`` (within the limit): per decision, the option of fewest seconds (its own and
    those of the value terms it touches) whose bytes keep the plan within the limit; rounds until none improves or
    ``deadline`` (``time.perf_counter()``) passes."""
    limit = problem.memory_limit if problem.memory_limit is not None else float("inf")
    units = start.recompute
    touching = terms_touching(problem)
    choice = list(start.choice)
    t, m = start.time, start.memory
    improved = True
    while improved and time.perf_counter() < deadline:
        improved = False
        for i, d in enumerate(problem.decisions):
            if time.perf_counter() >= deadline:
                break
            k0 = choice[i]
            cost, mem = option_cost(d, units), option_memory(d, units)
            seconds = {}
            for k in range(len(d.options)):
                if k == k0 or m + mem[k] - mem[k0] <= limit:
                    choice[i] = k
                    seconds[k] = cost[k] + sum(term_cost(term, choice) for term in touching.get(i, ()))
            k = min(seconds, key=lambda k: (seconds[k], k))
            choice[i] = k
            if k == k0 or not seconds[k] < seconds[k0]:
                choice[i] = k0
                continue
            t2, m2 = evaluate(problem, choice, units)  # exact: the transient bytes depend on the whole choice
            if m2 <= limit and t2 < t:
                t, m, improved = t2, m2, True
            else:
                choice[i] = k0
    return Candidate.of(problem, choice, units, start.multiplier)


def quickest_plan(problem: Problem) -> Candidate:
    """Per decision the option of fewest seconds of its own (communication left out), nothing recomputed."""
    choice = [min(range(len(d.options)), key=lambda k: (d.cost[k], k)) for d in problem.decisions]
    return Candidate.of(problem, choice, frozenset())


def fallback_plan(problem: Problem, seconds: float) -> Candidate | None:
    """A plan within the limit made without a solver in about ``seconds`` (see the module docstring), or None when
    even the least-memory plan does not fit. Without a limit: coordinate descent from :func:`quickest_plan`."""
    if problem.memory_limit is None:
        return improve_layouts(problem, quickest_plan(problem), time.perf_counter() + seconds)
    least = least_memory_plan(problem)
    if least.memory > problem.memory_limit:
        return None
    best = improve_layouts(problem, least, time.perf_counter() + seconds)
    fixed = repair(problem, best.choice, best.recompute)
    return fixed if fixed is not None and fixed.time <= best.time else best
