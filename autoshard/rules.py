"""The sharding rule table: how every dimension of every input of an op maps to its output.

A rule returns a :class:`DimMap`: one label per dimension of each tensor input and each output,
einsum-style. The strategy engine (:mod:`autoshard.strategies`) derives every valid way to run the op from it:

* a label may be sharded on a mesh axis: every operand dimension carrying it is then ``Shard(dim)`` on that
  axis, and the output is ``Shard`` along its dimension of that label — or ``Partial`` when the label does not
  reach the output (a summed/contracted dimension);
* ``None`` marks a dimension that must stay whole (softmax's dim, a normalised dim, a sliced dim, the inner
  factors of a merged view, a broadcast size-1 dim);
* ``linear`` says whether a ``Partial`` input may flow through: ``"sum"`` (``f(a1+a2, b1+b2) = f(a1,b1)+f(a2,b2)``:
  add, cat, views, sums — every linear input Partial together) or ``"multi"`` (multilinear: exactly one of the
  linear inputs Partial, the others replicated: mul, matmul);
* ``bias`` inputs are added once: where the output is Partial they are scaled by (coordinate == 0) at codegen.

Rules are pure functions of shapes and the node's non-tensor arguments, and every rule in :data:`RULES` is
checked against ground truth by ``tests/test_rules.py`` (run the op on full tensors and on shards, reassemble).

    >>> einsum("...k,nk,n->...n")(OpInfo(in_shapes=[(2, 8, 4), (6, 4), (6,)], out_shapes=[(2, 8, 6)]))
    DimMap(inputs=(('e0', 'e1', 'k'), ('n', 'k'), ('n',)), outputs=(('e0', 'e1', 'n'),), linear='multi', ...)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

aten = torch.ops.aten

Labels = tuple[str | None, ...]


@dataclass(frozen=True)
class DimMap:
    inputs: tuple[Labels | None, ...]
    outputs: tuple[Labels, ...]
    linear: str = "none"  # none | sum | multi
    linear_inputs: tuple[int, ...] | None = None  # inputs the op is linear in (None: all)
    bias: tuple[int, ...] = ()
    replicate_only: bool = False


@dataclass
class OpInfo:
    """What a rule may look at: tensor input shapes (flat order), output shapes, the node's args/kwargs."""

    in_shapes: list[tuple[int, ...] | None]
    out_shapes: list[tuple[int, ...]]
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    out_dtypes: list[torch.dtype] = field(default_factory=list)

    def arg(self, i: int, name: str, default=None):
        if len(self.args) > i:
            return self.args[i]
        return self.kwargs.get(name, default)


RuleFn = Callable[[OpInfo], DimMap]
RULES: dict[Any, RuleFn] = {}


def register(*ops):
    def deco(fn: RuleFn) -> RuleFn:
        for op in ops:
            RULES[op] = fn
        return fn

    return deco


