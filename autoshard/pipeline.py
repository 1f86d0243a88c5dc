"""Pipeline parallelism: the ``Pipeline`` options, the pipelined plan, and the per-rank runner.

    >>> mesh = autoshard.Mesh(pipe=2, data=2, model=2)
    >>> sm = autoshard.compile(model, mesh, example_inputs=(ids, labels),
    ...                        pipeline=autoshard.Pipeline(microbatches=8, schedule="1f1b", split="auto"))
    >>> sm.show()                   # stages, modules, time, memory, boundary tensors, imbalance, bubble
    >>> loss = sm(ids, labels)      # on each of the 8 processes: one training step (forward and backward)

How it is built (:func:`build_pipeline_plan`):

1. The example batch is cut to one *global microbatch* (``B / microbatches`` rows), and the model is traced and
   planned with the usual passes on the mesh *without* the pipe axis (the pipe axis is a pure pipeline axis:
   nothing is ever sharded on it, by construction rather than by hoping propagation leaves it alone). Local
   shapes inside the stages are then microbatch shapes.
2. :class:`~autoshard.passes.pipeline_split.PipelineSplit` cuts the annotated graph into ``pipe ×
   stages_per_rank`` stages balanced by the cost model; :func:`~autoshard.passes.pipeline_split.build_stage_graphs`
   makes one global GraphModule per stage, and :func:`autoshard.codegen.localize` gives each rank its stage's
   program for its (data, model) coordinates.
3. At run time (:class:`PipelineRunner`, :mod:`autoshard.runtime.pipeline`) each rank wraps its stage(s) in
   ``PipelineStage`` and runs ``ScheduleGPipe``/``Schedule1F1B`` (or the looped/interleaved ones when it holds
   several stages) over the process group of its pipe axis. Stage ``s`` lives on pipe coordinate ``s % pipe``.

Gradients. Inside a stage, the plan's collectives on the data/model axes run per microbatch as usual, except the
parameters' data-parallel all-reduce, which the runner does once per step after the last microbatch's backward
(one flat all-reduce per axes, :func:`autoshard.runtime.pipeline.sync_grads_once`). A parameter read by several
stages (a tied embedding and LM head) is held by each of them; after the backward its gradients are summed over
the pipe group (:func:`autoshard.runtime.pipeline.sum_shared_grads`), so every copy gets the full gradient and
stays equal to the others under any elementwise optimizer.

Loss scaling. Each microbatch's loss is the model's own loss on that microbatch (a mean over its rows, already
averaged over the data axis by the plan); the schedule sums the microbatch gradients and divides by
``microbatches``. The result equals the full-batch gradient exactly when the model's loss is a mean and the
microbatches are equal-sized (which :class:`Pipeline` enforces: ``microbatches`` must divide the batch); the
step's reported loss is the mean of the microbatch losses. A user ``loss_fn`` (applied on the last stage to
the model's output and the microbatch's ``target``) sees only this rank's rows when the output is sharded on the
data axis: it is divided by the data axis size, so that the data-axis gradient sum, and the reported loss summed
over the data axis, give the global mean. A loss with ``reduction="sum"`` or ignored labels
(``ignore_index``) unevenly spread over microbatches does not have this property.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch.utils import _pytree as pytree

from autoshard import meta as M
from autoshard.context import Context, Options
from autoshard.errors import MeshError, PlanError
from autoshard.mesh import Mesh
from autoshard.placements import Replicate, Shard, assemble, local_shape, shard_tensor

__all__ = [
    "Pipeline",
    "PipelinePlan",
    "PipelineRunner",
    "PipelinedModule",
    "bubble_fraction",
    "build_pipeline_plan",
]


@dataclass(frozen=True)
class Pipeline:
    """Pipeline options of ``autoshard.compile``.

    ``microbatches``: how many pieces the batch is cut into (must divide it); ``schedule``: ``"gpipe"``,
    ``"1f1b"`` or ``"interleaved"`` (1F1B over ``stages_per_rank`` > 1 stages per rank); ``split``: ``"auto"``
    or the module paths that start stages 1.. (``["transformer.h.2"]``); ``loss_fn(output, target)``: the loss
    of one microbatch (a mean), default the model's own loss (its output, ``.loss`` or first element);
    ``axis``: the mesh axis of the pipeline; ``profile``: the hardware profile that prices the split.
    """

    microbatches: int = 1
    schedule: str = "1f1b"
    split: str | tuple[str, ...] | list[str] = "auto"
    stages_per_rank: int = 1
    loss_fn: Callable | None = field(default=None, compare=False)
    axis: str = "pipe"
    profile: str = "cpu-gloo"

    @classmethod
    def parse(cls, text: str) -> Pipeline:
        """``"microbatches=8,schedule=1f1b,split=transformer.h.2+transformer.h.4"`` → ``Pipeline(...)`` (the CLI's
        ``--pipeline``; ``split`` is ``auto`` or module paths joined by ``+``)."""
        fields: dict = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            key, value = key.strip(), value.strip()
            if not sep or key not in ("microbatches", "schedule", "split", "stages_per_rank", "axis", "profile"):
                raise PlanError(f"pipeline options {text!r} have the part {part!r}, but each part is KEY=VALUE with "
                                "KEY one of microbatches, schedule, split, stages_per_rank, axis, profile.")
            if key in ("microbatches", "stages_per_rank"):
                if not value.isdigit():
                    raise PlanError(f"pipeline option {key} is {value!r}, but must be a positive integer.")
                fields[key] = int(value)
            elif key == "split" and value != "auto":
                fields[key] = tuple(v for v in value.split("+") if v)
            else:
                fields[key] = value
        return cls(**fields)

    def check(self, mesh: Mesh) -> None:
        from autoshard.runtime.pipeline import SCHEDULES

        if self.axis not in mesh.names:
            raise MeshError(f"mesh {mesh} has no axis `{self.axis}`, but the pipeline runs on it: add it, e.g. "
                            f"Mesh({self.axis}=2, ...), or pass Pipeline(axis=...).")
        if isinstance(self.microbatches, bool) or not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise PlanError(f"Pipeline has microbatches={self.microbatches!r}, but it must be a positive int.")
        if self.schedule not in SCHEDULES:
            raise PlanError(f"Pipeline has schedule={self.schedule!r}, but it must be one of {list(SCHEDULES)}.")
        if isinstance(self.stages_per_rank, bool) or not isinstance(self.stages_per_rank, int) or \
                self.stages_per_rank < 1:
            raise PlanError(f"Pipeline has stages_per_rank={self.stages_per_rank!r}, but it must be a positive int.")
        if self.schedule == "interleaved" and self.stages_per_rank < 2:
            raise PlanError("Pipeline has schedule='interleaved' with stages_per_rank=1, but interleaving needs "
                            "several stages per rank: pass stages_per_rank=2 (or more).")
        stages = mesh.axis_size(self.axis) * self.stages_per_rank
        if self.schedule != "gpipe" and self.microbatches < stages:
            # Schedule1F1B waits for warm-up microbatches that never come when there are fewer than stages.
            raise PlanError(f"Pipeline has {self.microbatches} microbatches for {stages} stages, but schedule "
                            f"{self.schedule!r} needs at least as many microbatches as stages: use "
                            f"microbatches >= {stages} or schedule='gpipe'.")
        if self.schedule == "interleaved" and self.microbatches % mesh.axis_size(self.axis):
            raise PlanError(f"Pipeline has {self.microbatches} microbatches, but the interleaved schedule needs a "
                            f"multiple of the pipe size {mesh.axis_size(self.axis)}.")


def bubble_fraction(stages: int, microbatches: int, virtual: int = 1) -> float:
    """The idle fraction of GPipe and 1F1B with ``stages`` equal ranks: (p - 1) / (m + p - 1); interleaved 1F1B
    with ``virtual`` stages per rank: (p - 1) / (v·m + p - 1)."""
    return (stages - 1) / (virtual * microbatches + stages - 1)


# ---- the plan ---------------------------------------------------------------------------------------------
@dataclass
class PipelinePlan:
    """The pipelined plan: one sharded plan of a global microbatch on the non-pipe axes, cut into stages."""

    plan: object  # autoshard.plan.Plan over ``submesh``
    mesh: Mesh
    submesh: Mesh
    pipeline: Pipeline
    split: object  # passes.pipeline_split.StageSplit
    stages: list  # passes.pipeline_split.StageGraph per stage
    batch: int  # global batch the plan was compiled for
    model_name: str = "model"

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
        to do once per step."""
        from autoshard.codegen import localize

        self.mesh._check_rank(rank)
        if not bucket_grads:
            return localize(self.stages[stage].gm, self.submesh, self.sub_rank(rank))
        return localize(self.stages[stage].gm, self.submesh, self.sub_rank(rank), bucket_grads=True,
                        defer_outputs=False)  # stage outputs are sent or fed to the schedule's loss

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
        from autoshard.trace import fetch_attr

        return isinstance(fetch_attr(self.plan.graph_module, target), torch.nn.Parameter)

    def param_specs(self):
        return self.plan.param_specs()

    # ---- inputs and gradients -----------------------------------------------------------------------------
    def input_names(self) -> list[str]:
        return [n.name for n in self.plan.graph_module.graph.nodes if n.op == "placeholder"]

    def shard_batch(self, rank: int, args=(), kwargs=None) -> dict[str, object]:
        """``rank``'s inputs for one step, by placeholder name: each microbatch (``batch / microbatches`` rows)
        is sharded like the plan's inputs on the non-pipe axes, and the pieces are concatenated again so that
        the schedule's chunking along dim 0 gives this rank its share of each microbatch."""
        from torch.fx._pytree import tree_flatten_spec

        gm = self.plan.graph_module
        leaves = tree_flatten_spec((tuple(args), dict(kwargs or {})), gm._in_spec)
        holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        return {h.name: self.shard_microbatches(x, h.meta[M.SPEC], rank) if isinstance(x, torch.Tensor) else x
                for x, h in zip(leaves, holders)}

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
    def format(self) -> str:
        from autoshard.report import format_stages

        return format_stages(self)

    def show(self, console=None) -> None:
        text = self.format()
        if console is None:
            print(text, end="")
        else:
            console.print(text, markup=False, highlight=False)

    def stage_memory(self, stage: int, rank: int = 0) -> int:
        """Estimated bytes on a rank for stage ``stage``: parameters + gradients + Adam state, plus the
        activations of the microbatches in flight (all of them for GPipe, ``stages - stage`` for 1F1B)."""
        from autoshard.cost_models.memory import activation_bytes, training_state_bytes

        gm = self.stages[stage].gm
        self.mesh._check_rank(rank)
        state = acts = 0
        for n in gm.graph.nodes:
            val = n.meta.get("val")
            if n.op == "get_attr" and isinstance(val, torch.Tensor) and isinstance(val, torch.nn.Parameter):
                numel = 1
                for s in local_shape(val.shape, n.meta[M.SPEC], self.submesh):
                    numel *= s
                state += training_state_bytes(numel, val.dtype)
            elif n.op == "call_function":
                with contextlib.suppress(Exception):  # an estimate: ops the memory model cannot price count 0
                    acts += activation_bytes(n)
        flight = self.pipeline.microbatches if self.pipeline.schedule == "gpipe" else \
            min(self.pipeline.microbatches, self.num_stages - stage)
        shard = max(1, self.submesh.size)
        return state + flight * acts // shard


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
                        pipeline: Pipeline) -> PipelinePlan:
    from autoshard import plan as plan_module
    from autoshard.passes.pipeline_split import REPORT_KEY, PipelineSplit, build_stage_graphs
    from autoshard.plan import _TRACE_LOCK, Plan, run_passes
    from autoshard.trace import trace

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
    sub_options = _strip_axis(options, mesh, pipeline.axis)
    with _TRACE_LOCK:
        gm = trace(model, margs, mkwargs)
    ctx = Context(sub, sub_options)
    stages = mesh.axis_size(pipeline.axis) * pipeline.stages_per_rank
    split = tuple(pipeline.split) if not isinstance(pipeline.split, str) else pipeline.split
    # the sharding passes the options ask for (the planner's search, when chosen), then the split
    passes = plan_module.pipeline(sub_options) if hasattr(plan_module, "pipeline") else plan_module.PIPELINE
    gm = run_passes(gm, ctx, (*passes, PipelineSplit(stages, split, pipeline.profile, pipeline.axis)))
    stage_split = ctx.report[REPORT_KEY]
    plan = Plan(gm, sub, ctx, type(model).__name__)
    return PipelinePlan(plan, mesh, sub, pipeline, stage_split, build_stage_graphs(gm, stage_split), batch,
                        type(model).__name__)


