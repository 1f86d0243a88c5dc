"""Input checks at every entry that runs a plan: the shapes and dtypes it was compiled for, or an autoshard error.

Shapes are static, so a batch of another shape would otherwise fail deep inside a rank program with a raw
``RuntimeError`` (``shape '[4, 16, 4, 16]' is invalid for input of size 3072``). Each entry names what it expects:

* a rank's program (:meth:`ShardedModule.__call__ <autoshard.api.sharded_module.ShardedModule>`,
  ``Plan.rank_program(r)(...)``, the pipelined module's stages) takes this rank's *local* inputs; when a tensor has the
  *global* shape instead, the message says so and points to ``autoshard.data_shard`` (the usual slip: the whole batch on
  every rank);
* :meth:`Plan.simulate <autoshard.compiler.plan.Plan.simulate>` and the CLI take the *global* inputs and cut every
  rank's share themselves; a tensor of one rank's local shape gets the opposite hint.

Every mismatch is a :class:`~autoshard.errors.RuntimeShapeError` naming the input, both shapes (or dtypes), the
entry, and the fix. :func:`expected_inputs` reads what a graph expects from its placeholders (``"val"`` and the
plan's spec); :func:`check_inputs` compares.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree

from autoshard import meta as M
from autoshard.errors import RuntimeShapeError
from autoshard.mesh import Mesh
from autoshard.placements import local_shape

__all__ = ["ExpectedInput", "check_inputs", "expected_inputs", "install_check", "tensor_leaves"]


@dataclass(frozen=True)
class ExpectedInput:
    """One tensor input of a plan: its placeholder name, global and local (per-rank) shapes, and dtype."""

    name: str
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    dtype: torch.dtype


def expected_inputs(graph_module: torch.fx.GraphModule, mesh: Mesh) -> list[ExpectedInput]:
    """The tensor placeholders of a planned graph (annotated with the plan's specs), in placeholder order."""
    out = []
    for n in graph_module.graph.nodes:
        val = n.meta.get("val")
        if n.op != "placeholder" or not isinstance(val, torch.Tensor):
            continue
        spec = n.meta.get(M.SPEC)
        local = tuple(local_shape(val.shape, spec, mesh)) if spec is not None else tuple(val.shape)
        out.append(ExpectedInput(n.name, tuple(val.shape), local, val.dtype))
    return out


def tensor_leaves(args, kwargs) -> list[torch.Tensor]:
    """The tensors among ``args`` and ``kwargs`` (nested containers flattened), in order."""
    return [x for x in pytree.tree_leaves((tuple(args), dict(kwargs or {}))) if isinstance(x, torch.Tensor)]


def check_inputs(expected: list[ExpectedInput], tensors: list[torch.Tensor], *, local: bool, where: str,
                 rank: int | None = None) -> None:
    """Raise :class:`RuntimeShapeError` for the first of ``tensors`` whose shape or dtype differs from
    ``expected`` (``local``: the per-rank shapes, else the global ones). ``where`` names the entry in the message
    (``"rank 1's program"``, ``"Plan.simulate"``). A different number of tensors is left to the program's own
    argument check (a Python ``TypeError`` naming the missing argument)."""
    if len(tensors) != len(expected):
        return
    who = f"rank {rank}" if rank is not None else "this rank"
    for x, e in zip(tensors, expected):
        want = e.local_shape if local else e.global_shape
        have = tuple(x.shape)
        if have != want:
            if local and have == e.global_shape:
                hint = (f"It has the global shape: {where} takes {who}'s shard of each input, e.g. "
                        "autoshard.data_shard(x, mesh, rank) (plan.shard_inputs(rank, ...) cuts every input).")
            elif not local and have == e.local_shape:
                hint = (f"It has one rank's local shape: {where} takes the global inputs and cuts every rank's "
                        "share itself: pass the whole batch.")
            else:
                hint = ("Shapes are static: pad or batch to the compiled shape, or compile a new ShardedModule for "
                        "the new shape.")
            what = f"local shape {list(have)}, but the plan was compiled for {list(want)} on {who}" if local else (
                f"shape {list(have)}, but the plan was compiled for the global shape {list(want)}")
            raise RuntimeShapeError(f"input `{e.name}` has {what}. {hint} (in {where})")
        if x.dtype != e.dtype:
            raise RuntimeShapeError(f"input `{e.name}` has dtype {x.dtype}, but the plan was compiled for {e.dtype}. "
                                    f"Cast the input (x.to({e.dtype})) or compile a new ShardedModule with example "
                                    f"inputs of dtype {x.dtype}. (in {where})")


def install_check(module: torch.fx.GraphModule, expected: list[ExpectedInput], rank: int) -> torch.fx.GraphModule:
    """Check every call of the rank program ``module`` against ``expected`` (local shapes) before it runs (a
    forward pre-hook; skipped while ``torch.compile`` traces it: the compiled graph is guarded on shapes)."""
    signature = inspect.signature(module.forward)
    where = f"rank {rank}'s program"

    def hook(mod, args, kwargs):
        if torch.compiler.is_compiling():
            return None
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return None  # the call itself raises, naming the argument
        check_inputs(expected, tensor_leaves(tuple(bound.arguments.values()), {}), local=True, where=where,
                     rank=rank)
        return None

    module.register_forward_pre_hook(hook, with_kwargs=True)
    return module
