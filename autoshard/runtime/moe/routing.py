"""The routing math of one MoE layer as plain functional torch ops (Switch Transformer / GShard semantics).

These are the per-group building blocks: the group ops the expert rewrite emits (:mod:`autoshard.runtime.moe.graph_ops`)
apply :func:`route` to every routing group, and :func:`capacity` sizes their buffers. Nothing here is distributed,
nothing reads options or records, and nothing depends on tensor *values* for a shape: every function traces with
fake tensors.

The math, for ``T`` tokens ``x[T, h]``, ``E`` experts, ``k`` choices per token (``top_k``):

* Capacity (:func:`capacity`): ``C = ceil(k * T / E * capacity_factor)``, at least 1, from static shapes only —
  every rank computes the same number locally, never by a collective.
* Routing (:func:`route`): ``p = softmax(logits)`` in float32. Each token's ``k`` experts are those with the
  largest ``p`` (ties go to the lower expert index). The *position* of choice ``(t, c)`` inside its expert ``e``
  counts the choices routed to ``e`` before it in GShard order: all first choices, in token order, then all second
  choices, in token order. So first choices take capacity before any second choice. ``keep = position < C``;
  a dropped choice contributes nothing (a token with every choice dropped gets a zero MoE output and is carried
  by the residual). Gate weights: for ``k == 1`` (Switch) the raw probability ``p[t, e]``, so experts upcycled
  from one dense FFN give ``gate * dense(x)``; for ``k >= 2`` the ``k`` chosen probabilities renormalised to
  sum to 1 — *before* dropping, so a token that loses its second choice keeps its first choice's renormalised
  weight (GShard), rather than being scaled back up to 1.
* Dispatch (:func:`dispatch`): ``buf[e, position[t, c]] = x[t]`` for every kept ``(t, c)`` with
  ``e = expert_index[t, c]``; unfilled slots are zero. Index scatter: ``O(T·k·h)`` work, buffer ``[E, C, h]``.
* Experts (:func:`expert_ffn`): per expert ``act(buf @ w1 + b1) @ w2 + b2`` as batched matmuls, or gated
  (SwiGLU-style) ``(act(buf @ w_gate) * (buf @ w1 + b1)) @ w2 + b2``.
* Combine (:func:`combine`): ``out[t] = Σ_c keep[t, c] · gate[t, c] · y[expert_index[t, c], position[t, c]]``
  (index gather).
* Auxiliary losses: :func:`load_balancing_loss` ``= E · Σ_i f_i · P_i`` (``f_i`` fraction of tokens whose first
  choice is ``i``, before capacity, no gradient; ``P_i`` mean router probability of ``i``, with gradient), which
  is 1 for uniform routing at any ``E``; :func:`z_loss` ``= mean_t(logsumexp(logits[t])²)``. The caller scales
  them (α) and attaches them to the activation's autograd graph.

:func:`dispatch_dense_onehot` and :func:`combine_dense_onehot` are the GShard einsum formulation (a one-hot
``[T, E, C]`` mask, ``O(T·E·C·h)`` work); they exist as a cross-check and for ``bench/moe_dispatch.py`` only.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from autoshard.errors import PlanError

__all__ = [
    "ACTIVATIONS",
    "Routing",
    "capacity",
    "combine",
    "combine_dense_onehot",
    "dispatch",
    "dispatch_dense_onehot",
    "expert_ffn",
    "load_balancing_loss",
    "route",
    "stats",
    "z_loss",
]


class Routing(NamedTuple):
    """The router's decision for ``T`` tokens and ``k`` choices each (see the module docstring)."""

    expert_index: Tensor  # [T, k] int64: the chosen experts, most probable first
    position: Tensor  # [T, k] int64: slot inside the expert, GShard order; >= capacity when dropped
    gate: Tensor  # [T, k] float32: combine weight (raw prob for k == 1, renormalised over the k choices otherwise)
    keep: Tensor  # [T, k] bool: position < capacity
    probs: Tensor  # [T, E] float32: the router softmax


ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


def _check_top_k(top_k: int, num_experts: int) -> None:
    if num_experts < 1:
        raise PlanError(
            f"MoE num_experts has {num_experts}, but at least 1 expert is needed. Set num_experts >= 1."
        )
    if not 1 <= top_k <= num_experts:
        raise PlanError(
            f"MoE top_k has {top_k}, but it must lie in [1, num_experts={num_experts}]. "
            "Use top_k=1 (Switch) or top_k=2 (GShard) with at least that many experts."
        )


def capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert: ``ceil(top_k * num_tokens / num_experts * capacity_factor)``, at least 1.

    Pure integer/rational arithmetic on static sizes, so every rank gets the same number without a collective.
    ``capacity_factor`` is taken as the decimal it prints as (``1.1`` is 11/10), so binary float rounding never
    adds a slot: ``capacity(50, 1, 1, 1.1) == 55``, not 56.
    """
    _check_top_k(top_k, num_experts)
    if num_tokens < 0:
        raise PlanError(f"MoE num_tokens has {num_tokens}, but it must be >= 0. Pass the static token count.")
    if not (math.isfinite(capacity_factor) and capacity_factor > 0):
        raise PlanError(
            f"MoE capacity_factor has {capacity_factor}, but it must be a finite number > 0. "
            "Use 1.0-2.0 for training (1.25 is common), larger to drop nothing."
        )
    slots = Fraction(top_k * num_tokens, num_experts) * Fraction(repr(float(capacity_factor)))
    return max(1, math.ceil(slots))


def route(logits: Tensor, top_k: int, capacity: int) -> Routing:
    """Router softmax, top-k choice, GShard capacity positions and gates for ``logits[T, E]``.

    Positions come from a stable sort of the choices by expert (``O(T·k·log(T·k))``, no ``[T·k, E]`` cumsum):
    a choice's position is its rank among the choices routed to the same expert, in choice-major order.

    >>> r = route(torch.tensor([[2.0, 1, 0], [2, 0, 1], [2, 1, 0], [0, 2, 1]]), top_k=2, capacity=2)
    >>> r.expert_index.tolist()
    [[0, 1], [0, 2], [0, 1], [1, 2]]
    >>> r.position.tolist()  # expert 1: token 3's first choice, then the second choices of tokens 0 and 2
    [[0, 1], [1, 0], [2, 2], [0, 1]]
    >>> r.keep.tolist()
    [[True, True], [True, True], [False, False], [True, True]]
    """
    if logits.dim() != 2:
        raise PlanError(
            f"MoE router logits have shape {tuple(logits.shape)}, but route() expects [tokens, experts]. "
            "Flatten the leading dims first (x.reshape(-1, hidden))."
        )
    num_tokens, num_experts = logits.shape
    _check_top_k(top_k, num_experts)
    if capacity < 1:
        raise PlanError(
            f"MoE capacity has {capacity}, but it must be >= 1. "
            "Compute it with autoshard.runtime.moe.routing.capacity()."
        )

    probs = torch.softmax(logits.float(), dim=-1)
    # stable descending sort: equal probabilities go to the lower expert index (topk leaves ties unspecified)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    top_probs, expert_index = sorted_probs[:, :top_k], order[:, :top_k]
    gate = top_probs if top_k == 1 else top_probs / top_probs.sum(dim=-1, keepdim=True)

    flat = expert_index.t().reshape(-1)  # choice-major: every first choice, then every second choice
    by_expert = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=logits.device)
    counts.index_add_(0, flat, torch.ones_like(flat))
    first_rank = torch.cumsum(counts, 0) - counts  # rank (in by_expert) of each expert's first choice
    rank = torch.arange(flat.numel(), device=logits.device)
    flat_position = torch.empty_like(flat).scatter_(0, by_expert, rank - first_rank[flat[by_expert]])
    position = flat_position.view(top_k, num_tokens).t()
    return Routing(expert_index, position, gate, position < capacity, probs)


def _check_routing(r: Routing, num_experts: int, what: str) -> None:
    if r.probs.shape[-1] != num_experts:
        raise PlanError(
            f"MoE {what} has num_experts={num_experts}, but the routing was made for {r.probs.shape[-1]} experts. "
            "Pass the same expert count to route() and to dispatch/combine."
        )


def _slots(r: Routing, capacity: int) -> tuple[Tensor, Tensor]:
    """Flat slot ``e * C + position`` of each choice and whether it is kept within ``capacity``.

    Masking again by ``position < capacity`` keeps a buffer smaller than the routing's capacity from writing
    into a neighbouring expert's slots: such choices are dropped, consistently in dispatch and combine.
    """
    keep = r.keep & (r.position < capacity)
    return r.expert_index * capacity + r.position, keep


def dispatch(x: Tensor, r: Routing, num_experts: int, capacity: int) -> Tensor:
    """Scatter tokens ``x[T, h]`` into the expert buffer ``[E, C, h]``; unfilled slots are zero.

    Each kept choice is one row copy (``index_put_`` into distinct slots, whose backward is a gather — an
    ``index_add_`` here would make the forward a scatter-add, several times slower on CPU); dropped choices all
    go to one extra trash row that is sliced off, so no ``[T, E, C]`` tensor and no one-hot is built.
    Differentiable in ``x``.
    """
    if x.dim() != 2 or x.shape[0] != r.expert_index.shape[0]:
        raise PlanError(
            f"MoE dispatch input has shape {tuple(x.shape)}, but the routing covers "
            f"{r.expert_index.shape[0]} tokens and expects [tokens, hidden]. Route the same flattened tokens."
        )
    _check_routing(r, num_experts, "dispatch")
    slot, keep = _slots(r, capacity)
    trash = num_experts * capacity
    slot = torch.where(keep, slot, trash)
    buf = x.new_zeros(trash + 1, x.shape[1])
    for c in range(slot.shape[1]):  # k is static and small; avoids materialising x repeated k times
        buf.index_put_((slot[:, c],), x)
    return buf[:trash].view(num_experts, capacity, x.shape[1])


def combine(y: Tensor, r: Routing) -> Tensor:
    """Gather expert outputs ``y[E, C, h]`` back to tokens: ``out[t] = Σ_c keep·gate[t, c]·y[e, position]``.

    Differentiable in ``y`` and in the gates (hence the router). Dropped choices contribute exactly zero.
    """
    if y.dim() != 3:
        raise PlanError(
            f"MoE combine input has shape {tuple(y.shape)}, but it expects the expert buffer [experts, capacity, "
            "hidden]. Pass the output of expert_ffn on the dispatched buffer."
        )
    num_experts, cap, hidden = y.shape
    _check_routing(r, num_experts, "combine")
    slot, keep = _slots(r, cap)
    slot = torch.where(keep, slot, 0)  # any valid row: its weight below is zero
    weight = (r.gate * keep).to(y.dtype)
    flat = y.reshape(num_experts * cap, hidden)
    out = weight[:, 0, None] * flat.index_select(0, slot[:, 0])
    for c in range(1, slot.shape[1]):
        out = out + weight[:, c, None] * flat.index_select(0, slot[:, c])
    return out


def load_balancing_loss(r: Routing, num_experts: int) -> Tensor:
    """``E · Σ_i f_i · P_i`` (Switch); 1 for uniform routing. Only ``P_i`` (the router probs) has a gradient.

    ``f_i`` counts first choices before capacity is applied, so the loss pushes the router away from
    overloaded experts even when their tokens are being dropped.
    """
    _check_routing(r, num_experts, "load_balancing_loss")
    first = r.expert_index[:, 0]
    counts = torch.zeros(num_experts, dtype=r.probs.dtype, device=first.device)
    counts.index_add_(0, first, torch.ones_like(first, dtype=r.probs.dtype))
    fraction = counts / first.shape[0]
    return num_experts * torch.sum(fraction * r.probs.mean(dim=0))


def z_loss(logits: Tensor) -> Tensor:
    """Router z-loss ``mean(logsumexp(logits, -1)²)`` in float32 (ST-MoE), keeping router logits small."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


