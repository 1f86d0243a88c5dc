"""The search under a memory limit: Lagrangian relaxation of the memory row, walked along its breakpoints.

With ``T(x)`` the estimated step time and ``M(x)`` the priced bytes of a plan (:mod:`.objective`), the memory row
``M(x) ≤ limit`` is moved into the objective: ``L(λ) = min_x T(x) + λ·(M(x) − limit)``. For every ``λ ≥ 0``,
``L(λ)`` is a lower bound of the least ``T`` within the limit, and the program without the memory row keeps its
tight structure, so it solves like the unconstrained one, from the previous HiGHS basis (:class:`.solver.WarmLP`;
:meth:`_Walk.relaxed`). The walk (:func:`search`):

0. The memory is a sum over decisions (plus transient bytes), so the least any plan needs is known before any
   solve (:func:`.repair.least_memory_plan`): a limit below it is :class:`~autoshard.errors.PlanError` at once,
   naming the least memory and the options that would lower it (:func:`_no_plan_fits`) — the only error.
1. ``λ = 0`` (:meth:`_Walk.point`): the least-time plan; if it fits, it is optimal.
2. Bracket the limit (:meth:`_Walk.bracket`): λ in units of that plan's seconds per byte, raised ×10 until some plan
   fits, with a second probe at λ/2 on a second HiGHS copy (HiGHS releases the GIL: two λ solve at once); failing
   that, the least-memory plan.
3. Walk (:meth:`_Walk.descend`): λ is the slope between the plans nearest the limit on either side (``lo`` over it,
   ``hi`` within it), plus the midpoint of the multipliers they were found at; stop when no plan lies below the
   segment (λ is the best multiplier) or within ``accept_gap`` of the best bound. Every plan met is repaired to fit
   (:func:`.repair.repair`) and the best kept.
4. Recomputation units are chosen per λ by coordinate descent (:func:`best_units`: a unit is recomputed when λ
   times the bytes it frees exceeds its extra forward time); the bound holds for the units the walk chose at each
   λ; :func:`lp_bound` is one over every recomputation choice (each unit's share an LP variable).
5. Only when a gap above ``accept_gap`` is left does HiGHS solve the exact ILP with the memory row (for the best
   plan's units, :func:`_exact`), for ``exact_limit`` seconds. A gap still left is reported (``info``).

Time never ends the search without a plan: every solve gets what is left of ``time_limit``, and a solve that runs
out stops the walk where it is (``info["timed_out"]``). The best plan met that fits is returned; before the walk
met one, :func:`.repair.fallback_plan` makes one without a solver (:func:`_out_of_time`). The gap is then measured to
the best bound known (:meth:`_Walk.final_bound`: the walk's, ``L(λ)`` of every plan the bracket met, and at worst
the least seconds of every decision).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from autoshard.passes.plan_search.ilp import (Program, build_program, integral, least_peak_program, solve_program,
                                              with_costs, with_memory_row)
from autoshard.passes.plan_search.objective import (Candidate, evaluate, format_bytes, memory_points, option_vectors,
                                                    ties, transient_bytes)
from autoshard.passes.plan_search.problem import Problem
from autoshard.passes.plan_search.repair import fallback_plan, least_memory_plan, repair
from autoshard.passes.plan_search.solver import WarmLP

from autoshard.errors import PlanError

logger = logging.getLogger(__name__)

#: relative gap below which a plan counts as optimal (the solver's own tolerances are ~1e-9 of the objective)
GAP_TOLERANCE = 1e-6
#: seconds for the whole search when the pass gives none
DEFAULT_TIME_LIMIT = 120.0


def search(problem: Problem, time_limit: float | None = None, info: dict | None = None, exact_limit: float = np.inf,
           accept_gap: float = 0.0) -> tuple[list[int], frozenset | dict]:
    """(option per decision, recomputed units): the least estimated step time with ``evaluate``'s memory within
    ``problem.memory_limit`` (see the module docstring). ``info`` receives optimal, gap, bound, multiplier and
    method."""
    info = info if info is not None else {}
    total = DEFAULT_TIME_LIMIT if time_limit is None else time_limit
    if problem.memory_limit is None:
        return _unconstrained(problem, total, info)
    least = least_memory_plan(problem)  # its bytes without the transient ones bound every plan's from below
    if least.priced_memory > problem.memory_limit:  # (its priced bytes: a lower bound of every plan's peak)
        raise _no_plan_fits(problem, _least_peak(problem, least, total))
    walk = _Walk(problem, total)
    lo = walk.point(0.0)
    if lo is None:  # time_limit ran out in the first solve
        return _out_of_time(problem, walk, info)
    one_solve = walk.elapsed()  # what one relaxed solve of this program costs
    if lo.memory <= problem.memory_limit:
        info.update(optimal=True, gap=0.0, bound=lo.time, method="unconstrained optimum within the limit")
        return list(lo.choice), lo.recompute
    # the row the walk prices: the liveness point where the least-time plan peaks (any one point's row gives a
    # valid bound: a plan within the limit is within it at every point)
    point = int(np.argmax(memory_points(problem, list(lo.choice), lo.recompute)))
    if point != problem.point:
        problem.price_at(point)
        walk.reprice()
        lo = Candidate.of(problem, lo.choice, lo.recompute, lo.multiplier)
    walk.second_copy()
    lo, hi = walk.bracket(lo)
    if hi is None:  # time_limit ran out before the walk met a plan within the limit
        return _out_of_time(problem, walk, info)
    walk.descend(lo, hi, accept_gap)
    if not np.isfinite(walk.bound):  # the walk made no step on the row it prices now: one multiplier's bound
        lam = next((p.multiplier for p in (hi, lo) if p.multiplier is not None and 0 < p.multiplier < np.inf),
                   lo.time / max(lo.priced_memory, 1.0))
        p = walk.point(lam, best_units(problem, hi.choice, lam))
        if p is not None:  # (None: time ran out in this solve; final_bound takes the bounds the plans met give)
            walk.bound, walk.multiplier = p.time + lam * (p.priced_memory - problem.memory_limit), lam
            walk.repaired(p)
    best, bound = walk.best, walk.final_bound()
    gap = _gap(best.time, bound)
    stopped = f" (time_limit={walk.total:g} s reached)" if walk.timed_out else ""
    info.update(optimal=gap <= GAP_TOLERANCE, gap=gap, bound=bound, lagrangian_seconds=walk.elapsed(),
                method=f"lagrangian ({walk.solves} solves) + repair{stopped}", multiplier=walk.multiplier,
                timed_out=walk.timed_out)
    left = min(walk.left(), exact_limit)
    # The exact ILP branches on top of the LP: a budget under ~10 relaxed solves of this program closes no gap
    if accept_gap >= gap > GAP_TOLERANCE:
        info.update(method=info["method"] + f" (gap within accept_gap={accept_gap:.0%}: no exact ILP)")
    elif gap > GAP_TOLERANCE and left > max(0.5, 10 * one_solve):
        best = _exact(problem, walk, best, left, info)
    if problem.units and info.get("optimal"):
        # proven for the recomputed units the walk chose, not over every recomputation choice (lp_bound is)
        info.update(optimal=False, method=info["method"] + " (optimal for the recomputed layers chosen)")
    return list(best.choice), best.recompute


def _unconstrained(problem: Problem, total: float, info: dict) -> tuple[list[int], frozenset]:
    """The exact ILP without a memory row; when HiGHS runs out of time before any plan, the solver-free plan of
    :func:`.repair.fallback_plan`, its gap measured to the least seconds of every decision."""
    prog = build_program(problem)
    res = solve_program(problem, prog, prog.c, total)
    if res.choice is not None:
        info.update(optimal=res.optimal, gap=res.gap, message=res.message, method="ilp",
                    bound=evaluate(problem, res.choice)[0], timed_out=res.timed_out)
        return res.choice, frozenset()
    made = fallback_plan(problem, max(1.0, 0.1 * total))
    bound = sum(min(d.cost) for d in problem.decisions if d.cost)
    info.update(optimal=False, gap=_gap(made.time, bound), bound=bound, timed_out=True, message=res.message,
                method=f"time_limit={total:g} s reached before HiGHS found a plan: coordinate descent")
    return list(made.choice), frozenset()


def _out_of_time(problem: Problem, walk: _Walk, info: dict) -> tuple[list[int], frozenset | dict]:
    """The plan when time_limit ran out before the walk met one within the limit: the solver-free plan of
    :func:`.repair.fallback_plan` (a tenth of the time limit, at least a second, to improve it) or a repaired plan
    of the walk, whichever is faster; the gap to the best lower bound known is reported."""
    made = fallback_plan(problem, max(1.0, 0.1 * walk.total))
    found = [p for p in (made, walk.best) if p is not None]
    if not found:
        raise _no_plan_fits(problem, least_memory_plan(problem).memory)
    best = min(found, key=lambda p: p.time)
    bound = walk.final_bound()
    gap = _gap(best.time, bound)
    info.update(optimal=gap <= GAP_TOLERANCE, gap=gap, bound=bound, lagrangian_seconds=walk.elapsed(),
                multiplier=walk.multiplier, timed_out=True,
                method=f"time_limit={walk.total:g} s reached after {walk.solves} relaxed solves: least-memory plan + "
                       "coordinate descent + repair")
    return list(best.choice), best.recompute


def _gap(t: float, bound: float) -> float:
    return max(0.0, (t - bound) / t) if t > 0 else 0.0


class _Walk:
    """The state of the walk: the programs per recomputation set, the HiGHS copies, the time budget, the plans met
    and the best plan within the limit and lower bound so far."""

    def __init__(self, problem: Problem, total: float):
        self.problem, self.total, self.start = problem, total, time.perf_counter()
        self.limit = problem.memory_limit
        base = build_program(problem, frozenset(), memory_row=False)
        self.base, self.warm = base, [WarmLP.create(base)]  # a second copy once the walk starts (second_copy)
        self.base_options = np.array(option_vectors(problem, frozenset())[0])
        self.programs: dict = {frozenset(): base}
        self.seen: list[Candidate] = []
        self.best: Candidate | None = None
        self.bound, self.multiplier, self.solves = -np.inf, None, 0
        self.everything = frozenset(range(len(problem.units)))
        self.timed_out = False  # a solve found no plan in the time left: the walk stops where it is

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.total - self.elapsed()

    def reprice(self) -> None:
        """The programs' bytes again, after :meth:`Problem.price_at` moved the priced point."""
        mem = np.zeros(len(self.base.c))
        options = option_vectors(self.problem, frozenset())[1]
        mem[:len(options)] = options
        for col, v in self.base.extra.items():
            mem[col] = v[self.problem.point]
        self.base = with_costs(self.base, self.base.c, mem)
        self.programs = {frozenset(): self.base}

    def second_copy(self) -> None:
        self.warm.append(self.warm[0].copy(self.base))  # from the first's optimal basis

    def program_for(self, units) -> Program:
        """One program for every recomputation choice: only the option columns' seconds and bytes depend on it."""
        key = tuple(sorted(units.items())) if isinstance(units, dict) else units
        if key not in self.programs:
            c, mem = option_vectors(self.problem, units)
            cost = self.base.c.copy()  # (option columns also carry costs of graph outputs: add the difference)
            cost[:len(c)] += np.array(c) - self.base_options
            memory = self.base.mem.copy()  # (auxiliary columns: the copies kept for backward)
            memory[:len(mem)] = mem
            self.programs[key] = with_costs(self.base, cost, memory)
        return self.programs[key]

    def relaxed(self, lam: float, units, solver: int = 0) -> list[int] | None:
        """The least ``T + λ·M`` plan: from the warm LP when its optimum is integral, else from the ILP; None when
        the time left did not suffice."""
        prog = self.program_for(units)
        return self.integer_optimum(prog, prog.c + lam * prog.mem, solver)

    def least_memory(self, units, bytes_scale: float, seconds_scale: float) -> list[int] | None:
        """The least ``M`` plan, ``T`` breaking ties (each in units of a plan's bytes and seconds)."""
        prog = self.program_for(units)
        return self.integer_optimum(prog, prog.mem / bytes_scale + prog.c * 1e-6 / seconds_scale)

    def integer_optimum(self, prog: Program, cost: np.ndarray, solver: int = 0) -> list[int] | None:
        if self.left() <= 0:
            self.timed_out = True
            return None
        left = max(1.0, self.left())  # a solve begun gets at least a second
        x = self.warm[solver].solve(cost, left)
        if x is not None and integral(x[prog.integer == 1]):  # an integral LP optimum is an ILP optimum
            return prog.choice(self.problem, x)
        res = solve_program(self.problem, prog, cost, max(1.0, self.left()))
        if res.choice is None:  # the program without the memory row always has a plan: time ran out
            self.timed_out = True
        return res.choice

    def point(self, lam: float, units=frozenset(), solver: int = 0) -> Candidate | None:
        """The relaxed optimum at ``lam``, its recomputed units chosen by coordinate descent (None: out of time)."""
        for _ in range(4):
            choice = self.relaxed(lam, units, solver)
            if choice is None:
                return None
            better = best_units(self.problem, choice, lam)
            if better == units:
                break
            units = better
        self.solves += 1
        return Candidate.of(self.problem, choice, units, lam)

    def points(self, first: tuple, second: tuple | None) -> list[Candidate]:
        """``point(*first)`` and, on the second HiGHS copy at the same time, ``point(*second)`` (those found in
        the time left)."""
        if second is None or len(self.warm) < 2:
            found = [self.point(*first)]
        else:
            with ThreadPoolExecutor(max_workers=1) as pool:
                other = pool.submit(self.point, *second, 1)
                found = [self.point(*first), other.result()]
        return [p for p in found if p is not None]

    def closest(self, candidates) -> tuple[Candidate | None, Candidate | None]:
        """(lo, hi): the plan over the limit with the least memory and the plan within it with the most (the
        neighbours of the limit on the lower hull of the plans seen)."""
        over = [p for p in candidates if p.memory > self.limit]
        within = [p for p in candidates if p.memory <= self.limit]
        return (min(over, key=lambda p: p.memory) if over else None,
                max(within, key=lambda p: p.memory) if within else None)

    def bracket(self, lo: Candidate) -> tuple[Candidate, Candidate | None]:
        """λ raised until a plan fits, a probe at λ/2 bracketing the limit from below; raises when none fits.
        ``hi`` is None when time ran out first."""
        self.seen = [lo]
        hi = None
        for scale in (1.0, 10.0, 100.0, 1e3, 1e4):
            lam = scale * lo.time / lo.priced_memory
            self.seen += self.points((lam, self.everything), (lam / 2, self.everything))
            self.follow_peak()
            lo, hi = self.closest(self.seen)
            if hi is not None or self.timed_out:
                break
        else:  # the least memory any plan needs (time only breaks ties), for the message
            least = min(self.seen, key=lambda p: p.memory)
            fixed = repair(self.problem, least.choice, least.recompute)
            hi = fixed if fixed is not None else self.least_peak(lo.time)
            plan = least_memory_plan(self.problem)  # (solver-free)
            if hi.memory > self.limit >= plan.memory:
                hi = Candidate(plan.choice, plan.recompute, plan.time, plan.memory, plan.memory, np.inf)
        if hi is None:
            return lo, None
        if hi.memory > self.limit:
            raise _no_plan_fits(self.problem, hi.memory)
        self.best, self.multiplier = hi, hi.multiplier
        for p in self.seen:
            self.repaired(p)
        return lo, hi

    def follow_peak(self) -> None:
        """Price the row of the point where the least-memory plan met peaks: raising λ on one point's bytes moves
        the peak to another point (activations freed, parameters' state left), which that row then has to see."""
        problem = self.problem
        least = min(self.seen, key=lambda p: p.memory)
        point = int(np.argmax(memory_points(problem, list(least.choice), least.recompute)))
        if point != problem.point:
            problem.price_at(point)
            self.reprice()
            self.seen = [Candidate.of(problem, p.choice, p.recompute, p.multiplier) for p in self.seen]

    def least_peak(self, seconds_scale: float) -> Candidate:
        """The plan of least peak (the ILP of every liveness point's row bounding one peak variable,
        :func:`.ilp.least_peak_program`), or a plan met that needs less by :func:`.objective.evaluate`."""
        problem = self.problem
        best = min(self.seen, key=lambda p: p.memory)
        prog = least_peak_program(problem, self.everything, 2 * max(p.memory for p in self.seen), seconds_scale)
        res = solve_program(problem, prog, prog.c, max(1.0, self.left()))
        if res.choice is not None:
            least = Candidate.of(problem, res.choice, self.everything, np.inf)
            if least.memory < best.memory:
                best = least
        return best

    def final_bound(self) -> float:
        """The best lower bound: the walk's; when time stopped it, also ``L(λ)`` of every plan the bracket met,
        and without any, the least seconds of every decision (communication costs at least nothing)."""
        if not self.timed_out:
            return self.bound
        bounds = [self.bound]
        bounds += [p.time + p.multiplier * (p.priced_memory - self.limit) for p in self.seen
                   if p.multiplier is not None and np.isfinite(p.multiplier)]
        bounds.append(sum(min(d.cost) for d in self.problem.decisions if d.cost))
        return max(bounds)

    def repaired(self, p: Candidate) -> None:
        """Every plan met is repaired at once (cheap next to a solve), so that accept_gap can stop the walk early."""
        fixed = repair(self.problem, p.choice, p.recompute)
        if fixed is not None and fixed.time < self.best.time:
            self.best = fixed

    def descend(self, lo: Candidate, hi: Candidate, accept_gap: float) -> None:
        """Walk λ along the breakpoints of the dual until no plan lies below the segment lo–hi."""
        while self.elapsed() < self.total:
            lam = (hi.time - lo.time) / max(lo.priced_memory - hi.priced_memory, 1e-30)
            if not 0 < lam < np.inf or lam * lo.priced_memory > 1e6 * max(lo.time, 1e-30):
                break  # (a plan over the limit that is slower than one within it: the walk has nothing left to cut)
            # beside the cutting-plane multiplier, the midpoint of the multipliers lo and hi were found at
            mid = (lo.multiplier + hi.multiplier) / 2 if np.isfinite(hi.multiplier) else None
            second = (mid, best_units(self.problem, hi.choice, mid)) if mid and abs(mid - lam) > 0.1 * lam else None
            xs = self.points((lam, best_units(self.problem, hi.choice, lam)), second)  # hi's units at this λ
            for p in xs:
                b = min(p.time + p.multiplier * p.priced_memory, lo.time + p.multiplier * lo.priced_memory)
                b -= p.multiplier * self.limit
                if b > self.bound:
                    self.bound, self.multiplier = b, p.multiplier
                self.repaired(p)
                logger.debug("λ=%.3e t=%.6f m=%.4e bound=%.6f best=%.6f", p.multiplier, p.time, p.memory,
                             self.bound, self.best.time)
            if self.timed_out:
                self.best = min([self.best, *(p for p in xs if p.memory <= self.limit)], key=lambda p: p.time)
                break  # (a point found beside one that was not is no step of the walk)
            line = lo.time + lam * lo.priced_memory
            if xs[0].time + lam * xs[0].priced_memory >= line - GAP_TOLERANCE * abs(line):
                break  # nothing below the segment: λ is the best multiplier
            lo, hi = (q if q is not None else old for q, old in zip(self.closest([lo, hi, *xs]), (lo, hi)))
            self.best = min([self.best, *(p for p in xs if p.memory <= self.limit)], key=lambda p: p.time)
            if _gap(self.best.time, self.bound) <= accept_gap and self.best.time > 0:
                break  # close enough to the lower bound (accept_gap): no more multipliers


