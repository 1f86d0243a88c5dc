"""Hardware profiles: what the cost model needs to know about the machine, per rank.

A :class:`HardwareProfile` holds the compute roofline of one rank (``peak_flops`` in FLOP/s for fp32, and per
dtype in ``dtype_flops`` — bf16 tensor cores run an order of magnitude faster than fp32 —, ``mem_bandwidth`` in B/s),
its memory (``memory_bytes``), whether communication overlaps compute (``overlap_comm``), and the alpha-beta cost of the
links collectives run over: a default :class:`LinkCost` and optional per-axis overrides. A link costs ``alpha`` seconds
per message step plus ``beta`` seconds per byte (``beta = 1 / bandwidth``); see :mod:`autoshard.cost_models.alpha_beta`
for how the collectives use them.

Per-axis overrides are ``(pattern, LinkCost)`` pairs tried in order; the first that matches an axis wins,
the default link applies otherwise (:meth:`HardwareProfile.link_for`). A pattern is

- an axis name (``"data"``) or a glob of names (``"data*"``, matched with :func:`fnmatch.fnmatchcase`);
- ``"#i"``: the axis at mesh position ``i``, negative counting from the end (``"#0"`` is the outermost axis,
  whose groups stride over the most ranks and, with the row-major rank layout of :class:`~autoshard.mesh.Mesh`,
  are the ones that leave a node first; ``"#-1"`` is the innermost).

Profiles are TOML files; the presets ship in ``cost_models/profiles/`` and load by name::

    name = "cpu-gloo"
    description = "..."
    peak_flops = 5e10          # FLOP/s per rank (fp32); or per dtype: {float32 = 6.7e13, bfloat16 = 9.89e14}
    mem_bandwidth = 1e10       # B/s per rank
    memory_bytes = 8589934592  # per rank
    overlap_comm = false

    [link]                     # default link: alpha in s, and either beta in s/B or bandwidth in B/s
    alpha = 5e-05
    bandwidth = 2e9

    [axes."#0"]                # optional overrides, tried in file order
    alpha = 1e-05
    bandwidth = 5e10

:func:`load_profile` reads a preset name or a path, :func:`save_profile` writes one (by hand: ``tomllib`` only
reads), :func:`list_profiles` names the presets.
"""

from __future__ import annotations

import fnmatch
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser as a package
    import tomli as tomllib

from autoshard.errors import PlanError
from autoshard.mesh import Mesh

__all__ = [
    "PROFILES_DIR",
    "HardwareProfile",
    "LinkCost",
    "format_profile",
    "list_profiles",
    "load_profile",
    "profile_from_dict",
    "profile_to_toml",
    "save_profile",
]

#: The collective kinds a link may be measured for separately (:mod:`autoshard.cost_models.alpha_beta`'s kinds).
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv", "grad_all_reduce")

#: What an op's time is bound by, for the efficiency tables: contractions (mm, bmm, linear, einsum, convolution:
#: work = FLOPs), attention (sdpa and its kernels: work = FLOPs), and everything else (memory-bound: work = bytes).
COMPUTE_KINDS = ("matmul", "attention", "memory")

#: The optimizers a profile may time the step of (the memory model's names).
OPTIMIZER_NAMES = ("adam", "adamw", "sgd", "sgd_momentum")

#: The dtypes a profile may give a FLOP peak for.
_FLOP_DTYPES = ("float64", "float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")

#: Where the preset profiles live (installed as package data).
PROFILES_DIR = Path(__file__).resolve().parent / "profiles"