def expert_ffn(
    buf: Tensor,
    w1: Tensor,
    b1: Tensor | None,
    w2: Tensor,
    b2: Tensor | None,
    activation: str,
    w_gate: Tensor | None = None,
) -> Tensor:
    """Every local expert's FFN on its slots, as batched matmuls.

    Shapes: ``buf[E, C, h]``, ``w1[E, h, f]``, ``b1[E, f]``, ``w2[E, f, h]``, ``b2[E, h]``, ``w_gate[E, h, f]``.
    Weights are stored input-major (``w1[e] = linear1.weight.T``), so upcycling a dense ``nn.Linear`` is a
    transpose and a broadcast. Empty slots produce bias-only rows that combine never reads.
    """
    if activation not in ACTIVATIONS:
        raise PlanError(
            f"MoE expert activation has {activation!r}, but it must be one of {sorted(ACTIVATIONS)}. "
            "Map the dense FFN's activation to one of these names."
        )
    experts, _, hidden = buf.shape
    ffn = w1.shape[-1]
    expected = {
        "w1": (experts, hidden, ffn),
        "w2": (experts, ffn, hidden),
        "b1": (experts, ffn),
        "b2": (experts, hidden),
    }
    if w_gate is not None:
        expected["w_gate"] = (experts, hidden, ffn)
    given = {"w1": w1, "w2": w2, "b1": b1, "b2": b2, "w_gate": w_gate}
    for name, shape in expected.items():
        t = given[name]
        if t is not None and tuple(t.shape) != shape:
            raise PlanError(
                f"MoE expert weight {name} has shape {tuple(t.shape)}, but the buffer {tuple(buf.shape)} and "
                f"w1 {tuple(w1.shape)} need {shape}. Stack per-expert weights as [experts, in, out]."
            )
    act = ACTIVATIONS[activation]
    up = torch.bmm(buf, w1) if b1 is None else torch.baddbmm(b1.unsqueeze(1), buf, w1)
    hidden_act = act(up) if w_gate is None else act(torch.bmm(buf, w_gate)) * up
    return torch.bmm(hidden_act, w2) if b2 is None else torch.baddbmm(b2.unsqueeze(1), hidden_act, w2)


