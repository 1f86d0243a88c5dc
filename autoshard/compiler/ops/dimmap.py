"""The vocabulary of sharding rules: :class:`DimMap`, :class:`OpInfo` and the builders rules are made of.

A rule returns a :class:`DimMap`: one label per dimension of each tensor input and each output,
einsum-style. The strategy engine (:mod:`autoshard.compiler.strategies`) derives every valid way to run the op from it:

* a label may be sharded on a mesh axis: every operand dimension carrying it is then ``Shard(dim)`` on that
  axis, and the output is ``Shard`` along its dimension of that label — or ``Partial`` when the label does not
  reach the output (a summed/contracted dimension);
* ``None`` marks a dimension that must stay whole (softmax's dim, a normalised dim, a sliced dim, the inner
  factors of a merged view, a broadcast size-1 dim);
* ``linear`` says whether a ``Partial`` input may flow through: ``"sum"`` (``f(a1+a2, b1+b2) = f(a1,b1)+f(a2,b2)``:
  add, cat, views, sums — every linear input Partial together) or ``"multi"`` (multilinear: exactly one of the
  linear inputs Partial, the others replicated: mul, matmul);
* ``bias`` inputs are added once: where the output is Partial they are scaled by (coordinate == 0) at
  localisation, so an op whose rule names a bias needs a ``localize`` facet (``tests/test_op_registry.py``).

Rules are pure functions of shapes and the node's non-tensor arguments. They are registered, with the rest of
what autoshard knows about an op, in :mod:`autoshard.compiler.ops.registry`; ``tests/test_rules.py`` checks every rule
against ground truth (run the op on full tensors and on shards, reassemble).

    >>> einsum("...k,nk,n->...n")(OpInfo(in_shapes=[(2, 8, 4), (6, 4), (6,)], out_shapes=[(2, 8, 6)]))
    DimMap(inputs=(('e0', 'e1', 'k'), ('n', 'k'), ('n',)), outputs=(('e0', 'e1', 'n'),), linear='multi', ...)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

Labels = tuple[str | None, ...]


@dataclass(frozen=True)
class DimMap:
    inputs: tuple[Labels | None, ...]
    outputs: tuple[Labels, ...]
    linear: str = "none"  # none | sum | multi
    linear_inputs: tuple[int, ...] | None = None  # inputs the op is linear in (None: all)
    bias: tuple[int, ...] = ()
    replicate_only: bool = False
    #: further ways to run the op, each ``(name, DimMap, valid)``: the strategies of that DimMap that differ from
    #: this one's, noted ``"name:..."`` (the op's local form reads the name: context-parallel attention's ring,
    #: all-gather or Ulysses); ``valid(strategy, in_shapes, mesh) -> bool`` or None drops those it cannot run
    variants: tuple[tuple[str, DimMap, Any], ...] = ()


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


def norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


# ---------------------------------------------------------------------------------------------------------
# Rule builders
# ---------------------------------------------------------------------------------------------------------
def out_labels(ndim: int, prefix: str = "d") -> list[str]:
    return [f"{prefix}{i}" for i in range(ndim)]


def broadcast_labels(shape, out_shape, labels) -> Labels:
    """Right-aligned broadcasting: an input dim shares the output's label unless it is a broadcast size 1."""
    off = len(out_shape) - len(shape)
    return tuple(None if (s == 1 and out_shape[off + i] != 1) else labels[off + i] for i, s in enumerate(shape))


def pointwise(linear: str = "none", linear_inputs: tuple[int, ...] | None = None) -> RuleFn:
    """Elementwise op with broadcasting over all its tensor inputs."""

    def rule(info: OpInfo) -> DimMap:
        out = info.out_shapes[0]
        labels = out_labels(len(out))
        ins = tuple(None if s is None else broadcast_labels(s, out, labels) for s in info.in_shapes)
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


def view_rule(info: OpInfo) -> DimMap:
    in_shape, out_shape = info.in_shapes[0], info.out_shapes[0]
    in_l: list[str | None] = [None] * len(in_shape)
    out_l: list[str | None] = [None] * len(out_shape)
    for k, (gi, gj) in enumerate(view_groups(in_shape, out_shape)):
        # Only the outermost factor of a merged/split group may carry a shard: its contiguous chunks are the
        # same elements before and after the view.
        if gi and gj and in_shape[gi[0]] > 1 and out_shape[gj[0]] > 1:
            in_l[gi[0]] = out_l[gj[0]] = f"g{k}"
    return DimMap((tuple(in_l),), (tuple(out_l),), "sum")


def permute_rule(info: OpInfo, perm: list[int]) -> DimMap:
    n = len(info.in_shapes[0])
    labels = out_labels(n)
    return DimMap((tuple(labels),), (tuple(labels[p] for p in perm),), "sum")


def reduce_rule(info: OpInfo, dims, keepdim: bool, linear: bool) -> DimMap:
    shape = info.in_shapes[0]
    n = len(shape)
    dims = list(range(n)) if dims is None or dims == [] else [norm_dim(d, n) for d in (
        dims if isinstance(dims, (list, tuple)) else [dims])]
    labels = out_labels(n)
    ins = [None if (d in dims and not linear) else labels[d] for d in range(n)]
    if keepdim:
        outs = [None if d in dims else labels[d] for d in range(n)]
    else:
        outs = [labels[d] for d in range(n) if d not in dims]
    extra = tuple(None if s is None else (None,) * len(s) for s in info.in_shapes[1:])
    return DimMap((tuple(ins),) + extra, tuple(tuple(outs) for _ in info.out_shapes), "sum" if linear else "none",
                  (0,))


def keep_dims_whole(info: OpInfo, whole: list[int], linear: str = "none") -> DimMap:
    """Same labels in and out, except ``whole`` dims which stay unsharded (softmax, cumsum, sliced dims)."""
    n = len(info.in_shapes[0])
    whole = {norm_dim(d, n) for d in whole}
    labels = tuple(None if d in whole else f"d{d}" for d in range(n))
    extra = tuple(None if s is None else (None,) * len(s) for s in info.in_shapes[1:])
    return DimMap((labels,) + extra, tuple(labels for _ in info.out_shapes), linear, (0,))


def numel(shape) -> int:
    return math.prod(shape)
