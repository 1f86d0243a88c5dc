"""The user-facing entry point: ``autoshard.compile(model, mesh, ...)``.

With ``example_inputs`` the plan is built at once, in one process, and can be inspected (``show``, ``code``,
``rank_module``) before any process group exists. Without them the module is lazy, like ``torch.compile``: it
traces on the first call, taking the static shapes of that call — each rank passes its own data shard (dim 0
split over the data axis, as with DDP), so the global batch is the local one times the data-axis size.

Calling the returned :class:`ShardedModule` runs this process's rank of the plan under ``torch.distributed``
(or under any communicator made current with :func:`autoshard.runtime.use`, e.g. the simulator's).
"""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from autoshard.context import Options
from autoshard.errors import AutoshardError, MeshError, PlanError, RuntimeShapeError
from autoshard.mesh import Mesh, as_mesh
from autoshard.placements import Spec, local_shape, parse_placement
from autoshard.plan import Plan, build_plan


def compile(model: torch.nn.Module, mesh, example_inputs=None, example_kwargs: dict | None = None, *,
            plan: dict | None = None, data_axis: str = "data", on_unsupported: str = "error",
            planner: str = "greedy", profile="cpu-gloo", memory_limit: float | str | None = None,
            optimizer: str = "adam", comm=None, timeout: float = 300.0, pipeline=None,
            bucket_cap_mb: float | None = None, moe=None, sequence_parallel: bool = False) -> ShardedModule:
    """Shard ``model`` over ``mesh``.

    ``plan`` maps glob patterns over parameter FQNs (or input names) to one placement per mesh axis, e.g.
    ``{"transformer.h.*.mlp.c_fc.weight": (Replicate(), Shard(1))}``; annotations are hard constraints.

    ``planner="greedy"`` (default) propagates op by op, fewest bytes first. ``planner="search"`` chooses every
    other strategy by an exact search minimising the estimated step time for the hardware ``profile`` (a preset
    name such as "cpu-gloo", "gpu-8x-nvlink", "multi-node", a TOML path, or a HardwareProfile) under
    ``memory_limit`` bytes per rank (an int or text like "2GiB").

    ``timeout`` (seconds): how long a collective waits for its peers under torch.distributed before raising
    :class:`~autoshard.errors.CollectiveTimeoutError` (a peer died or hangs).

    ``pipeline=autoshard.Pipeline(microbatches=..., schedule=..., split=...)`` cuts the model into stages over the
    mesh's ``pipe`` axis and returns a :class:`autoshard.pipeline.PipelinedModule` (calling it runs one training
    step, forward and backward, and returns the loss); see :mod:`autoshard.pipeline`.

    ``moe=autoshard.MoE(layers="blocks.*.mlp", every=2, num_experts=8, top_k=2, ...)`` rewrites the chosen dense
    FFNs as capacity-bounded Mixture-of-Experts layers with experts sharded over ``expert_axis`` (see
    :mod:`autoshard.moe`); their auxiliary losses train with the model's loss, and
    ``autoshard.moe_losses(module)`` / ``autoshard.moe_stats(module)`` report them after each forward.

    ``bucket_cap_mb``: data-parallel gradient all-reduces run like DDP's, in buckets of this many MiB launched
    asynchronously as gradients become ready during backward (:mod:`autoshard.runtime.buckets`; default as
    DDP's: a 1 MiB first bucket, then 25 MiB); 0 runs one blocking all-reduce per parameter inside backward
    instead. The gradients are identical either way.

    ``sequence_parallel=True`` (greedy planner): at equal communication prefer sharded activations, so norms and
    residuals between tensor-parallel layers run sharded along the sequence on the model axis (Megatron-SP:
    reduce-scatter + all-gather in place of each all-reduce, less activation memory per rank). Annotate the
    input's sequence dim, e.g. ``plan={"x": (Replicate(), Shard(1))}``, to start the model in that layout.
    """
    mesh = as_mesh(mesh)
    options = make_options(plan, data_axis, on_unsupported, mesh, planner, profile, memory_limit, optimizer,
                           sequence_parallel)
    if moe is not None:
        options = _with_moe(options, moe)
    if pipeline is not None:
        from autoshard.pipeline import PipelinedModule

        return PipelinedModule(model, mesh, options, example_inputs, example_kwargs, pipeline, comm, timeout)
    return ShardedModule(model, mesh, options, example_inputs, example_kwargs, comm, timeout, bucket_cap_mb)


