"""Compute cost of one aten op in an FX graph: FLOPs, bytes moved, and roofline time.

Shapes come from ``node.meta["val"]`` (FakeTensors from ``torch.export``) of the node and of the nodes it reads.
FLOPs count a multiply-add as 2. One table, :data:`RULES`, keyed by ``OpOverloadPacket`` (so every overload of an
op shares its rule), says for each op:

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

Time is a roofline, :func:`compute_time`: ``max(flops / peak_flops, bytes / mem_bandwidth) / shard_factor``, where
``bytes`` (:func:`bytes_accessed`) is every tensor input read once plus the output written once.

:func:`flops_expr` runs the same rules on symbols instead of sizes, for printing: a linear from ``[b, s, h]`` to
``n`` features gives ``2*b*h*n*s`` with ``names={2: "b", 16: "s", 64: "h", 128: "n"}``; sizes without a name
become ``d<size>`` and 1 stays 1.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import sympy
import torch
from torch.fx import Node

from autoshard.errors import PlanError
from autoshard.graph_utils import node_location

from .profile import HardwareProfile

__all__ = [
    "RULES",
    "backward_bytes_accessed",
    "backward_flops",
    "bytes_accessed",
    "compute_time",
    "flops",
    "flops_expr",
    "output_tensors",
    "tensor_bytes",
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


# ---- the rule table --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rule:
    """Cost of one op: forward FLOPs, the backward/forward ratio, and how bytes are counted."""

    flops: Callable[[_Op], object]
    backward: float = 1.0
    #: "io" (inputs + output), "view" (0 bytes), "embedding" (indices + 2·output)
    bytes: str = "io"
    #: backward FLOPs when they are not ``backward × forward`` (embedding: a scatter-add of the output).
    backward_flops: Callable[[_Op], object] | None = None


RULES: dict[object, Rule] = {}


def _rule(*ops, backward: float = 1.0, bytes: str = "io", backward_flops=None):
    def register(fn):
        for op in ops:
            RULES[op] = Rule(fn, backward, bytes, backward_flops)
        return fn

    return register


def _elementwise(op: _Op):
    return op.out_numel()


@_rule(aten.mm, aten.bmm, aten.matmul, backward=2.0)
def _mm(op: _Op):
    a = op.shape(0)
    return 2 * op.out_numel() * a[-1]


@_rule(aten.addmm, aten.baddbmm, backward=2.0)
def _addmm(op: _Op):
    return 2 * op.out_numel() * op.shape(1)[-1] + op.out_numel()


@_rule(aten.linear, backward=2.0)
def _linear(op: _Op):
    bias = op.out_numel() if op.arg(2) is not None else 0
    return 2 * op.out_numel() * op.shape(0)[-1] + bias


@_rule(aten.einsum, backward=2.0)
def _einsum(op: _Op):
    equation, operands = op.arg(0), op.arg(1)
    if len(operands) != 2:
        return op.out_numel()
    sizes: dict[str, object] = {}
    for term, x in zip(equation.replace(" ", "").split("->")[0].split(","), operands):
        shape = op.shape(x)
        if "..." in term:
            head, tail = term.split("...")
            labels = list(head) + [f"...{i}" for i in range(len(shape) - len(head) - len(tail))] + list(tail)
        else:
            labels = list(term)
        for label, s in zip(labels, shape):
            if not (label in sizes and s == 1):  # a broadcast 1 never replaces the real size
                sizes[label] = s
    return 2 * math.prod(sizes.values())


@_rule(aten.convolution, aten.conv1d, aten.conv2d, aten.conv3d, backward=2.0)
def _conv(op: _Op):
    w = op.shape(1)
    return 2 * op.out_numel() * math.prod(w[1:])  # w = [C_out, C_in/groups, *kernel]


@_rule(aten.scaled_dot_product_attention, aten._scaled_dot_product_flash_attention,
       aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_flash_attention_for_cpu,
       aten._scaled_dot_product_cudnn_attention, backward=2.5)
def _sdpa(op: _Op):
    q, k, v = op.shape(0), op.shape(1), op.shape(2)
    return 2 * math.prod(q[:-1]) * k[-2] * (q[-1] + v[-1])


@_rule(aten.softmax, aten._softmax, aten.log_softmax, aten._log_softmax, aten.special_softmax,
       aten.special_log_softmax)
def _softmax(op: _Op):
    return 5 * op.numel(0)


@_rule(aten.layer_norm, aten.native_layer_norm, aten.group_norm, aten.native_group_norm, aten.batch_norm,
       aten.native_batch_norm, aten._native_batch_norm_legit, aten._native_batch_norm_legit_no_training,
       aten.instance_norm)
def _norm(op: _Op):
    return 8 * op.numel(0)


@_rule(aten.rms_norm, aten._fused_rms_norm)
def _rms_norm(op: _Op):
    return 4 * op.numel(0)


@_rule(aten.sum, aten.mean, aten.amax, aten.amin, aten.max, aten.min, aten.prod, aten.argmax, aten.argmin,
       aten.any, aten.all, aten.linalg_vector_norm, aten.norm, aten.cumsum, aten.topk, aten.sort)
def _reduce(op: _Op):
    return op.numel(0)


@_rule(aten.var, aten.std, aten.var_mean, aten.std_mean, aten.logsumexp)
def _reduce3(op: _Op):
    return 3 * op.numel(0)


@_rule(aten.cross_entropy_loss)
def _cross_entropy(op: _Op):
    return 5 * op.numel(0) + op.numel(1)


@_rule(aten.nll_loss, aten.nll_loss_forward, aten.nll_loss2d_forward, aten.nll_loss_nd)
def _nll(op: _Op):
    return op.numel(1)


@_rule(aten.mse_loss, aten.l1_loss, aten.smooth_l1_loss, aten.huber_loss, aten.binary_cross_entropy,
       aten.binary_cross_entropy_with_logits, aten.kl_div)
def _pointwise_loss(op: _Op):
    return 3 * op.numel(0)


def _zero(op: _Op):
    return 0


def _embedding_backward(op: _Op):
    return op.out_numel()


_rule(aten.embedding, bytes="embedding", backward_flops=_embedding_backward)(_zero)

_rule(
    operator.getitem, aten.view, aten._unsafe_view, aten.reshape, aten.transpose, aten.t, aten.permute,
    aten.expand, aten.expand_as, aten.view_as, aten.slice, aten.select, aten.narrow, aten.unsqueeze, aten.squeeze,
    aten.split, aten.split_with_sizes, aten.chunk, aten.unbind, aten.tensor_split, aten.alias, aten.detach,
    aten.as_strided, aten.flatten, aten.unflatten, aten.movedim, aten.diagonal, aten.real, aten.view_as_real,
    aten.lift_fresh, aten._assert_tensor_metadata, aten.sym_size, aten.sym_numel, aten.sym_stride,
    backward=0.0, bytes="view",
)(_zero)

_rule(
    aten.clone, aten.contiguous, aten._to_copy, aten.to, aten.copy, aten.copy_, aten.cat, aten.stack,
    aten.index_select, aten.gather, aten.index, aten.repeat, aten.constant_pad_nd, aten.pad, aten.roll, aten.flip,
    aten.lift_fresh_copy, aten.zeros, aten.ones, aten.full, aten.empty, aten.arange, aten.zeros_like,
    aten.ones_like, aten.full_like, aten.empty_like, aten.new_zeros, aten.new_ones, aten.new_full,
    aten.new_empty, aten.scalar_tensor, aten.tril, aten.triu,
)(_zero)

_DEFAULT = Rule(_elementwise)


def _rule_of(node: Node) -> Rule | None:
    if node.op != "call_function":
        return None
    target = node.target
    return RULES.get(getattr(target, "overloadpacket", target), _DEFAULT)


def _has_gradient(node: Node) -> bool:
    return any(t.dtype.is_floating_point or t.dtype.is_complex for t in output_tensors(node))


# ---- public entry points ---------------------------------------------------------------------------------
def flops(node: Node) -> int:
    """Forward FLOPs of ``node`` at its full (global) shapes; 0 for placeholders, get_attr and output."""
    rule = _rule_of(node)
    return 0 if rule is None else int(rule.flops(_Op(node)))


def backward_flops(node: Node) -> int:
    """FLOPs of ``node``'s backward (see the module table); 0 when its outputs carry no gradient."""
    rule = _rule_of(node)
    if rule is None or not _has_gradient(node):
        return 0
    if rule.backward_flops is not None:
        return int(rule.backward_flops(_Op(node)))
    return round(rule.backward * rule.flops(_Op(node)))


