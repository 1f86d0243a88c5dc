"""The plan search: choose every op's strategy to minimise estimated step time under a memory limit.

The pass (:class:`PlanSearch`) builds a problem, searches it and writes the choices into node metadata:

* **The problem** (:mod:`.problem`, :func:`build_problem`): a decision per op (its strategies) and per free parameter
  (its layouts, each at the ZeRO stages it may be stored at), with seconds and per-rank bytes per option, and a value
  term per group of equivalent values (which option produces which spec, which consumer needs which spec or a
  gradient sync, and what each redistribution costs). Repeated layers share their variables (:mod:`.layers`,
  :func:`find_layers`), so the program's size does not grow with depth; ``recompute="auto"`` makes every copy of a
  repeated layer a recomputation candidate (:class:`Unit`). Under mixed precision it prices the program the
  casting passes make of a plan (:mod:`.precision`, :class:`ComputeCopies`), as ``plan.cost()`` does.
* **The ILP** (:mod:`.ilp`, :func:`solve`): ``x[d, k] ∈ {0, 1}``, one option per decision; redistributions bought
  once per (value, needed spec) and shared by every consumer; gradient syncs; objective ``Σ compute + Σ
  redistribution + Σ sync`` seconds; memory row ``Σ bytes ≤ limit``. Without a limit (or when the least-time plan
  fits) that program is solved exactly by HiGHS (its LP relaxation is usually integral).
* **The Lagrangian relaxation** (:mod:`.lagrangian`, :func:`search`): under a binding limit the memory rows (one
  per liveness point) move into the objective, ``L(λ) = min T + Σ_p λ_p·(M_p − limit)``, each λ solved from the
  previous HiGHS basis (:mod:`.solver`, :class:`WarmLP`), λ chosen by cutting planes on the dual; every ``L(λ)``
  is a lower bound.
* **The repair** (:mod:`.repair`, :func:`repair`): each plan the walk meets is made to fit by moves that keep every
  layout (a parameter's ZeRO stage, one more or one fewer recomputed copy); the best plan that fits is kept, and
  its gap to the best bound is reported. The exact ILP with the memory row runs only when a gap above
  ``accept_gap`` is left.
* **The objective of one plan** (:mod:`.objective`, :func:`evaluate`): the seconds and bytes the search minimises
  and bounds, computed independently of the program (tests and explanations use it).

A plan not proven optimal is reported (report ``optimal``, ``gap``) and warned about, never silently used. Time never
ends the search without a plan (:func:`search`: the best plan met, or a solver-free one, with its gap and
``timed_out``); the one error is a memory limit below the least memory any plan needs: below a lower bound
computed without a solve (:func:`least_memory_bound`) it is refused before the walk (naming the least peak exactly
when the least-peak ILP proves it within ``PROOF_SECONDS``); a limit above the bound is refused only when the walk
finds no plan within it and the least-peak ILP none either.
The graph arrives functional, its inputs and annotated parameters seeded and its gradients marked
(``passes/prepare.py``, earlier in the pass list).
Annotated parameters are hard constraints, as in propagation (:func:`autoshard.passes.propagate.pinned_values`).
The pass hands its choices to propagation through node metadata only: ``autoshard.meta.PLANNED`` (with
``PLANNED_BY = "plan_search"``) and ``autoshard.meta.DECISION`` on ops, the spec on free parameters,
``PLANNED_ZERO`` (``zero="auto"``) and ``RECOMPUTE`` (``recompute="auto"``). A strategy some earlier step already put
in ``PLANNED`` is the op's only option.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.fx
from autoshard.compiler.pipeline.options import microbatches_in_flight
from autoshard.cost_models.memory import StagedTimeline, layer_cuts
from autoshard.cost_models.profile import HardwareProfile, load_profile
from autoshard.passes.plan_search.ilp import Program, build_program, solve
from autoshard.passes.plan_search.lagrangian import (DEFAULT_TIME_LIMIT, GAP_TOLERANCE, PROOF_SECONDS, best_units,
                                                    least_memory_bound, lp_bound, search)
from autoshard.passes.plan_search.layers import Unit, find_layers, layer_copies, leaves_unit
from autoshard.passes.plan_search.objective import (INFEASIBLE, TIE_BREAK, Candidate, binding, evaluate, explain,
                                                    option_cost, option_memory, term_cost, transient_bytes)
from autoshard.passes.plan_search.problem import (DecisionVar, Problem, ValueTerm, build_problem, canonical,
                                                  output_spec_for)
from autoshard.passes.plan_search.repair import (fallback_plan, improve_layouts, least_memory_plan, quickest_plan,
                                                 repair)
from autoshard.passes.plan_search.solver import WarmLP

from autoshard import meta as M
from autoshard.compiler.context import Context
from autoshard.errors import PlanError
from autoshard.frontend.graph_utils import is_getitem, is_tensor_node
from autoshard.progress import slow_step

__all__ = ["DEFAULT_TIME_LIMIT", "GAP_TOLERANCE", "INFEASIBLE", "PROOF_SECONDS", "TIE_BREAK", "Candidate",
           "DecisionVar", "PlanSearch", "Problem", "Program", "Unit", "ValueTerm", "WarmLP", "best_units",
           "build_problem", "build_program", "evaluate", "explain", "fallback_plan", "find_layers",
           "improve_layouts", "in_flight", "layer_copies", "least_memory_bound",
           "least_memory_plan", "leaves_unit", "lp_bound", "option_cost", "option_memory", "output_spec_for",
           "quickest_plan", "receive_buffers", "repair", "search", "solve", "staged_cuts", "term_cost",
           "transient_bytes"]


@dataclass(frozen=True)
class PlanSearch:
    """Choose every free strategy by the search above; propagation then applies the choices."""

    profile: object = "cpu-gloo"
    memory_limit: float | None = None
    optimizer: str = "adam"
    tie_layers: bool = True
    #: seconds for the whole search (None: DEFAULT_TIME_LIMIT, 120; compile's Options.search_time_limit, the CLI's
    #: --search-time-limit); a plan stopped by it reports its gap. A limit below the least-memory bound is refused
    #: before the walk (in at most PROOF_SECONDS of it), whatever this is.
    time_limit: float | None = None
    #: under a memory limit: seconds for the exact ILP after the Lagrangian search, when that leaves a gap
    exact_seconds: float = 2.0
    #: under a memory limit: a Lagrangian plan this close to the lower bound is taken without the exact ILP (like a
    #: MIP gap tolerance; the gap is reported and warned about all the same). 2 s of exact ILP did not close the
    #: Llama-3-8B/70B gaps (0.81%, 0.48%) in bench/search_plans.py; 0 always tries it.
    accept_gap: float = 0.01
    #: a pipelined model (:class:`autoshard.passes.manager.PipelineOptions`) whose stages are fixed before the
    #: search (:func:`staged_cuts`): its memory rows bound each stage's memory, with the microbatches in flight
    #: under the schedule (:class:`autoshard.cost_models.memory.StagedTimeline`), rather than the whole model's
    pipeline: object = None
    name: str = "plan_search"

    def run(self, gm: torch.fx.GraphModule, ctx: Context) -> torch.fx.GraphModule:
        # The problem, the search and what it chose, made once for a job (Context.once): rank 0 decides, and every
        # other rank applies rank 0's Decided to its own graph (the same trace of the same model) without building
        # the problem again; the search may stop at its time limit, so the others must not search either.
        decided = ctx.decide_once(lambda: self.decide(gm, ctx))
        decided.apply(gm)
        if decided.warning is not None:
            ctx.warn(decided.warning)
        M.plan_report(gm)[self.name] = dict(decided.section)
        return gm

    def decide(self, gm: torch.fx.GraphModule, ctx: Context) -> Decided:
        """Build the problem of ``gm``, search it, and say what to write into the graph (nothing is written here)."""
        profile = self.profile if isinstance(self.profile, HardwareProfile) else load_profile(self.profile)
        t0, cpu0 = time.perf_counter(), time.process_time()
        zero, recompute = ctx.options.zero, ctx.options.recompute
        timeline = None
        cuts = staged_cuts(gm, self.pipeline) if self.memory_limit is not None else None
        if cuts is not None:
            timeline = StagedTimeline.staged(gm, cuts, *in_flight(self.pipeline))
        problem = build_problem(gm, ctx, profile, self.memory_limit, self.optimizer, self.tie_layers,
                                zero=0 if ctx.pinned is not None else zero, recompute=recompute, timeline=timeline)
        if timeline is not None:
            receive_buffers(problem, gm, timeline, self.pipeline.microbatches)
        t1 = time.perf_counter()
        with slow_step(f"autoshard: searching the best plan ({len(problem.decisions)} decisions)"):
            status: dict = {}
            choice, units = search(problem, self.time_limit, status, self.exact_seconds, self.accept_gap)
        t2 = time.perf_counter()
        total, memory = evaluate(problem, choice, units)
        stages, zero_marks = _stages(gm, problem, choice, zero == "auto")
        regions, recompute_marks = _recomputed(problem, units, recompute == "auto", timeline)
        planned, specs, why = self._choices(gm, problem, choice)
        section = {
            "step_time": total, "memory_per_rank": memory, "memory_limit": self.memory_limit,
            "profile": profile.name, "decisions": len(problem.decisions), "terms": len(problem.terms),
            "tied_nodes": len(problem.canon), "build_seconds": t1 - t0, "solve_seconds": t2 - t1,
            "cpu_seconds": time.process_time() - cpu0,  # this process's CPU time: what a busy machine does not inflate
            # whether the memory limit changed the plan (the least-time plan exceeds it; None: not known)
            "memory_limit_binding": status.get("binding") if self.memory_limit is not None else False,
            "binding": binding(problem, status.get("binding")),
            "optimal": status["optimal"], "gap": status["gap"],  # gap: to the best lower bound the search knows
            "timed_out": bool(status.get("timed_out")),  # time_limit stopped the search before it finished
            "method": status.get("method"), "lower_bound": status.get("bound"),
            # λ (seconds per byte, one per liveness point) of the lower bound
            "multiplier": None if status.get("multiplier") is None else [float(v) for v in status["multiplier"]],
            "zero_stages": {st: sum(1 for v in stages.values() if v == st) for st in sorted(set(stages.values()))},
            "recomputed": regions,
            # a pipeline's stages fixed before the search (module paths starting stages 1..): each stage's memory
            # bounded (None: the whole model's)
            "stage_cuts": list(cuts) if cuts is not None else None,
            "stage_memory": _stage_peaks(problem, choice, units) if cuts is not None else None,
        }
        warning = None if status["optimal"] else self._gap_warning(problem, status)
        return Decided(planned, specs, why, zero_marks, recompute_marks, section, warning)

    def _gap_warning(self, problem: Problem, status: dict) -> str:
        if status.get("timed_out"):
            within = " within memory_limit" if problem.memory_limit is not None else ""
            return (f"plan_search: its time limit ({self.time_limit or DEFAULT_TIME_LIMIT:g} s) ran out before the "
                    f"search finished: the plan is the best found{within}, its estimated step time at most "
                    f"{status['gap']:.2%} above the best lower bound known ({status['method']}); it is used as it "
                    "is.")
        return (f"plan_search: the plan is not proven optimal under memory_limit (its estimated step time is at most "
                f"{status['gap']:.2%} above a lower bound; plan.report['search'] has the details); it is used as "
                "it is.")

    def _choices(self, gm: torch.fx.GraphModule, problem: Problem, choice: list[int]) -> tuple[dict, dict, dict]:
        """({op: strategy} for ops not planned before the search, {free parameter: spec}, {op: its Decision})."""
        why = explain(problem, choice)
        planned, specs, decisions = {}, {}, {}
        for n in gm.graph.nodes:
            d = problem.index.get(canonical(problem.canon, n))
            if d is None or n.op not in ("call_function", "get_attr") or is_getitem(n):
                continue
            option = problem.decisions[d].options[choice[d]]
            if n.op == "get_attr":
                specs[n.name] = option
                continue
            if n.meta.get(M.PLANNED) is None:  # planned before the search: propagation still checks it
                planned[n.name] = option
            decisions[n.name] = why[d]
        return planned, specs, decisions


@dataclass(frozen=True)
class Decided:
    """What the search decided for one graph, by node name: all :meth:`PlanSearch.run` writes into the graph and
    the report. It pickles, so that rank 0's is every rank's (:meth:`Context.decide_once`); node names are the
    trace's, the same on every rank tracing the same model (the plan digests every rank compares check it)."""

    planned: dict  # op -> Strategy: ``PLANNED`` (``PLANNED_BY`` the search)
    specs: dict  # free parameter (get_attr) -> spec: ``SPEC``
    why: dict  # op -> Decision: ``DECISION``
    zero: dict  # parameter -> ZeRO stage: ``PLANNED_ZERO`` (zero="auto" only)
    recompute: dict  # op -> module path of its recomputed layer copy: ``RECOMPUTE`` (recompute="auto" only)
    section: dict  # the plan report's section of the search
    warning: str | None  # the plan is not proven optimal: said on every rank (rank 0 prints it)

    def apply(self, gm: torch.fx.GraphModule, name: str = "plan_search") -> None:
        nodes = {n.name: n for n in gm.graph.nodes}
        every = set(self.planned) | set(self.specs) | set(self.why) | set(self.zero) | set(self.recompute)
        missing = sorted(every - set(nodes))
        if missing:
            raise PlanError(f"the plan search's decisions name nodes this graph does not have ({', '.join(missing[:5])}"
                            f"{', ...' if len(missing) > 5 else ''}): this rank traced another program than the rank "
                            "that searched. Compile the same model with the same options and example shapes on "
                            "every rank.")
        for key, spec in self.specs.items():
            nodes[key].meta[M.SPEC] = spec
        for key, strategy in self.planned.items():
            nodes[key].meta[M.PLANNED] = strategy
            nodes[key].meta[M.PLANNED_BY] = name
        for key, decision in self.why.items():
            nodes[key].meta[M.DECISION] = decision
        for key, stage in self.zero.items():
            nodes[key].meta[M.PLANNED_ZERO] = stage
        for key, path in self.recompute.items():
            nodes[key].meta[M.RECOMPUTE] = path