# ---- running ----------------------------------------------------------------------------------------------
class PipelineRunner:
    """This process's part of a pipelined plan: its stage module(s), ``PipelineStage``(s) and the schedule.

    ``step(*args, target=None, **kwargs)`` runs one forward+backward over the whole (global) batch and returns the
    loss on every rank; gradients are left in ``parameters()`` (summed over the stages for tied weights).
    ``sync_once`` (default): the parameters' data-parallel gradient all-reduce runs once per step, after the last
    microbatch's backward (:func:`autoshard.runtime.pipeline.sync_grads_once`), not once per microbatch."""

    def __init__(self, pplan: PipelinePlan, rank: int | None = None, comm=None, timeout: float = 300.0,
                 sync_once: bool = True):
        import torch.distributed as dist

        from autoshard.plan import loss_of
        from autoshard.runtime import pipeline as rt
        from autoshard.runtime.dist import DistCommunicator

        if comm is None:
            if not (dist.is_available() and dist.is_initialized()):
                raise MeshError(f"a pipelined plan on {pplan.mesh} runs under torch.distributed, but it is not "
                                "initialised: launch with torchrun (and init_process_group) or "
                                "autoshard.runtime.launch.spawn.")
            comm = DistCommunicator(pplan.mesh, timeout=timeout)
        self.comm = comm
        self.plan = pplan
        self.sync_once = sync_once
        self.rank = comm.rank if rank is None else rank
        self.group = comm.process_group(pplan.pipeline.axis)
        p = pplan.pipeline
        self.modules: list = []
        stages = []
        for s in pplan.stages_of(self.rank):
            module = rt.StageModule(pplan.stage_module(s, self.rank, bucket_grads=sync_once), pplan.stages[s].inputs)
            self.modules.append(module)
            stages.append(rt.make_stage(module, s, pplan.num_stages, pplan.act_meta(s, self.rank, "acts"),
                                        pplan.act_meta(s, self.rank, "outputs"), self.group))
        self.is_last = pplan.num_stages - 1 in pplan.stages_of(self.rank)
        out_spec = getattr(pplan.plan.graph_module, "_out_spec", None)
        loss_fn = rt.model_loss(out_spec, p.loss_fn, loss_of)
        # A user loss_fn sees this rank's rows of a batch-sharded output: its mean over them, divided by the data
        # axis size, summed over the data axis (the gradient sync and the reported loss) is the global mean.
        self.data_axis, self.loss_shards = _output_data_shards(pplan) if p.loss_fn is not None else (None, 1)
        if self.loss_shards > 1:
            loss_fn = _scaled(loss_fn, self.loss_shards)
        self.schedule = rt.build_schedule(stages, p.schedule, p.microbatches, loss_fn)
        specs = pplan.param_specs()
        self.shared = [(fqn, tuple(local_shape(_val(pplan, fqn).shape, specs[fqn], pplan.submesh)),
                        _val(pplan, fqn).dtype) for fqn, _ in pplan.shared_params()]

    def parameters(self):
        for m in self.modules:
            yield from m.parameters()

    def named_parameters(self):
        """``(fqn, parameter)`` of this rank's stage(s); a tied weight appears once per stage holding it."""
        for m in self.modules:
            yield from m.inner.named_parameters()

    def step(self, *args, target=None, **kwargs) -> torch.Tensor:
        from autoshard.runtime import pipeline as rt
        from autoshard.runtime.comm import use

        inputs = self.plan.shard_batch(self.rank, args, kwargs)
        inputs = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
        if target is not None:
            sub = self.plan.submesh
            spec = tuple(Shard(0) if n == self.data_axis else Replicate() for n in sub.names)
            target = self.plan.shard_microbatches(target, spec, self.rank)
        if target is None and self.is_last:
            # The schedule wants a target on the last stage even when the model computes its own loss.
            rows = next(iter(v.shape[0] for v in inputs.values() if v.dim() >= 1))
            target = torch.zeros(rows)
        losses: list = []
        with use(self.comm):
            if self.is_last:
                self.schedule.step(target=target, losses=losses, return_outputs=False, **inputs)
            else:
                self.schedule.step(return_outputs=False, **inputs)
            if self.sync_once:
                rt.sync_grads_once(self.modules, self.comm)
            rt.sum_shared_grads(self.modules, self.shared, self.group)
        last = (self.plan.num_stages - 1) % self.plan.pipe
        loss = rt.broadcast_loss(losses, self.is_last, last, self.group)
        if self.loss_shards > 1:
            loss = self.comm.all_reduce(loss.reshape(1), self.data_axis).reshape(())
        return loss

    def grads(self) -> dict[str, torch.Tensor]:
        return {n: p.grad for n, p in self.named_parameters() if p.grad is not None}


