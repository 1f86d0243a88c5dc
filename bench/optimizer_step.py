"""The optimizer step on a ShardedModule's DTensor parameters, next to the same step on plain local tensors and
next to FSDP2's (``fully_shard``), on the same model and the same gloo ranks.

Every rank of one spawn (4 gloo processes on 127.0.0.1) holds, from one forward+backward of HF Llama (hidden 128,
2 layers):

* **dtensor**: ``torch.optim.AdamW`` (foreach, the default) over ``sharded.parameters()`` — DTensors, autoshard
  ``data=2 x model=2`` with the Megatron plan;
* **plain**: the same AdamW over plain tensors with the same local shapes and gradients (what the step cost before
  parameters were DTensors);
* **fsdp2**: ``fully_shard`` per decoder layer and on the root over the 4 ranks, AdamW over its DTensor shards.

The three steps of one repetition run back to back; the printed ratios are medians over repetitions of the
per-repetition ratio to **plain** (paired, so drift in machine speed cancels). Run:

    python bench/optimizer_step.py [--reps 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # run as a script (and in spawned workers): make `examples` importable
    sys.path.insert(0, str(_ROOT))


def _timed(opt) -> float:
    start = time.perf_counter()
    opt.step()
    return time.perf_counter() - start


def _worker(rank, world, reps):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import autoshard
    from autoshard.runtime.parameters import local_of
    from examples import models

    model, _, kwargs = models.hf_llama(layers=2, hidden=128)
    mesh = autoshard.Mesh(data=2, model=2)
    sharded = autoshard.compile(model, mesh, example_kwargs=kwargs, annotations=models.megatron(mesh, "hf_llama"),
                                device="cpu")
    _, local_kwargs = sharded.plan.shard_inputs(rank, (), kwargs)
    sharded(**local_kwargs).loss.backward()
    plain = [torch.nn.Parameter(local_of(p).detach().clone()) for p in sharded.parameters()]
    for q, p in zip(plain, sharded.parameters()):
        q.grad = local_of(p.grad).clone()

    fsdp, _, _ = models.hf_llama(layers=2, hidden=128)
    device_mesh = init_device_mesh("cpu", (world,))
    for layer in fsdp.model.layers:
        fully_shard(layer, mesh=device_mesh)
    fully_shard(fsdp, mesh=device_mesh)
    fsdp(**kwargs).loss.backward()

    opts = {"dtensor": torch.optim.AdamW(sharded.parameters(), lr=1e-4),
            "plain": torch.optim.AdamW(plain, lr=1e-4),
            "fsdp2": torch.optim.AdamW(fsdp.parameters(), lr=1e-4)}
    for opt in opts.values():  # state made, first-call costs paid
        opt.step()
    times = {k: [] for k in opts}
    for _ in range(reps):
        for k, opt in opts.items():
            times[k].append(_timed(opt))
    return times


def main(argv=None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    a = parser.parse_args(argv)
    from autoshard.runtime import spawn

    results = spawn(_worker, 4, a.reps, timeout=600)
    rows = {}
    for key in ("dtensor", "fsdp2"):
        ratios = [t / b for r in results for t, b in zip(r[key], r["plain"])]
        rows[key] = statistics.median(ratios)
    print("AdamW step, HF Llama hidden 128 x 2 layers, 4 gloo ranks (median of per-repetition ratios to plain)")
    print(f"{'parameters':<34}{'step time / plain':>18}")
    print(f"{'plain local tensors':<34}{1.0:>18.2f}")
    print(f"{'autoshard DTensor (data=2 x model=2)':<34}{rows['dtensor']:>18.2f}")
    print(f"{'FSDP2 fully_shard (4 ranks)':<34}{rows['fsdp2']:>18.2f}")
    return rows


if __name__ == "__main__":
    main()
