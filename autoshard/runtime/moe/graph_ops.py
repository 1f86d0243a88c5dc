"""The graph ops the expert rewrite (``passes/expert_rewrite.py``) emits for each MoE layer.

Every op takes the routing group as its leading dim (``[G, T_g, ...]``; their rules in
``autoshard/compiler/ops/moe.py`` shard it) and never reads tensor values for a shape, so each traces with fake
tensors:

* :func:`route_groups`, :func:`gate_groups`: :func:`autoshard.runtime.moe.routing.route` per group; the gate weights.
* :func:`dispatch_groups`, :func:`combine_groups`: tokens ``[G, T, h]`` to the expert buffer ``[E, G, C, h]``
  and back (index scatter / gather; the all-to-alls between them come from propagation).
* :func:`first_fraction`, :func:`aux_terms`, :func:`routing_stats`: this rank's shares of the global
  load-balancing and z losses, and its routing statistics.
* :func:`attach`: the auxiliary losses' gradients ride on the activation; the statistics of each forward are
  recorded in :mod:`autoshard.runtime.moe.records` under the compiled model's key.
"""

from __future__ import annotations

import torch
from torch import Tensor

from autoshard.runtime.moe.records import record
from autoshard.runtime.moe.routing import route

__all__ = ["attach", "aux_terms", "combine_groups", "dispatch_groups", "first_fraction", "gate_groups",
           "route_groups", "routing_stats"]


def route_groups(logits: Tensor, top_k: int, capacity: int):
    """:func:`~autoshard.runtime.moe.routing.route` per group on ``logits[G, T, E]``: (expert_index, position, keep),
    each ``[G, T, k]``.

    Integer outputs only: the differentiable gate comes from :func:`gate_groups` on the router softmax, a
    single-output op, so gradient bookkeeping never has to look through a tuple."""
    parts = [route(logits[g], top_k, capacity) for g in range(logits.shape[0])]
    return tuple(torch.stack([p[i] for p in parts]) for i in (0, 1, 3))


def gate_groups(probs: Tensor, expert_index: Tensor) -> Tensor:
    """Combine weights ``[G, T, k]``: the chosen probabilities, renormalised over the ``k`` choices when k >= 2
    (before dropping, as GShard), the raw probability for k == 1 (Switch)."""
    chosen = torch.gather(probs, -1, expert_index)
    return chosen if expert_index.shape[-1] == 1 else chosen / chosen.sum(dim=-1, keepdim=True)


def _flat_slots(expert_index: Tensor, position: Tensor, keep: Tensor, experts: int, capacity: int,
                fill: int) -> Tensor:
    """Row of each choice in the buffer ``[E, G, C, h]`` seen as ``[E·G·C, h]``; ``fill`` for dropped choices."""
    groups = expert_index.shape[0]
    group = torch.arange(groups, device=expert_index.device).view(groups, 1, 1)
    row = expert_index * (groups * capacity) + group * capacity + position
    return torch.where(keep, row, fill)


def dispatch_groups(x: Tensor, expert_index: Tensor, position: Tensor, keep: Tensor, num_experts: int,
                    capacity: int) -> Tensor:
    """Scatter tokens ``x[G, T, h]`` into the expert buffer ``[E, G, C, h]`` (unfilled slots zero).

    One row copy per kept choice (``index_put_`` into distinct rows, whose backward is a gather); dropped choices
    go to a trash row that is sliced off. ``O(T·k·h)`` work, no ``[T, E, C]`` tensor, no transpose copy."""
    groups, tokens, hidden = x.shape
    trash = num_experts * groups * capacity
    rows = _flat_slots(expert_index, position, keep, num_experts, capacity, trash)
    buf = x.new_zeros(trash + 1, hidden)
    flat_x = x.reshape(groups * tokens, hidden)
    for c in range(rows.shape[2]):
        buf.index_put_((rows[:, :, c].reshape(-1),), flat_x)
    return buf[:trash].view(num_experts, groups, capacity, hidden)


def combine_groups(y: Tensor, expert_index: Tensor, position: Tensor, gate: Tensor, keep: Tensor) -> Tensor:
    """Gather ``y[E, G, C, h]`` back to tokens ``[G, T, h]``: ``Σ_c keep·gate·y[e, g, position]`` (index select)."""
    experts, groups, cap, hidden = y.shape
    tokens = expert_index.shape[1]
    flat = y.reshape(experts * groups * cap, hidden)
    rows = _flat_slots(expert_index, position, keep, experts, cap, 0)  # dropped: any row, weight 0 below
    weight = (gate * keep).to(y.dtype)
    out = None
    for c in range(rows.shape[2]):
        picked = flat.index_select(0, rows[:, :, c].reshape(-1)).view(groups, tokens, hidden)
        term = weight[:, :, c, None] * picked
        out = term if out is None else out + term
    return out


