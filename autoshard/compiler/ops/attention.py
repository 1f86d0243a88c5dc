"""Attention: scaled_dot_product_attention shards batch and heads (queries too when not causal) — and, as
context parallelism, the sequence of queries, keys and values together on one axis.

The context-parallel strategies are variants of the rule (:class:`~autoshard.compiler.ops.dimmap.DimMap` ``variants``):
q, k, v ``Shard(seq)`` on one axis (the mask its query rows), output ``Shard(seq)``, once per local form —
``ring``, ``all_gather`` and ``ulysses`` (only where the local heads divide by the axis) — so both planners see
them as strategies of the op and the search prices each: its compute is split n ways (every query row still meets
every key), the saved activations are the local q, k, v and output, and :func:`context_comm` prices what the form
itself sends. The local form (:func:`_localize`) is :func:`autoshard.runtime.context.context_attention`; with
head-tail load balancing on the axis (``gm.meta[autoshard.meta.CONTEXT]``) it reads its chunks in that layout.
"""

from __future__ import annotations

import math

import torch

from autoshard import meta as M
from autoshard.errors import PlanError
from autoshard.compiler.ops.dimmap import DimMap, OpInfo, broadcast_labels
from autoshard.compiler.ops.local import arg, replace_node
from autoshard.compiler.ops.registry import OUTPUT, Shapes, Workspace, op
from autoshard.placements import Shard, local_shape

aten = torch.ops.aten

#: The local forms of context-parallel attention, in the order the greedy planner prefers them at equal bytes.
CONTEXT_FORMS = ("ring", "all_gather", "ulysses")


def sdpa_flops(op: Shapes):
    """2·b·h·s_q·s_kv·(d + d_v); causal attention counted in full (the math and CPU kernels compute it)."""
    q, k, v = op.shape(0), op.shape(1), op.shape(2)
    return 2 * math.prod(q[:-1]) * k[-2] * (q[-1] + v[-1])


def context_axis_of(strategy: M.Strategy, q_ndim: int) -> int | None:
    """The mesh axis index a context-parallel strategy shards the sequence on (None for other strategies)."""
    if ":" not in strategy.note:
        return None
    q = strategy.input_specs[0]
    return next(a for a, p in enumerate(q) if isinstance(p, Shard) and p.dim == q_ndim - 2)


def context_form(strategy: M.Strategy) -> str | None:
    return strategy.note.split(":", 1)[0] if ":" in strategy.note else None


def ulysses_valid(strategy: M.Strategy, in_shapes, mesh) -> bool:
    a = context_axis_of(strategy, len(in_shapes[0]))
    n = mesh.shape[a]
    return all(local_shape(in_shapes[i], strategy.input_specs[i], mesh)[-3] % n == 0 for i in (0, 1, 2))


def context_comm(node: torch.fx.Node, strategy: M.Strategy, mesh, profile, backward: bool = True) -> float:
    """Seconds (forward + backward; forward alone without ``backward``: what a recomputed region sends again) a
    context-parallel form sends by itself, by the alpha-beta model: ring 2(n-1) sends of the local K/V forward, as
    many again and 2(n-1) of dK/dV backward; all-gather two all-gathers forward, two and two reduce-scatters
    backward; Ulysses four all-to-alls forward (q, k, v, out) and eight backward."""
    from autoshard.cost_models.alpha_beta import collective_time
    from autoshard.frontend.graph_utils import itemsize

    form = context_form(strategy)
    if form is None:
        return 0.0
    q, k, v = node.args[:3]
    a = context_axis_of(strategy, len(q.meta["val"].shape))
    axis, n = mesh.names[a], mesh.shape[a]
    link = profile.link_for(axis, a, mesh)

    def local_bytes(i, x):
        return math.prod(local_shape(tuple(x.meta["val"].shape), strategy.input_specs[i], mesh)) * itemsize(x)

    kb, vb, qb = local_bytes(1, k), local_bytes(2, v), local_bytes(0, q)
    grad = bool(node.meta.get(M.REQUIRES_GRAD)) and backward
    if form == "ring":
        fwd = (n - 1) * (collective_time("send_recv", kb, 2, link) + collective_time("send_recv", vb, 2, link))
        return fwd * (3 if grad else 1)
    if form == "all_gather":
        fwd = collective_time("all_gather", kb * n, n, link) + collective_time("all_gather", vb * n, n, link)
        bwd = fwd + collective_time("reduce_scatter", kb * n, n, link) + collective_time("reduce_scatter", vb * n,
                                                                                         n, link)
        return fwd + (bwd if grad else 0.0)
    one = collective_time("all_to_all", qb, n, link)
    return (4 + (8 if grad else 0)) * one


