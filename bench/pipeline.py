"""Pipeline step time vs stages × microbatches on gloo, and the measured bubble next to the theoretical one.

A compute-heavy chain of ``layers`` square linears (tanh between, MSE loss) is compiled with
``autoshard.Pipeline`` on ``Mesh(pipe=p)`` and run for ``repeats`` timed steps (forward + backward, after one
warm-up) in ``p`` gloo processes; each step time is the fastest of the repeats (the least disturbed by other
work on the machine) of the slowest rank. The reference is
the same model in one process running the same ``m`` microbatches one after the other (gradient accumulation):
``T1``, timed by every pipeline process between its pipelined steps (so under the same load; rows with ``p=1``
time it alone). With ``p`` equal stages the ideal pipelined step is ``T1 / p``; what is left is the bubble plus the
transfers, so the *measured* bubble is ``1 - (T1 / p) / T_step``, printed next to the theoretical
``(p - 1) / (m + p - 1)`` of GPipe/1F1B.

    python bench/pipeline.py                   # p in 1,2; m in 1,2,4,8; hidden 512, 8 layers, batch 64
    python bench/pipeline.py --stages 1 2 4    # p=4 needs 4 free cores to mean anything
    python bench/pipeline.py --quick           # seconds-long smoke run

Numbers are only meaningful when each process has a core of its own: on a shared 2-core machine, ``p=2`` is
the largest useful setting, and noise from other work shows up as extra bubble.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn


class Chain(nn.Module):
    def __init__(self, hidden: int, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return F.mse_loss(x, y)


def _model(hidden: int, layers: int, batch: int):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return Chain(hidden, layers), (torch.randn(batch, hidden, generator=g), torch.randn(batch, hidden, generator=g))


def _worker(rank, world_size, hidden, layers, batch, microbatches, schedule, repeats):
    import torch.distributed as dist

    import autoshard
    from autoshard.api.sharded_module import make_options
    from autoshard.api.pipelined_module import PipelineRunner
    from autoshard.compiler.pipeline import Pipeline, build_pipeline_plan
    from autoshard.runtime import DistCommunicator

    model, args = _model(hidden, layers, batch)
    mesh = autoshard.Mesh(pipe=world_size)
    pplan = build_pipeline_plan(model, mesh, args, {}, make_options(None, "data", "error", mesh),
                                Pipeline(microbatches=microbatches, schedule=schedule))
    runner = PipelineRunner(pplan, comm=DistCommunicator(mesh, timeout=120))
    times, singles = [], []
    for i in range(repeats + 1):
        dist.barrier()
        t = time.perf_counter()
        runner.step(*args)
        dist.barrier()
        if i:
            times.append(time.perf_counter() - t)
        for p in runner.parameters():
            p.grad = None
        # the one-process reference, timed in the same rounds (same load on the machine): every rank at once
        dist.barrier()
        singles.append(_accumulate(model, args, microbatches))
    return min(times), pplan.split.imbalance, min(singles[1:])


def _accumulate(model, args, microbatches: int) -> float:
    x, y = args
    t = time.perf_counter()
    for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches)):
        (model(xm, ym) / microbatches).backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t


def single_process(hidden: int, layers: int, batch: int, microbatches: int, repeats: int) -> float:
    torch.set_num_threads(1)
    model, args = _model(hidden, layers, batch)
    return min(_accumulate(model, args, microbatches) for _ in range(repeats + 1))


def run(stages=(1, 2), microbatches=(1, 2, 4, 8), hidden=512, layers=8, batch=64, repeats=5,
        schedule="gpipe") -> list[dict]:
    from autoshard.compiler.pipeline import bubble_fraction
    from autoshard.runtime import spawn

    rows = []
    for m in microbatches:
        for p in stages:
            if p == 1:
                t1 = step = single_process(hidden, layers, batch, m, repeats)
                imbalance = 1.0
            else:
                out = spawn(_worker, p, hidden, layers, batch, m, schedule if m >= p else "gpipe", repeats,
                            timeout=300)
                step, imbalance, t1 = max(o[0] for o in out), out[0][1], min(o[2] for o in out)
            measured = 1 - (t1 / p) / step
            rows.append({"p": p, "m": m, "step_ms": step * 1e3, "ideal_ms": t1 / p * 1e3, "measured": measured,
                             "theory": bubble_fraction(p, m), "imbalance": imbalance})
    return rows


def format_rows(rows: list[dict]) -> str:
    head = f"{'p':>2} {'m':>3} {'step ms':>9} {'T1/p ms':>9} {'bubble measured':>16} {'theory (p-1)/(m+p-1)':>21} " \
           f"{'imbalance':>9}"
    lines = [head]
    for r in rows:
        lines.append(f"{r['p']:>2} {r['m']:>3} {r['step_ms']:>9.2f} {r['ideal_ms']:>9.2f} {r['measured']:>16.3f} "
                     f"{r['theory']:>21.3f} {r['imbalance']:>9.3f}")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Pipeline step time and bubble vs stages x microbatches on gloo.")
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--schedule", default="gpipe", choices=["gpipe", "1f1b"])
    ap.add_argument("--quick", action="store_true", help="tiny sizes, 2 repeats: a smoke run")
    a = ap.parse_args(argv)
    if a.quick:
        a.hidden, a.layers, a.batch, a.repeats, a.microbatches = 64, 4, 8, 2, [1, 4]
    rows = run(tuple(a.stages), tuple(a.microbatches), a.hidden, a.layers, a.batch, a.repeats, a.schedule)
    print(f"pipeline bench: Chain(hidden={a.hidden}, layers={a.layers}), batch {a.batch}, schedule {a.schedule}, "
          f"gloo on CPU, best of {a.repeats} steps")
    print(format_rows(rows))


if __name__ == "__main__":
    main()
