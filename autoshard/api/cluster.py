"""Devices in, configuration out: the mesh for ``devices`` ranks chosen by planning each candidate and pricing it.

    >>> search = autoshard.Search(profile="gpu-8x-nvlink", memory_limit="80GiB")
    >>> best = autoshard.api.cluster.plan_cluster(model, (ids,), devices=8, gpus_per_node=4, search=search)
    >>> best.mesh, best.plan.cost().step_time         # the cheapest candidate, planned (a Plan: save, apply)
    $ autoshard plan examples.models:gpt --devices 8 --gpus-per-node 4 --json

The candidates are the factorisations of ``devices`` into ``pipe × data × model``: :func:`candidate_meshes` gives
``data × model``, the model axis inner (its ranks adjacent, on one node) and at most ``gpus_per_node`` wide: tensor
parallelism's collectives run inside a node, data parallelism's between nodes; :func:`candidate_pipelines` puts a
``pipe`` axis of each divisor > 1 of ``devices`` outermost (stage-to-stage sends are the least traffic) over each
``data × model`` mesh of the rest, with ``microbatches`` in ``pipe, 2·pipe, 4·pipe`` (those that divide the batch
into microbatches the data axis divides) and each schedule the runtime has: ``1f1b`` and ``gpipe``, and
``interleaved`` with 2 stages per rank where there are at least ``2·pipe`` microbatches. An axis of size 1 is left
out of the mesh. With ``context_axis`` (``--context``) the meshes are ``data × context × model``, each with a context
axis planned with ``context_parallel`` (the search chooses each attention's form, ZeRO over the context axis where
there is no data axis); the pipelines' meshes of the other axes likewise.

Each candidate is planned by the plan search (:func:`autoshard.plan`, its options as given) and priced by
``plan.cost()`` (a pipeline: :meth:`PipelinePlan.cost <autoshard.compiler.pipeline.PipelinePlan.cost>`, the
schedule's bubble and the stages' sends priced, and its memory the largest rank's sum of
:meth:`~autoshard.compiler.pipeline.PipelinePlan.stage_memory` over its stages, which counts the microbatches in flight
under the schedule): the chosen configuration is the candidate of least estimated step time among those that fit
(ties: the least memory). A pipeline's stages are cut from one plan of a microbatch on the mesh without the pipe
axis, and its schedules share that plan (only the price and the memory differ), searched for the first schedule of
the group (``1f1b``): with one stage per rank the plan search bounds each stage's memory (its stages fixed before
it, :func:`autoshard.passes.plan_search.staged_cuts`), so it is given ``memory_limit``; interleaved stages it plans as
one model, so it is given ``pipe × memory_limit`` (each stage's peak is at most ``memory_limit`` and the stages
together hold the model once). The stages are checked against ``memory_limit`` after; where the least-memory
schedule's largest rank is over it, the microbatch plan is searched again (twice at most) for a limit smaller in
proportion. Bounds prune before the search runs:

* a mesh whose data axis does not divide the example batch is not planned (its data ranks would each run the whole
  batch, as autoshard replicates such an input), as :func:`candidate_pipelines` only offers microbatches the data
  axis divides.
* :func:`least_state_bytes`, before tracing: the parameters, gradients and optimizer state split as far as the mesh
  could split each tensor (ZeRO over the data axis, any number of elements; a mesh axis over a dimension it divides,
  one axis per dimension); a pipeline's largest stage holds at least a ``1/pipe`` share of that over the mesh
  without the pipe axis (every tensor is in some stage; a tied one in several). A candidate whose bound is over
  ``memory_limit`` is not planned.
* the search's own bound (:func:`autoshard.passes.plan_search.least_memory_bound`, computed without a solve): a
  candidate whose limit is below the least memory any of its plans needs is refused in seconds, before the search's
  walk, and recorded as pruned with the search's words.
* :func:`step_floor`, for pipelines (planned after the meshes, least floor first): the batch's matmul and attention
  FLOPs over every device at the profile's peak, over one minus the schedule's bubble; a pipeline whose floor is not
  below the best step already found is not planned.

Each candidate's search runs for at most ``search.time_limit`` seconds, :data:`CANDIDATE_TIME_LIMIT` (30) where it
is None: a candidate whose search meets no plan within ``memory_limit`` in that time is recorded as failed with the
search's words (give ``Search(time_limit=...)`` to search each longer).

Every candidate is kept with its reason (:class:`Candidate`); :meth:`ClusterPlan.as_json` is what ``autoshard plan
--devices N --json`` prints.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from autoshard.compiler.context import zero_axis_of
from autoshard.errors import PlanError
from autoshard.mesh import Mesh

__all__ = ["Candidate", "ClusterPlan", "candidate_meshes", "candidate_pipelines", "least_state_bytes", "step_floor",
           "pipeline_json", "plan_cluster"]

#: the schedules :func:`candidate_pipelines` tries, in the order ties are broken (1F1B holds fewer microbatches
#: than GPipe for the same bubble)
SCHEDULES = ("1f1b", "gpipe", "interleaved")
#: stages per rank of the interleaved schedule's candidates
VIRTUAL_STAGES = 2
#: how often a pipeline's microbatch plan is searched again when its largest rank is over the limit
PIPELINE_REPLANS = 2
#: seconds each candidate's plan search may run when ``Search.time_limit`` is None (a single plan's default is
#: 120 s): a candidate whose walk meets no plan within the limit in that time is recorded as failed with the search's
#: words, not searched for minutes. Llama-3.1-405B on 1,024 devices: its one such candidate (data=256 x model=4,
#: the batch of 128 unsplittable over 256 data ranks) took 136 s of 253 s at the single plan's default
CANDIDATE_TIME_LIMIT = 30.0


@dataclass(frozen=True)
class Candidate:
    """One mesh for the devices: its plan's estimated step and per-rank peak (``plan.cost()``), or why it has
    none (``pruned``: a bound says it cannot fit; ``failed``: planning it raised)."""

    mesh: Mesh
    step_time_s: float | None = None
    memory_per_rank_bytes: float | None = None
    pruned: str | None = None
    failed: str | None = None
    plan: object = field(default=None, repr=False, compare=False)  # the Plan (or PipelinePlan), where planned
    seconds: float = 0.0  # planning time
    #: the pipeline's options (``autoshard.Pipeline``), or None: no pipe axis
    pipeline: object = None
    #: the memory limit the plan search was given (a pipeline's microbatch plan: see the module docstring)
    search_memory_limit: float | None = None

    def as_json(self) -> dict:
        out = {"mesh": dict(self.mesh.axes), "pipeline": pipeline_json(self.pipeline, self.mesh),
               "step_time_s": self.step_time_s, "memory_per_rank_bytes": self.memory_per_rank_bytes,
               "planning_seconds": round(self.seconds, 3)}
        if self.pipeline is not None:
            out["search_memory_limit_bytes"] = self.search_memory_limit
        if self.pruned is not None:
            out["pruned"] = self.pruned
        if self.failed is not None:
            out["failed"] = self.failed
        return out


@dataclass(frozen=True)
class ClusterPlan:
    """Every candidate, the planned ones first in order of estimated step time; :attr:`best` is the first."""

    devices: int
    gpus_per_node: int | None
    candidates: tuple[Candidate, ...]

    @property
    def planned(self) -> list[Candidate]:
        return [c for c in self.candidates if c.plan is not None]

    @property
    def best(self) -> Candidate:
        if not self.planned:
            why = "; ".join(f"{describe(c)}: {c.pruned or c.failed}" for c in self.candidates)
            raise PlanError(f"no mesh of {self.devices} devices has a plan: {why}. Raise memory_limit, or use more "
                            "devices.")
        return self.planned[0]

    @property
    def mesh(self) -> Mesh:
        return self.best.mesh

    @property
    def plan(self):
        return self.best.plan

    def as_json(self, top: int = 3) -> dict:
        """The chosen configuration's fields (``mesh``, ``pipeline``, ``step_time_s``, ``memory_per_rank_bytes``),
        the best ``top`` planned candidates (the chosen one first) and the others with their reasons."""
        best = self.best.as_json()
        return {**{k: best[k] for k in ("mesh", "pipeline", "step_time_s", "memory_per_rank_bytes")},
                "devices": self.devices, "gpus_per_node": self.gpus_per_node,
                "candidates": [c.as_json() for c in self.planned[:top]],
                "not_planned": [c.as_json() for c in self.candidates if c.plan is None]}


def candidate_meshes(devices: int, gpus_per_node: int | None = None, data_axis: str = "data",
                     model_axis: str = "model", context_axis: str | None = None) -> list[Mesh]:
    """``data × model = devices`` with ``model`` at most ``gpus_per_node`` and dividing it (a model group never
    straddles two nodes), the model axis inner; axes of size 1 left out. Largest data axis first. With
    ``context_axis``: ``data × context × model``, the context axis between the two (torchtitan's order: its ring or
    all-to-all inside a node where it fits), each context size of each model size, smallest context first."""
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise PlanError(f"devices is {devices!r}, but must be a positive int (the number of ranks to plan for: "
                        "plan_cluster(..., devices=N), autoshard plan --devices N).")
    if gpus_per_node is not None and (isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int)
                                      or gpus_per_node < 1):
        raise PlanError(f"gpus_per_node is {gpus_per_node!r}, but must be a positive int (the devices of one node, "
                        "which bound the model axis: gpus_per_node=G, autoshard plan --gpus-per-node G), or None "
                        "(no node bound).")
    out = []
    for model in range(1, devices + 1):
        if devices % model or (gpus_per_node is not None and (model > gpus_per_node or gpus_per_node % model)):
            continue
        for context in range(1, devices // model + 1) if context_axis is not None else (1,):
            if (devices // model) % context:
                continue
            sizes = ((data_axis, devices // model // context), (context_axis, context), (model_axis, model))
            axes = tuple((n, s) for n, s in sizes if s > 1)
            out.append(Mesh(axes or ((data_axis, 1),)))
    if context_axis is not None:  # as without it, then by context size
        out.sort(key=lambda m: (m.axis_size(model_axis) if model_axis in m.names else 1,
                                m.axis_size(context_axis) if context_axis in m.names else 1))
    return out


def candidate_pipelines(devices: int, gpus_per_node: int | None = None, batch: int | None = None,
                        data_axis: str = "data", model_axis: str = "model", pipe_axis: str = "pipe",
                        schedules: tuple[str, ...] = SCHEDULES,
                        context_axis: str | None = None) -> list[tuple[Mesh, object]]:
    """``(mesh, Pipeline)`` for ``pipe × data × model = devices``, ``pipe`` a divisor > 1 of ``devices`` and outermost,
    ``data × model`` each of :func:`candidate_meshes` of ``devices / pipe``; ``microbatches`` in ``pipe, 2·pipe,
    4·pipe`` where they divide ``batch`` into microbatches the data axis divides (``batch`` None: all three); each of
    ``schedules`` (``interleaved``: :data:`VIRTUAL_STAGES` stages per rank, with at least that many times ``pipe``
    microbatches). Smallest pipe first, then as :func:`candidate_meshes`, fewest microbatches, ``schedules``' order.
    ``context_axis``: the meshes of the rest are ``data × context × model`` (:func:`candidate_meshes`)."""
    from autoshard.compiler.pipeline import Pipeline

    candidate_meshes(devices, gpus_per_node)  # the arguments checked
    out = []
    for pipe in range(2, devices + 1):
        if devices % pipe:
            continue
        for sub in candidate_meshes(devices // pipe, gpus_per_node, data_axis, model_axis, context_axis):
            rest = tuple((n, k) for n, k in sub.axes if k > 1)
            mesh = Mesh(((pipe_axis, pipe), *rest))
            d = sub.axis_size(data_axis) if data_axis in sub.names else 1
            for m in (pipe, 2 * pipe, 4 * pipe):
                if batch is not None and (batch % m or (batch // m) % d):
                    continue
                for schedule in schedules:
                    if schedule == "interleaved":
                        if m >= VIRTUAL_STAGES * pipe:
                            out.append((mesh, Pipeline(m, schedule, stages_per_rank=VIRTUAL_STAGES,
                                                       axis=pipe_axis)))
                    else:
                        out.append((mesh, Pipeline(m, schedule, axis=pipe_axis)))
    return out


def pipeline_json(pipeline, mesh: Mesh) -> dict | None:
    """A pipeline's options as ``--json`` prints them (None: no pipeline): ``stages`` (pipe × stages per rank),
    ``microbatches``, ``schedule``, ``stages_per_rank``, ``axis``."""
    if pipeline is None:
        return None
    return {"stages": mesh.axis_size(pipeline.axis) * pipeline.stages_per_rank,
            "microbatches": pipeline.microbatches, "schedule": pipeline.schedule,
            "stages_per_rank": pipeline.stages_per_rank, "axis": pipeline.axis}


def describe(candidate: Candidate) -> str:
    """``data=2,model=2`` or ``pipe=2,model=2 1f1b×4`` (a pipeline: its schedule and microbatches)."""
    p = candidate.pipeline
    if p is None:
        return _text(candidate.mesh)
    virtual = f" v={p.stages_per_rank}" if p.stages_per_rank > 1 else ""
    return f"{_text(candidate.mesh)} {p.schedule}{virtual} m={p.microbatches}"


def least_state_bytes(model: torch.nn.Module, mesh: Mesh, optimizer: str = "adam", zero: bool = True,
                      data_axis: str = "data") -> float:
    """A lower bound on one rank's parameters, gradients and optimizer state on ``mesh``: each tensor split by the
    most ranks any plan could split it over — ``zero``: stored sharded over the data axis whatever its shape (ZeRO
    pads); every other axis (or the data axis without ``zero``) only over a dimension it divides, one axis per
    dimension (autoshard's even shards). Buffers and activations are not counted (they only add)."""
    from autoshard.cost_models.memory import training_state_bytes

    total = 0.0
    seen = set()
    for p in model.parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        total += training_state_bytes(p.numel(), p.dtype, optimizer) / _most_splits(tuple(p.shape), mesh, zero,
                                                                                   data_axis)
    return total


def _most_splits(shape: tuple[int, ...], mesh: Mesh, zero: bool, data_axis: str) -> int:
    """The most ranks a tensor of ``shape`` can be split over on ``mesh`` (see :func:`least_state_bytes`)."""
    free = 1
    axes = []
    for name, size in mesh.axes:
        if zero and name == data_axis:
            free *= size
        else:
            axes.append(size)
    best = 1

    def place(i: int, used: frozenset, product: int) -> None:
        nonlocal best
        best = max(best, product)
        if i == len(axes):
            return
        place(i + 1, used, product)
        for d, n in enumerate(shape):
            if d not in used and n % axes[i] == 0:
                place(i + 1, used | {d}, product * axes[i])

    place(0, frozenset(), 1)
    return free * best


def step_floor(gm: torch.fx.GraphModule, profile, devices: int, batch: int, microbatches: int = 1,
               bubble: float = 0.0) -> float:
    """A lower bound on the estimated step (``plan.cost()``, ``PipelinePlan.cost()``) of any plan of the model whose
    planned graph ``gm`` is (global shapes, its gradients marked) on ``devices`` ranks, its batch of ``batch`` cut
    into ``microbatches`` run with the schedule's idle fraction ``bubble``: the matmul and attention FLOPs (forward,
    and backward where a gradient flows) of one microbatch, times the microbatches, over every device at the
    profile's peak for the op's dtype and the highest efficiency any of the op's tables (its kind, dtype, forward or
    backward) reaches, over ``1 - bubble``. Every op is priced at least its FLOPs over its split (at most the
    devices of a stage, ``devices / pipe``), its peak and its efficiency; a pipeline's slowest rank runs
    at least the ``1/pipe`` share of the stages' microbatches over ``1 - bubble``; recomputation and communication
    only add. A microbatch's FLOPs are the graph's with every size equal to ``batch`` read as ``batch /
    microbatches``: a dim that merely equals the batch shrinks too, which only lowers the bound (FLOPs grow with
    every size)."""
    from autoshard import meta as M
    from autoshard.compiler.ops import entry
    from autoshard.cost_models.compute import compute_dtype, flops_at

    def size(s: int) -> float:
        return s / microbatches if s == batch else s

    seconds = 0.0
    for n in gm.graph.nodes:
        e = entry(n.target) if n.op == "call_function" else None
        if e is None or e.compute_kind not in ("matmul", "attention"):
            continue
        forward, backward = flops_at(n, size)
        dtype = compute_dtype(n)
        work = forward + (backward if n.meta.get(M.REQUIRES_GRAD) else 0.0)
        seconds += work / (profile.flops_for(dtype) * profile.efficiency_ceiling(e.compute_kind, dtype))
    return microbatches * seconds / devices / (1 - bubble)


def plan_cluster(model: torch.nn.Module, example_inputs=None, example_kwargs: dict | None = None, *,
                 devices: int | None = None, gpus_per_node: int | None = None, search=None, data_axis: str = "data",
                 model_axis: str = "model", pipe_axis: str = "pipe", pipelines: bool = True,
                 schedules: tuple[str, ...] = SCHEDULES, context_axis: str | None = None, **options) -> ClusterPlan:
    """Plan ``model`` on every :func:`candidate_meshes` of ``devices`` and (``pipelines``) every
    :func:`candidate_pipelines` (of ``schedules``) with the plan search (``search``: an :class:`autoshard.Search`,
    default ``Search()``; ``options``: :func:`autoshard.plan`'s other keywords but annotations, which name one mesh's
    axes, and pipeline, which is chosen here) and rank the plans by their estimated step time; candidates a bound says
    cannot fit ``search.memory_limit`` are pruned (see the module docstring). ``context_axis``: also the meshes with
    that axis between data and model (:func:`candidate_meshes`), each planned with ``context_parallel=context_axis``
    (the sequence sharded there; pipelines too: ``pipe × data × context × model``). ``devices`` left out: the world
    torchrun started (every rank calls this together; each candidate without a pipe axis is planned on rank 0 and
    replayed on the others, as :func:`autoshard.plan` does)."""
    from autoshard.api.planning import Search
    from autoshard.compiler.plan import reused_traces

    if options.get("annotations"):
        raise PlanError("plan_cluster got annotations, but they give placements for one mesh's axes while the "
                        "meshes are being chosen: plan the mesh you annotate for with autoshard.plan.")
    if options.get("context_parallel") is not None:
        raise PlanError("plan_cluster got context_parallel=, but it names one mesh's axis: give context_axis=NAME "
                        "(autoshard plan --devices N --context) and the meshes with that axis are among the "
                        "candidates.")
    if options.get("pipeline") is not None:
        raise PlanError("plan_cluster got pipeline=, but it chooses the pipeline (its degree, microbatches and "
                        "schedule) among the candidates: drop it, or plan that pipeline with autoshard.plan.")
    options.pop("pipeline", None)
    if devices is None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise PlanError("plan_cluster got no devices and torch.distributed is not initialised: give devices=N "
                            "(the number of ranks), or call it under torchrun.")
        devices = dist.get_world_size()
    search = search if search is not None else Search()
    if not isinstance(search, Search):
        raise PlanError(f"plan_cluster got search of type {type(search).__name__}, but search must be "
                        "autoshard.Search(profile=..., memory_limit=..., ...) or None (the default Search()).")
    if search.time_limit is None:
        search = dataclasses.replace(search, time_limit=CANDIDATE_TIME_LIMIT)
    with reused_traces():  # every candidate plans the one trace of the model (one per microbatch shape)
        return _plan_candidates(model, example_inputs, example_kwargs, devices, gpus_per_node, search, options,
                                data_axis, model_axis, context_axis, pipe_axis, schedules, pipelines)


def _plan_candidates(model, example_inputs, example_kwargs, devices: int, gpus_per_node, search, options: dict,
                     data_axis: str, model_axis: str, context_axis: str, pipe_axis: str, schedules, pipelines: bool
                     ) -> ClusterPlan:
    """:func:`plan_cluster`'s candidates, planned and ordered."""
    from autoshard.api.planning import examples_of, parse_bytes

    limit = parse_bytes(search.memory_limit)
    zero = search.zero != 0
    out = []
    batch = _batch(*examples_of(example_inputs, example_kwargs))
    for mesh in candidate_meshes(devices, gpus_per_node, data_axis, model_axis, context_axis):
        out.append(_plan_mesh(model, example_inputs, example_kwargs, mesh, search, limit, zero, data_axis, batch,
                              _mesh_options(options, mesh, context_axis)))
    if pipelines:
        groups: dict = {}  # (mesh, microbatches, stages per rank) -> its schedules: one microbatch plan each
        for mesh, pipeline in candidate_pipelines(devices, gpus_per_node, batch, data_axis, model_axis, pipe_axis,
                                                  schedules, context_axis):
            groups.setdefault((mesh, pipeline.microbatches, pipeline.stages_per_rank), []).append(pipeline)
        # each pipeline's step floor (step_floor) from a planned mesh's graph, least first; one at or above the
        # best step found so far cannot be chosen and is not searched
        floors = dict.fromkeys(groups, 0.0)
        graph = next((c.plan for c in out if c.plan is not None), None)
        if graph is not None and batch is not None:
            from autoshard.compiler.pipeline.options import bubble_fraction
            from autoshard.cost_models.profile import HardwareProfile, load_profile

            profile = search.profile if isinstance(search.profile, HardwareProfile) else load_profile(search.profile)
            for key, group in groups.items():
                mesh, m, v = key
                virtual = v if group[0].schedule == "interleaved" else 1
                floors[key] = step_floor(graph.graph_module, profile, devices, batch, m,
                                         bubble_fraction(mesh.axis_size(pipe_axis), m, virtual))
        for key in sorted(groups, key=lambda k: floors[k]):
            mesh, group = key[0], groups[key]
            steps = [c.step_time_s for c in out if c.plan is not None]
            if steps and floors[key] >= min(steps):
                why = (f"its step is at least {floors[key]:.4g} s (the batch's matmul and attention FLOPs over "
                       f"{devices} devices at the profile's peak, with the schedule's bubble), not below the best "
                       f"found ({min(steps):.4g} s)")
                out.extend(Candidate(mesh, pruned=why, pipeline=p) for p in group)
                continue
            out.extend(_plan_pipeline(model, example_inputs, example_kwargs, mesh, group, search, limit, zero,
                                      data_axis, _mesh_options(options, mesh, context_axis)))
    order = sorted(out, key=lambda c: (c.plan is None, c.step_time_s if c.plan is not None else math.inf,
                                       c.memory_per_rank_bytes if c.plan is not None else math.inf))
    return ClusterPlan(devices, gpus_per_node, tuple(order))


def _mesh_options(options: dict, mesh: Mesh, context_axis: str) -> dict:
    """The compile options of one candidate mesh: ``options``, with context parallelism on ``context_axis`` where
    the mesh has that axis."""
    return dict(options, context_parallel=context_axis) if context_axis in mesh.names else options


def _plan_mesh(model, example_inputs, example_kwargs, mesh: Mesh, search, limit, zero: bool, data_axis: str,
               batch: int | None, options: dict) -> Candidate:
    """One ``data × model`` candidate: pruned by the state bound or a batch its data axis does not divide, or
    planned and priced by ``plan.cost()``."""
    import time

    from autoshard.api.planning import plan

    stored = zero_axis_of(mesh, data_axis, options.get("context_parallel"))
    bound = least_state_bytes(model, mesh, search.optimizer, zero, stored)
    if limit is not None and bound > limit:
        return Candidate(mesh, pruned=f"its parameters, gradients and optimizer state need at least {_gib(bound)} "
                                      f"per rank, over memory_limit {_gib(limit)}")
    d = mesh.axis_size(data_axis) if data_axis in mesh.names else 1
    if batch is not None and batch % d:  # as a pipeline's microbatches must divide over its data axis
        return Candidate(mesh, pruned=f"the batch of {batch} does not divide over {data_axis}={d}: every rank of a "
                                      f"{data_axis} group would run the whole batch")
    t0 = time.perf_counter()
    try:
        planned = plan(model, mesh, example_inputs, example_kwargs, search=search, data_axis=data_axis, **options)
    except PlanError as e:
        return _refused(mesh, e, time.perf_counter() - t0)
    cost = planned.cost()
    seconds = time.perf_counter() - t0
    if limit is not None and cost.memory_per_rank > limit:  # the search's re-plans did not bring it within
        return Candidate(mesh, cost.step_time, float(cost.memory_per_rank), seconds=seconds,
                         failed=f"its plan needs {_gib(cost.memory_per_rank)} per rank by plan.cost(), over "
                                f"memory_limit {_gib(limit)}")
    return Candidate(mesh, cost.step_time, float(cost.memory_per_rank), plan=planned, seconds=seconds)


def _plan_pipeline(model, example_inputs, example_kwargs, mesh: Mesh, group: list, search, limit, zero: bool,
                   data_axis: str, options: dict) -> list[Candidate]:
    """The candidates of one pipe mesh, microbatch count and stages per rank, one per schedule of ``group``: one
    microbatch plan (searched under ``pipe × limit``, again for less where the largest rank does not fit), each
    schedule priced on it (see the module docstring)."""
    import time

    from autoshard.api.planning import plan

    axis = group[0].axis
    pipe = mesh.axis_size(axis)
    rest = Mesh(tuple((n, k) for n, k in mesh.axes if n != axis) or ((data_axis, 1),))
    stored = zero_axis_of(rest, data_axis, options.get("context_parallel"))
    bound = least_state_bytes(model, rest, search.optimizer, zero, stored) / pipe
    if limit is not None and bound > limit:
        why = (f"its largest stage's parameters, gradients and optimizer state need at least {_gib(bound)} per rank "
               f"(1/{pipe} of the model's on the other axes), over memory_limit {_gib(limit)}")
        return [Candidate(mesh, pruned=why, pipeline=p) for p in group]
    # the search bounds each stage's memory (one stage per rank: autoshard.passes.plan_search.staged_cuts), so it is
    # given the limit itself; interleaved stages it plans as one model, under ``pipe × limit``
    staged = group[0].stages_per_rank == 1
    searched = None if limit is None else limit * (1 if staged else pipe)
    t0 = time.perf_counter()
    best: list[Candidate] = []
    for attempt in range(1 + PIPELINE_REPLANS):
        try:
            pplan = plan(model, mesh, example_inputs, example_kwargs, pipeline=group[0], data_axis=data_axis,
                         search=dataclasses.replace(search, memory_limit=searched), **options)
        except PlanError as e:
            if best:  # a tighter search refused: keep what the looser one gave
                break
            seconds = time.perf_counter() - t0
            return [dataclasses.replace(_refused(mesh, e, seconds), pipeline=p, search_memory_limit=searched)
                    for p in group]
        seconds = time.perf_counter() - t0
        best = []
        for p in group:
            variant = pplan if p == pplan.pipeline else dataclasses.replace(pplan, pipeline=p)
            step, memory = variant.cost().step_time, float(variant.memory_per_rank())
            if limit is not None and memory > limit:
                best.append(Candidate(mesh, step, memory, seconds=seconds, pipeline=p, search_memory_limit=searched,
                                      failed=f"its largest rank needs {_gib(memory)} by stage_memory (the "
                                             f"microbatch plan searched under {_gib(searched)}), over memory_limit "
                                             f"{_gib(limit)}"))
            else:
                best.append(Candidate(mesh, step, memory, plan=variant, seconds=seconds, pipeline=p,
                                      search_memory_limit=searched))
        least = min(c.memory_per_rank_bytes for c in best)
        if limit is None or least <= limit or attempt == PIPELINE_REPLANS:
            break
        searched = searched * limit / least * (1 - 1e-3)
    return best


def _refused(mesh: Mesh, error: PlanError, seconds: float) -> Candidate:
    """A candidate the search refused: pruned by its least-memory bound, or failed with its words."""
    text = str(error)
    if "least memory any plan needs" in text:
        return Candidate(mesh, pruned=text, seconds=seconds)
    return Candidate(mesh, failed=f"{type(error).__name__}: {text}", seconds=seconds)


def _batch(args: tuple, kwargs: dict) -> int | None:
    """The example batch (dim 0 of the first tensor input with a dim), as the pipeline cuts it; None: no such input."""
    from torch.utils import _pytree as pytree

    leaves = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor) and x.dim() >= 1]
    return leaves[0].shape[0] if leaves else None


def _text(mesh: Mesh) -> str:
    return ",".join(f"{n}={s}" for n, s in mesh.axes)


def _gib(n: float) -> str:
    return f"{n / 2**30:.4g} GiB" if n >= 2**30 else f"{n / 2**20:.4g} MiB"
