"""The pipelined plan: one sharded plan of a global microbatch on the non-pipe axes, cut into stages
(:func:`build_pipeline_plan`), and each rank's stage programs.

The plan is :func:`autoshard.compiler.plan.build_plan`'s, with the ``pipeline_split`` and ``build_stages`` passes of the
one pass list enabled: the split and the stage graphs are results of the list (``gm.meta``), verified by its driver,
and a stage program is made by the plan's one checked path, :meth:`autoshard.compiler.plan.Plan.rank_program` with
``stage=`` (the stage's programs on every rank issue the same collectives, or it raises).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch.utils import _pytree as pytree

from autoshard import meta as M
from autoshard.compiler.context import Options
from autoshard.errors import PlanError
from autoshard.mesh import Mesh
from autoshard.compiler.pipeline.options import Pipeline
from autoshard.placements import Replicate, assemble, local_shape, shard_tensor


#: how often a pipelined plan whose largest rank is over the memory limit is searched again (for a lower limit)
STAGE_REPLANS = 2


@dataclass(frozen=True)
class PipelineCost:
    """A pipelined plan's estimated step (:meth:`PipelinePlan.cost`), in seconds."""

    step_time: float  # the slowest rank's step
    microbatch: tuple[float, ...]  # per stage: seconds per microbatch (its nodes, forward + backward, and transfers)
    once: tuple[float, ...]  # per stage: seconds once per step (gradient syncs left to the runner, optimizer steps)
    ranks: tuple[float, ...]  # per rank: its step
    bubble: float  # the schedule's idle fraction
    overhead: float  # the profile's fixed seconds per step


@dataclass(frozen=True)
class StageTensor:
    """One tensor of a stage's program (:meth:`PipelinePlan.stage_tensors`)."""

    target: str  # the program's attribute
    aliases: tuple[str, ...]  # every name it has in the model (a tied weight has several), the first its own
    spec: tuple  # stored spec on the submesh (the non-pipe axes)
    shape: tuple[int, ...]  # global shape
    dtype: torch.dtype
    is_param: bool


