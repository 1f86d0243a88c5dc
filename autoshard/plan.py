"""The compiled artifact: the annotated global graph plus what it takes to make each rank's program.

A :class:`Plan` is produced ahead of time in one process by :func:`build_plan` (trace → passes) and answers
questions about itself without any process group: ``show()``, ``format()``, ``code(rank)``,
``rank_module(rank)``, ``collectives()``, ``param_specs()``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from autoshard import meta as M
from autoshard.codegen import local_param_specs, localize
from autoshard.context import Context, Options
from autoshard.errors import AutoshardError
from autoshard.mesh import Mesh
from autoshard.placements import Spec
from autoshard.passes.collectives import InsertCollectives
from autoshard.passes.propagate import Propagate
from autoshard.trace import trace

#: The passes that run, in order. Each is a frozen dataclass with ``name`` and ``run(gm, ctx) -> gm``.
PIPELINE = (Propagate(), InsertCollectives())


def run_passes(gm: torch.fx.GraphModule, ctx: Context, passes=PIPELINE) -> torch.fx.GraphModule:
    ran: list[str] = []
    for p in passes:
        try:
            gm = p.run(gm, ctx)
            gm.graph.lint()
        except AutoshardError:
            raise
        except Exception as e:
            raise AutoshardError(f"An error occurred when running the '{p.name}' pass after the following passes: "
                                 f"{ran or 'none'}: {type(e).__name__}: {e}") from e
        ran.append(p.name)
    return gm


@dataclass
class Plan:
    graph_module: torch.fx.GraphModule
    mesh: Mesh
    context: Context
    model_name: str = "model"

    # ---- per-rank programs ------------------------------------------------------------------------------
    def rank_module(self, rank: int, weights: torch.nn.Module | None = None) -> torch.fx.GraphModule:
        """A plain GraphModule holding only ``rank``'s parameter shards (copied from the traced weights)."""
        self.mesh._check_rank(rank)
        return localize(self.graph_module, self.mesh, rank, weights)

    def code(self, rank: int = 0) -> str:
        """The generated Python source of ``rank``'s module."""
        self.mesh._check_rank(rank)
        return localize(self.graph_module, self.mesh, rank).code.strip() + "\n"

    # ---- questions --------------------------------------------------------------------------------------
    def param_specs(self) -> dict[str, Spec]:
        return local_param_specs(self.graph_module)

    def collectives(self) -> list[tuple[str, M.CollectiveInfo]]:
        """(node name, info) of every inserted collective, in graph order."""
        return [(n.name, n.meta[M.COLLECTIVE]) for n in self.graph_module.graph.nodes if M.COLLECTIVE in n.meta]

    def format(self, rank: int | None = None) -> str:
        from autoshard.report import format_plan

        return format_plan(self)

    def show(self, console=None) -> None:
        from autoshard.report import show_plan

        show_plan(self, console)


def build_plan(model: torch.nn.Module, mesh: Mesh, args: tuple, kwargs: dict | None, options: Options) -> Plan:
    gm = trace(model, args, kwargs)
    ctx = Context(mesh, options)
    gm = run_passes(gm, ctx)
    return Plan(gm, mesh, ctx, type(model).__name__)
