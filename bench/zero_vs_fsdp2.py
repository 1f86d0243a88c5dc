"""ZeRO-3 next to FSDP2: autoshard ``zero=3`` and ``torch.distributed.fsdp.fully_shard`` on the same data-parallel job.

N gloo processes on 127.0.0.1 (N = 2 and 4, one spawn each), the same GPT (``examples.models.GPT``), the same
weights, the same per-rank batch, forward + backward steps (gradients set to None before each; no optimizer: its
step is the same elementwise update of the same shards in both):

* **autoshard**: ``autoshard.compile(model, Mesh(data=N), args, zero=3, comm=DistCommunicator(...))`` — the
  ``ShardedModule`` as a user runs it: every parameter stored sharded on dim 0 over the data axis, all-gathered
  before use (``all_gather_reshard``), the gathered copy freed after forward and gathered again in backward, the
  gradient reduce-scattered by the gather's backward; the loss is the global batch's (one loss all-reduce).
* **autoshard-no-prefetch**: the same, each layer's gathers grouped but not started early (``group_gathers``
  without its prefetch: the next layer's all-gather starts only when that layer needs it);
* **autoshard-ungrouped**: the same, with the ``group_gathers`` rank pass left out: one all-gather, one
  re-gather and one reduce-scatter per parameter (autoshard before that pass) — the "before" of the grouping;
* **FSDP2**: ``fully_shard(block, mesh, reshard_after_forward=True)`` for every block, then on the root (the
  embeddings, final norm and tied head, which FSDP2 keeps gathered between forward and backward); the loss is this
  rank's half (quarter) of the batch, so the max loss difference below compares autoshard's loss with the mean of
  FSDP2's rank losses, and the max gradient difference compares every parameter's whole gradient (``full_tensor()``
  of autoshard's DTensor gradient and of FSDP2's sharded one). The run fails (exit status 1, a banner) when a loss
  or gradient differs by more than 1e-5 or any gradient was not compared (missing on either side, or shapes that
  differ): a comparison that does not run is a failure, not a ``nan``.

Timing: repetitions interleave the systems (order rotating); in each, a system runs one untimed step and then
``TIMED`` steps, each started after a barrier and timed on every rank; a step's time is the slower rank's. The
step time is the median over all timed steps; the ratio is the median over repetitions of (autoshard's mean step /
FSDP2's mean step in the same repetition): paired, so load from other work hits both alike; its 95% bootstrap interval
says how much the load moved it.

Memory: ``torch.distributed._tools.mem_tracker.MemTracker`` over one extra untimed step per system (peak of
parameters, gradients, activations, temporaries and optimizer state it attributes to the tracked module; on CPU
it tracks tensor storages, not the allocator), max over ranks.

Bytes: per rank and step, the sum of each collective's *input* bytes (an all-gather's input is the shard, a
reduce-scatter's the full gradient), by kind: autoshard's own communicator log; FSDP2's by wrapping
``torch.distributed.all_gather_single`` / ``reduce_scatter_single`` / ``all_reduce`` (FSDP2 calls them through the
``torch.distributed`` module; autoshard's communicator binds its own references at import, so the wrappers count
FSDP2 only).

    python bench/zero_vs_fsdp2.py               # N = 2 and 4 (about 2-3 minutes on 2 busy cores)
    python bench/zero_vs_fsdp2.py --quick       # small model, few repetitions, forked processes: a smoke run
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

TIMED = 2
SIZES = {
    # per-rank batch 4 x 64 tokens; 4 blocks of hidden 256: 3.4M parameters (vocab 1024, tied head)
    "full": {"batch_per_rank": 4, "seq": 32, "hidden": 256, "heads": 8, "vocab": 1024, "layers": 4, "reps": 6},
    "quick": {"batch_per_rank": 2, "seq": 16, "hidden": 64, "heads": 4, "vocab": 128, "layers": 2, "reps": 2},
}
SYSTEMS = ("autoshard", "autoshard-no-prefetch", "autoshard-ungrouped", "FSDP2")


def _counting(log: list):
    """Wrap FSDP2's collectives in ``torch.distributed`` so each call appends (kind, input bytes) to ``log``."""
    import torch.distributed as dist

    def wrap(name, kind, input_of):
        original = getattr(dist, name)

        def counted(*args, **kwargs):
            t = input_of(args, kwargs)
            log.append((kind, t.numel() * t.element_size()))
            return original(*args, **kwargs)

        setattr(dist, name, counted)

    wrap("all_gather_single", "all_gather", lambda a, k: a[1] if len(a) > 1 else k["input"])
    wrap("reduce_scatter_single", "reduce_scatter", lambda a, k: k["input"] if "input" in k else a[1])
    wrap("all_reduce", "all_reduce", lambda a, k: a[0] if a else k["tensor"])


