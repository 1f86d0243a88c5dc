"""Localisation: the pass that turns the annotated global program into rank ``r``'s program.

The global graph (after propagation and collective insertion) says, for every node, its global shape and its
spec. Localising it for rank ``r`` means:

* shapes written into the code (``view``/``reshape``/``expand`` targets) become the local shapes of their outputs;
* ops whose local form differs from their global one are rewritten by the op's local form (:data:`LOCALIZERS`):
  a mean over a sharded dim divides by the *global* count; a bias added to a Partial output is added once; a mean
  cross-entropy over a sharded batch divides by the global count of targets; dropout draws one global mask;
* every ``get_attr`` holds rank ``r``'s shard of the original weight, copied (no full copy is kept).

The result keeps the original calling convention (the exported pytree in/out specs) and prints as readable Python
(``Plan.code(rank)``); the same plan always gives byte-identical code. Collectives stay the operators the
collective pass emitted (``torch.ops.autoshard.*``); local kernels are :mod:`autoshard.runtime.ops`.
"""

from __future__ import annotations

import math
import operator
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx

from autoshard import meta as M
from autoshard.context import Context
from autoshard.errors import UnsupportedOpError
from autoshard.graph_utils import node_location, tensor_inputs
from autoshard.mesh import Mesh
from autoshard.placements import Partial, Shard, Spec, local_shape, shard_offsets, shard_tensor
from autoshard.runtime import ops as local_kernels
from autoshard.trace import fetch_attr

aten = torch.ops.aten

Localizer = Callable[[torch.fx.Graph, torch.fx.Node, torch.fx.Node, Mesh, int], torch.fx.Node]
LOCALIZERS: dict[object, Localizer] = {}


def localizer(*ops):
    def deco(fn: Localizer) -> Localizer:
        for op in ops:
            LOCALIZERS[op] = fn
        return fn

    return deco


def _out_spec(old: torch.fx.Node) -> Spec:
    return old.meta[M.SPEC]


def _partial_axes(spec: Spec, mesh: Mesh) -> list[int]:
    return [a for a, p in enumerate(spec) if isinstance(p, Partial)]


@localizer(aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default)
def _local_shape_arg(graph, new, old, mesh, rank):
    new.args = (new.args[0], list(local_shape(old.meta["val"].shape, _out_spec(old), mesh))) + tuple(new.args[2:])
    return new


@localizer(aten.mean.dim, aten.mean.default)
def _mean(graph, new, old, mesh, rank):
    # A mean over a sharded dim: the local mean divides by the local count; the partial sum must divide by the
    # global one, so scale by local/global count of the reduced elements.
    x = tensor_inputs(old)[0]
    in_spec = old.meta[M.STRATEGY].input_specs[0]
    ndim = x.meta["val"].dim()
    dims = old.args[1] if old.target == aten.mean.dim and len(old.args) > 1 and old.args[1] else list(range(ndim))
    dims = [d % ndim for d in dims]
    gshape = x.meta["val"].shape
    lshape = local_shape(gshape, in_spec, mesh)
    ratio = math.prod(lshape[d] for d in dims) / math.prod(gshape[d] for d in dims)
    if ratio == 1:
        return new
    with graph.inserting_after(new):
        scaled = graph.call_function(aten.mul.Tensor, (new, ratio))
    return scaled


@localizer(aten.mse_loss.default, aten.l1_loss.default)
def _elementwise_loss(graph, new, old, mesh, rank):
    reduction = old.args[2] if len(old.args) > 2 else old.kwargs.get("reduction", 1)
    x = tensor_inputs(old)[0]
    in_spec = old.meta[M.STRATEGY].input_specs[0]
    ratio = math.prod(local_shape(x.meta["val"].shape, in_spec, mesh)) / math.prod(x.meta["val"].shape)
    if reduction != 1 or ratio == 1:
        return new
    with graph.inserting_after(new):
        return graph.call_function(aten.mul.Tensor, (new, ratio))


