"""Running a pipelined plan: this process's :class:`PipelineRunner` (its stages and schedule, over
:mod:`autoshard.runtime.pipeline`), and :class:`PipelinedModule`, what ``autoshard.compile(..., pipeline=...)``
returns."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils import _pytree as pytree

from autoshard import meta as M
from autoshard.compiler.context import Options
from autoshard.errors import AutoshardError, MeshError, PlanError
from autoshard.mesh import Mesh
from autoshard.compiler.pipeline.options import Pipeline
from autoshard.compiler.pipeline.plan import PipelinePlan, build_pipeline_plan
from autoshard.placements import Replicate, Shard, local_shape


# ---- running ----------------------------------------------------------------------------------------------
class PipelineRunner:
    """This process's part of a pipelined plan: its stage module(s), ``PipelineStage``(s) and the schedule.

    ``step(*args, target=None, **kwargs)`` runs one forward+backward over the whole (global) batch and returns the
    loss on every rank; gradients are left in ``parameters()`` (summed over the stages for tied weights).
    ``sync_once`` (default): the parameters' data-parallel gradient all-reduce runs once per step, after the last
    microbatch's backward (:func:`autoshard.runtime.pipeline.sync_grads_once`), not once per microbatch."""

    def __init__(self, pplan: PipelinePlan, rank: int | None = None, comm=None, timeout: float = 300.0,
                 sync_once: bool = True, device=None):
        import torch.distributed as dist

        from autoshard.runtime.parameters import default_device
        from autoshard.compiler.plan import loss_of
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
        self.device = torch.device(device) if device is not None else default_device()
        self.rank = comm.rank if rank is None else rank
        self.group = comm.process_group(pplan.pipeline.axis)
        p = pplan.pipeline
        self.modules: list = []
        stages = []
        for s in pplan.stages_of(self.rank):
            module = rt.StageModule(pplan.stage_module(s, self.rank, bucket_grads=sync_once).to(self.device),
                                    pplan.stages[s].inputs)
            self.modules.append(module)
            stages.append(rt.make_stage(module, s, pplan.num_stages, pplan.act_meta(s, self.rank, "acts"),
                                        pplan.act_meta(s, self.rank, "outputs"), self.group, self.device))
        self.is_last = pplan.num_stages - 1 in pplan.stages_of(self.rank)
        out_spec = getattr(pplan.microbatch_plan.graph_module, "_out_spec", None)
        loss_fn = rt.model_loss(out_spec, p.loss_fn, loss_of)
        # A user loss_fn sees this rank's rows of a batch-sharded output: its mean over them, divided by the data
        # axis size, summed over the data axis (the gradient sync and the reported loss) is the global mean.
        self.data_axis, self.loss_shards = _output_data_shards(pplan) if p.loss_fn is not None else (None, 1)
        if self.loss_shards > 1:
            loss_fn = _scaled(loss_fn, self.loss_shards)
        self.schedule = rt.build_schedule(stages, p.schedule, p.microbatches, loss_fn)
        if hasattr(comm, "on_close"):  # runtime.shutdown(): the stages hold the pipe group; let go of it then
            comm.on_close(self._release_groups)
        specs = pplan.param_specs()
        self.shared = [(fqn, tuple(local_shape(_val(pplan, fqn).shape, specs[fqn], pplan.submesh)),
                        _val(pplan, fqn).dtype) for fqn, _ in pplan.shared_params()]

        self._publish()

    # ---- DTensor parameters ---------------------------------------------------------------------------------
    # A stage's parameters are DTensors on the stage's DeviceMesh (the non-pipe axes through this rank), sharing
    # storage with the stage program's own leaves. The schedule runs forward and backward inside one step(), so
    # gradients cross over at the step's edges: before it, each program leaf takes its DTensor's gradient (None
    # after zero_grad(), the accumulated value otherwise); after it, the DTensor's gradient is the program's.
    def _publish(self) -> None:
        from autoshard.compiler.rank_programs import local_param_specs
        from autoshard.runtime.parameters import device_mesh, like
        from autoshard.frontend.trace import fetch_attr

        pplan = self.plan
        dm = device_mesh(pplan.mesh, self.device.type)
        names = pplan.submesh.names
        sub = dm[names] if dm is not None and all(n in pplan.mesh.names for n in names) else None
        specs = local_param_specs(pplan.microbatch_plan.graph_module)
        public = pplan.microbatch_plan.public_names()
        self._pairs: list[tuple[str, torch.nn.Parameter, torch.nn.Parameter]] = []
        for m in self.modules:
            for target, p in m.inner.named_parameters():
                if sub is None:
                    dp = p
                else:
                    full = fetch_attr(pplan.microbatch_plan.graph_module, target)
                    template = torch.empty(full.shape, device="meta")
                    dt = like(p.detach(), _Layout(sub, specs[target], template))
                    dp = torch.nn.Parameter(dt, requires_grad=p.requires_grad)
                self._pairs.append((public.get(target, target), p, dp))

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
        self.group = self.schedule = None

    def parameters(self):
        for _, _, dp in self._pairs:
            yield dp

    def named_parameters(self):
        """``(model name, parameter)`` of this rank's stage(s), each a DTensor on the stage's DeviceMesh; a tied
        weight appears once per stage holding it (:func:`autoshard.clip_grad_norm_` counts it once)."""
        for name, _, dp in self._pairs:
            yield name, dp

    def stage_of(self) -> dict[str, list[int]]:
        """{model name: the stages of this rank that hold it}."""
        out: dict[str, list[int]] = {}
        for m, s in zip(self.modules, self.plan.stages_of(self.rank)):
            for target, _ in m.inner.named_parameters():
                out.setdefault(self.plan.microbatch_plan.public_names().get(target, target), []).append(s)
        return out

    def step(self, *args, target=None, **kwargs) -> torch.Tensor:
        from autoshard.runtime import pipeline as rt
        from autoshard.runtime.communicator import use

        if self.schedule is None:
            raise AutoshardError("this pipelined module's communicator was closed (autoshard.runtime.shutdown()) "
                                 "and its process groups destroyed: compile and run a new one after "
                                 "init_process_group to train again.")
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
        self._grads_in()
        with use(self.comm):
            if self.is_last:
                self.schedule.step(target=target, losses=losses, return_outputs=False, **inputs)
            else:
                self.schedule.step(return_outputs=False, **inputs)
            if self.sync_once:
                rt.sync_grads_once(self.modules, self.comm)
            rt.sum_shared_grads(self.modules, self.shared, self.group)
        self._grads_out()
        last = (self.plan.num_stages - 1) % self.plan.pipe
        loss = rt.broadcast_loss(losses, self.is_last, last, self.group)
        if self.loss_shards > 1:
            loss = self.comm.all_reduce(loss.reshape(1), self.data_axis).reshape(())
        return loss

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
    from autoshard.frontend.trace import fetch_attr

    return fetch_attr(pplan.microbatch_plan.graph_module, fqn)


