"""What the agreement check before every call costs (autoshard/runtime/agreement.py ``check_call``).

Every call of a ShardedModule first exchanges (plan digest, mode, grad mode) across the world, so a call on some
ranks only is an error on every rank instead of an abort inside gloo or a hang. This measures the price on 4 gloo
processes on 127.0.0.1, side by side in one run, same model (the example GPT, Megatron on data=2 x model=2), same
data: training steps (forward + backward, gradients set to None) with the check, and with ``check_call`` replaced by
a no-op. Repetitions are interleaved (each runs one untimed step, then the timed steps of both variants, the order
alternating); the reported ratio is the median over repetitions of (with check) / (without), with the slower rank's
time per step. The check's own time is measured alone too (median of many calls).

    python bench/call_check.py            # about a minute on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # run as a script (and in spawned workers): make `examples` importable
    sys.path.insert(0, str(_ROOT))


def _work(rank, world_size, layers, reps, steps):
    import autoshard
    from autoshard.compiler.plan import loss_of
    from autoshard.runtime import agreement
    from examples import models

    torch.manual_seed(0)
    model, args, _ = models.gpt(layers=layers, batch=8, seq=64, hidden=128)
    mesh = autoshard.Mesh(data=2, model=2)
    sharded = autoshard.compile(model, mesh, args, annotations=models.megatron(mesh, "gpt"), device="cpu")
    local = tuple(autoshard.data_shard(x, mesh, rank) for x in args)
    real_check = agreement.check_call

    def step():
        loss_of(sharded(*local)).backward()
        for p in sharded.parameters():
            p.grad = None

    def timed(check: bool) -> float:
        agreement.check_call = real_check if check else (lambda *a, **k: None)
        step()  # untimed: warm
        torch.distributed.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        return (time.perf_counter() - t0) / steps

    rows = []
    for r in range(reps):
        order = (True, False) if r % 2 == 0 else (False, True)
        rows.append({check: timed(check) for check in order})
    agreement.check_call = real_check
    comm = sharded.communicator()
    alone = []
    for _ in range(200):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        real_check(comm, sharded._digest, True)
        alone.append(time.perf_counter() - t0)
    return rows, statistics.median(alone)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--steps", type=int, default=4)
    a = parser.parse_args()
    from autoshard.runtime import spawn

    results = spawn(_work, 4, a.layers, a.reps, a.steps, timeout=600)
    slowest = [{c: max(r[0][i][c] for r in results) for c in (True, False)} for i in range(a.reps)]
    ratio = statistics.median(s[True] / s[False] for s in slowest)
    with_check = statistics.median(s[True] for s in slowest)
    without = statistics.median(s[False] for s in slowest)
    alone = max(r[1] for r in results)
    print(f"GPT {a.layers} layers (hidden 128, seq 64, batch 8), Megatron on data=2 x model=2, 4 gloo processes, "
          f"{a.reps} interleaved repetitions of {a.steps} steps")
    print(f"step with the check / without: {ratio:.3f} (median of per-repetition ratios; medians "
          f"{with_check * 1e3:.2f} ms vs {without * 1e3:.2f} ms)")
    print(f"check_call alone: {alone * 1e6:.0f} us (median of 200, slowest rank)")


if __name__ == "__main__":
    main()
