"""Checkpoints of sharded models and their optimizers, through ``torch.distributed.checkpoint`` (DCP).

A checkpoint is a DCP directory plus one file of ours, ``autoshard.json``, written last: the commit marker.

* :func:`save` — on real ranks (a :class:`~autoshard.runtime.DistCommunicator`) every rank describes its local
  shards as DTensors (``DTensor.from_local`` over ``Mesh.to_device_mesh()`` with the plan's placements,
  ``Plan.param_specs()``) and ``dcp.save`` writes each shard once with its global offsets (replicated tensors are
  written by one rank only). In the simulator, and for a plain ``nn.Module`` in one process, the full tensors are
  assembled (:func:`full_state_dict`) and rank 0 writes them with ``no_dist=True`` — the same format.
* :func:`load` — the reverse, into any target: a ShardedModule on the same or another mesh (DCP reads the
  overlap of every saved chunk with this rank's shard: data=2×model=2 → model=4 reshards on load), a ShardedModule
  in the simulator, or the original ``nn.Module`` in one process (back to plain PyTorch).
* :func:`full_state_dict` — the original model's ``state_dict()``: every key (tied weights under each of their
  names), global shapes, in the original order; ready for ``model.load_state_dict`` or Hugging Face
  ``save_pretrained``.

Tensors are keyed ``model.<fqn>`` by the name the traced graph uses (a tied weight is stored once); the marker
lists every alias, so a target looks a tensor up by any of its names. With ``optimizer=``, the state of every
parameter is saved under ``optim.<fqn>.<key>``: tensors shaped like the parameter (Adam's ``exp_avg``,
``exp_avg_sq``) are sharded like it, others (``step``) are saved once as replicated values; hyper-parameters of
the parameter groups (``lr``, ``betas``, ...) go into the marker.

Atomic commit: everything is written under ``<path>.tmp-<uuid>``; after every rank has finished (DCP's own
final gather, then a barrier) rank 0 writes ``autoshard.json``, fsyncs it and renames the directory to ``path``
(an existing checkpoint there is moved aside first and removed after). A save interrupted by a dying rank thus
leaves only a ``.tmp-`` directory without marker, and :func:`load` refuses anything without the marker with a
:class:`~autoshard.errors.CheckpointError`.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import uuid

import torch

from autoshard.errors import CheckpointError
from autoshard.placements import Replicate, Shard, Spec, format_spec, shard_tensor

__all__ = ["MARKER", "full_state_dict", "load", "save"]

#: The commit marker: a checkpoint directory without it is incomplete.
MARKER = "autoshard.json"
FORMAT = "autoshard-dcp/1"

_DCP_LOCK = threading.Lock()  # simulated ranks (threads) read and write one at a time
_DEVICE_MESHES: dict = {}


# ---- what a target holds ------------------------------------------------------------------------------------
class _View:
    """One rank's view of a save/load target: its tensors (canonical name -> local tensor), their specs and
    global shapes, alias groups, the communicator (None in one process) and the source model."""

    def __init__(self, target):
        from autoshard.api import ShardedModule

        self.sharded = isinstance(target, ShardedModule)
        if self.sharded:
            self._init_sharded(target)
        elif isinstance(target, torch.nn.Module):
            self._init_plain(target)
        else:
            raise CheckpointError(f"checkpoint target has type {type(target).__name__}, but must be an "
                                  "autoshard.ShardedModule or a torch.nn.Module.")

    def _init_plain(self, model: torch.nn.Module) -> None:
        self.comm, self.mesh, self.source = None, None, model
        self.groups = _alias_groups(model)
        state = model.state_dict(keep_vars=True)
        self.local, self.specs, self.shapes, self.params = {}, {}, {}, {}
        for names in self.groups:
            t = state[names[0]]
            canon = names[-1]
            self.local[canon] = t
            self.specs[canon] = ()
            self.shapes[canon] = tuple(t.shape)
        for name, p in model.named_parameters(remove_duplicate=False):
            self.params.setdefault(id(p), (self._canon(name), p))

    def _init_sharded(self, sharded) -> None:
        from autoshard import meta as M
        from autoshard.trace import fetch_attr

        plan = sharded._need_plan()
        self.comm = sharded.communicator()  # refuses a communicator of another mesh
        self.mesh, self.source = plan.mesh, sharded._skeleton  # names only: the skeleton holds meta tensors
        local = sharded.materialize()
        persistent = set(self.source.state_dict().keys())
        self.local, self.specs, self.shapes, self.groups, self.params = {}, {}, {}, [], {}
        for n in plan.graph_module.graph.nodes:
            if n.op != "get_attr" or not isinstance(n.meta.get("val"), torch.Tensor):
                continue
            aliases = tuple(a for a in n.meta.get(M.ALIASES, (n.target,)) if a in persistent)
            if not aliases:
                continue  # a constant or a non-persistent buffer: rebuilt by the model, never saved
            canon = n.meta.get(M.PARAM, n.target)
            t = fetch_attr(local, n.target)
            self.local[canon] = t
            self.specs[canon] = n.meta[M.SPEC]
            self.shapes[canon] = tuple(n.meta["val"].shape)
            self.groups.append(tuple(a for a in aliases if a != canon) + (canon,))
            if isinstance(t, torch.nn.Parameter):
                self.params[id(t)] = (canon, t)
        # Entries the graph never reads (unused parameters, buffers): saved whole, as the ShardedModule keeps them.
        covered = {a for g in self.groups for a in g}
        for names in _alias_groups(self.source):
            if not covered.intersection(names):
                canon = names[-1]
                t = sharded._unread[names[0]]
                self.local[canon] = t
                self.specs[canon] = None  # whole on every rank, not part of the plan
                self.shapes[canon] = tuple(t.shape)
                self.groups.append(names)

    def _canon(self, name: str) -> str:
        for g in self.groups:
            if name in g:
                return g[-1]
        return name

    @property
    def rank(self) -> int:
        return 0 if self.comm is None else self.comm.rank

    def is_dist(self) -> bool:
        from autoshard.runtime.dist import DistCommunicator

        return isinstance(self.comm, DistCommunicator)

    def full(self, canon: str, t: torch.Tensor) -> torch.Tensor:
        """The global value of ``t`` (a local tensor laid out like ``canon``), gathered over the mesh."""
        spec = self.specs[canon]
        out = t.detach()
        if not spec or self.comm is None:
            return out.clone()
        for axis, p in zip(self.mesh.names, spec):
            if isinstance(p, Shard):
                out = self.comm.all_gather(out, axis, p.dim)
        return out.clone()

    def spec_of(self, canon: str) -> Spec:
        spec = self.specs[canon]
        return tuple(Replicate() for _ in self.mesh.names) if not spec else spec


def _alias_groups(model: torch.nn.Module) -> list[tuple[str, ...]]:
    """Names of each state_dict entry, grouped by tensor identity, in state_dict order."""
    state = model.state_dict(keep_vars=True)
    groups: dict[int, list[str]] = {}
    for name, t in state.items():
        groups.setdefault(id(t), []).append(name)
    return [tuple(g) for g in groups.values()]


# ---- full state dict ------------------------------------------------------------------------------------
def full_state_dict(target) -> dict[str, torch.Tensor]:
    """The original model's ``state_dict()`` with global values: every key (each name of a tied weight) and
    shape of ``model.state_dict()``, in its order. Collective on a ShardedModule: every rank must call it (every
    rank gets the full dict)."""
    view = _View(target)
    values = _gather_all(view)
    by_alias = {a: values[g[-1]] for g in view.groups for a in g}
    return {k: by_alias[k] for k in view.source.state_dict() if k in by_alias}


def _gather_all(view: _View) -> dict[str, torch.Tensor]:
    comm = view.comm
    recording = comm.recording if comm is not None else None
    if comm is not None:
        comm.recording = False  # checkpoint traffic is not part of the plan's collective counts
    try:
        return {canon: view.full(canon, t) for canon, t in view.local.items()}
    finally:
        if comm is not None:
            comm.recording = recording


# ---- save ---------------------------------------------------------------------------------------------------
def save(target, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None) -> str:
    """Write ``target``'s tensors (and ``optimizer``'s state) to the checkpoint directory ``path``; returns it.

    Collective: every rank of a ShardedModule calls it with the same ``path``. The directory appears at
    ``path`` only once every rank has written its shards (see the module docstring).
    """
    import torch.distributed.checkpoint as dcp

    path = os.fspath(path)
    view = _View(target)
    optim = _optimizer_state(view, optimizer) if optimizer is not None else {}
    marker = _marker(view, optimizer, optim)
    if view.is_dist():
        import torch.distributed as dist

        box = [f"{path}.tmp-{uuid.uuid4().hex}" if view.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        tmp = box[0]
        try:
            dcp.save(_dtensor_state(view, optim), checkpoint_id=tmp)
            view.comm.barrier()
        except Exception as e:  # DCP wraps a dead peer's "connection closed" in its own exception types
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"save to {path!r} failed on rank {view.rank} before its commit (did another "
                                  f"rank die?): {type(e).__name__}: {first}. Nothing was committed: {path!r} is "
                                  f"unchanged and the partial data in {tmp!r} will never load.") from e
        if view.rank == 0:
            _commit(tmp, path, marker)
        view.comm.barrier()
        return path
    full = _gather_all(view)
    full_optim = {k: (canon, view.full(canon, t) if shaped else t.detach().clone())
                  for k, (canon, t, shaped) in optim.items()}
    if view.rank == 0:
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        state = {f"model.{k}": v for k, v in full.items()}
        state.update({k: v for k, (_, v) in full_optim.items()})
        with _DCP_LOCK:
            dcp.save(state, checkpoint_id=tmp, no_dist=True)
        _commit(tmp, path, marker)
    if view.comm is not None:
        view.comm.barrier()
    return path


def _optimizer_state(view: _View, optimizer) -> dict[str, tuple[str, torch.Tensor, bool]]:
    """{``optim.<fqn>.<key>``: (canonical param name, local tensor, shaped like the param)}."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise CheckpointError(f"optimizer has type {type(optimizer).__name__}, but must be a torch.optim.Optimizer "
                              "built over the parameters of the model being saved.")
    out = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in view.params:
                raise CheckpointError(f"optimizer holds a parameter of shape {list(p.shape)} that the saved model "
                                      "does not own: build the optimizer over sharded.parameters() (or "
                                      "model.parameters()) of the model you save.")
            canon, _ = view.params[id(p)]
            for key, value in optimizer.state.get(p, {}).items():
                if not isinstance(value, torch.Tensor):
                    continue
                shaped = value.dim() > 0 and tuple(value.shape) == tuple(p.shape)
                out[f"optim.{canon}.{key}"] = (canon, value, shaped)
    return out


