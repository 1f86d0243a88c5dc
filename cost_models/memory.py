"""Per-rank memory: parameters, gradients, optimizer state and the activations kept for backward.

Training state of ``p`` local parameter elements of ``dtype`` (:func:`training_state_bytes`)::

    params    = p · itemsize(dtype)                                    param_bytes
    grads     = p · itemsize(dtype)                                    grad_bytes
    optimizer = sgd: 0 · sgd_momentum: params (one momentum buffer)    optimizer_state_bytes
                adam / adamw: 2 · p · 4 (exp_avg and exp_avg_sq, fp32 whatever the parameter dtype)

Activations (:func:`activation_bytes`) are a heuristic of what autograd saves between forward and backward, read
from each op's ``saves`` facet in the op registry (:mod:`autoshard.compiler.ops`): a node's output counts, at its local
size, when

- some user of it saves that input for its backward: contractions (mm, bmm, matmul, linear, einsum, conv, sdpa
  save their operands), products and quotients (mul, div save both sides), nonlinear functions whose derivative
  needs their input (gelu, silu, log, sin, layer_norm, rms_norm, the losses),
  embedding (its indices); or
- the node itself saves its output: relu, sigmoid, tanh, exp, softmax and log_softmax, sqrt and rsqrt, and the
  attention ops (their output and log-sum-exp; for multi-output ops every output counts);
- plus dropout's boolean mask (one byte per element) on top;
- plus what an op keeps besides its arguments and outputs, and what it holds only while it runs, from the op
  registry's ``workspace`` facet (:mod:`.workspace`): attention's float copy of a boolean mask among the
  activations (once per mask and layout read), ring attention's score blocks at the liveness point where the
  op's backward runs.

Outputs read only by ops that save nothing (add, sub, views, reductions) are freed during the forward and do not
count. Parameters (``get_attr`` nodes, nodes carrying ``autoshard.param``) and views of them count as parameters,
not activations. Two views of one saved tensor both count (an over-estimate that keeps the rule local).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.fx import Node

from autoshard import meta as M
from autoshard.errors import PlanError
from autoshard.frontend.graph_utils import tensor_inputs
from autoshard.compiler.ops import MASK, OUTPUT, entry

from .compute import output_tensors
from .workspace import kept_workspace, op_workspace, transient_workspace

__all__ = [
    "OPTIMIZERS",
    "MemoryBreakdown",
    "StagedTimeline",
    "Timeline",
    "activation_bytes",
    "dtype_bytes",
    "grad_bytes",
    "layer_cuts",
    "optimizer_state_bytes",
    "param_bytes",
    "plan_memory",
    "recompute_region",
    "training_state_bytes",
    "zero_state_bytes",
]


#: Optimizer name → (state in units of parameter bytes, fp32 state elements per parameter).
OPTIMIZERS: dict[str, tuple[int, int]] = {
    "sgd": (0, 0),
    "sgd_momentum": (1, 0),
    "adam": (0, 2),
    "adamw": (0, 2),
}


def dtype_bytes(dtype: torch.dtype) -> int:
    return dtype.itemsize


def param_bytes(local_numel: int, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of ``local_numel`` parameter elements on one rank."""
    return int(local_numel) * dtype.itemsize