def _exact(problem: Problem, walk: _Walk, best: Candidate, left: float, info: dict) -> Candidate:
    """HiGHS's ILP with the memory row (less the best plan's transient bytes), for the best plan's units."""
    prog = walk.program_for(best.recompute)
    room = problem.memory_limit - problem.fixed_memory - transient_bytes(problem, list(best.choice), best.recompute)
    res = solve_program(problem, with_memory_row(prog, room), prog.c, left)
    if res.choice is None:
        info.update(method=info["method"] + f" + exact ILP (no better plan in {left:.1f} s)")
        return best
    t, m = evaluate(problem, res.choice, best.recompute)
    bound = info["bound"]
    bound = max(bound, t) if res.optimal else max(bound, t * (1 - res.gap))  # optimum for this recomputation
    if m <= problem.memory_limit and t <= best.time * (1 + 1e-12):  # on a tie, the exact one: it breaks ties
        best = Candidate(tuple(res.choice), best.recompute, t, m, best.priced_memory)
    gap = _gap(best.time, bound)
    info.update(optimal=gap <= GAP_TOLERANCE, gap=gap, bound=bound, method=info["method"] + " + exact ILP",
                message=res.message)
    return best


def _least_peak(problem: Problem, least: Candidate, seconds: float) -> float:
    """The least memory to name when a limit is refused before the walk: the least-peak ILP's plan when HiGHS proves
    it optimal (a limit that high is met; transients included), else the priced bytes of the least-memory plan (a
    lower bound of every plan's peak, but one that transients such as a loss's logits may leave far below it)."""
    every = frozenset(range(len(problem.units)))
    prog = least_peak_program(problem, every, 2 * least.memory, max(least.time, 1e-30))
    res = solve_program(problem, prog, prog.c, min(seconds, 30.0))
    if res.choice is None or not res.optimal:
        return least.priced_memory
    return max(least.priced_memory, min(least.memory, Candidate.of(problem, res.choice, every, np.inf).memory))


