"""autoshard: trace a plain ``nn.Module``, pick a sharding plan, and generate one plain GraphModule per rank.

    >>> import autoshard
    >>> plan = autoshard.compile(model, autoshard.Mesh(data=2, model=2), example_inputs=(ids,))
    >>> plan.show(); print(plan.code(rank=1)); m1 = plan.rank_module(rank=1)
"""

from autoshard.api import ShardedModule, compile, data_shard
from autoshard.errors import (AutoshardError, CollectiveTimeoutError, MeshError, PlanError, RuntimeShapeError,
                              TraceError, UnsupportedOpError)
from autoshard.mesh import Mesh
from autoshard.placements import Partial, Replicate, Shard

__all__ = ["compile", "data_shard", "ShardedModule", "Mesh", "Shard", "Replicate", "Partial", "AutoshardError", "TraceError",
           "MeshError", "PlanError", "UnsupportedOpError", "RuntimeShapeError", "CollectiveTimeoutError"]