#: Score-sized fp32 blocks ``[b, h, c, c]`` the block kernel of context attention (``runtime/context.py``) holds at
#: once beyond its inputs and outputs, measured with a storage tracker on ``_forward``/``_backward`` (b 8, h 8,
#: c 256, ring, one rank): 6.1 in forward (the scores before and after masking, ``exp(s - lse)``, its zero fill,
#: the result), 7.1 in backward (p again, dO·Vᵀ, its difference with delta, dS and their products); the larger.
SCORE_BLOCKS = 7


def sdpa_workspace(node: torch.fx.Node, strategy: M.Strategy, mesh) -> Workspace:
    """What attention allocates besides its output on one rank (the ``workspace`` facet).

    - Whole attention (no context form) with a boolean mask: sdpa converts the mask to a float mask of q's dtype
      (0 / -inf, the mask's local shape), kept for backward when the attention has a gradient, else transient.
      Every attention reading one mask keeps the same copy (``kept_key``: the rank program converts the mask once,
      :func:`_share_additive_mask`). The CPU and flash kernels work in small blocks: nothing else counts.
    - A context form: :data:`SCORE_BLOCKS` fp32 score blocks ``[b, h, c, c]`` of the local batch and heads (Ulysses:
      the heads over the axis), ``c`` the chunk length (the local sequence, halved under head-tail balancing),
      plus the K/V the form holds besides its own: ring the two blocks in flight, all-gather the whole sequence's,
      Ulysses the re-sharded q, k, v and output.
    """
    from autoshard.frontend.graph_utils import itemsize

    q, k, v = node.args[:3]
    q_local = local_shape(tuple(q.meta["val"].shape), strategy.input_specs[0], mesh)
    form = context_form(strategy)
    if form is None:
        mask = arg(node, 3, "attn_mask")
        if not _is_bool_mask(mask):
            return Workspace()
        size = math.prod(local_shape(tuple(mask.meta["val"].shape), strategy.input_specs[3], mesh)) * itemsize(q)
        if node.meta.get(M.REQUIRES_GRAD):
            return Workspace(kept=size, kept_key=("additive_mask", mask))
        return Workspace(transient=size)
    n = mesh.shape[context_axis_of(strategy, len(q_local))]
    layout = node.graph.owning_module.meta.get(M.CONTEXT) if node.graph.owning_module is not None else None
    balanced = bool(layout is not None and layout.balance and layout.axis == mesh.names[context_axis_of(
        strategy, len(q_local))])
    c = q_local[-2] // (2 if balanced else 1)
    heads = q_local[-3] // (n if form == "ulysses" else 1)
    acc = 8 if q.meta["val"].dtype == torch.float64 else 4
    scores = SCORE_BLOCKS * math.prod(q_local[:-3]) * heads * c * c * acc

    def local_bytes(i, x):
        return math.prod(local_shape(tuple(x.meta["val"].shape), strategy.input_specs[i], mesh)) * itemsize(x)

    kv = local_bytes(1, k) + local_bytes(2, v)
    moved = {"ring": 2 * kv, "all_gather": n * kv, "ulysses": 2 * (local_bytes(0, q) + kv)}[form]
    return Workspace(transient=scores + moved)


def _is_bool_mask(x) -> bool:
    return isinstance(x, torch.fx.Node) and isinstance(x.meta.get("val"), torch.Tensor) and \
        x.meta["val"].dtype == torch.bool


def _plain_readers(mask: torch.fx.Node) -> list[torch.fx.Node]:
    """The attention nodes of the global graph that read ``mask`` as their mask and run whole (no context form)."""
    return [u for u in mask.users if u.target == aten.scaled_dot_product_attention.default
            and arg(u, 3, "attn_mask") is mask and M.STRATEGY in u.meta and context_form(u.meta[M.STRATEGY]) is None]


def _share_additive_mask(graph: torch.fx.Graph, new: torch.fx.Node, old: torch.fx.Node) -> torch.fx.Node:
    """Where several attentions read one boolean mask, pass them one float copy made once (``additive_mask``):
    sdpa converts a boolean mask to that very tensor on each call and keeps its copy for backward, so L layers
    would keep L copies of a [b, 1, s, s] float mask (at sequence 4096, batch 8: 512 MiB each). One attention
    alone is left as traced (the conversion inside sdpa costs the same)."""
    from autoshard.runtime.ops import additive_mask

    mask, old_mask = arg(new, 3, "attn_mask"), arg(old, 3, "attn_mask")
    if not (_is_bool_mask(old_mask) and isinstance(mask, torch.fx.Node) and len(_plain_readers(old_mask)) > 1):
        return new
    dtype = old.args[0].meta["val"].dtype
    made = next((u for u in mask.users if u.target is additive_mask and u.args[1] == dtype), None)
    if made is None:
        with graph.inserting_after(mask):
            made = graph.call_function(additive_mask, (mask, dtype))
        made.meta.update({k: v for k, v in mask.meta.items() if k != "val"})
        made.meta["val"] = torch.empty_like(mask.meta["val"], dtype=dtype) if "val" in mask.meta else None
    if len(new.args) > 3:
        new.args = (*new.args[:3], made, *new.args[4:])
    else:
        new.kwargs = {**new.kwargs, "attn_mask": made}
    return new


