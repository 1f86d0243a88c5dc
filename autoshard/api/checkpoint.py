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
* A PipelinedModule saves and loads the same format: each rank its stage(s)' tensors under their model names,
  laid out on the whole mesh with ``Replicate()`` on the pipe axis (a tensor of a stage is whole along it), so a
  pipeline's checkpoint loads into any target above and any of them into a pipeline. The marker lists every
  tensor of the model (every rank knows the plan), and the optimizer entries of every stage (exchanged over the
  pipe axis); in the simulator and for :func:`full_state_dict` each stage's full tensors are broadcast over the
  pipe axis.
* :func:`full_state_dict` — the original model's ``state_dict()``: every key (tied weights under each of their
  names), global shapes, in the original order; ready for ``model.load_state_dict`` or Hugging Face
  ``save_pretrained``.

Tensors are keyed ``model.<fqn>`` by the name the traced graph uses (a tied weight is stored once); the marker
lists every alias, so a target looks a tensor up by any of its names. With ``optimizer=``, the state of every
parameter is saved under ``optim.<fqn>.<key>``: tensors shaped like the parameter (Adam's ``exp_avg``,
``exp_avg_sq``) are sharded like it, others (``step``) are saved once as replicated values; hyper-parameters of
the parameter groups (``lr``, ``betas``, ...) go into the marker.

Atomic commit: everything is written under ``<path>.tmp-<uuid>``; after every rank has finished (DCP's own
final gather, then a barrier) every rank checksums a share of the written files, rank 0 writes ``autoshard.json``
(via ``autoshard.json.part``, fsynced, renamed), moves an existing checkpoint at ``path`` aside to
``<path>.old-<uuid>`` (the commit point), renames the new directory to ``path`` and removes the old one and every
leftover of earlier interrupted saves. A save interrupted before its commit leaves the previous checkpoint at
``path``; one interrupted between the two renames leaves no ``path`` but two complete directories, and
:func:`load` then reads the newer one and says so (``warnings.warn`` naming it). :func:`load` refuses a directory
without the marker with a :class:`~autoshard.errors.CheckpointError`.