def _norm(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


# ---------------------------------------------------------------------------------------------------------
# Rule builders
# ---------------------------------------------------------------------------------------------------------
def _out_labels(ndim: int, prefix: str = "d") -> list[str]:
    return [f"{prefix}{i}" for i in range(ndim)]


def _broadcast_labels(shape, out_shape, out_labels) -> Labels:
    """Right-aligned broadcasting: an input dim shares the output's label unless it is a broadcast size 1."""
    off = len(out_shape) - len(shape)
    return tuple(None if (s == 1 and out_shape[off + i] != 1) else out_labels[off + i] for i, s in enumerate(shape))


def pointwise(linear: str = "none", linear_inputs: tuple[int, ...] | None = None) -> RuleFn:
    """Elementwise op with broadcasting over all its tensor inputs."""

    def rule(info: OpInfo) -> DimMap:
        out = info.out_shapes[0]
        labels = _out_labels(len(out))
        ins = tuple(None if s is None else _broadcast_labels(s, out, labels) for s in info.in_shapes)
        outs = tuple(tuple(labels) for _ in info.out_shapes)
        return DimMap(ins, outs, linear, linear_inputs)

    return rule


def einsum(spec: str, linear: str = "multi", bias: tuple[int, ...] = ()) -> RuleFn:
    """``"...k,nk,n->...n"``: one letter per dim, ``...`` for leading dims broadcast across operands."""
    lhs, rhs = spec.replace(" ", "").split("->")
    operands = lhs.split(",")

    def expand(term: str, ndim: int, ell: list[str]) -> list[str | None]:
        if "..." not in term:
            return list(term)
        head, tail = term.split("...")
        n = ndim - len(head) - len(tail)
        return list(head) + ell[len(ell) - n:] + list(tail)

    def rule(info: OpInfo) -> DimMap:
        out_shape = info.out_shapes[0]
        n_ell = len(out_shape) - len(rhs.replace("...", ""))
        ell = [f"e{i}" for i in range(max(n_ell, 0))]
        out = expand(rhs, len(out_shape), ell)
        ins = []
        for term, shape in zip(operands, info.in_shapes):
            if shape is None:
                ins.append(None)
                continue
            labels = expand(term, len(shape), ell)
            # a broadcast ellipsis dim of size 1 must not carry the label of a larger dim
            labels = [None if (lab in ell and shape[i] == 1 and out_shape[out.index(lab)] != 1) else lab
                      for i, lab in enumerate(labels)]
            ins.append(tuple(labels))
        for extra in info.in_shapes[len(operands):]:
            ins.append(None if extra is None else (None,) * len(extra))
        linear_inputs = tuple(i for i in range(len(operands)) if i not in bias)
        return DimMap(tuple(ins), (tuple(out),), linear, linear_inputs, bias)

    return rule


def replicate_only(info: OpInfo) -> DimMap:
    """Ops we only run whole (index with tensors, diff): every input and output replicated."""
    ins = tuple(None if s is None else (None,) * len(s) for s in info.in_shapes)
    return DimMap(ins, tuple((None,) * len(s) for s in info.out_shapes), replicate_only=True)


def factory(info: OpInfo) -> DimMap:
    """Tensors made from nothing (arange, full, new_ones): replicated; consumers slice them locally for free."""
    return replicate_only(info)


def view_groups(in_shape, out_shape) -> list[tuple[list[int], list[int]]]:
    """Group input and output dims whose products match: ``[2,16,64] -> [32,64]`` gives ``[([0,1],[0]), ([2],[1])]``."""
    groups, i, j = [], 0, 0
    ni, no = len(in_shape), len(out_shape)
    while i < ni or j < no:
        gi, gj = [], []
        pi = pj = 1
        # size-1 dims form groups of their own so they never absorb a shard
        if i < ni and in_shape[i] == 1 and not (j < no and out_shape[j] == 1):
            groups.append(([i], []))
            i += 1
            continue
        if j < no and out_shape[j] == 1 and not (i < ni and in_shape[i] == 1):
            groups.append(([], [j]))
            j += 1
            continue
        while True:
            if pi <= pj and i < ni:
                gi.append(i)
                pi *= in_shape[i]
                i += 1
            elif j < no:
                gj.append(j)
                pj *= out_shape[j]
                j += 1
            else:
                break
            if pi == pj and gi and gj:
                break
        groups.append((gi, gj))
    return groups


def _view_rule(info: OpInfo) -> DimMap:
    in_shape, out_shape = info.in_shapes[0], info.out_shapes[0]
    in_l: list[str | None] = [None] * len(in_shape)
    out_l: list[str | None] = [None] * len(out_shape)
    for k, (gi, gj) in enumerate(view_groups(in_shape, out_shape)):
        # Only the outermost factor of a merged/split group may carry a shard: its contiguous chunks are the
        # same elements before and after the view.
        if gi and gj and in_shape[gi[0]] > 1 and out_shape[gj[0]] > 1:
            in_l[gi[0]] = out_l[gj[0]] = f"g{k}"
    return DimMap((tuple(in_l),), (tuple(out_l),), "sum")


def _permute(info: OpInfo, perm: list[int]) -> DimMap:
    n = len(info.in_shapes[0])
    labels = _out_labels(n)
    return DimMap((tuple(labels),), (tuple(labels[p] for p in perm),), "sum")


def _reduce(info: OpInfo, dims, keepdim: bool, linear: bool) -> DimMap:
    shape = info.in_shapes[0]
    n = len(shape)
    dims = list(range(n)) if dims is None or dims == [] else [_norm(d, n) for d in (
        dims if isinstance(dims, (list, tuple)) else [dims])]
    labels = _out_labels(n)
    ins = [None if (d in dims and not linear) else labels[d] for d in range(n)]
    if keepdim:
        outs = [None if d in dims else labels[d] for d in range(n)]
    else:
        outs = [labels[d] for d in range(n) if d not in dims]
    extra = tuple(None if s is None else (None,) * len(s) for s in info.in_shapes[1:])
    return DimMap((tuple(ins),) + extra, tuple(tuple(outs) for _ in info.out_shapes), "sum" if linear else "none",
                  (0,))


def _keep_dims_whole(info: OpInfo, whole: list[int], linear: str = "none") -> DimMap:
    """Same labels in and out, except ``whole`` dims which stay unsharded (softmax, cumsum, sliced dims)."""
    n = len(info.in_shapes[0])
    whole = {_norm(d, n) for d in whole}
    labels = tuple(None if d in whole else f"d{d}" for d in range(n))
    extra = tuple(None if s is None else (None,) * len(s) for s in info.in_shapes[1:])
    return DimMap((labels,) + extra, tuple(labels for _ in info.out_shapes), linear, (0,))


# ---------------------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------------------
# Contractions, one einsum each.
RULES[aten.mm.default] = einsum("mk,kn->mn")
RULES[aten.bmm.default] = einsum("bij,bjk->bik")
RULES[aten.linear.default] = einsum("...k,nk,n->...n", bias=(2,))


@register(aten.addmm.default, aten.baddbmm.default)
def _addmm(info: OpInfo) -> DimMap:
    # the added input broadcasts against the product (a bias [n], a row [1, n], or a full [m, n])
    spec = "mk,kn->mn" if len(info.out_shapes[0]) == 2 else "bij,bjk->bik"
    product = einsum(spec)(OpInfo(info.in_shapes[1:3], info.out_shapes))
    bias = _broadcast_labels(info.in_shapes[0], info.out_shapes[0], product.outputs[0])
    return DimMap((bias,) + product.inputs, product.outputs, "multi", (1, 2), (0,))


@register(aten.matmul.default)
def _matmul(info: OpInfo) -> DimMap:
    a, b = info.in_shapes
    if len(a) == 1 or len(b) == 1:
        return replicate_only(info)
    return einsum("...ij,...jk->...ik")(info)


# Elementwise. Linear ones let Partial flow through.
@register(aten.add.Tensor, aten.sub.Tensor)
def _add(info: OpInfo) -> DimMap:
    # x + y is linear in (x, y) jointly; x + 2.0 is not (each rank would add the constant once)
    tensors = sum(1 for s in info.in_shapes if s is not None)
    return pointwise("sum" if tensors == 2 else "none")(info)
for _op in (aten.mul.Tensor,):
    RULES[_op] = pointwise("multi")
RULES[aten.div.Tensor] = pointwise("multi", linear_inputs=(0,))
for _op in (aten.mul.Scalar, aten.div.Scalar, aten.neg.default, aten.alias.default, aten.clone.default,
            aten.contiguous.default, aten.detach.default, aten.lift_fresh_copy.default):
    RULES[_op] = pointwise("sum", linear_inputs=(0,))


@register(aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default, aten.type_as.default)
def _cast(info: OpInfo) -> DimMap:
    # A cast to a floating dtype is linear (a Partial sum stays one); to an integer or bool dtype it is not:
    # int(x0) + int(x1) != int(x0 + x1).
    floating = bool(info.out_dtypes) and (info.out_dtypes[0].is_floating_point or info.out_dtypes[0].is_complex)
    return pointwise("sum" if floating else "none", linear_inputs=(0,))(info)
for _op in (aten.gelu.default, aten.silu.default, aten.relu.default, aten.tanh.default, aten.sigmoid.default,
            aten.exp.default, aten.log.default, aten.rsqrt.default, aten.sqrt.default, aten.cos.default,
            aten.sin.default, aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.abs.default, aten.square.default,
            aten.add.Scalar, aten.sub.Scalar, aten.rsub.Scalar, aten.reciprocal.default, aten.erf.default,
            aten.eq.Tensor, aten.eq.Scalar, aten.ne.Tensor, aten.ne.Scalar, aten.le.Tensor, aten.le.Scalar,
            aten.lt.Tensor, aten.lt.Scalar, aten.ge.Tensor, aten.ge.Scalar, aten.gt.Tensor, aten.gt.Scalar,
            aten.__and__.Tensor, aten.__or__.Tensor, aten.bitwise_and.Tensor, aten.bitwise_or.Tensor,
            aten.logical_not.default, aten.logical_and.default, aten.where.self, aten.masked_fill.Scalar,
            aten.masked_fill.Tensor, aten.clamp.default, aten.minimum.default, aten.maximum.default,
            aten.dropout.default, aten.native_dropout.default, aten.gelu.default):
    RULES[_op] = pointwise()

# Factories and whole-only ops.
for _op in (aten.arange.default, aten.arange.start, aten.arange.start_step, aten.full.default, aten.zeros.default,
            aten.ones.default, aten.empty.memory_format, aten.scalar_tensor.default, aten.new_ones.default,
            aten.new_zeros.default, aten.new_full.default, aten.new_empty.default, aten.zeros_like.default,
            aten.ones_like.default, aten.full_like.default, aten.empty_like.default, aten.tril.default,
            aten.triu.default):
    RULES[_op] = factory
for _op in (aten.index.Tensor, aten.diff.default, aten.index_select.default, aten.gather.default):
    RULES[_op] = replicate_only


# Views.
@register(aten.view.default, aten.reshape.default, aten._unsafe_view.default)
def _view(info: OpInfo) -> DimMap:
    return _view_rule(info)


@register(aten.transpose.int)
def _transpose(info: OpInfo) -> DimMap:
    n = len(info.in_shapes[0])
    perm = list(range(n))
    a, b = _norm(info.arg(1, "dim0"), n), _norm(info.arg(2, "dim1"), n)
    perm[a], perm[b] = perm[b], perm[a]
    return _permute(info, perm)


@register(aten.t.default)
def _t(info: OpInfo) -> DimMap:
    return _permute(info, list(reversed(range(len(info.in_shapes[0])))))


@register(aten.permute.default)
def _permute_op(info: OpInfo) -> DimMap:
    n = len(info.in_shapes[0])
    return _permute(info, [_norm(d, n) for d in info.arg(1, "dims")])


@register(aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.flatten.using_ints,
          aten.unflatten.int)
def _unsqueeze(info: OpInfo) -> DimMap:
    return _view_rule(info)


@register(aten.expand.default)
def _expand(info: OpInfo) -> DimMap:
    out = info.out_shapes[0]
    labels = _out_labels(len(out))
    return DimMap((_broadcast_labels(info.in_shapes[0], out, labels),), (tuple(labels),), "sum")


@register(aten.slice.Tensor)
def _slice(info: OpInfo) -> DimMap:
    n = len(info.in_shapes[0])
    dim = _norm(info.arg(1, "dim", 0), n)
    whole = info.in_shapes[0][dim] == info.out_shapes[0][dim]
    return _keep_dims_whole(info, [] if whole else [dim], "sum")


@register(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int)
def _split(info: OpInfo) -> DimMap:
    n = len(info.in_shapes[0])
    unbind = len(info.out_shapes[0]) < n
    dim = _norm(info.arg(1, "dim", 0) if unbind else info.arg(2, "dim", 0), n)
    labels = tuple(None if d == dim else f"d{d}" for d in range(n))
    if unbind:  # unbind drops the dim
        outs = tuple(tuple(lab for d, lab in enumerate(labels) if d != dim) for _ in info.out_shapes)
    else:
        outs = tuple(labels for _ in info.out_shapes)
    return DimMap((labels,), outs, "sum")


@register(aten.cat.default)
def _cat(info: OpInfo) -> DimMap:
    out = info.out_shapes[0]
    dim = _norm(info.arg(1, "dim", 0), len(out))
    labels = tuple(None if d == dim else f"d{d}" for d in range(len(out)))
    ins = tuple(None if s is None else (labels if len(s) == len(out) else (None,) * len(s)) for s in info.in_shapes)
    return DimMap(ins, (labels,), "sum")


@register(aten.stack.default)
def _stack(info: OpInfo) -> DimMap:
    out = info.out_shapes[0]
    dim = _norm(info.arg(1, "dim", 0), len(out))
    labels = [f"d{d}" for d in range(len(out))]
    ins = tuple(None if s is None else tuple(lab for d, lab in enumerate(labels) if d != dim) for s in info.in_shapes)
    labels[dim] = None
    return DimMap(ins, (tuple(labels),), "sum")


@register(aten.pad.default, aten.constant_pad_nd.default)
def _pad(info: OpInfo) -> DimMap:
    n = len(info.in_shapes[0])
    pads = info.arg(1, "pad")
    whole = [n - 1 - i // 2 for i in range(len(pads))]
    return _keep_dims_whole(info, whole)


# Reductions: a sharded reduced dim makes the output Partial (sum-like ones only).
@register(aten.sum.dim_IntList, aten.mean.dim)
def _sum_dim(info: OpInfo) -> DimMap:
    return _reduce(info, info.arg(1, "dim"), bool(info.arg(2, "keepdim", False)), linear=True)


@register(aten.sum.default, aten.mean.default)
def _sum_all(info: OpInfo) -> DimMap:
    return _reduce(info, None, False, linear=True)


@register(aten.amax.default, aten.amin.default, aten.argmax.default, aten.argmin.default, aten.max.dim,
          aten.min.dim, aten.logsumexp.default, aten.var.correction, aten.std.correction)
def _max_dim(info: OpInfo) -> DimMap:
    return _reduce(info, info.arg(1, "dim"), bool(info.arg(2, "keepdim", False)), linear=False)


@register(aten.topk.default)
def _topk(info: OpInfo) -> DimMap:
    return _keep_dims_whole(info, [info.arg(2, "dim", -1)])


@register(aten.sort.default)
def _sort(info: OpInfo) -> DimMap:
    return _keep_dims_whole(info, [info.arg(1, "dim", -1)])


@register(aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default)
def _softmax(info: OpInfo) -> DimMap:
    return _keep_dims_whole(info, [info.arg(1, "dim")])


@register(aten.cumsum.default)
def _cumsum(info: OpInfo) -> DimMap:
    return _keep_dims_whole(info, [info.arg(1, "dim")], "sum")


# Normalisation: the normalised (trailing) dims stay whole; weight/bias replicated.
@register(aten.layer_norm.default, aten.rms_norm.default)
def _layer_norm(info: OpInfo) -> DimMap:
    n = len(info.in_shapes[0])
    k = len(info.arg(1, "normalized_shape"))
    labels = tuple(None if d >= n - k else f"d{d}" for d in range(n))
    ins = (labels,) + tuple(None if s is None else (None,) * len(s) for s in info.in_shapes[1:])
    return DimMap(ins, (labels,))


@register(aten.embedding.default)
def _embedding(info: OpInfo) -> DimMap:
    # Sharding the vocabulary ("v", contracted) gives a Partial output: each rank looks up the ids it holds and
    # zeros the rest (codegen: runtime.ops.masked_embedding).
    w, idx = info.in_shapes
    labels = _out_labels(len(idx))
    return DimMap((("v", "h"), tuple(labels)), (tuple(labels) + ("h",),), "multi", (0,))


@register(aten.scaled_dot_product_attention.default)
def _sdpa(info: OpInfo) -> DimMap:
    q, k, v = info.in_shapes[:3]
    causal = bool(info.arg(5, "is_causal", False))
    batch = [f"b{i}" for i in range(len(q) - 3)]
    head = "h"  # with GQA both head counts must divide by the axis: local groups stay aligned
    sq = None if causal else "s"
    out = tuple(batch) + (head, sq, None)
    ins = [tuple(batch) + (head, sq, None), tuple(batch) + (head, None, None), tuple(batch) + (head, None, None)]
    if len(info.in_shapes) > 3 and info.in_shapes[3] is not None:
        full = (*batch, head, sq, None)
        ins.append(_broadcast_labels(info.in_shapes[3], (*q[:-1], k[-2]), full))
    return DimMap(tuple(ins), (out,))


@register(aten.broadcast_tensors.default)
def _broadcast_tensors(info: OpInfo) -> DimMap:
    out = info.out_shapes[0]
    labels = _out_labels(len(out))
    ins = tuple(_broadcast_labels(s, out, labels) for s in info.in_shapes)
    return DimMap(ins, tuple(tuple(labels) for _ in info.out_shapes), "sum")


@register(aten.mse_loss.default, aten.l1_loss.default)
def _elementwise_loss(info: OpInfo) -> DimMap:
    # reduction 'none' keeps the shape; 'mean'/'sum' contract every dim (a sharded dim gives a Partial loss,
    # and codegen rescales the local mean to the global count).
    labels = tuple(_out_labels(len(info.in_shapes[0])))
    reduction = info.arg(2, "reduction", 1)
    return DimMap((labels, labels), (labels if reduction == 0 else (),))


@register(aten.nll_loss_nd.default, aten.nll_loss.default)
def _nll_loss(info: OpInfo) -> DimMap:
    # as cross-entropy, but the class dim stays whole (no vocab-parallel kernel for log-probabilities)
    dm = _cross_entropy(info)
    x_labels = tuple(None if lab == "c" else lab for lab in dm.inputs[0])
    return DimMap((x_labels,) + dm.inputs[1:], dm.outputs, dm.linear, dm.linear_inputs, dm.bias, dm.replicate_only)


@register(aten.cross_entropy_loss.default)
def _cross_entropy(info: OpInfo) -> DimMap:
    x, t = info.in_shapes[:2]
    reduction = info.arg(3, "reduction", 1)
    batch = tuple(f"n{i}" for i in range(len(t)))
    # The class dim may be sharded (vocab-parallel loss, runtime.ops.vocab_parallel_cross_entropy) for unweighted,
    # unsmoothed 2-D losses; the kernel returns a Partial value over that axis.
    vocab_ok = len(x) == 2 and len(info.in_shapes) == 2 and not info.arg(5, "label_smoothing", 0.0)
    x_labels = (batch[0], "c" if vocab_ok else None) + batch[1:] if len(x) == len(t) + 1 else (None,) * len(x)
    extra = tuple(None if s is None else (None,) * len(s) for s in info.in_shapes[2:])
    if len(x) != len(t) + 1:
        return replicate_only(info)
    # mean/sum reductions contract the batch labels: a sharded batch gives a Partial loss (codegen divides the
    # local sum by the global count of non-ignored targets).
    out = batch if reduction == 0 else ()
    return DimMap((x_labels, batch) + extra, (out,))


def rule_for(target) -> RuleFn | None:
    return RULES.get(target)


def numel(shape) -> int:
    return math.prod(shape)


# ---------------------------------------------------------------------------------------------------------
# Mixture of Experts graph ops (autoshard/moe/graph_ops.py, emitted by passes/expert_rewrite.py). The routing group "g"
# is the only shardable label: tokens live sharded on groups, the expert buffer [E, G, C, h] on groups too,
# and the expert matmuls (bmm/baddbmm) shard E — the redistribution between them is one all-to-all.
# ---------------------------------------------------------------------------------------------------------
from autoshard.moe import graph_ops as _moe  # noqa: E402


def _g(shape, at: int = 0) -> Labels:
    return tuple("g" if d == at else None for d in range(len(shape)))


@register(_moe.route_groups)
def _moe_route(info: OpInfo) -> DimMap:
    return DimMap((_g(info.in_shapes[0]),), tuple(_g(s) for s in info.out_shapes))


@register(_moe.dispatch_groups)
def _moe_dispatch(info: OpInfo) -> DimMap:
    return DimMap(tuple(_g(s) for s in info.in_shapes), (_g(info.out_shapes[0], 1),))


@register(_moe.combine_groups)
def _moe_combine(info: OpInfo) -> DimMap:
    # linear in the expert outputs: a Partial y (row-parallel experts) is combined before it is reduced
    ins = (_g(info.in_shapes[0], 1),) + tuple(_g(s) for s in info.in_shapes[1:])
    return DimMap(ins, (_g(info.out_shapes[0]),), "multi", (0,))


@register(_moe.gate_groups, _moe.first_fraction, _moe.routing_stats, _moe.aux_terms, _moe.attach)
def _moe_grouped(info: OpInfo) -> DimMap:
    # every input and output with a leading group dim carries "g"; [E]/stats vectors stay whole (a sharded group
    # contracted away gives a Partial sum, as these ops' local values are shares of the global one)
    def labels(s, leading: bool) -> Labels:
        return _g(s) if leading else (None,) * len(s)

    ins = tuple(None if s is None else labels(s, len(s) >= 2) for s in info.in_shapes)
    outs = tuple(labels(s, len(s) >= 2) for s in info.out_shapes)
    return DimMap(ins, outs)