@dataclass(frozen=True)
class LinkCost:
    """Alpha-beta cost of one link: ``alpha`` seconds per message step, ``beta`` seconds per byte."""

    alpha: float
    beta: float
    #: per collective kind (``"all_to_all"``, ...), the link measured for that kind when it differs from this one's
    #: ``(alpha, beta)``: ``((kind, LinkCost), ...)`` (a dict is accepted)
    kinds: tuple = ()
    #: fraction of a gradient reduction's time (the backward of ``grad_all_reduce`` and of the ZeRO/sequence-parallel
    #: gathers: all-reduce or reduce-scatter) hidden behind backward compute on this link: 0 where collectives run on
    #: the compute cores (gloo on CPU), near 1 where they run on their own engine (NCCL) with compute to hide behind
    overlap: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.overlap, bool) or not isinstance(self.overlap, (int, float)) or not 0 <= self.overlap <= 1:
            raise PlanError(f"LinkCost has overlap={self.overlap!r}, but overlap is the fraction of gradient "
                            "reductions hidden behind compute, between 0 and 1.")
        object.__setattr__(self, "overlap", float(self.overlap))
        kinds = tuple(self.kinds.items()) if isinstance(self.kinds, Mapping) else tuple(self.kinds)
        for item in kinds:
            if not (isinstance(item, tuple) and len(item) == 2 and item[0] in COLLECTIVE_KINDS
                    and isinstance(item[1], LinkCost) and not item[1].kinds):
                raise PlanError(f"LinkCost has the per-kind link {item!r}, but per-kind links are (kind, LinkCost) "
                                f"pairs with kind one of {list(COLLECTIVE_KINDS)} (and no kinds of their own).")
        object.__setattr__(self, "kinds", tuple(sorted(kinds)))
        for what, v in (("alpha", self.alpha), ("beta", self.beta)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise PlanError(f"LinkCost has {what}={v!r}, but {what} is a finite number >= 0 "
                                "(alpha in seconds, beta in seconds per byte).")
        object.__setattr__(self, "alpha", float(self.alpha))
        object.__setattr__(self, "beta", float(self.beta))

    @classmethod
    def from_bandwidth(cls, alpha: float, bandwidth: float, kinds=(), overlap: float = 0.0) -> LinkCost:
        """A link of ``bandwidth`` bytes per second and latency ``alpha`` seconds."""
        if isinstance(bandwidth, bool) or not isinstance(bandwidth, (int, float)) or not bandwidth > 0:
            raise PlanError(f"LinkCost has bandwidth={bandwidth!r}, but bandwidth is a number of bytes per "
                            "second > 0.")
        return cls(alpha, 1.0 / bandwidth, kinds, overlap)

    def for_kind(self, kind: str) -> LinkCost:
        """The link collective ``kind`` runs at: its own measured link when the profile has one (``grad_all_reduce``
        falls back to ``all_reduce``'s), else this one."""
        own = dict(self.kinds)
        if kind in own:
            return own[kind]
        if kind == "grad_all_reduce" and "all_reduce" in own:
            return own["all_reduce"]
        return self

    @property
    def bandwidth(self) -> float:
        """Bytes per second (``inf`` for a free link)."""
        return math.inf if self.beta == 0 else 1.0 / self.beta


@dataclass(frozen=True)
class HardwareProfile:
    """What one rank can do, and what its links cost. Numbers are per rank.

    ``axes`` holds per-axis link overrides as ``(pattern, LinkCost)`` pairs tried in order (the constructor
    also accepts a dict); it is a tuple so that profiles are hashable and can key caches.
    """

    name: str
    peak_flops: float
    mem_bandwidth: float
    memory_bytes: int
    overlap_comm: bool
    link: LinkCost
    axes: tuple[tuple[str, LinkCost], ...] = field(default=())
    description: str = ""
    #: peak FLOP/s per compute dtype but fp32, ``(("bfloat16", 9.89e14), ...)`` (a dict is accepted, and so is a dict
    #: as ``peak_flops``: its ``float32`` entry becomes ``peak_flops``); a dtype not listed runs at ``peak_flops``
    dtype_flops: tuple[tuple[str, float], ...] = field(default=())
    #: seconds each op costs besides its work (dispatch, kernel launch, the program's Python): per op in forward,
    #: and per op with a gradient in backward (autograd's node)
    op_overhead: float = 0.0
    backward_op_overhead: float = 0.0
    #: achieved fraction of the peak per compute kind (:data:`COMPUTE_KINDS`, or ``"kind.dtype"`` for one dtype) as a
    #: function of an op's work on one rank (FLOPs, bytes for ``memory``): ``((key, ((work, fraction), ...)), ...)``
    #: (a dict is accepted), interpolated in log(work) and constant beyond the ends; a kind without a table runs at
    #: the peak
    efficiency: tuple = ()
    #: seconds of one optimizer step: ``((name, per_tensor, per_element), ...)`` per optimizer; one not listed costs
    #: :data:`OPTIMIZER_BYTES` per element at ``mem_bandwidth`` and nothing per tensor
    optimizer_step: tuple = ()
    #: seconds each training step costs besides its ops, collectives and optimizer (the call's checks, zero_grad)
    step_overhead: float = 0.0

    def __post_init__(self) -> None:
        per_dtype = dict(self.dtype_flops.items() if isinstance(self.dtype_flops, Mapping) else self.dtype_flops)
        if isinstance(self.peak_flops, Mapping):
            per_dtype = {**self.peak_flops, **per_dtype}
            if "float32" not in per_dtype:
                raise PlanError(f"Hardware profile `{self.name}` has peak_flops per dtype {sorted(per_dtype)}, but "
                                "needs a float32 entry (the default for every dtype not listed).")
            object.__setattr__(self, "peak_flops", per_dtype["float32"])
        fp32 = per_dtype.pop("float32", self.peak_flops)  # fp32's peak is peak_flops: stored once
        if fp32 != self.peak_flops:
            raise PlanError(f"Hardware profile `{self.name}` has peak_flops={self.peak_flops!r} and a float32 peak of "
                            f"{fp32!r}: give fp32's peak once.")
        for key, v in per_dtype.items():
            if key not in _FLOP_DTYPES:
                raise PlanError(f"Hardware profile `{self.name}` has peak_flops for {key!r}, but the dtypes are "
                                f"{list(_FLOP_DTYPES)}.")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise PlanError(f"Hardware profile `{self.name}` has peak_flops {key} = {v!r}, but peak_flops is "
                                "a finite number > 0 (FLOP/s).")
        object.__setattr__(self, "dtype_flops", tuple(sorted((k, float(v)) for k, v in per_dtype.items())))
        for what in ("peak_flops", "mem_bandwidth", "memory_bytes"):
            v = getattr(self, what)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise PlanError(f"Hardware profile `{self.name}` has {what}={v!r}, but {what} is a finite "
                                "number > 0.")
        if not isinstance(self.link, LinkCost):
            raise PlanError(f"Hardware profile `{self.name}` has link={self.link!r}, but link is a LinkCost.")
        axes = tuple(self.axes.items()) if isinstance(self.axes, Mapping) else tuple(self.axes)
        for item in axes:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                    and isinstance(item[1], LinkCost)):
                raise PlanError(f"Hardware profile `{self.name}` has the axis override {item!r}, but overrides "
                                "are (pattern, LinkCost) pairs such as ('data', LinkCost(1e-5, 2e-11)).")
        object.__setattr__(self, "axes", axes)
        for what in ("op_overhead", "backward_op_overhead", "step_overhead"):
            v = getattr(self, what)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise PlanError(f"Hardware profile `{self.name}` has {what}={v!r}, but {what} is a finite number >= 0.")
            object.__setattr__(self, what, float(v))
        object.__setattr__(self, "efficiency", _checked_efficiency(self.name, self.efficiency))
        object.__setattr__(self, "optimizer_step", _checked_optimizer(self.name, self.optimizer_step))
        object.__setattr__(self, "peak_flops", float(self.peak_flops))
        object.__setattr__(self, "mem_bandwidth", float(self.mem_bandwidth))
        object.__setattr__(self, "memory_bytes", int(self.memory_bytes))
        object.__setattr__(self, "overlap_comm", bool(self.overlap_comm))

    def flops_for(self, dtype) -> float:
        """Peak FLOP/s for ops computing in ``dtype`` (a torch dtype or its name): its ``dtype_flops`` entry, else
        ``peak_flops``."""
        key = str(dtype).removeprefix("torch.")
        return next((v for k, v in self.dtype_flops if k == key), self.peak_flops)

    def efficiency_for(self, kind: str, dtype, work: float, backward: bool = False) -> float:
        """Achieved fraction of the peak of an op of compute ``kind`` doing ``work`` (FLOPs, or bytes for
        ``memory``) in ``dtype`` on one rank: the ``kind.dtype`` table, else the ``kind`` table, else 1. For the
        op's ``backward`` the ``kind.dtype.backward`` and ``kind.backward`` tables come first (a matmul's gradients
        run in other operand layouts than its forward, which some kernels run at another rate: bf16 on CPUs)."""
        tables = dict(self.efficiency)
        name = f"{kind}.{str(dtype).removeprefix('torch.')}"
        table = ((tables.get(f"{name}.backward") or tables.get(f"{kind}.backward")) if backward else None) or \
            tables.get(name) or tables.get(kind)
        if not table:
            return 1.0
        return _interpolate(table, work)

    def efficiency_ceiling(self, kind: str, dtype) -> float:
        """The most :meth:`efficiency_for` returns for ``kind`` in ``dtype`` at any work, forward or backward: the
        largest fraction of the tables it may read, 1 where a forward lookup finds none."""
        tables = dict(self.efficiency)
        name = f"{kind}.{str(dtype).removeprefix('torch.')}"
        found = [tables[t] for t in (f"{name}.backward", f"{kind}.backward", name, kind) if t in tables]
        fractions = [f for table in found for _, f in table]
        if name not in tables and kind not in tables:
            fractions.append(1.0)
        return max(fractions)

    def optimizer_seconds(self, optimizer: str, tensors: int, elements: float) -> float:
        """Seconds of one step of ``optimizer`` over ``tensors`` parameter tensors of ``elements`` elements."""
        for name, per_tensor, per_element in self.optimizer_step:
            if name == optimizer:
                return tensors * per_tensor + elements * per_element
        return elements * OPTIMIZER_BYTES.get(optimizer, OPTIMIZER_BYTES["adam"]) / self.mem_bandwidth

    def link_for(self, axis_name: str, axis_index: int | None = None, mesh: Mesh | None = None) -> LinkCost:
        """The link that collectives along mesh axis ``axis_name`` run over.

        ``axis_index`` is the axis's position in the mesh (looked up in ``mesh`` when omitted); ``"#i"``
        patterns need one of the two, name patterns need neither.
        """
        if axis_index is None and mesh is not None:
            axis_index = mesh.index(axis_name)
        ndim = mesh.ndim if mesh is not None else None
        for pattern, link in self.axes:
            if _matches(pattern, axis_name, axis_index, ndim):
                return link
        return self.link


