"""Per-rank code generation: from the annotated global graph to one plain GraphModule per rank.

The global graph (after propagation and collective insertion) says, for every node, its global shape and its
spec. Localising it for rank ``r`` means:

* shapes written into the code (``view``/``reshape``/``expand`` targets) become the local shapes of their outputs;
* ops whose local form differs from their global one are rewritten by a handler in :data:`LOCALIZERS`
  (a mean over a sharded dim divides by the *global* count; a bias added to a Partial output is added once;
  a mean cross-entropy over a sharded batch divides by the global count of targets);
* every ``get_attr`` holds rank ``r``'s shard of the original weight, copied (no full copy is kept).

The result calls ``autoshard.runtime.collectives`` for communication, keeps the original calling convention
(the exported pytree in/out specs), and prints as readable Python (``Plan.code(rank)``); the same plan always
gives byte-identical code.
"""

from __future__ import annotations

import math
import operator
import zlib
from collections.abc import Callable

import torch
import torch.fx

from autoshard import meta as M
from autoshard.errors import UnsupportedOpError, node_location
from autoshard.graph_utils import tensor_inputs
from autoshard.mesh import Mesh
from autoshard.placements import Partial, Shard, Spec, local_shape, shard_offsets, shard_tensor
from autoshard.runtime import collectives as runtime_collectives
from autoshard.runtime import ops as runtime_ops
from autoshard.runtime import sequence as runtime_sequence
from autoshard.runtime.buckets import GRAD_SYNC
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
        scaled = graph.call_function(runtime_ops.bias_once, (new.args[bias_pos], keep))
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
    return _replace(graph, new, runtime_ops.masked_embedding, (new.args[0], new.args[1], offset, padding_idx))


def _replace(graph, new, fn, args) -> torch.fx.Node:
    with graph.inserting_before(new):
        repl = graph.call_function(fn, tuple(args))
    repl.meta.update(new.meta)
    new.replace_all_uses_with(repl)
    graph.erase_node(new)
    return repl


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
    return _replace(graph, new, runtime_ops.cross_entropy_partial_mean, (a[0], a[1], weight, ignore, 0.0, axes, True))


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
    return _replace(graph, new, runtime_ops.dropout,
                    (new.args[0], new.args[1], new.args[2], list(val.shape), offsets, seed))


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
        return _replace(graph, new, runtime_ops.vocab_parallel_cross_entropy,
                        (new.args[0], new.args[1], ignore, reduction, vocab[0], batch_axes))
    if not axes or reduction != 1:
        return new  # sum reduction is already a correct partial sum; 'none' has no reduction
    a = list(new.args) + [None] * (6 - len(new.args))
    weight = a[2] if a[2] is not None else new.kwargs.get("weight")
    smoothing = a[5] if len(old.args) > 5 else old.kwargs.get("label_smoothing", 0.0)
    return _replace(graph, new, runtime_ops.cross_entropy_partial_mean, (a[0], a[1], weight, ignore, smoothing, axes))