def bytes_accessed(node: Node) -> int:
    """Bytes ``node`` reads and writes in the forward: each distinct tensor input once plus its outputs;
    0 for views; indices + 2·output for embedding (only the looked-up rows are read)."""
    rule = _rule_of(node)
    if rule is None or rule.bytes == "view":
        return 0
    out = sum(tensor_bytes(t) for t in output_tensors(node))
    if rule.bytes == "embedding":
        indices = _Op(node).arg(1)
        return 2 * out + sum(tensor_bytes(t) for t in _tensors(getattr(indices, "meta", {}).get("val")))
    return out + sum(tensor_bytes(t) for x in node.all_input_nodes for t in _tensors(x.meta.get("val")))


def backward_bytes_accessed(node: Node) -> int:
    """Bytes of ``node``'s backward: the forward bytes scaled like its FLOPs (at least 1×); 0 without gradient."""
    rule = _rule_of(node)
    if rule is None or rule.backward == 0 or not _has_gradient(node):
        return 0
    return round(max(rule.backward, 1.0) * bytes_accessed(node))


def compute_time(node: Node, profile: HardwareProfile, shard_factor: float = 1, *, backward: bool = False) -> float:
    """Roofline seconds of ``node`` (its backward when ``backward``): ``max(flops / peak_flops, bytes /
    mem_bandwidth) / shard_factor``, where ``shard_factor`` is how many ways the planner splits the op."""
    if not shard_factor > 0:
        raise PlanError(f"compute_time got shard_factor={shard_factor!r} for {node_location(node)}, but the "
                        "shard factor is the number of ways the op is split, >= 1.")
    f = backward_flops(node) if backward else flops(node)
    by = backward_bytes_accessed(node) if backward else bytes_accessed(node)
    return max(f / profile.peak_flops, by / profile.mem_bandwidth) / shard_factor


def flops_expr(node: Node, names: Mapping[int, str] | None = None) -> sympy.Expr:
    """Forward FLOPs of ``node`` as a sympy expression of its sizes: each size ``s`` becomes the symbol
    ``names[s]`` or ``d<s>`` (sizes that are equal share a symbol; 1 stays 1). Substituting the sizes back
    gives :func:`flops`."""
    rule = _rule_of(node)
    if rule is None:
        return sympy.Integer(0)
    names = names or {}

    def size(s: int):
        if s == 1:
            return sympy.Integer(1)
        return sympy.Symbol(names.get(s, f"d{s}"), positive=True, integer=True)

    return sympy.sympify(rule.flops(_Op(node, size)))
