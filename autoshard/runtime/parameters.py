"""What a :class:`~autoshard.api.sharded_module.ShardedModule` hands to the world: ``DTensor`` parameters in the model's
own tree.

A rank program (a plain ``GraphModule``) computes on local tensors. What user code sees is PyTorch's convention
for a distributed module (FSDP2, ``parallelize_module``): every parameter is an ``nn.Parameter`` that is a
``DTensor`` on a ``DeviceMesh`` with the autoshard mesh's axis names and sizes, placed as the plan *stores* it
(ZeRO = ``Shard`` on the data axis), with the global shape. So ``torch.nn.utils.clip_grad_norm_`` (a norm reduced
over the mesh), DCP (global offsets instead of same-key dedup), ``torch.distributed.checkpoint.state_dict`` and
optimizers are exact without knowing about autoshard.

How the two meet, with no copy and no extra collective:

* :func:`build_tree` makes one plain ``nn.Module`` per module path of the model (same paths, same order, tied
  weights one object under each name) holding the DTensors; the :class:`ShardedModule` registers its top-level
  children and parameters as its own, so ``named_parameters()``, ``state_dict()``, ``load_state_dict()`` and
  ``get_model_state_dict`` walk the model's names.
* Each DTensor's local tensor *is* the tensor registered in the rank program (same object): writes by
  ``init_weights``, ``autoshard.load`` or DCP land where the program reads.
* :func:`bound` swaps, for one call, every parameter the program reads for ``param.to_local()`` — differentiable,
  an alias made once per parameter — so autograd carries the program's gradient (already synced by the program's
  own collectives) back as a DTensor ``p.grad`` with the parameter's placements.

Where no process group exists (one rank, no ``torch.distributed``), a DeviceMesh cannot be built; parameters then
are the whole tensors, as on the model. :func:`device_mesh` says which.
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch
from torch.distributed.tensor import DTensor, Placement

from autoshard.errors import AutoshardError
from autoshard.mesh import Mesh

__all__ = ["bound", "build_tree", "clip_grad_norm_", "default_device", "device_mesh", "fill_tree", "like", "local_of",
           "local_slice", "placements_of"]

_MESHES: dict = {}
_MESHES_LOCK = threading.Lock()


def device_mesh(mesh: Mesh, device_type: str):
    """The ``DeviceMesh`` of ``mesh`` over this thread's default process group (cached per group), or None where
    ``torch.distributed`` is not initialised (in this thread: the simulator gives each rank thread its own)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.group.WORLD
    if dist.get_world_size(world) != mesh.size:
        raise AutoshardError(f"the process group has {dist.get_world_size(world)} ranks, but the mesh {mesh} has "
                             f"{mesh.size}: launch {mesh.size} processes (torchrun --nproc-per-node {mesh.size}).")
    key = (mesh, id(world), device_type)
    with _MESHES_LOCK:
        found = _MESHES.get(key)
    if found is not None and found[0]() is world:
        return found[1]
    dm = mesh.to_device_mesh(device_type)
    import weakref

    with _MESHES_LOCK:
        _MESHES[key] = (weakref.ref(world), dm)
    return dm


