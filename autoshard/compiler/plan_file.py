"""A plan as a file: what :meth:`Plan.save` writes and :func:`autoshard.load_plan` reads back.

A plan is the trace of the model plus the plan phase of the pass list, and every step of that is deterministic but
one: the plan search, whose time limit (and a busy machine) may change what it returns. So a file holds the inputs
of the plan phase (the mesh, the options) and the search's decisions (what :attr:`Context.once` returned: the
:class:`autoshard.passes.plan_search.Decided` of each search), and loading it plans again replaying them, as the
other ranks of a job replay rank 0's (:func:`autoshard.api.planning.plan_once`), without building or searching a
problem. What the plan was made for is kept beside it and checked before anything is traced: the model's parameters
and buffers (name, shape, dtype), the example inputs (each leaf's shape and dtype, or its value) and the training
mode; after the replay, the plan's :meth:`~autoshard.compiler.plan.Plan.digest` must be the one saved (a torch that
traces the model differently is named by the first node whose layout differs).

The format is JSON, one top-level key a line (``head plan.json`` shows the header), version :data:`VERSION`::

    {"format": "autoshard-plan", "version": 1, "autoshard": "0.1.0", "torch": "2.13.0",
     "model": "GPT", "training": true, "mesh": [["data", 2], ["model", 2]], "options": {"$": "Options", ...},
     "parameters": {"wte.weight": [[128, 64], "torch.float32"], ...}, "tied": [["head.weight", "wte.weight"]],
     "inputs": [{"name": "args[0]", "shape": [4, 16], "dtype": "torch.int64"}, ...],
     "digest": "3f2a...", "layout": {"idx": "placeholder idx (Shard(dim=0), Replicate())", ...},
     "decisions": [{"$": "Decided", "planned": {...}, ...}]}

Values JSON has no word for are objects tagged ``"$"``: ``tuple``, ``dict`` (keys not all text), ``float`` (inf,
nan), ``dtype``, torch's placements (``Shard``, ``Replicate``, ``Partial``) and the frozen dataclasses of
:func:`_classes` (options, strategies, the search's decisions). No pickle: reading a file builds only those
classes, through their constructors (which check their fields), so a plan file from elsewhere cannot run code; a
tag or field outside that list is an error naming it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
from dataclasses import dataclass

import torch

from autoshard.errors import PlanError
from autoshard.mesh import Mesh

__all__ = ["FORMAT", "VERSION", "PlanFile", "decode", "encode", "input_leaves", "read_plan_file", "tied_groups",
           "write_plan_file"]

FORMAT = "autoshard-plan"
#: the format's version: a file of another version is refused, naming both
VERSION = 1


def _classes() -> dict[str, type]:
    """The classes a plan file may hold, by tag: the plan's options and the search's decisions."""
    from autoshard.compiler.context import Options
    from autoshard.compiler.context_parallel import ContextParallel
    from autoshard.compiler.moe.options import MoE
    from autoshard.cost_models.profile import HardwareProfile, LinkCost
    from autoshard.frontend.precision import MixedPrecision
    from autoshard.meta import CollectiveInfo, Decision, Storage, Strategy
    from autoshard.passes.plan_search import Decided

    return {c.__name__: c for c in (Options, ContextParallel, MoE, HardwareProfile, LinkCost, MixedPrecision,
                                    Decision, Storage, Strategy, CollectiveInfo, Decided)}


def encode(value, where: str = "plan"):
    """``value`` as JSON data (see the module docstring); a value of another type is a PlanError naming ``where``."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) else {"$": "float", "value": repr(value)}
    if isinstance(value, list):
        return [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"$": "tuple", "items": [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and "$" not in value:
            return {k: encode(v, f"{where}[{k!r}]") for k, v in value.items()}
        return {"$": "dict", "items": [[encode(k, where), encode(v, f"{where}[{k!r}]")] for k, v in value.items()]}
    if isinstance(value, torch.dtype):
        return {"$": "dtype", "name": str(value).removeprefix("torch.")}
    if type(value) is Shard:
        return {"$": "Shard", "dim": value.dim}
    if type(value) is Replicate:
        return {"$": "Replicate"}
    if type(value) is Partial:
        return {"$": "Partial", "reduce_op": value.reduce_op}
    name = type(value).__name__
    if dataclasses.is_dataclass(value) and _classes().get(name) is type(value):
        out = {"$": name}
        for f in dataclasses.fields(value):
            if f.init:
                out[f.name] = encode(getattr(value, f.name), f"{where}.{f.name}")
        return out
    raise PlanError(f"{where} holds a {type(value).__module__}.{name} ({value!r:.80}), but a plan file stores only "
                    "numbers, text, lists, tuples, dicts, dtypes, placements and autoshard's option and decision "
                    "classes: give that option as one of those to save the plan.")


def decode(data, where: str = "plan file"):
    """The value :func:`encode` made ``data`` of; a tag or field outside the format is a PlanError naming it."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    if isinstance(data, list):
        return [decode(v, f"{where}[{i}]") for i, v in enumerate(data)]
    if not isinstance(data, dict):
        return data
    tag = data.get("$")
    if tag is None:
        return {k: decode(v, f"{where}[{k!r}]") for k, v in data.items()}
    fields = {k: v for k, v in data.items() if k != "$"}
    try:
        if tag == "tuple":
            return tuple(decode(v, f"{where}[{i}]") for i, v in enumerate(fields["items"]))
        if tag == "dict":
            return {_hashable(decode(k, where)): decode(v, f"{where}[{k!r}]") for k, v in fields["items"]}
        if tag == "float":
            return float(fields["value"])
        if tag == "dtype":
            dtype = getattr(torch, fields["name"], None)
            if not isinstance(dtype, torch.dtype):
                raise PlanError(f"{where} names the dtype {fields['name']!r}, which this torch ({torch.__version__}) "
                                "does not have: the plan was saved with another torch. Load it with that torch, or "
                                "plan again and save the plan with this one.")
            return dtype
        if tag == "Shard":
            return Shard(int(fields["dim"]))
        if tag == "Replicate":
            return Replicate()
        if tag == "Partial":
            return Partial(str(fields["reduce_op"]))
    except (KeyError, TypeError, ValueError) as e:
        raise PlanError(f"{where} has a malformed {tag!r} value ({e}): the file is damaged; save the plan "
                        "again.") from None
    cls = _classes().get(tag)
    if cls is None:
        raise PlanError(f"{where} holds a value tagged {tag!r}, which a plan file may not hold (the tags are "
                        f"tuple, dict, float, dtype, Shard, Replicate, Partial, {', '.join(_classes())}): the "
                        "file is damaged or not autoshard's; save the plan again.")
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise PlanError(f"{where} gives {tag} the fields {unknown}, which this autoshard's {tag} does not have "
                        f"(it has {sorted(known)}): save the plan again with this version of autoshard.")
    return cls(**{k: decode(v, f"{where}.{k}") for k, v in fields.items()})


def _hashable(key):
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


def input_leaves(args: tuple, kwargs: dict) -> list[dict]:
    """One entry per leaf of the example inputs: its name (``args[0]``, ``kwargs['labels']``) and its shape and dtype,
    or, for a value that is not a tensor, its text (a constant argument is part of the trace)."""
    from torch.utils import _pytree as pytree

    leaves, _ = pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))
    out = []
    for path, leaf in leaves:
        name = ("args" if path[0].idx == 0 else "kwargs") + pytree.keystr(path[1:])
        if isinstance(leaf, torch.Tensor):
            out.append({"name": name, "shape": list(leaf.shape), "dtype": str(leaf.dtype)})
        else:
            out.append({"name": name, "value": repr(leaf)})
    return out


def tied_groups(model: torch.nn.Module) -> list[list[str]]:
    """The names of each parameter or buffer ``model`` holds under more than one name (tied weights), sorted: a
    model that ties other weights traces to another program."""
    names: dict[int, list[str]] = {}
    for n, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(t), []).append(n)
    return sorted(sorted(group) for group in names.values() if len(group) > 1)


def _portable_profile(profile):
    """A profile given as a TOML path, as the profile it holds (a preset's name, a HardwareProfile or None kept)."""
    from autoshard.cost_models.profile import HardwareProfile, list_profiles, load_profile

    if profile is None or isinstance(profile, HardwareProfile) or (isinstance(profile, str) and
                                                                   profile in list_profiles()):
        return profile
    return load_profile(os.fspath(profile))


def _portable_options(options):
    """``options`` with a profile given as a TOML path replaced by the profile it holds: the file must plan the same
    on a machine that lacks the path (a preset's name is kept: the package has it)."""
    from autoshard.cost_models.profile import HardwareProfile, list_profiles, load_profile

    profile = options.profile
    if isinstance(profile, HardwareProfile) or (isinstance(profile, str) and profile in list_profiles()):
        return options
    return dataclasses.replace(options, profile=load_profile(os.fspath(profile)))


def write_plan_file(plan, path) -> None:
    """Write ``plan`` (a :class:`~autoshard.compiler.plan.Plan`, or a
    :class:`~autoshard.compiler.pipeline.PipelinePlan`) to ``path`` in the format above. A pipelined plan is its
    microbatch plan's file (options and decisions of the mesh without the pipe axis) with the whole mesh, the whole
    batch's inputs, ``pipeline`` (its options) and ``split`` (where the stages start, to check after the replay)."""
    import autoshard

    pipelined = hasattr(plan, "microbatch_plan")  # a PipelinePlan (imported here, it would close an import cycle)
    inner = plan.microbatch_plan if pipelined else plan
    if inner.context.pinned is not None:
        raise PlanError("this plan keeps the layouts of another plan (the program of the other mode or of new input "
                        "shapes, made by a ShardedModule), which a plan file does not hold: save the plan "
                        "autoshard.plan returned (sharded.plan).")
    header = {
        "format": FORMAT, "version": VERSION,
        "autoshard": getattr(autoshard, "__version__", None) or _version(), "torch": torch.__version__,
        "model": inner.model_name, "training": inner.training,
        "mesh": [[name, size] for name, size in plan.mesh.axes],
        "options": encode(_portable_options(inner.context.options), "option"),
        "parameters": {name: [list(shape), dtype] for name, (shape, dtype) in inner.model_signature.items()},
        "tied": inner.tied,
        "inputs": input_leaves(*plan.examples),
        "digest": inner.digest(),
        "layout": inner.layout(),
        "decisions": encode(list(inner.decisions), "decision"),
    }
    if pipelined:
        p = plan.pipeline
        header["pipeline"] = {
            "microbatches": p.microbatches, "schedule": p.schedule,
            "split": p.split if isinstance(p.split, str) else list(p.split), "stages_per_rank": p.stages_per_rank,
            "axis": p.axis, "profile": encode(_portable_profile(p.profile), "pipeline profile"),
            "loss_fn": p.loss_fn is not None}
        header["split"] = {"cuts": list(plan.split.cuts), "modules": [list(m) for m in plan.split.modules]}
    text = "{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v, allow_nan=False)}" for k, v in header.items()) + "\n}\n"
    tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)  # a reader never sees half a file


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("autoshard")
    except PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True)
