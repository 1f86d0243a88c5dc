"""Contractions: mm, bmm, matmul, linear, addmm/baddbmm, einsum. One einsum string each; a sharded contracted
label gives a Partial output, and a bias added to a Partial output is added on one coordinate only (local form)."""

from __future__ import annotations

import math

import torch

from autoshard.compiler.ops.dimmap import DimMap, OpInfo, broadcast_labels, einsum, replicate_only
from autoshard.compiler.ops.local import out_spec, partial_axes
from autoshard.compiler.ops.registry import Shapes, op
from autoshard.runtime import ops as local_kernels

aten = torch.ops.aten


def matmul_flops(op: Shapes):
    """2·M·N·K per batch."""
    return 2 * op.out_numel() * op.shape(0)[-1]


def addmm_flops(op: Shapes):
    return 2 * op.out_numel() * op.shape(1)[-1] + op.out_numel()


def linear_flops(op: Shapes):
    bias = op.out_numel() if op.arg(2) is not None else 0
    return 2 * op.out_numel() * op.shape(0)[-1] + bias


def einsum_flops(op: Shapes):
    """2·∏(size of every label) for two operands; one FLOP per output element otherwise."""
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


def bias_once(graph, new, old, mesh, rank):
    """A bias added to a Partial output would be summed once per rank: add it on coordinate 0 of every partial
    axis only. Its gradient passes straight through on every rank (the output's gradient is whole everywhere),
    so no rank needs a backward all-reduce for it (see strategies.py: bias inputs of Partial outputs)."""
    axes = partial_axes(out_spec(old), mesh)
    bias_pos = 2 if old.target == aten.linear.default else 0
    if not axes or len(new.args) <= bias_pos or new.args[bias_pos] is None:
        return new
    coords = mesh.coords(rank)
    keep = all(coords[mesh.names[a]] == 0 for a in axes)
    with graph.inserting_before(new):
        scaled = graph.call_function(local_kernels.bias_once, (new.args[bias_pos], keep))
    args = list(new.args)
    args[bias_pos] = scaled
    new.args = tuple(args)
    return new


# Every overload costs the same; backward ≈ 2× forward (a gradient for each operand).
op(aten.mm, aten.bmm, aten.matmul, flops=matmul_flops, backward=2.0, saves=(0, 1), compute_kind="matmul")
op(aten.addmm, aten.baddbmm, flops=addmm_flops, backward=2.0, saves=(1, 2), compute_kind="matmul")
op(aten.linear, flops=linear_flops, backward=2.0, saves=(0, 1), compute_kind="matmul")
op(aten.einsum, flops=einsum_flops, backward=2.0, saves=(1,), compute_kind="matmul")  # arg 1 is the list of operands

op(aten.mm.default, rule=einsum("mk,kn->mn"))
op(aten.bmm.default, rule=einsum("bij,bjk->bik"))
op(aten.linear.default, rule=einsum("...k,nk,n->...n", bias=(2,)), localize=bias_once)


@op(aten.addmm.default, aten.baddbmm.default, localize=bias_once)
def _addmm(info: OpInfo) -> DimMap:
    # the added input broadcasts against the product (a bias [n], a row [1, n], or a full [m, n])
    spec = "mk,kn->mn" if len(info.out_shapes[0]) == 2 else "bij,bjk->bik"
    product = einsum(spec)(OpInfo(info.in_shapes[1:3], info.out_shapes))
    bias = broadcast_labels(info.in_shapes[0], info.out_shapes[0], product.outputs[0])
    return DimMap((bias,) + product.inputs, product.outputs, "multi", (1, 2), (0,))


@op(aten.matmul.default)
def _matmul(info: OpInfo) -> DimMap:
    a, b = info.in_shapes
    if len(a) == 1 or len(b) == 1:
        return replicate_only(info)
    return einsum("...ij,...jk->...ik")(info)


@op(aten.einsum.default)
def _einsum(info: OpInfo) -> DimMap:
    """``torch.einsum(equation, operands)``: the equation is the rule (multilinear in the operands). An equation
    with a label repeated within one operand (a diagonal) or an implicit output runs whole."""
    equation = info.arg(0, "equation").replace(" ", "")
    if "->" not in equation:
        return replicate_only(info)
    lhs, _ = equation.split("->")
    terms = lhs.split(",")
    if len(terms) != len(info.in_shapes) or any(len(set(t.replace("...", ""))) != len(t.replace("...", ""))
                                                for t in terms):
        return replicate_only(info)
    return einsum(equation)(info)
