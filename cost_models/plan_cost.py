"""Costs of a plan in seconds and bytes: one op under a strategy, one redistribution, one gradient sync, and the
whole annotated graph (:func:`plan_cost`). The exact search (``passes/plan_search/``) minimises the same
quantities, so ``plan_cost`` of a searched plan equals the search's objective.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.fx
from autoshard.cost_models.compute import compute_time, op_work, work_seconds
from autoshard.cost_models.memory import MemoryBreakdown, plan_memory
from autoshard.cost_models.profile import HardwareProfile

from autoshard import meta as M
from autoshard.compiler import redistribute
from autoshard.compiler.collective_kinds import time as kind_time
from autoshard.frontend.graph_utils import is_getitem, itemsize, out_vals, rerun_in_backward, shape, tensor_inputs
from autoshard.mesh import Mesh
from autoshard.compiler.ops import entry
from autoshard.placements import Spec, local_shape


def local_numel(shape_, spec, mesh) -> int:
    return math.prod(local_shape(shape_, spec, mesh))


def shard_factor(node: torch.fx.Node, strat: M.Strategy, mesh: Mesh, vals: list | None = None) -> float:
    """How many ways the op's work is split: the op's ``split`` facet where it states one, else the largest
    global/local size ratio among its operands (``vals``: the inputs' and outputs' values, when the caller has them
    already)."""
    split = entry(node.target).split if node.op == "call_function" else None
    if split is not None:
        return split(node, strat, mesh)
    best = 1.0
    if vals is None:
        vals = [x.meta["val"] for x in tensor_inputs(node)] + out_vals(node)
    outs = strat.output_spec if isinstance(strat.output_spec[0], tuple) else (strat.output_spec,)
    for v, spec in zip(vals, list(strat.input_specs) + list(outs)):
        if spec is None or v.numel() == 0:
            continue
        best = max(best, v.numel() / max(1, local_numel(v.shape, spec, mesh)))
    return best


def op_times(node: torch.fx.Node, strategies, mesh: Mesh, profile: HardwareProfile) -> list[float]:
    """:func:`op_time` of every strategy in ``strategies`` (the unsplit roofline time computed once)."""
    fwd = op_work(node)  # the work once; its seconds per strategy's split (the same floats as op_time's)
    bwd = op_work(node, backward=True) if node.meta.get(M.REQUIRES_GRAD) else None
    vals = [x.meta["val"] for x in tensor_inputs(node)] + out_vals(node)
    out = []
    for s in strategies:
        f = shard_factor(node, s, mesh, vals)
        t = work_seconds(fwd, profile, f)
        if bwd is not None:
            t += work_seconds(bwd, profile, f)
        out.append(t + op_comm_time(node, s, mesh, profile))
    return out


def forward_times(node: torch.fx.Node, strategies, mesh: Mesh, profile: HardwareProfile) -> list[float]:
    """Forward seconds of ``node`` under each strategy in ``strategies``, what its local form sends by itself
    forward included (:func:`op_comm_time`): what backward spends running it again where its recomputation region
    is recomputed (:func:`plan_cost`; the plan search prices recomputed ops with it)."""
    fwd = op_work(node)  # the same floats as compute_time(node, profile, f)
    vals = [x.meta["val"] for x in tensor_inputs(node)] + out_vals(node)
    return [work_seconds(fwd, profile, shard_factor(node, s, mesh, vals)) + op_comm_time(node, s, mesh, profile,
                                                                                         backward=False)
            for s in strategies]


def trains(gm: torch.fx.GraphModule) -> bool:
    """Whether the graph has a backward (some node needs a gradient): only then are recomputation regions run
    again."""
    return any(n.meta.get(M.REQUIRES_GRAD) for n in gm.graph.nodes)


def rerun_nodes(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, str]:
    """{node: region id} of the nodes of an annotated graph that backward runs again
    (:func:`autoshard.frontend.graph_utils.rerun_in_backward`: each recomputation region's ops and the nodes between
    them, collectives included); none when the graph has no backward (:func:`trains`)."""
    return rerun_in_backward(gm.graph) if trains(gm) else {}


def op_comm_time(node: torch.fx.Node, strat: M.Strategy, mesh: Mesh, profile: HardwareProfile,
                 backward: bool = True) -> float:
    """What the op's local form sends by itself under ``strat`` (the registry's ``comm`` facet: context-parallel
    attention), forward + backward (forward alone without ``backward``); 0 for ops without one."""
    fn = entry(node.target).comm
    if fn is None:
        return 0.0
    return fn(node, strat, mesh, profile) if backward else fn(node, strat, mesh, profile, backward=False)


def op_time(node: torch.fx.Node, strat: M.Strategy, mesh: Mesh, profile: HardwareProfile) -> float:
    f = shard_factor(node, strat, mesh)
    t = compute_time(node, profile, f)
    if node.meta.get(M.REQUIRES_GRAD):
        t += compute_time(node, profile, f, backward=True)
    return t + op_comm_time(node, strat, mesh, profile)


def link(profile: HardwareProfile, mesh: Mesh, axis: str):
    return profile.link_for(axis, mesh.index(axis), mesh)


def redistribution_time(src: Spec, dst: Spec, x: torch.fx.Node, mesh: Mesh, profile: HardwareProfile
                        ) -> float | None:
    return redistribution_time_of(src, dst, shape(x), itemsize(x), bool(x.meta.get(M.REQUIRES_GRAD)), mesh, profile)


@functools.lru_cache(maxsize=1 << 16)
def redistribution_time_of(src, dst, shp, size, rg, mesh, profile) -> float | None:
    steps = redistribute.steps_between(src, dst, mesh)
    if steps is None:
        return None
    total = 0.0
    for st in steps:
        n = mesh.axis_size(st.axis)
        before = local_numel(shp, st.before, mesh) * size
        after = local_numel(shp, st.after, mesh) * size
        fwd, bwd = kind_time(st.kind, max(before, after), n, link(profile, mesh, st.axis), rg)
        total += fwd
        total += bwd
    return total


@functools.lru_cache(maxsize=1 << 16)
def redistribution_forward_time_of(src, dst, shp, size, mesh, profile) -> float | None:
    """Forward seconds of the redistribution ``src`` -> ``dst`` of a value of shape ``shp`` (``size`` bytes per
    element): what backward spends running it again where it lies between the ops of a recomputed region
    (:func:`node_time`; the plan search prices such redistributions with it). None where none exists."""
    steps = redistribute.steps_between(src, dst, mesh)
    if steps is None:
        return None
    total = 0.0
    for st in steps:
        before = local_numel(shp, st.before, mesh) * size
        after = local_numel(shp, st.after, mesh) * size
        total += kind_time(st.kind, max(before, after), mesh.axis_size(st.axis), link(profile, mesh, st.axis))[0]
    return total


def grad_sync_time(spec: Spec, axes, x: torch.fx.Node, mesh: Mesh, profile: HardwareProfile,
                   size: int | None = None) -> float:
    """Seconds of the gradient sync of ``x`` in ``spec`` over ``axes`` (``size``: bytes per element, default
    ``x``'s)."""
    nbytes = local_numel(shape(x), spec, mesh) * (itemsize(x) if size is None else size)
    return sum(kind_time("grad_all_reduce", nbytes, mesh.axis_size(a), link(profile, mesh, a))[1] for a in axes)


def _zero_stage_of_gather(node: torch.fx.Node, info) -> int:
    """The ZeRO stage of the parameter an all-gather on its storage axis gathers (0: not a ZeRO gather)."""
    if info.kind != "all_gather":
        return 0
    src = node.args[0]
    while isinstance(src, torch.fx.Node) and src.op == "call_function" and src.meta.get(M.PRECISION_CAST):
        src = src.args[0]
    storage = src.meta.get(M.STORAGE) if isinstance(src, torch.fx.Node) else None
    return storage.stage if storage is not None and storage.axis in info.axes else 0


def _zero_regather_time(node, info, mesh: Mesh, profile: HardwareProfile) -> float:
    """ZeRO-3: the all-gather runs again in backward (``all_gather_reshard``)."""
    if _zero_stage_of_gather(node, info) != 3:
        return 0.0
    return redistribution_time(info.src, info.dst, node.args[0], mesh, profile) or 0.0


def _zero_sync_saving(x, info, mesh: Mesh, profile: HardwareProfile) -> float:
    """ZeRO-2/3: a gathered parameter's gradient sync over the storage axis is a reduce-scatter, not an all-reduce
    and a slice (``all_gather_sync``/``all_gather_reshard``): the all-reduce priced minus the reduce-scatter."""
    if not isinstance(x, torch.fx.Node) or M.COLLECTIVE not in x.meta:
        return 0.0
    gather = x.meta[M.COLLECTIVE]
    if _zero_stage_of_gather(x, gather) < 2:
        return 0.0
    axis = gather.axes[0]
    if axis not in info.axes:
        return 0.0
    full = local_numel(shape(x), info.src, mesh) * itemsize(x)
    axis_link = link(profile, mesh, axis)
    n = mesh.axis_size(axis)
    all_reduce = kind_time("grad_all_reduce", full, n, axis_link)[1]
    reduce_scatter = kind_time("all_gather_sync", full, n, axis_link)[1]
    return max(0.0, all_reduce - reduce_scatter)


def optimizer_time(x: torch.fx.Node, spec: Spec, stage: int, data_size: int, mesh: Mesh, profile: HardwareProfile,
                   optimizer: str) -> float:
    """Seconds of the optimizer step over parameter ``x`` computed in ``spec`` and stored at ZeRO ``stage`` (1-3:
    this rank's 1/``data_size`` of it) — :meth:`HardwareProfile.optimizer_seconds` of one tensor; 0 for buffers and
    frozen parameters. The plan search prices each parameter option with it, and :func:`plan_cost` the plan's."""
    if not x.meta.get(M.REQUIRES_GRAD):
        return 0.0
    elements = local_numel(shape(x), spec, mesh) / (data_size if stage else 1)
    return profile.optimizer_seconds(optimizer, 1, elements)


def parameter_optimizer_time(n: torch.fx.Node, mesh: Mesh, profile: HardwareProfile, optimizer: str) -> float:
    """:func:`optimizer_time` of the parameter a get_attr node of an annotated graph reads, in the layout and ZeRO
    stage the plan stores it in (0 for buffers, frozen parameters and nodes without a spec)."""
    if not n.meta.get(M.REQUIRES_GRAD) or M.SPEC not in n.meta:
        return 0.0
    storage = n.meta.get(M.STORAGE)
    if storage is None:
        return optimizer_time(n, n.meta[M.SPEC], 0, 1, mesh, profile, optimizer)
    return optimizer_time(n, storage.compute, storage.stage, mesh.axis_size(storage.axis), mesh, profile, optimizer)


def step_overhead(gm: torch.fx.GraphModule, profile: HardwareProfile) -> float:
    """The profile's fixed seconds per training step (``step_overhead``) for a graph that trains, else 0."""
    return profile.step_overhead if trains(gm) else 0.0


def node_time(n: torch.fx.Node, mesh: Mesh, profile: HardwareProfile, rerun=frozenset()) -> tuple[float, float]:
    """(compute, communication) seconds of one node of an annotated graph, forward + backward: an op's
    :func:`op_time`, an inserted collective's redistribution (ZeRO-3's gather again in backward) or gradient sync
    (a reduce-scatter where the parameter is stored at ZeRO stage 2/3); for a node in ``rerun`` (the nodes backward
    runs again, :func:`rerun_nodes`) its forward once more: an op's :func:`forward_times`, a collective's
    :func:`redistribution_forward_time_of` (a gradient sync's forward is the identity). :func:`plan_cost` is their
    sum; the pipeline split prices its stages with it."""
    info = n.meta.get(M.COLLECTIVE)
    if info is not None:
        x = n.args[0]
        if info.kind == "grad_all_reduce":
            return 0.0, grad_sync_time(info.src, info.axes, x, mesh, profile) - _zero_sync_saving(x, info, mesh,
                                                                                                    profile)
        t = (redistribution_time(info.src, info.dst, x, mesh, profile) or 0.0) + _zero_regather_time(n, info, mesh,
                                                                                                     profile)
        if n in rerun:  # between the ops of a recomputed region: its forward runs again in backward
            t += redistribution_forward_time_of(info.src, info.dst, shape(x), itemsize(x), mesh, profile) or 0.0
        return 0.0, t
    if n.op != "call_function" or M.STRATEGY not in n.meta or is_getitem(n):
        return 0.0, 0.0
    t = op_time(n, n.meta[M.STRATEGY], mesh, profile)
    if n in rerun:
        # recomputed in backward: its forward runs twice (a region runs again whole, ops needing no gradient too)
        t += forward_times(n, [n.meta[M.STRATEGY]], mesh, profile)[0]
    return t, 0.0


@dataclass(frozen=True)
class PlanCost:
    #: seconds: compute + communication (forward + backward, recomputed forwards and the collectives among them, the
    #: share of gradient reductions a link does not hide) + the optimizer step + the profile's fixed step overhead
    step_time: float
    compute_time: float
    comm_time: float
    memory_per_rank: float  # bytes: parameters, gradients, optimizer state, saved activations
    parameter_bytes: float  # bytes of this rank's parameter shards
    comm_bytes: dict  # mesh axis -> bytes each rank sends per step (forward + backward, recomputed forwards)
    #: per-rank bytes by kind (parameters, gradients, optimizer, buffers, activations, gathered) and the step's
    #: peak (``memory_per_rank``): :class:`autoshard.cost_models.memory.MemoryBreakdown`
    memory: MemoryBreakdown | None = None
    optimizer_time: float = 0.0  # seconds of the optimizer step (the profile's optimizer_step)
    overhead_time: float = 0.0  # the profile's step_overhead


def plan_cost(gm: torch.fx.GraphModule, mesh: Mesh, profile: HardwareProfile, optimizer: str = "adam",
              compute_dtype: torch.dtype | None = None) -> PlanCost:
    """Evaluate an annotated global graph (after propagation and collective insertion). Memory per rank is the
    step's peak of :func:`autoshard.cost_models.memory.plan_memory` (ZeRO storage, mixed precision's
    ``compute_dtype`` copies, saved activations, gathered parameters)."""
    compute = comm = 0.0
    comm_bytes = {name: 0.0 for name in mesh.names}
    rerun = rerun_nodes(gm)
    opt = 0.0
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            opt += parameter_optimizer_time(n, mesh, profile, optimizer)
            continue
        info = n.meta.get(M.COLLECTIVE)
        if info is not None:
            again = info.bytes_forward if n in rerun else 0  # recomputed: its forward sends again
            for axis in info.axes:
                comm_bytes[axis] += (info.bytes_forward + info.bytes_backward + again) / len(info.axes)
        c, m = node_time(n, mesh, profile, rerun)
        compute += c
        comm += m
    breakdown = plan_memory(gm, mesh, optimizer, compute_dtype)
    fixed = step_overhead(gm, profile)
    return PlanCost(compute + comm + opt + fixed, compute, comm, breakdown.peak, breakdown.parameters, comm_bytes,
                    breakdown, opt, fixed)