def _no_plan_fits(problem: Problem, least: float) -> PlanError:
    limit = problem.memory_limit
    error = PlanError(
        f"option memory_limit is {format_bytes(limit)} per rank, but the least memory any plan needs is "
        f"{format_bytes(least)} per rank ({format_bytes(problem.fixed_memory)} of it fixed by annotations and "
        f"buffers). Raise memory_limit to at least {format_bytes(least)}, or use a larger mesh"
        + ("" if problem.units else ", recompute='auto' (recompute layers in backward)")
        + ("" if any(d.stages and max(d.stages) > 0 for d in problem.decisions)
           else ", zero='auto' (store parameters sharded over the data axis)") + ".")
    error.least_memory = least  # bytes per rank, by the search's memory model
    return error


def best_units(problem: Problem, choice: list[int], lam: float) -> frozenset:
    """The units worth recomputing at ``lam`` for ``choice``: λ times the bytes freed exceeds the forward again."""
    saving: dict = {}
    extra: dict = {}
    for i, d in enumerate(problem.decisions):
        if d.unit is None:
            continue
        k = choice[i]
        saving[d.unit] = saving.get(d.unit, 0.0) + d.memory[k] - d.memory_recomputed[k]
        extra[d.unit] = extra.get(d.unit, 0.0) + d.forward[k]
    return frozenset(u for u in saving if lam * saving[u] > extra[u])


