"""bf16 mixed precision against fp32: the sharded bf16 loss (data=2 x model=2, Megatron plan, simulator) next to
the fp32 loss on one device, for the example GPT and a tiny HF Llama; and the parameters' and gradients' dtypes.

    python bench/mixed_precision_accuracy.py
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))


def main() -> None:
    import torch

    import autoshard
    from autoshard.compiler.plan import loss_of
    from examples import models

    warnings.simplefilter("ignore")
    mesh = autoshard.Mesh(data=2, model=2)
    print(f"{'model':10s} {'fp32 loss (1 device)':>22s} {'bf16 loss (sharded)':>20s} {'relative':>10s}  "
          "gradient dtypes")
    for name in ("gpt", "hf_llama"):
        model, args, kwargs = models.FACTORIES[name]()
        fp32 = loss_of(model(*args, **kwargs)).item()
        plan = autoshard.compile(model, mesh, args, kwargs, annotations=models.megatron(mesh, name),
                                 precision=autoshard.MixedPrecision(torch.bfloat16, torch.float32)).plan
        sim = plan.simulate(args, kwargs)
        bf16 = loss_of(sim.outputs[0]).float().item()
        dtypes = sorted({str(g.dtype) for g in sim.grads.values()})
        print(f"{name:10s} {fp32:22.5f} {bf16:20.5f} {abs(bf16 - fp32) / abs(fp32):10.1e}  {dtypes}")


if __name__ == "__main__":
    main()
