"""Local kernels that generated per-rank code calls where an op's local form differs from the global one."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from autoshard.runtime.collectives import all_reduce
from autoshard.runtime.comm import current
from autoshard.runtime.pending import PendingTensor


def cross_entropy_partial_mean(logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None,
                               ignore_index: int, label_smoothing: float, axes: tuple[str, ...],
                               log_probs: bool = False) -> torch.Tensor:
    """This rank's share of a mean cross-entropy whose batch is sharded over ``axes``.

    The global mean divides the sum over *all* ranks' non-ignored targets by their global count, which no rank
    knows statically (ignore_index). Each rank returns ``local_sum / global_count``; summing the partial values
    over the ranks (the Partial→Replicate all-reduce that follows) gives exactly the single-device loss.
    """
    comm = current()
    count = _target_count(target, weight, ignore_index, logits.dtype)
    # the count's all-reduce travels while this rank computes its loss sum
    handle = comm.all_reduce_async(count.reshape(1), axes[0], phase="forward") if axes else None
    total = _loss_sum(logits, target, weight, ignore_index, label_smoothing, log_probs)
    if handle is not None:
        count = handle.wait()
        for axis in axes[1:]:
            count = comm.all_reduce(count, axis)
        count = count.reshape(())
    return total / count


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


def target_count_started(target: torch.Tensor, weight: torch.Tensor | None, ignore_index: int, axis: str,
                         dtype: torch.dtype) -> torch.Tensor:
    """The global count of non-ignored targets (their total class weight with ``weight``) of a batch sharded over
    ``axis``, as ``dtype``, its all-reduce started now: a
    :class:`~autoshard.runtime.pending.PendingTensor` waited when read. Codegen emits it as early in forward as
    the targets allow (they are inputs), so the count has arrived long before backward needs it."""
    comm = current()
    axis = comm._axis(axis)
    count = _target_count(target, weight, ignore_index, dtype).reshape(1)
    if torch.compiler.is_compiling():
        return comm.all_reduce(count, axis).reshape(())
    handle = comm.all_reduce_async(count, axis, phase="forward")
    if handle.is_completed():  # the simulator's collectives complete at once
        return handle.wait().reshape(())
    comm.pending.append(handle)
    return PendingTensor(count.reshape(()), handle, finish=lambda summed: summed.reshape(()))


def _value(t: torch.Tensor) -> torch.Tensor:
    return t.wait() if isinstance(t, PendingTensor) else t


class _MeanOutput(torch.autograd.Function):
    """``(Σ_ranks total) / count`` with the global ``count`` already on its way (:func:`target_count_started`):
    the sum's all-reduce is started and left in flight; backward needs only the count (``d/d total = 1 / count``),
    which arrived during forward — backward never waits for the other ranks."""

    @staticmethod
    def forward(ctx, total, count, comm, axis):
        ctx.count = count
        handle = comm.all_reduce_async(total.detach().reshape(1).clone(), axis, phase="forward")  # reduced in place
        if handle.is_completed():  # the simulator
            return handle.wait().reshape(()) / _value(count)
        comm.pending.append(handle)
        return PendingTensor(total.detach(), handle, finish=lambda summed: summed.reshape(()) / _value(count))

    @staticmethod
    def backward(ctx, grad):
        return grad / _value(ctx.count), None, None, None


def cross_entropy_mean_output(logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None,
                              ignore_index: int, label_smoothing: float, axis: str, log_probs: bool = False,
                              count: torch.Tensor | None = None) -> torch.Tensor:
    """The global mean cross-entropy (or nll) of a batch sharded over ``axis``, returned by the program: the global
    target ``count`` (from :func:`target_count_started`, started early in forward; computed here when None) and
    one all-reduce of the local loss sum, left in flight (a :class:`~autoshard.runtime.pending.PendingTensor`
    waited when read or by the gradient bucketer) instead of a blocking count all-reduce and an output all-reduce.
    Codegen uses it for ``all_reduce(cross_entropy_partial_mean(...))`` when that is a returned value."""
    comm = current()
    if count is None:
        count = target_count_started(target, weight, ignore_index, axis, logits.dtype)
    total = _loss_sum(logits, target, weight, ignore_index, label_smoothing, log_probs)
    if torch.compiler.is_compiling():
        return all_reduce(total, axis) / count
    return _MeanOutput.apply(total, count, comm, comm._axis(axis))


def masked_embedding(weight: torch.Tensor, indices: torch.Tensor, offset: int, padding_idx: int = -1) -> torch.Tensor:
    """Vocabulary-parallel embedding: rows ``[offset, offset + local_rows)`` live here; other ids give zeros, so the
    per-rank results are a Partial sum of the full lookup."""
    rows = weight.shape[0]
    local = indices - offset
    hit = (local >= 0) & (local < rows)
    pad = padding_idx - offset if padding_idx >= 0 and 0 <= padding_idx - offset < rows else -1
    out = torch.ops.aten.embedding.default(weight, local.clamp(0, rows - 1), pad)
    return out * hit.unsqueeze(-1).to(out.dtype)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits whose class dim is sharded on ``vocab_axis`` (Megatron's vocab-parallel loss).

    Forward: the row max, the sum of exponentials and the target logit are combined over the vocab axis, so each
    rank knows the exact per-token loss without gathering the logits. The result is returned as a *Partial*
    value on the vocab axis (the loss on coordinate 0, zero elsewhere) and, for a mean over a batch sharded on
    ``batch_axes``, divided by the global count of targets. Backward: ``(softmax - onehot) / count`` on the local
    slice of the classes — no communication.
    """

    @staticmethod
    def forward(ctx, logits, target, ignore_index, reduction, vocab_axis, batch_axes, comm):
        n_local = logits.shape[-1]
        offset = comm.axis_index(vocab_axis) * n_local
        x = logits.detach().float()
        row_max = comm.all_gather(x.max(dim=-1).values.unsqueeze(0), vocab_axis, 0).max(dim=0).values
        shifted = x - row_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = comm.all_reduce(exp.sum(dim=-1), vocab_axis)
        valid = target != ignore_index
        local_t = target - offset
        hit = valid & (local_t >= 0) & (local_t < n_local)
        picked = shifted.gather(-1, local_t.clamp(0, n_local - 1).unsqueeze(-1)).squeeze(-1) * hit
        picked = comm.all_reduce(picked, vocab_axis)
        per_token = (sum_exp.log() - picked) * valid
        if reduction == 0:
            count = torch.ones((), dtype=x.dtype)
            out = per_token
        else:
            count = valid.sum().to(x.dtype) if reduction == 1 else torch.ones((), dtype=x.dtype)
            for axis in batch_axes:
                if reduction == 1:
                    count = comm.all_reduce(count.reshape(1), axis).reshape(())
            out = per_token.sum() / count
        first = 1.0 if comm.axis_index(vocab_axis) == 0 else 0.0
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local_t.clamp(0, n_local - 1), hit, valid, count)
        ctx.reduction = reduction
        return (out * first).to(logits.dtype)

    @staticmethod
    def backward(ctx, grad):
        softmax, local_t, hit, valid, count = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, local_t.unsqueeze(-1), -hit.to(g.dtype).unsqueeze(-1))
        g = g * valid.unsqueeze(-1)
        scale = grad.float().unsqueeze(-1) if ctx.reduction == 0 else grad.float() / count
        return (g * scale).to(grad.dtype), None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: int,
                                 vocab_axis: str, batch_axes: tuple[str, ...]) -> torch.Tensor:
    return _VocabParallelCrossEntropy.apply(logits, target, ignore_index, reduction, vocab_axis, tuple(batch_axes),
                                            current())


