"""The user-facing entry point: ``autoshard.compile(model, mesh, ...)``.

With ``example_inputs`` the plan is built at once, in one process, and can be inspected (``show``, ``code``,
``rank_program``) before any process group exists. Without them the module is lazy, like ``torch.compile``: it
traces on the first call, taking the static shapes of that call — each rank passes its own data shard (dim 0
split over the data axis, as with DDP), so the global batch is the local one times the data-axis size.

Calling the returned :class:`ShardedModule` runs this process's rank of the plan under ``torch.distributed``
(or under any communicator made current with :func:`autoshard.runtime.use`, e.g. the simulator's).
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from autoshard.compiler.context import Options, Pinned
from autoshard.errors import AutoshardError, MeshError, PlanError, RuntimeShapeError, TraceError
from autoshard.mesh import Mesh, as_mesh
from autoshard.runtime.parameters import default_device, local_slice
from autoshard.api.planning import (  # noqa: F401  (make_options, memory_defaults, parse_bytes: compile's helpers)
    job_communicator,
    make_options,
    memory_defaults,
    parse_bytes,
    plan_once,
    with_moe,
)
from autoshard.compiler.plan import Plan, build_plan
from autoshard.runtime.torch_state import RANK_THREADS


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


def meta_skeleton(model: torch.nn.Module) -> torch.nn.Module:
    """``model``'s module tree with every parameter and buffer on the meta device (same classes, same names, tied
    parameters still one object): what ``init_weights`` runs the model's own init on, module by module, and what
    eval/train programs are traced from. Costs no tensor memory; a model already on meta is its own skeleton."""
    # torch.export swaps a model's tensors for FakeTensors while it traces it (in another rank thread, simulated)
    with RANK_THREADS.exclusive():
        tensors = [*model.parameters(), *model.buffers()]
        if all(t.is_meta for t in tensors):
            return model
        memo: dict[int, object] = {}
        for t in tensors:
            if id(t) not in memo:
                meta = torch.empty_like(t, device="meta")
                memo[id(t)] = torch.nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(
                    t, torch.nn.Parameter) else meta
        return copy.deepcopy(model, memo)


class ShardedModule(torch.nn.Module):
    """This process's rank of a sharded model; also the handle on the plan (``show``, ``code``, ``rank_program``).

    What it holds: the plan, this rank's program (``local``, built by :meth:`materialize` on first use —
    ``parameters()``, ``init_weights()``, a call) with only this rank's shards on :attr:`device`, and the
    model's module tree on the meta device (``_skeleton``: no tensor memory) for ``init_weights`` and for the
    program of the other training mode. ``train()``/``eval()`` switch programs as the model's own modes do:
    the plan is traced in the model's mode at compile time; the other mode's program is traced from the skeleton on
    first use (as FakeTensors on this rank's device, so that model code branching on ``x.device.type`` runs as here),
    with every parameter pinned to the same layout, and shares this rank's tensors.
    """

    def __init__(self, model, mesh: Mesh, options: Options, example_inputs=None, example_kwargs=None, comm=None,
                 timeout: float = 300.0, bucket_cap_mb: float | None = None, device=None, new_shapes: str = "plan",
                 planned: Plan | None = None):
        super().__init__()
        if bucket_cap_mb is not None and (isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float))
                                          or bucket_cap_mb < 0):
            raise AutoshardError(f"bucket_cap_mb is {bucket_cap_mb!r}, but must be a number of MiB >= 0 (0 turns "
                                 "gradient bucketing off).")
        if not isinstance(model, torch.nn.Module):
            raise TraceError(f"model has type {type(model).__name__}, but autoshard traces torch.nn.Module instances.")
        self.bucket_cap_mb = bucket_cap_mb
        self.bucketer = None
        self.mesh = mesh
        self.options = options
        self._device = torch.device(device) if device is not None else None
        self._comm = comm
        self._timeout = timeout
        self.plan: Plan | None = None
        self._local_box: tuple = ()  # this rank's program, when made (boxed: its tensors are published, not children)
        self._published: dict = {}
        self._bound: dict = {}
        self._views: dict = {}  # the alias each DTensor parameter's calls read (autoshard.runtime.parameters.bound)
        self._other_box: tuple = ()  # the other mode's program, when made (boxed: not a child module)
        self._shape_programs: dict = {}  # (training, input signature) -> program for inputs unlike the examples
        self._planned_signatures: set = set()  # signatures of calls whose inputs are the examples' (this rank's)
        self._compile_options: dict | None = None  # torch.compile's options for the programs (None: eager)
        self._compiled: dict = {}  # id(program) -> (program, its compiled runner)
        self._said: set = set()  # the warnings its plans gave (autoshard.runtime.notices.said_once)
        self._call_numbers: dict = {}  # (input signature, sync flag) -> the number the agreement check compares
        self._in_place = None  # the model sharded in place (autoshard.shard): its own tree holds this rank's shards
        if new_shapes not in ("plan", "error"):
            raise AutoshardError(f"option new_shapes is {new_shapes!r}, but must be 'plan' (a call with inputs "
                                 "unlike the example's is planned for them) or 'error'.")
        self.new_shapes = new_shapes
        self._expected: list | None = None
        self._initialised = True  # False while this rank's shards are uninitialised memory (a meta-built model)
        self._grad_sync = True  # False under no_sync() / set_requires_gradient_sync(False)
        self._skeleton_box = (meta_skeleton(model),)  # boxed: its meta tensors are not this module's parameters
        self._traced_training = model.training
        self.training = model.training
        self._model = (model,)  # until the plan has its weights (a tuple keeps it out of this module's children)
        self._applied_to = ()  # autoshard.apply's model until this rank's shards are made
        self._examples = None
        if planned is not None:  # autoshard.apply: the plan is made, and made for this model
            self._adopt(planned, model, *planned.examples)
            self._applied_to = (model,)  # whose weights this rank's shards take (see materialize)
        elif example_inputs is not None or example_kwargs is not None:
            args = () if example_inputs is None else (
                example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,))
            self._build_plan(tuple(args), dict(example_kwargs or {}))

    @property
    def local(self) -> torch.fx.GraphModule | None:
        """This rank's program (a plain GraphModule over local tensors), once made by :meth:`materialize`."""
        return self._local_box[0] if self._local_box else None

    #: what checkpoint and materialize code recognises a ShardedModule by (they do not import this module)
    AUTOSHARD_SHARDED = True

    @property
    def skeleton(self) -> torch.nn.Module:
        """The model's module tree on the meta device (names, classes, init code; no tensor memory)."""
        return self._skeleton_box[0]

    @property
    def unread_state(self) -> dict[str, torch.Tensor]:
        """State entries the program never reads (unused parameters and buffers), kept whole."""
        return self._unread

    @property
    def initialised(self) -> bool:
        """False while this rank's shards are uninitialised memory (a meta-built model before init or load)."""
        return self._initialised

    def mark_initialised(self) -> None:
        """Called once this rank's shards hold values (``init_weights``, ``autoshard.load``)."""
        self._initialised = True

    def need_plan(self) -> Plan:
        """The plan, or an error saying how to make one (call the module once, or pass example inputs)."""
        return self._need_plan()

    @property
    def _skeleton(self) -> torch.nn.Module:
        return self._skeleton_box[0]

    # ---- the plan ---------------------------------------------------------------------------------------
    def _build_plan(self, args: tuple, kwargs: dict) -> None:
        model = self._model[0]
        comm = self._job_communicator()
        from autoshard.runtime.notices import said_once

        with said_once(self._said):
            device = self._run_device()  # used only by a model on meta: it is traced for where it will run
            plan = (build_plan(model, self.mesh, args, kwargs, self.options, device=device) if comm is None
                    else plan_once(comm, model, self.mesh, args, kwargs, self.options, device=device))
        self._adopt(plan, model, args, kwargs)

    def _adopt(self, plan: Plan, model, args: tuple, kwargs: dict) -> None:
        """Take ``plan`` (made for ``model`` on the global examples ``args``/``kwargs``) as this module's plan."""
        self._traced_training = plan.training
        with RANK_THREADS.exclusive():  # the model may be shared with simulated ranks (threads) that trace it now
            self.plan = plan
            self._examples = (args, kwargs)
            structure, leaves = self._signature(args, kwargs)
            self._example_structure = structure
            self._example_values = [tuple(v) for kind, *v in leaves if kind == "value"]
            self._unread = self._unread_state(model)
            self._digest = self.plan.digest()  # what every rank's plan must equal (agreement.check_call)
            self._call_numbers = {}
        self._model = ()  # the plan's graph holds the weights until this rank's shards are made

    def _run_device(self) -> torch.device:
        """The device this rank's programs run on, which a model on the meta device is traced for (the skeleton of
        the other mode's and new shapes' programs, a meta-built model): that of this rank's tensors once made
        (:attr:`device`); before, that of the plan's weights where it holds real ones (what ``simulate`` runs on),
        else :attr:`device` (where :meth:`materialize` will put them)."""
        if self.local is None and self.plan is not None:
            gm = self.plan.graph_module
            found = next((t.device for t in (*gm.parameters(), *gm.buffers()) if not t.is_meta), None)
            if found is not None:
                return found
        return self.device

    def _planned_once(self, comm, model, args: tuple, kwargs: dict, options: Options, pinned=None) -> Plan:
        return plan_once(comm, model, self.mesh, args, kwargs, options, pinned)

    def _job_communicator(self):
        """This rank's communicator when every rank of the job plans at this point together (a process of a
        torch.distributed job, or a simulator rank's own thread), else None."""
        if self.mesh.size == 1:
            return None
        comm = self._comm
        if comm is None:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                return None
            comm = self.communicator()
        return job_communicator(self.mesh, comm)

    def _unread_state(self, model) -> dict[str, torch.Tensor]:
        """State entries the program never reads (unused parameters and buffers): kept whole, as the model has
        them (checkpoints save them)."""
        from autoshard import meta as M

        gm = self.plan.graph_module
        read = {a for n in gm.graph.nodes if n.op == "get_attr" for a in n.meta.get(M.ALIASES, (n.target,))}
        rewrite = gm.meta.get(M.MOE_REWRITE)  # a dense FFN's weights that an MoE layer replaced: gone, not unread
        replaced = rewrite.replaced() if rewrite is not None else frozenset()
        return {k: v for k, v in model.state_dict(keep_vars=True).items() if k not in read and k not in replaced}

    def _need_plan(self) -> Plan:
        if self.plan is None:
            raise AutoshardError("this ShardedModule has no plan yet: it compiles on its first call. Call it once "
                                 "with a batch, or pass example_inputs= to autoshard.compile to plan ahead of time.")
        return self.plan

    def show(self, console=None) -> None:
        self._need_plan().show(console)

    def code(self, rank: int = 0) -> str:
        return self._need_plan().code(rank)

    def rank_program(self, rank: int) -> torch.fx.GraphModule:
        return self._need_plan().rank_program(rank)

    def format(self) -> str:
        return self._need_plan().format()

    # ---- this rank's shards -----------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """Where this rank's shards live (``compile(device=...)``, default :func:`default_device`)."""
        if self._device is None:
            self._device = default_device()
        return self._device

    @property
    def rank(self) -> int:
        return self.communicator().rank

    @property
    def data_parallel_rank(self) -> int:
        """Which chunk of the global batch this rank passes: its coordinate on the data axis (0 without one).
        Ranks that differ only on other axes (model, context, expert) pass the same chunk."""
        axis = self.options.data_axis
        return self.mesh.coords(self.rank)[axis] if axis in self.mesh.names else 0

    @property
    def data_parallel_size(self) -> int:
        """Into how many chunks the global batch is cut: the data axis's size (1 without one)."""
        axis = self.options.data_axis
        return self.mesh.axis_size(axis) if axis in self.mesh.names else 1

    def _rank_known(self) -> bool:
        """Whether this process's rank is known without a call (a communicator given, or torch.distributed up)."""
        if self._comm is not None:
            return True
        import torch.distributed as dist

        return dist.is_available() and dist.is_initialized()

    def materialize(self) -> torch.fx.GraphModule:
        """Make this rank's program now (done on first use: ``parameters()``, ``init_weights()``, a call): only
        this rank's shards, on :attr:`device` — copied from the model, or uninitialised memory for a model built on
        the meta device (then :meth:`init_weights` or ``autoshard.load`` fills them). The plan keeps no weight
        afterwards."""
        if self.local is not None:
            return self.local
        plan = self._need_plan()
        comm = self.communicator()
        # Simulated ranks may share one applied plan (autoshard.apply of one Plan on every rank thread): its graph
        # holds the weights of the model applied last, and the first rank to make its shards releases them. So a
        # rank binds its own model's weights, makes its program and releases them in one step.
        with RANK_THREADS.exclusive():
            if self._applied_to:
                plan.bind_weights(self._applied_to[0])
            local = plan.rank_program(comm.rank, bucket_grads=self.bucketing)
            plan.release_weights()
        self._applied_to = ()
        tensors = [*local.parameters(), *local.buffers()]
        if any(t.is_meta for t in tensors):
            local.to_empty(device=self.device)
            self._initialised = False
        else:
            local.to(self.device)
        self._local_box = (local,)
        local.train(self.training)
        self._expected = self._expected_local_shapes()
        self._unread = {k: v if v.is_meta else v.detach().to(self.device) for k, v in self._unread.items()}
        self._publish()
        if self.bucketing:
            from autoshard.runtime.buckets import GradBucketer

            public = {target: (holder._parameters if is_param else holder._buffers)[attr]
                      for target, holder, attr, is_param in self._published_targets(local)}
            self.bucketer = GradBucketer(local, comm=comm, bucket_cap_mb=self.bucket_cap_mb, public=public)
        return local

    def init_weights(self, init=None) -> None:
        """Initialise this rank's shards by the model's own initialisation, run module by module on the
        skeleton (each module's ``reset_parameters()``, or a Hugging Face model's ``_init_weights``; or
        ``init(module)``): with the same seed, bit for bit the slices of the single-device model after
        ``to_empty`` and the same initialisation in the same order (see :mod:`autoshard.api.materialize`)."""
        from autoshard.api import materialize

        self.materialize()
        materialize.init_weights(self, init)
        self._initialised = True

    # ---- the model's tree of DTensor parameters (autoshard/runtime/parameters.py) ---------------------------------
    def parameters(self, recurse: bool = True):
        self._parameters_ready()  # at the call, as before the first call there is nothing to list
        return super().parameters(recurse)

    def buffers(self, recurse: bool = True):
        self._parameters_ready()
        return super().buffers(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """This rank's parameters under the model's own names, in the model's order (a tied weight under its first
        name, as ``model.named_parameters()`` gives it), each a ``DTensor`` placed as the plan stores it: name-based
        parameter groups, ``clip_grad_norm_`` and optimizers work as on one device."""
        self._parameters_ready()
        return super().named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        self._parameters_ready()
        return super().named_buffers(prefix, recurse, remove_duplicate)

    def state_dict(self, *args, **kwargs):
        """The keys of ``model.state_dict()`` (every name of a tied weight); values are ``DTensor``s (this rank's
        shards with their global layout) — DCP saves each shard once at its global offsets. Entries the program
        never reads are whole tensors, as the model has them."""
        self._parameters_ready()
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """As ``nn.Module.load_state_dict``, by the model's names: values may be DTensors (of any layout: they are
        redistributed) or whole tensors (this rank takes its slices)."""
        self._parameters_ready()
        if assign:
            raise AutoshardError("load_state_dict(assign=True) would replace the tensors this rank's program reads; "
                                 "load with assign=False (the values are copied into the shards).")
        mine = dict(super().state_dict(keep_vars=True))
        return super().load_state_dict(prepared_state(mine, state_dict), strict=strict)

    def _apply(self, fn, recurse: bool = True):
        raise AutoshardError("a ShardedModule's shards are placed by autoshard.compile: moving or casting them "
                             "(.to(), .cuda(), .half(), ...) would leave the compiled program behind. Pass "
                             "device=... (and precision=autoshard.MixedPrecision(...)) to autoshard.compile instead.")

    def _publish(self) -> None:
        """Give this module the model's tree of this rank's tensors as DTensors (:func:`build_tree`), sharing
        storage with the program's, and note where each program tensor is published (for :meth:`_bindings`)."""
        from autoshard import meta as M
        from autoshard.runtime.parameters import build_tree, device_mesh, fill_tree
        from autoshard.placements import Replicate
        from autoshard.frontend.trace import fetch_attr

        local = self.local
        held: dict[str, tuple] = {}
        for n in self.plan.graph_module.graph.nodes:
            if n.op == "get_attr" and isinstance(n.meta.get("val"), torch.Tensor):
                t = fetch_attr(local, n.target)
                for alias in n.meta.get(M.ALIASES, (n.target,)):
                    held[alias] = (t, n.meta[M.SPEC], tuple(n.meta["val"].shape))
        whole = (Replicate(),) * self.mesh.ndim
        for name, t in self._unread.items():
            held.setdefault(name, (t, whole, tuple(t.shape)))
        dm = device_mesh(self.mesh, self.device.type)
        if dm is None and self.mesh.size > 1:
            import warnings

            warnings.warn(f"no torch.distributed process group in this thread, so this rank's parameters of mesh "
                          f"{self.mesh} are its local shards as plain tensors, not DTensors: clip_grad_norm_, DCP "
                          "and the state_dict helpers would see local values. Initialise torch.distributed "
                          "(torchrun), or run ranks with autoshard.runtime.SimWorld.run.", stacklevel=3)
        if self._in_place is not None:  # autoshard.shard: the model's own modules hold the DTensors
            rewrite = self.plan.graph_module.meta.get(M.MOE_REWRITE)
            replaced = rewrite.replaced() if rewrite is not None else frozenset()
            public = fill_tree(self._in_place, held, dm, replaced)
            children = dict(self._in_place._modules)
            top = {**self._in_place._parameters, **self._in_place._buffers}
        else:
            children, top, public = build_tree(self._skeleton, held, dm)
        for name, module in children.items():
            if hasattr(type(self), name) or name in self.__dict__:
                raise PlanError(f"the model's top-level module `{name}` has the name of a ShardedModule attribute, "
                                "so its parameters cannot keep their names: rename that module in the model.")
            self.add_module(name, module)
        for name, t in top.items():
            if isinstance(t, torch.nn.Parameter):
                self.register_parameter(name, t)
            else:
                self.register_buffer(name, t, persistent=name not in self._skeleton._non_persistent_buffers_set)
        where = {}
        tree = self._in_place if self._in_place is not None else self
        for path, module in tree.named_modules(remove_duplicate=False):
            for table, is_param in ((module._parameters, True), (module._buffers, False)):
                for attr, t in table.items():
                    if t is not None:
                        key = next((k for k, v in public.items() if v is t), None)
                        if key is not None:
                            where.setdefault(key, (module, attr, is_param))
        self._published = where  # id(program tensor) -> (holder module, attribute, is parameter)
        self._bound = {}
        self._views = {}

    def _published_targets(self, program: torch.fx.GraphModule):
        """(program target, holder module, holder attribute, is parameter) of every published program tensor."""
        for _, named in ((True, program.named_parameters(remove_duplicate=False)),
                            (False, program.named_buffers(remove_duplicate=False))):
            for target, t in named:
                found = self._published.get(id(t))
                if found is not None:
                    yield target, found[0], found[1], found[2]

    def _bindings(self, program: torch.fx.GraphModule) -> list:
        """(program owner, attribute, is parameter, holder table, holder attribute) of every program tensor that is
        published (the holder table: its holder module's ``_parameters`` or ``_buffers``): the rows
        :func:`autoshard.runtime.parameters.bound` swaps in for a call, each the tensor the holder has at the call."""
        found = self._bound.get(id(program))
        if found is not None:
            return found
        out = []
        for table_name, is_param in (("_parameters", True), ("_buffers", False)):
            for owner in program.modules():
                for attr, t in getattr(owner, table_name).items():
                    target = self._published.get(id(t)) if t is not None else None
                    if target is not None:
                        holder, held, held_param = target
                        out.append((owner, attr, is_param, holder._parameters if held_param else holder._buffers,
                                    held))
        self._bound[id(program)] = out
        return out

    def _parameters_ready(self) -> None:
        if self.local is not None:
            return
        if self.plan is not None and (self._rank_known() or self.mesh.size == 1):
            self.materialize()
            return
        if self.plan is not None:
            raise AutoshardError("ShardedModule has no parameters yet: which shards this process holds depends on "
                                 "its rank, and torch.distributed is not initialised. Call "
                                 "torch.distributed.init_process_group first (torchrun), or pass comm=, or call "
                                 "the module once.")
        raise AutoshardError("ShardedModule has no parameters before its first call (the plan decides how "
                             "they are sharded). Call it once with a batch before building the optimizer, or "
                             "pass example_inputs= (or example_kwargs=) to autoshard.compile.")

    def communicator(self):
        if self._comm is None:
            from autoshard.runtime.communicator import current

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
                from autoshard.runtime.sim import SimWorld

                self._comm = SimWorld(self.mesh, timeout=self._timeout).communicator(0)  # one rank: no peers
            else:
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

    def train(self, mode: bool = True):
        """As the model's own ``train()``/``eval()``: the next call runs the program traced in that mode."""
        if not isinstance(mode, bool):
            raise TypeError("training mode is expected to be boolean")
        super().train(mode)
        for program in (*self._local_box, *self._other_box):
            if program is not None:
                program.train(mode)
        # a program planned for new inputs runs in the mode it was traced in (it is chosen by mode)
        return self

    def forward(self, *args, **kwargs):
        comm = self.communicator()
        if self.plan is None:
            self._build_plan(*self._global_examples(args, kwargs))
        self.materialize()
        if not self._initialised:
            raise AutoshardError("this rank's shards are uninitialised memory (the model was built on the meta "
                                 "device): call sharded.init_weights() or autoshard.load(sharded, path) first.")
        signature = self._signature(args, kwargs)
        planned = self._is_planned_call(signature, args, kwargs)
        training, sync = self.training, self._grad_sync
        number = self._call_numbers.get((signature, sync))
        if number is None:
            from autoshard.runtime.agreement import digest_number

            number = self._call_numbers[(signature, sync)] = digest_number(
                f"{self._digest}/sync={sync}/inputs={_digest_of(signature)}")
        # The agreement check (every rank makes this call with the same plan, mode, grad mode, sync flag and input
        # signature) runs during the forward where it can: started here, settled by the communicator before the
        # program's first collective (and at the end of the forward at the latest). A program not made yet is
        # planned by every rank together after the check has settled; one that may change state before its first
        # collective runs after it too.
        program = self._known_program(training, signature, planned)
        from autoshard.runtime import agreement

        overlap = program is not None and agreement.quiet_until_collective(program)
        # on two ranks on the host, the check's own exchange may do the program's first collective where that is a
        # small all-reduce (a data-parallel loss): one exchange where there were two
        carry = overlap and agreement.can_carry(comm) and agreement.first_collective_carries(program)
        agreement.check_call(comm, number, training,
                             lambda: {"call": {"gradient sync": sync, "inputs": _describe(signature)},
                                      **self.plan.layout()}, overlap=overlap, carry=carry)
        try:
            if program is None:
                program = self._program(training, signature, planned, args, kwargs)
            from autoshard.runtime.parameters import bound
            from autoshard.runtime.communicator import backward_uses, use
            from autoshard.runtime.grad_sync import syncing
            from autoshard.runtime.zero import running

            run = self._compiled_runner(program) if self._compile_options is not None else program
            with use(comm), running(program), bound(self._bindings(program), self._views), \
                    syncing(sync, self.bucketer):
                out = run(*args, **kwargs)
                comm.settle()  # a program without a collective in its forward: the check's verdict before returning
        except Exception:
            comm.settle()  # where the ranks differ, that is the error every rank raises; else the forward's own
            raise
        except BaseException:
            comm.forget_pending()
            raise
        return backward_uses(out, comm)

    def _known_program(self, training: bool, signature, planned: bool) -> torch.fx.GraphModule | None:
        """The program :meth:`_program` gives for this call if it is made already, else None (making it plans)."""
        if planned:
            if training == self._traced_training:
                return self.local
            return self._other_box[0] if self._other_box else None
        return self._shape_programs.get((training, signature))

    # ---- one program per mode and input shapes ----------------------------------------------------------
    @staticmethod
    def _signature(args, kwargs) -> tuple:
        """What selects a program: the inputs' structure, each tensor's shape and dtype, each other value."""
        if not kwargs and all(type(x) is torch.Tensor for x in args):  # the usual call: its structure known by count
            structure = _POSITIONAL.get(len(args))
            if structure is None:
                structure = _POSITIONAL[len(args)] = str(pytree.tree_flatten(((0,) * len(args), {}))[1])
            return (structure, tuple([("tensor", tuple(x.shape), str(x.dtype)) for x in args]))
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        out = []
        for x in leaves:
            if isinstance(x, torch.Tensor):
                out.append(("tensor", tuple(x.shape), str(x.dtype)))
            else:
                try:
                    hash(x)
                    out.append(("value", type(x).__name__, x))
                except TypeError:
                    out.append(("value", type(x).__name__, repr(x)))
        return (str(spec), tuple(out))

    def _is_planned_call(self, signature, args, kwargs) -> bool:
        """Whether this call's inputs are those the plan was made for (this rank's shapes of the example inputs,
        the same other values); else the inputs are checked (a dtype that differs is an error, as is any
        difference with ``new_shapes="error"``) and a program is planned for them (:meth:`_program`)."""
        from autoshard.frontend.inputs import ExpectedInput, check_inputs, tensor_leaves

        if signature in self._planned_signatures:
            return True
        tensors = tensor_leaves(args, kwargs)
        expected = self._expected
        same_layout = len(tensors) == len(expected) and signature[0] == self._example_structure
        same_values = [tuple(v) for kind, *v in signature[1] if kind == "value"] == self._example_values
        if same_layout and same_values and all(tuple(x.shape) == e.local_shape and x.dtype == e.dtype
                                               for x, e in zip(tensors, expected)):
            self._planned_signatures.add(signature)
            return True
        if self.new_shapes == "error":
            self._check_inputs(args, kwargs)  # names the input and both shapes
            raise RuntimeShapeError(f"ShardedModule.forward was called with inputs unlike the example inputs "
                                    f"({_describe(signature)}), and new_shapes='error'. Pass inputs like the "
                                    "example's, or new_shapes='plan' (the default) to plan new inputs on the fly.")
        if same_layout:
            for x, e in zip(tensors, expected):
                # the plan's dtype is not changed by a call: a dtype that differs is the usual error
                check_inputs([ExpectedInput(e.name, e.global_shape, tuple(x.shape), e.dtype)], [x], local=True,
                             where="ShardedModule.forward")
        return False

    def _program(self, training: bool, signature, planned: bool, args, kwargs) -> torch.fx.GraphModule:
        """This rank's program for a call in mode ``training`` with inputs of ``signature``: the plan's own (or
        its other mode's) for the planned inputs; for others a program planned on first use with every parameter
        and buffer pinned to its layout in the plan, sharing this rank's tensors (cached per mode and inputs)."""
        if planned:
            return self.local if training == self._traced_training else self._program_of_other_mode()
        key = (training, signature)
        program = self._shape_programs.get(key)
        if program is not None:
            return program
        examples = self._global_examples(args, kwargs)
        plan = self._pinned_plan(training, examples)
        program = plan.rank_program(self.communicator().rank, bucket_grads=self.bucketing, local_weights=self.local,
                                  check_inputs=False)
        program.train(training)
        self._shape_programs[key] = program
        count = len({sig for _, sig in self._shape_programs})
        if count == self.NEW_SHAPES_WARNING:
            from autoshard.runtime.notices import notice

            notice(f"autoshard: {self.NEW_SHAPES_WARNING} input shapes beyond the example's planned so far (each "
                   "one is traced and planned on its first call): pad or bucket inputs to a few shapes.")
        return program

    #: after this many new input shapes, a notice suggests padding or bucketing inputs
    NEW_SHAPES_WARNING = 8

    # ---- gradient accumulation without sync (DDP's no_sync, FSDP2's set_requires_gradient_sync) -------------
    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """As FSDP2's: ``False`` makes the backward of the following calls keep each parameter gradient
        unreduced (accumulated on this rank), until a call made with it ``True`` again reduces the sum at once —
        the same gradients as syncing every micro-step, with one sync per parameter instead of one per micro-step.
        Every rank must set it alike (each call checks)."""
        if not isinstance(requires_gradient_sync, bool):
            raise AutoshardError(f"set_requires_gradient_sync takes True or False, not {requires_gradient_sync!r}.")
        if not requires_gradient_sync and not self.bucketing:
            raise AutoshardError("gradient sync cannot be skipped with bucket_cap_mb=0: the program then reduces "
                                 "each gradient inside backward. Leave bucket_cap_mb at its default (or > 0) to use "
                                 "no_sync() / set_requires_gradient_sync(False).")
        self._grad_sync = requires_gradient_sync

    @property
    def require_backward_grad_sync(self) -> bool:
        """DDP's attribute: whether the next backward syncs gradients (settable)."""
        return self._grad_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self.set_requires_gradient_sync(value)

    @contextlib.contextmanager
    def no_sync(self):
        """As DDP's: the calls inside accumulate gradients without syncing them; the first call after it syncs
        everything accumulated (call its backward outside the block, as with DDP)."""
        was = self._grad_sync
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self._grad_sync = was

    def _program_of_other_mode(self) -> torch.fx.GraphModule:
        """The program of the mode the plan was not traced in: the skeleton traced in that mode, every
        parameter and buffer pinned to its layout in the plan, sharing this rank's tensors."""
        if self._other_box:
            return self._other_box[0]
        other = self._other_mode_plan()
        program = other.rank_program(self.communicator().rank, bucket_grads=self.bucketing, local_weights=self.local,
                                  check_inputs=False)
        program.train(self.training)
        self._other_box = (program,)
        return program

    def simulate(self, args=(), kwargs=None, backward: bool = True, timeout: float = 120.0):
        """Run every rank of this module's plan in this process (one thread each), in this module's mode (after
        ``eval()`` the eval program: no dropout, running statistics): :meth:`autoshard.compiler.plan.Plan.simulate`
        of the plan of that mode. Needs the model's weights (before the first call, as ``plan.simulate``)."""
        return self._plan_in_mode(self.training).simulate(args, kwargs, backward, timeout)

    def _plan_in_mode(self, training: bool) -> Plan:
        """The plan of mode ``training`` with the plan's weights (what ``Plan.simulate`` runs in that mode)."""
        plan = self._need_plan()
        if training == self._traced_training:
            return plan
        if any(t.is_meta for t in plan.graph_module.parameters()):
            raise AutoshardError(f"Plan.simulate in {'training' if training else 'eval'} mode needs the model's "
                                 "weights, but this plan holds none any more (this rank's program was made, or the "
                                 "model is on the meta device): simulate before the first call, on a fresh compile.")
        return self._other_mode_plan(training).with_weights_of(plan)

    def _other_mode_plan(self, training: bool | None = None) -> Plan:
        """The plan of the mode the model was not traced in, traced from the skeleton with every parameter pinned to
        its layout in the plan (the skeleton's meta tensors as weights)."""
        training = (not self._traced_training) if training is None else training
        return self._pinned_plan(training, self._examples)

    def _pinned_plan(self, training: bool, examples: tuple) -> Plan:
        """A plan of the skeleton traced in mode ``training`` on the global ``examples`` (args, kwargs) for the
        device the program runs on (:meth:`_run_device`), every parameter and buffer pinned to its layout in the plan
        (stored as the plan stores it), so that its program shares this rank's tensors; made by every rank together
        (:meth:`_planned_once`) where ranks plan at once."""
        plan = self._need_plan()
        specs = plan.param_specs()
        # the user's options as they are: the pass list itself leaves the eval program's activations to propagation
        # (autoshard.compiler.context.searches) and stores each parameter at its pinned stage
        pin = Pinned.of_plan(plan)
        skeleton = self._skeleton
        was = skeleton.training
        skeleton.train(training)
        from autoshard.runtime.notices import said_once

        try:
            comm = self._job_communicator()
            with said_once(self._said):  # what the plan warned about is not said again
                # traced as FakeTensors on the run device, not on meta: model code that branches on a tensor's
                # device type (Hugging Face Mixtral's load-balancing loss) takes the branch it takes when it runs
                other = plan_once(comm, skeleton, self.mesh, *examples, self.options, pin, device=self._run_device())
        finally:
            skeleton.train(was)
        moved = {k: (specs[k], v) for k, v in other.param_specs().items() if k in specs and specs[k] != v}
        if moved:
            first = min(moved)
            raise PlanError(f"the {'training' if training else 'eval'}-mode program lays out "
                            f"{sorted(moved)[:3]} differently from the plan ({moved[first]}), so it "
                            "cannot share this rank's tensors. Annotate those parameters (annotations=...) to fix one "
                            "layout.")
        return other

    # ---- torch.compile ------------------------------------------------------------------------------------
    def compile_programs(self, **options) -> None:
        """Run every program of this module through ``torch.compile(program, **options)`` from the next call on
        (what ``torch.compile`` of an in-place sharded model, its ``compile()``, or a compiled block of it asks
        for: autoshard runs the model as one traced program per mode and input shapes, so that program is what is
        compiled). Dynamo captures a rank program whole: the collectives are ``torch.library`` ops."""
        options = dict(options)
        if self._compile_options != options:
            self._compile_options = options
            self._compiled = {}

    def _compiled_runner(self, program: torch.fx.GraphModule):
        found = self._compiled.get(id(program))
        if found is None:
            found = (program, torch.compile(program, **self._compile_options))
            self._compiled[id(program)] = found
        return found[1]

    def _global_examples(self, args, kwargs):
        n = self.mesh.axis_size(self.options.data_axis) if self.options.data_axis in self.mesh.names else 1

        def grow(x):
            if isinstance(x, torch.Tensor) and x.dim() >= 1:
                return x.repeat(n, *([1] * (x.dim() - 1)))
            return x

        return pytree.tree_map(grow, tuple(args)), pytree.tree_map(grow, dict(kwargs))

    def _expected_local_shapes(self):
        from autoshard.frontend.inputs import expected_inputs

        return expected_inputs(self.plan.graph_module, self.mesh)

    def _check_inputs(self, args, kwargs) -> None:
        from autoshard.frontend.inputs import check_inputs, tensor_leaves

        check_inputs(self._expected, tensor_leaves(args, kwargs), local=True, where="ShardedModule.forward")


#: {number of positional arguments: the pytree structure of a call with that many tensors and no keywords}
_POSITIONAL: dict[int, str] = {}


def _digest_of(signature) -> str:
    import hashlib

    return hashlib.sha256(repr(signature).encode()).hexdigest()[:16]


def _describe(signature) -> str:
    parts = [f"{list(v[1])} {v[2].replace('torch.', '')}" if v[0] == "tensor" else f"{v[2]!r}"
             for v in signature[1]]
    return ", ".join(parts) if parts else "no inputs"


def prepared_state(mine: dict, state_dict: dict) -> dict:
    """``state_dict`` made loadable into a module whose tensors are ``mine`` (``state_dict(keep_vars=True)``): a
    whole tensor for a DTensor entry becomes this rank's slices of it (no collective); DTensors of any layout are
    left to ``DTensor.copy_`` (which redistributes)."""
    prepared = {}
    for key, value in state_dict.items():
        held = mine.get(key)
        if isinstance(held, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            value = local_slice(value, held)
        prepared[key] = value
    return prepared
