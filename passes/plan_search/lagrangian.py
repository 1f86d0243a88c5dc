"""The search under a memory limit: Lagrangian relaxation of the memory rows, one multiplier per liveness point.

With ``T(x)`` the estimated step time and ``M_p(x)`` the bytes a plan has at liveness point ``p`` (the end of
forward, each backward layer boundary, the optimizer step: :func:`.objective.memory_points`), the rows
``M_p(x) ≤ limit`` move into the objective: ``L(λ) = min_x T(x) + Σ_p λ_p·(M_p(x) − limit)``. For every ``λ ≥ 0``,
``L(λ)`` is a lower bound of the least ``T`` within the limit, and the program without memory rows keeps its tight
structure, so it solves like the unconstrained one, from the previous HiGHS basis (:class:`.solver.WarmLP`;
:meth:`_Walk.relaxed`). The search (:func:`search`):

0. A limit the least-memory plan (:func:`.repair.least_memory_plan`: per decision the option of fewest bytes,
   every unit recomputed) does not meet is checked against :func:`least_memory_bound` before the walk: every plan
   needs at least that many bytes (per liveness point, each decision's fewest bytes there, by the same columns the
   walk prices, plus the temporaries every plan has: computed in milliseconds). A limit below it is
   :class:`~autoshard.errors.PlanError` at once (:func:`_least_memory` gives the least-peak ILP
   (:func:`.ilp.least_peak_program`) ``PROOF_SECONDS`` to name the least memory exactly), naming the least memory
   ("at least" when not proven), the least-memory plan found and the options that would lower it
   (:func:`_no_plan_fits`) — the only error. Above it the walk runs; the least-peak ILP is solved only when the walk
   meets no plan that fits (:meth:`_Walk.least_fitting`; a proven least peak above the limit is the same error).
   (It used to run before every walk under such a limit: on a Llama-3-8B-shaped HF model at 4 GiB on
   data=8 x model=8, 5.4 s of ILP, unproven when its 5 s ran out, before a walk of 3.4 s that met the plan itself.)
1. ``λ = 0`` (:meth:`_Walk.point`): the least-time plan; if it fits, it is optimal.
2. Cutting planes (:meth:`_Walk.cutting_planes`): every plan met is a cut ``θ ≤ T_i + λ·(M_i − room)`` of the dual;
   a small LP maximises their lower envelope within a box around the best multipliers so far (Kelley's method in
   a trust region), the program is solved at that λ, and so on until the envelope promises no more than 1e-4 of the
   step time. Only the points some plan exceeds get a multiplier (one on a Llama: the end of forward). Every plan
   met is repaired to fit (:func:`.repair.repair`) and the best kept; the walk stops early once that plan is within
   ``accept_gap`` of the bound.
3. Recomputation units are chosen per λ by coordinate descent (:func:`best_units`: a unit is recomputed when what λ
   prices the bytes it frees at exceeds its extra forward time); the bound holds for the units the walk chose at
   each λ; :func:`lp_bound` is one over every recomputation choice (each unit's share an LP variable).
4. When no plan met could be repaired to fit (a duality gap: the plans at the best multipliers all exceed the limit
   and the repair's moves keep every layout), the multipliers are raised until one fits, then bisected
   (:meth:`_Walk.raise_multipliers`); only if that fails is the least-peak ILP solved (:meth:`_Walk.least_fitting`).
5. The best plan is then improved by coordinate descent over layouts within the limit (:meth:`_Walk.polish`: the
   repair changes stages and recomputation only; HF Bloom at 60% of its memory 1.513 -> 1.106 ms).
6. Only when a gap above ``accept_gap`` is left does HiGHS solve the exact ILP with every point's row (for the best
   plan's units, :func:`_exact`, the best plan its first incumbent), for ``exact_limit`` seconds. A gap still left
   is reported (``info``).

Time never ends the search without a plan: every solve gets what is left of ``time_limit``, and a solve that runs
out stops the walk where it is (``info["timed_out"]``). The best plan met that fits is returned; before the walk
met one, :func:`.repair.fallback_plan` makes one without a solver (:func:`_out_of_time`). The gap is measured to the
best bound known (:meth:`_Walk.final_bound`).

A walk with one multiplier on the point where the least-time plan peaks (before) never ended on Llama-3-70B: the
plans it met peaked at another point, so its next multiplier was always the same (2437 solves to its 120 s limit).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
from autoshard.passes.plan_search.ilp import (Program, RerunCopies, build_program, integral, kept_copies,
                                              least_peak_program, solve_program, with_costs)
from autoshard.passes.plan_search.objective import (Candidate, evaluate, format_bytes, memory_points, option_columns,
                                                    option_vectors, recomputation_change, rerun_seconds, ties)
from autoshard.passes.plan_search.problem import Problem
from autoshard.passes.plan_search.repair import fallback_plan, improve_layouts, least_memory_plan, repair
from autoshard.passes.plan_search.solver import WarmLP

from autoshard.errors import PlanError

logger = logging.getLogger(__name__)

#: relative gap below which a plan counts as optimal (the solver's own tolerances are ~1e-9 of the objective)
GAP_TOLERANCE = 1e-6
#: seconds for the whole search when the pass gives none
DEFAULT_TIME_LIMIT = 120.0
#: when the walk's multipliers price no plan within the limit: doublings of them at most, then bisections
MAX_DOUBLINGS, BISECTIONS = 30, 4
#: doublings in a row that met the same relaxed plan, after which raising the multipliers stops
SAME_PLAN = 2
#: seconds (at most; never more than the search's time limit) the refusal of a limit below the least-memory bound
#: spends on the least-peak ILP, to name the least memory exactly instead of the bound and the least-memory plan
#: found: small programs are proven in it; HF Llama (2 layers, data=2 x model=2) and a Llama-3-8B shape on
#: data=8 x model=8 were not proven in 5 s either (bench/infeasible_limit.py), so 5 s only delayed the error
PROOF_SECONDS = 1.0


def search(problem: Problem, time_limit: float | None = None, info: dict | None = None, exact_limit: float = np.inf,
           accept_gap: float = 0.0) -> tuple[list[int], frozenset | dict]:
    """(option per decision, recomputed units): the least estimated step time with ``evaluate``'s memory within
    ``problem.memory_limit`` (see the module docstring). ``info`` receives optimal, gap, bound, multiplier (one
    per liveness point, seconds per byte) and method."""
    info = info if info is not None else {}
    total = DEFAULT_TIME_LIMIT if time_limit is None else time_limit
    # binding: whether the limit changed the plan, i.e. the least-time plan exceeds it (None: not known, the time
    # limit ran out before the least-time plan was found)
    info.update(binding=False)
    if problem.memory_limit is None:
        return _unconstrained(problem, total, info)
    least = least_memory_plan(problem)
    floor = 0.0
    if least.memory > problem.memory_limit:  # is the limit met at all? (step 0)
        floor = least_memory_bound(problem)
        if problem.memory_limit < floor:  # no plan is: name the least memory, exactly if the ILP proves it in time
            least_bytes, found, proven = _least_memory(problem, least, floor, min(PROOF_SECONDS, total))
            raise _no_plan_fits(problem, least_bytes, found, proven)
    walk = _Walk(problem, total, floor)
    start = walk.point(walk.zero)
    if start is None:  # time_limit ran out in the first solve
        info.update(binding=None)
        return _out_of_time(problem, walk, info)
    one_solve = walk.elapsed()  # what one relaxed solve of this program costs
    if start.plan.memory <= problem.memory_limit:
        info.update(optimal=True, gap=0.0, bound=start.plan.time, method="unconstrained optimum within the limit")
        return list(start.plan.choice), start.plan.recompute
    info.update(binding=True)  # the least-time plan exceeds the limit: the plan returned is another one
    walk.cutting_planes(start, accept_gap)
    how = ""
    if walk.best is None and not walk.timed_out:
        solves = walk.solves
        walk.raise_multipliers(start)
        how = f" + multipliers raised ({walk.solves - solves} solves)"
    if walk.best is None:
        if walk.timed_out:  # time_limit ran out before the walk met a plan within the limit
            return _out_of_time(problem, walk, info)
        walk.best = walk.least_fitting(start.plan)  # (raises when no plan fits)
        how += " + least-peak plan"
    walk.polish()
    best, bound = walk.best, walk.final_bound()
    gap = _gap(best.time, bound)
    stopped = f" (time_limit={walk.total:g} s reached)" if walk.timed_out else ""
    info.update(optimal=gap <= GAP_TOLERANCE, gap=gap, bound=bound, lagrangian_seconds=walk.elapsed(),
                method=f"lagrangian ({walk.solves} solves) + repair{how}{stopped}", multiplier=walk.multiplier,
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
    bound = problem.fixed_seconds + sum(min(d.cost) for d in problem.decisions if d.cost)
    info.update(optimal=False, gap=_gap(made.time, bound), bound=bound, timed_out=True, message=res.message,
                method=f"time_limit={total:g} s reached before HiGHS found a plan: coordinate descent")
    return list(made.choice), frozenset()


def _out_of_time(problem: Problem, walk: _Walk, info: dict) -> tuple[list[int], frozenset | dict]:
    """The plan when time_limit ran out before the walk met one within the limit: the solver-free plan of
    :func:`.repair.fallback_plan` (a tenth of the time limit, at least a second, to improve it) or a repaired plan
    of the walk, whichever is faster; when neither fits, the least-peak ILP's plan (as long again) if it fits. The
    gap to the best lower bound known is reported."""
    made = fallback_plan(problem, max(1.0, 0.1 * walk.total))
    found = [p for p in (made, walk.best) if p is not None]
    if not found:  # the plan of least peak, as the walk's own last resort (least_fitting) would, as long again
        least = walk.least_met()
        peak, _ = _least_peak_plan(problem, 2 * least.memory, least.time, max(1.0, 0.1 * walk.total))
        if peak is not None and peak.memory <= problem.memory_limit:
            fixed = repair(problem, peak.choice, peak.recompute)
            found = [fixed if fixed is not None and fixed.time < peak.time else peak]
    if not found:
        raise _no_plan_fits(problem, walk.floor or least_memory_bound(problem), walk.least_met(), proven=False,
                            searched=walk.elapsed())
    best = min(found, key=lambda p: p.time)
    bound = walk.final_bound()
    gap = _gap(best.time, bound)
    info.update(optimal=gap <= GAP_TOLERANCE, gap=gap, bound=bound, lagrangian_seconds=walk.elapsed(),
                multiplier=walk.multiplier, timed_out=True,
                method=f"time_limit={walk.total:g} s reached after {walk.solves} relaxed solves: least-memory plan + "
                       "coordinate descent + repair")
    return list(best.choice), best.recompute


def _least_temporaries(problem: Problem) -> np.ndarray:
    """Bytes per liveness point that every plan's peak adds to what the program prices (fixed plus chosen columns):
    backward's first temporaries at the end of forward are at least the largest of the gradients every option of
    some op makes, the optimizer's at the step at least its largest stored tensor every option keeps
    (:func:`.objective.memory_points`). Within the limit, a plan's priced bytes are within ``limit`` less these."""
    least = np.zeros(len(problem.fixed_points))
    timeline = problem.memory_model.timeline if problem.memory_model is not None else None
    if problem.stage_sets is None:
        least[list(timeline.forward_ends) if timeline is not None else 0] = max(
            (min(d.gradient) for d in problem.decisions if d.stored is None and d.gradient), default=0.0)
    else:  # a pipeline's stages: each its own
        owner = timeline.owner()
        for end in timeline.forward_ends:
            mine = problem.stage_sets[int(owner[end])]
            least[end] = max((min(d.gradient) for i, d in enumerate(problem.decisions)
                              if mine[i] and d.stored is None and d.gradient), default=0.0)
    least[-1] = max([float(problem.fixed_stored),
                     *(min(d.stored) for d in problem.decisions if d.stored is not None and d.stored)])
    return least