@localizer(aten.linear.default, aten.addmm.default, aten.baddbmm.default)
def _bias_once(graph, new, old, mesh, rank):
    # A bias added to a Partial output would be summed once per rank: add it on coordinate 0 of every partial
    # axis only. Its gradient passes straight through on every rank (the output's gradient is whole everywhere),
    # so no rank needs a backward all-reduce for it (see strategies.py: bias inputs of Partial outputs).
    axes = _partial_axes(_out_spec(old), mesh)
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


@localizer(aten.embedding.default)
def _embedding(graph, new, old, mesh, rank):
    spec = old.meta[M.STRATEGY].input_specs[0]
    vocab_axes = [a for a, p in enumerate(spec) if isinstance(p, Shard) and p.dim == 0]
    if not vocab_axes:
        return new
    rows = old.args[0].meta["val"].shape[0] // mesh.shape[vocab_axes[0]]
    offset = mesh.coords(rank)[mesh.names[vocab_axes[0]]] * rows
    padding_idx = new.args[2] if len(new.args) > 2 else new.kwargs.get("padding_idx", -1)
    return _replace(graph, new, local_kernels.masked_embedding, (new.args[0], new.args[1], offset, padding_idx))


def _replace(graph, new, fn, args) -> torch.fx.Node:
    with graph.inserting_before(new):
        repl = graph.call_function(fn, tuple(args))
    repl.meta.update(new.meta)
    new.replace_all_uses_with(repl)
    graph.erase_node(new)
    return repl


def _replace_first(graph, new, op, args) -> torch.fx.Node:
    """Replace ``new`` by element 0 of ``op(*args)`` (an op that also returns what its backward needs)."""
    with graph.inserting_before(new):
        call = graph.create_node("call_function", op, tuple(args), name=op.__name__.split(".")[0])
        first = graph.call_function(operator.getitem, (call, 0))
    first.meta.update(new.meta)
    new.replace_all_uses_with(first)
    graph.erase_node(new)
    return first


@localizer(aten.nll_loss_nd.default, aten.nll_loss.default)
def _nll_loss(graph, new, old, mesh, rank):
    spec = _out_spec(old)
    axes = tuple(mesh.names[a] for a in _partial_axes(spec, mesh))
    reduction = old.args[3] if len(old.args) > 3 else old.kwargs.get("reduction", 1)
    if not axes or reduction != 1:
        return new
    a = list(new.args) + [None] * (5 - len(new.args))
    weight = a[2] if a[2] is not None else new.kwargs.get("weight")
    ignore = old.args[4] if len(old.args) > 4 else old.kwargs.get("ignore_index", -100)
    return _replace(graph, new, local_kernels.cross_entropy_partial_mean, (a[0], a[1], weight, ignore, 0.0, axes, True))


@localizer(aten.dropout.default)
def _dropout(graph, new, old, mesh, rank):
    # Per-process RNG would give replicated copies different masks: use one global mask, sliced per rank.
    p, train = old.args[1], old.args[2]
    if not train or p == 0:
        return new  # no randomness: the op is the identity
    val = old.meta["val"]
    spec = _out_spec(old)
    seed = zlib.crc32(old.name.encode())
    offsets = list(shard_offsets(val.shape, spec, mesh, rank))
    return _replace_first(graph, new, torch.ops.autoshard.dropout.default,
                          (new.args[0], float(p), list(val.shape), offsets, seed))


@localizer(aten.native_dropout.default)
def _native_dropout(graph, new, old, mesh, rank):
    p, train = old.args[1], old.args[2] if len(old.args) > 2 else True
    if train and p:
        raise UnsupportedOpError(f"{node_location(old)} is native_dropout with p={p} in training mode; autoshard "
                                 "reproduces dropout masks across ranks only for aten.dropout. Use "
                                 "torch.nn.functional.dropout (or nn.Dropout), or p=0.")
    return new