def first_fraction(expert_index: Tensor, num_experts: int, total_tokens: int) -> Tensor:
    """``[E]``: this rank's first choices per expert over the *global* token count (sums to f over ranks)."""
    first = expert_index[..., 0].reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.float32, device=first.device)
    counts.index_add_(0, first, torch.ones(first.shape, dtype=torch.float32, device=first.device))
    return counts / total_tokens


def aux_terms(probs: Tensor, logits: Tensor, fraction: Tensor, num_experts: int, total_tokens: int) -> Tensor:
    """``[G, 2]``: per group, its share of the load-balancing loss ``E·Σ_i f_i·P_i`` and of the z-loss (unscaled)."""
    share = probs.sum(dim=1) / total_tokens  # [G, E]: this group's part of P
    lb = num_experts * (share * fraction.detach()).sum(dim=-1)
    z = torch.logsumexp(logits.float(), dim=-1).square().sum(dim=1) / total_tokens
    return torch.stack([lb, z], dim=1)


def routing_stats(expert_index: Tensor, keep: Tensor, terms: Tensor, num_experts: int) -> Tensor:
    """``[2 + 2E]`` (no gradient): this rank's [lb, z, routed per expert..., kept per expert...] (sums over ranks)."""
    flat = expert_index.reshape(-1)
    ones = torch.ones(flat.shape, dtype=torch.float32, device=flat.device)
    routed = torch.zeros(num_experts, dtype=torch.float32, device=flat.device).index_add_(0, flat, ones)
    kept = torch.zeros(num_experts, dtype=torch.float32, device=flat.device).index_add_(
        0, flat, keep.reshape(-1).to(torch.float32))
    return torch.cat([terms.detach().sum(dim=0).float(), routed, kept])


class _Attach(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, terms, alpha, beta):
        ctx.shape, ctx.dtype, ctx.weights = terms.shape, terms.dtype, (alpha, beta)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        scale = torch.tensor(ctx.weights, dtype=ctx.dtype, device=grad.device)
        return grad, scale.expand(ctx.shape), None, None


def attach(out: Tensor, terms: Tensor, stats: Tensor, key: str, layer: str, alpha: float, beta: float,
           top_k: int) -> Tensor:
    """Identity on ``out``; its backward also gives the loss terms their gradient (``α`` for ``lb``, ``β`` for
    ``z``), so the auxiliary losses train the router through the model's own ``loss.backward()``. Records the
    (replicated) ``stats`` of this forward under the compiled model's record ``key`` and the layer's path
    (:func:`autoshard.runtime.moe.records.record`), for :func:`moe_losses` and :func:`moe_stats`."""
    if not _is_fake(stats):
        record(key, layer, stats.detach(), alpha, beta, top_k)
    if not torch.is_grad_enabled() or not terms.requires_grad:
        return out.view_as(out)
    return _Attach.apply(out, terms, alpha, beta)


def _is_fake(t: Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor) or t.device.type == "meta"


def slot_groups(expert_index: Tensor, num_experts: int, capacity: int):
    """GShard positions of given choices ``expert_index[G, T, k]`` per group: (position, keep), each ``[G, T, k]``.

    A choice's position counts the choices routed to the same expert before it in choice-major order (every
    first choice in token order, then every second choice, ...), as :func:`autoshard.runtime.moe.routing.route` does;
    ``keep = position < capacity``."""
    groups, tokens, k = expert_index.shape
    flat = expert_index.transpose(1, 2).reshape(groups, tokens * k)  # choice-major per group
    by_expert = torch.argsort(flat, dim=1, stable=True)
    counts = torch.zeros(groups, num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(1, flat, torch.ones_like(flat))
    first_rank = torch.cumsum(counts, 1) - counts
    rank = torch.arange(tokens * k, device=flat.device).expand(groups, -1)
    sorted_expert = torch.gather(flat, 1, by_expert)
    pos_sorted = rank - torch.gather(first_rank, 1, sorted_expert)
    position = torch.empty_like(flat).scatter_(1, by_expert, pos_sorted)
    position = position.view(groups, k, tokens).transpose(1, 2).contiguous()
    return position, position < capacity
