"""Local kernels that generated per-rank code calls where an op's local form differs from its global one.

Pure-torch kernels are plain functions (``torch.compile`` traces through them); kernels that communicate or draw
random numbers are ``torch.library`` custom ops (``torch.ops.autoshard.*``) with fake kernels and autograd
formulas, like the collectives of :mod:`autoshard.runtime.collective_ops`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from autoshard.runtime.communicator import current
from autoshard.runtime.primitives import AUTOCAST_FP32, define_op, raw_all_gather, raw_all_reduce


def cross_entropy_partial_mean(logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None,
                               ignore_index: int, label_smoothing: float, axes: tuple[str, ...],
                               log_probs: bool = False) -> torch.Tensor:
    """This rank's share of a mean cross-entropy whose batch is sharded over ``axes``.

    The global mean divides the sum over *all* ranks' non-ignored targets by their global count, which no rank
    knows statically (ignore_index). Each rank returns ``local_sum / global_count``; summing the partial values
    over the ranks (the Partial→Replicate all-reduce that follows) gives exactly the single-device loss.
    """
    total = _loss_sum(logits, target, weight, ignore_index, label_smoothing, log_probs)
    # the count in the dtype of the sum: under torch.autocast the loss is float32 (cross_entropy is on autocast's
    # fp32 list) while the logits are bf16, whose 8 bits would round a count above 256 as eager's never is
    count = _target_count(target, weight, ignore_index, total.dtype).reshape(1)
    for axis in axes:
        count = raw_all_reduce(count, axis, "forward")
    return total / count.reshape(())


def _target_count(target, weight, ignore_index, dtype) -> torch.Tensor:
    """This rank's count of non-ignored targets (their total class weight with ``weight``), no gradient."""
    with torch.no_grad():
        valid = target != ignore_index
        if weight is not None:
            return weight[target.clamp(min=0)].masked_fill(~valid, 0).sum().to(dtype)
        return valid.sum().to(dtype)


def _loss_sum(logits, target, weight, ignore_index, label_smoothing, log_probs) -> torch.Tensor:
    if log_probs:  # nll_loss: the inputs are already log-probabilities
        return F.nll_loss(logits, target, weight=weight, ignore_index=ignore_index, reduction="sum")
    return F.cross_entropy(logits, target, weight=weight, ignore_index=ignore_index, reduction="sum",
                           label_smoothing=label_smoothing)


def masked_embedding(weight: torch.Tensor, indices: torch.Tensor, offset: int, padding_idx: int = -1) -> torch.Tensor:
    """Vocabulary-parallel embedding: rows ``[offset, offset + local_rows)`` live here; other ids give zeros, so the
    per-rank results are a Partial sum of the full lookup."""
    rows = weight.shape[0]
    local = indices - offset
    hit = (local >= 0) & (local < rows)
    pad = padding_idx - offset if padding_idx >= 0 and 0 <= padding_idx - offset < rows else -1
    out = torch.ops.aten.embedding.default(weight, local.clamp(0, rows - 1), pad)
    return out * hit.unsqueeze(-1).to(out.dtype)


# ---- vocabulary-parallel cross-entropy (Megatron) ---------------------------------------------------------
@define_op("vocab_parallel_cross_entropy",
     "(Tensor logits, Tensor target, int ignore_index, int reduction, str vocab_axis, int vocab_size, "
     "str[] batch_axes) -> (Tensor, Tensor, Tensor)", autocast=AUTOCAST_FP32)
def _vocab_parallel_ce(logits, target, ignore_index, reduction, vocab_axis, vocab_size, batch_axes):
    """(loss, softmax of the local classes, count). Forward: the row max, the sum of exponentials and the target
    logit are combined over the vocab axis, so each rank knows the exact per-token loss without gathering the
    logits. The loss is a *Partial* value on the vocab axis (on coordinate 0, zero elsewhere) and, for a mean over
    a batch sharded on ``batch_axes``, divided by the global count of targets."""
    comm = current()
    n_local = logits.shape[-1]
    offset = comm.axis_index(vocab_axis) * n_local
    x = logits.detach().float()
    row_max = raw_all_gather(x.max(dim=-1).values.unsqueeze(0), vocab_axis, 0, vocab_size, "forward").max(dim=0).values
    shifted = x - row_max.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = raw_all_reduce(exp.sum(dim=-1), vocab_axis, "forward")
    valid = target != ignore_index
    local_t = target - offset
    hit = valid & (local_t >= 0) & (local_t < n_local)
    picked = shifted.gather(-1, local_t.clamp(0, n_local - 1).unsqueeze(-1)).squeeze(-1) * hit
    picked = raw_all_reduce(picked, vocab_axis, "forward")
    per_token = (sum_exp.log() - picked) * valid
    count = torch.ones((), dtype=x.dtype, device=x.device)
    if reduction == 0:
        out = per_token
    else:
        if reduction == 1:
            count = valid.sum().to(x.dtype)
            for axis in batch_axes:
                count = raw_all_reduce(count.reshape(1), axis, "forward").reshape(())
        out = per_token.sum() / count
    first = 1.0 if comm.axis_index(vocab_axis) == 0 else 0.0
    return (out * first).to(logits.dtype), exp / sum_exp.unsqueeze(-1), count