def grad_bytes(local_numel: int, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of the gradients of ``local_numel`` parameter elements (same dtype as the parameters)."""
    return param_bytes(local_numel, dtype)


def optimizer_state_bytes(param_bytes: int, optimizer: str = "adam", dtype: torch.dtype = torch.float32) -> int:
    """Optimizer state for ``param_bytes`` bytes of parameters of ``dtype``: sgd 0, sgd_momentum 1×, adam/adamw
    two fp32 moments per element (2× for fp32 parameters, 4× for bf16 ones)."""
    key = optimizer.lower()
    if key not in OPTIMIZERS:
        raise PlanError(f"optimizer {optimizer!r} has no memory model; the known optimizers are "
                        f"{sorted(OPTIMIZERS)}.")
    same_dtype, fp32_moments = OPTIMIZERS[key]
    numel = param_bytes // dtype.itemsize
    return same_dtype * param_bytes + fp32_moments * numel * torch.float32.itemsize


def training_state_bytes(local_numel: int, dtype: torch.dtype = torch.float32, optimizer: str = "adam") -> int:
    """Parameters + gradients + optimizer state of ``local_numel`` parameter elements on one rank."""
    p = param_bytes(local_numel, dtype)
    return 2 * p + optimizer_state_bytes(p, optimizer, dtype)


def zero_state_bytes(local_numel: int, stage: int, data_size: int, dtype: torch.dtype = torch.float32,
                     optimizer: str = "adam", compute_dtype: torch.dtype | None = None) -> dict[str, int]:
    """Per-rank bytes of one parameter by kind under ZeRO ``stage`` (:class:`autoshard.meta.Storage`).

    ``local_numel``: elements of the parameter in its compute layout on one rank; ``data_size``: ranks it is stored
    sharded over (stages 1-3); ``dtype``: the stored (master) dtype; ``compute_dtype``: the dtype it is gathered and
    used in (mixed precision; default ``dtype``). Kinds:

    - ``parameters``: the stored tensor (what the optimizer steps) — the compute layout at stage 0, 1/data_size of
      it at stages 1-3; plus, under mixed precision at stage 0, the compute copy;
    - ``gradients``: the stored tensor's gradient (same size and dtype);
    - ``optimizer``: its optimizer state (:func:`optimizer_state_bytes`);
    - ``gathered``: the all-gathered compute copy that stays alive from its forward use to its backward use
      (stages 1 and 2 keep it; stage 3 frees it after forward and gathers again: 0 here, the one layer being
      gathered at a time is counted once by the caller).
    """
    if stage not in (0, 1, 2, 3):
        raise PlanError(f"ZeRO stage {stage!r} does not exist: use 0, 1, 2 or 3.")
    compute_dtype = compute_dtype or dtype
    stored = local_numel if stage == 0 else -(-local_numel // max(1, data_size))
    p = param_bytes(stored, dtype)
    out = {"parameters": p, "gradients": grad_bytes(stored, dtype),
           "optimizer": optimizer_state_bytes(p, optimizer, dtype), "gathered": 0}
    if stage == 0 and compute_dtype != dtype:
        out["parameters"] += param_bytes(local_numel, compute_dtype)
    if stage in (1, 2):
        out["gathered"] = param_bytes(local_numel, compute_dtype)
    return out


def _saves(node: Node) -> tuple:
    """The ``saves`` facet of ``node``'s op (:mod:`autoshard.compiler.ops`); () for placeholders, get_attr and
    output."""
    return entry(node.target).saves if node.op == "call_function" else ()


def _saved_inputs(user: Node) -> list:
    """The nodes ``user`` keeps for its backward: the args at its ``saves`` positions (every node of a list arg),
    less the operands of a product or quotient that autograd keeps only for another operand's gradient
    (:func:`_kept_for_gradient`)."""
    saved = []
    for i in _saves(user):
        if isinstance(i, int) and i < len(user.args) and _kept_for_gradient(user, i):
            a = user.args[i]
            saved.extend(a if isinstance(a, (list, tuple)) else [a])
    return saved


def _identity_dropout(node: Node) -> bool:
    """A dropout with ``p=0`` or out of training: the rank program runs it as the identity (no mask, its input)."""
    if node.op != "call_function" or MASK not in _saves(node) or len(node.args) < 2:
        return False
    p, train = node.args[1], node.args[2] if len(node.args) > 2 else True
    return isinstance(p, (int, float)) and (p == 0 or train is False)


def _keeps_mask(node: Node) -> bool:
    """``node`` keeps a dropout mask for its backward."""
    return MASK in _saves(node) and not _identity_dropout(node)


def _requires_grad(a) -> bool:
    """An operand with a gradient: a node marked so by trace (a floating tensor in a graph without the mark)."""
    if not isinstance(a, Node):
        return False
    if M.REQUIRES_GRAD in a.meta:
        return bool(a.meta[M.REQUIRES_GRAD])
    val = a.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_floating_point()


def _kept_for_gradient(user: Node, i: int) -> bool:
    """Whether autograd keeps operand ``i`` of ``user`` (derivatives.yaml): ``a * b`` keeps ``a`` for ``b``'s
    gradient and ``b`` for ``a``'s, so each only where the other operand requires grad (``x * 0.5`` and ``q * cos``
    keep no ``x``, no ``q``); ``a / b`` keeps ``a`` only for ``b``'s gradient, ``b`` for either's. Every other op
    keeps what its ``saves`` facet says."""
    packet = getattr(user.target, "overloadpacket", user.target)
    if packet not in (torch.ops.aten.mul, torch.ops.aten.div) or len(user.args) < 2 or i > 1:
        return True
    a, b = user.args[0], user.args[1]
    if packet is torch.ops.aten.mul:
        return _requires_grad(b if i == 0 else a)
    return _requires_grad(b) if i == 0 else _requires_grad(a) or _requires_grad(b)


def _is_param(node: Node) -> bool:
    """A parameter or buffer, or a view of one (``t(weight)``, ``weight.view(...)``)."""
    while True:
        if node.op == "get_attr" or M.PARAM in node.meta:
            return True
        if (node.op != "call_function" or entry(node.target).bytes != "view" or not node.args
                or not isinstance(node.args[0], Node)):
            return False
        node = node.args[0]


def activation_bytes(node: Node, local_numel: int | None = None,
                     region_of: Callable[[Node], str | None] | None = None) -> int:
    """Bytes of ``node``'s output that stay alive for the backward on one rank (the module docstring says which).

    ``local_numel`` is the number of elements of the output a rank holds (the global numel when omitted).
    ``region_of``: the recomputation region of a node (default: its :data:`autoshard.meta.RECOMPUTE`, written by
    trace, the ``recompute=`` glob or the plan search; ``lambda n: None`` prices the plan without recomputation).
    A region saves only its inputs (the checkpoint keeps them to run the region again in backward): a node inside
    one counts only where a reader outside the region saves it (or is another region's input), its dropout mask
    never; a node outside counts where it saves itself, a reader saves it, or a region reads it.
    """
    tensors = output_tensors(node)
    if not tensors or node.op == "output" or _is_param(node):
        return 0
    region_of = region_of or recompute_region
    numel = sum(t.numel() for t in tensors) if local_numel is None else int(local_numel)
    itemsize = tensors[0].dtype.itemsize
    mine = region_of(node)
    readers = [u for u in node.users if u.op == "call_function" and (mine is None or region_of(u) != mine)]
    saved = (mine is None and OUTPUT in _saves(node)) or any(
        region_of(u) is not None or any(x is node for x in _saved_inputs(u)) for u in readers)
    total = numel * itemsize if saved else 0
    if _keeps_mask(node) and mine is None:
        total += numel  # the boolean mask
    return total


def recompute_region(node: Node) -> str | None:
    """The recomputation region (:data:`autoshard.meta.RECOMPUTE`) of a call_function node, None elsewhere."""
    return node.meta.get(M.RECOMPUTE) if node.op == "call_function" else None


# ---- liveness points: the moments a step's peak is taken at -----------------------------------------------
def segment_key(node: Node) -> str | None:
    """The repeated layer ``node`` lies in — its module path (a parameter: its target) up to the first numeric
    component, ``model.layers.3`` — or None outside every numbered module."""
    path = str(node.target) if node.op == "get_attr" else M.module_path(node)
    parts = path.split(".") if path else []
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[:i + 1])
    return None


def _inherits_segment(node: Node) -> bool:
    """Nodes a pass inserted (collectives, getitems, casts without a module stack) lie where their neighbours do."""
    return (M.COLLECTIVE in node.meta or node.target is operator.getitem or not node.meta.get("nn_module_stack"))


@dataclass(frozen=True)
class Timeline:
    """The forward cut into segments — what precedes the first repeated layer, each layer copy, what lies between
    and after — and the liveness points of a training step:

    - point 0, the end of forward: every saved activation, no gradient;
    - point ``k`` (1 .. S-1): the backward of the last ``k`` segments done — their activations freed, the
      gradients of the parameters they use made;
    - point S, the optimizer step: every gradient, no activation.

    An activation lives from its forward to its segment's backward (:meth:`activation_alive`), a gradient from its
    parameter's last segment's backward to the step (:meth:`gradient_alive`). The anchors' ILPs (Alpa,
    autoparallel) bound memory at such points; the peak of a step is the largest of them."""

    segments: tuple[str, ...]
    index: dict = field(default_factory=dict, compare=False)  # call_function node -> segment number
    _cache: dict = field(default_factory=dict, compare=False, repr=False)  # (kind, segment or node) -> answer

    @classmethod
    def of(cls, gm) -> Timeline:
        segments: list[str] = []
        number: dict[str, int] = {}
        index: dict[Node, int] = {}
        current: str | None = None
        for n in gm.graph.nodes:
            if n.op != "call_function":
                continue
            key = segment_key(n)
            if key is None:
                if current is not None and (_inherits_segment(n) or current.startswith("between ")
                                            or current == "prologue"):
                    key = current
                else:
                    key = "prologue" if current is None else f"between {current}"
            if key not in number:
                number[key] = len(segments)
                segments.append(key)
            index[n] = number[key]
            current = key
        return cls(tuple(segments) or ("prologue",), index)

    @property
    def points(self) -> int:
        return len(self.segments) + 1

    def names(self) -> list[str]:
        s = len(self.segments)
        return (["end of forward"] + [f"backward done through {self.segments[s - k]}" for k in range(1, s)]
                + ["optimizer step"])

    def segment(self, node: Node) -> int:
        """The segment of a call_function node (0 for any other node)."""
        return self.index.get(node, 0)

    @property
    def forward_ends(self) -> tuple[int, ...]:
        """The points where backward's first temporaries count: the end of forward (one timeline: point 0)."""
        return (0,)

    def held(self, first: int, last: int) -> np.ndarray:
        """1 at the points a parameter used by segments ``first`` .. ``last`` is held (one timeline: all)."""
        return np.ones(self.points)

    def gradient_held(self, first: int, last: int) -> np.ndarray:
        """1 at the points the gradient of a parameter used by segments ``first`` .. ``last`` is alive: from
        ``last``'s backward on."""
        return self.gradient_alive(last)

    def accumulates(self, point: int) -> bool:
        """Whether an earlier microbatch's backward has made every gradient at liveness point ``point`` (a
        pipeline's later backwards): backward's first temporaries then hold a parameter's new gradient too, before
        it is added to the one made before. One timeline: never."""
        return False

    def positions(self) -> np.ndarray:
        """Per point, its place in backward (one timeline: the point itself)."""
        return np.arange(self.points)

    def activation_alive(self, segment: int, once: bool = False) -> np.ndarray:
        """1 at the points an activation of ``segment`` is alive (until its segment's backward), else 0.
        ``once``: a copy held once per step whatever the microbatches in flight (the same here; see
        :class:`StagedTimeline`)."""
        key = ("activation", segment)
        if key not in self._cache:
            self._cache[key] = (np.arange(self.points) < len(self.segments) - segment).astype(float)
        return self._cache[key]

    def gradient_alive(self, segment: int) -> np.ndarray:
        """1 at the points a gradient made by ``segment``'s backward is alive (from then to the step), else 0."""
        key = ("gradient", segment)
        if key not in self._cache:
            self._cache[key] = (np.arange(self.points) >= len(self.segments) - segment).astype(float)
        return self._cache[key]

    def uses(self, param: Node) -> tuple[int, int]:
        """(first, last) segment of the ops that use ``param`` (through views, casts and collectives)."""
        key = ("uses", param)
        if key not in self._cache:
            self._cache[key] = self._uses(param)
        return self._cache[key]

    def _uses(self, param: Node) -> tuple[int, int]:
        seen, todo, segs = set(), list(param.users), []
        while todo:
            u = todo.pop()
            if u in seen:
                continue
            seen.add(u)
            if u.op != "call_function":
                continue
            if M.COLLECTIVE in u.meta or str(u.target) in _CASTS or entry(u.target).bytes == "view":
                todo.extend(u.users)
            segs.append(self.segment(u))
        return (min(segs), max(segs)) if segs else (0, 0)


