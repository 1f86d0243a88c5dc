"""What the expert rewrite made, as a typed result: :class:`MoERewrite` on ``gm.meta[autoshard.meta.MOE_REWRITE]``.

The expert rewrite (``passes/expert_rewrite.py``) reports through this value and through the annotations it
implies for the expert parameters (``gm.meta[autoshard.meta.IMPLIED_ANNOTATIONS]``); it never changes the user's
options. Readers: :mod:`autoshard.runtime.moe.records` (the record key), and the plan report (``ctx.report``, made from
:meth:`MoERewrite.report`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["MoELayer", "MoERewrite"]


@dataclass(frozen=True)
class MoELayer:
    """One dense FFN rewritten as an MoE layer: its sizes, its routing capacity and the parameters it created."""

    path: str  # module path of the dense FFN
    experts: int
    top_k: int
    groups: int  # routing groups G
    tokens_per_group: int  # T_g
    capacity: int  # C: slots per expert per group
    capacity_factor: float
    gated: bool  # two in-projections (SwiGLU-style)
    hidden: int
    ffn: int
    buffer_bytes: int  # the expert buffer [E, G, C, h]
    expert_params: tuple[str, ...]  # <path>.experts.{w1,b1,w3,b3,w2,b2} that exist, in creation order
    router: str  # <path>.router.weight
    init: str  # upcycle | random
    replaced: tuple[str, ...] = ()  # the dense FFN's parameters the layer replaced (no longer read by the program)


@dataclass(frozen=True)
class MoERewrite:
    """The expert rewrite's result for one graph: its layers in graph order, the routing groups, the expert axis,
    and ``key``, the record key its ``attach`` nodes carry (unique in the process: see
    :mod:`autoshard.runtime.moe.records`)."""

    layers: tuple[MoELayer, ...]
    groups: int
    expert_axis: str
    key: str

    def replaced(self) -> frozenset[str]:
        """The dense FFN parameters every layer replaced (no longer read by the program)."""
        return frozenset(name for layer in self.layers for name in layer.replaced)

    def report(self) -> dict:
        """Plain data for the plan report: ``{"layers": [{field: value}...], "groups", "expert_axis"}``."""
        layers = [{**dataclasses.asdict(layer), "expert_params": list(layer.expert_params)} for layer in self.layers]
        return {"layers": layers, "groups": self.groups, "expert_axis": self.expert_axis}
