"""What a rank waits at a collective when ranks share cores: compute, a small all_reduce, and both, on 4 gloo ranks.

``autoshard calibrate`` times each probe right after a barrier, every rank arriving together; in a training step a
rank arrives at a collective from compute, and on a machine with fewer cores than ranks its peers may have been
descheduled meanwhile. This measures that difference, per iteration of a loop every rank runs at once (the mean over
ranks of each rank's mean over ``--iters`` iterations), at three amounts of compute (256x256 matmuls):

* compute alone on its rank (the others wait in a barrier), and on every rank at once;
* a small all_reduce (256 floats) in a loop on every rank;
* compute then the all_reduce; ``extra per all_reduce`` = that, less the two before it.

    python bench/collective_wait.py              # 4 ranks, 40 iterations per row
    python bench/collective_wait.py --world-size 2 --iters 100

These are measurements to model from (the contention :mod:`autoshard.cost_models.calibrate` prints, and a time per
collective call), not asserts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

MATMULS = (2, 8, 32)


def _worker(rank: int, world_size: int, matmuls: int, iters: int) -> dict:
    import torch
    import torch.distributed as dist

    a, t = torch.randn(256, 256), torch.ones(256)

    def compute():
        for _ in range(matmuls):
            torch.mm(a, a)

    def all_reduce():
        dist.all_reduce(t)

    def both():
        compute()
        all_reduce()

    for _ in range(3):
        both()
    out = {}
    for name, fn in (("compute_all", compute), ("all_reduce", all_reduce), ("both", both)):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        out[name] = (time.perf_counter() - start) / iters
    for r in range(world_size):  # each rank alone in turn, the others waiting in the barrier
        dist.barrier()
        if r == rank:
            start = time.perf_counter()
            for _ in range(iters):
                compute()
            out["compute_alone"] = (time.perf_counter() - start) / iters
    dist.barrier()
    return out


def measure(world_size: int, iters: int) -> list[dict]:
    from autoshard.runtime import spawn

    rows = []
    for matmuls in MATMULS:
        per_rank = spawn(_worker, world_size, matmuls, iters, timeout=300)
        mean = {k: statistics.mean(r[k] for r in per_rank) for k in per_rank[0]}
        mean["extra"] = mean["both"] - mean["compute_all"] - mean["all_reduce"]
        rows.append({"matmuls": matmuls, **mean})
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--iters", type=int, default=40)
    opts = ap.parse_args(argv)
    rows = measure(opts.world_size, opts.iters)
    print(f"{opts.world_size} gloo ranks on {os.cpu_count()} cores, ms per iteration (mean over ranks)")
    print(f"{'matmuls':>8} {'compute alone':>14} {'compute, all':>13} {'all_reduce':>11} {'both':>8} {'extra':>8}")
    for r in rows:
        print(f"{r['matmuls']:>8} {r['compute_alone'] * 1e3:>14.2f} {r['compute_all'] * 1e3:>13.2f} "
              f"{r['all_reduce'] * 1e3:>11.2f} {r['both'] * 1e3:>8.2f} {r['extra'] * 1e3:>8.2f}")
    return rows


if __name__ == "__main__":
    main()
