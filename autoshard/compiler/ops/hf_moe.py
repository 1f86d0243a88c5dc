"""Registry entries of the ops the Hugging Face sparse-MoE path traces and rewrites to: ``autoshard::hf_experts``
(a recognised experts block, :mod:`autoshard.frontend.hf_blocks`) and
:func:`autoshard.runtime.moe.graph_ops.slot_groups` (the GShard positions the ``MoE(existing=True)`` rewrite in
:mod:`autoshard.passes.expert_rewrite` emits)."""

from __future__ import annotations

import torch

from autoshard.compiler.ops.dimmap import DimMap, OpInfo
from autoshard.compiler.ops.registry import elementwise, op
from autoshard.frontend import hf_blocks  # noqa: F401  (defines torch.ops.autoshard.hf_experts)
from autoshard.runtime.moe.graph_ops import slot_groups


def _experts_flops(op) -> object:
    """Every expert on every token (the op's dropless form): ``2·E·T·(h·out + f·h)`` from the stacked weights."""
    tokens = op.shape(op.arg(0))[0]
    up, down = op.shape(op.arg(3)), op.shape(op.arg(4))
    return 2 * tokens * (up[0] * up[1] * up[2] + down[0] * down[1] * down[2])


def _experts_local(graph, new, old, mesh, rank):
    """Experts sharded on their dim 0: this rank's slice starts at its offset among the experts (the top-k indices
    stay global), so choices of other experts add nothing here and the output is this rank's Partial share."""
    from autoshard.compiler.ops.local import input_spec
    from autoshard.placements import Shard, shard_offsets

    spec = input_spec(old, 3)
    if not any(isinstance(p, Shard) and p.dim == 0 for p in spec):
        return new
    offset = shard_offsets(tuple(old.args[3].meta["val"].shape), spec, mesh, rank)[0]
    args = list(new.args[:11]) + [int(offset)]
    new.args = tuple(args)
    new.kwargs = {}
    return new


@op(torch.ops.autoshard.hf_experts.default, flops=_experts_flops, saves=(0, 1, 2, 3, 4), localize=_experts_local)
def _hf_experts_rule(info: OpInfo) -> DimMap:
    # token-parallel ("t": hidden, top-k index and weights share the token dim) and expert-parallel ("e": the
    # stacked weights' and biases' expert dim; it does not reach the output, so a rank holding some experts
    # computes its Partial share of the sum over each token's choices)
    tok = lambda s: None if s is None else (("t",) + (None,) * (len(s) - 1))
    exp = lambda s: None if s is None else (("e",) + (None,) * (len(s) - 1))
    ins = tuple(tok(s) if i < 3 else exp(s) for i, s in enumerate(info.in_shapes))
    return DimMap(ins, (tok(info.out_shapes[0]),))


@op(slot_groups, flops=elementwise, saves=())
def _slot_rule(info: OpInfo) -> DimMap:
    g = lambda s: tuple("g" if d == 0 else None for d in range(len(s)))
    return DimMap((g(info.in_shapes[0]),), tuple(g(s) for s in info.out_shapes))