def _dense_masks(r: Routing, num_experts: int, capacity: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """GShard's one-hot ``[T, E, C]`` dispatch mask and gate-weighted combine tensor.

    Positions are masked to 0 *before* ``F.one_hot``: over-capacity positions would make it raise.
    """
    _, keep = _slots(r, capacity)
    position = torch.where(keep, r.position, 0)
    experts = F.one_hot(r.expert_index, num_experts).to(dtype) * keep.unsqueeze(-1).to(dtype)  # [T, k, E]
    slots = F.one_hot(position, capacity).to(dtype)  # [T, k, C]
    dispatch_mask = torch.einsum("tke,tkc->tec", experts, slots)
    combine_weights = torch.einsum("tke,tkc->tec", experts * r.gate.to(dtype).unsqueeze(-1), slots)
    return dispatch_mask, combine_weights


def dispatch_dense_onehot(x: Tensor, r: Routing, num_experts: int, capacity: int) -> Tensor:
    """Reference GShard dispatch ``einsum('tec,th->ech', mask, x)``; O(T·E·C·h). Benchmarks/cross-checks only."""
    _check_routing(r, num_experts, "dispatch_dense_onehot")
    mask, _ = _dense_masks(r, num_experts, capacity, x.dtype)
    return torch.einsum("tec,th->ech", mask, x)


def combine_dense_onehot(y: Tensor, r: Routing, num_experts: int, capacity: int) -> Tensor:
    """Reference GShard combine ``einsum('tec,ech->th', gate-weighted mask, y)``. Benchmarks/cross-checks only."""
    _check_routing(r, num_experts, "combine_dense_onehot")
    _, weights = _dense_masks(r, num_experts, capacity, y.dtype)
    return torch.einsum("tec,ech->th", weights, y)


def stats(r: Routing, num_experts: int) -> dict:
    """Routing statistics for reports (reads values, so not for traced code).

    Keys: ``tokens_per_expert`` (kept choices per expert), ``routed_per_expert`` (before capacity),
    ``dropped`` and ``dropped_fraction`` (of the ``T·k`` choices), ``tokens_fully_dropped_fraction`` (tokens
    whose every choice was dropped: their MoE output is zero).
    """
    _check_routing(r, num_experts, "stats")
    flat = r.expert_index.reshape(-1)
    routed = torch.bincount(flat, minlength=num_experts)
    kept = torch.bincount(flat[r.keep.reshape(-1)], minlength=num_experts)
    choices = r.keep.numel()
    dropped = choices - int(r.keep.sum())
    tokens = r.keep.shape[0]
    return {
        "tokens_per_expert": kept.tolist(),
        "routed_per_expert": routed.tolist(),
        "dropped": dropped,
        "dropped_fraction": dropped / choices if choices else 0.0,
        "tokens_fully_dropped_fraction": float((~r.keep.any(dim=1)).sum()) / tokens if tokens else 0.0,
    }