def _jsonable(value):
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return repr(value)


def _marker(view: _View, optimizer, optim: dict) -> dict:
    tensors = {}
    for canon, t in view.local.items():
        spec = view.specs[canon]
        tensors[canon] = {"shape": list(view.shapes[canon]), "dtype": str(t.dtype).replace("torch.", ""),
                          "aliases": list(next(g for g in view.groups if g[-1] == canon)),
                          "spec": format_spec(spec) if spec else None}
    out = {"format": FORMAT, "torch": torch.__version__,
           "mesh": [list(a) for a in view.mesh.axes] if view.mesh is not None else None,
           "tensors": tensors}
    if optimizer is not None:
        out["optimizer"] = {
            "type": type(optimizer).__name__,
            "param_groups": [{k: _jsonable(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
            "state": {k: {"param": canon, "shaped": shaped, "shape": list(t.shape),
                          "dtype": str(t.dtype).replace("torch.", "")} for k, (canon, t, shaped) in optim.items()},
        }
    return out


def _device_mesh(view: _View):
    import torch.distributed as dist

    # the device type of this rank's tensors: "cuda" under NCCL, "cpu" under gloo
    device_type = next((t.device.type for t in view.local.values() if not t.is_meta), "cpu")
    key = (view.mesh, id(dist.group.WORLD), device_type)
    if key not in _DEVICE_MESHES:
        _DEVICE_MESHES[key] = view.mesh.to_device_mesh(device_type)
    return _DEVICE_MESHES[key]


def _dtensor(view: _View, dm, canon: str, local: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    shape = torch.Size(view.shapes[canon])
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local.detach(), dm, view.spec_of(canon), run_check=False, shape=shape, stride=stride)


def _dtensor_state(view: _View, optim: dict) -> dict:
    dm = _device_mesh(view)
    state = {f"model.{canon}": _dtensor(view, dm, canon, t) for canon, t in view.local.items()}
    for key, (canon, t, shaped) in optim.items():
        state[key] = _dtensor(view, dm, canon, t) if shaped else t.detach()
    return state


def _commit(tmp: str, path: str, marker: dict) -> None:
    """Rank 0, after every rank has written: marker last, then the rename that makes the checkpoint visible."""
    with open(os.path.join(tmp, MARKER), "w") as f:
        json.dump(marker, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    old = None
    if os.path.exists(path):
        old = f"{path}.old-{uuid.uuid4().hex}"
        os.replace(path, old)
    os.replace(tmp, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ---- load ---------------------------------------------------------------------------------------------------
def read_marker(path: str | os.PathLike) -> dict:
    """The commit marker of the checkpoint at ``path``; :class:`CheckpointError` if there is none."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        parent = os.path.dirname(os.path.abspath(path)) or "."
        base = os.path.basename(path)
        partial = sorted(n for n in os.listdir(parent) if n.startswith(f"{base}.tmp-")) if os.path.isdir(parent) else []
        hint = (f" A save there was interrupted before its commit: {partial} hold(s) partial data; save again."
                if partial else "")
        raise CheckpointError(f"checkpoint path {path!r} has no checkpoint directory, but load needs one written "
                              f"by autoshard.save.{hint}")
    marker_path = os.path.join(path, MARKER)
    if not os.path.exists(marker_path):
        raise CheckpointError(f"checkpoint {path!r} has no commit marker {MARKER}, but every complete autoshard "
                              "checkpoint has one (written last): the save that wrote it did not finish (a rank "
                              "died or timed out). Save again from a healthy run.")
    with open(marker_path) as f:
        marker = json.load(f)
    if marker.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path!r} has format {marker.get('format')!r}, but this autoshard reads "
                              f"{FORMAT!r}.")
    return marker


def load(target, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Restore ``target``'s tensors (and ``optimizer``'s state) from the checkpoint at ``path``, resharding to
    ``target``'s plan. Collective on a ShardedModule. Returns the checkpoint's marker (mesh, specs, hyper-
    parameters).

    A Hugging Face directory (``model.safetensors`` or ``model.safetensors.index.json``, no commit marker) is read
    by :func:`autoshard.materialize.load_pretrained` instead: each rank reads only its slices; returns
    ``{"bytes_read": ..., "tensors": ...}``."""
    import torch.distributed.checkpoint as dcp

    from autoshard.materialize import is_pretrained_dir, load_pretrained

    path = os.fspath(path)
    if is_pretrained_dir(path):
        if optimizer is not None:
            raise CheckpointError(f"{path!r} is a Hugging Face directory, which holds no optimizer state, but load "
                                  "was given optimizer=: load without it (or from an autoshard.save checkpoint).")
        return load_pretrained(target, path)
    marker = read_marker(path)
    view = _View(target)
    saved = marker["tensors"]
    name_of = {a: canon for canon, info in saved.items() for a in info["aliases"]}
    plan: dict[str, str] = {}  # our canonical name -> saved canonical name
    for group in view.groups:
        hit = next((name_of[a] for a in group if a in name_of), None)
        if hit is None:
            raise CheckpointError(f"checkpoint {path!r} has no tensor `{group[-1]}`, but the model being loaded "
                                  f"has it: was it saved from another model? It holds {sorted(saved)[:8]}...")
        want, have = list(view.shapes[group[-1]]), saved[hit]["shape"]
        if want != have:
            raise CheckpointError(f"checkpoint tensor `{hit}` has shape {have}, but the model's `{group[-1]}` has "
                                  f"shape {want}: the checkpoint belongs to a model of another size.")
        plan[group[-1]] = hit
    optim = _prepare_optimizer(view, optimizer, marker, path) if optimizer is not None else {}
    if view.is_dist():
        dm = _device_mesh(view)
        state = {f"model.{plan[c]}": _dtensor(view, dm, c, t) for c, t in view.local.items()}
        for key, (canon, t, shaped) in optim.items():
            state[key] = _dtensor(view, dm, canon, t) if shaped else t
        dcp.load(state, checkpoint_id=path)
        with torch.no_grad():
            for c, t in view.local.items():
                t.copy_(state[f"model.{plan[c]}"].to_local())
            for key, (_, t, shaped) in optim.items():
                t.copy_(state[key].to_local() if shaped else state[key])
        view.comm.barrier()
        return marker
    full = {f"model.{plan[c]}": torch.empty(view.shapes[c], dtype=t.dtype) for c, t in view.local.items()}
    for key, (canon, t, shaped) in optim.items():
        full[key] = torch.empty(view.shapes[canon], dtype=t.dtype) if shaped else torch.empty_like(t)
    with _DCP_LOCK:
        dcp.load(full, checkpoint_id=path, no_dist=True)
    with torch.no_grad():
        for c, t in view.local.items():
            t.copy_(_mine(view, c, full[f"model.{plan[c]}"]))
        for key, (canon, t, shaped) in optim.items():
            t.copy_(_mine(view, canon, full[key]) if shaped else full[key])
    if view.comm is not None:
        view.comm.barrier()
    return marker


def _mine(view: _View, canon: str, full: torch.Tensor) -> torch.Tensor:
    spec = view.specs[canon]
    if not spec or view.comm is None:
        return full
    return shard_tensor(full, spec, view.mesh, view.rank)


def _prepare_optimizer(view: _View, optimizer, marker: dict, path: str) -> dict:
    """Create ``optimizer``'s state entries (zeros, local shapes) so DCP can load into them; set hyper-params."""
    info = marker.get("optimizer")
    if info is None:
        raise CheckpointError(f"checkpoint {path!r} has no optimizer state, but load was given optimizer=: save "
                              "with autoshard.save(model, path, optimizer=opt), or load without optimizer=.")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise CheckpointError(f"optimizer has type {type(optimizer).__name__}, but must be a torch.optim.Optimizer.")
    if info["type"] != type(optimizer).__name__:
        raise CheckpointError(f"checkpoint {path!r} has {info['type']} state, but the optimizer is "
                              f"{type(optimizer).__name__}: build the same optimizer class before loading.")
    if len(info["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointError(f"checkpoint {path!r} has {len(info['param_groups'])} parameter groups, but the "
                              f"optimizer has {len(optimizer.param_groups)}.")
    saved_name = {a: canon for canon, t in marker["tensors"].items() for a in t["aliases"]}
    by_saved = {}
    for key, entry in info["state"].items():
        by_saved.setdefault(entry["param"], []).append((key, entry))
    out = {}
    for group, hyper in zip(optimizer.param_groups, info["param_groups"]):
        for k, v in hyper.items():
            if k in group and not isinstance(group[k], torch.Tensor):
                group[k] = tuple(v) if isinstance(group[k], tuple) else v
        for p in group["params"]:
            if id(p) not in view.params:
                raise CheckpointError(f"optimizer holds a parameter of shape {list(p.shape)} that the loaded "
                                      "model does not own: build it over sharded.parameters() of this model.")
            canon, _ = view.params[id(p)]
            group_names = next(g for g in view.groups if g[-1] == canon)
            saved = next((saved_name[a] for a in group_names if a in saved_name), canon)
            state = optimizer.state[p]
            for key, entry in by_saved.get(saved, []):
                name = key.rsplit(".", 1)[1]
                dtype = getattr(torch, entry["dtype"])
                if entry["shaped"]:
                    state[name] = torch.zeros_like(p, dtype=dtype, memory_format=torch.contiguous_format)
                else:
                    state[name] = torch.zeros(entry["shape"], dtype=dtype)
                out[key] = (canon, state[name], entry["shaped"])
    return out
