"""The plan search's objective for one assignment: estimated step time and per-rank memory.

For a choice (one option index per decision) and a recomputation set (units recomputed whole, or
``{unit: share of its copies}``):

* seconds ``T = Σ_d option_cost(d)[k_d] + Σ_terms term_cost`` (:func:`evaluate`): each option's compute (plus its
  forward again where recomputed, :func:`option_cost`), each redistribution bought once per (value, needed spec)
  and each gradient sync (:func:`term_cost`) — the same objective the program of :mod:`.ilp` minimises, less the
  tie-breaking seconds (:func:`ties`);
* bytes ``M = fixed + Σ_d option_memory(d)[k_d] + transient_bytes`` (:func:`option_memory`,
  :func:`transient_bytes`): the sum counts every saved activation and every parameter's state as alive at once;
  the transient bytes add the two largest ZeRO-3 gathered layers and the largest recomputed copy's activations.

:func:`explain` turns a choice into the :class:`autoshard.meta.Decision` stored on every op (its cost share and the
best rejected option).
"""

from __future__ import annotations

from dataclasses import dataclass

from autoshard.passes.plan_search.problem import DecisionVar, Problem, ValueTerm, output_spec_for

from autoshard import meta as M
from autoshard.placements import Shard

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
    o = term.fixed if term.fixed is not None else next(ix.out[(d, choice[d])] for d in ix.producers
                                                       if (d, choice[d]) in ix.out)
    wanted: dict = {}  # the specs consumers need (interned: one object per spec, so keyed by id)
    keys: dict = {}
    for d in ix.consumers:
        for i in ix.need.get((d, choice[d]), ()):
            wanted[id(i)] = i
        for key in ix.sync.get((d, choice[d]), ()):
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


def recomputed_share(d: DecisionVar, recompute) -> float:
    """The share of ``d``'s copies recomputed: ``recompute`` is a set of units (all their copies) or a mapping
    {unit: share of its copies}."""
    if d.unit is None:
        return 0.0
    if isinstance(recompute, dict):
        return recompute.get(d.unit, 0.0)
    return 1.0 if d.unit in recompute else 0.0


def option_cost(d: DecisionVar, recompute=frozenset()) -> list[float]:
    """Seconds of each option of ``d``, its unit's forward run again in backward when the unit is recomputed."""
    f = recomputed_share(d, recompute)
    return d.cost if not f else [c + f * x for c, x in zip(d.cost, d.forward)]


def option_memory(d: DecisionVar, recompute=frozenset()) -> list[float]:
    """Bytes of each option of ``d``: what a recomputed share keeps instead of its saved activations."""
    f = recomputed_share(d, recompute)
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
        if recomputed_share(d, recompute):
            live[d.unit] = live.get(d.unit, 0.0) + d.memory[choice[i]] / (d.copies or 1)
    return peak + max(live.values(), default=0.0)


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


def binding(problem: Problem, memory: float) -> str:
    if problem.memory_limit is not None and memory >= 0.999 * problem.memory_limit:
        return "memory limit"
    return "step time (memory limit not binding)" if problem.memory_limit is not None else "step time"


def format_bytes(b: float) -> str:
    if b >= 2**30:
        return f"{b / 2**30:.2f} GiB"
    return f"{b / 2**20:.2f} MiB" if b >= 2**20 else f"{b / 2**10:.1f} KiB"


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
