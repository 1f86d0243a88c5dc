"""ZeRO/FSDP storage: store parameters sharded over the data axis apart from the layout they compute in.

Runs after ``propagate`` (every parameter has its *compute* spec, chosen as if it were stored whole) and before
``insert_collectives``. For each parameter given a ZeRO stage > 0 — ``Options.zero`` for all, or per parameter
(``meta[autoshard.planned_zero]``, written by the plan search under ``zero="auto"``) — it picks a tensor dim that no
mesh axis shards yet and that the data axis divides, and makes the parameter's spec that compute spec plus
``Shard(dim)`` on the data axis: the *stored* spec. What this rank holds, what ``parameters()`` returns and what the
optimizer steps is then the stored shard (so the optimizer state is sharded too: ZeRO-1), and collective insertion
adds the all-gather from stored to compute layout before its uses, as for any other redistribution:

=======  ==========================================  ==========================================================
stage    forward                                      backward
=======  ==========================================  ==========================================================
1        all-gather, copy kept for backward           gradient all-reduced over the data axis, this rank's slice
                                                      kept (``all_gather`` + ``grad_all_reduce``, not fused)
2        all-gather, copy kept for backward           gradient reduce-scattered (``all_gather_sync``)
3        all-gather, copy freed after forward use     gathered again, gradient reduce-scattered
                                                      (``all_gather_reshard``, :mod:`autoshard.runtime.zero`)
=======  ==========================================  ==========================================================

Stage 1 keeps no more memory than stage 2 in this runtime (a parameter's gradient is its stored shard either way)
and moves twice the gradient bytes; it exists to match DeepSpeed's stage and for comparison. The stage of the
collectives is decided per rank program by ``fuse_gather_grad_sync`` (:func:`stage_of`).

A parameter is left whole (stage 0, listed in the plan report's ``["shard_storage"]["kept_whole"]`` and in one warning
when the user forced a stage) when the mesh has no data axis of size > 1, the parameter is already sharded over it
(experts on the expert axis), or no free dim is divisible by the data axis. Buffers are never sharded (FSDP does
not shard them either). A dtype cast marked ``meta["autoshard.precision_cast"]`` that is the parameter's only user
(mixed precision) is stored sharded too, so the cast runs on the shard and the all-gather moves the low-precision
bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from autoshard import meta as M
from autoshard.compiler.context import Context, zero_axis
from autoshard.frontend.graph_utils import shape
from autoshard.placements import Shard

__all__ = ["ShardStorage", "stage_of", "stored_spec"]

PRECISION_CAST = M.PRECISION_CAST


def stored_spec(compute: tuple, shape_: tuple[int, ...], mesh, axis: str) -> tuple | None:
    """``compute`` plus ``Shard(d)`` on ``axis`` for the first dim ``d`` (dim 0 first, then the largest) that no
    axis shards and that ``axis`` divides; None where there is none or ``axis`` already shards the tensor."""
    if axis not in mesh.names or mesh.axis_size(axis) <= 1:
        return None
    a = mesh.index(axis)
    if isinstance(compute[a], Shard) or not shape_:
        return None
    taken = {p.dim for p in compute if isinstance(p, Shard)}
    n = mesh.axis_size(axis)
    order = [0] + sorted(range(1, len(shape_)), key=lambda d: -shape_[d])
    for d in order:
        if d not in taken and shape_[d] % n == 0 and shape_[d] >= n:
            spec = list(compute)
            spec[a] = Shard(d)
            return tuple(spec)
    return None


def _stage_for(node: torch.fx.Node, zero) -> int:
    if M.PLANNED_ZERO in node.meta:
        return int(node.meta[M.PLANNED_ZERO])
    if isinstance(zero, int):
        return zero
    if isinstance(zero, dict):  # {parameter name: stage}: pinned per parameter (Pinned.storage)
        for name in (node.meta.get(M.PARAM), str(node.target), *node.meta.get(M.ALIASES, ())):
            if name in zero:
                return int(zero[name])
    return 0


def stage_of(node: torch.fx.Node) -> int:
    """The ZeRO stage of the parameter a collective's input comes from (through precision casts and views); 0 when
    the input is not a parameter stored at a stage > 0."""
    seen = 0
    while isinstance(node, torch.fx.Node) and seen < 8:
        storage = node.meta.get(M.STORAGE)
        if storage is not None:
            return storage.stage
        if node.op != "call_function" or not node.meta.get(PRECISION_CAST) or not node.args:
            return 0
        node = node.args[0]
        seen += 1
    return 0


@dataclass(frozen=True)
class ShardStorage:
    name: str = "shard_storage"
    phase: str = "plan"

    def run(self, gm: torch.fx.GraphModule, ctx: Context) -> torch.fx.GraphModule:
        mesh, axis = ctx.mesh, zero_axis(ctx.options, ctx.mesh)
        zero = dict(ctx.pinned.storage) if ctx.pinned is not None else ctx.options.zero
        stored: dict[int, list[str]] = {1: [], 2: [], 3: []}
        kept: list[str] = []
        for node in gm.graph.nodes:
            if node.op != "get_attr" or not isinstance(node.meta.get("val"), torch.Tensor):
                continue
            if not node.meta.get(M.REQUIRES_GRAD):
                continue  # buffers and frozen parameters: no gradient, no optimizer state
            stage = _stage_for(node, zero)
            if stage == 0:
                continue
            compute = node.meta[M.SPEC]
            spec = stored_spec(compute, shape(node), mesh, axis)
            name = node.meta.get(M.PARAM, str(node.target))
            if spec is None:
                kept.append(name)
                continue
            node.meta[M.SPEC] = spec
            node.meta[M.STORAGE] = M.Storage(stage, compute, spec, axis)
            stored[stage].append(name)
            cast = _only_cast_user(node)
            if cast is not None and cast.meta.get(M.SPEC) == compute:
                cast.meta[M.SPEC] = spec
                strat = cast.meta.get(M.STRATEGY)
                if strat is not None:
                    import dataclasses

                    cast.meta[M.STRATEGY] = dataclasses.replace(
                        strat, input_specs=(spec,) + tuple(strat.input_specs[1:]), output_spec=spec, grad_sync=())
        if kept and isinstance(zero, int) and zero > 0:
            why = (f"the mesh has no axis `{axis}` of size > 1" if axis not in mesh.names or mesh.axis_size(axis) <= 1
                   else f"each is already sharded over `{axis}` or has no dim that `{axis}` "
                        f"(size {mesh.axis_size(axis)}) divides and no other axis shards")
            ctx.warn(f"zero={zero}: {len(kept)} parameter(s) stay stored whole ({', '.join(kept[:4])}"
                     f"{', ...' if len(kept) > 4 else ''}): {why}.")
        M.plan_report(gm)[self.name] = {"stage_1": stored[1], "stage_2": stored[2], "stage_3": stored[3],
                                        "kept_whole": kept}
        return gm


def _only_cast_user(node: torch.fx.Node) -> torch.fx.Node | None:
    users = list(node.users)
    if len(users) == 1 and users[0].meta.get(PRECISION_CAST):
        return users[0]
    return None