def _with_moe(options: Options, moe) -> Options:
    import dataclasses

    from autoshard.moe import MoE

    if not isinstance(moe, MoE):
        raise PlanError(f"option moe is {type(moe).__name__}, but must be an autoshard.MoE(layers=..., "
                        "num_experts=..., ...).")
    return dataclasses.replace(options, moe=moe)


def parse_bytes(value) -> float | None:
    """2_000_000, "2GiB", "512MB", "1.5 GB" -> bytes."""
    if value is None or isinstance(value, (int, float)) and not isinstance(value, bool):
        return None if value is None else float(value)
    units = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
             "tib": 2**40}
    text = str(value).strip().lower().replace(" ", "")
    number = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(number):]
    try:
        return float(number) * units[unit]
    except (KeyError, ValueError):
        raise PlanError(f"memory_limit is {value!r}, but must be a number of bytes or text like '2GiB', '512MB'.") from None


def make_options(plan, data_axis: str, on_unsupported: str, mesh: Mesh, planner: str = "greedy",
                 profile="cpu-gloo", memory_limit=None, optimizer: str = "adam",
                 sequence_parallel: bool = False) -> Options:
    if planner not in ("search", "greedy"):
        raise PlanError(f"option planner is {planner!r}, but must be 'search' or 'greedy'.")
    if optimizer not in ("adam", "adamw", "sgd", "sgd_momentum"):
        raise PlanError(f"option optimizer is {optimizer!r}, but must be one of adam, adamw, sgd, sgd_momentum.")
    if on_unsupported not in ("error", "replicate"):
        raise PlanError(f"option on_unsupported is {on_unsupported!r}, but must be 'error' or 'replicate'.")
    if not isinstance(data_axis, str):
        raise PlanError(f"option data_axis is {data_axis!r}, but must be a mesh axis name such as 'data'.")
    annotations = []
    for pattern, spec in (plan or {}).items():
        if isinstance(spec, str) or not isinstance(spec, (tuple, list)):
            raise PlanError(f"annotation {pattern!r} has {spec!r}, but must be a tuple with one placement per "
                            f"mesh axis {list(mesh.names)}, e.g. (Replicate(), Shard(0)).")
        annotations.append((pattern, tuple(parse_placement(p) if isinstance(p, str) else p for p in spec)))
    return Options(annotations=tuple(annotations), data_axis=data_axis, on_unsupported=on_unsupported,
                   planner=planner, profile=profile, memory_limit=parse_bytes(memory_limit), optimizer=optimizer,
                   sequence_parallel=bool(sequence_parallel))


def data_shard(x: torch.Tensor, mesh, rank: int, axis: str = "data") -> torch.Tensor:
    """``rank``'s share of a global batch: chunk ``i`` of dim 0 for the rank at coordinate ``i`` on ``axis``
    (the default input sharding); the whole batch when the mesh has no such axis."""
    mesh = as_mesh(mesh)
    if axis not in mesh.names:
        return x
    n = mesh.axis_size(axis)
    if x.shape[0] % n:
        raise PlanError(f"batch of size {x.shape[0]} is not divisible by axis `{axis}` of size {n}: use a global "
                        f"batch that is a multiple of {n}.")
    return x.chunk(n, dim=0)[mesh.coords(rank)[axis]]