def parameter_points(timeline: Timeline, state: dict[str, int], first: int, last: int) -> np.ndarray:
    """Bytes per liveness point of one parameter whose :func:`zero_state_bytes` are ``state``, used by segments
    ``first`` .. ``last``: stored tensor and optimizer state always, its gradient from ``last``'s backward, a kept
    gathered copy (ZeRO-1/2) until ``first``'s backward."""
    return (float(state["parameters"] + state["optimizer"]) * timeline.held(first, last)
            + state["gradients"] * timeline.gradient_held(first, last)
            + state["gathered"] * timeline.activation_alive(first, once=True))


@dataclass(frozen=True)
class StagedTimeline(Timeline):
    """The liveness points of a pipelined model whose stages are fixed before the search: each point belongs to one
    stage, and counts only that stage's bytes, as :meth:`autoshard.compiler.pipeline.PipelinePlan.stage_memory`
    prices a stage. So one memory row per point bounds every stage's memory instead of the whole model's.

    Point ``k < S`` belongs to the stage of segment ``S - 1 - k`` (the stage whose backward runs next); a stage's
    points run from the end of its own forward (:attr:`forward_ends`) to its own backward's end. They price the
    backward that peaks there, as ``stage_memory`` takes the larger of two (``later`` per stage, the microbatches in
    flight during the backwards after the first):

    - where 1F1B's steady state exists (more microbatches than in flight: ``later == flight``), every backward
      after the first holds ``flight`` microbatches and every gradient, which bounds the first too: an activation of
      segment ``g`` in stage ``s`` is alive at ``s``'s points until ``g``'s backward, plus ``flight[s] - 1`` at
      every point of ``s`` (the other microbatches in flight hold their whole forward); a gradient at every point
      of its stage; backward's temporaries hold a parameter's new gradient too (:meth:`accumulates`);
    - where none does (GPipe; 1F1B on a stage whose in-flight count is every microbatch: ``later == flight - 1``),
      the first backward holds the most activations and no gradient yet, the later ones one microbatch fewer and
      every gradient. Those stages' points price the first backward (``flight - 1`` others; a gradient from its
      segment's backward on; no accumulation), and each has a twin after them (:meth:`positions`: the same place
      in backward) pricing the later ones (``later - 1`` others, every gradient, accumulating) where there are any.

    The whole model's optimizer step (the last point) holds no stage's bytes (each stage's points hold all its
    gradients already). A parameter's stored state counts at the points of the stages of its first and last use
    (a tied embedding and head in both), nowhere else."""

    stage_of: tuple[int, ...] = ()  # per segment: its stage
    flight: tuple[int, ...] = ()  # per stage: microbatches in flight at its first backward
    #: per stage: microbatches in flight at its later backwards (``flight``: 1F1B's steady state; ``flight - 1``:
    #: one fewer each time; 0: one microbatch, no later backward); empty: ``flight`` everywhere
    later: tuple[int, ...] = ()

    @classmethod
    def staged(cls, gm, cuts: tuple[str, ...], flight: tuple[int, ...],
               later: tuple[int, ...] | None = None) -> StagedTimeline:
        """The timeline of ``gm`` cut before the modules ``cuts`` (module paths, each starting a stage:
        :func:`layer_cuts`), ``flight`` microbatches in flight per stage at its first backward, ``later`` at the
        ones after it (default: ``flight``)."""
        base = Timeline.of(gm)
        first: dict[int, int] = {}  # segment -> graph position of its first node
        starts = []
        for i, n in enumerate(gm.graph.nodes):
            if n in base.index:
                first.setdefault(base.index[n], i)
            if n.op == "call_function" and len(starts) < len(cuts):
                path = M.module_path(n)
                want = cuts[len(starts)]
                if path == want or path.startswith(want + "."):
                    starts.append(i)
        if len(starts) != len(cuts):
            raise PlanError(f"pipeline cut points {list(cuts)}: only {len(starts)} name modules of the model in order.")
        stage_of = tuple(sum(1 for c in starts if c <= first.get(s, 0)) for s in range(len(base.segments)))
        return cls(base.segments, base.index, stage_of=stage_of, flight=tuple(flight),
                   later=tuple(flight if later is None else later))

    def draining(self, stage: int) -> bool:
        """Whether ``stage``'s later backwards hold fewer microbatches than its first (its points price the first
        backward, and their twins the later ones)."""
        return bool(self.later) and self.later[stage] < self.flight[stage]

    def _twins(self) -> list[int]:
        """The base points (``k < S``) of the stages whose later backwards get points of their own, in order."""
        key = ("twins",)
        if key not in self._cache:
            s = len(self.segments)
            self._cache[key] = [k for k in range(s) if self.draining(st := self.stage_of[s - 1 - k])
                                and self.later[st] >= 1]
        return self._cache[key]

    @property
    def points(self) -> int:
        return len(self.segments) + len(self._twins()) + 1

    def positions(self) -> np.ndarray:
        """Per point, its place in backward as a point of one timeline (``k``; a twin its base point's; the step
        ``S``)."""
        key = ("positions",)
        if key not in self._cache:
            s = len(self.segments)
            self._cache[key] = np.array([*range(s), *self._twins(), s])
        return self._cache[key]

    def _first_backward(self) -> np.ndarray:
        """1 at the points that price a draining stage's first backward, else 0."""
        key = ("first",)
        if key not in self._cache:
            s = len(self.segments)
            owner = self.owner()
            self._cache[key] = np.array([float(k < s and self.draining(int(owner[k]))) for k in range(self.points)])
        return self._cache[key]

    def names(self) -> list[str]:
        base = super().names()
        return [*base[:-1], *(f"{base[k]}, a later microbatch" for k in self._twins()), base[-1]]

    def owner(self) -> np.ndarray:
        """Per point, its stage (-1: the optimizer step)."""
        key = ("owner",)
        if key not in self._cache:
            s = len(self.segments)
            self._cache[key] = np.array([self.stage_of[s - 1 - k] for k in (*range(s), *self._twins())] + [-1])
        return self._cache[key]

    def mask(self, stage: int) -> np.ndarray:
        return (self.owner() == stage).astype(float)

    @property
    def forward_ends(self) -> tuple[int, ...]:
        owner, s = self.owner(), len(self.segments)
        return tuple(k for k in range(len(owner) - 1)
                     if k == 0 or k == s or owner[k] != owner[k - 1])

    def accumulates(self, point: int) -> bool:
        """Whether an earlier microbatch has made every gradient of the stage at ``point`` (its backward's
        temporaries hold a parameter's new gradient before it is added)."""
        return not self._first_backward()[point]

    def held(self, first: int, last: int) -> np.ndarray:
        return np.maximum(self.mask(self.stage_of[first]), self.mask(self.stage_of[last]))

    def activation_alive(self, segment: int, once: bool = False) -> np.ndarray:
        key = ("activation", segment, once)
        if key not in self._cache:
            stage = self.stage_of[segment]
            mask = self.mask(stage)
            own = (self.positions() < len(self.segments) - segment) * mask
            if once:
                self._cache[key] = own
            else:
                others = self.flight[stage] - 1
                if self.draining(stage):  # its twins: the later backwards, one microbatch fewer
                    first = self._first_backward()
                    others = first * others + (1 - first) * (self.later[stage] - 1)
                self._cache[key] = own + others * mask
        return self._cache[key]

    def _gradient_from(self, segment: int, stage: int) -> np.ndarray:
        """1 at ``stage``'s points where a gradient made by ``segment``'s backward is alive: all of them, but from
        that backward on at the points of a draining stage's first backward."""
        made = (self.positions() >= len(self.segments) - segment).astype(float)
        first = self._first_backward()
        return self.mask(stage) * (first * made + (1 - first))

    def gradient_alive(self, segment: int) -> np.ndarray:
        key = ("gradient", segment)
        if key not in self._cache:
            self._cache[key] = self._gradient_from(segment, self.stage_of[segment])
        return self._cache[key]

    def gradient_held(self, first: int, last: int) -> np.ndarray:
        # a tied weight's stages each hold its gradient: the later stage's from its last use's backward, the earlier
        # one's from its first use's (the last use within that stage, at most: an upper bound)
        a, b = self.stage_of[first], self.stage_of[last]
        out = self._gradient_from(last, b)
        return out if a == b else np.maximum(out, self._gradient_from(first, a))