class PipelinedModule(torch.nn.Module):
    """What ``autoshard.compile(..., pipeline=...)`` returns: the plan (``show``, ``code``, ``format``) and, once
    called in a process group, this rank's runner. Calling it runs one training step (forward *and* backward,
    as pipeline schedules interleave them) and returns the loss."""

    def __init__(self, model, mesh: Mesh, options: Options, example_inputs, example_kwargs, pipeline: Pipeline,
                 comm=None, timeout: float = 300.0, device=None):
        super().__init__()
        if example_inputs is None and example_kwargs is None:
            raise PlanError("a pipelined compile needs example_inputs= (the global batch): the split and the "
                            "microbatch shapes are decided ahead of time.")
        args = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
        self.mesh = mesh
        self.plan = build_pipeline_plan(model, mesh, tuple(args or ()), example_kwargs, options, pipeline)
        self._comm = comm
        self._timeout = timeout
        self._device = device
        self._runner: PipelineRunner | None = None

    def show(self, console=None) -> None:
        self.plan.show(console)

    def format(self) -> str:
        return self.plan.format()

    def code(self, rank: int = 0, stage: int | None = None) -> str:
        return self.plan.code(rank, stage)

    def runner(self) -> PipelineRunner:
        if self._runner is None:
            self._runner = PipelineRunner(self.plan, comm=self._comm, timeout=self._timeout, device=self._device)
        return self._runner

    def parameters(self, recurse: bool = True):
        return self.runner().parameters()

    def named_parameters(self, *a, **k):
        return self.runner().named_parameters()

    def forward(self, *args, target=None, **kwargs):
        from autoshard.frontend.inputs import check_inputs, tensor_leaves

        check_inputs(self.plan.expected_inputs(), tensor_leaves(args, kwargs), local=False,
                     where="the pipelined module (one step over the global batch)")
        return self.runner().step(*args, target=target, **kwargs)