class ShardedModule(torch.nn.Module):
    """This process's rank of a sharded model; also the handle on the plan (``show``, ``code``, ``rank_module``)."""

    def __init__(self, model, mesh: Mesh, options: Options, example_inputs=None, example_kwargs=None, comm=None,
                 timeout: float = 300.0, bucket_cap_mb: float | None = None):
        super().__init__()
        if bucket_cap_mb is not None and (isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float))
                                          or bucket_cap_mb < 0):
            raise AutoshardError(f"bucket_cap_mb is {bucket_cap_mb!r}, but must be a number of MiB >= 0 (0 turns "
                                 "gradient bucketing off).")
        self.bucket_cap_mb = bucket_cap_mb
        self.bucketer = None
        self.mesh = mesh
        self.options = options
        self._source = (model,)  # a tuple keeps the unsharded model out of this module's parameters
        self._comm = comm
        self._timeout = timeout
        self.plan: Plan | None = None
        self.local: torch.fx.GraphModule | None = None
        self._expected: list | None = None
        if example_inputs is not None or example_kwargs is not None:
            args = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
            self.plan = build_plan(model, mesh, tuple(args or ()), example_kwargs, options)

    # ---- the plan ---------------------------------------------------------------------------------------
    def _need_plan(self) -> Plan:
        if self.plan is None:
            raise AutoshardError("this ShardedModule has no plan yet: it compiles on its first call. Call it once "
                                 "with a batch, or pass example_inputs= to autoshard.compile to plan ahead of time.")
        return self.plan

    def show(self, console=None) -> None:
        self._need_plan().show(console)

    def code(self, rank: int = 0) -> str:
        return self._need_plan().code(rank)

    def rank_module(self, rank: int) -> torch.fx.GraphModule:
        return self._need_plan().rank_module(rank)

    def format(self) -> str:
        return self._need_plan().format()

    # ---- running ----------------------------------------------------------------------------------------
    def parameters(self, recurse: bool = True):
        if self.local is None:
            raise AutoshardError("ShardedModule has no parameters before its first call (the plan decides how "
                                 "they are sharded). Call it once with a batch before building the optimizer, or "
                                 "pass example_inputs= to autoshard.compile.")
        return super().parameters(recurse)

    def communicator(self):
        if self._comm is None:
            from autoshard.runtime.comm import current

            try:
                self._comm = current()
            except AutoshardError:
                self._comm = None
        if self._comm is None:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                if self.mesh.size != 1:
                    raise MeshError(f"mesh {self.mesh} has {self.mesh.size} ranks, but torch.distributed is not "
                                    "initialised. Launch with torchrun (and init_process_group), or run the plan "
                                    "in the simulator (autoshard.runtime.SimWorld).")
            from autoshard.runtime.dist import DistCommunicator

            self._comm = DistCommunicator(self.mesh, timeout=self._timeout)
        if self._comm.mesh != self.mesh:
            raise MeshError(f"the ShardedModule's communicator runs on {self._comm.mesh}, but its plan is for "
                            f"{self.mesh}: compile for the mesh you run on (or run on the mesh you compiled for).")
        return self._comm

    @property
    def bucketing(self) -> bool:
        """Whether data-parallel gradients are synced by a :class:`~autoshard.runtime.buckets.GradBucketer`
        (``bucket_cap_mb`` not 0)."""
        return self.bucket_cap_mb is None or self.bucket_cap_mb > 0

    def forward(self, *args, **kwargs):
        comm = self.communicator()
        if self.plan is None:
            gargs, gkwargs = self._global_examples(args, kwargs)
            self.plan = build_plan(self._source[0], self.mesh, gargs, gkwargs, self.options)
        if self.local is None:
            local = self.plan.rank_module(comm.rank, bucket_grads=self.bucketing)
            if self.bucketing:
                from autoshard.runtime.buckets import GradBucketer

                self.bucketer = GradBucketer(local, comm=comm, bucket_cap_mb=self.bucket_cap_mb)
            self.local = local
            self._expected = self._expected_local_shapes()
        self._check_inputs(args, kwargs)
        from autoshard.runtime.comm import use

        with use(comm):
            return self.local(*args, **kwargs)

    def _global_examples(self, args, kwargs):
        n = self.mesh.axis_size(self.options.data_axis) if self.options.data_axis in self.mesh.names else 1

        def grow(x):
            if isinstance(x, torch.Tensor) and x.dim() >= 1:
                return x.repeat(n, *([1] * (x.dim() - 1)))
            return x

        return pytree.tree_map(grow, tuple(args)), pytree.tree_map(grow, dict(kwargs))

    def _expected_local_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        from autoshard import meta as M

        out = []
        for n in self.plan.graph_module.graph.nodes:
            if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor):
                spec: Spec = n.meta[M.SPEC]
                out.append((n.name, local_shape(n.meta["val"].shape, spec, self.mesh)))
        return out

    def _check_inputs(self, args, kwargs) -> None:
        leaves = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        if len(leaves) != len(self._expected):
            return
        for x, (name, want) in zip(leaves, self._expected):
            if tuple(x.shape) != tuple(want):
                raise RuntimeShapeError(
                    f"input `{name}` has local shape {list(x.shape)}, but the plan was compiled for {list(want)} on "
                    f"this rank. Shapes are static: pad or batch to the compiled shape, or compile a new "
                    f"ShardedModule for the new shape.")