def _gap(t: float, bound: float) -> float:
    return max(0.0, (t - bound) / t) if t > 0 else 0.0


@dataclass(frozen=True)
class Cut:
    """A plan of the relaxed program met at ``multiplier`` (seconds per byte, one per liveness point): its seconds
    (ties included) and bytes per point as the program prices them (``points``: the fixed bytes plus the chosen
    columns'), what the memory model adds at each point (``transient``: ZeRO-3's gathered layers, backward's and
    the optimizer's temporaries), and the plan (:class:`.objective.Candidate`, by ``evaluate``)."""

    seconds: float
    points: np.ndarray
    transient: np.ndarray
    plan: Candidate
    multiplier: np.ndarray
    fits: bool = False  # the plan fits after repair (:meth:`_Walk.repaired`)


class _Walk:
    """The state of the search under a limit: the programs and per-point bytes per recomputation set, the HiGHS
    copy, the time budget, the best plan within the limit and the best lower bound so far."""

    def __init__(self, problem: Problem, total: float, floor: float = 0.0):
        self.problem, self.total, self.start = problem, total, time.perf_counter()
        # bytes every plan needs at least (0: not computed)
        self.floor = floor
        self.limit = problem.memory_limit
        base = build_program(problem, frozenset(), memory_row=False)
        self.base, self.warm = base, WarmLP.create(base)
        self.columns = option_columns(problem)
        self.base_options = np.array(option_vectors(problem, frozenset())[0])
        self.programs: dict = {frozenset(): base}
        self.matrices: dict = {}
        self.zero = np.zeros(len(problem.fixed_points))
        self.room = problem.memory_limit - problem.fixed_points - _least_temporaries(problem)
        self.best: Candidate | None = None
        self.least: Candidate | None = None  # the plan of least memory met (for the refusal's message)
        self.bound, self.multiplier, self.solves = -np.inf, None, 0
        self.ties = _most_ties(problem)
        self.timed_out = False  # a solve found no plan in the time left: the walk stops where it is

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.total - self.elapsed()

    @staticmethod
    def key(units):
        return tuple(sorted(units.items())) if isinstance(units, dict) else units

    def program_for(self, units) -> Program:
        """One program for every recomputation choice: only the option columns' seconds and bytes depend on it."""
        key = self.key(units)
        if key not in self.programs:
            c, mem = option_vectors(self.problem, units)
            cost = self.base.c.copy()  # (option columns also carry costs of graph outputs: add the difference)
            cost[:len(c)] += np.array(c) - self.base_options
            memory = self.base.mem.copy()  # (auxiliary columns: the copies kept for backward)
            memory[:len(mem)] = mem
            for col, v in kept_copies(self.base.extra, self.base.within, units).items():
                memory[col] = v[self.problem.point]
            copies = RerunCopies(units)
            for col, (seconds, forward, pairs) in self.base.rerun.items():  # redistributions run again
                cost[col] = seconds + forward * copies(pairs)
            self.programs[key] = with_costs(self.base, cost, memory)
        return self.programs[key]

    def memory_matrix(self, units) -> np.ndarray:
        """Bytes of every column of the program at every liveness point (columns × points): the options' at the
        recomputed shares of ``units``, the auxiliary columns' (copies kept for backward) per point."""
        key = self.key(units)
        if key not in self.matrices:
            matrix = np.zeros((len(self.base.c), len(self.zero)))
            options = self.columns.point_bytes(units)
            matrix[:len(options)] = options
            for col, v in kept_copies(self.base.extra, self.base.within, units).items():
                matrix[col] = v
            self.matrices[key] = matrix
        return self.matrices[key]

    def point(self, lam: np.ndarray, units=frozenset()) -> Cut | None:
        """The relaxed optimum at multipliers ``lam`` (per point), its recomputed units chosen by coordinate
        descent (:func:`best_units`); its lower bound ``L(λ)`` taken, its plan repaired. None: out of time."""
        for _ in range(4):
            found = self.relaxed(lam, units)
            if found is None:
                return None
            better = best_units(self.problem, found[0], lam)
            if better == units:
                break
            units = better
        choice, x, lp_value = found
        self.solves += 1
        prog, matrix = self.program_for(units), self.memory_matrix(units)
        points = self.problem.fixed_points + matrix.T @ x
        plan = Candidate.of(self.problem, choice, units)
        transient = memory_points(self.problem, choice, units) - points
        # L(λ) = min c·x + λ·(M·x − room) over the program (the LP value bounds it from below), less the ties
        bound = self.problem.fixed_seconds + lp_value - float(lam @ self.room) - self.ties
        if bound > self.bound:
            self.bound, self.multiplier = bound, lam
        if self.least is None or plan.memory < self.least.memory:
            self.least = plan
        fits = self.repaired(plan)
        return Cut(float(prog.c @ x), points, transient, plan, lam, fits)

    def relaxed(self, lam: np.ndarray, units) -> tuple[list[int], np.ndarray, float] | None:
        """(choice, its solution, the LP relaxation's value) of the least ``T + λ·M`` plan: from the warm LP when its
        optimum is integral, else from the ILP; None when the time left did not suffice."""
        prog = self.program_for(units)
        cost = prog.c + self.memory_matrix(units) @ lam
        if self.left() <= 0:
            self.timed_out = True
            return None
        x = self.warm.solve(cost, max(1.0, self.left()))  # a solve begun gets at least a second
        if x is not None and integral(x[prog.integer == 1]):  # an integral LP optimum is an ILP optimum
            return prog.choice(self.problem, x), x, float(cost @ x)
        res = solve_program(self.problem, prog, cost, max(1.0, self.left()))
        if res.choice is None:  # the program without the memory row always has a plan: time ran out
            self.timed_out = True
            return None
        value = float(cost @ x) if x is not None else (float(cost @ res.x) if res.optimal else -np.inf)
        return res.choice, res.x, value

    def cutting_planes(self, start: Cut, accept_gap: float) -> None:
        """Maximise the dual ``L(λ)`` over one multiplier per liveness point: Kelley's cutting planes (the lower
        envelope of the plans met, ``θ ≤ T_i + λ·(M_i − room)``, maximised by a small LP) in a box around the best
        multipliers so far, doubled when a step that reached its edge improved ``L``. ``room`` is the limit less
        the least transient bytes met per point (what the program does not price: ZeRO-3's gathered layers, the
        temporaries), so that the walk aims at plans whose peak fits; the bound reported is ``L(λ)`` against the
        limit itself (:meth:`point`). Stops when the envelope promises no more than ``1e-4`` of the step time, the
        best plan is within ``accept_gap`` of the bound, or time runs out."""
        from scipy.optimize import linprog

        seconds, bytes_ = max(start.seconds, 1e-30), self.limit
        unit = seconds / bytes_  # multipliers in units of the first plan's seconds per byte of the limit
        cuts, centre, box = [start], start, 1.0
        while self.left() > 0:
            room = self.limit - np.min([c.transient for c in cuts], axis=0)
            over = np.array([c.points - room for c in cuts])
            active = np.flatnonzero((over > 0).any(axis=0))
            if not len(active):
                return  # every plan met is within the room at every point: the repair did the rest
            mid = centre.multiplier[active] / unit
            lower, upper = np.maximum(0.0, mid - box), mid + box
            if len(cuts) == 1:  # one cut pushes every point to the box's edge: price the peak point alone first
                active = active[[int(np.argmax(over[0, active]))]]
                lower, upper = np.zeros(1), np.full(1, box / 2)
            res = linprog(np.r_[-1.0, np.zeros(len(active))],
                          A_ub=np.hstack([np.ones((len(cuts), 1)), -over[:, active] / bytes_]),
                          b_ub=np.array([c.seconds for c in cuts]) / seconds,
                          bounds=[(None, None), *zip(lower, upper)], method="highs")
            if res.status != 0:
                return
            envelope, mu = -res.fun, res.x[1:]
            here = (centre.seconds + centre.multiplier @ (centre.points - room)) / seconds
            if envelope - here <= 1e-4:
                return  # the best multipliers (in this box): no plan the walk could meet beats them much
            lam = self.zero.copy()
            lam[active] = mu * unit
            cut = self.point(lam, best_units(self.problem, list(centre.plan.choice), lam))
            if cut is None:
                return
            cuts.append(cut)
            value = (cut.seconds + lam @ (cut.points - room)) / seconds
            if value >= here + 0.1 * (envelope - here):  # a serious step: the box moves there
                if np.any(mu >= upper - 1e-9) or np.any((mu <= lower + 1e-9) & (lower > 0)):
                    box *= 2.0
                centre = cut
            logger.debug("cut %d: %d points, envelope %.6f, here %.6f, value %.6f, bound %.6f, best %s",
                         len(cuts), len(active), envelope, here, value,
                         self.bound / seconds, None if self.best is None else self.best.time / seconds)
            if self.best is not None and _gap(self.best.time, self.bound) <= accept_gap:
                return  # close enough to the lower bound (accept_gap): no more multipliers

    def raise_multipliers(self, start: Cut) -> None:
        """When no plan the walk met could be repaired to fit. The multipliers that maximise ``L(λ)`` need not price
        a plan within the limit (a duality gap: the plans at the dual optimum all exceed it, and the repair's moves
        keep every layout, so without layers to recompute they free little: HF Mamba). Higher multipliers price bytes
        dearer: the best multipliers are doubled until a plan met fits after repair, then the factor is bisected
        (geometrically) between the last that did not and the first that did, and the best plan's layouts improved
        by coordinate descent (:func:`.repair.improve_layouts`). One relaxed solve per step; at most
        ``MAX_DOUBLINGS`` doublings, and none more once ``SAME_PLAN`` doublings in a row met the same plan: the
        multipliers then price bytes so dearly that the relaxed plan is the one of least bytes it reaches, and more
        would meet it again (HF Llama, 2 layers, at a limit between the least-memory bound and the least plan: 29
        doublings, 122 s, before this stop)."""
        lam = self.multiplier if self.multiplier is not None and np.any(self.multiplier > 0) else None
        if lam is None:  # the bound never rose above λ = 0's: price the start's peak point at seconds per limit
            lam = self.zero.copy()
            lam[int(np.argmax(start.points + start.transient))] = start.seconds / self.limit
        below, above = 1.0, None
        last, same = None, 0
        for _ in range(MAX_DOUBLINGS):
            cut = self.point(lam * 2 * below, best_units(self.problem, list(start.plan.choice), lam * 2 * below))
            if cut is None:
                return
            if self.best is not None:
                above = 2 * below
                break
            plan = (cut.plan.choice, self.key(cut.plan.recompute))
            same = same + 1 if plan == last else 0
            if same >= SAME_PLAN:
                return
            last = plan
            below *= 2
        if above is None:
            return
        for _ in range(BISECTIONS):
            mid = float(np.sqrt(below * above))
            fits = self._fits_at(lam * mid, start)
            if fits is None:
                break
            below, above = (below, mid) if fits else (mid, above)

    def polish(self) -> None:
        """Coordinate descent over layouts from the best plan (:func:`.repair.improve_layouts`: per decision the
        option of fewest seconds that keeps the plan within the limit), for at most a tenth of the time limit."""
        deadline = time.perf_counter() + max(0.0, min(self.left(), 0.1 * self.total))
        better = improve_layouts(self.problem, self.best, deadline)
        if better.time < self.best.time:
            self.best = better

    def _fits_at(self, lam: np.ndarray, start: Cut) -> bool | None:
        """Whether the plan of multipliers ``lam`` fits after repair (None: out of time)."""
        cut = self.point(lam, best_units(self.problem, list(start.plan.choice), lam))
        return None if cut is None else cut.fits

    def least_fitting(self, start: Candidate) -> Candidate:
        """When no plan the walk met could be repaired to fit: the least-memory plan met, the solver-free one or the
        plan of least peak (the ILP of every liveness point's row), repaired; raises when none fits."""
        problem = self.problem
        found = [p for p in (least_memory_plan(problem), self.least) if p is not None]
        if min(p.memory for p in found) > self.limit:
            peak, proven = _least_peak_plan(problem, 2 * max(start.memory, found[0].memory), start.time,
                                            max(1.0, self.left()))
            if peak is not None and proven and peak.memory > self.limit:  # the least memory, proven
                raise _no_plan_fits(problem, peak.memory, peak, proven=True)
            found += [peak] if peak is not None else []
        least = min(found, key=lambda p: p.memory)
        if least.memory > self.limit:
            raise _no_plan_fits(problem, self.floor or least_memory_bound(problem), least, proven=False,
                                searched=self.elapsed())
        fixed = repair(problem, least.choice, least.recompute)
        return fixed if fixed is not None and fixed.time < least.time else least

    def least_met(self) -> Candidate:
        """The plan of least memory met: the walk's, the one found before it, the least-memory plan."""
        found = [p for p in (least_memory_plan(self.problem), self.least) if p is not None]
        return min(found, key=lambda p: p.memory)

    def final_bound(self) -> float:
        """The best lower bound: the walk's, and at worst the least seconds of every decision (communication costs
        at least nothing)."""
        return max(self.bound, self.problem.fixed_seconds + sum(min(d.cost) for d in self.problem.decisions if d.cost))

    def repaired(self, p: Candidate) -> bool:
        """Every plan met is repaired at once (cheap next to a solve), so that accept_gap can stop the walk early;
        whether it could be made to fit."""
        fixed = repair(self.problem, p.choice, p.recompute)
        if fixed is not None and (self.best is None or fixed.time < self.best.time):
            self.best = fixed
        return fixed is not None


