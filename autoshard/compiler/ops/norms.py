"""Normalisations: softmax keeps its dim whole; layer_norm / rms_norm keep the normalised (trailing) dims whole,
with weight and bias replicated."""

from __future__ import annotations

import math

import torch

from autoshard.compiler.ops.dimmap import DimMap, OpInfo, keep_dims_whole
from autoshard.compiler.ops.registry import OUTPUT, Shapes, op

aten = torch.ops.aten


def softmax_flops(op: Shapes):
    return 5 * op.numel(0)


def norm_flops(op: Shapes):
    return 8 * op.numel(0)


def rms_norm_flops(op: Shapes):
    return 4 * op.numel(0)


op(aten.softmax, aten._softmax, aten.log_softmax, aten._log_softmax, flops=softmax_flops, saves=(OUTPUT,))
op(aten.special_softmax, aten.special_log_softmax, flops=softmax_flops)
op(aten.layer_norm, aten.native_layer_norm, aten.group_norm, aten.batch_norm, aten.native_batch_norm,
   flops=norm_flops, saves=(0,))
op(aten.native_group_norm, aten._native_batch_norm_legit, aten._native_batch_norm_legit_no_training,
   flops=norm_flops)
op(aten.instance_norm, flops=norm_flops, saves=(0,))
op(aten.rms_norm, flops=rms_norm_flops, saves=(0,))
op(aten._fused_rms_norm, flops=rms_norm_flops)


@op(aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default)
def _softmax(info: OpInfo) -> DimMap:
    return keep_dims_whole(info, [info.arg(1, "dim")])


@op(aten.layer_norm.default, aten.rms_norm.default)
def _layer_norm(info: OpInfo) -> DimMap:
    n = len(info.in_shapes[0])
    k = len(info.arg(1, "normalized_shape"))
    labels = tuple(None if d >= n - k else f"d{d}" for d in range(n))
    ins = (labels,) + tuple(None if s is None else (None,) * len(s) for s in info.in_shapes[1:])
    return DimMap(ins, (labels,))


# ---- batch, instance and group norm (issue "Any model: op coverage") --------------------------------------
def sync_batch_norm(x, weight, bias, running_mean, running_var, momentum: float, eps: float, axes: list[str],
                    count: int):
    """Batch norm in training mode over a batch sharded on ``axes``: statistics of the *global* batch (SyncBN:
    the single-device result), two all-reduces of per-channel sums; the running statistics are updated in place
    with the same global values on every rank. Gradients: the sums go through ``grad_all_reduce`` (identity
    forward, all-reduce backward), so each rank's share of the statistics' gradient reaches every rank."""
    dims = [0] + list(range(2, x.dim()))
    bshape = [1, x.shape[1]] + [1] * (x.dim() - 2)

    def global_sum(t):
        t = t.sum(dims)
        for a in axes:
            t = torch.ops.autoshard.all_reduce.default(t, a)
        return torch.ops.autoshard.grad_all_reduce.default(t, list(axes))

    mean = global_sum(x) / count
    centred = x - mean.view(bshape)
    var = global_sum(centred * centred) / count
    y = centred * torch.rsqrt(var + eps).view(bshape)
    if weight is not None:
        y = y * weight.view(bshape)
    if bias is not None:
        y = y + bias.view(bshape)
    with torch.no_grad():
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(mean.detach().to(running_mean.dtype), alpha=momentum)
        if running_var is not None:
            unbiased = var.detach() * (count / max(count - 1, 1))
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
    return y


def batch_norm_local(graph, new, old, mesh, rank):
    """Training mode with the batch sharded: :func:`sync_batch_norm` (global statistics); otherwise the op as is
    (channels sharded, or eval mode, where every element is normalised with the running statistics)."""
    from autoshard.compiler.ops.local import arg, input_spec
    from autoshard.placements import Shard

    training = arg(old, 5, "training", False)
    spec = input_spec(old, 0)
    axes = [mesh.names[a] for a, p in enumerate(spec) if isinstance(p, Shard) and p.dim == 0]
    if not training or not axes:
        return new
    shape = old.args[0].meta["val"].shape
    count = shape[0] * math.prod(shape[2:])
    a = list(new.args) + [None] * (9 - len(new.args))
    with graph.inserting_before(new):
        repl = graph.call_function(sync_batch_norm, (a[0], a[1], a[2], a[3], a[4], float(a[6]), float(a[7]), axes,
                                                     count))
    repl.meta.update(new.meta)
    new.replace_all_uses_with(repl)
    graph.erase_node(new)
    return repl


@op(aten.batch_norm.default, localize=batch_norm_local)
def _batch_norm(info: OpInfo) -> DimMap:
    """Channels shard with weight, bias and running statistics. In training mode the batch shards too (global
    statistics through :func:`sync_batch_norm`) and the spatial dims stay whole; in eval mode every dim but the
    channels is independent."""
    x = info.in_shapes[0]
    training = bool(info.arg(5, "training", False))
    spatial = tuple(None if training else f"s{d}" for d in range(len(x) - 2))
    xl = ("n", "c") + spatial
    ins = (xl,) + tuple(None if s is None else ("c",) for s in info.in_shapes[1:])
    return DimMap(ins, (xl,))


@op(aten.instance_norm.default)
def _instance_norm(info: OpInfo) -> DimMap:
    """Statistics per (sample, channel) over the spatial dims: batch and channels shard, spatial dims stay whole.
    With running statistics updated from the batch (``use_input_stats``), the batch stays whole too."""
    x = info.in_shapes[0]
    has_running = info.arg(3, "running_mean") is not None
    n = None if has_running and info.arg(5, "use_input_stats", True) else "n"
    xl = (n, "c") + (None,) * (len(x) - 2)
    ins = (xl,) + tuple(None if s is None else ("c",) for s in info.in_shapes[1:])
    return DimMap(ins, (xl,))


@op(aten.group_norm.default)
def _group_norm(info: OpInfo) -> DimMap:
    """Statistics per (sample, group): only the batch shards."""
    x = info.in_shapes[0]
    xl = ("n",) + (None,) * (len(x) - 1)
    ins = (xl,) + tuple(None if s is None else (None,) for s in info.in_shapes[1:])
    return DimMap(ins, (xl,))