def _output_data_shards(pplan: PipelinePlan) -> tuple[str | None, int]:
    """(data axis, its size) when the model's first output leaves the plan sharded on dim 0 over the data axis."""
    axis = pplan.plan.context.options.data_axis
    out = next(n for n in pplan.plan.graph_module.graph.nodes if n.op == "output")
    first = next((x for x in pytree.tree_leaves(out.args) if isinstance(x, torch.fx.Node)), None)
    if first is None or axis not in pplan.submesh.names:
        return None, 1
    want = out.meta.get(M.STRATEGY)
    spec = want.input_specs[0] if want is not None and want.input_specs else first.meta.get(M.SPEC)
    p = spec[pplan.submesh.index(axis)] if spec else None
    if isinstance(p, Shard) and p.dim == 0:
        return axis, pplan.submesh.axis_size(axis)
    return None, 1


def _scaled(fn: Callable, n: int) -> Callable:
    def scaled(output, target):
        return fn(output, target) / n

    return scaled


def _val(pplan: PipelinePlan, fqn: str) -> torch.Tensor:
    from autoshard.trace import fetch_attr

    return fetch_attr(pplan.plan.graph_module, fqn)


class PipelinedModule(torch.nn.Module):
    """What ``autoshard.compile(..., pipeline=...)`` returns: the plan (``show``, ``code``, ``format``) and, once
    called in a process group, this rank's runner. Calling it runs one training step (forward *and* backward,
    as pipeline schedules interleave them) and returns the loss."""

    def __init__(self, model, mesh: Mesh, options: Options, example_inputs, example_kwargs, pipeline: Pipeline,
                 comm=None, timeout: float = 300.0):
        super().__init__()
        if example_inputs is None and example_kwargs is None:
            raise PlanError("a pipelined compile needs example_inputs= (the global batch): the split and the "
                            "microbatch shapes are decided ahead of time.")
        args = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
        self.mesh = mesh
        self.plan = build_pipeline_plan(model, mesh, tuple(args or ()), example_kwargs, options, pipeline)
        self._comm = comm
        self._timeout = timeout
        self._runner: PipelineRunner | None = None

    def show(self, console=None) -> None:
        self.plan.show(console)

    def format(self) -> str:
        return self.plan.format()

    def code(self, rank: int = 0, stage: int | None = None) -> str:
        return self.plan.code(rank, stage)

    def runner(self) -> PipelineRunner:
        if self._runner is None:
            self._runner = PipelineRunner(self.plan, comm=self._comm, timeout=self._timeout)
        return self._runner

    def parameters(self, recurse: bool = True):
        return self.runner().parameters()

    def named_parameters(self, *a, **k):
        return self.runner().named_parameters()

    def forward(self, *args, target=None, **kwargs):
        return self.runner().step(*args, target=target, **kwargs)
