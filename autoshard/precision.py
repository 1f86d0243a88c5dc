"""Mixed precision: fp32 master parameters and optimizer state, compute in a lower dtype (as FSDP2's
``MixedPrecisionPolicy``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autoshard.errors import PlanError

__all__ = ["MixedPrecision"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class MixedPrecision:
    """``param_dtype``: the dtype parameters are cast to for compute (the cast is fused with the gather where the
    parameter is stored sharded); ``reduce_dtype``: the dtype gradients are reduced in (default ``param_dtype``);
    ``output_dtype``: the dtype of the model's floating outputs (default: as computed). The parameters the optimizer
    steps (masters) and its state keep the model's own dtype."""

    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None

    def __post_init__(self):
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            v = getattr(self, name)
            if v is None and name != "param_dtype":
                continue
            if v not in _FLOATS:
                raise PlanError(f"MixedPrecision({name}={v!r}): must be a floating dtype, one of "
                                f"{[str(d) for d in _FLOATS]}.")

    @property
    def grad_reduce_dtype(self) -> torch.dtype:
        return self.reduce_dtype or self.param_dtype