def _exact(problem: Problem, walk: _Walk, best: Candidate, left: float, info: dict) -> Candidate:
    """HiGHS's ILP with every liveness point's memory row (:func:`.ilp.build_program`), for the best plan's units."""
    prog = build_program(problem, best.recompute)
    started = time.perf_counter()
    res = solve_program(problem, prog, prog.c, left, start=list(best.choice))
    if res.choice is None:
        # out of time, or none within the program's rows: they price a recomputed layer per op output, which may
        # count more than the plans' exact evaluation (Llama-3-70B's repaired plan fits, its ILP is infeasible)
        why = "time limit" if res.timed_out else f"HiGHS: {res.message}"
        info.update(method=info["method"] + f" + exact ILP (no plan: {why} after "
                                            f"{time.perf_counter() - started:.1f} s of {left:.1f} s)")
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


def least_memory_bound(problem: Problem) -> float:
    """Bytes per rank every plan needs at least, from the columns the walk prices (:func:`.objective.option_columns`)
    and the temporaries every plan adds (:func:`_least_temporaries`): per liveness point, the fixed bytes plus each
    decision's fewest bytes at that point over its options, recomputed or not (parameters at their most sharded
    layout and stage, activations at their smallest layout), the largest over points. Each decision is chosen
    apart per point, and redistributed copies, ZeRO-3's gathered layers and a recomputed layer's activations count
    nothing, so no plan is below it (the walk's ``room`` rests on the same inequality); the copies a layout forces
    (a loss's logits gathered, a weight's copy kept for backward) can leave it far below the least peak (HF Llama,
    2 layers, data=2 x model=2: 363 KiB against 422 KiB; bench/infeasible_limit.py)."""
    cols = option_columns(problem)
    points = np.minimum(cols.points, cols.points + cols.recomputed)  # (recomputed: unit columns; else 0 added)
    fewest = np.minimum.reduceat(points, cols.offsets, axis=0) if len(points) else np.zeros((0, 0))
    per_point = problem.fixed_points + fewest.sum(axis=0) + _least_temporaries(problem)
    return float(per_point.max())


