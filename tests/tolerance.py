"""Tolerances derived from the arithmetic, for results whose float sums are reduced in another order than the
reference's (a kernel's blocking chosen by the CPU and thread count, a rank's partial sums, an all-reduce).

A float sum of n terms, added in any order, is within gamma_(n-1) * sum|terms| of the exact sum, gamma_k = k*u/(1-k*u),
u = eps/2 (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., (4.4)). For a chain of products and sums
(a matmul chain, its gradient, a loss over it) the first-order bound is gamma_n * M: n is the number of roundings on
the longest path from an input to the result (the lengths of the sums on it plus one per product or elementwise
op), M is the same computation on the absolute values of the operands (every term's magnitude, nothing cancelling).
``sum_bound`` takes ``n * eps = 2 * n * u``: the first-order bound with a factor of 2 for the higher-order terms. The
reference is computed in float64 from the same operands, so its own error (~1e-16 relative) is far below the bound.
"""
from __future__ import annotations

import torch


def sum_bound(magnitude: torch.Tensor, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Bound on |computed - exact| of a ``dtype`` result whose terms' magnitudes add up to ``magnitude`` (elementwise)
    and which rounds at most ``n`` times on any path from an input: ``n * eps(dtype) * magnitude``."""
    return n * torch.finfo(dtype).eps * magnitude.double()


def assert_within_sum_bound(actual: torch.Tensor, reference: torch.Tensor, magnitude: torch.Tensor, n: int,
                            dtype: torch.dtype | None = None, what: str = "") -> None:
    """``actual`` (computed in ``dtype``, its own dtype by default) is within ``sum_bound(magnitude, n)`` of
    ``reference`` (float64, same operands) at every element; the message names the worst element."""
    dtype = dtype or actual.dtype
    assert actual.shape == reference.shape == magnitude.shape, (what, actual.shape, reference.shape, magnitude.shape)
    err = (actual.double() - reference.double()).abs()
    bound = sum_bound(magnitude, n, dtype)
    ratio = err / bound.clamp_min(torch.finfo(torch.float64).tiny)
    worst = int(ratio.argmax()) if ratio.numel() else 0
    assert bool((err <= bound).all()), (
        f"{what}: {int((err > bound).sum())} of {err.numel()} elements beyond n*eps*sum|terms| (n={n}, {dtype}); "
        f"worst at flat index {worst}: |err| {err.flatten()[worst].item():.3e} > "
        f"bound {bound.flatten()[worst].item():.3e}")
