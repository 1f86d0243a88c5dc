"""Elementwise ops, copies and casts: same labels in and out (broadcast aware). Linear ones let Partial flow.

Cost and saved tensors are stated per op (every overload); rules per overload, as they read its arguments.
"""

from __future__ import annotations

import torch

from autoshard.compiler.ops.dimmap import DimMap, OpInfo, broadcast_labels, pointwise
from autoshard.compiler.ops.registry import OUTPUT, elementwise, op, zero

aten = torch.ops.aten

# ---- what each op costs and keeps for backward (every overload) ------------------------------------------
# products and quotients keep both sides
op(aten.mul, aten.div, aten.pow, aten.maximum, aten.minimum, aten.atan2, flops=elementwise, saves=(0, 1))
# nonlinear functions whose derivative needs their input
op(aten.gelu, aten.silu, aten.mish, aten.hardswish, aten.leaky_relu, aten.elu, aten.softplus, aten.log, aten.sin,
   aten.cos, aten.abs, aten.reciprocal, aten.erf, aten.log_sigmoid, aten.where, aten.clamp, flops=elementwise,
   saves=(0,))
# functions whose derivative needs their output
op(aten.relu, aten.sigmoid, aten.tanh, aten.exp, aten.sqrt, aten.rsqrt, flops=elementwise, saves=(OUTPUT,))
# nothing kept: linear maps, comparisons, logic (square's backward reads its input, which the memory model has
# never counted: a known under-estimate)
op(aten.add, aten.sub, aten.rsub, aten.neg, aten.square, aten.eq, aten.ne, aten.le, aten.lt, aten.ge, aten.gt,
   aten.__and__, aten.__or__, aten.bitwise_and, aten.bitwise_or, aten.logical_not, aten.logical_and,
   aten.masked_fill, aten.type_as, flops=elementwise, saves=())
# copies and casts move bytes only
op(aten.clone, aten.contiguous, aten._to_copy, aten.to, aten.copy, aten.copy_, aten.lift_fresh_copy, flops=zero,
   saves=())

# ---- how each overload shards ----------------------------------------------------------------------------


@op(aten.add.Tensor, aten.sub.Tensor)
def _add(info: OpInfo) -> DimMap:
    # x + y is linear in (x, y) jointly; x + 2.0 is not (each rank would add the constant once)
    tensors = sum(1 for s in info.in_shapes if s is not None)
    return pointwise("sum" if tensors == 2 else "none")(info)


op(aten.mul.Tensor, rule=pointwise("multi"))
op(aten.div.Tensor, rule=pointwise("multi", linear_inputs=(0,)))
op(aten.mul.Scalar, aten.div.Scalar, aten.neg.default, aten.clone.default, aten.contiguous.default,
   aten.lift_fresh_copy.default, rule=pointwise("sum", linear_inputs=(0,)))


@op(aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default)
def _cast(info: OpInfo) -> DimMap:
    # A cast to a floating dtype is linear (a Partial sum stays one); to an integer or bool dtype it is not:
    # int(x0) + int(x1) != int(x0 + x1).
    floating = bool(info.out_dtypes) and (info.out_dtypes[0].is_floating_point or info.out_dtypes[0].is_complex)
    return pointwise("sum" if floating else "none", linear_inputs=(0,))(info)


@op(aten.type_as.default)
def _type_as(info: OpInfo) -> DimMap:
    # self.to(other.dtype): a cast of self; `other` gives its dtype only and need not broadcast to the output
    # (DeBERTa-v2: torch.tensor(mid - 1).type_as(relative_pos), a 0-d self and a 2-d other). Where other's dims
    # line up with the output's (right-aligned, equal or broadcast size 1) they share its labels, so the usual
    # x.type_as(y) of one layout moves nothing; otherwise other stays whole.
    self_shape, other = info.in_shapes[0], info.in_shapes[1]
    cast = _cast(OpInfo([self_shape], info.out_shapes, info.args, info.kwargs, info.out_dtypes))
    out = info.out_shapes[0]
    off = len(out) - len(other)
    if off >= 0 and all(s in (1, out[off + i]) for i, s in enumerate(other)):
        other_labels = broadcast_labels(other, out, cast.outputs[0])
    else:
        other_labels = (None,) * len(other)
    return DimMap((cast.inputs[0], other_labels), cast.outputs, cast.linear, cast.linear_inputs)


