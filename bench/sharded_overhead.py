"""What a ShardedModule call adds to its bare rank program, and how much of it is the agreement check.

Two gloo processes, one model, side by side in one run (repetitions interleaved, the order rotating; per repetition
1 untimed + 2 timed forward+backward steps, each after a barrier; a step's time is the slower rank's), per mesh:

* ``bare``: ``plan.rank_program(rank, bucket_grads=True)`` with a ``GradBucketer`` (``bucket_cap_mb=25``): plain
  tensors, what the ShardedModule runs;
* ``bare+check``: the same after ``autoshard.runtime.agreement.check_call`` waited on before the call (one host
  all-reduce over the world: the check as a ShardedModule made it before it overlapped it with the forward);
* ``sm``: the ``ShardedModule`` (``autoshard.compile(..., comm=..., bucket_cap_mb=25)`` called as a module: its
  DTensor parameters bound to the program per call, gradients as DTensors, the check started before the forward
  and settled before the program's first collective);
* ``sm-sync-check``: the ShardedModule with the check waited on before the program runs (as for a program that may
  change state before its first collective: ``agreement.quiet_until_collective`` replaced by ``False``);
* ``sm-no-check``: the ShardedModule with ``check_call`` replaced by a no-op for the call.

Printed: the median step of each and its median paired ratio to ``bare``.

    python bench/sharded_overhead.py                  # the MLP (4 parameters) and the 4-layer GPT (68)
    python bench/sharded_overhead.py --cases mlp --reps 10
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

SYSTEMS = ("bare", "bare+check", "sm", "sm-sync-check", "sm-no-check")


def _model(case: str):
    import torch

    from examples import models

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if case == "mlp":  # bench/runtime.py's MLP
        return models.MLP(512, 2048), (torch.randn(64, 512, generator=g), torch.randn(64, 512, generator=g)), "mlp"
    ids = torch.randint(0, 1024, (8, 64), generator=g)  # bench/runtime.py's 4-layer GPT
    return models.GPT(1024, 256, 8, 4, 64), (ids, torch.randint(0, 1024, (8, 64), generator=g)), "gpt"


def _worker(rank, world, cases, reps):
    import copy
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    import autoshard
    import autoshard.runtime.agreement as agreement
    from autoshard.compiler.plan import loss_of
    from autoshard.runtime import DistCommunicator, use
    from autoshard.runtime.buckets import GradBucketer
    from examples import models

    real_check, real_quiet = agreement.check_call, agreement.quiet_until_collective
    out = {}
    for case in cases:
        model, args, megatron = _model(case)
        for kind, mesh in (("tp", autoshard.Mesh(model=2)), ("dp", autoshard.Mesh(data=2))):
            comm = DistCommunicator(mesh, timeout=300)
            ann = {k: (v,) for k, v in models.MEGATRON[megatron].items()} if kind == "tp" else {}
            plan = autoshard.compile(model, mesh, args, annotations=ann).plan
            bare = plan.rank_program(rank, weights=model, bucket_grads=True)
            GradBucketer(bare, comm=comm, bucket_cap_mb=25)
            local, _ = plan.shard_inputs(rank, args)
            sm = autoshard.compile(copy.deepcopy(model), mesh, args, annotations=ann, comm=comm, bucket_cap_mb=25)

            def f_bare():
                with use(comm):
                    return loss_of(bare(*local))

            def f_bare_check():
                real_check(comm, "bench", True)
                return f_bare()

            def f_sm():
                return loss_of(sm(*local))

            def f_sm_sync_check():
                agreement.quiet_until_collective = lambda program: False
                try:
                    return loss_of(sm(*local))
                finally:
                    agreement.quiet_until_collective = real_quiet

            def f_sm_no_check():
                agreement.check_call = lambda *a, **k: None
                try:
                    return loss_of(sm(*local))
                finally:
                    agreement.check_call = real_check

            fns = {"bare": (f_bare, list(bare.parameters())), "bare+check": (f_bare_check, list(bare.parameters())),
                   "sm": (f_sm, list(sm.parameters())), "sm-sync-check": (f_sm_sync_check, list(sm.parameters())),
                   "sm-no-check": (f_sm_no_check, list(sm.parameters()))}

            def step(fn, params):
                for p in params:
                    p.grad = None
                fn().backward()

            for fn, params in fns.values():
                step(fn, params)
            times = {k: [] for k in SYSTEMS}
            for rep in range(reps):
                for key in SYSTEMS[rep % len(SYSTEMS):] + SYSTEMS[:rep % len(SYSTEMS)]:
                    fn, params = fns[key]
                    step(fn, params)
                    burst = []
                    for _ in range(2):
                        dist.barrier()
                        t0 = time.perf_counter()
                        step(fn, params)
                        burst.append(time.perf_counter() - t0)
                    times[key].append(burst)
            out[(case, kind)] = {"times": times, "params": len(list(sm.parameters()))}
    return out


def summarize(results: list[dict]) -> list[dict]:
    rows = []
    for key in results[0]:
        slower = {s: [statistics.fmean(max(step) for step in zip(*bursts))
                      for bursts in zip(*(r[key]["times"][s] for r in results))] for s in SYSTEMS}
        base = slower["bare"]
        for s in SYSTEMS:
            rows.append({"case": key[0], "mesh": key[1], "system": s, "params": results[0][key]["params"],
                         "ms": statistics.median(slower[s]) * 1e3,
                         "ratio": statistics.median([a / b for a, b in zip(slower[s], base)])})
    return rows


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["mlp", "gpt4"], choices=["mlp", "gpt4"])
    parser.add_argument("--reps", type=int, default=30)
    a = parser.parse_args(argv)
    from autoshard.runtime import spawn

    rows = summarize(spawn(_worker, 2, tuple(a.cases), a.reps, timeout=1800))
    print(f"2 gloo processes; {a.reps} interleaved repetitions of 1 untimed + 2 timed steps (slower rank); ratio = "
          "median over repetitions of step / bare's in the same repetition")
    print(f"| {'case':<5} | {'mesh':<4} | {'params':>6} | {'system':<13} | {'step ms':>8} | {'/ bare':>6} |")
    print("| ----- | ---- | ------ | ------------- | -------- | ------ |")
    for r in rows:
        print(f"| {r['case']:<5} | {r['mesh']:<4} | {r['params']:>6} | {r['system']:<13} | {r['ms']:>8.2f} | "
              f"{r['ratio']:>6.3f} |")
    return rows


if __name__ == "__main__":
    main()