def dropout(x: torch.Tensor, p: float, train: bool, global_shape: list[int], offsets: list[int], seed: int
            ) -> torch.Tensor:
    """Dropout whose mask is one global mask, sliced: identical on ranks that hold the same elements (a replicated
    tensor stays replicated) and different across shards, whatever the per-process RNG state.

    The mask of call ``c`` of this rank's program comes from a generator seeded with ``seed`` (fixed per graph
    node at codegen) and ``c`` (the communicator's count of random calls, equal on every rank).
    """
    if not train or p == 0:
        return x.clone()
    comm = current()
    call = comm.random_calls
    comm.random_calls += 1
    g = torch.Generator(device=x.device).manual_seed((seed * 1_000_003 + call) % (2**63 - 1))
    keep = torch.rand(global_shape, generator=g, device=x.device) >= p
    for d, (start, size) in enumerate(zip(offsets, x.shape)):
        keep = keep.narrow(d, start, size)
    return x * keep.to(x.dtype) / (1.0 - p)


class _BiasOnce(torch.autograd.Function):
    """Forward: the bias on one rank of a Partial sum, zero on the others. Backward: the whole gradient on every
    rank (the gradient of a Partial output is complete everywhere), so the bias needs no all-reduce."""

    @staticmethod
    def forward(ctx, bias, keep):
        return bias.clone() if keep else torch.zeros_like(bias)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def bias_once(bias: torch.Tensor, keep: bool) -> torch.Tensor:
    return _BiasOnce.apply(bias, keep)