def default_device() -> torch.device:
    """``cuda:LOCAL_RANK`` where CUDA is available (torchrun sets ``LOCAL_RANK``), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def forget_meshes() -> None:
    """Drop the cached DeviceMeshes and their process groups (``autoshard.runtime.shutdown()`` calls it before
    destroying the groups), and DTensor's own caches of sharding propagation, whose entries keep the DeviceMesh of
    every DTensor op run so far (and through it that mesh's process groups, with their gloo threads)."""
    with _MESHES_LOCK:
        meshes = [dm for _, dm in _MESHES.values()]
        _MESHES.clear()
    for dm in meshes:
        # DTensor parameters still alive (the user's module) keep their DeviceMesh, and it its process groups
        # (``_pg_registry``): they are being destroyed, and no collective can run on them after this
        getattr(dm, "_pg_registry", {}).clear()
    propagator = DTensor._op_dispatcher.sharding_propagator
    for cached in (propagator.propagate_op_sharding, getattr(propagator, "_propagate_tensor_meta_cached", None)):
        clear = getattr(cached, "cache_clear", None)
        if clear is not None:
            clear()
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # its C++ fast path's cache
    if clear_native is not None:
        clear_native()


def placements_of(spec) -> tuple[Placement, ...]:
    """An autoshard spec as DTensor placements (the vocabulary is DTensor's own)."""
    return tuple(spec)


def _dtensor(local: torch.Tensor, dm, spec, shape, requires_grad: bool | None) -> torch.Tensor:
    shape = torch.Size(shape)
    stride = torch.empty(shape, device="meta").stride()
    dt = DTensor.from_local(local.detach(), dm, placements_of(spec), run_check=False, shape=shape, stride=stride)
    if requires_grad is None:
        return dt
    return torch.nn.Parameter(dt, requires_grad=requires_grad)


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The local tensor behind a DTensor (the object itself, not a view); a plain tensor is its own."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _public_of(entry: tuple, dm, public: dict, requires_grad: bool | None) -> torch.Tensor:
    """The public tensor of ``entry`` (this rank's local tensor, stored spec, global shape), made once per local
    tensor (tied names share it): a DTensor over ``dm`` (a parameter where ``requires_grad`` is not None), or without
    a DeviceMesh the local tensor itself (as an ``nn.Parameter`` for a parameter)."""
    local, spec, shape = entry
    if id(local) not in public:
        if dm is not None:
            public[id(local)] = _dtensor(local, dm, spec, shape, requires_grad)
        else:
            public[id(local)] = local if requires_grad is None else torch.nn.Parameter(local, requires_grad)
    return public[id(local)]


def build_tree(skeleton: torch.nn.Module, held: dict[str, tuple[torch.Tensor, tuple, tuple]], dm
               ) -> tuple[dict[str, torch.nn.Module], dict[str, torch.Tensor], dict[int, torch.Tensor]]:
    """The model-shaped tree of this rank's tensors.

    ``held``: {model name of a parameter or buffer: (this rank's local tensor, stored spec, global shape)} — every
    name of a tied tensor. ``dm``: the DeviceMesh (None: whole tensors, one rank without a process group).
    Returns (top-level child modules by name, top-level parameters and buffers by name, {id(local tensor): its
    public tensor}). Module paths, their order and each module's own parameter/buffer order are the skeleton's,
    so ``named_parameters()`` and ``state_dict()`` walk in the model's order; a tensor shared by two names (tied)
    is one object under both, so ``named_parameters()`` gives it under its first name."""
    public: dict[int, torch.Tensor] = {}
    made: dict[int, torch.nn.Module] = {}  # id(skeleton module) -> holder (shared submodules stay shared)
    root_holder = torch.nn.Module()
    made[id(skeleton)] = root_holder
    for path, module in skeleton.named_modules(remove_duplicate=False):
        if id(module) in made and path:
            holder = made[id(module)]
        else:
            holder = made.setdefault(id(module), torch.nn.Module())
        holder.training = module.training
        if path:
            parent_path, _, leaf = path.rpartition(".")
            parent = root_holder.get_submodule(parent_path) if parent_path else root_holder
            if leaf not in parent._modules:
                parent.add_module(leaf, holder)
        prefix = f"{path}." if path else ""
        if holder._parameters or holder._buffers:
            continue  # a shared module already filled
        for name, p in module._parameters.items():
            if p is None:
                holder.register_parameter(name, None)
                continue
            entry = held.get(prefix + name)
            if entry is not None:
                holder._parameters[name] = _public_of(entry, dm, public, p.requires_grad)
        for name, b in module._buffers.items():
            entry = held.get(prefix + name)
            if b is None or entry is None:
                continue
            holder._buffers[name] = _public_of(entry, dm, public, None)
            if name in module._non_persistent_buffers_set:
                holder._non_persistent_buffers_set.add(name)
    placed = {f"{path}.{name}" if path else name
              for path, holder in root_holder.named_modules(remove_duplicate=False)
              for name in (*holder._parameters, *holder._buffers)}
    _place_new(root_holder, {k: v for k, v in held.items() if k not in placed}, dm, public)
    return dict(root_holder._modules), {**root_holder._parameters, **root_holder._buffers}, public


def _place_new(root: torch.nn.Module, new: dict[str, tuple[torch.Tensor, tuple, tuple]], dm,
               public: dict[int, torch.Tensor]) -> None:
    """Parameters the compiler created that the model does not have (an MoE layer's experts and router, under the
    dense FFN's path): registered under their names in new holder modules, trainable, so that
    ``named_parameters()``, optimizers, ``clip_grad_norm_`` and state dicts see them as they see the model's."""
    for name, entry in new.items():
        parent = root
        *path, leaf = name.split(".")
        for part in path:
            if part not in parent._modules:
                parent.add_module(part, torch.nn.Module())
            parent = parent._modules[part]
        parent._parameters[leaf] = _public_of(entry, dm, public, True)


def fill_tree(model: torch.nn.Module, held: dict[str, tuple[torch.Tensor, tuple, tuple]],
              dm, replaced: frozenset[str] = frozenset()) -> dict[int, torch.Tensor]:
    """:func:`build_tree` into the model itself (``autoshard.shard``, in place): each parameter and buffer of
    ``model`` named in ``held`` is replaced by its public tensor (a DTensor over ``dm``, or this rank's tensor as an
    ``nn.Parameter`` without one), keeping its ``requires_grad``; tied tensors stay one object. The model's own
    tensors are dropped; those named in ``replaced`` (a dense FFN an MoE layer replaced) are removed, and tensors
    the compiler created (the MoE layer's) are added under their names. Returns {id(local tensor): its public
    tensor}."""
    public: dict[int, torch.Tensor] = {}
    done: set[int] = set()
    for path, module in model.named_modules(remove_duplicate=False):
        if id(module) in done:
            continue  # a shared module: filled under its first path
        done.add(id(module))
        prefix = f"{path}." if path else ""
        for table, is_param in ((module._parameters, True), (module._buffers, False)):
            for name, t in list(table.items()):
                entry = held.get(prefix + name)
                if t is not None and entry is not None:
                    table[name] = _public_of(entry, dm, public, t.requires_grad if is_param else None)
                elif t is not None and entry is None and prefix + name in replaced:
                    del table[name]  # replaced by a layer the compiler made (an MoE layer's experts)
    placed = {f"{path}.{name}" if path else name for path, module in model.named_modules(remove_duplicate=False)
              for name in (*module._parameters, *module._buffers)}
    _place_new(model, {k: v for k, v in held.items() if k not in placed}, dm, public)
    return public


@contextlib.contextmanager
def bound(rows: list[tuple[torch.nn.Module, str, bool, dict, str]], views: dict | None = None):
    """Run a program on the public tensors: for each (owner module, attribute, is parameter, holder table, holder
    key) of ``rows`` the public tensor ``holder table[holder key]`` (a ``DTensor`` of the ShardedModule's tree) stands,
    for the duration, in place of the owner's own — as its ``to_local()``: a differentiable alias of its local tensor
    for a parameter that requires grad (its gradient comes back as a DTensor with the parameter's placements), the
    local tensor itself otherwise. Tied parameters (one public tensor under two attributes) share one alias.

    ``views``: {id(public tensor): (public tensor, its local tensor, alias)} kept by the caller across calls: a
    parameter's alias is made once and used by every call with gradients on while the parameter and its local tensor
    stay the same objects (an alias carries no saved tensor, so every backward may run through it; its version
    counter is the local tensor's). Without it, one alias per call.

    The alias is a plain attribute of its owner for the call (taken out of ``_parameters``/``_buffers``): tools
    that walk a called module's parameters (``MemTracker``, hooks) see the ShardedModule's DTensor leaves, never a
    non-leaf alias as a parameter."""
    grad = torch.is_grad_enabled()
    made = {} if views is None else views
    saved = []
    try:
        for owner, attr, is_param, holder, key in rows:
            t = holder[key]
            if isinstance(t, DTensor):
                local = t._local_tensor
                if grad and t.requires_grad:
                    entry = made.get(id(t))
                    if entry is None or entry[0] is not t or entry[1] is not local:
                        entry = made[id(t)] = (t, local, _LocalView.apply(t))
                    v = entry[2]
                else:
                    v = local
            else:
                v = t
            table = owner._parameters if is_param else owner._buffers
            saved.append((owner, table, attr, table.pop(attr)))
            owner.__dict__[attr] = v
        yield
    finally:
        for owner, table, attr, old in reversed(saved):
            owner.__dict__.pop(attr, None)
            table[attr] = old


#: DTensor's constructor proper (C++): ``DTensor(local, spec, requires_grad=False)`` without the Python wrappers
#: around its ``__init__`` (which does nothing), a third of the cost — paid per parameter and step
_new_dtensor = DTensor.__new__


def _wrap(local: torch.Tensor, spec) -> DTensor:
    """``local`` (the local tensor of a DTensor of ``spec``: its shape, stride and dtype) as that DTensor."""
    return _new_dtensor(DTensor, local, spec, requires_grad=False)


def like(local: torch.Tensor, template: torch.Tensor) -> torch.Tensor:
    """``local`` as a DTensor laid out as ``template`` (a DTensor); a plain template gives ``local`` itself.

    Not differentiable. Where ``local`` has the template's local shape, stride and dtype (a gradient of a
    parameter), the DTensor shares the template's spec — FSDP2's ``_from_local_no_grad``: no spec is built, which
    is most of ``from_local``'s cost, paid per parameter and step."""
    if not isinstance(template, DTensor):
        if hasattr(template, "device_mesh"):
            return DTensor.from_local(local, template.device_mesh, template.placements, run_check=False,
                                      shape=template.shape, stride=template.stride())
        return local
    mine = template._local_tensor
    if local.shape == mine.shape and local.dtype == mine.dtype and local.stride() == mine.stride():
        return _wrap(local, template._spec)
    return DTensor.from_local(local, template.device_mesh, template.placements, run_check=False,
                              shape=template.shape, stride=template.stride())


class _LocalView(torch.autograd.Function):
    """``p.to_local()`` of a DTensor parameter for the calls of the rank program: forward an alias of its local
    tensor (``detach()``: the same storage and version counter, no view of it, so an in-place update of the
    parameter — an optimizer step — leaves the alias's autograd node as it is), backward the gradient as a DTensor
    laid out as the parameter with the parameter's own spec (not one rebuilt per parameter and step as
    ``to_local``'s backward does). It saves no tensor, so one alias serves many calls and their backwards
    (:func:`bound`'s ``views``).

    Where the gradient would go straight into an empty ``p.grad`` — a ``backward()`` that accumulates into ``p``
    (not ``autograd.grad``), no hook on ``p``, no ``create_graph``, ``p.grad`` None — backward stores it there itself,
    as ``AccumulateGrad`` would (that step's case of a gradient it may take: ``p.grad`` the DTensor of ``grad
    .detach()``), and sends nothing on: ``AccumulateGrad`` on a DTensor leaf detaches the gradient through DTensor's
    dispatch, the larger part of this function's cost per parameter and step. A gradient that reaches ``p`` by
    another path too then adds to it there (one addition either way: the same sum)."""

    @staticmethod
    def forward(ctx, p: DTensor) -> torch.Tensor:  # noqa: D102 - see the class
        mine = p._local_tensor
        ctx.param, ctx.spec, ctx.local = p, p._spec, (mine.shape, mine.stride(), mine.dtype)
        ctx.set_materialize_grads(False)  # no gradient (a sync held back by no_sync) stays None, not zeros
        return mine.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None) -> DTensor | None:  # noqa: D102
        if grad is None:
            return None
        spec = ctx.spec
        if (grad.shape, grad.stride(), grad.dtype) != ctx.local:
            return DTensor.from_local(grad, spec.mesh, spec.placements, run_check=False, shape=spec.shape,
                                      stride=spec.stride)
        p = ctx.param
        if p.grad is None and not p._backward_hooks and not p._post_accumulate_grad_hooks and \
                not torch.is_grad_enabled() and not torch.compiler.is_compiling() and _accumulates(ctx):
            p.grad = _wrap(grad.detach(), spec)
            return None
        return _wrap(grad, spec)