def _peak_bytes(step, module) -> int | None:
    try:
        from torch.distributed._tools.mem_tracker import MemTracker

        mt = MemTracker()
        mt.track_external(module)
        with mt:
            step()
        snap = mt.get_tracker_snapshot("peak")
        return int(sum(v.get("Total", 0) for v in snap.values()))
    except Exception:  # noqa: BLE001 - a tracker failure must not lose the timings
        return None


def _worker(rank, world, size_name, reps):
    import copy
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import autoshard
    from autoshard.compiler.plan import loss_of
    from autoshard.runtime import DistCommunicator, use
    from examples.models import GPT

    size = SIZES[size_name]
    torch.manual_seed(0)
    model = GPT(size["vocab"], size["hidden"], size["heads"], size["layers"], size["seq"])
    g = torch.Generator().manual_seed(1)
    batch = size["batch_per_rank"] * world
    ids = torch.randint(0, size["vocab"], (batch, size["seq"]), generator=g)
    labels = torch.randint(0, size["vocab"], (batch, size["seq"]), generator=g)

    mesh = autoshard.Mesh(data=world)
    comm = DistCommunicator(mesh, timeout=300)
    from autoshard.passes import group_gathers

    def without(obj, attr, value):  # compile and make this rank's program with obj.attr replaced
        saved = getattr(obj, attr)
        setattr(obj, attr, value)
        try:
            made = autoshard.compile(copy.deepcopy(model), mesh, (ids, labels), zero=3, comm=comm)
            made.materialize()
            return made
        finally:
            setattr(obj, attr, saved)

    with use(comm):
        sharded = autoshard.compile(copy.deepcopy(model), mesh, (ids, labels), zero=3, comm=comm)
        sharded.materialize()
        no_prefetch = without(group_gathers, "_prefetch_next", lambda graph, groups: None)
        ungrouped = without(group_gathers.GroupGathers, "run", lambda self, gm, ctx: gm)
    local, _ = sharded.plan.shard_inputs(rank, (ids, labels))

    fsdp = copy.deepcopy(model)
    device_mesh = init_device_mesh("cpu", (world,))
    for blk in fsdp.blocks:
        fully_shard(blk, mesh=device_mesh, reshard_after_forward=True)
    fully_shard(fsdp, mesh=device_mesh, reshard_after_forward=True)
    fsdp_log: list = []
    _counting(fsdp_log)

    def step_of(module, call):
        params = list(module.parameters())

        def step():
            for p in params:
                p.grad = None
            loss = call()
            loss.backward()
            return loss

        return step

    steps = {
        "autoshard": step_of(sharded, lambda: loss_of(sharded(*local))),
        "autoshard-no-prefetch": step_of(no_prefetch, lambda: loss_of(no_prefetch(*local))),
        "autoshard-ungrouped": step_of(ungrouped, lambda: loss_of(ungrouped(*local))),
        "FSDP2": step_of(fsdp, lambda: fsdp(*local)),
    }
    modules = {"autoshard": sharded, "autoshard-no-prefetch": no_prefetch, "autoshard-ungrouped": ungrouped,
               "FSDP2": fsdp}
    info = {k: {} for k in SYSTEMS}
    # one step each: losses, gradients, bytes
    losses = {}
    for key in ("autoshard-ungrouped", "autoshard-no-prefetch", "autoshard"):
        comm.log.clear()
        loss_a = losses[key] = float(steps[key]())
        records = list(comm.log)
        info[key]["bytes"] = _by_kind((r.kind, r.nbytes) for r in records)
        info[key]["n"] = len(records)
    fsdp_log.clear()
    loss_f = steps["FSDP2"]()
    info["FSDP2"]["bytes"] = _by_kind(fsdp_log)
    info["FSDP2"]["n"] = len(fsdp_log)
    mean_f = loss_f.detach().clone()
    dist.all_reduce(mean_f)
    mean_f /= world
    diff, compared, missing = 0.0, 0, []
    # every gradient compared whole: autoshard's DTensor gradients and FSDP2's shards (Shard(0), padded where dim 0
    # does not divide) are gathered to full tensors on every rank, in the same order on every rank
    for label, mod in (("autoshard", sharded), ("autoshard-no-prefetch", no_prefetch),
                       ("autoshard-ungrouped", ungrouped)):
        grads_a = dict(mod.named_parameters())
        for name, p in fsdp.named_parameters():
            mine = grads_a.get(name)
            if mine is None or mine.grad is None or p.grad is None:
                missing.append(f"{label}:{name}")
                continue
            theirs = _whole(p.grad)
            ours = _whole(mine.grad)
            if ours.shape != theirs.shape:
                missing.append(f"{label}:{name} (shapes {list(ours.shape)} vs {list(theirs.shape)})")
                continue
            compared += 1
            diff = max(diff, (theirs - ours).abs().max().item())
        extra = sorted(set(grads_a) - {n for n, _ in fsdp.named_parameters()})
        missing += [f"{label}:{name} (not in FSDP2's model)" for name in extra]
    info["loss"] = (loss_a, float(mean_f), max(abs(v - float(mean_f)) for v in losses.values()), diff, compared)
    info["missing"] = missing
    info["expected"] = 3 * sum(1 for _ in fsdp.parameters())
    for key in SYSTEMS:
        info[key]["peak"] = _peak_bytes(steps[key], modules[key])
    times = {k: [] for k in SYSTEMS}
    for rep in range(reps):
        order = SYSTEMS[rep % len(SYSTEMS):] + SYSTEMS[: rep % len(SYSTEMS)]
        for key in order:
            steps[key]()
            burst = []
            for _ in range(TIMED):
                dist.barrier()
                t0 = time.perf_counter()
                steps[key]()
                burst.append(time.perf_counter() - t0)
            times[key].append(burst)
    info["times"] = times
    info["params"] = sum(p.numel() for p in model.parameters())
    return info


