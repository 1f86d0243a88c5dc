"""Gradient bucketing of the data-parallel parameter syncs (DDP's reducer, as a pass).

With ``bucket_grads``, the ``grad_all_reduce`` of every parameter that feeds nothing else leaves the program: the
parameter's gradient is then exactly its local gradient, to be all-reduced over the node's axes. The parameters are
listed instead in ``gm.meta[GRAD_SYNC]`` as ``((attribute name, axes), ...)`` in graph order, for
:class:`autoshard.runtime.buckets.GradBucketer` to all-reduce in buckets, overlapped with backward.

A replicated lookup of a parameter by ids computed from constants alone (position embeddings,
``embedding(param, unsqueeze(arange(s) + 0))``), possibly followed by a cast that keeps the dtype, joins too: the
lookup is linear in the parameter and its ids are the same on every rank, so all-reducing the rows' gradients and
then scattering them is scattering and then all-reducing the parameter's (equal up to the order of the sums).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from autoshard.compiler.collective_kinds import is_kind
from autoshard.compiler.context import Context
from autoshard.runtime.buckets import GRAD_SYNC

_ARANGES = (torch.ops.aten.arange.default, torch.ops.aten.arange.start, torch.ops.aten.arange.start_step)


@dataclass(frozen=True)
class BucketGradSync:
    name: str = "bucket_grad_sync"
    phase: str = "rank"

    def run(self, gm: torch.fx.GraphModule, ctx: Context) -> torch.fx.GraphModule:
        if not ctx.bucket_grads:
            return gm
        syncs: list[tuple[str, tuple[str, ...]]] = []
        for node in list(gm.graph.nodes):
            param = param_of_sync(node)
            if param is None:
                continue
            syncs.append((param.target, tuple(node.args[1])))
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
        gm.recompile()
        gm.meta[GRAD_SYNC] = tuple(syncs)
        return gm


def param_of_sync(node: torch.fx.Node) -> torch.fx.Node | None:
    """The parameter whose gradient ``node`` (a grad_all_reduce) syncs, where it can join the buckets."""
    if not is_kind(node, "grad_all_reduce"):
        return None
    src = node.args[0]
    if not isinstance(src, torch.fx.Node):
        return None
    if src.op == "get_attr" and len(src.users) == 1 and isinstance(src.meta.get("val"), torch.Tensor):
        return src
    while _is_same_dtype_cast(src) and len(src.users) == 1:
        src = src.args[0]
    if not (src.op == "call_function" and src.target is torch.ops.aten.embedding.default and len(src.users) == 1):
        return None
    weight, ids = src.args[0], src.args[1]
    if (isinstance(weight, torch.fx.Node) and weight.op == "get_attr" and len(weight.users) == 1
            and isinstance(weight.meta.get("val"), torch.Tensor) and isinstance(ids, torch.fx.Node)
            and _from_constants(ids)):
        return weight
    return None


_CASTS = (torch.ops.aten.to.dtype_layout, torch.ops.aten.to.dtype, torch.ops.aten._to_copy.default)


def _is_same_dtype_cast(node) -> bool:
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _CASTS):
        return False
    src = node.args[0]
    out, inp = node.meta.get("val"), getattr(src, "meta", {}).get("val")
    return isinstance(out, torch.Tensor) and isinstance(inp, torch.Tensor) and out.dtype == inp.dtype


def _from_constants(node: torch.fx.Node) -> bool:
    """Whether ``node`` is computed from factories alone (no input, parameter or collective): the same on every
    rank."""
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if (n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload)
                or n.target.namespace == "autoshard"):
            return False
        if not n.all_input_nodes and n.target not in _ARANGES and n.target.overloadpacket not in _FACTORIES:
            return False
        stack.extend(n.all_input_nodes)
    return True


_FACTORIES = {torch.ops.aten.arange, torch.ops.aten.zeros, torch.ops.aten.ones, torch.ops.aten.full}
