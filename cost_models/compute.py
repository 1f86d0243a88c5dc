"""Compute cost of one aten op in an FX graph: FLOPs, bytes moved, and roofline time.

Shapes come from ``node.meta["val"]`` (FakeTensors from ``torch.export``) of the node and of the nodes it reads.
FLOPs count a multiply-add as 2. The formulas are facets of each op's entry in the op registry
(:mod:`autoshard.compiler.ops`: ``flops``, ``backward``, ``backward_flops``, ``bytes``, stated once per op next to its
sharding rule, usually on the ``OpOverloadPacket`` so every overload shares them); they say:

==================================================  ==============================================  ========
op                                                  forward FLOPs                                   backward
==================================================  ==============================================  ========
mm / addmm / bmm / baddbmm / matmul / linear        2·M·N·K per batch (+ M·N for a bias)            2×
einsum (two operands)                               2·∏(sizes of every label)                       2×
convolution                                         2·numel(out)·C_in/groups·∏kernel                2×
scaled_dot_product_attention (and aten variants)    2·b·h·s_q·s_kv·(d + d_v)  (= 4·b·h·s_q·s_kv·d)  2.5×
softmax / log_softmax                               5·numel                                         1×
layer_norm / group_norm / batch_norm                8·numel                                         1×
rms_norm                                            4·numel                                         1×
reductions (sum, mean, amax, ...)                   numel(input) (var/std/logsumexp: 3·numel)       1×
cross_entropy_loss                                  5·numel(logits) + numel(target)                 1×
embedding                                           0 (it moves bytes: indices + 2·output)          numel(out)
views (view, permute, transpose, getitem, ...)      0, and 0 bytes                                  0
copies (clone, cat, _to_copy, ...)                  0 (bytes in + out)                              1×
anything else (elementwise, unknown ops)            numel(output)                                   1×
==================================================  ==============================================  ========

Backward is ≈2× forward for contractions (gradients for both operands), ≈2.5× for attention (FlashAttention's
backward recomputes the scores: 5 matmuls against 2), 1× for the rest, and 0 for ops whose outputs are not
floating point (no gradient flows). Causal attention is counted in full (the math and CPU kernels compute it).

Time, :func:`compute_time`, is the profile's per-op overhead (``op_overhead`` in forward, ``backward_op_overhead``
for an op's backward) plus a roofline of the rank's share of the work,
``max(f / (peak_flops(dtype)·eff(kind, f)), b / (mem_bandwidth·eff(memory, b)))`` with ``f = flops / shard_factor``
and ``b = bytes / shard_factor``: the FLOP peak of the dtype the op computes in (:func:`compute_dtype`: bf16 matmuls
of a mixed-precision program at the bf16 peak), ``bytes`` (:func:`bytes_accessed`) every tensor input read once
plus the output written once, and ``eff`` the achieved fraction of the peak that the profile's efficiency tables
give for the op's compute kind (the registry's ``compute_kind`` facet: matmul, attention, memory) at that size
(small matmuls run far below the peak). A profile without tables or overheads is the plain roofline.

:func:`flops_expr` runs the same formulas on symbols instead of sizes, for printing: a linear from ``[b, s, h]`` to
``n`` features gives ``2*b*h*n*s`` with ``names={2: "b", 16: "s", 64: "h", 128: "n"}``; sizes without a name
become ``d<size>`` and 1 stays 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import sympy
import torch
from torch.fx import Node

from autoshard.errors import PlanError
from autoshard.frontend.graph_utils import node_location
from autoshard.compiler.ops import OpEntry, entry

from .profile import HardwareProfile

__all__ = [
    "backward_bytes_accessed",
    "backward_flops",
    "bytes_accessed",
    "compute_dtype",
    "compute_time",
    "flops",
    "flops_expr",
    "op_work",
    "output_tensors",
    "tensor_bytes",
    "work_seconds",
]

aten = torch.ops.aten


# ---- reading shapes --------------------------------------------------------------------------------------
def _tensors(val) -> list:
    if isinstance(val, (list, tuple)):
        return [t for v in val for t in _tensors(v)]
    return [val] if isinstance(val, torch.Tensor) else []


def output_tensors(node: Node) -> list[torch.Tensor]:
    """The (fake) tensors ``node`` produces, from ``meta["val"]``; [] when it has none."""
    return _tensors(node.meta.get("val"))


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.dtype.itemsize


class _Op:
    """A node seen through its arguments' shapes; ``size`` maps each int size to an int or a symbol."""

    __slots__ = ("node", "size")

    def __init__(self, node: Node, size: Callable[[int], object] = int):
        self.node = node
        self.size = size

    def arg(self, i: int, default=None):
        args = self.node.args
        if i < len(args):
            return args[i]
        schema = getattr(self.node.target, "_schema", None)
        if schema is not None and i < len(schema.arguments):
            return self.node.kwargs.get(schema.arguments[i].name, default)
        return default

    def val(self, x):
        return x.meta.get("val") if isinstance(x, Node) else x

    def shape(self, x) -> tuple:
        """Shape of argument ``x`` (an index into the args, or a node/tensor)."""
        a = self.arg(x) if isinstance(x, int) else x
        v = self.val(a)
        if not isinstance(v, torch.Tensor):
            what = f"argument {x}" if isinstance(x, int) else "an argument"
            what += f" (`{a.name}`)" if isinstance(a, Node) else ""
            raise PlanError(f"{node_location(self.node)} has {what} without a tensor in meta['val'], but its cost "
                            "needs the shape. Trace with torch.export so every node carries meta['val'].")
        return tuple(self.size(int(d)) for d in v.shape)

    def numel(self, x) -> object:
        return math.prod(self.shape(x))

    def out_numel(self) -> object:
        return sum((math.prod(self.size(int(d)) for d in t.shape) for t in output_tensors(self.node)), 0)