#: Bytes an optimizer step reads and writes per fp32 parameter element when the profile has not timed it: Adam
#: reads the parameter, its gradient and two moments and writes the parameter and the moments (7 x 4 bytes).
OPTIMIZER_BYTES = {"adam": 28, "adamw": 28, "sgd": 12, "sgd_momentum": 20}


def _interpolate(table, work: float) -> float:
    """Piecewise linear in log(work) through ``table``'s ``(work, fraction)`` points, constant beyond the ends."""
    if work <= table[0][0]:
        return table[0][1]
    if work >= table[-1][0]:
        return table[-1][1]
    x = math.log(work)
    for (w0, f0), (w1, f1) in zip(table, table[1:]):
        if work <= w1:
            t = (x - math.log(w0)) / (math.log(w1) - math.log(w0))
            return f0 + t * (f1 - f0)
    return table[-1][1]  # not reached


def _checked_efficiency(name: str, value) -> tuple:
    items = tuple(value.items()) if isinstance(value, Mapping) else tuple(value)
    out = []
    for item in items:
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)):
            raise PlanError(f"Hardware profile `{name}` has the efficiency entry {item!r}, but entries are "
                            "(kind, ((work, fraction), ...)) pairs.")
        key, points = item
        parts = key.split(".")
        backward = parts[-1] == "backward" and len(parts) > 1
        kind, dtype = parts[0], ".".join(parts[1:-1] if backward else parts[1:])
        if kind not in COMPUTE_KINDS or (dtype and dtype not in _FLOP_DTYPES):
            raise PlanError(f"Hardware profile `{name}` has efficiency for {key!r}, but the keys are a compute kind "
                            f"{list(COMPUTE_KINDS)}, optionally with a dtype (`matmul.bfloat16`) and `.backward` "
                            "(`matmul.bfloat16.backward`: the ops of its backward).")
        pts = []
        for pt in points:
            ok = isinstance(pt, (tuple, list)) and len(pt) == 2 and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in pt)
            if not ok:
                raise PlanError(f"Hardware profile `{name}` has the efficiency point {pt!r} for {key!r}, but points "
                                "are [work, fraction] with work > 0 (FLOPs or bytes) and fraction > 0.")
            pts.append((float(pt[0]), float(pt[1])))
        pts.sort()
        if not pts or len({w for w, _ in pts}) != len(pts):
            raise PlanError(f"Hardware profile `{name}` has efficiency for {key!r} with points {pts}, but needs at "
                            "least one point and one fraction per work size.")
        out.append((key, tuple(pts)))
    return tuple(sorted(out))


