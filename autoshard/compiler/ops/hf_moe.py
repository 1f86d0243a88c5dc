"""Registry entries of the ops the Hugging Face sparse-MoE path traces and rewrites to: ``autoshard::hf_experts``
(a recognised experts block, :mod:`autoshard.frontend.hf_blocks`) and
:func:`autoshard.runtime.moe.graph_ops.slot_groups` (the GShard positions the ``MoE(existing=True)`` rewrite in
:mod:`autoshard.passes.expert_rewrite` emits)."""

from __future__ import annotations

import torch
import torch.fx

from autoshard import meta as M
from autoshard.compiler.ops.dimmap import DimMap, OpInfo
from autoshard.compiler.ops.registry import Workspace, elementwise, op
from autoshard.frontend import hf_blocks  # noqa: F401  (defines torch.ops.autoshard.hf_experts)
from autoshard.runtime.moe.graph_ops import slot_groups


def _experts_flops(op) -> object:
    """Each token through its top-k experts (the op's sparse, dropless form): ``2·T·k·(h·out + f·h)``, ``k/E`` of
    every expert on every token, from the top-k index ``[T, k]`` and one expert's weights.

    At the graph's global shapes, as every FLOP count (:func:`autoshard.cost_models.compute.flops`): the
    weights' ``E`` does not enter, and a rank holding ``E_local`` of the experts does ``E_local/E`` of it on
    average (its tokens' choices of its own experts): the op's ``split`` facet (:func:`_experts_split`, the tokens'
    split times the experts') is what the cost model divides it by."""
    tokens, k = op.shape(op.arg(1))
    up, down = op.shape(op.arg(3)), op.shape(op.arg(4))
    return 2 * tokens * k * (up[1] * up[2] + down[1] * down[2])


def _experts_workspace(node: torch.fx.Node, strategy, mesh) -> Workspace:
    """What the sparse form holds while it runs on one rank: ``rows = T_local·k`` routed rows at most (every choice
    of the rank's tokens on the rank's experts; ``E_local/E`` of it on average), each ``3·h + out + 2·f`` features
    (the gathered input, the first projection, the activation and gated product, the expert's output and its weighted
    copy), four int64 indices per row, and a float32 ``[T_local, h]`` sum. Backward recomputes the forward under
    autograd and holds a gradient of each row tensor too: twice the rows. Freed when the op returns: transient."""
    from autoshard.frontend.graph_utils import itemsize
    from autoshard.placements import local_shape

    hidden, index, up, down = (node.args[i] for i in (0, 1, 3, 4))
    tokens, h = local_shape(tuple(hidden.meta["val"].shape), strategy.input_specs[0], mesh)
    rows = tokens * index.meta["val"].shape[1]
    up_shape, down_shape = up.meta["val"].shape, down.meta["val"].shape
    out, f = up_shape[1] * up_shape[2] // h, down_shape[1] * down_shape[2] // h
    per_row = (3 * h + out + 2 * f) * itemsize(hidden) * (2 if node.meta.get(M.REQUIRES_GRAD) else 1)
    return Workspace(transient=rows * (per_row + 4 * 8) + tokens * h * 4)


def _experts_split(node: torch.fx.Node, strategy, mesh) -> float:
    """How many ways a strategy splits the op's work: its tokens' split times its experts' split. A rank runs its
    tokens' choices of its own experts only (``E_local/E`` of them on average); the tokens ("t") and the experts
    ("e") are split over different axes, and no single operand carries both splits."""
    import math

    from autoshard.placements import local_shape

    ratios = []
    for pos in (0, 3):  # hidden (its tokens), the stacked in-projection (its experts)
        val, spec = node.args[pos].meta["val"], strategy.input_specs[pos]
        local = 1 if spec is None else math.prod(local_shape(tuple(val.shape), spec, mesh))
        ratios.append(1.0 if spec is None or val.numel() == 0 else val.numel() / max(1, local))
    return ratios[0] * ratios[1]


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


# backward: the op recomputes its forward under autograd (1x), then the gradients of the rows and of the weights
# (2x, as a matmul's)
@op(torch.ops.autoshard.hf_experts.default, flops=_experts_flops, backward=3.0, saves=(0, 1, 2, 3, 4),
    localize=_experts_local, workspace=_experts_workspace, compute_kind="matmul", split=_experts_split)
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
