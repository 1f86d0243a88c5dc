"""Train a small GPT for 20 steps on pipe=2 × data=2 × model=2 (8 gloo processes), and check that every step's
loss equals a single-process run of the same model, data and optimizer (to 1e-4).

    python examples/train_3d.py                   # 8 processes on 127.0.0.1, then the single-process run
    python examples/train_3d.py --steps 5 --schedule gpipe

Each process compiles the same pipelined plan (``autoshard.compile(..., pipeline=autoshard.Pipeline(...))``, which
is deterministic), runs its stage of the pipeline on its data shard of each microbatch with its Megatron shard of
the weights (calling the module runs one forward+backward step and returns the loss), and steps plain
``torch.optim.SGD`` on the parameters it holds: the gradients it holds are exactly its shard of the full-batch
gradient (the tied embedding/LM head copies on stages 0 and 1 get the same summed gradient, so they stay equal).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MESH = {"pipe": 2, "data": 2, "model": 2}
SIZES = {"layers": 4, "hidden": 32, "heads": 4, "seq": 8, "vocab": 64}


def batches(steps: int, batch: int, seq: int, vocab: int):
    g = torch.Generator().manual_seed(1234)
    return [(torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g))
            for _ in range(steps)]


def _worker(rank, world_size, steps, batch, microbatches, schedule, lr):
    import autoshard
    from examples import models

    model, args, _ = models.gpt(batch=batch, **SIZES)
    mesh = autoshard.Mesh(**MESH)
    sm = autoshard.compile(model, mesh, args, annotations=models.megatron(mesh, "gpt"), planner="greedy", timeout=120,
                           pipeline=autoshard.Pipeline(microbatches=microbatches, schedule=schedule))
    opt = torch.optim.SGD(list(sm.parameters()), lr=lr)
    losses = []
    for ids, labels in batches(steps, batch, SIZES["seq"], SIZES["vocab"]):
        opt.zero_grad(set_to_none=True)
        losses.append(float(sm(ids, labels)))  # one step: forward and backward over every microbatch
        opt.step()
    return losses


def single_process(steps: int, batch: int, lr: float) -> list[float]:
    from examples import models

    model, _, _ = models.gpt(batch=batch, **SIZES)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for ids, labels in batches(steps, batch, SIZES["seq"], SIZES["vocab"]):
        opt.zero_grad(set_to_none=True)
        loss = model(ids, labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main(argv=None) -> int:
    from autoshard.runtime import spawn

    ap = argparse.ArgumentParser(description="20 steps of a GPT on pipe=2 x data=2 x model=2 vs one process.")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"])
    ap.add_argument("--lr", type=float, default=0.5)
    a = ap.parse_args(argv)
    per_rank = spawn(_worker, 8, a.steps, a.batch, a.microbatches, a.schedule, a.lr, timeout=600,
                     start_method="forkserver")
    ref = single_process(a.steps, a.batch, a.lr)
    worst = 0.0
    print(f"step  loss 3d (rank 0)  loss 1 process  |diff|   ({a.schedule}, {a.microbatches} microbatches of "
          f"{a.batch // a.microbatches})")
    for i, r in enumerate(ref):
        spread = max(abs(per_rank[k][i] - per_rank[0][i]) for k in range(8))
        d = max(abs(per_rank[0][i] - r), spread)
        worst = max(worst, d)
        print(f"{i:>4}  {per_rank[0][i]:>16.6f}  {r:>14.6f}  {d:.1e}")
    ok = worst <= 1e-4
    print(f"max |loss difference| over {a.steps} steps and 8 ranks: {worst:.2e} -> {'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
