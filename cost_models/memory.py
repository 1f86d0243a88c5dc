"""Per-rank memory: parameters, gradients, optimizer state and the activations kept for backward.

Training state of ``p`` local parameter elements of ``dtype`` (:func:`training_state_bytes`)::

    params    = p · itemsize(dtype)                                    param_bytes
    grads     = p · itemsize(dtype)                                    grad_bytes
    optimizer = sgd: 0 · sgd_momentum: params (one momentum buffer)    optimizer_state_bytes
                adam / adamw: 2 · p · 4 (exp_avg and exp_avg_sq, fp32 whatever the parameter dtype)

Activations (:func:`activation_bytes`) are a heuristic of what autograd saves between forward and backward, read
from each op's ``saves`` facet in the op registry (:mod:`autoshard.ops`): a node's output counts, at its local
size, when

- some user of it saves that input for its backward: contractions (mm, bmm, matmul, linear, einsum, conv, sdpa
  save their operands), products and quotients (mul, div save both sides), nonlinear functions whose derivative
  needs their input (gelu, silu, log, sin, layer_norm, rms_norm, the losses),
  embedding (its indices); or
- the node itself saves its output: relu, sigmoid, tanh, exp, softmax and log_softmax, sqrt and rsqrt, and the
  attention ops (their output and log-sum-exp; for multi-output ops every output counts);
- plus dropout's boolean mask (one byte per element) on top.

Outputs read only by ops that save nothing (add, sub, views, reductions) are freed during the forward and do not
count. Parameters (``get_attr`` nodes, nodes carrying ``autoshard.param``) and views of them count as parameters,
not activations. Two views of one saved tensor both count (an over-estimate that keeps the rule local).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.fx import Node

from autoshard import meta as M
from autoshard.errors import PlanError
from autoshard.ops import MASK, OUTPUT, entry

from .compute import output_tensors

__all__ = [
    "OPTIMIZERS",
    "MemoryBreakdown",
    "activation_bytes",
    "dtype_bytes",
    "grad_bytes",
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
    out = {"parameters": p, "gradients": grad_bytes(stored, dtype), "optimizer": optimizer_state_bytes(p, optimizer, dtype),
           "gathered": 0}
    if stage == 0 and compute_dtype != dtype:
        out["parameters"] += param_bytes(local_numel, compute_dtype)
    if stage in (1, 2):
        out["gathered"] = param_bytes(local_numel, compute_dtype)
    return out


def _saves(node: Node) -> tuple:
    """The ``saves`` facet of ``node``'s op (:mod:`autoshard.ops`); () for placeholders, get_attr and output."""
    return entry(node.target).saves if node.op == "call_function" else ()


def _saved_inputs(user: Node) -> list:
    """The nodes ``user`` keeps for its backward: the args at its ``saves`` positions (every node of a list arg)."""
    saved = []
    for i in _saves(user):
        if isinstance(i, int) and i < len(user.args):
            a = user.args[i]
            saved.extend(a if isinstance(a, (list, tuple)) else [a])
    return saved


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
    if MASK in _saves(node) and mine is None:
        total += numel  # the boolean mask
    return total


def recompute_region(node: Node) -> str | None:
    """The recomputation region (:data:`autoshard.meta.RECOMPUTE`) of a call_function node, None elsewhere."""
    return node.meta.get(M.RECOMPUTE) if node.op == "call_function" else None


