"""Local kernels that generated per-rank code calls where an op's local form differs from the global one."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from autoshard.runtime.comm import current


def cross_entropy_partial_mean(logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None,
                               ignore_index: int, label_smoothing: float, axes: tuple[str, ...]) -> torch.Tensor:
    """This rank's share of a mean cross-entropy whose batch is sharded over ``axes``.

    The global mean divides the sum over *all* ranks' non-ignored targets by their global count, which no rank
    knows statically (ignore_index). Each rank returns ``local_sum / global_count``; summing the partial values
    over the ranks (the Partial→Replicate all-reduce that follows) gives exactly the single-device loss.
    """
    total = F.cross_entropy(logits, target, weight=weight, ignore_index=ignore_index, reduction="sum",
                            label_smoothing=label_smoothing)
    with torch.no_grad():
        valid = target != ignore_index
        if weight is not None:
            count = weight[target.clamp(min=0)].masked_fill(~valid, 0).sum().to(logits.dtype)
        else:
            count = valid.sum().to(logits.dtype)
        comm = current()
        for axis in axes:
            count = comm.all_reduce(count.reshape(1), axis).reshape(())
    return total / count


def masked_embedding(weight: torch.Tensor, indices: torch.Tensor, offset: int) -> torch.Tensor:
    """Vocabulary-parallel embedding: rows ``[offset, offset + local_rows)`` live here; other ids give zeros."""
    rows = weight.shape[0]
    local = indices - offset
    hit = (local >= 0) & (local < rows)
    out = F.embedding(local.clamp(0, rows - 1), weight)
    return out * hit.unsqueeze(-1).to(out.dtype)