def _least_memory(problem: Problem, least: Candidate, floor: float, seconds: float) -> tuple[float, Candidate, bool]:
    """(bytes every plan needs at least, the plan of least memory found, whether that plan is proven the least):
    ``floor`` (:func:`least_memory_bound`), then the least-peak ILP for at most ``seconds`` (its program's build
    included). Proven, the least memory is that plan's (a limit that high is met; transients included)."""
    started = time.perf_counter()
    peak, proven = _least_peak_plan(problem, 2 * least.memory, least.time, seconds, started=started)
    found = peak if peak is not None and peak.memory < least.memory else least
    if proven:
        return found.memory, found, True
    return min(floor, found.memory), found, False


def _least_peak_plan(problem: Problem, scale: float, seconds_scale: float, seconds: float,
                     started: float | None = None) -> tuple[Candidate | None, bool]:
    """(the plan of least peak, every unit recomputed, or None when HiGHS found none; whether HiGHS proved it):
    the ILP of every liveness point's row bounding one peak variable (:func:`.ilp.least_peak_program`), solved
    within ``seconds`` of ``started`` (``time.perf_counter()``; default: now)."""
    started = time.perf_counter() if started is None else started
    every = frozenset(range(len(problem.units)))
    prog = least_peak_program(problem, every, scale, max(seconds_scale, 1e-30))
    res = solve_program(problem, prog, prog.c, max(0.01, seconds - (time.perf_counter() - started)))
    if res.choice is None:
        return None, False
    return Candidate.of(problem, res.choice, every, np.inf), bool(res.optimal)