def _accumulates(ctx) -> bool:
    """Whether this backward pass runs the parameter's ``AccumulateGrad`` (a ``backward()`` reaching it, not
    ``autograd.grad``, which torch refuses to answer for a leaf)."""
    try:
        return torch._C._will_engine_execute_node(ctx.next_functions[0][0])
    except RuntimeError:
        return False


def local_slice(full: torch.Tensor, template: DTensor) -> DTensor:
    """This rank's slices of a whole tensor, laid out as ``template``: cut locally, no collective (every rank
    holds the whole value)."""
    if tuple(full.shape) != tuple(template.shape):
        raise AutoshardError(f"a whole tensor of shape {list(full.shape)} cannot fill a parameter of global shape "
                             f"{list(template.shape)}: load a state dict of the same model.")
    out = full
    dm = template.device_mesh
    for i, p in enumerate(template.placements):
        if p.is_shard():
            out = out.chunk(dm.size(i), dim=p.dim)[dm.get_local_rank(i)]
    return like(out.to(template.device, template.dtype), template)


def clip_grad_norm_(module: torch.nn.Module, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for any autoshard module, pipelines included: the total norm of every
    gradient of the whole model, each parameter counted once, returned (a plain tensor) and used to clip on every
    rank.

    On a ShardedModule it is torch's own (DTensor gradients reduce over the mesh). A pipeline spreads parameters
    over stages: torch's function would see one stage's; here each stage's norm is reduced over its DeviceMesh,
    a weight tied across stages is counted on its first stage only, and the stages' norms are combined over the
    pipe axis (an all-reduce of the p-th powers, or of the maximum for ``inf``)."""
    import math

    import torch.distributed as dist

    runner = getattr(module, "runner", None)
    if runner is None:
        total = torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm, norm_type, error_if_nonfinite,
                                               foreach)
        return total.full_tensor() if isinstance(total, DTensor) else total
    runner = runner()
    first = {name: min(stages) for name, stages in _stages_holding(runner).items()}
    mine = runner.plan.stages_of(runner.rank)
    counted, everything = [], []
    for (name, _, dp), stage in zip(runner._pairs, _stage_per_pair(runner)):
        if dp.grad is None:
            continue
        everything.append(dp.grad)
        if first.get(name, stage) == stage and stage in mine:
            counted.append(dp.grad)
    norm_type = float(norm_type)
    if counted:
        norms = [torch.linalg.vector_norm(g, norm_type) for g in counted]
        norms = [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]
        local = torch.linalg.vector_norm(torch.stack(norms), norm_type).double()
    else:
        local = torch.zeros((), dtype=torch.float64)
    group = runner.group
    if math.isinf(norm_type):
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        total = local
    else:
        power = local.pow(norm_type)
        dist.all_reduce(power, group=group)
        total = power.pow(1.0 / norm_type)
    total = total.float()
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite, so it cannot be "
                           "clipped. To disable this error and scale the gradients by the non-finite norm anyway, "
                           "set `error_if_nonfinite=False`")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for g in everything:
            local_of(g).mul_(coef.to(local_of(g).dtype))
    return total


def _stages_holding(runner) -> dict[str, list[int]]:
    """{model name: every stage of the plan holding that parameter} (the same on every rank)."""
    public = runner.plan.microbatch_plan.public_names()
    out: dict[str, list[int]] = {}
    for sg in runner.plan.stages:
        for target in sg.params:
            out.setdefault(public.get(target, target), []).append(sg.index)
    return out


def _stage_per_pair(runner) -> list[int]:
    """The stage index of each of ``runner._pairs`` (made stage by stage, in ``stages_of`` order)."""
    out = []
    for m, s in zip(runner.modules, runner.plan.stages_of(runner.rank)):
        out.extend(s for _ in m.inner.named_parameters())
    return out
