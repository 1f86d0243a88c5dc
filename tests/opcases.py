"""Op test cases for ``tests/test_rules.py``: one tiny module per case, each reaching one aten op of the rule table.

A case names the op under test (the first node with that target in the traced graph, or the ``occurrence``-th),
a function ``fn(module, *inputs)`` that calls it, its example inputs and its parameters. Float inputs and
parameters require grad, so both the forward and the backward of every strategy are checked; integer indices,
targets and boolean masks are plain inputs.

Operands that a strategy may need ``Partial`` are graph *inputs* in at least one case of every linear op (an
input can be annotated ``Partial()``; a parameter cannot usefully be Partial, see ``test_rules.py``). Shapes are
small and every dim a strategy may shard is even, so both the 1-D and the 2x2 mesh have something to split;
distinct sizes per dim catch transposed layouts.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

aten = torch.ops.aten


# ---------------------------------------------------------------------------------------------------------
# Example values
# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Float:
    """A float tensor with values in N(0, 1), or in [0.5, 1.5) when ``positive`` (rsqrt, log, division)."""

    shape: tuple[int, ...]
    positive: bool = False
    grad: bool = True
    dtype: torch.dtype = torch.float32
    scale: float = 1.0
    zeros: bool = False  # about a third of the values exactly 0

    def make(self, g: torch.Generator) -> torch.Tensor:
        t = torch.rand(self.shape, generator=g) + 0.5 if self.positive else torch.randn(self.shape, generator=g)
        if self.zeros:
            t = t * (torch.rand(self.shape, generator=g) > 0.33)
        return (t * self.scale).to(self.dtype).requires_grad_(self.grad)


@dataclass(frozen=True)
class Ints:
    """Integer indices/targets in ``[0, high)``; ``force`` writes given values at given flat positions (so that
    e.g. an ``ignore_index`` is present among the targets on every shard)."""

    shape: tuple[int, ...]
    high: int
    force: tuple[tuple[int, int], ...] = ()

    def make(self, g: torch.Generator) -> torch.Tensor:
        t = torch.randint(0, self.high, self.shape, generator=g)
        flat = t.view(-1)
        for pos, value in self.force:
            flat[pos] = value
        return t


@dataclass(frozen=True)
class Mask:
    """A boolean mask, about half True."""

    shape: tuple[int, ...]

    def make(self, g: torch.Generator) -> torch.Tensor:
        return torch.rand(self.shape, generator=g) > 0.5


def f(*shape: int, grad: bool = True) -> Float:
    return Float(tuple(shape), grad=grad)


def pos(*shape: int) -> Float:
    return Float(tuple(shape), positive=True)


def small(*shape: int) -> Float:
    """float64, N(0, 0.3²): sums of many products (convolutions) stay within the sweep's absolute tolerance."""
    return Float(tuple(shape), scale=0.3, dtype=torch.float64)


# ---------------------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------------------
class OpModule(nn.Module):
    """``forward(*inputs) = fn(self, *inputs)``; parameters are attributes named as in the case."""

    def __init__(self, fn: Callable, params: dict[str, torch.Tensor]):
        super().__init__()
        self.fn = fn
        for name, value in params.items():
            self.register_parameter(name, nn.Parameter(value))

    def forward(self, *inputs):
        return self.fn(self, *inputs)


@dataclass(frozen=True)
class OpCase:
    name: str
    op: object  # the aten OpOverload under test
    fn: Callable  # fn(module, *inputs)
    inputs: tuple = ()
    params: dict[str, Float] = field(default_factory=dict)
    occurrence: int = 0  # which node with target ``op`` (in graph order) is under test
    two_d: bool = True  # also sweep the 2x2 mesh

    def build(self) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        """A fresh module and example inputs, the same on every call (seeded by the case name)."""
        g = torch.Generator().manual_seed(zlib.crc32(self.name.encode()))
        params = {k: v.make(g).detach() for k, v in self.params.items()}
        args = tuple(x.make(g) for x in self.inputs)
        return OpModule(self.fn, params), args


def case(name, op, fn, *inputs, params=None, **kw) -> OpCase:
    return OpCase(name, op, fn, tuple(inputs), dict(params or {}), **kw)


