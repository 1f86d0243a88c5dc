"""The passes that prepare the traced graph for planning, each run once, before both planners.

* :class:`Functionalize`: in-place writes on activations become functional ops
  (:func:`autoshard.passes.propagate.functionalize`), as both planners and every later pass see them;
* :class:`SeedSpecs`: the specs fixed before planning — annotated parameters (the user's and those implied by
  earlier passes, ``gm.meta[autoshard.meta.IMPLIED_ANNOTATIONS]``) and every input (batch dim on the data axis)
  (:func:`autoshard.passes.propagate.seed_specs`);
* :class:`MarkRequiresGrad`: ``node.meta[autoshard.meta.REQUIRES_GRAD]`` on every node: which values carry a
  gradient, what the memory model saves and the syncs follow (:func:`autoshard.passes.propagate.mark_requires_grad`).

They used to run inside ``plan_search`` and ``propagate`` (both), hidden from the pass list and its record.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx
from autoshard.passes.propagate import functionalize, mark_requires_grad, seed_specs

from autoshard.compiler.context import Context

__all__ = ["Functionalize", "MarkRequiresGrad", "SeedSpecs"]


@dataclass(frozen=True)
class Functionalize:
    name: str = "functionalize"

    def run(self, gm: torch.fx.GraphModule, ctx: Context) -> torch.fx.GraphModule:
        functionalize(gm)  # (in-place writes it leaves are handled by propagation: a buffer keeps its layout)
        return gm


@dataclass(frozen=True)
class SeedSpecs:
    name: str = "seed_specs"

    def run(self, gm: torch.fx.GraphModule, ctx: Context) -> torch.fx.GraphModule:
        seed_specs(gm, ctx)
        return gm


@dataclass(frozen=True)
class MarkRequiresGrad:
    name: str = "mark_requires_grad"

    def run(self, gm: torch.fx.GraphModule, ctx: Context) -> torch.fx.GraphModule:
        mark_requires_grad(gm)
        return gm