def staged_cuts(gm: torch.fx.GraphModule, pipeline) -> tuple[str, ...] | None:
    """Where a pipelined model's stages start (module paths of stages 1..), fixed before the search so that its
    memory rows are the stages': the user's cut points, or the repeated layers dealt out evenly
    (:func:`autoshard.cost_models.memory.layer_cuts`); None (the whole model's memory): no pipeline, interleaved
    stages (a rank holds several), or fewer layers than stages. :class:`autoshard.passes.pipeline_split.PipelineSplit`
    cuts at the same places."""
    if pipeline is None or getattr(pipeline, "stages_per_rank", 1) != 1 or pipeline.stages < 2:
        return None
    if pipeline.split != "auto":
        return tuple([pipeline.split] if isinstance(pipeline.split, str) else pipeline.split)
    return layer_cuts(gm, pipeline.stages)


def in_flight(pipeline) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per stage, the microbatches in flight at its first backward and at its later ones
    (:func:`autoshard.compiler.pipeline.options.microbatches_in_flight`, as ``PipelinePlan.stage_breakdown``)."""
    counts = [microbatches_in_flight(pipeline.schedule, pipeline.microbatches, pipeline.stages, s)
              for s in range(pipeline.stages)]
    return tuple(c[0] for c in counts), tuple(c[1] for c in counts)


def receive_buffers(problem: Problem, gm: torch.fx.GraphModule, timeline: StagedTimeline, microbatches: int) -> None:
    """Add to ``problem`` what a value crossing a stage boundary costs the stages, as
    :meth:`autoshard.compiler.pipeline.PipelinePlan.stage_breakdown` counts it: the receive buffers
    ``torch.distributed.pipelining`` keeps, one per microbatch (at a stage's points, the activations crossing its
    first cut, received, and the floating ones crossing the next, their gradients received), and the sending stage's
    own copy, an output of its graph kept for every microbatch in flight until that microbatch's backward (at its
    points, as an activation of the value's segment; a stage that passes it on, as one of its first segment's). A
    crossing value (:meth:`GraphMemory.is_value`, made before a cut and read after it) adds its bytes in each
    option's output layout to its decision's points."""
    memory = problem.memory_model
    stage = {n: timeline.stage_of[timeline.segment(n)] for n in gm.graph.nodes if n in timeline.index}
    first = {}  # stage -> its first segment
    for g, s in enumerate(timeline.stage_of):
        first.setdefault(s, g)
    for n in gm.graph.nodes:
        if not memory.is_value(n) or n not in stage:
            continue
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor) or not val.is_floating_point():
            continue
        last = max((stage.get(u, stage[n]) for u in n.users), default=stage[n])
        if last == stage[n]:
            continue
        i = problem.index.get(canonical(problem.canon, n))
        if i is None or problem.decisions[i].stored is not None:
            continue
        d = problem.decisions[i]
        # the stages between pass it on: each receives it and sends it again
        where = sum(timeline.mask(s) for s in range(stage[n], last + 1)) + sum(
            timeline.mask(s) for s in range(stage[n] + 1, last))
        # and each stage that sends it keeps it, an output of its graph, for every microbatch in flight until that
        # microbatch's backward reaches the stage (stage_breakdown's keeps_outputs)
        kept = timeline.activation_alive(timeline.segment(n)) + sum(
            timeline.activation_alive(first[s]) for s in range(stage[n] + 1, last))
        received = problem.receive.setdefault(i, [0.0] * len(d.options))
        for k, option in enumerate(d.options):
            extra = float(sum(memory.own_bytes(n, option.output_spec)[0])) * (microbatches * where + kept)
            received[k] = received[k] + extra
            d.points[k] = d.points[k] + extra
            if d.points_recomputed is not None:
                d.points_recomputed[k] = d.points_recomputed[k] + extra
    problem.columns = None
    problem.price_at(0)


def _stage_peaks(problem: Problem, choice: list[int], units) -> list[int]:
    """Per stage, the largest of its liveness points (:func:`memory_points` of the plan chosen)."""
    from autoshard.passes.plan_search.objective import memory_points

    points = memory_points(problem, choice, units)
    owner = problem.memory_model.timeline.owner()
    return [int(points[owner == s].max(initial=0.0)) for s in range(int(owner.max()) + 1)]


def _stages(gm: torch.fx.GraphModule, problem: Problem, choice: list[int], planned: bool) -> tuple[dict, dict]:
    """({parameter target: ZeRO stage chosen}, {node: stage} to mark ``PLANNED_ZERO`` with: with ``planned``
    (``zero="auto"``) every copy, else none)."""
    stages: dict[str, int] = {}
    marks: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op != "get_attr" or not n.meta.get(M.REQUIRES_GRAD) or not is_tensor_node(n):
            continue
        d = problem.index.get(canonical(problem.canon, n))
        dv = problem.decisions[d] if d is not None else None
        stage = dv.stages[choice[d]] if dv is not None and dv.stages else 0
        if planned:
            marks[n.name] = stage
        stages[str(n.target)] = stage
    return stages, marks


def _recomputed(problem: Problem, units, planned: bool, timeline: StagedTimeline | None = None
                ) -> tuple[list[str], dict]:
    """(the module paths of the recomputed layer copies, {op: its copy's path} to mark ``RECOMPUTE`` with: with
    ``planned`` (``recompute="auto"``) the ops of those copies, else none). A unit recomputed in part (``share``)
    recomputes its first copies; a pipeline's stages fixed before the search (``timeline``): its first copies in
    each stage, that share of them rounded up, as the search's memory rows count it (a share of every copy's
    bytes)."""
    regions = []
    shares = units if isinstance(units, dict) else {u: 1.0 for u in units}
    for u, share in sorted(shares.items()):
        copies = problem.units[u].copies
        groups: dict[int, list[str]] = {}
        for path, nodes in copies.items():
            stage = timeline.stage_of[timeline.segment(nodes[0])] if timeline is not None and nodes else 0
            groups.setdefault(stage, []).append(path)
        for paths in groups.values():
            # stages: at least the share in each (the rows priced a share of each stage's copies), so no stage
            # keeps more than its row counted
            many = math.ceil(share * len(paths) - 1e-9) if timeline is not None else round(share * len(paths))
            regions.extend(paths[:many])
    marks: dict[str, str] = {}
    if planned:
        for u in problem.units:
            for path, nodes in u.copies.items():
                if path in regions:
                    for n in nodes:
                        marks[n.name] = path
    return regions, marks
