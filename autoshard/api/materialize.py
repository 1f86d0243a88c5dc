"""A model that never exists whole on a rank: initialise and load only this rank's shards.

A model built under ``torch.device("meta")`` is compiled without allocating anything; the rank program then
holds uninitialised memory for this rank's shards only (``ShardedModule.materialize`` → ``to_empty``). Two ways
fill it:

* :func:`init_weights` — the model's own initialisation, run module by module on the meta *skeleton*
  (``ShardedModule.skeleton``): a Hugging Face ``PreTrainedModel`` in the order of its ``initialize_weights()``
  (transformers' ``smart_apply``: children before parents, a sub-``PreTrainedModel`` with its own
  ``_initialize_weights``; ``_is_hf_initialized`` honoured), any other model in ``model.modules()`` order calling
  ``reset_parameters()`` where a module has one, or ``init(module)`` in ``model.apply(init)`` order. For each
  module its own (``recurse=False``) parameters and buffers are made full-size on the device as temporaries,
  the init runs on them, this rank's slice is copied into the rank program, and the temporaries are freed: a rank
  never holds more than one module's own tensors whole. A tensor a module's init touches that is not its own
  (GPT-2's attention re-initialises ``c_proj.weight``) is made on first touch (a torch-function mode), filled
  with this rank's slice of what earlier modules wrote, and written back the same way.
* :func:`load_pretrained` — a Hugging Face directory (``model.safetensors`` or ``model.safetensors.index.json``
  and its shards): each rank reads only its slices (``safe_open(...).get_slice(name)[...]``), names mapped
  through the traced FQNs and their aliases (a tied weight is saved once under one of its names). Non-persistent
  buffers, never saved, are computed as init computes them (a rotary module's ``inv_freq``).

Equality with one device: with the same seed, :func:`init_weights` gives bit for bit the slices of the model
made on one device by ``model.to_empty(device=...)`` followed by the same initialisation in the same order
(``model.init_weights()`` for Hugging Face — ``initialize_weights()`` then ``tie_weights()``; the
``reset_parameters()`` loop otherwise). ``to_empty`` unties tied weights, so every owner of a tied weight draws
its own init (the random streams stay aligned) and the tied tensor keeps the value given by its first name's
module (``named_parameters()`` order) — which is what ``tie_weights()``, or re-assigning the tie, gives eager.

The core works on ``(skeleton, local, plan, rank)`` (:func:`init_local`, :func:`load_local`) so it can be used
on any rank program, e.g. ``plan.rank_program(rank).to_empty(device=...)`` for every rank in one process.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from autoshard.errors import AutoshardError, CheckpointError
from autoshard.placements import Partial, Shard, Spec
from autoshard.runtime.torch_state import RANK_THREADS

__all__ = ["init_local", "init_weights", "is_pretrained_dir", "load_local", "load_pretrained"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


# ---- where each tensor lives in the rank program ------------------------------------------------------------
@dataclass
class _Target:
    """One tensor of the rank program: its get_attr target, every name it has in the model, global shape, spec."""

    target: str
    aliases: tuple[str, ...]
    shape: tuple[int, ...]
    spec: Spec | None
    tensor: torch.Tensor
    written: bool = False


def _targets(local: torch.nn.Module, plan) -> dict[str, _Target]:
    """{get_attr target: _Target} of every tensor the program reads."""
    from autoshard import meta as M
    from autoshard.frontend.trace import fetch_attr

    out = {}
    for n in plan.graph_module.graph.nodes:
        if n.op != "get_attr" or not isinstance(n.meta.get("val"), torch.Tensor) or n.target in out:
            continue
        out[n.target] = _Target(n.target, tuple(n.meta.get(M.ALIASES, (n.target,))), tuple(n.meta["val"].shape),
                                n.meta.get(M.SPEC), fetch_attr(local, n.target))
    return out


def rank_index(shape, spec: Spec | None, mesh, rank: int) -> tuple[tuple[slice, ...], bool]:
    """This rank's region of a tensor of global ``shape``: one slice per dim, and whether the rank holds zeros
    instead (``Partial`` on an axis where the rank is not at coordinate 0)."""
    index = [slice(0, d) for d in shape]
    if not spec:
        return tuple(index), False
    coords = mesh.coords(rank)
    zero = False
    for (axis, size), p in zip(mesh.axes, spec):
        if isinstance(p, Shard):
            step = shape[p.dim] // size
            start = index[p.dim].start + coords[axis] * step
            index[p.dim] = slice(start, start + step)
        elif isinstance(p, Partial) and coords[axis] != 0:
            zero = True
    return tuple(index), zero


def _store(target: _Target, full: torch.Tensor, mesh, rank: int) -> None:
    index, zero = rank_index(target.shape, target.spec, mesh, rank)
    if zero:
        target.tensor.zero_()
    else:
        target.tensor.copy_(full[index])
    target.written = True


# ---- the order of the model's own init ----------------------------------------------------------------------
def _is_hf(model: torch.nn.Module) -> bool:
    mod = sys.modules.get("transformers.modeling_utils")
    return mod is not None and isinstance(model, mod.PreTrainedModel)


def _steps(model: torch.nn.Module, init) -> list[tuple[torch.nn.Module, object]]:
    """(module, call) in the order the single-device init runs them; ``call(module)`` initialises ``module``."""
    if init is not None:
        order: list = []
        model.apply(order.append)  # nn.Module.apply order: children before parents, no de-duplication
        return [(m, init) for m in order]
    if _is_hf(model):
        from transformers.modeling_utils import PreTrainedModel

        custom = bool(model.is_custom_code()) if hasattr(model, "is_custom_code") else False
        out = []

        def walk(module, fn):  # transformers' smart_apply
            for child in module.children():
                walk(child, child._initialize_weights if isinstance(child, PreTrainedModel) else fn)
            out.append((module, lambda m, fn=fn: fn(m, custom)))

        walk(model, model._initialize_weights)
        return out
    return [(m, lambda m: m.reset_parameters()) for m in model.modules()
            if callable(getattr(m, "reset_parameters", None))]


def _hf_guard(model):
    if _is_hf(model):
        try:
            from transformers.initialization import guard_torch_init_functions
        except ImportError:  # transformers 4: torch.nn.init is not patched
            return nullcontext()
        return guard_torch_init_functions()
    return nullcontext()


# ---- temporaries --------------------------------------------------------------------------------------------
_METADATA = {torch.Tensor.dim, torch.Tensor.size, torch.Tensor.numel, torch.Tensor.stride,
             torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.element_size,
             torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.ndim.__get__,
             torch.Tensor.requires_grad.__get__, torch.Tensor.is_meta.__get__, torch.Tensor.__len__}


@dataclass
class _Tensor:
    """A tensor of the skeleton: its names, where each owner holds it, and its place in the rank program."""

    meta: torch.Tensor
    names: list[str]
    #: (module, "_parameters"|"_buffers", key)
    slots: list[tuple[torch.nn.Module, str, str]] = field(default_factory=list)
    target: _Target | None = None


class _Run(TorchFunctionMode):
    """Runs the init steps; the torch-function mode swaps a skeleton tensor that a step touches but does not own
    for a full temporary on the device (made on first touch, written back after the step)."""

    def __init__(self, skeleton, targets: dict[str, _Target], mesh, rank: int, device, only: set[str] | None,
                 unread: dict | None):
        super().__init__()
        self.mesh, self.rank, self.device, self.only = mesh, rank, torch.device(device), only
        self.unread = unread
        by_alias = {a: t for t in targets.values() for a in t.aliases}
        self.tensors: dict[int, _Tensor] = {}
        for name, t in [*skeleton.named_parameters(remove_duplicate=False),
                        *skeleton.named_buffers(remove_duplicate=False)]:
            if t is None:
                continue
            info = self.tensors.setdefault(id(t), _Tensor(t, []))
            info.names.append(name)
            if info.target is None and name in by_alias:
                info.target = by_alias[name]
        for module in skeleton.modules():
            for kind in ("_parameters", "_buffers"):
                for key, t in getattr(module, kind).items():
                    if t is not None and id(t) in self.tensors:
                        self.tensors[id(t)].slots.append((module, kind, key))
        self.touched: dict[int, torch.Tensor] = {}  # id(meta) -> temporary made by the mode during one step
        self._touched_state: dict[int, tuple[int, bool]] = {}  # id(meta) -> (its version when made, restored)
        self.live = 0
        self.peak = 0

    # a temporary: NaN (floats) where nothing was written yet, this rank's slice where earlier steps wrote it
    def make(self, info: _Tensor) -> tuple[torch.Tensor, bool]:
        meta = info.meta
        full = torch.empty(meta.shape, dtype=meta.dtype, device=self.device)
        restored = False
        if full.is_floating_point() or full.is_complex():
            full.fill_(float("nan"))
        target = info.target
        if target is not None and target.written:
            index, zero = rank_index(target.shape, target.spec, self.mesh, self.rank)
            if not zero:
                full[index].copy_(target.tensor)
                restored = True
        self.live += full.numel() * full.element_size()
        self.peak = max(self.peak, self.live)
        return full, restored

    def wanted(self, info: _Tensor) -> bool:
        if self.only is None:
            return True
        return info.target is not None and info.target.target in self.only

    def write_back(self, info: _Tensor, full: torch.Tensor, version: int, restored: bool, module_name: str) -> None:
        self.live -= full.numel() * full.element_size()
        written = full._version != version
        if full.is_floating_point() or full.is_complex():
            nan = torch.isnan(full)
            written = written or not bool(nan.all())
        else:
            nan = None
        if not written or not self.wanted(info):
            return
        target = info.target
        if target is not None:
            index, zero = rank_index(target.shape, target.spec, self.mesh, self.rank)
            if restored and nan is not None and not zero and bool(nan[index].any()):
                raise AutoshardError(
                    f"the init of module `{module_name or '(the model)'}` read tensor `{info.names[0]}` "
                    "outside this rank's slice after its own module had initialised it (e.g. a norm over the whole "
                    "tensor): a rank keeps only its slice of a tensor between modules. Initialise that tensor in its "
                    "own module's init, or pass init= to sharded.init_weights.")
            _store(target, full, self.mesh, self.rank)
        elif self.unread is not None:
            for name in info.names:
                if name in self.unread:
                    self.unread[name] = full.detach().clone()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            return func(*args, **kwargs)

        def swap(x):
            if isinstance(x, torch.Tensor) and id(x) in self.tensors and x.is_meta:
                if id(x) not in self.touched:
                    full, restored = self.make(self.tensors[id(x)])
                    self.touched[id(x)] = full
                    self._touched_state[id(x)] = (full._version, restored)
                return self.touched[id(x)]
            return x

        args, kwargs = pytree.tree_map(swap, (args, kwargs))
        return func(*args, **kwargs)


# ---- init -----------------------------------------------------------------------------------------------------
def init_local(skeleton: torch.nn.Module, local: torch.nn.Module, plan, rank: int, device=None, init=None, *,
               only: set[str] | None = None, strict: bool = True, unread: dict | None = None) -> dict:
    """Fill ``local`` (rank ``rank``'s program of ``plan``) by the model's own initialisation run on
    ``skeleton`` module by module (see the module docstring). ``only``: the get_attr targets to write (others are
    left as they are, and only the modules owning them run). ``strict``: raise :class:`AutoshardError` naming
    every tensor of ``local`` that no init wrote. Returns ``{"modules": steps run, "peak_bytes": the most bytes
    of full-size temporaries alive at once, "written": targets written}``."""
    targets = _targets(local, plan)
    if device is None:
        device = next((t.tensor.device for t in targets.values()), torch.device("cpu"))
    run = _Run(skeleton, targets, plan.mesh, rank, device, only, unread)
    names = {id(m): n for n, m in skeleton.named_modules(remove_duplicate=False)}
    # the owner that keeps a tied tensor: the module of its first name
    keepers = {id(info.meta): _owner_of(skeleton, info.names[0]) for info in run.tensors.values()}
    steps = _steps(skeleton, init)
    if only is not None:
        owners = {id(m) for info in run.tensors.values() if run.wanted(info) for m, _, _ in info.slots}
        steps = [(m, c) for m, c in steps if id(m) in owners]
    flags = {id(m): (m, m.__dict__.get("_is_hf_initialized", _ABSENT)) for m in skeleton.modules()}
    count = 0

    # where ranks are threads of one process (the simulator), one rank initialises at a time and never while
    # another traces: the skeleton may be the user's meta model itself, shared by every rank, and transformers
    # patches torch.nn.init process-wide while it initialises (a no-op where each rank is a process)
    with RANK_THREADS.exclusive(), torch.no_grad(), _hf_guard(skeleton):
        try:
            for module, call in steps:
                if getattr(module, "_is_hf_initialized", False) and init is None and _is_hf(skeleton):
                    continue  # transformers skips it too (and would not touch its tensors)
                _step(run, module, names.get(id(module), ""), call, keepers)
                count += 1
        finally:
            for m, was in flags.values():  # the skeleton is left as it was: init_weights can run again
                if was is _ABSENT:
                    m.__dict__.pop("_is_hf_initialized", None)
                else:
                    m._is_hf_initialized = was
    wanted = [t for t in targets.values() if only is None or t.target in only]
    missing = [t.target for t in wanted if not t.written]
    if strict and missing:
        raise AutoshardError(
            f"no init wrote {missing[:8]}{'...' if len(missing) > 8 else ''} on rank {rank}: the model was built "
            "on the meta device and these tensors' modules have no initialisation autoshard can run (no "
            "reset_parameters(), no Hugging Face _init_weights branch) — e.g. a non-persistent buffer computed in "
            "__init__. Build that module outside torch.device('meta') (its tensors are then taken as they are), "
            "or pass init=fn to init_weights with fn(module) filling them.")
    return {"modules": count, "peak_bytes": run.peak, "written": [t.target for t in wanted if t.written]}


_ABSENT = object()


def _owner_of(skeleton, name: str):
    owner, _, _ = name.rpartition(".")
    return skeleton.get_submodule(owner) if owner else skeleton


def _step(run: _Run, module, name: str, call, keepers) -> None:
    """One step of :class:`_Run` with the tied-weight keeper decided by the first name's module."""
    own = []
    swapped = []
    for kind in ("_parameters", "_buffers"):
        for key, t in list(getattr(module, kind).items()):
            if t is None or id(t) not in run.tensors or not t.is_meta:
                continue
            info = run.tensors[id(t)]
            full, restored = run.make(info)
            first_owner = keepers[id(t)]
            keep = first_owner is module and info.names[0].rpartition(".")[2] == key
            if isinstance(t, torch.nn.Parameter):
                new = torch.nn.Parameter(full, requires_grad=t.requires_grad)
                new.__dict__.update(t.__dict__)  # flags such as _is_hf_initialized
            else:
                new = full
                new.__dict__.update(t.__dict__)
            getattr(module, kind)[key] = new
            swapped.append((kind, key, t))
            own.append((info, new, new._version, restored, keep))
    run.touched, run._touched_state = {}, {}
    try:
        with run:
            call(module)
    finally:
        for kind, key, t in swapped:
            getattr(module, kind)[key] = t
    for info, full, version, restored, keep in own:
        if keep:
            run.write_back(info, full, version, restored, name)
        else:
            run.live -= full.numel() * full.element_size()
    for key, full in run.touched.items():
        version, restored = run._touched_state[key]
        run.write_back(run.tensors[key], full, version, restored, name)
    run.touched, run._touched_state = {}, {}


def init_weights(sharded, init=None) -> dict:
    """``sharded.init_weights(init)``: initialise this rank's shards of a :class:`~autoshard.ShardedModule` (see
    the module docstring). Returns :func:`init_local`'s statistics. A Hugging Face model built off meta has every
    module flagged ``_is_hf_initialized``, so (as its own ``initialize_weights()``) this then changes nothing
    unless ``init=`` is given; a tensor no init writes is an error only while the shards are uninitialised."""
    local = sharded.materialize()
    stats = init_local(sharded.skeleton, local, sharded.plan, sharded.rank, sharded.device, init,
                       strict=not sharded.initialised, unread=sharded.unread_state)
    sharded.mark_initialised()
    return stats


# ---- loading a Hugging Face directory -------------------------------------------------------------------------
def is_pretrained_dir(path) -> bool:
    """Whether ``path`` is a Hugging Face safetensors directory (and not an autoshard checkpoint)."""
    from autoshard import meta as M

    path = os.fspath(path)
    return (os.path.isdir(path) and not os.path.exists(os.path.join(path, M.CHECKPOINT_MARKER))
            and any(os.path.exists(os.path.join(path, f)) for f in (SINGLE_FILE, INDEX_FILE)))


def _weight_map(path: str) -> dict[str, str]:
    """{tensor name: file} of the directory."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(f"{index!r} is not a safetensors index (a JSON object with a `weight_map`): "
                                  f"{type(e).__name__}: {e}") from None
        return {k: os.path.join(path, v) for k, v in weight_map.items()}
    from safetensors import safe_open

    file = os.path.join(path, SINGLE_FILE)
    with safe_open(file, framework="pt") as f:
        return {k: file for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)


def _candidates(name: str, prefix: str) -> list[str]:
    """The names a tensor may be saved under: itself, and with/without the base model's prefix."""
    out = [name]
    if prefix:
        out.append(name[len(prefix) + 1:] if name.startswith(prefix + ".") else f"{prefix}.{name}")
    return out


def load_local(skeleton: torch.nn.Module, local: torch.nn.Module, plan, rank: int, path, device=None,
               unread: dict | None = None, compute: bool = True) -> dict:
    """Fill ``local`` (rank ``rank``'s program of ``plan``) from the Hugging Face directory ``path``, reading only
    this rank's slices. Tensors the directory lacks that are non-persistent buffers are computed by their module's
    init (``compute=False``: left as they are — a program whose buffers already hold their values). ``unread``:
    {name: tensor} of state the program never reads, replaced by the whole saved tensors. Returns
    ``{"bytes_read", "tensors", "files", "computed"}``."""
    from safetensors import safe_open

    path = os.fspath(path)
    if not is_pretrained_dir(path):
        raise CheckpointError(f"{path!r} is not a Hugging Face directory: it has neither {SINGLE_FILE} nor "
                              f"{INDEX_FILE}.")
    weight_map = _weight_map(path)
    targets = _targets(local, plan)
    persistent = set(skeleton.state_dict().keys())
    prefix = getattr(skeleton, "base_model_prefix", "") or ""
    plan_read: list[tuple[_Target, str, str]] = []
    missing: set[str] = set()
    for t in targets.values():
        key = next((c for a in t.aliases for c in _candidates(a, prefix) if c in weight_map), None)
        if key is not None:
            plan_read.append((t, key, weight_map[key]))
        elif not any(a in persistent for a in t.aliases):
            missing.add(t.target)
        else:
            raise CheckpointError(f"{path!r} has no tensor `{t.aliases[0]}` (names tried: "
                                  f"{[c for a in t.aliases for c in _candidates(a, prefix)]}), but the model "
                                  f"has it: was it saved from another model? It holds {sorted(weight_map)[:6]}...")
    read = 0
    with ExitStack() as stack, torch.no_grad():
        handles: dict[str, object] = {}
        for t, key, file in plan_read:
            if file not in handles:
                if not os.path.exists(file):
                    raise CheckpointError(f"safetensors file {file!r} named by {INDEX_FILE} for `{key}` does "
                                          "not exist.")
                handles[file] = stack.enter_context(safe_open(file, framework="pt", device="cpu"))
            view = handles[file].get_slice(key)
            shape = tuple(view.get_shape())
            if shape != t.shape:
                raise CheckpointError(f"{file!r}: tensor `{key}` has shape {list(shape)}, but the model's "
                                      f"`{t.aliases[0]}` has shape {list(t.shape)}: the checkpoint belongs to a model "
                                      "of another size (or another config).")
            index, zero = rank_index(t.shape, t.spec, plan.mesh, rank)
            if zero:
                t.tensor.zero_()
            else:
                part = view[index] if index else handles[file].get_tensor(key)
                read += part.numel() * part.element_size()
                t.tensor.copy_(part)
            t.written = True
        if unread:
            for name in list(unread):
                key = next((c for c in _candidates(name, prefix) if c in weight_map), None)
                if key is not None:
                    file = weight_map[key]
                    if file not in handles:
                        handles[file] = stack.enter_context(safe_open(file, framework="pt", device="cpu"))
                    full = handles[file].get_tensor(key)
                    read += full.numel() * full.element_size()
                    unread[name] = full.to(device or full.device)
    computed = sorted(missing) if compute else []
    if computed:
        try:
            init_local(skeleton, local, plan, rank, device, only=missing)
        except AutoshardError as e:
            raise CheckpointError(f"{path!r} has no tensors {computed} (non-persistent buffers), and computing "
                                  f"them by their modules' init failed: {e}") from None
    return {"bytes_read": read, "tensors": len(plan_read), "files": len({f for _, _, f in plan_read}),
            "computed": computed}


def load_pretrained(sharded, path) -> dict:
    """``autoshard.load(sharded, hf_dir)``: this rank's slices of a Hugging Face safetensors directory into a
    :class:`~autoshard.ShardedModule` (or, for a plain ``nn.Module``, its whole tensors). Returns ``{"bytes_read":
    bytes this rank read, "tensors": tensors read, ...}``."""
    if getattr(type(sharded), "AUTOSHARD_IN_PLACE", False):  # autoshard.shard's model: its ShardedModule
        sharded = sharded.autoshard
    if not getattr(type(sharded), "AUTOSHARD_SHARDED", False):
        return _load_plain(sharded, os.fspath(path))
    local = sharded.materialize()
    stats = load_local(sharded.skeleton, local, sharded.plan, sharded.rank, path, sharded.device,
                       unread=sharded.unread_state, compute=not sharded.initialised)
    sharded.mark_initialised()
    return stats


def _load_plain(model: torch.nn.Module, path: str) -> dict:
    """Whole tensors into a plain ``nn.Module`` in one process (names as in its ``state_dict``)."""
    from safetensors import safe_open

    if not isinstance(model, torch.nn.Module):
        raise CheckpointError(f"checkpoint target has type {type(model).__name__}, but must be an "
                              "autoshard.ShardedModule or a torch.nn.Module.")
    weight_map = _weight_map(path)
    prefix = getattr(model, "base_model_prefix", "") or ""
    groups: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(t), (t, []))[1].append(name)
    read, count = 0, 0
    with ExitStack() as stack, torch.no_grad():
        handles: dict[str, object] = {}
        for t, names in groups.values():
            key = next((c for n in names for c in _candidates(n, prefix) if c in weight_map), None)
            if key is None:
                raise CheckpointError(f"{path!r} has no tensor `{names[0]}`, but the model has it.")
            file = weight_map[key]
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(file, framework="pt", device="cpu"))
            full = handles[file].get_tensor(key)
            if tuple(full.shape) != tuple(t.shape):
                raise CheckpointError(f"{file!r}: tensor `{key}` has shape {list(full.shape)}, but the model's "
                                      f"`{names[0]}` has shape {list(t.shape)}.")
            t.copy_(full)
            read += full.numel() * full.element_size()
            count += 1
    return {"bytes_read": read, "tensors": count}
