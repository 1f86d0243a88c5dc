"""Mixture of Experts: the user's options (:class:`MoE`), the graph ops the expert rewrite emits, and the
per-forward losses and statistics (:func:`moe_losses`, :func:`moe_stats`).

``autoshard.compile(model, mesh, example_inputs, moe=autoshard.MoE(layers="blocks.*.mlp", every=2, ...))`` runs
``passes/expert_rewrite.py`` before propagation: each selected dense FFN becomes a capacity-bounded MoE layer built
from the ops below (see that module for the graph it emits).

Routing groups (GShard): tokens are routed in ``G`` groups, by default one per coordinate of the expert axis
(``G = mesh.axis_size(expert_axis)``; ``MoE(groups=...)`` overrides it). Group ``g`` is the ``g``-th contiguous
chunk of the batch, i.e. exactly the tokens data rank ``g`` holds, so each rank routes its own tokens with a
capacity ``C = ceil(k * T_g / E * capacity_factor)`` computed from static shapes — never agreed by a collective.
The global graph carries the group as an explicit leading dim (``[G, T_g, h]``), which is what the rule table
shards; on one device the same graph routes the same ``G`` groups, so sharded and single-device runs agree
exactly. The expert buffer is ``[E, G, C, h]``: sharded on the group dim (dim 1) where tokens live, on the expert
dim (dim 0) where the experts run; the propagation turns one into the other with one all-to-all each way.

Auxiliary losses are defined over *all* tokens (global means): ``lb = α · E · Σ_i f_i · P_i`` with ``f_i`` the
fraction of all tokens whose first choice is ``i`` (no gradient) and ``P_i`` the mean router probability of ``i``;
``z = β · mean_t(logsumexp(logits_t)²)``. Because ``f`` is global and carries no gradient, the loss is a sum of
per-group terms (``lb = Σ_g α·E·Σ_i f_i·P_i^g``), so each rank holds its own groups' terms and no term is counted
twice or scaled by the world size. The terms are attached to the MoE output's autograd graph (:func:`attach`,
Megatron's approach): ``loss.backward()`` on the model's own loss already includes their gradients — do *not* add
them again. Their values (and routing statistics) are recorded on every forward and read with
:func:`moe_losses` / :func:`moe_stats`, e.g. to log ``loss + moe_losses(m)["total"]``.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import threading
from dataclasses import dataclass

import torch
from torch import Tensor

from autoshard.errors import PlanError
from autoshard.moe_ops import capacity as _capacity
from autoshard.moe_ops import route as _route

__all__ = ["MoE", "moe_losses", "moe_stats"]


@dataclass(frozen=True)
class MoE:
    """Which dense FFNs become Mixture-of-Experts layers, and how.

    ``layers``: a glob over module paths (``"transformer.h.*.mlp"``) or an explicit list of paths. ``every``: of
    the matched layers in graph order, rewrite those with ``(index + 1) % every == 0`` (``every=2``: the 2nd, 4th,
    ...; Switch/GShard's every other layer). ``init``: ``"upcycle"`` copies the dense FFN into every expert (plus
    Gaussian ``noise`` times each weight's std), ``"random"`` draws fresh weights like ``nn.Linear``. The router
    (float32 even when the model is not) is drawn from ``N(0, router_std²)`` with ``seed``.
    ``expert_axis``: the mesh axis the experts are sharded over (when the mesh has it). ``groups``: routing groups
    (default: the size of the expert axis, one per data rank).
    """

    layers: str | tuple[str, ...] = "*.mlp"
    every: int = 1
    num_experts: int = 8
    top_k: int = 2
    capacity_factor: float = 1.25
    aux_loss_weight: float = 0.01
    z_loss_weight: float = 1e-3
    expert_axis: str = "data"
    init: str = "upcycle"  # upcycle | random
    noise: float = 0.0
    router_std: float = 0.02
    seed: int = 0
    groups: int | None = None

    def __post_init__(self):
        if isinstance(self.layers, list):
            object.__setattr__(self, "layers", tuple(self.layers))
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.num_experts, int) or self.num_experts < 1:
            raise PlanError(f"MoE num_experts has {self.num_experts!r}, but must be an int >= 1. Use e.g. 8.")
        if not isinstance(self.top_k, int) or not 1 <= self.top_k <= self.num_experts:
            raise PlanError(f"MoE top_k has {self.top_k!r}, but must lie in [1, num_experts={self.num_experts}]. "
                            "Use top_k=1 (Switch) or top_k=2 (GShard) with at least that many experts.")
        cf = self.capacity_factor
        if isinstance(cf, bool) or not isinstance(cf, (int, float)) or not (math.isfinite(cf) and cf > 0):
            raise PlanError(f"MoE capacity_factor has {cf!r}, but must be a finite number > 0. Use 1.0-2.0 for "
                            "training (1.25 is common), larger to drop nothing.")
        if not isinstance(self.every, int) or self.every < 1:
            raise PlanError(f"MoE every has {self.every!r}, but must be an int >= 1 (2: every other layer).")
        if self.init not in ("upcycle", "random"):
            raise PlanError(f"MoE init has {self.init!r}, but must be 'upcycle' (copy the dense FFN into every "
                            "expert) or 'random'.")
        if self.groups is not None and (not isinstance(self.groups, int) or self.groups < 1):
            raise PlanError(f"MoE groups has {self.groups!r}, but must be None (one per expert-axis rank) or an "
                            "int >= 1.")

    @classmethod
    def parse(cls, text: str) -> MoE:
        """``"layers=blocks.*.mlp,every=2,num_experts=8,top_k=2"`` → ``MoE(...)`` (the CLI's ``--moe``; an explicit
        list of layers is joined by ``+``)."""
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        fields: dict = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = (s.strip() for s in part.partition("="))
            if not sep or key not in types:
                raise PlanError(f"MoE options {text!r} have the part {part!r}, but each part is KEY=VALUE with KEY "
                                f"one of {', '.join(types)}.")
            if key == "layers":
                fields[key] = tuple(value.split("+")) if "+" in value else value
            elif key in ("every", "num_experts", "top_k", "seed", "groups"):
                if not value.lstrip("-").isdigit():
                    raise PlanError(f"MoE option {key} is {value!r}, but must be an integer.")
                fields[key] = int(value)
            elif key in ("capacity_factor", "aux_loss_weight", "z_loss_weight", "noise", "router_std"):
                try:
                    fields[key] = float(value)
                except ValueError:
                    raise PlanError(f"MoE option {key} is {value!r}, but must be a number.") from None
            else:
                fields[key] = value
        return cls(**fields)

    def select(self, paths: list[str]) -> list[str]:
        """The module paths (from ``paths``, in graph order) this option rewrites."""
        if isinstance(self.layers, str):
            matched = [p for p in paths if fnmatch.fnmatchcase(p, self.layers)]
        else:
            matched = [p for p in paths if p in self.layers]
            missing = [p for p in self.layers if p not in paths]
            if missing:
                raise PlanError(f"MoE layers names {missing}, but the model has no module at that path. Module "
                                f"paths look like: {', '.join(paths[:6])}, ...")
        if not matched:
            raise PlanError(f"MoE layers={self.layers!r} matches no module of the model, but must match at least "
                            f"one FFN. Module paths look like: {', '.join(paths[:6])}, ...")
        return [p for i, p in enumerate(matched) if (i + 1) % self.every == 0]


# ---------------------------------------------------------------------------------------------------------
# Graph ops. Every one takes the routing group as its leading dim (the rule table shards it) and never reads
# tensor values for a shape, so each traces with fake tensors.
# ---------------------------------------------------------------------------------------------------------
def route_groups(logits: Tensor, top_k: int, capacity: int):
    """``moe_ops.route`` per group on ``logits[G, T, E]``: (expert_index, position, keep), each ``[G, T, k]``.

    Integer outputs only: the differentiable gate comes from :func:`gate_groups` on the router softmax, a
    single-output op, so gradient bookkeeping never has to look through a tuple."""
    parts = [_route(logits[g], top_k, capacity) for g in range(logits.shape[0])]
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


def attach(out: Tensor, terms: Tensor, stats: Tensor, layer: str, alpha: float, beta: float, top_k: int) -> Tensor:
    """Identity on ``out``; its backward also gives the loss terms their gradient (``α`` for ``lb``, ``β`` for
    ``z``), so the auxiliary losses train the router through the model's own ``loss.backward()``. Records the
    (replicated) ``stats`` of this forward for :func:`moe_losses` and :func:`moe_stats`."""
    if not _is_fake(stats):
        _record(layer, stats.detach(), alpha, beta, top_k)
    if not torch.is_grad_enabled() or not terms.requires_grad:
        return out.view_as(out)
    return _Attach.apply(out, terms, alpha, beta)


def _is_fake(t: Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor) or t.device.type == "meta"


# ---------------------------------------------------------------------------------------------------------
# Records of the last forward, per rank (the simulator runs ranks as threads of one process).
# ---------------------------------------------------------------------------------------------------------
_LOCK = threading.Lock()
_RECORDS: dict[int, dict[str, dict]] = {}


def _current_rank() -> int:
    from autoshard.errors import AutoshardError
    from autoshard.runtime.comm import current

    try:
        return current().rank
    except AutoshardError:  # no communicator: one process, rank 0
        return 0


def _record(layer: str, stats: Tensor, alpha: float, beta: float, top_k: int) -> None:
    n = (stats.numel() - 2) // 2
    lb, z = stats[0], stats[1]
    routed, kept = stats[2:2 + n], stats[2 + n:]
    choices = float(routed.sum())
    entry = {
        "load_balancing": alpha * lb, "z": beta * z, "total": alpha * lb + beta * z,
        "load_balancing_raw": lb, "z_raw": z,
        "tokens_per_expert": [round(v) for v in kept.tolist()],
        "routed_per_expert": [round(v) for v in routed.tolist()],
        "dropped": round(choices - float(kept.sum())),
        "dropped_fraction": (choices - float(kept.sum())) / choices if choices else 0.0,
        "tokens": round(choices / top_k),
    }
    with _LOCK:
        _RECORDS.setdefault(_current_rank(), {})[layer] = entry


def _records(module, rank: int | None) -> dict[str, dict]:
    if rank is None:
        comm = getattr(module, "_comm", None)
        rank = comm.rank if comm is not None else _current_rank()
    with _LOCK:
        recs = dict(_RECORDS.get(rank, {}))
    plan = getattr(module, "plan", None) or (module if hasattr(module, "context") else None)
    layers = None
    if plan is not None:
        layers = plan.context.report.get("expert_rewrite", {}).get("layers")
    if layers is not None:
        recs = {k: v for k, v in recs.items() if k in {entry["path"] for entry in layers}}
    return recs


def moe_losses(module=None, *, rank: int | None = None) -> dict:
    """The auxiliary losses of the last forward (this rank's view; the values are global, replicated):
    ``{"total": α·lb + β·z summed over layers, "layers": {path: {"load_balancing": α·lb, "z": β·z, "total"}}}``.

    They are already attached to the autograd graph (their gradients flow with the model's own loss); add
    ``total`` to the *logged* loss, not to the one you call ``backward`` on.
    """
    recs = _records(module, rank)
    layers = {k: {"load_balancing": v["load_balancing"], "z": v["z"], "total": v["total"]} for k, v in recs.items()}
    total = sum((v["total"] for v in layers.values()), torch.zeros(()))
    return {"total": total, "layers": layers}


def moe_stats(module=None, *, rank: int | None = None) -> dict[str, dict]:
    """Per MoE layer, the routing of the last forward over all ranks' tokens: ``tokens_per_expert`` (kept
    choices), ``routed_per_expert`` (before capacity), ``dropped``, ``dropped_fraction`` (of the ``tokens·k``
    choices), plus the unscaled losses ``load_balancing_raw`` and ``z_raw``."""
    return {k: {key: v[key] for key in ("tokens_per_expert", "routed_per_expert", "dropped", "dropped_fraction",
                                        "tokens", "load_balancing_raw", "z_raw")}
            for k, v in _records(module, rank).items()}


def clear_records() -> None:
    with _LOCK:
        _RECORDS.clear()


def capacity_of(tokens_per_group: int, options: MoE) -> int:
    return _capacity(tokens_per_group, options.num_experts, options.top_k, options.capacity_factor)