def layer_cuts(gm, stages: int) -> tuple[str, ...] | None:
    """Module paths of the repeated layers starting stages ``1 .. stages - 1`` when ``gm``'s layers (the numbered
    modules :func:`segment_key` finds, in the order they run) are dealt out evenly, stage ``s`` holding layers
    ``round(s·L/stages)`` onwards (what precedes the first layer in stage 0, what follows the last in the last
    stage); None where there are fewer layers than stages."""
    layers: list[str] = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and not _inherits_segment(n):
            key = segment_key(n)
            if key is not None and key not in layers:
                layers.append(key)
    if stages < 2 or len(layers) < stages:
        return None
    return tuple(layers[round(s * len(layers) / stages)] for s in range(1, stages))


# ---- saved activations of values: one accounting for a plan's graph and for the search ---------------------
def keeps(reader: Node, arg: Node, origin: Node, region_of: Callable[[Node], str | None] = recompute_region) -> bool:
    """``reader`` keeps ``arg`` (a copy of the value ``origin``: itself, or ``origin`` redistributed) for its
    backward: it saves that argument (the op's ``saves`` facet), or it lies in a recomputation region that does not
    hold ``origin`` (a region keeps its inputs to run again). A reader in ``origin``'s own region keeps nothing."""
    mine, theirs = region_of(origin), region_of(reader)
    if mine is not None and theirs == mine:
        return False
    return theirs is not None or any(x is arg for x in _saved_inputs(reader))


@dataclass
class SavedValue:
    """One value of the forward, as the memory model sees it in a plan: ``node`` (its op, or a getitem), the bytes
    of its own outputs on one rank (``own``: one entry per output; a getitem's single output), ``reads``: who reads
    which copy — ``(reader, arg, copy)`` with ``arg`` the node the reader takes (``reader`` None: a reader already
    known to keep it), ``copy`` None for the value itself or ``(key, bytes)`` for a redistributed copy (one per
    target layout) — and ``alive``: the liveness
    points it counts at (a multiple of :meth:`Timeline.activation_alive`: tied layer copies add up)."""

    node: Node
    own: list[int]
    reads: list[tuple]
    alive: np.ndarray
    numel: int = 0  # elements of its own (first) output on one rank: dropout's mask


def region_part(v: SavedValue) -> SavedValue:
    """What of ``v`` (a value in a recomputation region) its region keeps while its backward runs: its own output,
    and the copies that readers in the same region take."""
    region = recompute_region(v.node)
    reads = [(r, a, c) for r, a, c in v.reads if c is None or recompute_region(r) == region]
    return SavedValue(v.node, v.own, reads, v.alive, v.numel)


def storage_key(node: Node, copied: Callable[[Node, Node], bool] | None = None):
    """What ``node``'s output shares storage with: through views and same-dtype casts to a value; a getitem of a
    multi-output op is ``(op, index)``. ``copied(view, source)``: whether the view reads its source through a
    redistribution (a new storage: the plan search's layouts, before collectives are in the graph)."""
    base = _storage_base(node, copied)
    if base.target is operator.getitem and isinstance(base.args[0], Node):
        return (base.args[0], base.args[1])
    return base


def saved_bytes(values: list[SavedValue], region_of: Callable[[Node], str | None] = recompute_region,
                storage_of: Callable[[Node], object] = storage_key) -> tuple[np.ndarray, int]:
    """(bytes per liveness point, bytes at the end of forward) of the saved activations of ``values``.

    A value's own output counts when it saves it (relu, softmax, attention: every output) or a reader keeps the
    value itself (:func:`keeps`); a redistributed copy counts once per layout a reader keeps; dropout adds its
    boolean mask. Outputs sharing storage (views, same-dtype casts, a getitem and its op) count once: the largest
    (``storage_of``: :func:`storage_key`, or the plan search's, which knows its layouts)."""
    shared: dict = {}  # storage key -> (bytes, alive)
    points = None
    for v in values:
        points = np.zeros_like(v.alive) if points is None else points
        mine = region_of(v.node)
        multi = len(v.own) > 1
        own = mine is None and OUTPUT in _saves(v.node)
        copies: dict = {}
        for reader, arg, copy in v.reads:
            if reader is not None and not keeps(reader, arg, v.node, region_of):
                continue
            if copy is None:
                own = True
            else:
                copies[copy[0]] = copy[1]
        if own:
            keys = [(v.node, k) for k in range(len(v.own))] if multi else [storage_of(v.node)]
            for key, b in zip(keys, v.own):
                if b > shared.get(key, (0, None))[0]:
                    shared[key] = (b, v.alive)
        extra = sum(copies.values()) + (v.numel if _keeps_mask(v.node) and mine is None else 0)
        if extra:
            points = points + extra * v.alive
    for b, alive in shared.values():
        points = points + b * alive
    if points is None:
        return np.zeros(1), 0
    return points, int(round(points[0]))