Integrity: the marker records, for every file DCP wrote (``__<rank>_<n>.distcp`` and ``.metadata``), its size and
crc32, and for every stored tensor chunk (``storage_data`` of DCP's metadata: file, byte range) the crc32 of its
bytes; the marker carries the crc32 of its own canonical JSON. :func:`load` checks the marker, then the size of
every file, then every checksum (split over the ranks on ``torch.distributed``, gathered so every rank raises the
same error) before DCP reads anything: a damaged, truncated or missing file raises ``CheckpointError`` naming the
file and the tensors it holds. DCP's, JSON's and the OS's exceptions are re-raised as ``CheckpointError`` (chained).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
import warnings
import zlib

import torch

from autoshard import meta as M
from autoshard.errors import CheckpointError
from autoshard.runtime.parameters import local_of
from autoshard.runtime.torch_state import RANK_THREADS
from autoshard.placements import Replicate, Shard, Spec, format_spec, shard_tensor

__all__ = ["MARKER", "full_state_dict", "load", "save"]

#: The commit marker: a checkpoint directory without it is incomplete.
MARKER = M.CHECKPOINT_MARKER
FORMAT = "autoshard-dcp/2"
FORMAT_V1 = "autoshard-dcp/1"  # written before checksums: loads unverified, with a warning
_BLOCK = 1 << 22  # bytes read at a time when checksumming


# ---- what a target holds ------------------------------------------------------------------------------------
class _View:
    """One rank's view of a save/load target: its tensors (canonical name -> local tensor), their specs and
    global shapes, alias groups, the communicator (None in one process) and the source model."""

    def __init__(self, target):
        if getattr(type(target), "AUTOSHARD_IN_PLACE", False):  # autoshard.shard's model: its ShardedModule
            target = target.autoshard
        self.pipe = None  # a pipelined module's layout (every tensor of the model, which pipe coordinate holds it)
        self.sharded = getattr(type(target), "AUTOSHARD_SHARDED", False)
        if getattr(type(target), "AUTOSHARD_PIPELINED", False):
            self.sharded = True
            self._init_pipelined(target)
        elif self.sharded:
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
        self.local, self.specs, self.shapes, self.dtypes, self.params = {}, {}, {}, {}, {}
        for names in self.groups:
            t = state[names[0]]
            canon = names[-1]
            self.local[canon] = t
            self.specs[canon] = ()
            self.shapes[canon] = tuple(t.shape)
            self.dtypes[canon] = t.dtype
        for name, p in model.named_parameters(remove_duplicate=False):
            self.params.setdefault(id(p), (self._canon(name), p))

    def _init_sharded(self, sharded) -> None:
        """From the ShardedModule's own state dict: DTensors give this rank's local tensor, its placements and
        the global shape; whole tensors (entries the program never reads) are saved whole."""
        from torch.distributed.tensor import DTensor

        plan = sharded.need_plan()
        self.comm = sharded.communicator()  # refuses a communicator of another mesh
        self.mesh, self.source = plan.mesh, sharded.skeleton  # names only: the skeleton holds meta tensors
        state = sharded.state_dict(keep_vars=True)
        self.local, self.specs, self.shapes, self.dtypes, self.groups, self.params = {}, {}, {}, {}, [], {}
        for names in _alias_groups(sharded):
            canon = names[-1]
            t = state[names[0]]
            self.local[canon] = local_of(t)
            self.specs[canon] = tuple(t.placements) if isinstance(t, DTensor) else None
            self.shapes[canon] = tuple(t.shape)
            self.dtypes[canon] = t.dtype
            self.groups.append(names)
            if isinstance(t, torch.nn.Parameter):
                self.params[id(t)] = (canon, t)

    def _init_pipelined(self, module) -> None:
        """From a PipelinedModule's :meth:`~autoshard.api.pipelined_module.PipelinedModule.checkpoint_layout`: every
        tensor of the model (the same on every rank: names, global shapes, dtypes, layouts on the whole mesh with
        ``Replicate()`` on the pipe axis), and this rank's local tensors, those of its stage(s). DCP then writes each
        stage's shards at their global offsets, as from any plan."""
        layout = module.checkpoint_layout()
        self.comm = module.communicator()
        self.mesh, self.source = module.plan.mesh, module.skeleton
        self.groups, self.local, self.params = layout.groups, layout.local, layout.params
        self.specs, self.shapes, self.dtypes = layout.specs, layout.shapes, layout.dtypes
        self.pipe = layout

    def device(self) -> torch.device:
        return next((t.device for t in self.local.values() if not t.is_meta), torch.device("cpu"))

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
        values = {canon: view.full(canon, t) for canon, t in view.local.items()}
        return _across_pipe(view, values) if view.pipe is not None else values
    finally:
        if comm is not None:
            comm.recording = recording


def _across_pipe(view: _View, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A pipelined module's full tensors on every rank: each from the pipe coordinate of its first stage (a
    broadcast over the pipe axis per tensor, in the model's order, the same on every rank)."""
    axis, coord = view.pipe.axis, view.mesh.coords(view.rank)[view.pipe.axis]
    device = view.device()
    out = {}
    for names in view.groups:
        canon = names[-1]
        src = view.pipe.owner[canon]
        t = values[canon] if coord == src else torch.empty(view.shapes[canon], dtype=view.dtypes[canon],
                                                           device=device)
        out[canon] = view.comm.broadcast(t.to(device), axis, src)
    return out


def _pipe_objects(view: _View, obj) -> list:
    """``obj`` of every pipe coordinate through this rank, in coordinate order (pickled, two all-gathers over the
    pipe axis)."""
    import pickle

    comm, axis, device = view.comm, view.pipe.axis, view.device()
    recording, comm.recording = comm.recording, False
    try:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = comm.all_gather(torch.tensor([data.numel()], dtype=torch.int64, device=device), axis, 0).tolist()
        padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
        padded[: data.numel()] = data.to(device)
        every = comm.all_gather(padded, axis, 0).cpu()
    finally:
        comm.recording = recording
    top = max(sizes)
    return [pickle.loads(every[i * top: i * top + n].numpy().tobytes()) for i, n in enumerate(sizes)]


def _optimizer_entries(view: _View, optim: dict) -> dict[str, tuple[dict, int]]:
    """{``optim.<fqn>.<key>``: (its marker entry, the pipe coordinate that holds it)} of the whole model: this
    rank's, and for a pipelined module every stage's (collective over the pipe axis)."""
    mine = {k: {"param": canon, "shaped": shaped, "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
            for k, (canon, t, shaped) in optim.items()}
    if view.pipe is None:
        return {k: (v, 0) for k, v in mine.items()}
    out: dict[str, tuple[dict, int]] = {}
    for coord, entries in enumerate(_pipe_objects(view, mine)):
        for k, v in entries.items():
            out.setdefault(k, (v, coord))
    return out


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
    entries = _optimizer_entries(view, optim) if optimizer is not None else {}
    marker = _marker(view, optimizer, entries)
    if view.is_dist():
        import torch.distributed as dist

        box = [f"{path}.tmp-{uuid.uuid4().hex}" if view.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        tmp = box[0]
        try:
            dcp.save(_dtensor_state(view, optim), checkpoint_id=tmp)
            view.comm.barrier()
            integrity = _integrity(view, tmp)
        except _dcp_errors() as e:  # DCP wraps a dead peer's "connection closed" in its own exception types
            raise CheckpointError(f"save to {path!r} failed on rank {view.rank} before its commit (did another "
                                  f"rank die?): {_describe(e)}. Nothing was committed: {path!r} is "
                                  f"unchanged and the partial data in {tmp!r} will never load.") from e
        failed = [None]
        if view.rank == 0:
            try:
                _commit(tmp, path, _sealed(marker, integrity))
            except CheckpointError as e:
                failed = [str(e)]
        dist.broadcast_object_list(failed, src=0)  # every rank returns (or raises) once rank 0 has committed
        if failed[0] is not None:
            raise CheckpointError(failed[0] if view.rank == 0 else f"rank 0: {failed[0]}")
        return path
    full = _gather_all(view)
    full_optim = {k: (canon, view.full(canon, t) if shaped else t.detach().clone())
                  for k, (canon, t, shaped) in optim.items()}
    if view.pipe is not None:
        full_optim = _optimizer_across_pipe(view, full_optim, entries)
    if view.rank == 0:
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        state = {f"model.{k}": v for k, v in full.items()}
        state.update({k: v for k, (_, v) in full_optim.items()})
        try:
            with RANK_THREADS.exclusive():  # simulated ranks (threads) read and write one at a time
                dcp.save(state, checkpoint_id=tmp, no_dist=True)
            integrity = _integrity(view, tmp)
        except _dcp_errors() as e:
            _discard(tmp)
            raise CheckpointError(f"save to {path!r} failed before its commit: {_describe(e)}. Nothing was "
                                  f"committed: {path!r} is unchanged and the partial data was removed.") from e
        _commit(tmp, path, _sealed(marker, integrity))
    if view.comm is not None:
        view.comm.barrier()
    return path


def _optimizer_across_pipe(view: _View, full_optim: dict, entries: dict) -> dict:
    """A pipelined module's full optimizer tensors on every rank, each from the pipe coordinate holding it."""
    comm, axis = view.comm, view.pipe.axis
    coord, device = view.mesh.coords(view.rank)[axis], view.device()
    recording, comm.recording = comm.recording, False
    out = {}
    try:
        for key in sorted(entries):
            entry, src = entries[key]
            canon = entry["param"]
            shape = view.shapes[canon] if entry["shaped"] else tuple(entry["shape"])
            t = full_optim[key][1] if coord == src else torch.empty(shape, dtype=getattr(torch, entry["dtype"]),
                                                                    device=device)
            out[key] = (canon, comm.broadcast(t.to(device), axis, src))
    finally:
        comm.recording = recording
    return out


def _dcp_errors() -> tuple:
    """What DCP raises: its ``CheckpointException`` derives from BaseException, not Exception."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def _inner(e: BaseException) -> BaseException | None:
    """The first rank's exception wrapped in DCP's CheckpointException (None for other exceptions)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        inner = inner[0] if isinstance(inner, tuple) else inner
        if isinstance(inner, BaseException):
            return inner
    return None


def _describe(e: BaseException) -> str:
    """``Type: first line`` of ``e``; for DCP's CheckpointException, of the first rank's wrapped exception."""
    inner = _inner(e)
    if inner is not None:
        return f"{type(e).__name__} ({type(inner).__name__}: {_first_line(inner)})"
    return f"{type(e).__name__}: {_first_line(e)}"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


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
                out[f"optim.{canon}.{key}"] = (canon, local_of(value), shaped)
    return out


def _jsonable(value):
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return repr(value)


def _marker(view: _View, optimizer, entries: dict) -> dict:
    """The commit marker's contents: every tensor of the model (a pipelined module's of every stage) and, with an
    optimizer, every state entry (``entries``: :func:`_optimizer_entries`)."""
    tensors = {}
    for names in view.groups:
        canon = names[-1]
        spec = view.specs[canon]
        tensors[canon] = {"shape": list(view.shapes[canon]), "dtype": str(view.dtypes[canon]).replace("torch.", ""),
                          "aliases": list(names), "spec": format_spec(spec) if spec else None}
    out = {"format": FORMAT, "torch": torch.__version__,
           "mesh": [list(a) for a in view.mesh.axes] if view.mesh is not None else None,
           "tensors": tensors}
    if optimizer is not None:
        out["optimizer"] = {
            "type": type(optimizer).__name__,
            "param_groups": [{k: _jsonable(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
            "state": {k: entry for k, (entry, _) in entries.items()},
        }
    return out


def _device_mesh(view: _View):
    from autoshard.runtime.parameters import device_mesh

    # the device type of this rank's tensors: "cuda" under NCCL, "cpu" under gloo
    device_type = next((t.device.type for t in view.local.values() if not t.is_meta), "cpu")
    return device_mesh(view.mesh, device_type)


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


# ---- integrity ----------------------------------------------------------------------------------------------
def _crc_hex(value: int) -> str:
    return f"{value & 0xFFFFFFFF:08x}"


def _canonical(marker: dict) -> bytes:
    """The bytes the marker's own checksum covers: its JSON without ``crc32``, keys sorted, no spaces."""
    body = {k: v for k, v in marker.items() if k != "crc32"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _sealed(marker: dict, integrity: dict) -> dict:
    out = dict(marker, saved_ns=time.time_ns(), integrity=integrity)
    out["crc32"] = _crc_hex(zlib.crc32(_canonical(out)))
    return out


def _data_files(directory: str) -> list[str]:
    """The files DCP wrote into ``directory`` (every file but our marker), sorted."""
    return sorted(n for n in os.listdir(directory)
                  if not n.startswith(MARKER) and os.path.isfile(os.path.join(directory, n)))


def _scan(file_path: str, chunks: list[dict]) -> dict:
    """Size and crc32 of the file, and the crc32 of each chunk's byte range (``start``, ``length``), in one
    sequential read."""
    order = sorted(range(len(chunks)), key=lambda i: chunks[i]["start"])
    crcs = [0] * len(chunks)
    whole, pos, first = 0, 0, 0
    with open(file_path, "rb") as f:
        while block := f.read(_BLOCK):
            view = memoryview(block)
            end = pos + len(block)
            whole = zlib.crc32(view, whole)
            k = first
            while k < len(order) and chunks[order[k]]["start"] < end:
                c = chunks[order[k]]
                lo, hi = max(c["start"], pos) - pos, min(c["start"] + c["length"], end) - pos
                if hi > lo:
                    crcs[order[k]] = zlib.crc32(view[lo:hi], crcs[order[k]])
                k += 1
            while first < len(order) and chunks[order[first]]["start"] + chunks[order[first]]["length"] <= end:
                first += 1
            pos = end
    return {"size": pos, "crc32": _crc_hex(whole), "chunks": [_crc_hex(c) for c in crcs]}


def _integrity(view: _View, tmp: str) -> dict:
    """The checksums of a just-written DCP directory: ``{"algorithm": "crc32", "files": {name: {"size", "crc32",
    "chunks": [{"tensor", "offsets", "start", "length", "crc32"}]}}}``. On ``torch.distributed`` every rank reads
    a share of the files (file ``i`` on rank ``i % world``) and the results are gathered; collective."""
    from torch.distributed.checkpoint import FileSystemReader

    files = _data_files(tmp)
    chunks: dict[str, list[dict]] = {f: [] for f in files}
    for index, info in FileSystemReader(tmp).read_metadata().storage_data.items():
        chunks.setdefault(info.relative_path, []).append(
            {"tensor": index.fqn, "offsets": [int(o) for o in index.offset], "start": int(info.offset),
             "length": int(info.length)})
    world = torch.distributed.get_world_size() if view.is_dist() else 1
    rank = view.rank if view.is_dist() else 0
    mine, error = {}, None
    try:
        for name in files[rank::world]:
            scanned = _scan(os.path.join(tmp, name), chunks.get(name, []))
            listed = [dict(c, crc32=crc) for c, crc in zip(chunks.get(name, []), scanned["chunks"])]
            mine[name] = {"size": scanned["size"], "crc32": scanned["crc32"], "chunks": listed}
    except OSError as e:
        error = f"rank {rank} could not checksum the files it wrote in {tmp!r}: {_describe(e)}"
    parts = [(mine, error)]
    if view.is_dist():
        parts = [None] * world
        with view.comm._guard("checkpoint checksum exchange", None):
            torch.distributed.all_gather_object(parts, (mine, error))
    out: dict[str, dict] = {}
    for got, err in parts:  # the callers re-raise these as CheckpointError
        if err is not None:
            raise OSError(err)
        out.update(got)
    missing = sorted(set(chunks) - set(out))
    if missing:
        raise OSError(f"DCP's metadata in {tmp!r} lists files {missing} that were not written")
    return {"algorithm": "crc32", "files": {f: out[f] for f in sorted(out)}}


def _holds(info: dict) -> str:
    if not info.get("chunks"):
        return "DCP's metadata" if info.get("name") == ".metadata" else "no tensor chunks"
    names = list(dict.fromkeys(c["tensor"] for c in info["chunks"]))
    shown = ", ".join(f"`{n}`" for n in names[:4])
    return f"chunks of {shown}" + (f" and {len(names) - 4} more tensors" if len(names) > 4 else "")


def _file_problem(directory: str, name: str, info: dict) -> str | None:
    """What is wrong with one listed file, or None: missing, of another size, or checksums that differ."""
    file_path = os.path.join(directory, name)
    holds = _holds(dict(info, name=name))
    try:
        size = os.stat(file_path).st_size
    except FileNotFoundError:
        return (f"checkpoint {directory!r} is missing its file {name!r} ({holds}), but its commit marker lists it: "
                "it was deleted or moved after the save. Restore the file or save again.")
    except OSError as e:
        return f"checkpoint file {file_path!r} ({holds}) cannot be read: {_describe(e)}."
    if size != info["size"]:
        return (f"checkpoint file {file_path!r} ({holds}) has {size} bytes, but the save wrote {info['size']}: it "
                "was truncated or overwritten after the save. Restore the file or save again.")
    try:
        scanned = _scan(file_path, info.get("chunks", []))
    except OSError as e:
        return f"checkpoint file {file_path!r} ({holds}) cannot be read: {_describe(e)}."
    bad = [(c, got) for c, got in zip(info.get("chunks", []), scanned["chunks"]) if got != c["crc32"]]
    after = "the file was changed after the save. Restore the file or save again."
    if bad:
        c, got = bad[0]
        more = ""
        if len(bad) > 1:
            more = f"; {len(bad) - 1} more damaged chunks: " + ", ".join(f"`{b['tensor']}`" for b, _ in bad[1:5])
        return (f"checkpoint file {file_path!r} holds damaged data: tensor `{c['tensor']}` (chunk at offsets "
                f"{c['offsets']}, bytes {c['start']}..{c['start'] + c['length']}) has crc32 {got}, but the save "
                f"wrote {c['crc32']}{more}: {after}")
    if scanned["crc32"] != info["crc32"]:
        return (f"checkpoint file {file_path!r} ({holds}) holds damaged data: its crc32 is {scanned['crc32']}, but "
                f"the save wrote {info['crc32']}: {after}")
    return None


def _verify_files(view: _View, directory: str, marker: dict) -> None:
    """Check every file the marker lists (sizes first, then checksums) before DCP reads any; on
    ``torch.distributed`` rank ``r`` checks files ``r, r + world, ...`` and every rank raises the same error."""
    integrity = marker.get("integrity")
    if integrity is None:  # FORMAT_V1: read_marker warned
        return
    files = sorted(integrity["files"])
    dist_ = view.is_dist()
    world = torch.distributed.get_world_size() if dist_ else 1
    rank = view.rank if dist_ else 0
    mine = files[rank::world]
    problems = [p for p in (_file_problem(directory, n, integrity["files"][n]) for n in mine) if p]
    if dist_:
        gathered = [None] * world
        with view.comm._guard("checkpoint verification exchange", None):
            torch.distributed.all_gather_object(gathered, problems)
        problems = [p for part in gathered for p in part]
    if problems:
        extra = f" ({len(problems) - 1} more damaged files: {problems[1:3]})" if len(problems) > 1 else ""
        raise CheckpointError(problems[0] + extra)


# ---- commit -------------------------------------------------------------------------------------------------
_LEFTOVER = r"\.(tmp|old)-[0-9a-f]{32}"


def _rename(src: str, dst: str) -> None:
    """Every rename of a commit (tests replace it to crash at each step)."""
    os.replace(src, dst)


def _rmtree(directory: str) -> None:
    shutil.rmtree(directory, ignore_errors=True)


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _discard(directory: str) -> None:
    """Remove a directory of ours: its marker first, so a half-removed directory never looks complete."""
    try:
        os.remove(os.path.join(directory, MARKER))
    except OSError:
        pass
    _rmtree(directory)


def _leftovers(path: str) -> list[str]:
    """``<path>.tmp-<uuid>`` and ``<path>.old-<uuid>`` directories beside ``path`` (only names save makes)."""
    parent = os.path.dirname(os.path.abspath(path))
    base = os.path.basename(os.path.abspath(path))
    if not os.path.isdir(parent):
        return []
    pattern = re.compile(re.escape(base) + _LEFTOVER)
    return sorted(os.path.join(os.path.dirname(path), n) for n in os.listdir(parent)
                  if pattern.fullmatch(n) and os.path.isdir(os.path.join(parent, n)))


def _write_marker(tmp: str, marker: dict) -> None:
    part = os.path.join(tmp, MARKER + ".part")
    with open(part, "w") as f:
        json.dump(marker, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _rename(part, os.path.join(tmp, MARKER))
    _fsync_dir(tmp)


def _commit(tmp: str, path: str, marker: dict) -> None:
    """Rank 0, after every rank has written: marker last, then the renames that make the checkpoint visible.

    Crash points and what :func:`load` finds: before the marker is renamed into place, ``tmp`` is incomplete and
    ``path`` the previous checkpoint; before ``path`` moves aside, ``tmp`` is complete but not committed (load
    reads ``path``, warning); between the two renames there is no ``path`` (load reads ``tmp``, the newer
    complete directory, warning); after them, ``path`` is the new checkpoint and the next save removes what is
    left over."""
    parent = os.path.dirname(os.path.abspath(path))
    try:
        _write_marker(tmp, marker)
        old = None
        if os.path.lexists(path):
            old = f"{path}.old-{uuid.uuid4().hex}"
            _rename(path, old)  # the commit point: from here on load reads the new checkpoint
        _rename(tmp, path)
        _fsync_dir(parent)
    except OSError as e:
        raise CheckpointError(f"save to {path!r} failed during its commit: {_describe(e)}. load({path!r}) reads the "
                              "last complete checkpoint (the previous one, or this one from its leftover directory, "
                              "with a warning).") from e
    for leftover in _leftovers(path):  # the previous checkpoint and every earlier interrupted save
        _discard(leftover)


# ---- load ---------------------------------------------------------------------------------------------------
def read_marker(path: str | os.PathLike) -> dict:
    """The commit marker of the checkpoint directory ``path``, its own checksum verified; :class:`CheckpointError`
    if there is none or it is damaged."""
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

    def damaged(detail: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {path!r} has a damaged commit marker {marker_path!r}: {detail}: it was "
                               "changed after the save. Restore the file or save again.")

    try:
        with open(marker_path, "rb") as f:
            marker = json.loads(f.read())
    except OSError as e:
        raise damaged(f"reading it failed ({_describe(e)})") from e
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise damaged(f"it is not valid JSON ({_describe(e)})") from e
    if not isinstance(marker, dict):
        raise damaged(f"it holds a JSON {type(marker).__name__}, not an object")
    if "crc32" in marker:
        got = _crc_hex(zlib.crc32(_canonical(marker)))
        if got != marker["crc32"]:
            raise damaged(f"its contents have crc32 {got}, but the save wrote {marker['crc32']!r}")
    elif marker.get("format") == FORMAT_V1 and "integrity" not in marker:
        warnings.warn(f"checkpoint {path!r} has format {FORMAT_V1!r}, written without checksums: it loads "
                      "unverified. Save it again to add them.", stacklevel=3)
        return marker
    elif marker.get("format") == FORMAT or "integrity" in marker:
        raise damaged("it has no checksum (crc32), but every marker of this format has one")
    if marker.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path!r} has format {marker.get('format')!r}, but this autoshard reads "
                              f"{FORMAT!r}.")
    if not isinstance(marker.get("integrity"), dict) or not isinstance(marker.get("tensors"), dict):
        raise damaged("it lacks its tensor list or checksums")
    return marker


def _resolve(path: str) -> tuple[str, dict]:
    """The directory to load for ``path`` and its marker. ``path`` itself when it exists (damage there raises);
    when a save was interrupted between moving the previous checkpoint aside and renaming the new one into place,
    the newest complete leftover (``.tmp-``: the new one; ``.old-``: the previous one). Warns whenever leftovers
    of interrupted saves sit beside ``path``, naming the directory it loads."""
    leftovers = _leftovers(path)
    if os.path.isdir(path) or not leftovers:
        marker = read_marker(path)
        if leftovers:
            newer = [d for d in leftovers if ".tmp-" in os.path.basename(d) and _complete(d) is not None]
            note = (f"; {newer} hold(s) a complete save that was interrupted before its commit, not loaded" if newer
                    else "")
            warnings.warn(f"checkpoint {path!r}: loading {path!r} itself, the last committed checkpoint{note}. "
                          f"Leftovers of interrupted saves sit beside it ({[os.path.basename(d) for d in leftovers]}); "
                          "the next save to it removes them.", stacklevel=3)
        return path, marker
    complete = [(m.get("saved_ns", 0), d, m) for d in leftovers if (m := _complete(d)) is not None]
    if not complete:
        return path, read_marker(path)  # raises: no checkpoint directory (partial data beside it)
    _, used, marker = max(complete, key=lambda c: (c[0], ".tmp-" in os.path.basename(c[1])))
    which = "the new checkpoint" if ".tmp-" in os.path.basename(used) else "the previous checkpoint"
    others = [os.path.basename(d) for d in leftovers if d != used]
    warnings.warn(f"checkpoint {path!r} is missing: a save to it was interrupted between moving the previous "
                  f"checkpoint aside and renaming the new one into place. Loading {which} from {used!r} (complete: "
                  f"its commit marker and file sizes check out)"
                  + (f"; also left over: {others}" if others else "")
                  + f". The next save to {path!r} removes the leftovers.", stacklevel=3)
    return used, marker


def _complete(directory: str) -> dict | None:
    """The marker of a leftover directory if it is a complete checkpoint (marker and file sizes), else None."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            marker = read_marker(directory)
    except CheckpointError:
        return None
    for name, info in (marker.get("integrity") or {}).get("files", {}).items():
        try:
            if os.stat(os.path.join(directory, name)).st_size != info["size"]:
                return None
        except OSError:
            return None
    return marker


def load(target, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Restore ``target``'s tensors (and ``optimizer``'s state) from the checkpoint at ``path``, resharding to
    ``target``'s plan. Collective on a ShardedModule. Returns the checkpoint's marker (mesh, specs, hyper-
    parameters).

    Every file is checked against the marker's sizes and checksums first (a damaged one raises
    :class:`CheckpointError` naming it); when a save to ``path`` was interrupted mid-commit, the last complete
    checkpoint is loaded from its leftover directory, with a warning naming it.

    A Hugging Face directory (``model.safetensors`` or ``model.safetensors.index.json``, no commit marker) is read
    by :func:`autoshard.api.materialize.load_pretrained` instead: each rank reads only its slices; returns
    ``{"bytes_read": ..., "tensors": ...}``."""
    marker = _load_checkpoint(target, path, optimizer)
    if getattr(target, "initialised", True) is False:
        if getattr(type(target), "AUTOSHARD_PIPELINED", False):
            _compute_unsaved_pipelined(target, path)
        else:
            _compute_unsaved(target, path)
    return marker


def _compute_unsaved_pipelined(module, path) -> None:
    """:func:`_compute_unsaved` of a PipelinedModule: each stage's non-persistent buffers, by their modules' init."""
    from autoshard.errors import AutoshardError

    try:
        module.compute_unsaved()
    except AutoshardError as e:
        raise CheckpointError(f"checkpoint {os.fspath(path)!r} loaded, but the tensors it never holds "
                              f"(non-persistent buffers) could not be computed by their modules' init: {e}") from e


def _compute_unsaved(sharded, path) -> None:
    """After an autoshard checkpoint filled a meta-built ShardedModule: the tensors a checkpoint never holds
    (non-persistent buffers such as rotary ``inv_freq``) are computed by their modules' init, as ``init_weights``
    computes them; then the module may run."""
    from autoshard import meta as M
    from autoshard.errors import AutoshardError
    from autoshard.api.materialize import init_local

    persistent = set(sharded.skeleton.state_dict().keys())
    unsaved = {n.target for n in sharded.plan.graph_module.graph.nodes if n.op == "get_attr"
               and isinstance(n.meta.get("val"), torch.Tensor)
               and not any(a in persistent for a in n.meta.get(M.ALIASES, (n.target,)))}
    if unsaved:
        try:
            init_local(sharded.skeleton, sharded.local, sharded.plan, sharded.rank, sharded.device, only=unsaved)
        except AutoshardError as e:
            raise CheckpointError(f"checkpoint {os.fspath(path)!r} loaded, but {sorted(unsaved)} (never saved: "
                                  f"non-persistent buffers) could not be computed by their modules' init: {e}") from e
    sharded.mark_initialised()


def _load_checkpoint(target, path, optimizer) -> dict:
    import torch.distributed.checkpoint as dcp

    from autoshard.api.materialize import is_pretrained_dir, load_pretrained

    path = os.fspath(path)
    if is_pretrained_dir(path):
        if optimizer is not None:
            raise CheckpointError(f"{path!r} is a Hugging Face directory, which holds no optimizer state, but load "
                                  "was given optimizer=: load without it (or from an autoshard.save checkpoint).")
        if getattr(type(target), "AUTOSHARD_PIPELINED", False):
            return target.load_pretrained(path)
        return load_pretrained(target, path)
    used, marker = _resolve(path)
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
    _verify_files(view, used, marker)  # before DCP reads a byte, and before the optimizer is touched
    optim = _prepare_optimizer(view, optimizer, marker, path) if optimizer is not None else {}
    if view.is_dist():
        dm = _device_mesh(view)
        state = {f"model.{plan[c]}": _dtensor(view, dm, c, t) for c, t in view.local.items()}
        for key, (canon, t, shaped) in optim.items():
            state[key] = _dtensor(view, dm, canon, t) if shaped else t
        _read(used, lambda: dcp.load(state, checkpoint_id=used))
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
    with RANK_THREADS.exclusive():  # simulated ranks (threads) read and write one at a time
        _read(used, lambda: dcp.load(full, checkpoint_id=used, no_dist=True))
    with torch.no_grad():
        for c, t in view.local.items():
            t.copy_(_mine(view, c, full[f"model.{plan[c]}"]))
        for key, (canon, t, shaped) in optim.items():
            t.copy_(_mine(view, canon, full[key]) if shaped else full[key])
    if view.comm is not None:
        view.comm.barrier()
    return marker


def _read(directory: str, fn) -> None:
    """Run DCP's read; its exceptions (and the OS's) become a CheckpointError naming the file where one is known."""
    try:
        fn()
    except _dcp_errors() as e:
        if isinstance(e, CheckpointError):
            raise
        inner = _inner(e) or e
        text = f"{e} {inner}"
        names = [n for n in sorted(os.listdir(directory)) if n in text] if os.path.isdir(directory) else []
        filename = getattr(inner, "filename", None)
        where = f" in {filename!r}" if filename else f" in {os.path.join(directory, names[0])!r}" if names else ""
        raise CheckpointError(f"checkpoint {directory!r} could not be read{where}: torch.distributed.checkpoint "
                              f"raised {_describe(e)}. Restore its files or save again.") from e


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
                out[key] = (canon, local_of(state[name]), entry["shaped"])
    return out
