"""Running a pipelined plan: this process's :class:`PipelineRunner` (its stages and schedule, over
:mod:`autoshard.runtime.pipeline`), and :class:`PipelinedModule`, what ``autoshard.compile(..., pipeline=...)``
returns.

A :class:`PipelinedModule` is a module of the same kind as a :class:`~autoshard.ShardedModule`, for this rank's
stage(s): ``named_parameters()``, ``state_dict()``, ``load_state_dict()``, ``init_weights()`` (a model built on
the meta device), ``autoshard.save``/``autoshard.load`` (DCP) and ``train()``/``eval()`` work on it, by the model's
own names. What differs is the call: a pipeline schedule interleaves forward and backward of the microbatches, so
a pipelined module has no forward of its own; :meth:`PipelinedModule.step` runs one schedule over the global batch
(``torch.distributed.pipelining``'s ``Schedule*.step(*args, target=..., losses=..., **kwargs)``), and calling the
module is the same step.

Parameters. This rank holds the parameters of its stage(s) only, as ``torch.distributed.pipelining`` stage modules
do: the others are absent from its ``named_parameters()`` and ``state_dict()``. Each is a ``DTensor`` on the
stage's DeviceMesh (the mesh's non-pipe axes through this rank), placed as the plan stores it, with its global
shape, under the model's name; a weight tied across stages (an embedding and its LM head) is in the tree of every
stage holding it, under each of its names, and its copies are kept equal (their gradients are summed over the pipe
axis). On a mesh whose only axis is ``pipe`` a stage's tensors are whole: plain tensors.

Checkpoints. :func:`autoshard.save` writes each stage's tensors under their model names with their global layout
(a DTensor over the whole mesh, ``Replicate()`` on the pipe axis), so the checkpoint is the same as one saved from
any other plan of the model: it loads into another pipeline, another mesh, a ShardedModule or the plain model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from torch.utils import _pytree as pytree

from autoshard import meta as M
from autoshard.api.sharded_module import meta_skeleton, prepared_state
from autoshard.compiler.context import Options
from autoshard.errors import AutoshardError, MeshError, PlanError, TraceError
from autoshard.mesh import Mesh
from autoshard.compiler.pipeline.options import Pipeline
from autoshard.compiler.pipeline.plan import PipelinePlan, build_pipeline_plan
from autoshard.placements import Replicate, Shard, local_shape


# ---- running ----------------------------------------------------------------------------------------------
class PipelineRunner:
    """This process's part of a pipelined plan: its stage module(s), ``PipelineStage``(s) and the schedule.

    ``step(*args, target=None, losses=None, **kwargs)`` runs one forward+backward over the whole (global) batch
    and returns the loss on every rank; gradients are left in ``parameters()`` (summed over the stages for tied
    weights). ``sync_once`` (default): the parameters' data-parallel gradient all-reduce runs once per step, after
    the last microbatch's backward (:func:`autoshard.runtime.pipeline.sync_grads_once`), not once per microbatch;
    ``bucket_cap_mb``: that all-reduce in buckets of at most this many MiB (None: one per axes and dtype).

    The stage programs are made at once (on the meta device's model: uninitialised memory, ``initialised``
    False); the ``PipelineStage``\\ s and the schedule on the first step, so a runner in the simulator (which has
    no point-to-point process group) still holds its parameters."""

    def __init__(self, pplan: PipelinePlan, rank: int | None = None, comm=None, timeout: float = 300.0,
                 sync_once: bool = True, device=None, bucket_cap_mb: float | None = None):
        from autoshard.runtime.parameters import default_device
        from autoshard.compiler.plan import loss_of
        from autoshard.runtime import pipeline as rt

        self.comm = comm if comm is not None else communicator_for(pplan.mesh, timeout)
        self.plan = pplan
        self.sync_once = sync_once
        self.bucket_bytes = None if bucket_cap_mb is None else max(1, int(bucket_cap_mb * (1 << 20)))
        self.device = torch.device(device) if device is not None else default_device()
        self.rank = self.comm.rank if rank is None else rank
        p = pplan.pipeline
        self.modules: list = []
        self.initialised = True
        for s in pplan.stages_of(self.rank):
            program = pplan.stage_module(s, self.rank, bucket_grads=sync_once)
            if any(t.is_meta for t in (*program.parameters(), *program.buffers())):
                program.to_empty(device=self.device)
                self.initialised = False
            else:
                program.to(self.device)
            self.modules.append(rt.StageModule(program, pplan.stages[s].inputs))
        self._tie_shared()
        self.is_last = pplan.num_stages - 1 in pplan.stages_of(self.rank)
        out_spec = getattr(pplan.microbatch_plan.graph_module, "_out_spec", None)
        loss_fn = rt.model_loss(out_spec, p.loss_fn, loss_of)
        # A user loss_fn sees this rank's rows of a batch-sharded output: its mean over them, divided by the data
        # axis size, summed over the data axis (the gradient sync and the reported loss) is the global mean.
        self.data_axis, self.loss_shards = _output_data_shards(pplan) if p.loss_fn is not None else (None, 1)
        if self.loss_shards > 1:
            loss_fn = _scaled(loss_fn, self.loss_shards)
        self._loss_fn = loss_fn
        self.schedule = None  # made on the first step (:meth:`_schedule_ready`)
        self._group = None
        self._closed = False
        if hasattr(self.comm, "on_close"):  # runtime.shutdown(): the stages hold the pipe group; let go of it then
            self.comm.on_close(self._release_groups)
        specs = pplan.param_specs()
        self.shared = [(fqn, tuple(local_shape(_val(pplan, fqn).shape, specs[fqn], pplan.submesh)),
                        _val(pplan, fqn).dtype) for fqn, _ in pplan.shared_params()]
        self._publish()

    # ---- the stages' tensors ----------------------------------------------------------------------------
    def _tie_shared(self) -> None:
        """Two stages of this rank that read the same tensor (a tied weight when a rank holds several stages)
        share one object: one value, one gradient (the sum of both stages'), one optimizer state."""
        first: dict[str, torch.Tensor] = {}
        for m, s in zip(self.modules, self.plan.stages_of(self.rank)):
            for st in self.plan.stage_tensors(s):
                t = _attr(m.inner, st.target)
                if not isinstance(t, torch.Tensor):
                    continue
                kept = first.setdefault(st.aliases[0], t)
                if kept is not t:
                    _set_attr(m.inner, st.target, kept)

    def entries(self) -> list[tuple[int, object, torch.Tensor]]:
        """(stage, :class:`~autoshard.compiler.pipeline.plan.StageTensor`, this rank's local tensor) of every tensor
        of this rank's stage programs, stage by stage in graph order."""
        return [(s, st, t) for m, s in zip(self.modules, self.plan.stages_of(self.rank))
                for st in self.plan.stage_tensors(s) if isinstance(t := _attr(m.inner, st.target), torch.Tensor)]

    # A stage's parameters are DTensors on the stage's DeviceMesh (the non-pipe axes through this rank), sharing
    # storage with the stage program's own leaves. The schedule runs forward and backward inside one step(), so
    # gradients cross over at the step's edges: before it, each program leaf takes its DTensor's gradient (None
    # after zero_grad(), the accumulated value otherwise); after it, the DTensor's gradient is the program's.
    def _publish(self) -> None:
        from autoshard.runtime.parameters import device_mesh, like

        pplan = self.plan
        dm = device_mesh(pplan.mesh, self.device.type)
        names = pplan.submesh.names
        self.device_mesh = dm[names] if dm is not None and all(n in pplan.mesh.names for n in names) else None
        #: {id(program tensor): the public tensor} and {model name: public tensor} (every alias) of this rank
        self.public: dict[int, torch.Tensor] = {}
        self.held: dict[str, torch.Tensor] = {}
        for _, st, t in self.entries():
            if id(t) not in self.public:
                if self.device_mesh is None:
                    public = t
                else:
                    dt = like(t.detach(), _Layout(self.device_mesh, st.spec, torch.empty(st.shape, device="meta")))
                    public = torch.nn.Parameter(dt, requires_grad=t.requires_grad) if isinstance(
                        t, torch.nn.Parameter) else dt
                self.public[id(t)] = public
            for alias in st.aliases:
                self.held.setdefault(alias, self.public[id(t)])
        first_name = {st.target: st.aliases[0] for _, st, _ in self.entries()}
        self._pairs: list[tuple[str, torch.nn.Parameter, torch.nn.Parameter]] = [
            (first_name.get(target, target), p, self.public[id(p)])
            for m in self.modules for target, p in m.inner.named_parameters()]

    def _grads_in(self) -> None:
        from autoshard.runtime.parameters import local_of

        for _, p, dp in self._pairs:
            if dp is not p:
                p.grad = None if dp.grad is None else local_of(dp.grad)

    def _grads_out(self) -> None:
        from autoshard.runtime.parameters import like

        for _, p, dp in self._pairs:
            if dp is not p:
                dp.grad = None if p.grad is None else like(p.grad, dp)

    def _release_groups(self) -> None:
        self._closed = True
        self._group = self.schedule = None

    @property
    def group(self):
        """The process group of the pipe axis through this rank (None once the communicator is closed)."""
        if self._closed:
            return None
        if self._group is None:
            self._group = self.comm.process_group(self.plan.pipeline.axis)
        return self._group

    def parameters(self):
        seen = set()
        for _, _, dp in self._pairs:
            if id(dp) not in seen:
                seen.add(id(dp))
                yield dp

    def named_parameters(self):
        """``(model name, parameter)`` of this rank's stage(s), each a DTensor on the stage's DeviceMesh (a
        parameter two stages of this rank share, once)."""
        seen = set()
        for name, _, dp in self._pairs:
            if id(dp) not in seen:
                seen.add(id(dp))
                yield name, dp

    def stage_of(self) -> dict[str, list[int]]:
        """{model name: the stages of this rank that hold it}."""
        out: dict[str, list[int]] = {}
        for m, s in zip(self.modules, self.plan.stages_of(self.rank)):
            for target, _ in m.inner.named_parameters():
                out.setdefault(self.plan.microbatch_plan.public_names().get(target, target), []).append(s)
        return out

    # ---- the schedule -------------------------------------------------------------------------------------
    def _schedule_ready(self):
        from autoshard.runtime import pipeline as rt

        if self._closed:
            raise AutoshardError("this pipelined module's communicator was closed (autoshard.runtime.shutdown()) "
                                 "and its process groups destroyed: compile and run a new one after "
                                 "init_process_group to train again.")
        if self.schedule is None:
            pplan, group = self.plan, self.group
            stages = [rt.make_stage(m, s, pplan.num_stages, pplan.act_meta(s, self.rank, "acts"),
                                    pplan.act_meta(s, self.rank, "outputs"), group, self.device)
                      for m, s in zip(self.modules, pplan.stages_of(self.rank))]
            self.schedule = rt.build_schedule(stages, pplan.pipeline.schedule, pplan.pipeline.microbatches,
                                              self._loss_fn)
        return self.schedule

    def _inputs(self, args, kwargs, target):
        inputs = self.plan.shard_batch(self.rank, args, kwargs)
        inputs = {k: v.to(self.device) for k, v in inputs.items() if isinstance(v, torch.Tensor)}
        if target is not None:
            sub = self.plan.submesh
            spec = tuple(Shard(0) if n == self.data_axis else Replicate() for n in sub.names)
            target = self.plan.shard_microbatches(target, spec, self.rank).to(self.device)
        if target is None and self.is_last:
            # The schedule wants a target on the last stage even when the model computes its own loss.
            rows = next(iter(v.shape[0] for v in inputs.values() if v.dim() >= 1))
            target = torch.zeros(rows, device=self.device)
        return inputs, target

    def step(self, *args, target=None, losses: list | None = None, **kwargs) -> torch.Tensor:
        """One training step over the global batch: every microbatch's forward and backward, the gradient syncs.
        Returns the step's loss (the mean of the microbatch losses) on every rank; ``losses``, a list, is extended
        with the ``microbatches`` losses, on every rank."""
        from autoshard.runtime import pipeline as rt
        from autoshard.runtime.communicator import use

        schedule = self._schedule_ready()
        inputs, target = self._inputs(args, kwargs, target)
        found: list = []
        self._grads_in()
        with use(self.comm):
            if self.is_last:
                schedule.step(target=target, losses=found, return_outputs=False, **inputs)
            else:
                schedule.step(return_outputs=False, **inputs)
            if self.sync_once:
                rt.sync_grads_once(self.modules, self.comm, self.bucket_bytes)
            rt.sum_shared_grads(self.modules, self.shared, self.group)
        self._grads_out()
        return self._loss(found, losses)

    def eval_step(self, *args, target=None, losses: list | None = None, **kwargs) -> torch.Tensor:
        """The step's forward only (``Schedule.eval``), no gradient: the loss over the global batch on every rank,
        ``losses`` extended with the microbatch losses."""
        from autoshard.runtime.communicator import use

        schedule = self._schedule_ready()
        inputs, target = self._inputs(args, kwargs, target)
        found: list = []
        with torch.no_grad(), use(self.comm):
            # return_outputs=False reaches Schedule.step through eval's keywords: the outputs (a stage's scalar
            # loss) stay on the last stage, unmerged
            if self.is_last:
                schedule.eval(target=target, losses=found, return_outputs=False, **inputs)
            else:
                schedule.eval(return_outputs=False, **inputs)
        return self._loss(found, losses)

    def _loss(self, found: list, losses: list | None) -> torch.Tensor:
        from autoshard.runtime import pipeline as rt

        last = (self.plan.num_stages - 1) % self.plan.pipe
        per = rt.broadcast_losses(found, self.is_last, last, self.group, self.plan.pipeline.microbatches,
                                  self.device)
        if self.loss_shards > 1:
            per = self.comm.all_reduce(per, self.data_axis)
        if losses is not None:
            losses.extend(per.unbind())
        return per.mean()

    def grads(self) -> dict[str, torch.Tensor]:
        """{program attribute: this rank's local gradient} of this rank's stage(s), as
        :meth:`PipelinePlan.assemble_grads` takes them."""
        return {n: p.grad for m in self.modules for n, p in m.inner.named_parameters() if p.grad is not None}


class _Layout:
    """What :func:`autoshard.runtime.parameters.like` reads of a DTensor template: mesh, placements, global shape."""

    def __init__(self, device_mesh, placements, template: torch.Tensor):
        self.device_mesh, self.placements = device_mesh, tuple(placements)
        self.shape, self._stride = template.shape, template.stride()

    def stride(self):
        return self._stride


def communicator_for(mesh: Mesh, timeout: float):
    """The communicator of this thread's rank: the simulator's (a rank thread of ``SimWorld.run``) or one over
    ``torch.distributed``; a :class:`MeshError` where neither exists."""
    import torch.distributed as dist

    from autoshard.runtime.communicator import current
    from autoshard.runtime.dist import DistCommunicator

    try:
        comm = current()
    except AutoshardError:
        comm = None
    if comm is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise MeshError(f"a pipelined plan on {mesh} runs under torch.distributed, but it is not initialised: "
                            "launch with torchrun (and init_process_group) or autoshard.runtime.launch.spawn.")
        comm = DistCommunicator(mesh, timeout=timeout)
    if comm.mesh != mesh:
        raise MeshError(f"the pipelined module's communicator runs on {comm.mesh}, but its plan is for {mesh}: "
                        "compile for the mesh you run on (or run on the mesh you compiled for).")
    return comm


def _output_data_shards(pplan: PipelinePlan) -> tuple[str | None, int]:
    """(data axis, its size) when the model's first output leaves the plan sharded on dim 0 over the data axis."""
    axis = pplan.microbatch_plan.context.options.data_axis
    out = next(n for n in pplan.microbatch_plan.graph_module.graph.nodes if n.op == "output")
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
    return _attr(pplan.microbatch_plan.graph_module, fqn)


def _attr(module: torch.nn.Module, target: str):
    obj = module
    for part in target.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _set_attr(module: torch.nn.Module, target: str, value: torch.Tensor) -> None:
    owner_path, _, leaf = target.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    if leaf in owner._parameters:
        owner._parameters[leaf] = value
    elif leaf in owner._buffers:
        owner._buffers[leaf] = value
    else:
        setattr(owner, leaf, value)


# ---- what the checkpoint code reads -------------------------------------------------------------------------
@dataclass
class CheckpointLayout:
    """Every tensor of the model as a pipelined module holds it (:meth:`PipelinedModule.checkpoint_layout`): the
    same answer on every rank but for ``local`` and ``params``, this rank's."""

    groups: list[tuple[str, ...]]  # the names of each state-dict tensor of the model, model order (tied: several)
    shapes: dict[str, tuple[int, ...]]  # by canonical name (a group's last name): global shape
    dtypes: dict[str, torch.dtype]
    specs: dict[str, tuple]  # stored placements on the whole mesh (Replicate on the pipe axis)
    owner: dict[str, int]  # the pipe coordinate of the first stage holding it
    axis: str  # the pipe axis
    local: dict[str, torch.Tensor] = field(default_factory=dict)  # this rank's local tensors
    params: dict[int, tuple[str, torch.Tensor]] = field(default_factory=dict)  # id(public parameter) -> (canon, it)


# ---- the module ---------------------------------------------------------------------------------------------
class PipelinedModule(torch.nn.Module):
    """What ``autoshard.compile(..., pipeline=...)`` returns: this rank's stage(s) of the model as a module of the
    model's own names (``named_parameters()``, ``state_dict()``, ``load_state_dict()``, ``init_weights()``,
    ``train()``/``eval()``, ``autoshard.save``/``load``), the plan (``show``, ``code``, ``format``), and
    :meth:`step`, one schedule over the global batch. ``module(*args, target=..., **kwargs)`` is ``step``.

    ``bucket_cap_mb``: the data-parallel gradient all-reduce, which a pipeline runs once per step after the last
    microbatch's backward, in buckets of at most this many MiB (None: one all-reduce per axes and dtype); 0 runs
    each parameter's all-reduce inside every microbatch's backward instead. The gradients are the same."""

    #: what the checkpoint code recognises a pipelined module by (it does not import this module)
    AUTOSHARD_PIPELINED = True

    def __init__(self, model, mesh: Mesh, options: Options, example_inputs=None, example_kwargs=None,
                 pipeline: Pipeline | None = None, comm=None, timeout: float = 300.0, device=None,
                 bucket_cap_mb: float | None = None, *, planned: PipelinePlan | None = None):
        super().__init__()
        if bucket_cap_mb is not None and (isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float))
                                          or bucket_cap_mb < 0):
            raise AutoshardError(f"bucket_cap_mb is {bucket_cap_mb!r}, but must be a number of MiB >= 0 (0: each "
                                 "parameter's gradient all-reduce inside every microbatch's backward).")
        if not isinstance(model, torch.nn.Module):
            raise TraceError(f"model has type {type(model).__name__}, but autoshard traces torch.nn.Module instances.")
        if planned is None:
            if example_inputs is None and example_kwargs is None:
                raise PlanError("a pipelined compile needs example_inputs= (the global batch): the split and the "
                                "microbatch shapes are decided ahead of time.")
            args = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
            planned = build_pipeline_plan(model, mesh, tuple(args or ()), example_kwargs, options, pipeline)
        self.mesh = planned.mesh
        self.plan = planned
        self.bucket_cap_mb = bucket_cap_mb
        self._comm = comm
        self._timeout = timeout
        self._device = device
        self._runner: PipelineRunner | None = None
        self._skeleton_box = (meta_skeleton(model),)  # boxed: its meta tensors are not this module's parameters
        #: every name of every tensor some stage reads
        self._read = {a for sg in planned.stages for n in sg.gm.graph.nodes if n.op == "get_attr"
                      for a in n.meta.get(M.ALIASES, (str(n.target),))}
        # state entries no stage reads (unused parameters and buffers), kept whole: by the ranks of the first pipe
        # coordinate once the stages are made
        self._unread = {k: v.detach() for k, v in model.state_dict(keep_vars=True).items() if k not in self._read}
        self._unread_meta = {k: torch.empty_like(v, device="meta") for k, v in self._unread.items()}
        # a model built on the meta device: its stage shards are uninitialised memory until init_weights or a load
        self._initialised = not any(t.is_meta for t in (*model.parameters(), *model.buffers()))
        self.training = model.training

    @classmethod
    def of_plan(cls, model: torch.nn.Module, plan: PipelinePlan, *, comm=None, timeout: float = 300.0, device=None,
                bucket_cap_mb: float | None = None) -> PipelinedModule:
        """``model`` (the model planned, or one with the same tensors) run as the pipelined ``plan`` says: its own
        tensors are the ones this rank's stages take their shards of."""
        plan.bind_weights(model)
        return cls(model, plan.mesh, plan.microbatch_plan.context.options, pipeline=plan.pipeline, comm=comm,
                   timeout=timeout, device=device, bucket_cap_mb=bucket_cap_mb, planned=plan)

    # ---- the plan -----------------------------------------------------------------------------------------
    @property
    def pipeline(self) -> Pipeline:
        return self.plan.pipeline

    @property
    def skeleton(self) -> torch.nn.Module:
        """The model's module tree on the meta device (names, classes, init code; no tensor memory)."""
        return self._skeleton_box[0]

    def show(self, console=None) -> None:
        self.plan.show(console)

    def format(self) -> str:
        return self.plan.format()

    def code(self, rank: int = 0, stage: int | None = None) -> str:
        return self.plan.code(rank, stage)

    # ---- this rank ----------------------------------------------------------------------------------------
    def communicator(self):
        if self._comm is None:
            self._comm = communicator_for(self.mesh, self._timeout)
        return self._comm

    @property
    def rank(self) -> int:
        return self.communicator().rank

    @property
    def stages(self) -> list[int]:
        """The stages this rank holds."""
        return self.plan.stages_of(self.rank)

    @property
    def device(self) -> torch.device:
        """Where this rank's shards live (``compile(device=...)``, default the current accelerator, else the CPU)."""
        from autoshard.runtime.parameters import default_device

        if self._runner is not None:
            return self._runner.device
        return torch.device(self._device) if self._device is not None else default_device()

    @property
    def initialised(self) -> bool:
        """False while this rank's shards are uninitialised memory (a meta-built model before init or load)."""
        return self._initialised

    def mark_initialised(self) -> None:
        self._initialised = True

    def runner(self) -> PipelineRunner:
        """This rank's stages and schedule (made on first use: ``parameters()``, ``state_dict()``, a step...)."""
        return self.materialize()

    def materialize(self) -> PipelineRunner:
        """Make this rank's stage programs now: only its stages' shards, on ``device`` — copied from the model, or
        uninitialised memory for a model built on the meta device (then :meth:`init_weights` or
        ``autoshard.load`` fills them). The plan keeps no weight afterwards."""
        if self._runner is None:
            comm = self.communicator()
            runner = PipelineRunner(self.plan, comm=comm, timeout=self._timeout, device=self._device,
                                    sync_once=self.bucket_cap_mb != 0, bucket_cap_mb=self.bucket_cap_mb or None)
            self._runner = runner
            self._initialised = self._initialised and runner.initialised
            self._publish(runner)
            self.plan.release_weights()
        return self._runner

    def _holds_unread(self, runner: PipelineRunner) -> bool:
        return self.mesh.coords(runner.rank)[self.pipeline.axis] == 0

    def _publish(self, runner: PipelineRunner) -> None:
        """Give this module the model's tree of this rank's stage tensors (every alias of each), sharing storage
        with the stage programs; entries no stage reads on the first pipe coordinate's ranks."""
        held = dict(runner.held)
        if self._holds_unread(runner):
            skeleton_params = dict(self.skeleton.named_parameters(remove_duplicate=False))
            unread = {}
            for name, t in self._unread.items():
                local = t if t.is_meta else t.to(runner.device)
                if runner.device_mesh is not None:
                    from torch.distributed.tensor import DTensor

                    whole = (Replicate(),) * runner.device_mesh.ndim
                    local = DTensor.from_local(local, runner.device_mesh, whole, run_check=False)
                if name in skeleton_params:
                    local = torch.nn.Parameter(local, requires_grad=skeleton_params[name].requires_grad)
                unread[name] = local
                held[name] = local
            self._unread = unread
        else:
            self._unread = {}
        root = _model_tree(self.skeleton, held)
        for name, module in root._modules.items():
            if hasattr(type(self), name) or name in self.__dict__:
                raise PlanError(f"the model's top-level module `{name}` has the name of a PipelinedModule "
                                "attribute, so its parameters cannot keep their names: rename that module in the "
                                "model.")
            self.add_module(name, module)
        for name, t in root._parameters.items():
            self.register_parameter(name, t)
        for name, t in root._buffers.items():
            self.register_buffer(name, t, persistent=name not in root._non_persistent_buffers_set)

    def _ready(self) -> PipelineRunner:
        if self._runner is not None:
            return self._runner
        try:
            self.communicator()
        except MeshError as e:
            raise AutoshardError("PipelinedModule has no parameters yet: which stage this process holds depends on "
                                 "its rank, and torch.distributed is not initialised. Call "
                                 "torch.distributed.init_process_group first (torchrun), or pass comm=.") from e
        return self.materialize()

    # ---- the model's tree of this rank's stage tensors ----------------------------------------------------
    def parameters(self, recurse: bool = True):
        self._ready()
        return super().parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """This rank's stage parameters under the model's own names, in the model's order (a tied weight under its
        first name), each a ``DTensor`` on the stage's DeviceMesh placed as the plan stores it; the parameters of
        other stages are not here."""
        self._ready()
        return super().named_parameters(prefix, recurse, remove_duplicate)

    def buffers(self, recurse: bool = True):
        self._ready()
        return super().buffers(recurse)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        self._ready()
        return super().named_buffers(prefix, recurse, remove_duplicate)

    def state_dict(self, *args, **kwargs):
        """The entries of ``model.state_dict()`` this rank's stages hold (every name of a tied weight), values
        ``DTensor``s (this rank's shards with their global layout over the stage's DeviceMesh): DCP saves each shard
        once at its global offsets."""
        self._ready()
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """As ``nn.Module.load_state_dict``, by the model's names, into this rank's stages: values may be DTensors
        (redistributed) or whole tensors (this rank takes its slices). Entries of the model that other stages hold
        are skipped (a whole model's state dict loads on every rank); ``strict`` checks this rank's entries and
        names the model does not have."""
        self._ready()
        if assign:
            raise AutoshardError("load_state_dict(assign=True) would replace the tensors this rank's stage programs "
                                 "read; load with assign=False (the values are copied into the shards).")
        mine = dict(super().state_dict(keep_vars=True))
        model = self._read | set(self.skeleton.state_dict().keys())
        kept = {k: v for k, v in state_dict.items() if k in mine or k not in model}
        result = super().load_state_dict(prepared_state(mine, kept), strict=strict)
        if not self._initialised and all(k in kept for k in mine):
            self.compute_unsaved()  # a meta-built module given every entry: its non-persistent buffers too
        return result

    def _apply(self, fn, recurse: bool = True):
        raise AutoshardError("a PipelinedModule's shards are placed by autoshard.compile: moving or casting them "
                             "(.to(), .cuda(), .half(), ...) would leave the stage programs behind. Pass "
                             "device=... (and precision=autoshard.MixedPrecision(...)) to autoshard.compile instead.")

    # ---- initialising and loading a meta-built model ------------------------------------------------------
    def _stage_view(self, runner: PipelineRunner):
        """(a module holding this rank's stage tensors at their program names, a plan-like view of this rank's
        stage graphs on the submesh): what :mod:`autoshard.api.materialize` fills a rank program through."""
        from torch.fx.graph_module import _assign_attr

        container = torch.nn.Module()
        nodes, seen = [], set()
        for m, s in zip(runner.modules, self.plan.stages_of(runner.rank)):
            for n in self.plan.stages[s].gm.graph.nodes:
                if n.op == "get_attr" and isinstance(n.meta.get("val"), torch.Tensor) and n.target not in seen \
                        and isinstance(t := _attr(m.inner, str(n.target)), torch.Tensor):
                    seen.add(n.target)
                    nodes.append(n)
                    _assign_attr(t, container, str(n.target))
        view = SimpleNamespace(graph_module=SimpleNamespace(graph=SimpleNamespace(nodes=nodes)),
                               mesh=self.plan.submesh)
        return container, view

    def init_weights(self, init=None) -> dict:
        """Initialise this rank's stage shards by the model's own initialisation, run module by module on the
        skeleton as ``ShardedModule.init_weights`` runs it (every module's init, in the single-device order, so that
        with the same seed the values are bit for bit the slices of the single-device model's; ``init(module)``
        in ``model.apply`` order instead when given). Returns the statistics of
        :func:`autoshard.api.materialize.init_local`."""
        from autoshard.api.materialize import init_local

        runner = self.materialize()
        container, view = self._stage_view(runner)
        unread = dict(self._unread)
        stats = init_local(self.skeleton, container, view, self.plan.sub_rank(runner.rank), runner.device, init,
                           strict=not self._initialised, unread=unread)
        self._refill_unread(unread)
        self._initialised = True
        return stats

    def _refill_unread(self, values: dict) -> None:
        from autoshard.runtime.parameters import local_of

        with torch.no_grad():
            for name, t in self._unread.items():
                new = values.get(name)
                if new is not None and new is not t and not local_of(t).is_meta:
                    local_of(t).copy_(local_of(new))

    def compute_unsaved(self) -> None:
        """After a checkpoint filled a meta-built module: the tensors a checkpoint never holds (non-persistent
        buffers such as rotary ``inv_freq``) are computed by their modules' init, as :meth:`init_weights` computes
        them; then the module may run."""
        from autoshard.api.materialize import init_local

        runner = self.materialize()
        persistent = set(self.skeleton.state_dict().keys())
        unsaved = {st.target for _, st, _ in runner.entries() if not any(a in persistent for a in st.aliases)}
        if unsaved:
            container, view = self._stage_view(runner)
            init_local(self.skeleton, container, view, self.plan.sub_rank(runner.rank), runner.device, only=unsaved)
        self._initialised = True

    def load_pretrained(self, path) -> dict:
        """``autoshard.load(module, hf_dir)``: this rank's slices of its stages' tensors from a Hugging Face
        safetensors directory (see :func:`autoshard.api.materialize.load_local`)."""
        from autoshard.api.materialize import load_local

        runner = self.materialize()
        container, view = self._stage_view(runner)
        unread = dict(self._unread)
        stats = load_local(self.skeleton, container, view, self.plan.sub_rank(runner.rank), path, runner.device,
                           unread=unread, compute=not self._initialised)
        self._refill_unread(unread)
        self._initialised = True
        return stats

    def checkpoint_layout(self) -> CheckpointLayout:
        """Every state-dict tensor of the model (each stage's and those no stage reads), with the global shape,
        dtype, layout on the whole mesh and the pipe coordinate that holds it; and this rank's local tensors. What
        ``autoshard.save``/``load``/``full_state_dict`` read (:mod:`autoshard.api.checkpoint`)."""
        from autoshard.runtime.parameters import local_of

        self._ready()
        plan = self.plan
        by_alias: dict[str, tuple] = {}
        for sg in plan.stages:
            for st in plan.stage_tensors(sg.index):
                for a in st.aliases:
                    by_alias.setdefault(a, (st, plan.pipe_coordinate(sg.index)))
        groups: dict[int, list[str]] = {}
        for name, t in self.skeleton.state_dict(keep_vars=True).items():
            groups.setdefault(id(t), []).append(name)
        layout = CheckpointLayout([tuple(g) for g in groups.values()], {}, {}, {}, {}, plan.pipeline.axis)
        whole = (Replicate(),) * self.mesh.ndim
        mine = {a: t for a, t in self.state_dict(keep_vars=True).items()}
        for names in layout.groups:
            canon = names[-1]
            hit = next((by_alias[a] for a in names if a in by_alias), None)
            if hit is not None:
                st, coord = hit
                layout.shapes[canon], layout.dtypes[canon] = st.shape, st.dtype
                layout.specs[canon], layout.owner[canon] = plan.mesh_spec(st.spec), coord
            else:
                t = next(self._unread_meta[a] for a in names if a in self._unread_meta)
                layout.shapes[canon], layout.dtypes[canon] = tuple(t.shape), t.dtype
                layout.specs[canon], layout.owner[canon] = whole, 0
            t = next((mine[a] for a in names if a in mine), None)
            if t is not None:
                layout.local[canon] = local_of(t)
                if isinstance(t, torch.nn.Parameter):
                    layout.params[id(t)] = (canon, t)
        return layout

    # ---- running ------------------------------------------------------------------------------------------
    def train(self, mode: bool = True):
        """As the model's own ``train()``/``eval()``: in eval mode :meth:`step` runs the forward of every
        microbatch only (``Schedule.eval``) and returns the loss. The stage programs are those of the mode the
        model was traced in; where the other mode computes something else (dropout, batch norm) a step in it is
        an error that says so."""
        if not isinstance(mode, bool):
            raise TypeError("training mode is expected to be boolean")
        return super().train(mode)

    def step(self, *args, target=None, losses: list | None = None, return_outputs: bool = False,
             loss_kwargs: dict | None = None, **kwargs) -> torch.Tensor:
        """One schedule over the global batch, as ``torch.distributed.pipelining``'s ``Schedule*.step(*args,
        target=None, losses=None, return_outputs=..., loss_kwargs=None, **kwargs)``: ``args``/``kwargs`` the model's
        inputs (every rank passes the whole batch; the schedule cuts it into microbatches), ``target`` the target of
        ``Pipeline(loss_fn=...)`` (None: the model computes its loss), ``losses`` a list extended with the
        microbatch losses. In training mode every microbatch's forward and backward, gradients left in
        ``parameters()``; in eval mode the forward only. Returns the loss over the batch (the mean of the microbatch
        losses) on every rank, and fills ``losses`` on every rank — torch's returns the last stage's outputs there
        (``return_outputs=True``, its default) and fills ``losses`` only on the last stage. ``return_outputs=True``
        and ``loss_kwargs`` are refused, saying why."""
        from autoshard.frontend.inputs import check_inputs, tensor_leaves

        if return_outputs:
            raise AutoshardError("step(return_outputs=True) would return the last stage's outputs, but a pipelined "
                                 "module's step returns the batch's loss on every rank (the outputs are the last "
                                 "stage's shards of each microbatch's): leave return_outputs out.")
        if loss_kwargs:
            raise AutoshardError(f"step got loss_kwargs={sorted(loss_kwargs)}, but the loss is "
                                 "Pipeline(loss_fn=...)(output, target) or the model's own: bind extra arguments "
                                 "into loss_fn (functools.partial) when compiling.")
        check_inputs(self.plan.expected_inputs(), tensor_leaves(args, kwargs), local=False,
                     where="the pipelined module (one step over the global batch)")
        if losses is not None and not isinstance(losses, list):
            raise TypeError(f"losses must be a list but got a {type(losses)}")
        runner = self.materialize()
        if not self._initialised:
            raise AutoshardError("this rank's stage shards are uninitialised memory (the model was built on the "
                                 "meta device): call module.init_weights() or autoshard.load(module, path) first.")
        traced = self.plan.microbatch_plan.training
        if self.training != traced:
            where = self.plan.mode_dependent()
            if where:
                mode = "training" if self.training else "eval"
                raise AutoshardError(
                    f"this pipelined module is in {mode} mode, but its stage programs were traced in "
                    f"{'training' if traced else 'eval'} mode and compute something else in {mode} mode: "
                    f"{where[0]}{f' (and {len(where) - 1} more)' if len(where) > 1 else ''}. A pipelined plan has "
                    f"the programs of one mode: call module.train({traced}) to run it, or compile the model in "
                    f"{mode} mode (model.{'train' if self.training else 'eval'}() before autoshard.compile) and "
                    "load this module's weights into it (autoshard.save/load, or load_state_dict).")
        if self.training:
            return runner.step(*args, target=target, losses=losses, **kwargs)
        return runner.eval_step(*args, target=target, losses=losses, **kwargs)

    def forward(self, *args, **kwargs):
        """``module(...)`` is :meth:`step` (a pipeline has no forward of its own: the schedule runs forward and
        backward of the microbatches interleaved)."""
        return self.step(*args, **kwargs)