@localizer(aten.unflatten.int)
def _unflatten(graph, new, old, mesh, rank):
    out = local_shape(old.meta["val"].shape, _out_spec(old), mesh)
    ndim = old.args[0].meta["val"].dim()
    dim = old.args[1] % ndim
    sizes = list(out[dim: dim + len(old.args[2])])
    new.args = (new.args[0], new.args[1], sizes) + tuple(new.args[3:])
    return new


@localizer(aten.cross_entropy_loss.default)
def _cross_entropy(graph, new, old, mesh, rank):
    spec = _out_spec(old)
    axes = tuple(mesh.names[a] for a in _partial_axes(spec, mesh))
    reduction = old.args[3] if len(old.args) > 3 else old.kwargs.get("reduction", 1)
    x_spec = old.meta[M.STRATEGY].input_specs[0]
    vocab = [mesh.names[a] for a, p in enumerate(x_spec) if isinstance(p, Shard) and p.dim == 1]
    ignore = old.args[4] if len(old.args) > 4 else old.kwargs.get("ignore_index", -100)
    if vocab:
        batch_axes = tuple(mesh.names[a] for a, p in enumerate(x_spec) if isinstance(p, Shard) and p.dim == 0)
        return _replace_first(graph, new, torch.ops.autoshard.vocab_parallel_cross_entropy.default,
                              (new.args[0], new.args[1], ignore, reduction, vocab[0], mesh.axis_size(vocab[0]),
                               list(batch_axes)))
    if not axes or reduction != 1:
        return new  # sum reduction is already a correct partial sum; 'none' has no reduction
    a = list(new.args) + [None] * (6 - len(new.args))
    weight = a[2] if a[2] is not None else new.kwargs.get("weight")
    smoothing = a[5] if len(old.args) > 5 else old.kwargs.get("label_smoothing", 0.0)
    return _replace(graph, new, local_kernels.cross_entropy_partial_mean, (a[0], a[1], weight, ignore, smoothing, axes))


@dataclass(frozen=True)
class Localize:
    """Rank ``ctx.rank``'s GraphModule from the global program: local shapes, local forms, local weights (from
    ``ctx.weights``, default the graph module itself). Graph-level metadata (``gm.meta``) is carried over."""

    name: str = "localize"
    phase: str = "rank"

    def run(self, gm: torch.fx.GraphModule, ctx: Context) -> torch.fx.GraphModule:
        mesh, rank = ctx.mesh, ctx.rank
        weights = gm if ctx.weights is None else ctx.weights
        graph = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        attrs: dict[str, torch.Tensor] = {}
        for old in gm.graph.nodes:
            new = graph.node_copy(old, lambda n: env[n])
            new.meta = {k: v for k, v in old.meta.items() if k != "val"}
            if old.op == "get_attr":
                attrs[old.target] = _local_attr(fetch_attr(weights, old.target), old.meta.get(M.SPEC), mesh, rank)
            elif old.op == "call_function" and old.target in LOCALIZERS:
                new = LOCALIZERS[old.target](graph, new, old, mesh, rank)
            env[old] = new
        graph._codegen = gm.graph._codegen  # the pytree calling convention; never mutated
        out = torch.fx.GraphModule(attrs, graph, class_name=f"Rank{rank}Module")
        for name in ("_in_spec", "_out_spec"):
            if hasattr(gm, name):
                setattr(out, name, getattr(gm, name))
        out.meta.update(gm.meta)
        return out


def _local_attr(full, spec: Spec | None, mesh: Mesh, rank: int):
    if not isinstance(full, torch.Tensor):
        return full
    local = full.detach() if spec is None else shard_tensor(full.detach(), spec, mesh, rank)
    if isinstance(full, torch.nn.Parameter):
        return torch.nn.Parameter(local.clone(), requires_grad=full.requires_grad)
    return local.clone()


def local_param_specs(gm: torch.fx.GraphModule) -> dict[str, Spec]:
    """{parameter FQN: spec} of every get_attr tensor of the annotated global graph."""
    return {n.meta.get(M.PARAM, n.target): n.meta[M.SPEC] for n in gm.graph.nodes
            if n.op == "get_attr" and isinstance(n.meta.get("val"), torch.Tensor)}