def _most_ties(problem: Problem) -> float:
    """The most the tie-breaking seconds (:func:`.objective.ties`) add to a plan: bounds subtract it."""
    return sum(max(ties(problem, d), default=0.0) for d in problem.decisions)


def _no_plan_fits(problem: Problem, least: float, found: Candidate | None = None, proven: bool = True,
                  searched: float | None = None) -> PlanError:
    """The refusal of a limit: ``least`` bytes every plan needs (exactly, with ``proven``; else at least), the plan
    of least memory ``found``, and ``searched`` seconds when the walk looked for a plan first."""
    limit = problem.memory_limit
    floor, met = format_bytes(least), None if found is None else format_bytes(found.memory)
    fixed = f"{format_bytes(problem.fixed_memory)} of it fixed by annotations and buffers"
    if proven:
        head = f"the least memory any plan needs is {floor} per rank ({fixed})"
        fix = f"Raise memory_limit to at least {floor}"
    else:
        bound = f"the least memory any plan needs is at least {floor} per rank (a lower bound; {fixed})"
        head = bound if met is None else f"{bound}, and the least-memory plan found needs {met}"
        if searched is not None:
            head = f"no plan within it was found in {searched:.1f} s of search: {head}"
            fix = f"Raise memory_limit to {met or floor}, give the search more time (search_time_limit)"
        else:
            fix = f"Raise memory_limit to at least {floor}" + (f" ({met} is met)" if met is not None else "")
    error = PlanError(
        f"option memory_limit is {format_bytes(limit)} per rank, but {head}. {fix}, or use a larger mesh"
        + ("" if problem.units else ", recompute='auto' (recompute layers in backward)")
        + ("" if any(d.stages and max(d.stages) > 0 for d in problem.decisions)
           else ", zero='auto' (store parameters sharded over the data axis)") + ".")
    error.least_memory = least  # bytes per rank every plan needs (at least, unless proven), by the memory model
    error.least_memory_found = None if found is None else found.memory  # the least-memory plan found: it is met
    error.least_memory_proven = proven
    return error