# ---- a plan's memory per rank, by kind and by liveness point -----------------------------------------------
@dataclass(frozen=True)
class MemoryBreakdown:
    """Estimated bytes per rank of one plan, by kind, and the peak of a training step.

    - ``parameters``, ``gradients``, ``optimizer``: the stored parameters (ZeRO shards where stored so), their
      gradients and optimizer state (:func:`zero_state_bytes`); ``buffers``: buffers and frozen parameters;
    - ``activations``: what autograd keeps from forward for backward (:func:`saved_bytes`, at local sizes);
    - ``gathered``: parameter copies made for compute and kept for backward — every ZeRO-1/2 parameter's gathered
      copy, for ZeRO-3 the largest layer's twice (the layer in use, and the next layer's gather the runtime prefetches),
      and the copies other redistributions of a parameter make (a gradient sync's clone, a gather for a layout).

    The step's peak is the largest of its liveness points (:class:`Timeline`): the end of forward (everything but
    gradients), each backward segment boundary (``between``: the activations of the segments not yet run
    backward, the gradients of those that have) and the optimizer step (parameters, gradients and optimizer state,
    plus the optimizer's temporaries: one parameter-sized buffer of the largest parameter for a per-parameter
    update).
    """

    parameters: int = 0
    gradients: int = 0
    optimizer: int = 0
    buffers: int = 0
    activations: int = 0
    gathered: int = 0
    #: the optimizer's temporaries at its step: one buffer of the largest stored parameter (per-parameter update)
    largest_parameter: int = 0
    #: backward's first temporaries: the gradient of the largest activation (the logits' at a language model's
    #: loss), plus the activations of one recomputed region while its backward runs (the largest region's)
    temporaries: int = 0
    stages: dict = field(default_factory=dict)  # ZeRO stage -> number of parameters stored at it
    #: bytes at each backward segment boundary (the liveness points between the end of forward and the step)
    between: tuple = ()
    #: the transient workspace (:mod:`.workspace`) of the last segment's ops, whose backward runs first: at the end
    #: of forward (the other segments' ops add theirs to their own point of ``between``)
    transient: int = 0
    #: gradients an earlier microbatch's backward made, alive at every point (a pipeline stage's later backwards:
    #: ``plan_memory(accumulating=True)``); 0 otherwise
    accumulated: int = 0
    #: the once-per-step gradient sync's buffers, alive with every gradient before the step (a pipeline stage's
    #: flat copies: ``plan_memory(sync_once=True)``); the step's point holds the larger of it and the optimizer's
    gradient_sync: int = 0

    @property
    def end_of_forward(self) -> int:
        return (self.parameters + self.optimizer + self.buffers + self.activations + self.gathered + self.temporaries
                + self.transient + self.accumulated)

    @property
    def optimizer_step(self) -> int:
        return (self.parameters + self.gradients + self.optimizer + self.buffers
                + max(self.largest_parameter, self.gradient_sync))

    @property
    def points(self) -> tuple[int, ...]:
        """Bytes at every liveness point, in :meth:`Timeline.names` order."""
        return (self.end_of_forward, *self.between, self.optimizer_step)

    @property
    def peak(self) -> int:
        return max(self.points)

    def as_dict(self) -> dict:
        out = {"parameters": self.parameters, "gradients": self.gradients, "optimizer": self.optimizer,
               "buffers": self.buffers, "activations": self.activations, "gathered": self.gathered,
               "temporaries": self.temporaries, "transient": self.transient, "peak": self.peak,
               "stages": dict(self.stages)}
        out.update({k: v for k, v in (("accumulated", self.accumulated), ("gradient_sync", self.gradient_sync)) if v})
        return out


def point_totals(fixed: float, varying: np.ndarray, zero3_gathered: float, temporaries: float,
                 largest_parameter: float, starts: tuple[int, ...] = (0,)) -> np.ndarray:
    """Bytes per liveness point from the sums: ``fixed`` (at every point), ``varying`` (per point: activations,
    gradients, kept gathered copies), the ZeRO-3 layers gathered at once (every point but the step), backward's
    first temporaries (the end of forward: ``starts``, each stage's under :class:`StagedTimeline`) and the
    optimizer's (the step)."""
    out = fixed + np.asarray(varying, dtype=float)
    out[:-1] += zero3_gathered
    out[list(starts)] += temporaries
    out[-1] += largest_parameter
    return out


def transient_point(timeline: Timeline, node: Node) -> np.ndarray:
    """1 at the liveness point where ``node``'s transient workspace counts: just before its segment's backward
    (the activations of its segment and those before alive, the gradients of the later ones made), else 0. Two
    ops of one segment add up there (an upper bound: they run one after the other)."""
    return (timeline.positions() == len(timeline.segments) - 1 - timeline.segment(node)).astype(float)


def largest_gradient(local_numel: int, dtype: torch.dtype) -> int:
    """Bytes of an activation's gradient in backward: at least fp32 (losses compute in fp32: vocab-parallel
    cross-entropy, HF's upcast)."""
    return int(local_numel) * max(dtype.itemsize, 4)


_CASTS = ("aten._to_copy.default", "aten.to.dtype", "aten.to.dtype_layout", "aten.type_as.default")


def _parameter_copy(node: Node) -> tuple[Node | None, bool]:
    """(the parameter, counted elsewhere) when ``node`` is a parameter made ready for compute — through
    collectives and dtype casts only — else (None, False). Counted elsewhere (True): the compute-dtype cast of a
    parameter where it lies (with the parameter: :func:`zero_state_bytes`), a ZeRO-stored parameter's gathers and
    the casts before them (``gathered``), a gradient sync of the parameter itself (the runtime's bucketer syncs the
    ``.grad``, no copy). Anything else on the way — a cast back after a gradient sync, another layout's gather, and
    the gradient sync that follows such a gather (a parameter stored sharded by its layout, ``zero=0``: its gathered
    copy is what the consumer keeps for backward) — is a kept copy."""
    chain = []
    cur = node
    while isinstance(cur, Node) and cur.op == "call_function" and cur.args and (
            M.COLLECTIVE in cur.meta or str(cur.target) in _CASTS):
        chain.append(cur)
        cur = cur.args[0]
    if not chain or not isinstance(cur, Node) or cur.op != "get_attr":
        return None, False
    syncs_and_casts = all(str(c.target) in _CASTS or c.meta[M.COLLECTIVE].kind == "grad_all_reduce" for c in chain)
    if M.STORAGE not in cur.meta and syncs_and_casts:
        return cur, True  # the compute copy of a parameter stored whole (before or after its gradient sync)
    if M.STORAGE in cur.meta and all(M.COLLECTIVE in c.meta or c.meta.get(M.PRECISION_CAST) for c in chain):
        return cur, True
    return cur, False


def _is_collective(n: Node) -> bool:
    return n.op == "call_function" and M.COLLECTIVE in n.meta and bool(n.args) and isinstance(n.args[0], Node)


def _through_syncs(n: Node) -> Node:
    """A gradient sync is the identity forward: the copy it passes on is its input's."""
    while _is_collective(n) and n.meta[M.COLLECTIVE].kind == "grad_all_reduce":
        n = n.args[0]
    return n


def _origin(n: Node) -> Node:
    """The value a chain of collectives redistributes."""
    while _is_collective(n):
        n = n.args[0]
    return n


def _tensor_args(node: Node) -> list[Node]:
    out = []
    for a in (*node.args, *node.kwargs.values()):
        for x in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(x, Node):
                out.append(x)
    return out


def _own_bytes(node: Node, spec, local_numel: Callable) -> tuple[list[int], int]:
    """(local bytes of each output of ``node`` under ``spec``, local elements of its first output)."""
    tensors = output_tensors(node)
    multi = isinstance(spec, tuple) and spec and isinstance(spec[0], tuple)
    specs = list(spec) if multi else [spec] * len(tensors)
    own = [local_numel(t.shape, s) * t.element_size() for t, s in zip(tensors, specs)]
    return own, (local_numel(tensors[0].shape, specs[0]) if tensors else 0)