# ---- the registry's cost facets --------------------------------------------------------------------------
def _entry_of(node: Node) -> OpEntry | None:
    """The op's entry (FLOPs, backward ratio, bytes mode) from :mod:`autoshard.compiler.ops`; None for non-ops."""
    if node.op != "call_function":
        return None
    return entry(node.target)


def _has_gradient(node: Node) -> bool:
    return any(t.dtype.is_floating_point or t.dtype.is_complex for t in output_tensors(node))


# ---- public entry points ---------------------------------------------------------------------------------
def flops(node: Node) -> int:
    """Forward FLOPs of ``node`` at its full (global) shapes; 0 for placeholders, get_attr and output."""
    e = _entry_of(node)
    return 0 if e is None else int(e.flops(_Op(node)))


def backward_flops(node: Node) -> int:
    """FLOPs of ``node``'s backward (see the module table); 0 when its outputs carry no gradient."""
    e = _entry_of(node)
    if e is None or not _has_gradient(node):
        return 0
    if e.backward_flops is not None:
        return int(e.backward_flops(_Op(node)))
    return round(e.backward * e.flops(_Op(node)))


def flops_at(node: Node, size: Callable[[int], float]) -> tuple[float, float]:
    """(forward, backward) FLOPs of ``node`` with each of its sizes ``s`` read as ``size(s)`` (a smaller microbatch:
    ``s / m`` for the batch), backward 0 where its outputs carry no gradient; (0, 0) for non-ops and for an op whose
    FLOPs formula needs integer sizes (so a sum of these bounds the work from below)."""
    e = _entry_of(node)
    if e is None:
        return 0.0, 0.0
    op = _Op(node, size)
    try:
        f = float(e.flops(op))
        b = float(e.backward_flops(op)) if e.backward_flops is not None else e.backward * f
    except (TypeError, ValueError):
        return 0.0, 0.0
    return f, (b if _has_gradient(node) else 0.0)


def bytes_accessed(node: Node) -> int:
    """Bytes ``node`` reads and writes in the forward: each distinct tensor input once plus its outputs;
    0 for views; indices + 2·output for embedding (only the looked-up rows are read)."""
    e = _entry_of(node)
    if e is None or e.bytes == "view":
        return 0
    out = sum(tensor_bytes(t) for t in output_tensors(node))
    if e.bytes == "embedding":
        indices = _Op(node).arg(1)
        return 2 * out + sum(tensor_bytes(t) for t in _tensors(getattr(indices, "meta", {}).get("val")))
    return out + sum(tensor_bytes(t) for x in node.all_input_nodes for t in _tensors(x.meta.get("val")))