CASES: list[OpCase] = [
    # ---- contractions ------------------------------------------------------------------------------------
    case("mm", aten.mm.default, lambda m, a, b: torch.mm(a, b), f(4, 8), f(8, 6)),
    case("bmm", aten.bmm.default, lambda m, a, b: torch.bmm(a, b), f(2, 4, 8), f(2, 8, 6)),
    case("linear_bias", aten.linear.default, lambda m, x: F.linear(x, m.w, m.b), f(2, 4, 8),
         params={"w": f(6, 8), "b": f(6)}),
    case("linear_loss", aten.linear.default, lambda m, x: F.linear(x, m.w, m.b).square().mean(), f(4, 8),
         params={"w": f(6, 8), "b": f(6)}),
    case("linear_nobias", aten.linear.default, lambda m, x: F.linear(x, m.w), f(4, 8), params={"w": f(6, 8)}),
    case("linear_bias_inputs", aten.linear.default, lambda m, x, w, b: F.linear(x, w, b), f(4, 8), f(6, 8), f(6)),
    case("addmm", aten.addmm.default, lambda m, b, x, w: torch.addmm(b, x, w), f(6), f(4, 8), f(8, 6)),
    case("addmm_bias2d", aten.addmm.default, lambda m, b, x, w: torch.addmm(b, x, w), f(4, 6), f(4, 8), f(8, 6)),
    case("matmul_batched", aten.matmul.default, lambda m, a, b: torch.matmul(a, b), f(2, 4, 8), f(2, 8, 6)),
    case("matmul_bcast", aten.matmul.default, lambda m, a, b: a @ b, f(2, 4, 8), f(8, 6)),
    case("matmul_size1_batch", aten.matmul.default, lambda m, a, b: a @ b, f(1, 4, 8), f(2, 8, 6)),
    case("baddbmm", aten.baddbmm.default, lambda m, b, x, y: torch.baddbmm(b, x, y), f(2, 4, 6), f(2, 4, 8),
         f(2, 8, 6)),
    # ---- elementwise, broadcasting -----------------------------------------------------------------------
    case("add_lower_rank", aten.add.Tensor, lambda m, a, b: a + b, f(4, 8), f(8)),
    case("add_size1", aten.add.Tensor, lambda m, a, b: a + b, f(4, 8), f(4, 1)),
    case("add_param", aten.add.Tensor, lambda m, a: a + m.b, f(2, 4, 8), params={"b": f(8)}),
    case("sub_bcast", aten.sub.Tensor, lambda m, a, b: a - b, f(2, 4, 8), f(1, 4, 8)),
    case("mul_bcast", aten.mul.Tensor, lambda m, a, b: a * b, f(4, 8), f(1, 8)),
    case("mul_param", aten.mul.Tensor, lambda m, a: a * m.g, f(4, 8), params={"g": f(8)}),
    case("div_bcast", aten.div.Tensor, lambda m, a, b: a / b, f(4, 8), pos(4, 1)),
    case("add_scalar", aten.add.Tensor, lambda m, a: a + 1.5, f(4, 8)),
    case("sub_scalar", aten.sub.Tensor, lambda m, a: a - 0.5, f(4, 8)),
    case("mul_scalar", aten.mul.Tensor, lambda m, a: a * 2.5, f(4, 8)),
    case("div_scalar", aten.div.Tensor, lambda m, a: a / 4.0, f(4, 8)),
    case("rsub_scalar", aten.rsub.Scalar, lambda m, a: 1.0 - a, f(4, 8)),
    case("neg", aten.neg.default, lambda m, a: -a, f(4, 8)),
    case("to_dtype", aten.to.dtype, lambda m, a: a.to(torch.float64), f(4, 8)),
    case("to_int", aten.to.dtype, lambda m, a: a.to(torch.int32), Float((4, 8), grad=False, scale=3.0)),
    case("to_bool", aten.to.dtype, lambda m, a: a.to(torch.bool), Float((4, 8), grad=False, zeros=True)),
    case("type_as_int", aten.type_as.default, lambda m, a, b: a.type_as(b), Float((4, 8), grad=False, scale=3.0),
         Ints((4, 8), 3)),
    case("gelu", aten.gelu.default, lambda m, a: F.gelu(a), f(4, 8)),
    case("silu", aten.silu.default, lambda m, a: F.silu(a), f(4, 8)),
    case("relu", aten.relu.default, lambda m, a: torch.relu(a), f(4, 8)),
    case("tanh", aten.tanh.default, lambda m, a: torch.tanh(a), f(4, 8)),
    case("exp", aten.exp.default, lambda m, a: torch.exp(a), f(4, 8)),
    case("rsqrt", aten.rsqrt.default, lambda m, a: torch.rsqrt(a), pos(4, 8)),
    case("pow", aten.pow.Tensor_Scalar, lambda m, a: a.pow(3), f(4, 8)),
    case("gt", aten.gt.Tensor, lambda m, a, b: a > b, f(4, 8, grad=False), f(8, grad=False)),
    case("where", aten.where.self, lambda m, c, a, b: torch.where(c, a, b), Mask((4, 8)), f(4, 8), f(1, 8)),
    case("where_of_compare", aten.where.self, lambda m, a, b: torch.where(a > 0, a, b), f(4, 8), f(4, 8)),
    case("masked_fill", aten.masked_fill.Scalar, lambda m, a, c: a.masked_fill(c, -2.0), f(4, 8), Mask((1, 8))),
    # ---- more pointwise ops of the table (1-D mesh; the 2x2 sweep adds nothing for one-input maps) -----
    *[case(name, op, fn, x, two_d=False) for name, op, fn, x in [
        ("sigmoid", aten.sigmoid.default, lambda m, a: torch.sigmoid(a), f(4, 8)),
        ("log", aten.log.default, lambda m, a: torch.log(a), pos(4, 8)),
        ("sqrt", aten.sqrt.default, lambda m, a: torch.sqrt(a), pos(4, 8)),
        ("cos", aten.cos.default, lambda m, a: torch.cos(a), f(4, 8)),
        ("sin", aten.sin.default, lambda m, a: torch.sin(a), f(4, 8)),
        ("abs", aten.abs.default, lambda m, a: torch.abs(a), f(4, 8)),
        ("square", aten.square.default, lambda m, a: torch.square(a), f(4, 8)),
        ("reciprocal", aten.reciprocal.default, lambda m, a: torch.reciprocal(a), pos(4, 8)),
        ("erf", aten.erf.default, lambda m, a: torch.erf(a), f(4, 8)),
        ("clamp", aten.clamp.default, lambda m, a: a.clamp(-0.5, 0.5), f(4, 8)),
        ("clone", aten.clone.default, lambda m, a: a.clone(), f(4, 8)),
        ("alias", aten.alias.default, lambda m, a: a[:, :], f(4, 8)),
        ("detach", aten.detach.default, lambda m, a: a.detach() * 1.0, f(4, 8, grad=False)),
        ("to_device", aten.to.device, lambda m, a: a.to("cpu", torch.float64), f(4, 8)),
        ("dropout_p0", aten.dropout.default, lambda m, a: F.dropout(a, 0.0), f(4, 8)),
        ("lt_scalar", aten.lt.Scalar, lambda m, a: a < 0.25, f(4, 8, grad=False)),
        ("logical_not", aten.logical_not.default, lambda m, c: torch.logical_not(c), Mask((4, 8))),
    ]],
    *[case(name, op, fn, x, two_d=False) for name, op, fn, x in [
        ("add_Scalar", aten.add.Scalar, lambda m, a: aten.add.Scalar(a, 1.5), f(4, 8)),
        ("sub_Scalar", aten.sub.Scalar, lambda m, a: aten.sub.Scalar(a, 1.5), f(4, 8)),
        ("mul_Scalar", aten.mul.Scalar, lambda m, a: aten.mul.Scalar(a, 1.5), f(4, 8)),
        ("div_Scalar", aten.div.Scalar, lambda m, a: aten.div.Scalar(a, 1.5), f(4, 8)),
        ("contiguous", aten.contiguous.default, lambda m, a: aten.contiguous.default(a), f(4, 8)),
        ("lift_fresh_copy", aten.lift_fresh_copy.default, lambda m, a: aten.lift_fresh_copy.default(a),
         f(4, 8, grad=False)),
        ("_to_copy", aten._to_copy.default, lambda m, a: aten._to_copy.default(a, dtype=torch.float64), f(4, 8)),
        ("to_dtype_layout", aten.to.dtype_layout, lambda m, a: aten.to.dtype_layout(a, dtype=torch.float64),
         f(4, 8)),
        ("native_dropout_p0", aten.native_dropout.default, lambda m, a: aten.native_dropout.default(a, 0.0, True),
         f(4, 8)),
        ("eq_scalar", aten.eq.Scalar, lambda m, a: a == 1, Ints((4, 8), 3)),
        ("ne_scalar", aten.ne.Scalar, lambda m, a: a != 1, Ints((4, 8), 3)),
        ("ge_scalar", aten.ge.Scalar, lambda m, a: a >= 0.0, f(4, 8, grad=False)),
        ("gt_scalar", aten.gt.Scalar, lambda m, a: a > 0.0, f(4, 8, grad=False)),
        ("le_scalar", aten.le.Scalar, lambda m, a: a <= 0.0, f(4, 8, grad=False)),
    ]],
    case("ne_tensor", aten.ne.Tensor, lambda m, a, b: a != b, Ints((4, 8), 3), Ints((4, 1), 3)),
    case("ge_tensor", aten.ge.Tensor, lambda m, a, b: a >= b, f(4, 8, grad=False), f(8, grad=False)),
    case("lt_tensor", aten.lt.Tensor, lambda m, a, b: a < b, f(4, 8, grad=False), f(4, 8, grad=False)),
    case("bitwise_and", aten.bitwise_and.Tensor, lambda m, a, b: aten.bitwise_and.Tensor(a, b), Mask((4, 8)),
         Mask((8,))),
    case("bitwise_or", aten.bitwise_or.Tensor, lambda m, a, b: aten.bitwise_or.Tensor(a, b), Mask((4, 8)),
         Mask((4, 8))),
    case("pow_tensor", aten.pow.Tensor_Tensor, lambda m, a, b: a.pow(b), pos(4, 8), f(8)),
    case("minimum", aten.minimum.default, lambda m, a, b: torch.minimum(a, b), f(4, 8), f(4, 1)),
    case("maximum", aten.maximum.default, lambda m, a, b: torch.maximum(a, b), f(4, 8), f(8)),
    case("type_as", aten.type_as.default, lambda m, a, b: a.type_as(b), f(4, 8), Float((4, 8), grad=False,
                                                                                   dtype=torch.float64)),
    case("eq_tensor", aten.eq.Tensor, lambda m, a, b: a == b, Ints((4, 8), 3), Ints((8,), 3)),
    case("le_tensor", aten.le.Tensor, lambda m, a, b: a <= b, f(4, 8, grad=False), f(4, 1, grad=False)),
    case("and", aten.__and__.Tensor, lambda m, a, b: a & b, Mask((4, 8)), Mask((8,))),
    case("or", aten.__or__.Tensor, lambda m, a, b: a | b, Mask((4, 8)), Mask((4, 1))),
    case("logical_and", aten.logical_and.default, lambda m, a, b: torch.logical_and(a, b), Mask((4, 8)),
         Mask((4, 8))),
    case("masked_fill_tensor", aten.masked_fill.Tensor, lambda m, a, c, v: a.masked_fill(c, v), f(4, 8),
         Mask((4, 8)), f(grad=False)),
    # ---- views and data movement -------------------------------------------------------------------------
    case("view_merge", aten.view.default, lambda m, a: a.view(8, 8), f(2, 4, 8)),
    case("view_merge_inner", aten.view.default, lambda m, a: a.view(2, 32), f(2, 4, 8)),
    case("reshape_split", aten.reshape.default, lambda m, a: a.reshape(2, 4, 2, 4), f(2, 4, 8)),
    case("view_regroup", aten.view.default, lambda m, a: a.view(4, 2, 8), f(2, 4, 8)),
    case("unflatten", aten.unflatten.int, lambda m, a: a.unflatten(1, (2, 4)), f(4, 8)),
    case("_unsafe_view", aten._unsafe_view.default, lambda m, a: aten._unsafe_view.default(a, [2, 4, 8]),
         f(8, 8)),
    case("transpose", aten.transpose.int, lambda m, a: a.transpose(1, 2), f(2, 4, 8)),
    case("permute", aten.permute.default, lambda m, a: a.permute(2, 0, 1), f(2, 4, 8)),
    case("t", aten.t.default, lambda m, a: a.t(), f(4, 8)),
    case("unsqueeze", aten.unsqueeze.default, lambda m, a: a.unsqueeze(1), f(4, 8)),
    case("squeeze_dim", aten.squeeze.dim, lambda m, a: a.squeeze(1), f(4, 1, 8)),
    case("expand", aten.expand.default, lambda m, a: a.expand(4, 6, 8), f(4, 1, 8)),
    case("expand_new_dim", aten.expand.default, lambda m, a: a.expand(4, -1, 8), f(6, 8)),
    case("slice_partial", aten.slice.Tensor, lambda m, a: a[:, 2:6], f(4, 8)),
    case("slice_full", aten.slice.Tensor, lambda m, a: aten.slice.Tensor(a, 1, 0, 8), f(4, 8)),
    case("split", aten.split.Tensor, lambda m, a: a.split(4, dim=1), f(4, 8)),
    case("split_with_sizes", aten.split_with_sizes.default, lambda m, a: a.split([2, 6], dim=1), f(4, 8)),
    case("chunk", aten.chunk.default, lambda m, a: a.chunk(2, dim=-1), f(4, 8)),
    case("unbind", aten.unbind.int, lambda m, a: a.unbind(1), f(4, 2, 6)),
    case("cat", aten.cat.default, lambda m, a, b: torch.cat([a, b], dim=1), f(4, 8), f(4, 6)),
    case("stack", aten.stack.default, lambda m, a, b: torch.stack([a, b], dim=1), f(4, 8), f(4, 8)),
    case("pad", aten.pad.default, lambda m, a: F.pad(a, (1, 1)), f(4, 8)),
    case("flatten", aten.flatten.using_ints, lambda m, a: a.flatten(1), f(2, 4, 8)),
    case("squeeze_all", aten.squeeze.default, lambda m, a: a.squeeze(), f(4, 1, 8)),
    case("squeeze_dims", aten.squeeze.dims, lambda m, a: a.squeeze((1, 3)), f(4, 1, 8, 1)),
    case("broadcast_tensors", aten.broadcast_tensors.default, lambda m, a, b: torch.broadcast_tensors(a, b),
         f(4, 8), f(1, 8)),
    case("constant_pad_nd", aten.constant_pad_nd.default, lambda m, a: aten.constant_pad_nd.default(a, [0, 0, 1, 2]),
         f(4, 8)),
    # ---- reductions and scans ----------------------------------------------------------------------------
    case("sum_dim_keepdim", aten.sum.dim_IntList, lambda m, a: a.sum(1, keepdim=True), f(2, 4, 8)),
    case("sum_dims", aten.sum.dim_IntList, lambda m, a: a.sum((0, 2)), f(2, 4, 8)),
    case("sum_all", aten.sum.default, lambda m, a: a.sum(), f(4, 8)),
    case("mean_dim_keepdim", aten.mean.dim, lambda m, a: a.mean(-1, keepdim=True), f(2, 4, 8)),
    case("mean_dim", aten.mean.dim, lambda m, a: a.mean(1), f(2, 4, 8)),
    case("mean_all", aten.mean.default, lambda m, a: a.mean(), f(4, 8)),
    case("var", aten.var.correction, lambda m, a: torch.var(a, dim=1, correction=0), f(4, 8)),
    case("std_keepdim", aten.std.correction, lambda m, a: aten.std.correction(a, [0], correction=1, keepdim=True),
         f(4, 8)),
    case("amax", aten.amax.default, lambda m, a: a.amax(-1), f(4, 8)),
    case("amax_keepdim", aten.amax.default, lambda m, a: a.amax(0, keepdim=True), f(4, 8)),
    case("_softmax", aten._softmax.default, lambda m, a: aten._softmax.default(a, -1, False), f(2, 4, 8)),
    case("_log_softmax", aten._log_softmax.default, lambda m, a: aten._log_softmax.default(a, 1, False),
         f(2, 4, 8)),
    case("softmax", aten.softmax.int, lambda m, a: a.softmax(-1), f(2, 4, 8)),
    case("log_softmax", aten.log_softmax.int, lambda m, a: F.log_softmax(a, dim=1), f(2, 4, 8)),
    case("cumsum", aten.cumsum.default, lambda m, a: a.cumsum(1), f(4, 8)),
    case("amin", aten.amin.default, lambda m, a: a.amin(1), f(4, 8)),
    case("argmax", aten.argmax.default, lambda m, a: a.argmax(1), f(4, 8, grad=False)),
    case("argmin", aten.argmin.default, lambda m, a: a.argmin(0), f(4, 8, grad=False)),
    case("max_dim", aten.max.dim, lambda m, a: tuple(a.max(1)), f(4, 8)),
    case("min_dim", aten.min.dim, lambda m, a: tuple(a.min(0, keepdim=True)), f(4, 8)),
    case("logsumexp", aten.logsumexp.default, lambda m, a: a.logsumexp(1), f(2, 4, 8)),
    case("topk", aten.topk.default, lambda m, a: tuple(a.topk(3, dim=1)), f(4, 8)),
    case("sort", aten.sort.default, lambda m, a: tuple(a.sort(dim=0)), f(4, 8)),
    # ---- ops the table runs whole, and factories ---------------------------------------------------------
    case("diff", aten.diff.default, lambda m, a: torch.diff(a, dim=1), f(4, 8)),
    case("index", aten.index.Tensor, lambda m, a, i: a[i], f(4, 8), Ints((6,), 4)),
    case("index_select", aten.index_select.default, lambda m, a, i: a.index_select(1, i), f(4, 8), Ints((6,), 8)),
    case("gather", aten.gather.default, lambda m, a, i: a.gather(1, i), f(4, 8), Ints((4, 2), 8)),
    case("triu", aten.triu.default, lambda m, a: torch.triu(a, 1), f(4, 8)),
    case("arange_end", aten.arange.default, lambda m, a: a * torch.arange(8), f(4, 8)),
    case("arange_start", aten.arange.start, lambda m, a: a * torch.arange(1, 9), f(4, 8)),
    case("zeros", aten.zeros.default, lambda m, a: a + torch.zeros(8), f(4, 8)),
    case("scalar_tensor", aten.scalar_tensor.default, lambda m, a: a * aten.scalar_tensor.default(2.0), f(4, 8)),
    case("full_like", aten.full_like.default, lambda m, a: torch.full_like(a, 2.0) * a, f(4, 8)),
    case("ones_like", aten.ones_like.default, lambda m, a: torch.ones_like(a) + a, f(4, 8)),
    case("new_zeros", aten.new_zeros.default, lambda m, a: a.new_zeros(8) + a, f(4, 8)),
    case("new_full", aten.new_full.default, lambda m, a: a.new_full((4, 1), 2.0) * a, f(4, 8)),
    case("tril", aten.tril.default, lambda m, a: torch.tril(a), f(4, 8)),
    case("arange", aten.arange.start_step, lambda m, a: a * torch.arange(0, 16, 2), f(4, 8)),
    case("full", aten.full.default, lambda m, a: a + torch.full((4, 8), 0.5), f(4, 8)),
    case("ones", aten.ones.default, lambda m, a: a + torch.ones(8), f(4, 8)),
    case("zeros_like", aten.zeros_like.default, lambda m, a: torch.zeros_like(a) + a, f(4, 8)),
    case("new_ones", aten.new_ones.default, lambda m, a: a * a.new_ones(8), f(4, 8)),
    # ---- normalisation, embedding, attention -------------------------------------------------------------
    case("layer_norm", aten.layer_norm.default, lambda m, a: F.layer_norm(a, (8,), m.w, m.b), f(2, 4, 8),
         params={"w": f(8), "b": f(8)}),
    case("layer_norm_2d", aten.layer_norm.default, lambda m, a: F.layer_norm(a, (4, 8)), f(2, 4, 8)),
    case("rms_norm", aten.rms_norm.default, lambda m, a: F.rms_norm(a, (8,), m.w), f(2, 4, 8),
         params={"w": f(8)}),
    case("embedding", aten.embedding.default, lambda m, i: F.embedding(i, m.w), Ints((4, 6), 16),
         params={"w": f(16, 8)}),
    case("embedding_input", aten.embedding.default, lambda m, w, i: F.embedding(i, w), f(16, 8),
         Ints((4, 6), 16)),
    case("embedding_padding", aten.embedding.default, lambda m, i: F.embedding(i, m.w, padding_idx=3),
         Ints((4, 6), 16, ((0, 3), (7, 3), (20, 3))), params={"w": f(16, 8)}),
    case("sdpa", aten.scaled_dot_product_attention.default,
         lambda m, q, k, v: F.scaled_dot_product_attention(q, k, v), f(2, 4, 8, 4), f(2, 4, 6, 4),
         f(2, 4, 6, 4)),
    case("sdpa_causal", aten.scaled_dot_product_attention.default,
         lambda m, q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), f(2, 4, 8, 4),
         f(2, 4, 8, 4), f(2, 4, 8, 4)),
    case("sdpa_mask", aten.scaled_dot_product_attention.default,
         lambda m, q, k, v, mask: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), f(2, 4, 8, 4),
         f(2, 4, 6, 4), f(2, 4, 6, 4), f(8, 6)),
    case("sdpa_bool_mask", aten.scaled_dot_product_attention.default,
         lambda m, q, k, v, mask: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), f(2, 4, 8, 4),
         f(2, 4, 6, 4), f(2, 4, 6, 4), Mask((2, 1, 8, 6))),
    # ---- op coverage (issue "Any model"): activations, rounding, logic, scalar forms ------------------------
    *[case(name, op, fn, x, two_d=False) for name, op, fn, x in [
        ("softplus", aten.softplus.default, lambda m, a: F.softplus(a), f(4, 8)),
        ("hardtanh", aten.hardtanh.default, lambda m, a: F.hardtanh(a, -0.5, 0.5), f(4, 8)),
        ("relu6", aten.relu6.default, lambda m, a: F.relu6(a * 4), f(4, 8)),
        ("hardsigmoid", aten.hardsigmoid.default, lambda m, a: F.hardsigmoid(a), f(4, 8)),
        ("hardswish", aten.hardswish.default, lambda m, a: F.hardswish(a), f(4, 8)),
        ("elu", aten.elu.default, lambda m, a: F.elu(a), f(4, 8)),
        ("selu", aten.selu.default, lambda m, a: F.selu(a), f(4, 8)),
        ("celu", aten.celu.default, lambda m, a: F.celu(a), f(4, 8)),
        ("leaky_relu", aten.leaky_relu.default, lambda m, a: F.leaky_relu(a, 0.1), f(4, 8)),
        ("mish", aten.mish.default, lambda m, a: F.mish(a), f(4, 8)),
        ("log_sigmoid", aten.log_sigmoid.default, lambda m, a: F.logsigmoid(a), f(4, 8)),
        ("log1p", aten.log1p.default, lambda m, a: torch.log1p(a), pos(4, 8)),
        ("expm1", aten.expm1.default, lambda m, a: torch.expm1(a), f(4, 8)),
        ("tan", aten.tan.default, lambda m, a: torch.tan(a * 0.5), f(4, 8)),
        ("atan", aten.atan.default, lambda m, a: torch.atan(a), f(4, 8)),
        ("sign", aten.sign.default, lambda m, a: torch.sign(a), f(4, 8)),
        ("floor", aten.floor.default, lambda m, a: torch.floor(a * 3), f(4, 8)),
        ("ceil", aten.ceil.default, lambda m, a: torch.ceil(a * 3), f(4, 8)),
        ("round", aten.round.default, lambda m, a: torch.round(a * 3), f(4, 8)),
        ("trunc", aten.trunc.default, lambda m, a: torch.trunc(a * 3), f(4, 8)),
        ("isnan", aten.isnan.default, lambda m, a: torch.isnan(a), f(4, 8, grad=False)),
        ("isinf", aten.isinf.default, lambda m, a: torch.isinf(a), f(4, 8, grad=False)),
        ("nan_to_num", aten.nan_to_num.default, lambda m, a: torch.nan_to_num(a), f(4, 8)),
        ("bitwise_not", aten.bitwise_not.default, lambda m, c: ~c, Mask((4, 8))),
        ("clamp_min", aten.clamp_min.default, lambda m, a: aten.clamp_min.default(a, 0.1), f(4, 8)),
        ("clamp_max", aten.clamp_max.default, lambda m, a: aten.clamp_max.default(a, 0.1), f(4, 8)),
        ("floor_divide_scalar", aten.floor_divide.Scalar, lambda m, a: aten.floor_divide.Scalar(a, 3),
         Ints((4, 8), 20)),
        ("remainder_scalar", aten.remainder.Scalar, lambda m, a: torch.remainder(a, 0.7), f(4, 8)),
        ("fmod_scalar", aten.fmod.Scalar, lambda m, a: torch.fmod(a, 0.7), f(4, 8)),
        ("fill_scalar", aten.fill.Scalar, lambda m, a: aten.fill.Scalar(a, 2.0) * a, f(4, 8)),
        ("where_scalar_other", aten.where.ScalarOther, lambda m, a: torch.where(a > 0, a, 0.5), f(4, 8)),
        ("where_scalar_self", aten.where.ScalarSelf, lambda m, a: torch.where(a > 0, 0.5, a), f(4, 8)),
        ("where_scalar", aten.where.Scalar, lambda m, c: aten.where.Scalar(c, 1.0, 0.0), Mask((4, 8))),
        ("lerp_scalar", aten.lerp.Scalar, lambda m, a: torch.lerp(a, a.square(), 0.3), f(4, 8)),
    ]],
    case("min_other", aten.min.other, lambda m, a, b: torch.min(a, b), f(4, 8), f(8)),
    case("max_other", aten.max.other, lambda m, a, b: torch.max(a, b), f(4, 8), f(4, 1)),
    case("clamp_tensor", aten.clamp.Tensor, lambda m, a, lo: torch.clamp(a, lo, lo + 1), f(4, 8), f(8)),
    case("clamp_min_tensor", aten.clamp_min.Tensor, lambda m, a, lo: aten.clamp_min.Tensor(a, lo), f(4, 8), f(8)),
    case("clamp_max_tensor", aten.clamp_max.Tensor, lambda m, a, hi: aten.clamp_max.Tensor(a, hi), f(4, 8),
         f(4, 1)),
    case("bitwise_xor", aten.bitwise_xor.Tensor, lambda m, a, b: aten.bitwise_xor.Tensor(a, b), Mask((4, 8)),
         Mask((8,))),
    case("logical_or", aten.logical_or.default, lambda m, a, b: torch.logical_or(a, b), Mask((4, 8)), Mask((4, 8))),
    case("logical_xor", aten.logical_xor.default, lambda m, a, b: torch.logical_xor(a, b), Mask((4, 8)),
         Mask((8,))),
    case("floor_divide", aten.floor_divide.default, lambda m, a, b: torch.floor_divide(a, b), Ints((4, 8), 20),
         Ints((8,), 3, tuple((i, 2) for i in range(8)))),
    case("remainder", aten.remainder.Tensor, lambda m, a, b: torch.remainder(a, b), f(4, 8), pos(8)),
    case("fmod", aten.fmod.Tensor, lambda m, a, b: torch.fmod(a, b), f(4, 8), pos(4, 1)),
    case("fill_tensor", aten.fill.Tensor, lambda m, a, v: aten.fill.Tensor(a, v) * a, f(4, 8), f(grad=False)),
    case("lerp_tensor", aten.lerp.Tensor, lambda m, a, b, w: torch.lerp(a, b, w), f(4, 8), f(4, 8),
         Float((8,), positive=True, grad=False)),
    case("copy", aten.copy.default, lambda m, d, s: aten.copy.default(d, s), f(4, 8, grad=False), f(8, grad=False)),
    case("copy_int", aten.copy.default, lambda m, d, s: aten.copy.default(d, s), Ints((4, 8), 3),
         Float((4, 8), grad=False, scale=3.0)),
    # ---- views, scatters into views, repeats, roll, flip ----------------------------------------------------
    case("select", aten.select.int, lambda m, a: a[:, 1], f(4, 6, 8)),
    case("select_neg", aten.select.int, lambda m, a: a.select(-1, 3), f(4, 6, 8)),
    case("select_scatter", aten.select_scatter.default,
         lambda m, a, b: torch.select_scatter(a, b, 1, 2), f(4, 6, 8), f(4, 8)),
    case("slice_scatter", aten.slice_scatter.default,
         lambda m, a, b: torch.slice_scatter(a, b, 1, 2, 6), f(4, 8, 6), f(4, 4, 6)),
    case("repeat", aten.repeat.default, lambda m, a: a.repeat(2, 1, 1), f(4, 8)),
    case("repeat_inner", aten.repeat.default, lambda m, a: a.repeat(1, 2), f(4, 8)),
    case("repeat_interleave", aten.repeat_interleave.self_int, lambda m, a: a.repeat_interleave(2, dim=1),
         f(4, 6, 8)),
    case("repeat_interleave_flat", aten.repeat_interleave.self_int, lambda m, a: a.repeat_interleave(2), f(4, 8)),
    case("repeat_interleave_tensor", aten.repeat_interleave.self_Tensor,
         lambda m, a: aten.repeat_interleave.self_Tensor(a, torch.tensor([1, 2, 1, 2, 1, 2]), 1, output_size=9),
         f(4, 6, 8)),
    case("roll", aten.roll.default, lambda m, a: a.roll(2, 1), f(4, 8)),
    case("roll_flat", aten.roll.default, lambda m, a: a.roll(3), f(4, 8)),
    case("flip", aten.flip.default, lambda m, a: a.flip(1), f(4, 6, 8)),
    # ---- scans, histograms, writes through indices ----------------------------------------------------------
    case("cumprod", aten.cumprod.default, lambda m, a: a.cumprod(1), pos(4, 8)),
    case("cummax", aten.cummax.default, lambda m, a: tuple(a.cummax(0)), f(4, 8)),
    case("cummin", aten.cummin.default, lambda m, a: tuple(a.cummin(1)), f(4, 8)),
    case("logcumsumexp", aten.logcumsumexp.default, lambda m, a: a.logcumsumexp(1), f(4, 8)),
    case("histc", aten.histc.default, lambda m, a: torch.histc(a, 4, -1.0, 1.0), f(4, 8, grad=False)),
    case("index_put", aten.index_put.default,
         lambda m, a, i, v: aten.index_put.default(a, [i], v), f(8, 6), Ints((4,), 8, ((0, 0), (1, 1), (2, 2),
                                                                                      (3, 3))), f(4, 6)),
    case("index_put_accumulate", aten.index_put.default,
         lambda m, a, i, v: aten.index_put.default(a, [i], v, True), f(8, 6), Ints((4,), 8), f(4, 6)),
    case("index_put_scalar", aten.index_put.default,
         lambda m, a, i: aten.index_put.default(a, [i], torch.tensor(0.5)), f(8, 6), Ints((4,), 8)),
    case("scatter_add", aten.scatter_add.default, lambda m, a, i, s: a.scatter_add(1, i, s), f(4, 8),
         Ints((4, 8), 8), f(4, 8)),
    case("scatter_src", aten.scatter.src, lambda m, a, i, s: a.scatter(1, i, s), f(4, 8),
         Ints((4, 8), 8, tuple((i, i % 8) for i in range(32))), f(4, 8)),
    case("scatter_small_index", aten.scatter_add.default, lambda m, a, i, s: a.scatter_add(0, i, s), f(4, 8),
         Ints((2, 8), 4), f(2, 8)),
    case("scatter_value", aten.scatter.value, lambda m, a, i: a.scatter(1, i, 2.0), f(4, 8), Ints((4, 2), 8)),
    case("einsum", aten.einsum.default, lambda m, a, b: torch.einsum("bij,bjk->bik", a, b), f(2, 4, 8),
         f(2, 8, 6)),
    case("einsum_ellipsis", aten.einsum.default, lambda m, a, w: torch.einsum("...k,nk->...n", a, w), f(2, 4, 8),
         f(6, 8)),
    case("einsum_diagonal", aten.einsum.default, lambda m, a: torch.einsum("ii->i", a), f(4, 4)),
    # ---- convolutions and normalisations --------------------------------------------------------------------
    case("conv1d", aten.conv1d.default, lambda m, x: F.conv1d(x, m.w, m.b, padding=1), small(2, 4, 6),
         params={"w": small(6, 4, 3), "b": small(6)}),
    case("conv2d", aten.conv2d.default, lambda m, x, w, b: F.conv2d(x, w, b), small(2, 4, 5, 5), small(6, 4, 3, 3),
         small(6)),
    case("conv2d_nobias", aten.conv2d.default, lambda m, x: F.conv2d(x, m.w, stride=2), small(2, 4, 6, 6),
         params={"w": small(6, 4, 3, 3)}),
    case("conv2d_depthwise", aten.conv2d.default, lambda m, x: F.conv2d(x, m.w, m.b, padding=1, groups=4),
         small(2, 4, 4, 4), params={"w": small(8, 1, 3, 3), "b": small(8)}),
    case("conv2d_groups", aten.conv2d.default, lambda m, x: F.conv2d(x, m.w, groups=2), small(2, 4, 4, 4),
         params={"w": small(6, 2, 3, 3)}),
    case("conv3d", aten.conv3d.default, lambda m, x: F.conv3d(x, m.w, m.b), small(2, 2, 4, 4, 4),
         params={"w": small(4, 2, 3, 3, 3), "b": small(4)}),
    case("conv1d_same", aten.conv1d.padding, lambda m, x: F.conv1d(x, m.w, None, 1, "same"), small(2, 4, 6),
         params={"w": small(6, 4, 3)}),
    case("conv2d_same", aten.conv2d.padding, lambda m, x: F.conv2d(x, m.w, m.b, 1, "same"), small(2, 4, 4, 4),
         params={"w": small(6, 4, 3, 3), "b": small(6)}),
    case("conv3d_same", aten.conv3d.padding, lambda m, x: F.conv3d(x, m.w, None, 1, "same"), small(2, 2, 4, 4, 4),
         params={"w": small(4, 2, 3, 3, 3)}),
    case("convolution", aten.convolution.default,
         lambda m, x: aten.convolution.default(x, m.w, m.b, [1], [1], [1], False, [0], 1), small(2, 4, 6),
         params={"w": small(6, 4, 3), "b": small(6)}),
    case("convolution_transposed", aten.convolution.default,
         lambda m, x: aten.convolution.default(x, m.w, m.b, [1], [0], [1], True, [0], 1), small(2, 4, 6),
         params={"w": small(4, 6, 3), "b": small(6)}),
    case("batch_norm_train", aten.batch_norm.default,
         lambda m, x, rm, rv: F.batch_norm(x, rm, rv, m.w, m.b, training=True), f(4, 6, 3, 3),
         Float((6,), grad=False), Float((6,), positive=True, grad=False), params={"w": f(6), "b": f(6)}),
    case("batch_norm_eval", aten.batch_norm.default,
         lambda m, x, rm, rv: F.batch_norm(x, rm, rv, m.w, m.b, training=False), f(4, 6, 4),
         Float((6,), grad=False), Float((6,), positive=True, grad=False), params={"w": f(6), "b": f(6)}),
    case("batch_norm_no_stats", aten.batch_norm.default, lambda m, x: F.batch_norm(x, None, None, training=True),
         f(4, 6)),
    case("instance_norm", aten.instance_norm.default, lambda m, x: F.instance_norm(x, weight=m.w, bias=m.b),
         f(4, 6, 5), params={"w": f(6), "b": f(6)}),
    case("group_norm", aten.group_norm.default, lambda m, x: F.group_norm(x, 2, m.w, m.b), f(4, 6, 5),
         params={"w": f(6), "b": f(6)}),
    # ---- losses ------------------------------------------------------------------------------------------
    case("cross_entropy_mean", aten.cross_entropy_loss.default,
         lambda m, x, t: F.cross_entropy(x, t, ignore_index=2), f(8, 6), Ints((8,), 6, ((0, 2), (5, 2), (6, 2)))),
    case("cross_entropy_sum", aten.cross_entropy_loss.default,
         lambda m, x, t: F.cross_entropy(x, t, reduction="sum"), f(8, 6), Ints((8,), 6)),
    case("cross_entropy_none", aten.cross_entropy_loss.default,
         lambda m, x, t: F.cross_entropy(x, t, reduction="none"), f(8, 6), Ints((8,), 6)),
    case("cross_entropy_3d", aten.cross_entropy_loss.default,
         lambda m, x, t: F.cross_entropy(x, t, ignore_index=0), f(2, 6, 4), Ints((2, 4), 6, ((1, 0),))),
    case("cross_entropy_weight", aten.cross_entropy_loss.default,
         lambda m, x, t, w: F.cross_entropy(x, t, weight=w, ignore_index=2), f(8, 6),
         Ints((8,), 6, ((0, 2), (5, 2))), Float((6,), positive=True, grad=False)),
    case("cross_entropy_smoothing", aten.cross_entropy_loss.default,
         lambda m, x, t: F.cross_entropy(x, t, ignore_index=2, label_smoothing=0.1), f(8, 6),
         Ints((8,), 6, ((0, 2), (5, 2), (6, 2)))),
    case("nll_loss_default", aten.nll_loss.default, lambda m, x, t: aten.nll_loss.default(x, t), f(8, 6),
         Ints((8,), 6)),
    case("nll_loss", aten.nll_loss_nd.default, lambda m, x, t: F.nll_loss(x, t), f(8, 6), Ints((8,), 6)),
    case("mse_loss", aten.mse_loss.default, lambda m, x, y: F.mse_loss(x, y), f(4, 8), f(4, 8)),
    case("l1_loss", aten.l1_loss.default, lambda m, x, y: F.l1_loss(x, y), f(4, 8), f(4, 8)),
    case("mse_loss_sum", aten.mse_loss.default, lambda m, x, y: F.mse_loss(x, y, reduction="sum"), f(4, 8),
         f(4, 8)),
]

BY_NAME = {c.name: c for c in CASES}
assert len(BY_NAME) == len(CASES), "case names must be unique"