def best_units(problem: Problem, choice: list[int], lam) -> frozenset:
    """The units worth recomputing at ``lam`` (seconds per byte: one per liveness point, or one for the point the
    problem prices) for ``choice``: what λ prices the bytes freed at exceeds the forward run again (its ops' and the
    redistributions' between them)."""
    cols = option_columns(problem)
    at = cols.at(choice)
    at = at[cols.unit[at] >= 0]
    if not len(at):
        return frozenset()
    units = cols.unit[at]
    extra = np.bincount(units, weights=cols.forward[at]).tolist()
    for u, seconds in rerun_seconds(problem, choice)[1].items():  # the redistributions inside its copies again
        if u < len(extra):
            extra[u] += seconds
    change = recomputation_change(problem, choice)
    saving = {}
    for u in np.unique(units).tolist():
        freed = -np.asarray(change.get(u, np.zeros(len(problem.fixed_points))))
        saving[u] = float(freed @ lam) if np.ndim(lam) else float(freed[problem.point] * lam)
    return frozenset(u for u in saving if saving[u] > extra[u])


def lp_bound(problem: Problem, lam) -> float:
    """A lower bound of the least estimated step time of every plan within ``problem.memory_limit``, every
    recomputation choice included: ``L(λ) = min T + Σ_p λ_p·(M_p − limit)`` (``lam``: seconds per byte, one per
    liveness point, or one for the point the problem prices) over the LP relaxation of the program with each
    unit's recomputed share a variable (``r[u] ∈ [0, 1]``; per op ``d`` of the unit and option ``k`` a share
    ``z[d, k] ≤ x[d, k]`` with ``Σ_k z[d, k] = r[u]``, costing the option's forward again and changing its bytes
    by ``points_recomputed[k] − points[k]``: where ``x`` is integral that is the product ``r[u]·x[d, k]``,
    linear; the redistributions a recomputed unit runs again are left out, which keeps it a bound), less the most
    the tie-breaking costs add. :func:`search`'s own bound fixes the recomputed units at each
    λ (coordinate descent) and so may overstate this one; solving this program takes ~3× longer per λ, so the
    search does not (``bench/search_plans.py`` prints both)."""
    if not np.ndim(lam):
        lam, scalar = np.zeros(len(problem.fixed_points)), lam
        lam[problem.point] = scalar
    prog = _shares_program(problem, np.asarray(lam, dtype=float))
    x = WarmLP.create(prog).solve(prog.c, DEFAULT_TIME_LIMIT)
    if x is None:
        raise PlanError(f"lp_bound: HiGHS did not solve the program in {DEFAULT_TIME_LIMIT:g} s")
    return (problem.fixed_seconds + float(prog.c @ x) - float(lam @ (problem.memory_limit - problem.fixed_points))
            - _most_ties(problem))


def _shares_program(problem: Problem, lam: np.ndarray) -> Program:
    """The relaxed program, its columns priced ``T + λ·M``, plus each unit's recomputed share and the per-option
    shares ``z[d, k]``."""
    from scipy.sparse import coo_matrix, hstack, vstack

    base = build_program(problem, memory_row=False)
    n0 = base.a.shape[1]
    priced = base.c.copy()
    options = option_columns(problem).point_bytes(frozenset())
    priced[:len(options)] += options @ lam
    for col, v in base.extra.items():
        if col not in base.within:  # (a copy kept only within a layer copy: at most its bytes, at least none)
            priced[col] += v @ lam
    extra = _Rows(list(priced), [0.0] * n0)
    share = {u: extra.new_var(0.0, 0.0) for u in range(len(problem.units))}
    for i, d in enumerate(problem.decisions):
        if d.unit is None:
            continue
        zs = []
        for k in range(len(d.options)):
            freed = np.asarray(d.points_recomputed[k]) - np.asarray(d.points[k])
            zs.append(extra.new_var(d.forward[k] + float(freed @ lam), 0.0))
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