op(aten.gelu.default, aten.silu.default, aten.relu.default, aten.tanh.default, aten.sigmoid.default,
   aten.exp.default, aten.log.default, aten.rsqrt.default, aten.sqrt.default, aten.cos.default, aten.sin.default,
   aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.abs.default, aten.square.default, aten.add.Scalar,
   aten.sub.Scalar, aten.rsub.Scalar, aten.reciprocal.default, aten.erf.default, aten.eq.Tensor, aten.eq.Scalar,
   aten.ne.Tensor, aten.ne.Scalar, aten.le.Tensor, aten.le.Scalar, aten.lt.Tensor, aten.lt.Scalar, aten.ge.Tensor,
   aten.ge.Scalar, aten.gt.Tensor, aten.gt.Scalar, aten.__and__.Tensor, aten.__or__.Tensor, aten.bitwise_and.Tensor,
   aten.bitwise_or.Tensor, aten.logical_not.default, aten.logical_and.default, aten.where.self,
   aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.clamp.default, aten.minimum.default,
   aten.maximum.default, rule=pointwise())

# ---- more elementwise ops real models use (issue "Any model: op coverage") --------------------------------
# activations and maps whose derivative needs their input
op(aten.hardtanh, aten.relu6, aten.hardsigmoid, aten.selu, aten.celu, aten.log1p, aten.expm1,
   aten.tan, aten.atan, aten.clamp_min, aten.clamp_max, aten.fmod, aten.remainder, aten.lerp, aten.nan_to_num,
   flops=elementwise, saves=(0,))
# no gradient (piecewise constant) or nothing kept
op(aten.bitwise_not, aten.bitwise_xor, aten.logical_or, aten.logical_xor, aten.floor_divide, aten.sign,
   aten.floor, aten.ceil, aten.round, aten.trunc, aten.isnan, aten.isinf, aten.fill, flops=elementwise, saves=())
op(aten.min.other, aten.max.other, rule=pointwise(), flops=elementwise, saves=(0, 1))  # min(a, b), max(a, b)

op(aten.softplus.default, aten.hardtanh.default, aten.relu6.default, aten.hardsigmoid.default,
   aten.hardswish.default, aten.elu.default, aten.selu.default, aten.celu.default, aten.leaky_relu.default,
   aten.mish.default, aten.log_sigmoid.default, aten.log1p.default, aten.expm1.default,
   aten.tan.default, aten.atan.default, aten.sign.default, aten.floor.default, aten.ceil.default,
   aten.round.default, aten.trunc.default, aten.isnan.default, aten.isinf.default, aten.nan_to_num.default,
   aten.bitwise_not.default, aten.bitwise_xor.Tensor, aten.logical_or.default, aten.logical_xor.default,
   aten.floor_divide.default, aten.floor_divide.Scalar, aten.remainder.Tensor, aten.remainder.Scalar,
   aten.fmod.Tensor, aten.fmod.Scalar, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar,
   aten.clamp.Tensor, aten.clamp_min.default, aten.clamp_max.default, aten.clamp_min.Tensor, aten.clamp_max.Tensor,
   aten.lerp.Scalar, aten.lerp.Tensor, aten.fill.Scalar, aten.fill.Tensor,
   rule=pointwise())
# copy(dst, src): src broadcast into dst's shape and dtype (the functional form of ``dst.copy_(src)``); linear in
# src (dst gives only a shape) when the result is floating (a cast to int is not linear)
@op(aten.copy.default)
def _copy(info: OpInfo) -> DimMap:
    floating = bool(info.out_dtypes) and (info.out_dtypes[0].is_floating_point or info.out_dtypes[0].is_complex)
    return pointwise("sum" if floating else "none", linear_inputs=(1,))(info)
