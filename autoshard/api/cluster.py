"""Devices in, configuration out: the mesh for ``devices`` ranks chosen by planning each candidate and pricing it.

    >>> search = autoshard.Search(profile="gpu-8x-nvlink", memory_limit="80GiB")
    >>> best = autoshard.api.cluster.plan_cluster(model, (ids,), devices=8, gpus_per_node=4, search=search)
    >>> best.mesh, best.plan.cost().step_time         # the cheapest candidate, planned (a Plan: save, apply)
    $ autoshard plan examples.models:gpt --devices 8 --gpus-per-node 4 --json

The candidates (:func:`candidate_meshes`) are the factorisations of ``devices`` into ``data × model``, the model axis
inner (its ranks adjacent, on one node) and at most ``gpus_per_node`` wide: tensor parallelism's collectives run
inside a node, data parallelism's between nodes. An axis of size 1 is left out of the mesh. (Pipeline and context
axes are not searched here: the plan search prices neither yet.)

Each candidate is planned by the plan search (:func:`autoshard.plan`, its options as given) and priced by
``plan.cost()``: the chosen mesh is the candidate of least estimated step time among those that fit. Bounds prune
before the search runs:

* :func:`least_state_bytes`, before tracing: the parameters, gradients and optimizer state split as far as the mesh
  could split each tensor (ZeRO over the data axis, any number of elements; a mesh axis over a dimension it divides,
  one axis per dimension). A candidate whose bound is over ``memory_limit`` is not planned.
* the search's own bound (:func:`autoshard.passes.plan_search.least_memory_bound`, computed without a solve): a
  candidate whose limit is below the least memory any of its plans needs is refused in seconds, before the search's
  walk, and recorded as pruned with the search's words.

Every candidate is kept with its reason (:class:`Candidate`); :meth:`ClusterPlan.as_json` is what ``autoshard plan
--devices N --json`` prints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from autoshard.errors import PlanError
from autoshard.mesh import Mesh

__all__ = ["Candidate", "ClusterPlan", "candidate_meshes", "least_state_bytes", "plan_cluster"]


@dataclass(frozen=True)
class Candidate:
    """One mesh for the devices: its plan's estimated step and per-rank peak (``plan.cost()``), or why it has
    none (``pruned``: a bound says it cannot fit; ``failed``: planning it raised)."""

    mesh: Mesh
    step_time_s: float | None = None
    memory_per_rank_bytes: float | None = None
    pruned: str | None = None
    failed: str | None = None
    plan: object = field(default=None, repr=False, compare=False)  # the Plan, where planned
    seconds: float = 0.0  # planning time

    def as_json(self) -> dict:
        out = {"mesh": dict(self.mesh.axes), "pipeline": None, "step_time_s": self.step_time_s,
               "memory_per_rank_bytes": self.memory_per_rank_bytes, "planning_seconds": round(self.seconds, 3)}
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
            why = "; ".join(f"{_text(c.mesh)}: {c.pruned or c.failed}" for c in self.candidates)
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
                     model_axis: str = "model") -> list[Mesh]:
    """``data × model = devices`` with ``model`` at most ``gpus_per_node`` and dividing it (a model group never
    straddles two nodes), the model axis inner; axes of size 1 left out. Largest data axis first."""
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise PlanError(f"devices is {devices!r}, but must be a positive int (the number of ranks).")
    if gpus_per_node is not None and (isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int)
                                      or gpus_per_node < 1):
        raise PlanError(f"gpus_per_node is {gpus_per_node!r}, but must be a positive int.")
    out = []
    for model in range(1, devices + 1):
        if devices % model or (gpus_per_node is not None and (model > gpus_per_node or gpus_per_node % model)):
            continue
        axes = tuple((n, s) for n, s in ((data_axis, devices // model), (model_axis, model)) if s > 1)
        out.append(Mesh(axes or ((data_axis, 1),)))
    return out


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


def plan_cluster(model: torch.nn.Module, example_inputs=None, example_kwargs: dict | None = None, *,
                 devices: int | None = None, gpus_per_node: int | None = None, search=None, data_axis: str = "data",
                 model_axis: str = "model", **options) -> ClusterPlan:
    """Plan ``model`` on every :func:`candidate_meshes` of ``devices`` with the plan search (``search``: an
    :class:`autoshard.Search`, default ``Search()``; ``options``: :func:`autoshard.plan`'s other keywords but
    annotations, which name one mesh's axes) and rank the plans by ``plan.cost().step_time``; candidates a bound
    says cannot fit ``search.memory_limit`` are pruned (see the module docstring). ``devices`` left out: the world
    torchrun started (every rank calls this together; each candidate is planned on rank 0 and replayed on the
    others, as :func:`autoshard.plan` does)."""
    import time

    from autoshard.api.planning import Search, parse_bytes, plan

    if options.get("annotations"):
        raise PlanError("plan_cluster got annotations, but they give placements for one mesh's axes while the "
                        "meshes are being chosen: plan the mesh you annotate for with autoshard.plan.")
    if devices is None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise PlanError("plan_cluster got no devices and torch.distributed is not initialised: give devices=N "
                            "(the number of ranks), or call it under torchrun.")
        devices = dist.get_world_size()
    search = search if search is not None else Search()
    if not isinstance(search, Search):
        raise PlanError(f"search has type {type(search).__name__}, but must be autoshard.Search(...).")
    limit = parse_bytes(search.memory_limit)
    zero = search.zero != 0
    out = []
    for mesh in candidate_meshes(devices, gpus_per_node, data_axis, model_axis):
        bound = least_state_bytes(model, mesh, search.optimizer, zero, data_axis)
        if limit is not None and bound > limit:
            out.append(Candidate(mesh, pruned=f"its parameters, gradients and optimizer state need at least "
                                              f"{_gib(bound)} per rank, over memory_limit {_gib(limit)}"))
            continue
        t0 = time.perf_counter()
        try:
            planned = plan(model, mesh, example_inputs, example_kwargs, search=search, data_axis=data_axis,
                           **options)
        except PlanError as e:
            text = str(e)
            seconds = time.perf_counter() - t0
            if "least memory any plan needs" in text:
                out.append(Candidate(mesh, pruned=text, seconds=seconds))
            else:
                out.append(Candidate(mesh, failed=f"{type(e).__name__}: {text}", seconds=seconds))
            continue
        cost = planned.cost()
        seconds = time.perf_counter() - t0
        if limit is not None and cost.memory_per_rank > limit:  # the search's re-plans did not bring it within
            out.append(Candidate(mesh, cost.step_time, float(cost.memory_per_rank), seconds=seconds,
                                 failed=f"its plan needs {_gib(cost.memory_per_rank)} per rank by plan.cost(), "
                                        f"over memory_limit {_gib(limit)}"))
            continue
        out.append(Candidate(mesh, cost.step_time, float(cost.memory_per_rank), plan=planned, seconds=seconds))
    order = sorted(out, key=lambda c: (c.plan is None, c.step_time_s if c.plan is not None else math.inf))
    return ClusterPlan(devices, gpus_per_node, tuple(order))


def _text(mesh: Mesh) -> str:
    return ",".join(f"{n}={s}" for n, s in mesh.axes)


def _gib(n: float) -> str:
    return f"{n / 2**30:.4g} GiB" if n >= 2**30 else f"{n / 2**20:.4g} MiB"
