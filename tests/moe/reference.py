"""A deliberately simple eager MoE layer written from the spec, independent of ``autoshard.runtime.moe.routing``:
the oracle.

Semantics (DESIGN.md, "MoE (expert rewrite)"): float32 router softmax; each token picks its ``k`` most probable
experts (ties to the lower index); capacity ``C = ceil(k·T/E·capacity_factor)`` (at least 1) with the factor read
as the decimal it prints as; slots are handed out first to every token's first choice in token order, then to
every second choice; a choice that finds its expert full is dropped. Gates: the raw probability for ``k == 1``,
the chosen probabilities renormalised over the ``k`` choices (before dropping) for ``k >= 2``. Each kept choice
adds ``gate · expert(x[t])``. Load-balancing loss ``E·Σ f_i·P_i`` with ``f_i`` the fraction of first choices
(a constant) and ``P_i`` the mean probability; z-loss ``mean(logsumexp(logits)²)``.

Everything is python loops over tokens, choices and experts on small tensors; only elementary torch math is
used, so autograd gives the oracle's gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal

import torch
from torch import Tensor


def reference_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Exact integer ceiling of ``top_k·num_tokens·capacity_factor / num_experts``, at least 1."""
    num, den = Decimal(repr(float(capacity_factor))).as_integer_ratio()
    return max(1, -(-(top_k * num_tokens * num) // (num_experts * den)))


def reference_activation(name: str, u: Tensor) -> Tensor:
    """The activations by their textbook formulas."""
    if name == "gelu":
        return 0.5 * u * (1.0 + torch.erf(u / math.sqrt(2.0)))
    if name == "gelu_tanh":
        return 0.5 * u * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (u + 0.044715 * u**3)))
    if name == "relu":
        return torch.where(u > 0, u, torch.zeros_like(u))
    if name == "silu":
        return u / (1.0 + torch.exp(-u))
    raise ValueError(f"unknown activation {name!r}")


def reference_expert(
    v: Tensor,
    e: int,
    w1: Tensor,
    b1: Tensor | None,
    w2: Tensor,
    b2: Tensor | None,
    activation: str,
    w_gate: Tensor | None,
) -> Tensor:
    """Expert ``e`` applied to one token ``v[h]`` (weights stored ``[E, in, out]``)."""
    up = v @ w1[e]
    if b1 is not None:
        up = up + b1[e]
    act = reference_activation(activation, up if w_gate is None else v @ w_gate[e])
    hidden = act if w_gate is None else act * up
    out = hidden @ w2[e]
    return out if b2 is None else out + b2[e]


@dataclass
class ReferenceResult:
    out: Tensor  # [T, h]
    lb_loss: Tensor  # scalar
    z_loss: Tensor  # scalar
    capacity: int
    choices: list[list[int]]  # [T][k] expert ids
    positions: list[list[int]]  # [T][k]
    keep: list[list[bool]]  # [T][k]
    gates: list[list[Tensor]]  # [T][k] scalar tensors


def reference_moe(
    x: Tensor,
    router_weight: Tensor,
    w1: Tensor,
    b1: Tensor | None,
    w2: Tensor,
    b2: Tensor | None,
    *,
    top_k: int,
    capacity_factor: float,
    activation: str,
    w_gate: Tensor | None = None,
) -> ReferenceResult:
    """The MoE layer on ``x[T, h]`` with router ``router_weight[E, h]`` (logits = x @ router_weight.T)."""
    num_tokens, hidden = x.shape
    num_experts = router_weight.shape[0]
    cap = reference_capacity(num_tokens, num_experts, top_k, capacity_factor)
    logits = x.float() @ router_weight.float().t()

    probs, lse = [], []
    for t in range(num_tokens):
        row = logits[t]
        m = row.max().detach()
        ex = torch.exp(row - m)
        probs.append(ex / ex.sum())
        lse.append(m + torch.log(ex.sum()))

    choices = []
    for t in range(num_tokens):
        ranked = sorted(range(num_experts), key=lambda e: (-float(probs[t][e].detach()), e))
        choices.append(ranked[:top_k])

    positions = [[0] * top_k for _ in range(num_tokens)]
    filled = [0] * num_experts
    for c in range(top_k):
        for t in range(num_tokens):
            e = choices[t][c]
            positions[t][c] = filled[e]
            filled[e] += 1
    keep = [[positions[t][c] < cap for c in range(top_k)] for t in range(num_tokens)]

    gates = []
    for t in range(num_tokens):
        chosen = [probs[t][e] for e in choices[t]]
        if top_k == 1:
            gates.append(chosen)
        else:
            total = sum(chosen[1:], chosen[0])
            gates.append([p / total for p in chosen])

    rows = []
    for t in range(num_tokens):
        acc = torch.zeros(hidden, dtype=x.dtype)
        for c in range(top_k):
            if keep[t][c]:
                y = reference_expert(x[t], choices[t][c], w1, b1, w2, b2, activation, w_gate)
                acc = acc + gates[t][c] * y
        rows.append(acc)
    out = torch.stack(rows)

    lb = torch.zeros((), dtype=torch.float32)
    for i in range(num_experts):
        f_i = sum(1 for t in range(num_tokens) if choices[t][0] == i) / num_tokens
        p_i = sum((probs[t][i] for t in range(num_tokens)), torch.zeros(())) / num_tokens
        lb = lb + f_i * p_i
    lb = num_experts * lb
    z = sum((s * s for s in lse), torch.zeros(())) / num_tokens
    return ReferenceResult(out, lb, z, cap, choices, positions, keep, gates)
