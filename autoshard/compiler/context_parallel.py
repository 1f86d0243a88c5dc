"""How users ask for context parallelism: ``compile(..., context_axis="context")`` or
``context_axis=ContextParallel(axis="context", attention="ring", balance=True)``.

With it every input whose dim 1 is the attention's sequence is passed *whole* (each rank its data shard of the
batch, every token of it) and cut along the sequence on ``axis`` inside the program; attention runs
context-parallel in the local form ``attention`` (``"ring"``, ``"all_gather"``, ``"ulysses"``, or None: the
planner's choice), and ``balance`` (default: True) lays the sequence out head-tail — rank ``r`` holds chunks ``r``
and ``2n-1-r`` of ``2n`` — so causal attention gives every rank the same work. The layout is autoshard's: the cut
of the inputs, rotary positions and masks (both computed whole, then sliced), labels, and the gathers of
outputs leaving the program all follow it. See ``passes/context_parallel.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoshard.errors import PlanError
from autoshard.mesh import Mesh

__all__ = ["ContextParallel", "as_context_parallel"]

_FORMS = ("ring", "all_gather", "ulysses")


@dataclass(frozen=True)
class ContextParallel:
    axis: str = "context"
    attention: str | None = "ring"
    balance: bool = True


def as_context_parallel(value, mesh: Mesh) -> ContextParallel | None:
    """The option ``context_axis`` (None, an axis name or a :class:`ContextParallel`), checked against ``mesh``."""
    if value is None:
        return None
    cp = ContextParallel(axis=value) if isinstance(value, str) else value
    if not isinstance(cp, ContextParallel):
        raise PlanError(f"option context_axis has type {type(value).__name__}, but must be a mesh axis name such as "
                        "'context' or autoshard.ContextParallel(axis=..., attention=..., balance=...).")
    if cp.axis not in mesh.names:
        raise PlanError(f"option context_axis names axis {cp.axis!r}, but the mesh has axes {list(mesh.names)}: "
                        f"add it, e.g. Mesh(data=2, {cp.axis}=2).")
    if cp.attention is not None and cp.attention not in _FORMS:
        raise PlanError(f"option context_axis has attention={cp.attention!r}, but it is one of {_FORMS} or None "
                        "(the planner's choice).")
    return cp
