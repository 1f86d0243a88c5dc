"""The user API: what a training script calls and holds.

:mod:`.sharded_module` (``compile``, ``ShardedModule``), :mod:`.in_place` (``shard``), :mod:`.pipelined_module`,
:mod:`.checkpoint` (DCP save/load), :mod:`.materialize` (meta-built models), :mod:`.cli`. This layer may import every
other layer; none imports it.
"""

from __future__ import annotations

import importlib


def __getattr__(name: str):
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from e
