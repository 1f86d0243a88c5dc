"""autoshard: trace a plain ``nn.Module``, pick a sharding plan, and generate one plain GraphModule per rank.

    >>> import autoshard
    >>> plan = autoshard.plan(model, autoshard.Mesh(data=2, model=2), (ids,), search=autoshard.Search())
    >>> plan.show(); print(plan.code(rank=1)); sim = plan.simulate((ids,))
    >>> sharded = autoshard.apply(model, plan)     # this rank's module, under torchrun

The compiler is imported on first use (module ``__getattr__``), so ``import autoshard.runtime`` in a worker
process stays light and never loads the passes.
"""

from __future__ import annotations

import importlib

from autoshard.errors import (
    AutoshardError,
    CheckpointError,
    CollectiveTimeoutError,
    MeshError,
    PeerDiedError,
    PlanError,
    RuntimeShapeError,
    TraceError,
    UnsupportedOpError,
)
from autoshard.mesh import Mesh

_LAZY = {"plan": "autoshard.api.planning", "load_plan": "autoshard.api.planning",
         "apply": "autoshard.api.entry", "Search": "autoshard.api.planning",
         "compile": "autoshard.api.entry", "shard": "autoshard.api.in_place",
         "ShardedModule": "autoshard.api.sharded_module", "data_shard": "autoshard.api.sharded_module",
         "Shard": "autoshard.placements", "Replicate": "autoshard.placements", "Partial": "autoshard.placements",
         "Pipeline": "autoshard.compiler.pipeline", "MixedPrecision": "autoshard.frontend.precision",
         "ContextParallel": "autoshard.compiler.context_parallel",
         "MoE": "autoshard.compiler.moe", "moe_losses": "autoshard.compiler.moe", "moe_stats": "autoshard.compiler.moe",
         "save": "autoshard.api.checkpoint", "load": "autoshard.api.checkpoint",
         "full_state_dict": "autoshard.api.checkpoint",
         "clip_grad_norm_": "autoshard.runtime.parameters"}

__all__ = ["plan", "load_plan", "apply", "Search", "compile", "shard", "data_shard", "ShardedModule", "Mesh", "Shard",
           "Replicate", "Partial", "AutoshardError",
           "TraceError", "MeshError", "PlanError", "UnsupportedOpError", "RuntimeShapeError",
           "CollectiveTimeoutError", "PeerDiedError", "CheckpointError", "save", "load", "full_state_dict", "Pipeline",
           "MixedPrecision", "MoE", "moe_losses", "moe_stats", "clip_grad_norm_", "ContextParallel"]


_SUBMODULES = {"api", "frontend", "compiler", "runtime", "passes", "cost_models", "errors", "mesh", "placements",
               "meta", "progress"}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"autoshard.{name}")
    raise AttributeError(f"module 'autoshard' has no attribute {name!r}")