def localize(gm: torch.fx.GraphModule, mesh: Mesh, rank: int, weights: torch.nn.Module | None = None,
             bucket_grads: bool = False, defer_outputs: bool | None = None) -> torch.fx.GraphModule:
    """Rank ``rank``'s GraphModule. ``weights`` holds the full parameters (default: ``gm`` itself).

    ``bucket_grads``: leave out the ``grad_all_reduce`` of every parameter that feeds nothing else (its gradient
    is then exactly the local gradient, all-reduced over the node's axes) and list those parameters instead in
    ``module.meta[GRAD_SYNC]`` as ``((attribute name, axes), ...)`` in graph order, for
    :class:`autoshard.runtime.buckets.GradBucketer` to all-reduce in buckets, overlapped with backward; and start
    the all-reduces of returned values (the loss) asynchronously (``all_reduce_output``: waited when read, or by
    the bucketer at the end of backward). ``defer_outputs`` (default: ``bucket_grads``) controls the latter alone:
    pipeline stages, whose outputs go to ``send``, keep their output all-reduces blocking.
    """
    weights = gm if weights is None else weights
    defer_outputs = bucket_grads if defer_outputs is None else defer_outputs
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    attrs: dict[str, torch.Tensor] = {}
    syncs: list[tuple[str, tuple[str, ...]]] = []
    for old in gm.graph.nodes:
        if bucket_grads and _is_param_grad_sync(old):
            env[old] = env[old.args[0]]
            syncs.append((old.args[0].target, tuple(old.args[1])))
            continue
        if bucket_grads and _is_lookup_grad_sync(old):
            # a replicated lookup of a parameter (position embeddings): all-reducing the rows' gradients is
            # all-reducing the parameter's (the lookup is linear in it, the rows distinct), so it joins the buckets
            env[old] = env[old.args[0]]
            syncs.append((old.args[0].args[0].target, tuple(old.args[1])))
            continue
        if _is_gather_then_sync(old):
            # all_gather + grad_all_reduce on the same axis: one op whose backward is a reduce-scatter
            gathered = env[old.args[0]]
            with graph.inserting_after(gathered):
                fused = graph.call_function(runtime_sequence.all_gather_sync, (*gathered.args, tuple(old.args[1])))
            fused.meta = {k: v for k, v in old.meta.items() if k != "val"}
            graph.erase_node(gathered)
            env[old.args[0]] = env[old] = fused
            continue
        new = graph.node_copy(old, lambda n: env[n])
        new.meta = {k: v for k, v in old.meta.items() if k != "val"}
        if defer_outputs and _is_output_mean_loss(old, env):
            # all_reduce(cross_entropy_partial_mean(...)) returned: the global target count started at the top of
            # forward (target_count_started, hoisted), the loss sum's all-reduce left in flight
            ce = env[old.args[0]]
            logits, target, weight, ignore, smoothing, _, *log_probs = ce.args
            with graph.inserting_before(ce):
                count = graph.call_function(runtime_ops.target_count_started,
                                            (target, weight, ignore, old.args[1], old.meta["val"].dtype))
            new.target = runtime_ops.cross_entropy_mean_output
            new.args = (logits, target, weight, ignore, smoothing, old.args[1], *(log_probs or [False]))
            new.kwargs = {"count": count}
            graph.erase_node(ce)
            _hoist(graph, count)
        elif defer_outputs and _is_output_all_reduce(old):
            new.target = runtime_collectives.all_reduce_output  # waited by the bucketer or when read
        elif _reduces_a_dead_matmul(old):
            new.target = runtime_collectives.all_reduce_  # in place: no output buffer
        if old.op == "get_attr":
            attrs[old.target] = _local_attr(fetch_attr(weights, old.target), old.meta.get(M.SPEC), mesh, rank)
        elif old.op == "call_function" and old.target in LOCALIZERS:
            new = LOCALIZERS[old.target](graph, new, old, mesh, rank)
        env[old] = new
    _fuse_linears_grad_all_reduce(graph)
    graph._codegen = gm.graph._codegen  # the pytree calling convention; never mutated
    graph.lint()
    out = torch.fx.GraphModule(attrs, graph, class_name=f"Rank{rank}Module")
    for name in ("_in_spec", "_out_spec"):
        if hasattr(gm, name):
            setattr(out, name, getattr(gm, name))
    if bucket_grads:
        out.meta[GRAD_SYNC] = tuple(syncs)
    return out


def _hoist(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    """Move ``node`` and the aten ops it depends on (views of the targets, say) to just after the program's inputs
    and parameters, so that its collective starts at the beginning of forward. Left where it is when it depends on
    anything else (a collective, a runtime function), which would change the order of collectives."""
    first = next((n for n in graph.nodes if n.op not in ("placeholder", "get_attr")), None)
    if first is None or first is node:
        return
    chain: list[torch.fx.Node] = []
    stack, seen = list(node.all_input_nodes), set()
    while stack:
        n = stack.pop()
        if n in seen or n.op in ("placeholder", "get_attr"):
            continue
        seen.add(n)
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            return
        chain.append(n)
        stack.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(graph.nodes)}
    if any(order[n] > order[first] for inp in [node, *chain] for n in inp.all_input_nodes
           if n.op in ("placeholder", "get_attr")):
        return  # an input defined after the first op: leave the graph as it is
    for n in sorted(chain, key=order.__getitem__) + [node]:
        first.prepend(n)


def _is_gather_then_sync(node: torch.fx.Node) -> bool:
    """``grad_all_reduce(all_gather(x, axis, dim), axes)`` with ``axis`` in ``axes``, the gather used only there."""
    if node.op != "call_function" or node.target is not runtime_collectives.grad_all_reduce:
        return False
    src = node.args[0]
    return (isinstance(src, torch.fx.Node) and src.op == "call_function"
            and src.target is runtime_collectives.all_gather and len(src.users) == 1
            and src.args[1] in tuple(node.args[1]))