def plan_memory(gm, mesh, optimizer: str = "adam", compute_dtype: torch.dtype | None = None,
                in_flight: int = 1, *, accumulating: bool = False, keeps_outputs: bool = False,
                sync_once: bool = False) -> MemoryBreakdown:
    """:class:`MemoryBreakdown` of an annotated global graph (after ``propagate`` and ``insert_collectives``; ZeRO
    storage read from :data:`autoshard.meta.STORAGE`). ``compute_dtype``: mixed precision's ``param_dtype`` (None:
    the parameters' own dtype). Raises :class:`~autoshard.errors.PlanError` for an optimizer it has no model of.

    How a pipeline schedule runs the graph of one stage
    (:meth:`autoshard.compiler.pipeline.plan.PipelinePlan.stage_memory`):

    - ``in_flight``: microbatches whose activations are alive at once; while one runs its backward, the others
      hold everything their forward saved (their gradients accumulate in one set);
    - ``accumulating``: an earlier microbatch's backward has made every gradient: all of them alive at every point,
      and while backward adds a parameter's new gradient to its own, that new one too (the largest parameter's
      gradient, with backward's first temporaries);
    - ``keeps_outputs``: the graph's outputs are kept until their segment's backward (the schedule keeps each
      microbatch's stage outputs to run its backward with the gradients the next stage sends);
    - ``sync_once``: the data-parallel gradient syncs the program leaves to the runner
      (:func:`passes.bucket_grad_sync.param_of_sync`'s) run once per step on flat copies
      (:func:`autoshard.runtime.pipeline.sync_grads_once`: per (axes, dtype) group, the gradients concatenated
      and the all-reduce's new tensor; the previous group's reduced copy is still held while the next is
      concatenated) — ``gradient_sync``, with every gradient, before the optimizer step."""
    if not isinstance(in_flight, int) or in_flight < 1:
        raise PlanError(f"plan_memory has in_flight={in_flight!r}, but it counts microbatches: an int >= 1.")
    from autoshard.placements import local_shape

    def local_numel(shape_, spec) -> int:
        return math.prod(local_shape(tuple(shape_), spec, mesh))

    timeline = Timeline.of(gm)
    kinds = dict.fromkeys(("parameters", "gradients", "optimizer", "buffers", "activations", "gathered"), 0)
    varying = np.zeros(timeline.points)  # gradients and kept copies per point (activations are added below)
    largest = largest_grad = 0
    grad_of: dict[Node, int] = {}  # parameter -> bytes of its stored gradient
    stages: dict[int, int] = {}
    layer_gathers: dict[str, int] = {}
    largest_activation = 0
    regions: dict[str, int] = {}
    values: dict[Node, SavedValue] = {}
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if n.op == "get_attr" and isinstance(val, torch.Tensor):
            if not n.meta.get(M.REQUIRES_GRAD):
                kinds["buffers"] += local_numel(val.shape, n.meta[M.SPEC]) * val.element_size()
                continue
            storage = n.meta.get(M.STORAGE)
            stage = storage.stage if storage is not None else 0
            compute = storage.compute if storage is not None else n.meta[M.SPEC]
            data = mesh.axis_size(storage.axis) if storage is not None else 1
            state = zero_state_bytes(local_numel(val.shape, compute), stage, data, val.dtype, optimizer,
                                     compute_dtype if compute_dtype is not None and val.dtype.is_floating_point
                                     else None)
            for k in ("parameters", "gradients", "optimizer", "gathered"):
                kinds[k] += state[k]
            first, last = timeline.uses(n)
            varying += parameter_points(timeline, state, first, last) - (state["parameters"] + state["optimizer"])
            if accumulating:  # made by an earlier microbatch's backward: alive before this one's reaches it
                varying += state["gradients"] * (1 - timeline.gradient_alive(last))
            largest = max(largest, state["parameters"])
            largest_grad = max(largest_grad, state["gradients"])
            grad_of[n] = state["gradients"]
            stages[stage] = stages.get(stage, 0) + 1
            if stage == 3:
                gathered = param_bytes(local_numel(val.shape, compute), compute_dtype or val.dtype)
                layer = segment_key(n) or str(n.target)
                layer_gathers[layer] = layer_gathers.get(layer, 0) + gathered
        elif n.op == "call_function" and n.meta.get(M.REQUIRES_GRAD) and M.SPEC in n.meta:
            spec = n.meta[M.SPEC]
            source, counted = _parameter_copy(n)
            if source is not None:  # a copy of a parameter made for compute: never an activation
                if not counted and isinstance(val, torch.Tensor):
                    b = activation_bytes(n, local_numel(val.shape, spec))
                    kinds["gathered"] += b
                    varying += b * timeline.activation_alive(timeline.segment(n))
                continue
            if _is_collective(n) or _is_param(n) or not output_tensors(n):
                continue
            own, numel = _own_bytes(n, spec, local_numel)
            values[n] = SavedValue(n, own, [], timeline.activation_alive(timeline.segment(n)), numel)
            if len(own) == 1:
                largest_activation = max(largest_activation, largest_gradient(numel, val.dtype))
    # who reads which copy of each value: itself (through gradient syncs) or a redistribution of it
    for r in gm.graph.nodes:  # (the output node keeps nothing, but a copy made for it has a gradient in backward)
        if r.op not in ("call_function", "output") or _is_collective(r):
            continue
        keeper = None if r.op == "output" and keeps_outputs else r  # None: a reader known to keep it
        for a in _tensor_args(r):
            copy = _through_syncs(a)
            origin = _origin(copy)
            v = values.get(origin)
            if v is None:
                continue
            if copy is origin:
                v.reads.append((keeper, a, None))
            else:
                cval = copy.meta["val"]
                numel = local_numel(cval.shape, copy.meta[M.SPEC])
                v.reads.append((keeper, a, (copy, numel * cval.element_size())))
                largest_activation = max(largest_activation, largest_gradient(numel, cval.dtype))
    acts, kinds["activations"] = saved_bytes(list(values.values()))
    # what ops keep besides their outputs (attention's float mask): once per storage, until its first keeper's
    # segment runs backward
    for size, first in kept_workspace(gm, mesh, timeline.segment):
        kinds["activations"] += size
        acts = acts + size * timeline.activation_alive(timeline.segment(first))
    # the other microbatches in flight hold what their whole forward saved, at every point but the step
    kinds["activations"] *= in_flight
    acts = acts + (in_flight - 1) * acts[0] * (np.arange(timeline.points) < timeline.points - 1)
    # what ops hold while they run (ring attention's score blocks): at the point where their segment's backward
    # runs next — every activation of it and of the segments before alive, as in its forward and more
    transient = np.zeros(timeline.points)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for size, n in transient_workspace(gm, mesh):
        # by then the backward of its segment's later ops has freed what they saved (an attention's MLP after it)
        later = [v for v in values.values() if timeline.segment(v.node) == timeline.segment(n)
                 and order[v.node] > order[n]]
        freed = saved_bytes(later)[1] if later else 0  # (this microbatch's: the others' stay)
        transient += max(0, size - freed) * transient_point(timeline, n)
    for v in values.values():  # what a recomputed region saves while its backward runs, recomputed
        region = recompute_region(v.node)
        if region is not None:
            regions[region] = regions.get(region, 0) + saved_bytes([region_part(v)], _no_region)[1]
    zero3 = 2 * max(layer_gathers.values(), default=0)  # the layer in use and the next one's prefetch
    kinds["gathered"] += zero3
    # backward's first temporaries: the largest activation's gradient, and one recomputed region's activations
    # (accumulating: and a parameter's new gradient before it is added to the one an earlier microbatch made)
    temporaries = largest_activation + max(regions.values(), default=0) + (largest_grad if accumulating else 0)
    sync = _gradient_sync_bytes(gm, grad_of) if sync_once else 0
    fixed = kinds["parameters"] + kinds["optimizer"] + kinds["buffers"]
    points = point_totals(fixed, varying + acts, zero3, temporaries, max(largest, sync)) + transient
    return MemoryBreakdown(**kinds, largest_parameter=largest, temporaries=temporaries, stages=stages,
                           between=tuple(int(round(x)) for x in points[1:-1]), transient=int(transient[0]),
                           accumulated=kinds["gradients"] if accumulating else 0, gradient_sync=sync)


def _gradient_sync_bytes(gm, grad_of: dict[Node, int]) -> int:
    """The most bytes :func:`autoshard.runtime.pipeline.sync_grads_once` holds besides the gradients: the
    parameters whose sync the program leaves to the runner (:func:`passes.bucket_grad_sync.param_of_sync`, in
    graph order) grouped by (axes, dtype); per group its gradients concatenated into one flat tensor and the
    all-reduce's new one, while the previous group's reduced tensor is still held during the concatenation."""
    from autoshard.passes.bucket_grad_sync import param_of_sync

    groups: dict[tuple, int] = {}
    for n in gm.graph.nodes:
        param = param_of_sync(n) if n.op == "call_function" else None
        if param is not None and param in grad_of:
            key = (tuple(n.args[1]), param.meta["val"].dtype)
            groups[key] = groups.get(key, 0) + grad_of[param]
    held, prev = 0, 0
    for size in groups.values():
        held, prev = max(held, size + max(size, prev)), size
    return held