class PlanFile:
    """A plan file read back: what the plan was made for, its options, and the search's decisions."""

    path: str
    mesh: Mesh
    options: object  # autoshard.compiler.context.Options
    training: bool
    model_name: str
    parameters: dict  # name -> (shape tuple, dtype text)
    tied: list  # tied_groups of the model
    inputs: list  # input_leaves of the examples
    digest: str
    layout: dict
    decisions: list
    #: a pipelined plan's options (``Pipeline``'s fields, ``loss_fn``: whether it had one), else None
    pipeline: dict | None = None
    #: a pipelined plan's stage split: ``cuts`` and ``modules`` per stage
    split: dict | None = None

    def check_split(self, pplan) -> None:
        """The replayed pipelined plan's stages against the saved ones: a PlanError naming the first that differs."""
        modules = [list(m) for m in pplan.split.modules]
        if list(pplan.split.cuts) == self.split["cuts"] and modules == self.split["modules"]:
            return
        first = next((i for i, (a, b) in enumerate(zip(self.split["modules"], modules)) if a != b),
                     min(len(modules), len(self.split["modules"])))
        saved = self.split["modules"][first] if first < len(self.split["modules"]) else "absent"
        here = modules[first] if first < len(modules) else "absent"
        raise PlanError(f"the plan in {self.path} replays to other pipeline stages here (stage {first} holds "
                        f"{saved} in the file, {here} here): this torch or autoshard prices or cuts the model "
                        "differently from the one that saved it. Save the plan again with the versions this job runs.")

    # ---- what it was made for -----------------------------------------------------------------------------
    def check_mesh(self, mesh: Mesh) -> None:
        if mesh != self.mesh:
            raise PlanError(f"the plan in {self.path} is for the mesh {_mesh_text(self.mesh)}, but the mesh given is "
                            f"{_mesh_text(mesh)}: load it with mesh={_mesh_text(self.mesh)} (or none: the file's), "
                            "or plan for this mesh and save that plan.")

    def check_world(self, world_size: int) -> None:
        if world_size != self.mesh.size:
            raise PlanError(f"the plan in {self.path} is for the mesh {_mesh_text(self.mesh)} of {self.mesh.size} "
                            f"ranks, but this job has {world_size} ranks: start {self.mesh.size} ranks, or plan for "
                            f"{world_size} and save that plan.")

    def check_model(self, model: torch.nn.Module, signature: dict) -> None:
        """Every parameter and buffer of the file's model against ``model``'s (``signature``: its
        :func:`~autoshard.compiler.plan.signature_of`): a PlanError naming each difference."""
        kinds = {n: "buffer" for n, _ in model.named_buffers(remove_duplicate=False)}
        kinds.update((n, "parameter") for n, _ in model.named_parameters(remove_duplicate=False))
        mine = {n: (tuple(s), d) for n, (s, d) in self.parameters.items()}
        diffs = []
        for name, (shape, dtype) in mine.items():
            if name not in signature:
                diffs.append(f"{name} is in the file's model but not in this {type(model).__name__}")
                continue
            their_shape, their_dtype = signature[name]
            if their_shape != shape:
                diffs.append(f"{kinds.get(name, 'tensor')} {name} has shape {_shape(shape)} in the file, "
                             f"{_shape(their_shape)} in this model")
            if their_dtype != dtype:
                diffs.append(f"{kinds.get(name, 'tensor')} {name} has dtype {dtype} in the file, {their_dtype} in "
                             "this model")
        diffs += [f"{kinds.get(n, 'tensor')} {n} is in this model but not in the file's" for n in signature
                  if n not in mine]
        if not diffs and tied_groups(model) != self.tied:
            theirs = tied_groups(model)
            diffs += [f"{' and '.join(g)} are one tensor in the file's model, not in this one" for g in self.tied
                      if g not in theirs]
            diffs += [f"{' and '.join(g)} are one tensor in this model, not in the file's" for g in theirs
                      if g not in self.tied]
        if self.model_name != type(model).__name__:
            diffs.insert(0, f"the file's model is a {self.model_name}, this one a {type(model).__name__}")
        if diffs:
            more = f" (and {len(diffs) - 8} more)" if len(diffs) > 8 else ""
            raise PlanError(f"the plan in {self.path} was made for another model: " + "; ".join(diffs[:8]) + more +
                            ". Build the model the plan was made for (the same config), or plan this one and save "
                            "that plan.")
        if mine and model.training != self.training:
            raise PlanError(f"the plan in {self.path} was made in {_mode(self.training)} mode, but the model is in "
                            f"{_mode(model.training)} mode: call model.{'train' if self.training else 'eval'}() "
                            "before loading it.")

    def check_inputs(self, args: tuple, kwargs: dict) -> None:
        """The example inputs against the file's: a PlanError naming each leaf that differs."""
        given = {leaf["name"]: leaf for leaf in input_leaves(args, kwargs)}
        saved = {leaf["name"]: leaf for leaf in self.inputs}
        diffs = [f"input {n} is in the file but not given" for n in saved if n not in given]
        diffs += [f"input {n} is given but not in the file" for n in given if n not in saved]
        for name, leaf in saved.items():
            other = given.get(name)
            if other is None or other == leaf:
                continue
            if "shape" in leaf and "shape" in other:
                if leaf["shape"] != other["shape"]:
                    diffs.append(f"input {name} has shape {_shape(leaf['shape'])} in the file, "
                                 f"{_shape(other['shape'])} given")
                if leaf["dtype"] != other["dtype"]:
                    diffs.append(f"input {name} has dtype {leaf['dtype']} in the file, {other['dtype']} given")
            else:
                diffs.append(f"input {name} is {_leaf(leaf)} in the file, {_leaf(other)} given")
        if diffs:
            raise PlanError(f"the plan in {self.path} was made for other example inputs: " + "; ".join(diffs[:8]) +
                            ". Give example inputs of the shapes it was planned for (global: the whole batch), or "
                            "plan for these and save that plan.")

    def check_digest(self, plan) -> None:
        """The replayed plan against the saved one: a PlanError naming the first node whose layout differs."""
        if plan.digest() == self.digest:
            return
        layout = plan.layout()
        first = next((n for n in self.layout if layout.get(n) != self.layout[n]), None)
        first = first or next((n for n in layout if n not in self.layout), None)
        where = (f"node {first} is `{self.layout.get(first, 'absent')}` in the file, `{layout.get(first, 'absent')}` "
                 "here" if first is not None else "the nodes agree, their order does not")
        raise PlanError(f"the plan in {self.path} replays to another plan here ({where}): this torch or autoshard "
                        "traces or plans the model differently from the one that saved it. Save the plan again with "
                        "the versions this job runs.")