@dataclass
class PipelinePlan:
    """The pipelined plan: one sharded plan of a global microbatch on the non-pipe axes, cut into stages."""

    microbatch_plan: object  # autoshard.compiler.plan.Plan of one global microbatch over ``submesh``
    mesh: Mesh
    submesh: Mesh
    pipeline: Pipeline
    split: object  # passes.pipeline_split.StageSplit
    stages: list  # passes.pipeline_split.StageGraph per stage
    batch: int  # global batch the plan was compiled for
    model_name: str = "model"
    #: the global example inputs it was planned for, ``(args, kwargs)`` (the microbatch plan holds one microbatch)
    examples: tuple = ((), {})

    # ---- coordinates ------------------------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def pipe(self) -> int:
        return self.mesh.axis_size(self.pipeline.axis)

    def sub_rank(self, rank: int) -> int:
        """The rank's coordinate on the non-pipe axes, as a rank of ``submesh``."""
        c = self.mesh.coords(rank)
        if self.submesh.names == ("stage",) and "stage" not in self.mesh.names:
            return 0
        return self.submesh.rank_of({n: c[n] for n in self.submesh.names})

    def stages_of(self, rank: int) -> list[int]:
        c = self.mesh.coords(rank)[self.pipeline.axis]
        return [c + self.pipe * j for j in range(self.pipeline.stages_per_rank)]

    # ---- programs -----------------------------------------------------------------------------------------
    def stage_module(self, stage: int, rank: int, bucket_grads: bool = False) -> torch.fx.GraphModule:
        """Rank ``rank``'s program of stage ``stage`` (its shard of the stage's parameters). ``bucket_grads``: leave
        the parameters' data-parallel gradient sync out of the program (listed in ``module.meta``) for the runner
        to do once per step. Made by the plan's one checked path (:meth:`autoshard.compiler.plan.Plan.rank_program`):
        the stage's programs on every rank issue the same collectives."""
        self.mesh._check_rank(rank)
        return self.microbatch_plan.rank_program(self.sub_rank(rank), bucket_grads=bucket_grads, stage=stage,
                                                 check_inputs=False)

    def code(self, rank: int = 0, stage: int | None = None) -> str:
        stage = self.stages_of(rank)[0] if stage is None else stage
        return self.stage_module(stage, rank).code.strip() + "\n"

    def act_meta(self, stage: int, rank: int, which: str = "acts") -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(local shape, dtype) of the activations stage ``stage`` receives (``"acts"``) or sends (``"outputs"``)."""
        sg = self.stages[stage]
        nodes = {n.name: n for n in sg.gm.graph.nodes}
        out_node = next(n for n in sg.gm.graph.nodes if n.op == "output")
        if which == "acts":
            vals = [nodes[name] for name in sg.acts]
        else:
            vals = [x for x in out_node.args[0] if isinstance(x, torch.fx.Node)]
        self.mesh._check_rank(rank)  # shards are even: every rank of a stage has the same local shapes
        return [(tuple(local_shape(v.meta["val"].shape, v.meta[M.SPEC], self.submesh)), v.meta["val"].dtype)
                for v in vals]

    def shared_params(self) -> list[tuple[str, tuple[int, ...]]]:
        """Parameters held by more than one stage (tied weights), with their stages."""
        holders: dict[str, list[int]] = {}
        for sg in self.stages:
            for p in sg.params:
                holders.setdefault(p, []).append(sg.index)
        return [(p, tuple(s)) for p, s in holders.items() if len(s) > 1 and self._is_param(p)]

    def _is_param(self, target: str) -> bool:
        from autoshard.frontend.trace import fetch_attr

        return isinstance(fetch_attr(self.microbatch_plan.graph_module, target), torch.nn.Parameter)

    def param_specs(self):
        """{program attribute: stored spec} (stage programs name parameters by attribute)."""
        from autoshard.compiler.rank_programs import param_specs_of

        return param_specs_of(self.microbatch_plan.graph_module)

    # ---- the model's tensors by stage ------------------------------------------------------------------------
    def stage_tensors(self, stage: int) -> list[StageTensor]:
        """Every tensor stage ``stage``'s program holds (its parameters and the buffers it reads), in graph order:
        program attribute, every name the tensor has in the model, stored spec on ``submesh``, global shape, dtype."""
        out = []
        for n in self.stages[stage].gm.graph.nodes:
            val = n.meta.get("val")
            if n.op != "get_attr" or not isinstance(val, torch.Tensor):
                continue
            held = _attr(self.stages[stage].gm, str(n.target))
            out.append(StageTensor(str(n.target), tuple(n.meta.get(M.ALIASES, (str(n.target),))), n.meta[M.SPEC],
                                   tuple(val.shape), held.dtype if isinstance(held, torch.Tensor) else val.dtype,
                                   isinstance(held, torch.nn.Parameter)))
        return out

    def pipe_coordinate(self, stage: int) -> int:
        """The coordinate on the pipe axis of the ranks that hold stage ``stage``."""
        return stage % self.pipe

    def mesh_spec(self, spec) -> tuple:
        """A spec on ``submesh`` as one on the whole mesh: ``Replicate()`` on the pipe axis (a stage's tensor is
        whole along it: every pipe coordinate holding that stage has it all)."""
        by_axis = dict(zip(self.submesh.names, spec or ()))
        return tuple(Replicate() if name == self.pipeline.axis else by_axis.get(name, Replicate())
                     for name in self.mesh.names)

    def mode_dependent(self) -> list[str]:
        """Where the traced program computes something else in the other training mode: dropout with ``p > 0`` and
        batch norms (statistics of the batch in training, running statistics in eval), as node locations."""
        from autoshard.frontend.graph_utils import node_location

        aten = torch.ops.aten
        dropouts = {aten.dropout, aten.native_dropout, aten.feature_dropout, aten.alpha_dropout}
        norms = {aten.batch_norm, aten.native_batch_norm, aten._native_batch_norm_legit,
                 aten._native_batch_norm_legit_functional, aten.cudnn_batch_norm,
                 aten._native_batch_norm_legit_no_training}
        out = []
        for n in self.microbatch_plan.graph_module.graph.nodes:
            packet = getattr(n.target, "overloadpacket", None) if n.op == "call_function" else None
            if packet in dropouts and len(n.args) > 1 and n.args[1]:
                out.append(node_location(n))
            elif packet in norms:
                out.append(node_location(n))
        return out

    def bind_weights(self, model: torch.nn.Module) -> None:
        """Give the plan's graphs (the microbatch plan's and every stage's) ``model``'s own tensors, by the names
        the model gives them: stage programs made afterwards take their slices of ``model``."""
        from torch.fx.graph_module import _assign_attr

        state = dict(model.named_parameters(remove_duplicate=False))
        state.update(model.named_buffers(remove_duplicate=False))
        for gm in (self.microbatch_plan.graph_module, *(sg.gm for sg in self.stages)):
            for n in gm.graph.nodes:
                if n.op != "get_attr":
                    continue
                name = next((a for a in n.meta.get(M.ALIASES, (str(n.target),)) if a in state), None)
                if name is not None:
                    _assign_attr(state[name], gm, str(n.target))

    def release_weights(self) -> None:
        """Replace every tensor the plan's graphs hold (the microbatch plan's and every stage's) by a meta tensor
        of the same shape and dtype, tied tensors still one: the plan keeps nothing of the model alive (a rank
        whose stage programs are made needs no full weight again; programs made later hold meta tensors)."""
        metas: dict[int, torch.Tensor] = {}
        for gm in (self.microbatch_plan.graph_module, *(sg.gm for sg in self.stages)):
            for module in gm.modules():
                for table in (module._parameters, module._buffers):
                    for name, t in list(table.items()):
                        if t is None or t.is_meta:
                            continue
                        if id(t) not in metas:
                            meta = torch.empty_like(t, device="meta")
                            metas[id(t)] = torch.nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(
                                t, torch.nn.Parameter) else meta
                        table[name] = metas[id(t)]
                for name, t in list(vars(module).items()):  # plain tensor attributes (constants)
                    if isinstance(t, torch.Tensor) and not t.is_meta:
                        setattr(module, name, torch.empty_like(t, device="meta"))

    # ---- inputs and gradients -----------------------------------------------------------------------------
    def input_names(self) -> list[str]:
        return [n.name for n in self.microbatch_plan.graph_module.graph.nodes if n.op == "placeholder"]

    def shard_batch(self, rank: int, args=(), kwargs=None) -> dict[str, object]:
        """``rank``'s inputs for one step, by placeholder name: each microbatch (``batch / microbatches`` rows)
        is sharded like the plan's inputs on the non-pipe axes, and the pieces are concatenated again so that
        the schedule's chunking along dim 0 gives this rank its share of each microbatch."""
        from torch.fx._pytree import tree_flatten_spec

        gm = self.microbatch_plan.graph_module
        leaves = tree_flatten_spec((tuple(args), dict(kwargs or {})), gm._in_spec)
        holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        return {h.name: self.shard_microbatches(x, h.meta[M.SPEC], rank) if isinstance(x, torch.Tensor) else x
                for x, h in zip(leaves, holders)}

    def expected_inputs(self) -> list:
        """The tensor inputs of one step (:class:`autoshard.frontend.inputs.ExpectedInput`): the microbatch plan's, with
        the rows of every input cut into microbatches (dim 0 of ``batch / microbatches``) put back."""
        import dataclasses

        from autoshard.frontend.inputs import expected_inputs

        m, rows = self.pipeline.microbatches, self.batch // self.pipeline.microbatches

        def whole(shape):
            return (shape[0] * m, *shape[1:]) if len(shape) >= 1 and shape[0] == rows else shape

        return [dataclasses.replace(e, global_shape=whole(e.global_shape),
                                    local_shape=(e.local_shape[0] * m, *e.local_shape[1:])
                                    if whole(e.global_shape) != e.global_shape else e.local_shape)
                for e in expected_inputs(self.microbatch_plan.graph_module, self.submesh)]

    def shard_microbatches(self, x: torch.Tensor, spec, rank: int) -> torch.Tensor:
        m = self.pipeline.microbatches
        if x.dim() == 0 or x.shape[0] % m:
            raise PlanError(f"pipeline input has batch size {x.shape[0] if x.dim() else 'none'}, but "
                            f"{m} microbatches must divide it: use a batch that is a multiple of {m}.")
        sub = self.sub_rank(rank)
        return torch.cat([shard_tensor(mb, spec, self.submesh, sub) for mb in x.chunk(m, 0)], 0)

    def assemble_grads(self, per_rank: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Full gradients from every rank's ``{fqn: local grad}`` (each rank's stages), by the plan's specs."""
        specs = self.param_specs()
        out = {}
        for fqn, spec in specs.items():
            for s in range(self.num_stages):
                ranks = [r for r in range(self.mesh.size) if s in self.stages_of(r)]
                pieces = [per_rank[r].get(fqn) for r in sorted(ranks, key=self.sub_rank)]
                if all(p is not None for p in pieces) and pieces:
                    out[fqn] = assemble(pieces, spec, self.submesh)
                    break
        return out

    # ---- report -------------------------------------------------------------------------------------------
    def cost(self) -> PipelineCost:
        """The estimated step (:class:`PipelineCost`), from the stages the split priced as ``plan.cost()`` prices the
        microbatch plan's nodes (:func:`autoshard.cost_models.plan_cost.node_time`): each rank runs its stages'
        microbatches in the schedule's time, ``microbatches × Σ its stages' seconds per microbatch / (1 − bubble)``,
        then once per step its stages' gradient syncs and optimizer steps and the profile's step overhead; the step
        is the slowest rank's. What ``format``, ``autoshard show --pipeline`` and its ``--json`` print."""
        from autoshard.cost_models.plan_cost import step_overhead
        from autoshard.cost_models.profile import HardwareProfile, load_profile
        from autoshard.compiler.pipeline.options import bubble_fraction

        split, p = self.split, self.pipeline
        name = p.profile or self.microbatch_plan.context.options.profile
        profile = name if isinstance(name, HardwareProfile) else load_profile(name)
        v = p.stages_per_rank if p.schedule == "interleaved" else 1
        bubble = bubble_fraction(self.pipe, p.microbatches, v)
        once = split.once or (0.0,) * split.stages
        overhead = step_overhead(self.microbatch_plan.graph_module, profile)
        ranks = tuple(sum(split.costs[s] for s in self.stages_of(r)) * p.microbatches / (1 - bubble)
                      + sum(once[s] for s in self.stages_of(r)) + overhead for r in range(self.mesh.size))
        return PipelineCost(max(ranks), tuple(split.costs), tuple(once), ranks, bubble, overhead)

    def format(self) -> str:
        from autoshard.compiler.report import format_stages

        return format_stages(self)

    def show(self, console=None) -> None:
        text = self.format()
        if console is None:
            print(text, end="")
        else:
            console.print(text, markup=False, highlight=False)

    def rank_memory(self, rank: int) -> int:
        """Estimated peak bytes on ``rank``: the sum of :meth:`stage_memory` over the stages it runs (one, or
        ``stages_per_rank`` interleaved: each stage's parameters, state and microbatches in flight are all held by
        the rank at once; the sum of the stages' peaks bounds the rank's)."""
        return sum(self.stage_memory(s, rank) for s in self.stages_of(rank))

    def memory_per_rank(self) -> int:
        """The largest :meth:`rank_memory` over the ranks (each pipe coordinate's first rank: shards are even, so
        every rank of a pipe coordinate holds the same bytes): what must fit a device."""
        firsts = {self.mesh.coords(r)[self.pipeline.axis]: r for r in reversed(range(self.mesh.size))}
        return max(self.rank_memory(r) for r in firsts.values())

    def save(self, path) -> None:
        """Write this pipelined plan to ``path`` (:mod:`autoshard.compiler.plan_file`'s format, with the pipeline's
        options and its stage split beside the microbatch plan's decisions); ``autoshard.load_plan(path, model,
        example_inputs)`` makes it again on any rank without searching. A ``loss_fn`` is code, not data: the file
        records that there was one, and ``load_plan`` must be given it again (``loss_fn=``)."""
        from autoshard.compiler.plan_file import write_plan_file

        write_plan_file(self, path)

    def stage_memory(self, stage: int, rank: int = 0) -> int:
        """Estimated peak bytes on a rank for stage ``stage`` (:func:`autoshard.cost_models.memory.plan_memory` of
        the stage's graph on the non-pipe axes, with the plan's optimizer and mixed precision, as the schedule runs
        it): its parameters, gradients and optimizer state, the saved activations and stage outputs of the
        microbatches in flight at once (all of them for GPipe, ``stages - stage`` for 1F1B) — with every gradient
        once a microbatch's backward is done (1F1B's steady state) —, the runner's once-per-step gradient sync,
        and the receive buffers ``torch.distributed.pipelining`` keeps, one per microbatch."""
        return self.stage_breakdown(stage, rank).peak

    def stage_breakdown(self, stage: int, rank: int = 0):
        """:class:`autoshard.cost_models.memory.MemoryBreakdown` of stage ``stage`` on ``rank`` (see
        :meth:`stage_memory`): of the schedule's backward that peaks higher — the first (``flight`` microbatches
        forwarded, no gradient yet) or a later one (every gradient made; 1F1B keeps ``flight`` microbatches in
        flight while more remain, GPipe and 1F1B's cool-down one fewer)."""
        import math

        from autoshard.compiler.pipeline.options import microbatches_in_flight
        from autoshard.cost_models.memory import plan_memory

        self.mesh._check_rank(rank)  # shards are even: every rank of a stage holds the same bytes
        if not 0 <= stage < self.num_stages:
            raise PlanError(f"stage_memory has stage={stage}, but the pipeline has stages 0..{self.num_stages - 1}.")
        m = self.pipeline.microbatches
        flight, later = microbatches_in_flight(self.pipeline.schedule, m, self.num_stages, stage)
        options = self.microbatch_plan.context.options
        precision = options.precision

        def price(in_flight: int, accumulating: bool):
            return plan_memory(self.stages[stage].gm, self.submesh, options.optimizer,
                               precision.param_dtype if precision is not None else None, in_flight=in_flight,
                               accumulating=accumulating, keeps_outputs=True, sync_once=True)

        cases = [price(flight, False)]
        if later >= 1:
            cases.append(price(later, True))
        worst = max(cases, key=lambda b: b.peak)
        # the receive buffers of every microbatch, allocated once: the activations this stage receives, and the
        # gradients of the (floating) activations it sends
        nbytes = 0
        if stage > 0:
            nbytes += sum(math.prod(s) * d.itemsize for s, d in self.act_meta(stage, rank, "acts"))
        if stage < self.num_stages - 1:
            nbytes += sum(math.prod(s) * d.itemsize for s, d in self.act_meta(stage, rank, "outputs")
                          if d.is_floating_point)
        return replace(worst, buffers=worst.buffers + m * nbytes,
                       between=tuple(x + m * nbytes for x in worst.between))