_ALIAS_CASTS = ("aten.to.dtype", "aten.to.dtype_layout", "aten.type_as.default")  # (_to_copy always copies)


def _storage_base(node: Node, copied: Callable[[Node, Node], bool] | None = None) -> Node:
    """The node whose output ``node``'s output shares storage with: through views, and through casts to the dtype
    the tensor already has (``x.to(torch.float32)`` of a float32 ``x`` returns ``x``, as Llama's RMSNorm does)."""
    while node.op == "call_function" and node.args and isinstance(node.args[0], Node):
        src = node.args[0]
        if copied is not None and copied(node, src):
            break
        if entry(node.target).bytes == "view" or _identity_dropout(node):
            node = src
            continue
        val, sval = node.meta.get("val"), src.meta.get("val")
        if (str(node.target) in _ALIAS_CASTS and isinstance(val, torch.Tensor) and isinstance(sval, torch.Tensor)
                and val.dtype == sval.dtype):
            node = src
            continue
        break
    return node


def _aliases_region_input(node: Node, region: str | None, region_of: Callable) -> bool:
    """``node`` (in recomputation ``region``) is a view or same-dtype cast of a value made outside that region: the
    region keeps the value's storage as its input, as :func:`saved_bytes` counts it at the value (the next layer's
    ``hidden_states.to(float32)`` of the previous layer's residual sum, which owns the storage here)."""
    if region is None:
        return False
    base = storage_key(node)
    return isinstance(base, Node) and base is not node and region_of(base) != region


def _no_region(node: Node) -> None:
    return None