def _localize(graph: torch.fx.Graph, new: torch.fx.Node, old: torch.fx.Node, mesh, rank: int) -> torch.fx.Node:
    strategy = old.meta[M.STRATEGY]
    form = context_form(strategy)
    if form is None:
        return _share_additive_mask(graph, new, old)
    from autoshard.frontend.graph_utils import node_location
    from autoshard.runtime.context import context_attention

    q, k, v = new.args[:3]
    a = context_axis_of(strategy, len(old.args[0].meta["val"].shape))
    axis, n = mesh.names[a], mesh.shape[a]
    layout = old.graph.owning_module.meta.get(M.CONTEXT) if old.graph.owning_module is not None else None
    balanced = bool(layout is not None and layout.axis == axis and layout.balance)
    if float(arg(new, 4, "dropout_p", 0.0) or 0.0) != 0.0:
        raise PlanError(f"{node_location(old)} runs attention with dropout_p={arg(new, 4, 'dropout_p')}, but "
                        "context-parallel attention has no attention dropout. Set the model's attention dropout "
                        "to 0, or leave the sequence unsharded on this attention.")
    length = old.args[0].meta["val"].shape[-2]
    if balanced and length % (2 * n):
        raise PlanError(f"{node_location(old)} has sequence {length}, but head-tail load balancing on axis "
                        f"`{axis}` of size {n} needs a sequence divisible by {2 * n}.")
    if form == "ulysses" and not ulysses_valid(strategy, [tuple(x.meta["val"].shape) for x in old.args[:3]],
                                                mesh):
        raise PlanError(f"{node_location(old)} cannot run Ulysses attention on axis `{axis}` of size {n}: its "
                        "local query and key/value heads must divide by the axis size. Use attention='ring' or "
                        "'all_gather'.")
    mask = arg(new, 3, "attn_mask")
    causal = bool(arg(new, 5, "is_causal", False))
    scale = arg(new, 6, "scale")
    return replace_node(graph, new, context_attention, (q, k, v, mask, axis, n, form, causal, balanced, scale))


# Backward ≈ 2.5× (FlashAttention recomputes the scores: 5 matmuls against 2); q, k, v, the output and its
# log-sum-exp are kept.
op(aten.scaled_dot_product_attention, aten._scaled_dot_product_flash_attention,
   aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_flash_attention_for_cpu,
   aten._scaled_dot_product_cudnn_attention, flops=sdpa_flops, backward=2.5, saves=(0, 1, 2, OUTPUT),
   compute_kind="attention")


@op(aten.scaled_dot_product_attention.default, localize=_localize, comm=context_comm, workspace=sdpa_workspace)
def _sdpa(info: OpInfo) -> DimMap:
    q, k, _v = info.in_shapes[:3]
    causal = bool(info.arg(5, "is_causal", False))
    batch = [f"b{i}" for i in range(len(q) - 3)]
    head = "h"  # with GQA both head counts must divide by the axis: local groups stay aligned
    sq = None if causal else "s"
    out = tuple(batch) + (head, sq, None)
    ins = [tuple(batch) + (head, sq, None), tuple(batch) + (head, None, None), tuple(batch) + (head, None, None)]
    seq = (*batch, head, "s", None)  # context parallelism: queries, keys and values sharded along the sequence
    cp_ins = [seq, seq, seq]
    has_mask = len(info.in_shapes) > 3 and info.in_shapes[3] is not None
    if has_mask:
        full = (*batch, head, sq, None)
        ins.append(broadcast_labels(info.in_shapes[3], (*q[:-1], k[-2]), full))
        cp_ins.append(broadcast_labels(info.in_shapes[3], (*q[:-1], k[-2]), seq))
    variants = ()
    if q[-2] == k[-2]:  # self-attention: one sequence for queries and keys
        cp = DimMap(tuple(cp_ins), (seq,))
        variants = tuple((form, cp, ulysses_valid if form == "ulysses" else None) for form in CONTEXT_FORMS)
    return DimMap(tuple(ins), (out,), variants=variants)