def _fuse_linears_grad_all_reduce(graph: torch.fx.Graph) -> None:
    """``grad_all_reduce(x)`` read only by linears (column-parallel q/k/v, fc1) becomes one
    ``linears_grad_all_reduce`` whose backward overlaps the input gradient's all-reduce with the weight gradients."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not runtime_collectives.grad_all_reduce:
            continue
        users = sorted(node.users, key=lambda u: order.get(u, len(order)))
        if not users or not all(_is_linear_of(u, node) for u in users):
            continue
        params = [p for u in users for p in (u.args[1], u.args[2] if len(u.args) > 2 else None)]
        first = users[0]
        late = [p for p in params if isinstance(p, torch.fx.Node) and order[p] > order[first]]
        if any(p.op != "call_function" or any(order.get(a, len(order)) > order[first] for a in p.all_input_nodes)
               for p in late):
            continue  # a weight computed from values made after the first linear: leave the graph as it is
        for p in late:  # a weight's own sync (grad_all_reduce of a parameter): move it up, before the linears
            first.prepend(p)
        with graph.inserting_before(first):
            fused = graph.call_function(runtime_collectives.linears_grad_all_reduce,
                                        (node.args[0], node.args[1], *params))
            fused.meta = dict(node.meta)
            for i, u in enumerate(users):
                item = graph.call_function(operator.getitem, (fused, i))
                item.meta = dict(u.meta)
                u.replace_all_uses_with(item)
        for u in users:
            graph.erase_node(u)
        graph.erase_node(node)


def _is_linear_of(user: torch.fx.Node, x: torch.fx.Node) -> bool:
    return (user.op == "call_function" and user.target is torch.ops.aten.linear.default and user.args[0] is x
            and x not in user.args[1:] and not user.kwargs)


# ops whose backward keeps their inputs, not their result (so the result may be overwritten)
_MATMULS = {torch.ops.aten.linear.default, torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
            torch.ops.aten.matmul.default, torch.ops.aten.bmm.default, torch.ops.aten.add.Tensor,
            torch.ops.aten.sub.Tensor}


def _reduces_a_dead_matmul(node: torch.fx.Node) -> bool:
    """``all_reduce(y)`` where ``y`` is a matmul's (or sum's) result, which its backward does not keep, read only
    here: the row-parallel linear's Partial output (plus the residual), summed in place."""
    if node.op != "call_function" or node.target is not runtime_collectives.all_reduce:
        return False
    src = node.args[0]
    return (isinstance(src, torch.fx.Node) and src.op == "call_function" and src.target in _MATMULS
            and len(src.users) == 1)


def _is_output_mean_loss(node: torch.fx.Node, env: dict) -> bool:
    """A returned ``all_reduce(x, axis)`` whose localized ``x`` is ``cross_entropy_partial_mean(..., (axis,))`` read
    only there (the data-parallel loss)."""
    if not _is_output_all_reduce(node) or len(node.args[0].users) != 1:
        return False
    src = env[node.args[0]]
    return (src.op == "call_function" and src.target is runtime_ops.cross_entropy_partial_mean
            and tuple(src.args[5]) == (node.args[1],))


def _is_output_all_reduce(node: torch.fx.Node) -> bool:
    """An ``all_reduce`` whose result only leaves the program (the data-parallel loss)."""
    return (node.op == "call_function" and node.target is runtime_collectives.all_reduce and bool(node.users)
            and all(u.op == "output" for u in node.users))


def _is_lookup_grad_sync(node: torch.fx.Node) -> bool:
    """``grad_all_reduce(embedding(param, arange(...)))``: the parameter used only there, the ids distinct constants
    (so each row's gradient is the lookup's gradient at one position, and syncing either is the same sum)."""
    if node.op != "call_function" or node.target is not runtime_collectives.grad_all_reduce:
        return False
    src = node.args[0]
    if not (isinstance(src, torch.fx.Node) and src.op == "call_function"
            and src.target is torch.ops.aten.embedding.default and len(src.users) == 1):
        return False
    weight, ids = src.args[0], src.args[1]
    return (isinstance(weight, torch.fx.Node) and weight.op == "get_attr" and len(weight.users) == 1
            and isinstance(weight.meta.get("val"), torch.Tensor) and isinstance(ids, torch.fx.Node)
            and ids.op == "call_function" and ids.target in _ARANGES)


_ARANGES = (torch.ops.aten.arange.default, torch.ops.aten.arange.start, torch.ops.aten.arange.start_step)


def _is_param_grad_sync(node: torch.fx.Node) -> bool:
    """A parameter's data-parallel gradient sync: ``grad_all_reduce(get_attr)``, the parameter's only use."""
    if node.op != "call_function" or node.target is not runtime_collectives.grad_all_reduce:
        return False
    src = node.args[0]
    return (isinstance(src, torch.fx.Node) and src.op == "get_attr" and len(src.users) == 1
            and isinstance(src.meta.get("val"), torch.Tensor))


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