# ---- a plan's memory per rank, by kind ---------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryBreakdown:
    """Estimated bytes per rank of one plan, by kind, and the peak of a training step.

    - ``parameters``, ``gradients``, ``optimizer``: the stored parameters (ZeRO shards where stored so), their
      gradients and optimizer state (:func:`zero_state_bytes`); ``buffers``: buffers and frozen parameters;
    - ``activations``: what autograd keeps from forward for backward (:func:`activation_bytes`, at local sizes);
    - ``gathered``: parameter copies made for compute and kept for backward — every ZeRO-1/2 parameter's gathered
      copy, for ZeRO-3 the largest layer's twice (the layer in use, and the next layer's gather the runtime prefetches),
      and the copies other redistributions of a parameter make (a gradient sync's clone, a gather for a layout).

    The step's peak is the larger of two moments: the end of forward (everything but gradients: a step's gradients
    appear as its activations are freed, so the two are not counted together) and the optimizer step (parameters,
    gradients and optimizer state, plus the optimizer's temporaries: one parameter-sized buffer of the largest
    parameter for a per-parameter update).
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

    @property
    def end_of_forward(self) -> int:
        return self.parameters + self.optimizer + self.buffers + self.activations + self.gathered + self.temporaries

    @property
    def optimizer_step(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.buffers + self.largest_parameter

    @property
    def peak(self) -> int:
        return max(self.end_of_forward, self.optimizer_step)

    def as_dict(self) -> dict:
        return {"parameters": self.parameters, "gradients": self.gradients, "optimizer": self.optimizer,
                "buffers": self.buffers, "activations": self.activations, "gathered": self.gathered,
                "temporaries": self.temporaries, "peak": self.peak, "stages": dict(self.stages)}


def _layer_of(fqn: str) -> str:
    """The repeated layer a parameter belongs to: its FQN up to the first numeric component (``blocks.3``,
    ``model.layers.11``); the FQN itself where there is none."""
    parts = fqn.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[:i + 1])
    return fqn


_CASTS = ("aten._to_copy.default", "aten.to.dtype", "aten.to.dtype_layout", "aten.type_as.default")


def _parameter_copy(node: Node) -> tuple[Node | None, bool]:
    """(the parameter, counted elsewhere) when ``node`` is a parameter made ready for compute — through
    collectives and dtype casts only — else (None, False). Counted elsewhere (True): the compute-dtype cast of a
    parameter where it lies (with the parameter: :func:`zero_state_bytes`), a ZeRO-stored parameter's gathers and
    the casts before them (``gathered``), a gradient sync (the runtime's bucketer syncs the ``.grad``, no copy).
    Anything else on the way — a cast back after a gradient sync, another layout's gather — is a kept copy."""
    chain = []
    cur = node
    while isinstance(cur, Node) and cur.op == "call_function" and cur.args and (
            M.COLLECTIVE in cur.meta or str(cur.target) in _CASTS):
        chain.append(cur)
        cur = cur.args[0]
    if not chain or not isinstance(cur, Node) or cur.op != "get_attr":
        return None, False
    if M.COLLECTIVE in node.meta and node.meta[M.COLLECTIVE].kind == "grad_all_reduce":
        return cur, True
    syncs_and_casts = all(str(c.target) in _CASTS or c.meta[M.COLLECTIVE].kind == "grad_all_reduce" for c in chain)
    if M.STORAGE not in cur.meta and syncs_and_casts:
        return cur, True  # the compute copy of a parameter stored whole (before or after its gradient sync)
    if M.STORAGE in cur.meta and all(M.COLLECTIVE in c.meta or c.meta.get(M.PRECISION_CAST) for c in chain):
        return cur, True
    return cur, False


def plan_memory(gm, mesh, optimizer: str = "adam", compute_dtype: torch.dtype | None = None) -> MemoryBreakdown:
    """:class:`MemoryBreakdown` of an annotated global graph (after ``propagate``; ZeRO storage read from
    :data:`autoshard.meta.STORAGE`). ``compute_dtype``: mixed precision's ``param_dtype`` (None: the parameters'
    own dtype)."""
    import math

    from autoshard.placements import local_shape

    def local_numel(shape_, spec) -> int:
        return math.prod(local_shape(tuple(shape_), spec, mesh))

    kinds = dict.fromkeys(("parameters", "gradients", "optimizer", "buffers", "activations", "gathered"), 0)
    largest = 0
    stages: dict[int, int] = {}
    layer_gathers: dict[str, int] = {}
    largest_activation = 0
    regions: dict[str, int] = {}
    by_storage: dict[Node, int] = {}
    region_of = _regions_with_collectives(gm)
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
            largest = max(largest, state["parameters"])
            stages[stage] = stages.get(stage, 0) + 1
            if stage == 3:
                gathered = param_bytes(local_numel(val.shape, compute), compute_dtype or val.dtype)
                layer = _layer_of(n.meta.get(M.PARAM, str(n.target)))
                layer_gathers[layer] = layer_gathers.get(layer, 0) + gathered
        elif n.op == "call_function" and n.meta.get(M.REQUIRES_GRAD) and M.SPEC in n.meta:
            spec = n.meta[M.SPEC]
            source, counted = _parameter_copy(n)
            if source is not None:  # a copy of a parameter made for compute: never an activation
                if not counted and isinstance(val, torch.Tensor):
                    kinds["gathered"] += activation_bytes(n, local_numel(val.shape, spec))
                continue
            if isinstance(val, torch.Tensor) and isinstance(spec, tuple) and (not spec or not isinstance(spec[0], tuple)):
                local = local_numel(val.shape, spec)
                saved = activation_bytes(n, local, region_of=region_of)
                if saved:  # one storage counts once, whichever of its aliases (views, same-dtype casts) is saved
                    base = _storage_base(n)
                    kinds["activations"] += max(0, saved - by_storage.get(base, 0))
                    by_storage[base] = max(by_storage.get(base, 0), saved)
                # its gradient, at least in fp32: losses compute in fp32 (vocab-parallel cross-entropy, HF's upcast)
                largest_activation = max(largest_activation, local * max(val.element_size(), 4))
                region = region_of(n)
                if region is not None:  # what the region saves while its backward runs, recomputed
                    regions[region] = regions.get(region, 0) + activation_bytes(n, local, region_of=_no_region)
            else:
                kinds["activations"] += activation_bytes(n)  # multi-output: at global size (an over-estimate)
    if layer_gathers:
        kinds["gathered"] += 2 * max(layer_gathers.values())  # the layer in use and the next one's prefetch
    # backward's first temporaries: the largest activation's gradient, and one recomputed region's activations
    temporaries = largest_activation + max(regions.values(), default=0)
    return MemoryBreakdown(**kinds, largest_parameter=largest, temporaries=temporaries, stages=stages)


def _regions_with_collectives(gm):
    """``node -> region`` (:data:`autoshard.meta.RECOMPUTE`) where a collective between two ops of one region counts
    in that region, as the recompute rank pass makes regions convex (the global graph marks only the model's ops)."""
    nodes = list(gm.graph.nodes)

    def is_collective(n: Node) -> bool:
        return n.op == "call_function" and M.COLLECTIVE in n.meta and bool(n.args) and isinstance(n.args[0], Node)

    up: dict[Node, str | None] = {}  # the region of the op a chain of collectives starts from
    for n in nodes:
        up[n] = recompute_region(n) or (up.get(n.args[0]) if is_collective(n) else None)
    down: dict[Node, str | None] = {}  # the one region every op a chain of collectives feeds is in
    for n in reversed(nodes):
        region = recompute_region(n)
        if region is None and is_collective(n):
            users = {down.get(u) for u in n.users}
            region = users.pop() if len(users) == 1 else None
        down[n] = region
    inferred = {n: up[n] for n in nodes if is_collective(n) and up[n] is not None and up[n] == down[n]}

    def region_of(node: Node) -> str | None:
        return recompute_region(node) or inferred.get(node)

    return region_of


_ALIAS_CASTS = ("aten.to.dtype", "aten.to.dtype_layout", "aten.type_as.default")  # (_to_copy always copies)


def _storage_base(node: Node) -> Node:
    """The node whose output ``node``'s output shares storage with: through views, and through casts to the dtype
    the tensor already has (``x.to(torch.float32)`` of a float32 ``x`` returns ``x``, as Llama's RMSNorm does)."""
    while node.op == "call_function" and node.args and isinstance(node.args[0], Node):
        src = node.args[0]
        if entry(node.target).bytes == "view":
            node = src
            continue
        val, sval = node.meta.get("val"), src.meta.get("val")
        if (str(node.target) in _ALIAS_CASTS and isinstance(val, torch.Tensor) and isinstance(sval, torch.Tensor)
                and val.dtype == sval.dtype):
            node = src
            continue
        break
    return node


def _no_region(node: Node) -> None:
    return None