def lp_bound(problem: Problem, lam: float) -> float:
    """A lower bound of the least estimated step time of every plan within ``problem.memory_limit``, every
    recomputation choice included: ``L(λ) = min T + λ·(M − room)`` over the LP relaxation of the program with each
    unit's recomputed share a variable (``r[u] ∈ [0, 1]``; per op ``d`` of the unit and option ``k`` a share
    ``z[d, k] ≤ x[d, k]`` with ``Σ_k z[d, k] = r[u]``, costing the option's forward again and freeing
    ``memory[k] − memory_recomputed[k]`` bytes: where ``x`` is integral that is the product ``r[u]·x[d, k]``,
    linear), less the most the tie-breaking costs add. :func:`search`'s own bound fixes the recomputed units at each
    λ (coordinate descent) and so may overstate this one; solving this program takes ~3× longer per λ, so the
    search does not (``bench/search_plans.py`` prints both)."""
    prog = _shares_program(problem)
    objective = prog.c + lam * prog.mem
    x = WarmLP.create(prog).solve(objective, DEFAULT_TIME_LIMIT)
    if x is None:
        raise PlanError(f"lp_bound: HiGHS did not solve the program in {DEFAULT_TIME_LIMIT:g} s")
    most = sum(max(ties(problem, d), default=0.0) for d in problem.decisions)  # the most ties add to a plan
    return float(objective @ x) - lam * (problem.memory_limit - problem.fixed_memory) - most