@_vocab_parallel_ce.register_fake
def _(logits, target, ignore_index, reduction, vocab_axis, vocab_size, batch_axes):
    loss = logits.new_empty(target.shape) if reduction == 0 else logits.new_empty(())
    return loss, logits.new_empty(logits.shape, dtype=torch.float32), logits.new_empty((), dtype=torch.float32)


def _setup_vocab_ce(ctx, inputs, output):
    logits, target, ignore_index, reduction, vocab_axis, _, _ = inputs
    _, softmax, count = output
    ctx.save_for_backward(softmax, target, count)
    ctx.ignore_index, ctx.reduction = ignore_index, reduction
    ctx.offset = current().axis_index(vocab_axis) * logits.shape[-1]


def _vocab_ce_backward(ctx, grad, _softmax_grad, _count_grad):
    # (softmax - onehot) / count on the local slice of the classes: no communication
    softmax, target, count = ctx.saved_tensors
    n_local = softmax.shape[-1]
    valid = target != ctx.ignore_index
    local_t = target - ctx.offset
    hit = valid & (local_t >= 0) & (local_t < n_local)
    g = softmax.scatter_add(-1, local_t.clamp(0, n_local - 1).unsqueeze(-1), -hit.to(softmax.dtype).unsqueeze(-1))
    g = g * valid.unsqueeze(-1)
    scale = grad.float().unsqueeze(-1) if ctx.reduction == 0 else grad.float() / count
    return (g * scale).to(grad.dtype), None, None, None, None, None, None


_vocab_parallel_ce.register_autograd(_vocab_ce_backward, setup_context=_setup_vocab_ce)


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: int,
                                 vocab_axis: str, vocab_size: int, batch_axes) -> torch.Tensor:
    """Cross-entropy over logits whose class dim is sharded on ``vocab_axis`` (of ``vocab_size`` ranks)."""
    return torch.ops.autoshard.vocab_parallel_cross_entropy(logits, target, ignore_index, reduction, vocab_axis,
                                                           vocab_size, list(batch_axes))[0]


# ---- dropout with one global mask -------------------------------------------------------------------------
@define_op("dropout",
           "(Tensor x, float p, SymInt[] global_shape, SymInt[] offsets, int seed) -> (Tensor, Tensor)")
def _dropout(x, p, global_shape, offsets, seed):
    """(output, scaled mask). The mask of call ``c`` of this rank's program comes from a generator seeded with
    ``seed`` (fixed per graph node at codegen) and ``c`` (the communicator's count of random calls, equal on every
    rank), drawn for the global shape and sliced at ``offsets``."""
    comm = current()
    if comm._pending is not None:  # the call's agreement check settles before the count moves (runtime.agreement)
        comm.settle()
    call = comm.random_calls
    comm.random_calls += 1
    g = torch.Generator(device=x.device).manual_seed((seed * 1_000_003 + call) % (2**63 - 1))
    keep = torch.rand(list(global_shape), generator=g, device=x.device) >= p
    for d, (start, size) in enumerate(zip(offsets, x.shape)):
        keep = keep.narrow(d, start, size)
    mask = keep.to(x.dtype) / (1.0 - p)
    return x * mask, mask


_dropout.register_fake(lambda x, p, global_shape, offsets, seed: (torch.empty_like(x), torch.empty_like(x)))


def _setup_dropout(ctx, inputs, output):
    ctx.save_for_backward(output[1])


_dropout.register_autograd(lambda ctx, grad, _mask_grad: (grad * ctx.saved_tensors[0], None, None, None, None),
                           setup_context=_setup_dropout)


def dropout(x: torch.Tensor, p: float, train: bool, global_shape: list[int], offsets: list[int], seed: int
            ) -> torch.Tensor:
    """Dropout whose mask is one global mask, sliced: identical on ranks that hold the same elements (a replicated
    tensor stays replicated) and different across shards, whatever the per-process RNG state."""
    if not train or p == 0:
        return x.clone()
    return torch.ops.autoshard.dropout(x, float(p), list(global_shape), list(offsets), int(seed))[0]


def bias_once(bias: torch.Tensor, keep: bool) -> torch.Tensor:
    """Forward: the bias on one rank of a Partial sum, zero on the others. Backward: the whole gradient on every
    rank (the gradient of a Partial output is complete everywhere), so the bias needs no all-reduce."""
    return bias if keep else bias - bias.detach()


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float form of a boolean attention mask: 0 where ``mask`` is True, -inf where False — the tensor
    ``scaled_dot_product_attention`` makes from a boolean mask on every call and keeps for its backward. Made once
    per mask and passed to every attention that reads it, the layers share one saved copy instead of one each."""
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask.logical_not(), float("-inf"))