def _whole(t):
    """A gradient as one full tensor on every rank (a DTensor gathered over its mesh)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


#: what "equal" means for the gradients and losses (fp32, one step; the sums run in different orders)
LOSS_TOLERANCE, GRAD_TOLERANCE = 1e-5, 1e-5


def _interval(values: list[float], draws: int = 2000) -> tuple[float, float]:
    """95% bootstrap interval of the median of ``values`` (a fixed seed: the same data, the same interval)."""
    import random

    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def _by_kind(records) -> dict[str, int]:
    out: dict[str, int] = {}
    for kind, nbytes in records:
        out[kind] = out.get(kind, 0) + nbytes
    return out


def _fmt_bytes(n) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def summarize(results: list[dict]) -> dict:
    """Per system: median step (slower rank, ms), peak memory (max over ranks), bytes by kind and collectives
    (rank 0); the paired ratio autoshard / FSDP2; the loss and gradient differences (max over ranks)."""
    def slower(key):  # per repetition: the mean over its timed steps of the slower rank's time
        return [statistics.fmean(max(step) for step in zip(*bursts))
                for bursts in zip(*(r["times"][key] for r in results))]

    per_step = {k: [max(s) for rep in zip(*(r["times"][k] for r in results)) for s in zip(*rep)] for k in SYSTEMS}
    base = slower("FSDP2")
    ratios = {k: [a / f for a, f in zip(slower(k), base)] for k in SYSTEMS}
    out = {"ratio": {k: (statistics.median(v), _interval(v)) for k, v in ratios.items()},
           "loss": tuple(max(r["loss"][i] for r in results) for i in (2, 3)),
           "compared": min(r["loss"][4] for r in results),
           "expected": results[0]["expected"], "missing": sorted({m for r in results for m in r["missing"]}),
           "losses": results[0]["loss"][:2], "params": results[0]["params"]}
    for k in SYSTEMS:
        peaks = [r[k]["peak"] for r in results]
        out[k] = {"ms": statistics.median(per_step[k]) * 1e3, "peak": None if None in peaks else max(peaks),
                  "bytes": results[0][k]["bytes"], "n": results[0][k]["n"]}
    return out


def report(by_world: dict[int, dict]) -> str:
    rows = [("ranks", "system", "step (ms)", "ratio [95% CI]", "peak mem/rank", "all-gather", "reduce-scatter",
             "all-reduce", "total bytes/rank/step", "collectives/step")]
    for world, s in by_world.items():
        for k in SYSTEMS:
            b = s[k]["bytes"]
            ratio, (lo, hi) = s["ratio"][k]
            rows.append((str(world), k, f"{s[k]['ms']:.1f}", f"{ratio:.2f} [{lo:.2f}, {hi:.2f}]",
                         _fmt_bytes(s[k]["peak"]), _fmt_bytes(b.get("all_gather", 0)),
                         _fmt_bytes(b.get("reduce_scatter", 0)), _fmt_bytes(b.get("all_reduce", 0)),
                         _fmt_bytes(sum(b.values())), str(s[k]["n"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for i, r in enumerate(rows):
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
        if i == 0:
            lines.append("| " + " | ".join("-" * w for w in widths) + " |")
    for world, s in by_world.items():
        la, lf = s["losses"]
        lines.append(f"\n{world} ranks: loss autoshard {la:.6f}, FSDP2 (mean of ranks) {lf:.6f}; max |loss diff| "
                     f"{s['loss'][0]:.2e}, max |grad diff| over {s['compared']} of {s['expected']} whole gradients "
                     f"(the 3 autoshard programs' vs FSDP2's, full_tensor on both sides) {s['loss'][1]:.2e}")
    return "\n".join(lines)


def check(by_world: dict[int, dict]) -> list[str]:
    """What the run got wrong: a loss or gradient that differs beyond the tolerances, or a comparison that did not
    run (a gradient missing on either side, or shapes that differ). Empty when every comparison ran and agreed."""
    problems = []
    for world, s in by_world.items():
        loss_diff, grad_diff = s["loss"]
        if not loss_diff <= LOSS_TOLERANCE:  # (nan fails too)
            problems.append(f"{world} ranks: max |loss diff| {loss_diff:.3e} > {LOSS_TOLERANCE:g}")
        if not grad_diff <= GRAD_TOLERANCE:
            problems.append(f"{world} ranks: max |grad diff| {grad_diff:.3e} > {GRAD_TOLERANCE:g}")
        if s["compared"] != s["expected"] or s["missing"]:
            problems.append(f"{world} ranks: {s['compared']} of {s['expected']} gradients compared; not compared: "
                            + ", ".join(s["missing"][:10]) + (" ..." if len(s["missing"]) > 10 else ""))
    return problems


def main(argv=None) -> dict[int, dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model, 2 repetitions (a smoke run)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--reps", type=int, default=None,
                        help=f"repetitions (default full 6, quick 2), each 1 untimed + {TIMED} timed steps per system")
    a = parser.parse_args(argv)
    from autoshard.runtime import spawn

    size_name = "quick" if a.quick else "full"
    reps = a.reps or SIZES[size_name]["reps"]
    t0 = time.time()
    # --quick forks the processes from a forkserver that has imported torch and autoshard once (a smoke run)
    start = "forkserver" if a.quick else "spawn"
    by_world = {n: summarize(spawn(_worker, n, size_name, reps, timeout=600, start_method=start)) for n in a.ranks}
    print(f"GPT {({k: v for k, v in SIZES[size_name].items() if k != 'reps'})}, "
          f"{by_world[a.ranks[0]]['params'] / 1e6:.2f}M parameters; gloo on 127.0.0.1, 1 thread per process; "
          f"forward + backward; step = median over {reps} reps x {TIMED} timed steps (slower rank); ratio = median "
          "over reps of system / FSDP2 in the same rep, with a 95% bootstrap interval of that median; "
          "peak = MemTracker (tensor storages, max over ranks); "
          "bytes = collective inputs per rank, one step")
    print(report(by_world))
    print(f"\n({time.time() - t0:.0f} s)")
    problems = check(by_world)
    if problems:  # loudly: a benchmark whose systems compute different things measures nothing
        print("\n" + "!" * 100 + "\nGRADIENTS OR LOSSES DIFFER, OR A COMPARISON DID NOT RUN:\n  "
              + "\n  ".join(problems) + "\n" + "!" * 100)
        raise SystemExit(1)
    return by_world


if __name__ == "__main__":
    main()
