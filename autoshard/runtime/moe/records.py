"""The losses and routing statistics of each MoE forward, kept per compiled model and per rank.

Every MoE layer's :func:`~autoshard.runtime.moe.graph_ops.attach` node carries the record key of the expert rewrite that
made it (:attr:`MoERewrite.key <autoshard.compiler.moe.result.MoERewrite>`, unique in the process) and calls
:func:`record` on each forward. Records are stored under ``(key, rank, layer)``: the rank comes from the runtime's
current communicator, since the simulator runs ranks as threads of one process. Two models compiled in one
process therefore never see each other's records, and :func:`moe_losses` / :func:`moe_stats` find a model's key
on its global graph (``gm.meta[autoshard.meta.MOE_REWRITE]``; rank programs carry a copy of that meta).
"""

from __future__ import annotations

import itertools
import threading

import torch
import torch.fx
from torch import Tensor

from autoshard import meta as M

__all__ = ["clear_records", "key_of", "moe_losses", "moe_stats", "new_key", "record"]

_LOCK = threading.Lock()
#: (record key, rank) -> layer path -> that layer's entry of the last forward
_RECORDS: dict[tuple[str, int], dict[str, dict]] = {}
#: rank -> the record key written last on it (what ``moe_losses()`` without a module reads)
_LAST: dict[int, str] = {}
_KEYS = itertools.count()


def new_key() -> str:
    """A record key no other expert rewrite of this process has: ``"moe0"``, ``"moe1"``, ..."""
    return f"moe{next(_KEYS)}"


def _current_rank() -> int:
    from autoshard.errors import AutoshardError
    from autoshard.runtime.communicator import current

    try:
        return current().rank
    except AutoshardError:  # no communicator: one process, rank 0
        return 0


def record(key: str, layer: str, stats: Tensor, alpha: float, beta: float, top_k: int) -> None:
    """Store one layer's ``stats`` (``[lb, z, routed per expert..., kept per expert...]``) of this forward."""
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
    rank = _current_rank()
    with _LOCK:
        _RECORDS.setdefault((key, rank), {})[layer] = entry
        _LAST[rank] = key


def key_of(module) -> str | None:
    """The record key of a compiled model: ``module`` is a :class:`~autoshard.api.sharded_module.ShardedModule`, a plan,
    a pipelined module or plan, or a graph module (global or a rank's program). None when it has no MoE layer (or,
    for a lazy module, no plan yet)."""
    for _ in range(4):  # ShardedModule / PipelinedModule -> (PipelinePlan ->) Plan -> its graph module
        if isinstance(module, torch.fx.GraphModule):
            break
        inner = getattr(module, "graph_module", None)
        module = inner if inner is not None else getattr(module, "plan", None)
        if module is None:
            return None
    if not isinstance(module, torch.fx.GraphModule):
        return None
    rewrite = module.meta.get(M.MOE_REWRITE)
    return None if rewrite is None else rewrite.key


def _records(module, rank: int | None) -> dict[str, dict]:
    if rank is None:
        comm = getattr(module, "_comm", None)
        rank = comm.rank if comm is not None else _current_rank()
    with _LOCK:
        key = _LAST.get(rank) if module is None else key_of(module)
        return dict(_RECORDS.get((key, rank), {})) if key is not None else {}


def moe_losses(module=None, *, rank: int | None = None) -> dict:
    """The auxiliary losses of ``module``'s last forward (this rank's view; the values are global, replicated):
    ``{"total": α·lb + β·z summed over layers, "layers": {path: {"load_balancing": α·lb, "z": β·z, "total"}}}``.
    Without a module: those of the model that ran an MoE forward last on this rank.

    They are already attached to the autograd graph (their gradients flow with the model's own loss); add
    ``total`` to the *logged* loss, not to the one you call ``backward`` on.
    """
    recs = _records(module, rank)
    layers = {k: {"load_balancing": v["load_balancing"], "z": v["z"], "total": v["total"]} for k, v in recs.items()}
    total = sum((v["total"] for v in layers.values()), torch.zeros(()))
    return {"total": total, "layers": layers}


def moe_stats(module=None, *, rank: int | None = None) -> dict[str, dict]:
    """Per MoE layer, the routing of ``module``'s last forward over all ranks' tokens: ``tokens_per_expert`` (kept
    choices), ``routed_per_expert`` (before capacity), ``dropped``, ``dropped_fraction`` (of the ``tokens·k``
    choices), plus the unscaled losses ``load_balancing_raw`` and ``z_raw``."""
    return {k: {key: v[key] for key in ("tokens_per_expert", "routed_per_expert", "dropped", "dropped_fraction",
                                        "tokens", "load_balancing_raw", "z_raw")}
            for k, v in _records(module, rank).items()}


def clear_records(module=None) -> None:
    """Forget the records of ``module`` (every rank), or of every model when no module is given."""
    with _LOCK:
        if module is None:
            _RECORDS.clear()
            _LAST.clear()
            return
        key = key_of(module)
        for k in [k for k in _RECORDS if k[0] == key]:
            del _RECORDS[k]