# ---- the same model, priced per decision option: the plan search's coefficients ----------------------------
class GraphMemory:
    """The memory model of a global graph *before* collective insertion, as the plan search prices it.

    Linear coefficients, bytes per liveness point (:class:`Timeline`) of one option of one decision:

    - a parameter stored at a spec and ZeRO stage (:meth:`parameter`: :func:`parameter_points`), a buffer
      (:meth:`buffer`);
    - an op's outputs under a strategy (:meth:`op_option`): its saved outputs at local size, as if every reader
      read them in that layout (a storage shared by views counts at its first saved member);

    and the terms that are no sum of options (:meth:`points`): the copies a redistribution makes for a reader that
    keeps them, readers that keep another layout than the one produced (an exact account: :func:`saved_bytes` on
    :class:`SavedValue`\\ s built from the chosen layouts), the ZeRO-3 layer gathered at once, backward's first
    temporaries and the optimizer's. :func:`plan_memory` prices the same plan after collective insertion with the
    same functions, so the search's memory of a plan is ``plan.cost()``'s."""

    def __init__(self, gm, mesh, optimizer: str = "adam", compute_dtype: torch.dtype | None = None,
                 region_of: Callable[[Node], str | None] = recompute_region, timeline: Timeline | None = None):
        from autoshard.placements import local_shape

        optimizer_state_bytes(0, optimizer)  # an optimizer without a model is an error here, not at pricing
        self.mesh, self.optimizer, self.compute_dtype, self.region_of = mesh, optimizer, compute_dtype, region_of
        self.timeline = timeline if timeline is not None else Timeline.of(gm)
        self._local_shape = local_shape
        self.owners: dict = {}  # storage key -> the first node whose saved output lives in it (graph order)
        self._kept_owners: dict = {}  # Workspace.kept_key -> the first op keeping it (kept_owner)
        self._counted_cache: dict = {}
        for n in gm.graph.nodes:
            if not self.is_value(n):
                continue
            multi = len(output_tensors(n)) > 1
            mine = region_of(n)
            own = mine is None and OUTPUT in _saves(n)
            if multi:
                for k in range(len(output_tensors(n))):
                    if own:
                        self.owners.setdefault((n, k), n)
                continue
            if own or any(keeps(r, n, n, region_of) for r in n.users if r.op == "call_function"):
                self.owners.setdefault(storage_key(n), n)

    def local_numel(self, shape_, spec) -> int:
        return math.prod(self._local_shape(tuple(shape_), spec, self.mesh))

    @staticmethod
    def is_value(n: Node) -> bool:
        """An activation the model counts: a requires-grad op's output that is no parameter or view of one."""
        return (n.op == "call_function" and bool(n.meta.get(M.REQUIRES_GRAD)) and bool(output_tensors(n))
                and not _is_param(n))

    # ---- parameters ----------------------------------------------------------------------------------------
    def parameter_state(self, node: Node, spec, stage: int, data_size: int) -> dict[str, int]:
        """:func:`zero_state_bytes` of parameter ``node`` used in layout ``spec``, stored at ZeRO ``stage``."""
        val = node.meta["val"]
        cd = self.compute_dtype if self.compute_dtype is not None and val.dtype.is_floating_point else None
        return zero_state_bytes(self.local_numel(val.shape, spec), stage, data_size, val.dtype, self.optimizer, cd)

    def parameter(self, nodes: list[Node], spec, stage: int, data_size: int) -> np.ndarray:
        """Bytes per point of the parameters ``nodes`` (tied copies of one decision) in ``spec`` at ``stage``."""
        out = np.zeros(self.timeline.points)
        for n in nodes:
            state = self.parameter_state(n, spec, stage, data_size)
            out += parameter_points(self.timeline, state, *self.timeline.uses(n))
        return out

    def zero3_gathered(self, node: Node, spec) -> tuple[str, int]:
        """(the layer it is gathered with, bytes of its compute copy) of a ZeRO-3 parameter."""
        val = node.meta["val"]
        return (segment_key(node) or str(node.target),
                param_bytes(self.local_numel(val.shape, spec), self.compute_dtype or val.dtype))

    def buffer(self, node: Node, spec) -> int:
        val = node.meta["val"]
        return self.local_numel(val.shape, spec) * val.element_size()

    # ---- activations ---------------------------------------------------------------------------------------
    def alive(self, nodes: list[Node]) -> np.ndarray:
        """The liveness of activations made by ``nodes`` (tied copies: their points add up). A parameter's copies
        are made where it is read: they live until the backward of its earliest reader's segment, as the
        collectives making them do in a plan's graph."""
        return sum((self.timeline.activation_alive(self._made_in(n), once=n.op == "get_attr") for n in nodes),
                   np.zeros(self.timeline.points))

    def _made_in(self, node: Node) -> int:
        if node.op != "get_attr":
            return self.timeline.segment(node)
        return min((self.timeline.segment(u) for u in node.users if u.op == "call_function"), default=0)

    def own_bytes(self, node: Node, output_spec) -> tuple[list[int], int]:
        """(local bytes of each output, local elements of the first) of ``node`` under ``output_spec``."""
        return _own_bytes(node, output_spec, self.local_numel)

    def op_option(self, node: Node, output_spec, region_of: Callable | None = None) -> float:
        """Saved bytes at the end of forward of op ``node``'s outputs in layout ``output_spec``, as if every reader
        read that layout (the linear part: :meth:`points` adds what redistributions change). Getitems of a
        multi-output op count with it. ``region_of``: the recomputation regions to price it under."""
        if not self.is_value(node):
            return 0.0
        counted, mask = self._counted(node, region_of or self.region_of)
        if not counted and not mask:
            return 0.0
        own, numel = self.own_bytes(node, output_spec)
        return float(sum(own[k] for k in counted) + (numel if mask else 0))

    def kept_only_by_readers(self, node: Node) -> bool:
        """Whether :meth:`op_option` counts ``node``'s (single) output only because a reader keeps it: the op does
        not save it itself, lies in no recomputation region and owns its storage. Then the output is kept only in a
        layout some keeping reader reads it in (a reader of a redistributed copy keeps the copy instead): the
        search's program counts it through the readers' choices (:meth:`.ilp._Builder.own_output`)."""
        if not self.is_value(node) or len(output_tensors(node)) != 1 or self.region_of(node) is not None:
            return False
        counted, mask = self._counted(node, self.region_of)
        return counted == (0,) and not mask and OUTPUT not in _saves(node)

    def _counted(self, node: Node, region_of: Callable) -> tuple[tuple[int, ...], bool]:
        """(the outputs of ``node`` whose saved bytes it carries, whether its dropout mask counts): what
        :func:`saved_bytes` keeps of its outputs when every reader reads them as produced, each storage at its
        owner. The same for every layout: cached."""
        key = (node, region_of)
        cached = self._counted_cache.get(key)
        if cached is not None:
            return cached
        counted: list[int] = []
        n_out = len(output_tensors(node))
        mine = region_of(node)
        own = mine is None and OUTPUT in _saves(node)
        if n_out > 1:
            if own and self.owners.get((node, 0)) is node:
                counted = list(range(n_out))
            for g in node.users:
                if (g.target is operator.getitem and self.is_value(g) and g.args[1] not in counted
                        and self.owners.get(storage_key(g)) is g
                        and any(keeps(r, g, g, region_of) for r in g.users if r.op == "call_function")):
                    counted.append(g.args[1])
        elif self.owners.get(storage_key(node)) is node and (
                own or any(keeps(r, node, node, region_of) for r in node.users if r.op == "call_function")
                or _aliases_region_input(node, mine, region_of)):
            counted = [0]
        answer = (tuple(counted), _keeps_mask(node) and mine is None)
        self._counted_cache[key] = answer
        return answer

    def workspace(self, nodes: list[Node], strategy) -> np.ndarray:
        """Bytes per point of what the ops ``nodes`` (tied copies of one decision) allocate besides their outputs
        under ``strategy`` (:mod:`.workspace`), as one linear term of the program: a kept storage
        (:meth:`kept_storage`) at the first op asked about it (:meth:`kept_owner`), alive until that op's segment
        runs backward — no more than a plan keeps, since the storage exists wherever its owner keeps it, from a
        segment no later (:func:`autoshard.passes.plan_search.objective.memory_points` counts a plan's exactly:
        :meth:`kept`, :meth:`kept_points`); and :meth:`transient`."""
        out = self.transient(nodes, strategy)
        for n in nodes:
            w = op_workspace(n, self.mesh, strategy)
            if w.kept and self.kept_owner(n, w, strategy) is n:
                out += w.kept * self.timeline.activation_alive(self.timeline.segment(n))
        return out

    def transient(self, nodes: list[Node], strategy) -> np.ndarray:
        """Bytes per point of what the ops ``nodes`` hold only while they run under ``strategy``: at
        :func:`transient_point` — whole: :func:`plan_memory` credits what the segment's later ops saved and have
        freed by then, which depends on their layouts, so the search's transient is an upper bound of it."""
        out = np.zeros(self.timeline.points)
        for n in nodes:
            w = op_workspace(n, self.mesh, strategy)
            if w.transient:
                out += w.transient * transient_point(self.timeline, n)
        return out

    def kept(self, nodes: list[Node], strategy) -> tuple:
        """``(storage, bytes, segment)`` of what each op of ``nodes`` keeps for backward besides its outputs under
        ``strategy`` (:meth:`kept_storage`): a plan's are counted by :meth:`kept_points`."""
        out = []
        for n in nodes:
            w = op_workspace(n, self.mesh, strategy)
            if w.kept:
                out.append((self._kept_key(n, w, strategy), w.kept, self.timeline.segment(n)))
        return tuple(out)

    def _kept_key(self, node: Node, w, strategy):
        """:meth:`kept_storage`, per stage under a :class:`StagedTimeline` (each stage's graph makes its own)."""
        key = self.kept_storage(node, w, strategy)
        stage_of = getattr(self.timeline, "stage_of", None)
        return (key, stage_of[self.timeline.segment(node)]) if stage_of else key

    def kept_points(self, kept) -> np.ndarray:
        """Bytes per point of the storages ``kept`` (:meth:`kept` of a plan's options), as :func:`plan_memory` counts
        them (:func:`.workspace.kept_workspace`): each storage once, at its largest, alive until the backward of the
        earliest segment keeping it."""
        found: dict = {}
        for key, size, segment in kept:
            b, s = found.get(key, (0, segment))
            found[key] = (max(b, size), min(s, segment))
        out = np.zeros(self.timeline.points)
        for b, s in found.values():
            out += b * self.timeline.activation_alive(s)
        return out

    @staticmethod
    def kept_storage(node: Node, w, strategy):
        """The storage ``w.kept`` lives in, as the plan's graph has it: ``node`` itself without a ``kept_key``; else
        one per key and layout ``node`` reads the key's nodes in. Collective insertion gives every layout a reader
        takes of a value but the one it is made in a node of its own (shared by the readers of that layout), and
        :func:`.workspace.kept_workspace` keys a storage by the op's argument: HF Llama's attentions reading one
        boolean mask whole and sharded keep two float copies (``sdpa_workspace``'s ``("additive_mask", mask)``)."""
        if w.kept_key is None:
            return node
        key = w.kept_key if isinstance(w.kept_key, tuple) else (w.kept_key,)
        named = [x for x in key if isinstance(x, Node)]
        specs = getattr(strategy, "input_specs", None) or ()
        layouts = tuple(s for x, s in zip(tensor_inputs(node), specs) if any(x is y for y in named))
        return (w.kept_key, layouts)

    def kept_owner(self, node: Node, w, strategy=None) -> Node:
        """The op that carries the storage of ``w.kept`` (:meth:`kept_storage`; ``node`` itself without a key) in
        the program's linear term: the first op asked about that storage, the first in graph order as the search
        asks (``_op_decisions`` walks the graph)."""
        if w.kept_key is None:
            return node
        return self._kept_owners.setdefault(self._kept_key(node, w, strategy), node)

    def gradient(self, node: Node, output_spec) -> int:
        """Bytes of the gradient of ``node``'s output in backward (single-output values; 0 otherwise)."""
        if not self.is_value(node) or len(output_tensors(node)) != 1:
            return 0
        own, numel = self.own_bytes(node, output_spec)
        return largest_gradient(numel, output_tensors(node)[0].dtype)

    def copy_bytes(self, node: Node, spec) -> int:
        """Local bytes of a copy of ``node``'s (single) output redistributed to ``spec``: a floating parameter's in
        the compute dtype (mixed precision casts it before any redistribution)."""
        t = output_tensors(node)[0]
        if node.op == "get_attr" and self.compute_dtype is not None and t.is_floating_point():
            return param_bytes(self.local_numel(t.shape, spec), self.compute_dtype)
        return self.local_numel(t.shape, spec) * t.element_size()

    def points(self, fixed: np.ndarray, values: list[SavedValue], zero3_layers: dict[str, int],
               temporaries: float, largest_parameter: float) -> np.ndarray:
        """Bytes per liveness point of a plan: ``fixed`` (the options' parameter and buffer bytes per point), the
        saved activations of ``values`` (:func:`saved_bytes`), the ZeRO-3 layer gathered at once (twice: the one
        in use and the next one's prefetch), backward's first ``temporaries`` and the optimizer's."""
        acts = saved_bytes(values, self.region_of)[0] if values else 0.0
        return point_totals(0.0, fixed + acts, 2 * max(zero3_layers.values(), default=0), temporaries,
                            largest_parameter, self.timeline.forward_ends)