def read_plan_file(path) -> PlanFile:
    """The :class:`PlanFile` at ``path``; a file that is not one (or of another version) is a PlanError saying so."""
    where = os.fspath(path)
    try:
        with open(where) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise PlanError(f"there is no plan file at {where}: save one with plan.save(path).") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PlanError(f"{where} is not a plan file ({type(e).__name__}: {e}): save one with "
                        "plan.save(path).") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise PlanError(f"{where} is not an autoshard plan file (its format is "
                        f"{data.get('format') if isinstance(data, dict) else type(data).__name__!r}, not {FORMAT!r}): "
                        "save one with plan.save(path).")
    if data.get("version") != VERSION:
        raise PlanError(f"{where} is a plan file of version {data.get('version')!r}, but this autoshard reads version "
                        f"{VERSION}: save the plan again with this autoshard.")
    try:
        mesh = Mesh(tuple((str(n), int(s)) for n, s in data["mesh"]))
        return PlanFile(where, mesh, decode(data["options"], f"{where}: options"), bool(data["training"]),
                        str(data["model"]),
                        {n: (tuple(s), d) for n, (s, d) in data["parameters"].items()},
                        [list(g) for g in data["tied"]], list(data["inputs"]),
                        str(data["digest"]), dict(data["layout"]), decode(data["decisions"], f"{where}: decisions"),
                        _pipeline_of(data.get("pipeline"), where), data.get("split"))
    except (KeyError, TypeError, ValueError) as e:
        raise PlanError(f"{where} is a damaged plan file ({type(e).__name__}: {e}): save the plan again.") from None


def _pipeline_of(data, where: str) -> dict | None:
    if data is None:
        return None
    out = {k: data[k] for k in ("microbatches", "schedule", "stages_per_rank", "axis", "loss_fn")}
    out["split"] = data["split"] if isinstance(data["split"], str) else tuple(str(m) for m in data["split"])
    out["profile"] = decode(data["profile"], f"{where}: pipeline profile")
    return out


def _mesh_text(mesh: Mesh) -> str:
    return ",".join(f"{n}={s}" for n, s in mesh.axes)


def _shape(shape) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def _leaf(leaf: dict) -> str:
    return f"a tensor of shape {_shape(leaf['shape'])}" if "shape" in leaf else leaf["value"]


def _mode(training: bool) -> str:
    return "training" if training else "eval"