def _attr(module: torch.nn.Module, target: str):
    obj = module
    for part in target.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _submesh(mesh: Mesh, axis: str) -> Mesh:
    rest = tuple((n, s) for n, s in mesh.axes if n != axis)
    # A mesh needs an axis; a size-1 axis never gets sharded (strategies replicate on size 1), so no collective
    # of the stage programs ever names it.
    return Mesh(rest) if rest else Mesh(stage=1)


def _strip_axis(options: Options, mesh: Mesh, axis: str) -> Options:
    i = mesh.index(axis)
    annotations = []
    for pattern, spec in options.annotations:
        if len(spec) != mesh.ndim:
            raise PlanError(f"annotation {pattern!r} has {len(spec)} placements, but mesh {mesh} has {mesh.ndim} "
                            f"axes {list(mesh.names)}: give one per axis.")
        if not isinstance(spec[i], Replicate):
            raise PlanError(f"annotation {pattern!r} places {spec[i]} on the pipeline axis `{axis}`, but nothing "
                            "is sharded on the pipeline axis: use Replicate() there.")
        rest = tuple(p for a, p in enumerate(spec) if a != i)
        annotations.append((pattern, rest or (Replicate(),)))
    return replace(options, annotations=tuple(annotations))


def _microbatch_examples(args, kwargs, m: int):
    leaves = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor) and x.dim() >= 1]
    if not leaves:
        raise PlanError("pipeline needs example inputs with a batch dimension (dim 0) to cut into microbatches.")
    batch = leaves[0].shape[0]
    if batch % m:
        raise PlanError(f"example batch has {batch} rows, but Pipeline(microbatches={m}) must divide it: use a "
                        f"batch that is a multiple of {m}, or another number of microbatches.")

    def cut(x):
        if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == batch:
            return x[: batch // m]
        return x

    return pytree.tree_map(cut, tuple(args)), pytree.tree_map(cut, dict(kwargs or {})), batch


def build_pipeline_plan(model: torch.nn.Module, mesh: Mesh, args: tuple, kwargs: dict | None, options: Options,
                        pipeline: Pipeline, once=None, submesh_options: bool = False) -> PipelinePlan:
    """The pipelined plan of ``model`` on ``mesh`` (see the module docstring). ``once``: as
    :func:`autoshard.compiler.plan.build_plan`'s (a plan file's decisions replayed). ``submesh_options``: ``options``
    are already those of the mesh without the pipe axis (a plan file's: the microbatch plan's own options)."""
    from autoshard.passes.manager import PipelineOptions
    from autoshard.passes.pipeline_split import stage_graphs_of, stage_split_of
    from autoshard.compiler.plan import build_plan

    if not isinstance(pipeline, Pipeline):
        raise PlanError(f"pipeline= has type {type(pipeline).__name__}, but must be autoshard.Pipeline(...).")
    pipeline.check(mesh)
    margs, mkwargs, batch = _microbatch_examples(args, kwargs, pipeline.microbatches)
    sub = _submesh(mesh, pipeline.axis)
    if options.data_axis in sub.names:
        d = sub.axis_size(options.data_axis)
        mb = batch // pipeline.microbatches
        if mb % d:
            raise PlanError(f"a microbatch has {mb} rows (batch {batch} / {pipeline.microbatches} microbatches), "
                            f"but the data axis `{options.data_axis}` of size {d} must divide it: use a batch that "
                            f"is a multiple of {pipeline.microbatches * d}.")
    stages = mesh.axis_size(pipeline.axis) * pipeline.stages_per_rank
    split = tuple(pipeline.split) if not isinstance(pipeline.split, str) else pipeline.split
    # the plan phase of the one pass list, with the pipeline split and the stage graphs enabled
    planned = options if submesh_options else _strip_axis(options, mesh, pipeline.axis)
    limit = planned.memory_limit
    for attempt in range(1 + STAGE_REPLANS):
        plan = build_plan(model, sub, margs, mkwargs, planned,
                          pipeline=PipelineOptions(stages, split, pipeline.profile or options.profile, pipeline.axis,
                                                   pipeline.microbatches, pipeline.schedule,
                                                   pipeline.stages_per_rank),
                          once=once)
        gm = plan.graph_module
        out = PipelinePlan(plan, mesh, sub, pipeline, stage_split_of(gm), list(stage_graphs_of(gm)), batch,
                           type(model).__name__, (tuple(args), dict(kwargs or {})))
        # the search bounds each stage (one per rank) by its own count, a little under stage_memory's (values a
        # stage's graph makes again, which the whole graph makes once): where the largest rank is over the limit,
        # search again for a limit smaller in proportion, as build_plan does for a whole plan
        if limit is None or once is not None or pipeline.stages_per_rank != 1 or attempt == STAGE_REPLANS:
            break
        peak = out.memory_per_rank()
        if peak <= limit:
            break
        planned = replace(planned, memory_limit=planned.memory_limit * limit / peak * (1 - 1e-3))
    return out