def _checked_optimizer(name: str, value) -> tuple:
    items = [(k, *v) for k, v in value.items()] if isinstance(value, Mapping) else list(value)
    out = []
    for item in items:
        ok = (isinstance(item, (tuple, list)) and len(item) == 3 and item[0] in OPTIMIZER_NAMES
              and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
                      for v in item[1:]))
        if not ok:
            raise PlanError(f"Hardware profile `{name}` has the optimizer step {item!r}, but entries are (optimizer, "
                            f"seconds per tensor, seconds per element) with optimizer one of {list(OPTIMIZER_NAMES)}.")
        out.append((item[0], float(item[1]), float(item[2])))
    return tuple(sorted(out))


def _matches(pattern: str, axis_name: str, axis_index: int | None, ndim: int | None) -> bool:
    if not pattern.startswith("#"):
        return fnmatch.fnmatchcase(axis_name, pattern)
    try:
        want = int(pattern[1:])
    except ValueError:
        raise PlanError(f"Axis pattern {pattern!r} starts with '#', but '#' patterns are a mesh position such as "
                        "'#0' (outermost) or '#-1' (innermost).") from None
    if axis_index is None:
        return False
    if want < 0:
        if ndim is None:
            return False
        want += ndim
    return want == axis_index


# ---- TOML ------------------------------------------------------------------------------------------------
def list_profiles() -> list[str]:
    """Names of the preset profiles, sorted."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.toml"))


def load_profile(name_or_path: str | Path) -> HardwareProfile:
    """A preset by name (``"cpu-gloo"``) or a profile TOML file by path. Raises PlanError."""
    text = str(name_or_path)
    path = Path(text)
    # A bare word is a preset name; anything with a directory part or a .toml suffix is a path.
    if isinstance(name_or_path, str) and path.name == text and path.suffix != ".toml":
        path = PROFILES_DIR / f"{text}.toml"
        if not path.is_file():
            raise PlanError(f"Hardware profile `{text}` is unknown; the presets are {list_profiles()}. "
                            "Pass one of them or the path of a profile TOML file (see `autoshard calibrate`).")
    if not path.is_file():
        raise PlanError(f"Hardware profile file {str(path)!r} does not exist; the presets are "
                        f"{list_profiles()}.")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise PlanError(f"Hardware profile file {str(path)!r} is not valid TOML: {e}.") from None
    return profile_from_dict(data, source=str(path))


def profile_from_dict(data: Mapping, source: str = "<dict>") -> HardwareProfile:
    """Build a profile from the parsed TOML layout described in the module docstring."""
    required = ("name", "peak_flops", "mem_bandwidth", "memory_bytes", "link")
    known = set(required) | {"overlap_comm", "axes", "description", "op_overhead", "backward_op_overhead",
                             "efficiency", "optimizer", "step_overhead"}
    missing = [k for k in required if k not in data]
    if missing:
        raise PlanError(f"Hardware profile {source} has no {missing}, but needs {list(required)}.")
    unknown = sorted(set(data) - known)
    if unknown:
        raise PlanError(f"Hardware profile {source} has the unknown keys {unknown}; known keys are {sorted(known)}.")
    axes = data.get("axes", {})
    if isinstance(data["peak_flops"], Mapping):
        per_dtype = data["peak_flops"]
        if "float32" not in per_dtype:
            raise PlanError(f"Hardware profile {source} has peak_flops per dtype {sorted(per_dtype)}, but needs a "
                            "float32 entry (the default for every dtype not listed).")
    if not isinstance(axes, Mapping):
        raise PlanError(f"Hardware profile {source} has axes={axes!r}, but axes is a table of tables, "
                        'e.g. [axes."data"] alpha = 1e-5 bandwidth = 5e10.')
    return HardwareProfile(
        name=data["name"],
        description=data.get("description", ""),
        peak_flops=data["peak_flops"],
        mem_bandwidth=data["mem_bandwidth"],
        memory_bytes=data["memory_bytes"],
        overlap_comm=data.get("overlap_comm", False),
        link=_link_from_dict(data["link"], f"{source} [link]"),
        axes=tuple((str(k), _link_from_dict(v, f'{source} [axes."{k}"]')) for k, v in axes.items()),
        op_overhead=data.get("op_overhead", 0.0),
        backward_op_overhead=data.get("backward_op_overhead", 0.0),
        efficiency=_efficiency_from_dict(data.get("efficiency", {}), source),
        optimizer_step=_optimizer_from_dict(data.get("optimizer", {}), source),
        step_overhead=data.get("step_overhead", 0.0),
    )


def _efficiency_from_dict(d, source: str) -> tuple:
    if not isinstance(d, Mapping):
        raise PlanError(f"Hardware profile {source} has efficiency={d!r}, but efficiency is a table such as "
                        "[efficiency] matmul = [[1e6, 0.3], [1e9, 0.9]].")
    return tuple((str(k), tuple(tuple(p) if isinstance(p, list) else p for p in v)) for k, v in d.items())


def _optimizer_from_dict(d, source: str) -> tuple:
    if not isinstance(d, Mapping) or not all(isinstance(v, Mapping) for v in d.values()):
        raise PlanError(f"Hardware profile {source} has optimizer={d!r}, but optimizer is a table of tables such as "
                        "[optimizer.adamw] per_tensor = 2e-5 per_element = 3e-9.")
    out = []
    for k, v in d.items():
        unknown = sorted(set(v) - {"per_tensor", "per_element"})
        if unknown:
            raise PlanError(f"Hardware profile {source} [optimizer.{k}] has the unknown keys {unknown}; it has "
                            "per_tensor and per_element (seconds).")
        out.append((str(k), v.get("per_tensor", 0.0), v.get("per_element", 0.0)))
    return tuple(out)


def _link_from_dict(d, where: str) -> LinkCost:
    if not isinstance(d, Mapping):
        raise PlanError(f"Hardware profile {where} is {d!r}, but a link is a table with alpha and beta or bandwidth.")
    kinds = {k: v for k, v in d.items() if k in COLLECTIVE_KINDS}
    d = {k: v for k, v in d.items() if k not in kinds}
    unknown = sorted(set(d) - {"alpha", "beta", "bandwidth", "overlap"})
    if unknown:
        raise PlanError(f"Hardware profile {where} has the unknown keys {unknown}; a link has alpha and either "
                        "beta (s/B) or bandwidth (B/s), optionally overlap and per-kind tables.")
    overlap = d.pop("overlap", 0.0) if "overlap" in d else 0.0
    if "alpha" not in d or ("beta" in d) == ("bandwidth" in d):
        raise PlanError(f"Hardware profile {where} has keys {sorted(d)}, but a link has alpha and exactly one of "
                        "beta (s/B) or bandwidth (B/s).")
    own = tuple((k, _link_from_dict(v, f"{where[:-1]}.{k}]")) for k, v in kinds.items())
    if "beta" in d:
        return LinkCost(d["alpha"], d["beta"], own, overlap)
    return LinkCost.from_bandwidth(d["alpha"], d["bandwidth"], own, overlap)


def _toml_str(s: str) -> str:
    # JSON string escapes (\", \\, \n, \uXXXX with ensure_ascii) are all valid in TOML basic strings.
    return json.dumps(s, ensure_ascii=True)


def _toml_float(x: float) -> str:
    # repr round-trips exactly; TOML accepts the same spelling, including inf and exponents like 1e-09.
    r = repr(float(x))
    return r if ("." in r or "e" in r or "n" in r) else r + ".0"


def _link_lines(link: LinkCost) -> list[str]:
    lines = [f"alpha = {_toml_float(link.alpha)}",
             f"beta = {_toml_float(link.beta)}  # {link.bandwidth / 1e9:.4g} GB/s"]
    if link.overlap:
        lines.append(f"overlap = {_toml_float(link.overlap)}  # of gradient reductions, hidden behind compute")
    return lines


def profile_to_toml(profile: HardwareProfile) -> str:
    """The TOML text of ``profile`` (what :func:`save_profile` writes; :func:`load_profile` reads it back)."""
    lines = [
        f"name = {_toml_str(profile.name)}",
        f"description = {_toml_str(profile.description)}",
        _peak_line(profile),
        f"mem_bandwidth = {_toml_float(profile.mem_bandwidth)}  # B/s per rank",
        f"memory_bytes = {profile.memory_bytes}  # {profile.memory_bytes / 2**30:.4g} GiB per rank",
        f"overlap_comm = {'true' if profile.overlap_comm else 'false'}",
        "",
    ]
    lines += [f"op_overhead = {_toml_float(profile.op_overhead)}  # s per op, forward",
              f"backward_op_overhead = {_toml_float(profile.backward_op_overhead)}  # s per op, backward",
              f"step_overhead = {_toml_float(profile.step_overhead)}  # s per training step"]
    if profile.efficiency:
        lines += ["", "[efficiency]  # [work (FLOPs; bytes for memory), fraction of the peak] on one rank"]
        lines += [f"{_toml_str(k)} = [{', '.join(f'[{_toml_float(w)}, {_toml_float(f)}]' for w, f in pts)}]"
                  for k, pts in profile.efficiency]
    for name, per_tensor, per_element in profile.optimizer_step:
        lines += ["", f"[optimizer.{name}]", f"per_tensor = {_toml_float(per_tensor)}  # s",
                  f"per_element = {_toml_float(per_element)}  # s"]
    lines += ["", "[link]", *_link_lines(profile.link)]
    for kind, link in profile.link.kinds:
        lines += ["", f"[link.{kind}]", *_link_lines(link)]
    for pattern, link in profile.axes:
        lines += ["", f"[axes.{_toml_str(pattern)}]", *_link_lines(link)]
        for kind, sub in link.kinds:
            lines += ["", f"[axes.{_toml_str(pattern)}.{kind}]", *_link_lines(sub)]
    return "\n".join(lines) + "\n"


def _peak_line(profile: HardwareProfile) -> str:
    if not profile.dtype_flops:
        return f"peak_flops = {_toml_float(profile.peak_flops)}  # FLOP/s per rank, fp32"
    entries = dict(profile.dtype_flops)
    entries["float32"] = profile.peak_flops
    inner = ", ".join(f"{k} = {_toml_float(v)}" for k, v in sorted(entries.items()))
    return f"peak_flops = {{{inner}}}  # FLOP/s per rank, per compute dtype"


def save_profile(profile: HardwareProfile, path: str | Path) -> Path:
    """Write ``profile`` as TOML to ``path`` (parents created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(profile_to_toml(profile))
    return path


def format_profile(profile: HardwareProfile) -> str:
    """A short plain-text summary of a profile (for reports and the CLI)."""
    def link(lc: LinkCost) -> str:
        return f"alpha={lc.alpha * 1e6:.3g} us, bandwidth={lc.bandwidth / 1e9:.4g} GB/s"

    per = "".join(f", {k} {v / 1e12:.4g}" for k, v in profile.dtype_flops if k != "float32")
    out = [(f"profile {profile.name}: peak {profile.peak_flops / 1e12:.4g} TFLOP/s{per}, memory bandwidth "
            f"{profile.mem_bandwidth / 1e9:.4g} GB/s, memory {profile.memory_bytes / 2**30:.4g} GiB per rank, "
            f"overlap_comm={profile.overlap_comm}"),
           f"  link (default): {link(profile.link)}"]
    out += [f"  link axes {pattern!r}: {link(lc)}" for pattern, lc in profile.axes]
    return "\n".join(out)