def backward_bytes_accessed(node: Node) -> int:
    """Bytes of ``node``'s backward: the forward bytes scaled like its FLOPs (at least 1×); 0 without gradient."""
    e = _entry_of(node)
    if e is None or e.backward == 0 or not _has_gradient(node):
        return 0
    return round(max(e.backward, 1.0) * bytes_accessed(node))


def compute_time(node: Node, profile: HardwareProfile, shard_factor: float = 1, *, backward: bool = False) -> float:
    """Seconds of ``node`` (its backward when ``backward``) on one rank when the planner splits it ``shard_factor``
    ways: the profile's per-op overhead plus the roofline of the rank's share,
    ``max(flops / (peak(dtype)·eff), bytes / (mem_bandwidth·eff_memory))`` with the achieved fractions of the peak
    read from the profile's efficiency tables at the rank's work (:meth:`HardwareProfile.efficiency_for`)."""
    if not shard_factor > 0:
        raise PlanError(f"compute_time got shard_factor={shard_factor!r} for {node_location(node)}, but the "
                        "shard factor is the number of ways the op is split, >= 1.")
    return work_seconds(op_work(node, backward), profile, shard_factor)


def op_work(node: Node, backward: bool = False) -> tuple:
    """What :func:`work_seconds` prices, computed once per node: ``(runs, flops, bytes, compute kind, dtype)``;
    ``runs`` is ``"forward"`` or ``"backward"`` for an op that runs (it pays the profile's per-op overhead), None
    for placeholders, outputs and a backward that does not run (no gradient flows)."""
    e = _entry_of(node)
    if e is None or (backward and not _has_gradient(node)):
        return (None, 0, 0, "memory", torch.float32)
    if backward:
        return ("backward", backward_flops(node), backward_bytes_accessed(node), e.compute_kind, compute_dtype(node))
    return ("forward", flops(node), bytes_accessed(node), e.compute_kind, compute_dtype(node))


def work_seconds(work: tuple, profile: HardwareProfile, shard_factor: float = 1) -> float:
    """Seconds of :func:`op_work`'s ``work`` split ``shard_factor`` ways (see :func:`compute_time`)."""
    runs, f, by, kind, dtype = work
    if runs is None:
        return 0.0
    overhead = profile.op_overhead if runs == "forward" else profile.backward_op_overhead
    f, by = f / shard_factor, by / shard_factor
    t_flops = f / (profile.flops_for(dtype) * profile.efficiency_for(kind, dtype, f, runs == "backward")) if f else 0.0
    t_bytes = by / (profile.mem_bandwidth * profile.efficiency_for("memory", dtype, by)) if by else 0.0
    return overhead + max(t_flops, t_bytes)


def compute_dtype(node: Node) -> torch.dtype:
    """The dtype ``node`` computes in, which picks the FLOP peak of the profile: its first floating tensor input
    (a matmul's operands; a cast computes nothing), else its first floating output, else float32."""
    inputs = [x.meta.get("val") for x in node.all_input_nodes]
    for v in (*inputs, *output_tensors(node)):
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.dtype
    return torch.float32


def flops_expr(node: Node, names: Mapping[int, str] | None = None) -> sympy.Expr:
    """Forward FLOPs of ``node`` as a sympy expression of its sizes: each size ``s`` becomes the symbol
    ``names[s]`` or ``d<s>`` (sizes that are equal share a symbol; 1 stays 1). Substituting the sizes back
    gives :func:`flops`."""
    e = _entry_of(node)
    if e is None:
        return sympy.Integer(0)
    names = names or {}

    def size(s: int):
        if s == 1:
            return sympy.Integer(1)
        return sympy.Symbol(names.get(s, f"d{s}"), positive=True, integer=True)

    return sympy.sympify(e.flops(_Op(node, size)))