def _shares_program(problem: Problem) -> Program:
    """The relaxed program plus each unit's recomputed share and the per-option shares ``z[d, k]``."""
    from scipy.sparse import coo_matrix, hstack, vstack

    base = build_program(problem, memory_row=False)
    n0 = base.a.shape[1]
    extra = _Rows(list(base.c), list(base.mem))
    share = {u: extra.new_var(0.0, 0.0) for u in range(len(problem.units))}
    for i, d in enumerate(problem.decisions):
        if d.unit is None:
            continue
        zs = []
        for k in range(len(d.options)):
            zs.append(extra.new_var(d.forward[k], d.memory_recomputed[k] - d.memory[k]))
            extra.constraint([(zs[-1], 1.0), (base.offsets[i] + k, -1.0)], -np.inf, 0.0)
        extra.constraint([(z, 1.0) for z in zs] + [(share[d.unit], -1.0)], 0.0, 0.0)
    n = len(extra.cost)
    rows = coo_matrix((extra.vals, (extra.rows, extra.cols)), shape=(len(extra.lo), n))
    a = vstack([hstack([base.a, coo_matrix((base.a.shape[0], n - n0))]), rows]).tocsr()
    return Program(np.array(extra.cost), np.array(extra.mem), a, [*base.lo, *extra.lo], [*base.hi, *extra.hi],
                   np.zeros(n, dtype=int), base.offsets)


class _Rows:
    """Columns (seconds, bytes) and rows added to a program."""

    def __init__(self, cost: list[float], mem: list[float]):
        self.cost, self.mem = cost, mem
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.lo: list[float] = []
        self.hi: list[float] = []

    def new_var(self, c: float, m: float) -> int:
        self.cost.append(c)
        self.mem.append(m)
        return len(self.cost) - 1

    def constraint(self, entries, lb: float, ub: float) -> None:
        for col, v in entries:
            self.rows.append(len(self.lo))
            self.cols.append(col)
            self.vals.append(v)
        self.lo.append(lb)
        self.hi.append(ub)