def _model_tree(skeleton: torch.nn.Module, held: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A plain module tree shaped as ``skeleton`` (same paths, same order, shared submodules shared) holding the
    tensors of ``held`` ({model name: tensor}, every name of a tied tensor) under their names; names the model
    does not have (parameters the compiler created) are added along their paths."""
    made: dict[int, torch.nn.Module] = {}
    root = torch.nn.Module()
    made[id(skeleton)] = root
    for path, module in skeleton.named_modules(remove_duplicate=False):
        holder = made.get(id(module))
        new = holder is None
        if new:
            holder = made[id(module)] = torch.nn.Module()
        holder.training = module.training
        if path:
            parent_path, _, leaf = path.rpartition(".")
            parent = root.get_submodule(parent_path) if parent_path else root
            if leaf not in parent._modules:
                parent.add_module(leaf, holder)
            if not new:
                continue  # a shared module, filled under its first path
        prefix = f"{path}." if path else ""
        for name in module._parameters:
            t = held.get(prefix + name)
            if t is not None:
                holder._parameters[name] = t
        for name in module._buffers:
            t = held.get(prefix + name)
            if t is not None:
                holder._buffers[name] = t
                if name in module._non_persistent_buffers_set:
                    holder._non_persistent_buffers_set.add(name)
    placed = {f"{path}.{name}" if path else name for path, holder in root.named_modules(remove_duplicate=False)
              for name in (*holder._parameters, *holder._buffers)}
    for name, t in held.items():
        if name in placed or not isinstance(t, torch.nn.Parameter):
            continue  # a tensor the model does not have is a parameter the compiler made (MoE experts), or no entry
        parent = root
        *path, leaf = name.split(".")
        for part in path:
            if part not in parent._modules:
                parent.add_module(part, torch.nn.Module())
            parent = parent._modules[part]
        parent._parameters[leaf] = t
    return root
