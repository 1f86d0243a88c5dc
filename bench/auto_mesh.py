"""The configuration ``plan_cluster`` chooses for N devices against the clock: every candidate it plans, measured.

The examples' GPT is planned for ``--devices`` ranks by :func:`autoshard.api.cluster.plan_cluster` (every
``data x model`` mesh and every ``pipe x data x model`` pipeline with its microbatches and schedules, priced with
``--profile``); each planned candidate is saved (``plan.save``) and, on ``--devices`` gloo processes, loaded
(``autoshard.load_plan``: no search), applied and trained for ``--warmup`` + ``--steps`` steps (zero_grad, forward,
backward, AdamW; a pipeline's step is its schedule over the whole batch). Measured: the median over the timed steps
of the slowest rank's step. Printed beside the prediction (``plan.cost().step_time``, ``PipelinePlan.cost()``): each
configuration's rank by predicted and by measured time, and whether the chosen one (the least predicted) was
measured fastest, with its measured time over the fastest's.

    python bench/auto_mesh.py                          # GPT 4 layers, hidden 128, batch 16, seq 64, on 4 ranks
    python bench/auto_mesh.py --profile here.toml      # priced by a calibrated profile (autoshard calibrate)
    python bench/auto_mesh.py --quick                  # a smoke run: tiny GPT, 1F1B only, 3 best measured
    python bench/auto_mesh.py --model hf_llama         # HF LlamaForCausalLM of the same shape (GQA: 2 kv heads)

On a machine with fewer cores than ranks (this one: 2 cores, 4 ranks) the processes share cores, which the cost
model does not price: the comparison is of the ranking, not of the absolute times.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
if _ROOT not in sys.path:  # run as a script (and in spawned workers): make `examples` importable
    sys.path.insert(0, _ROOT)

SHAPE = {"batch": 16, "seq": 64, "layers": 4, "hidden": 128, "heads": 4, "vocab": 256}
QUICK = {"batch": 4, "seq": 16, "layers": 2, "hidden": 32, "heads": 4, "vocab": 64}


#: the models --model names: the examples' GPT (token ids in, loss out) and Hugging Face's LlamaForCausalLM (input_ids
#: and labels as keywords)
MODELS = ("gpt", "hf_llama")


def build(shape: dict, name: str = "gpt"):
    from examples import models

    if name == "hf_llama":
        return models.hf_llama(batch=shape["batch"], seq=shape["seq"], layers=shape["layers"],
                               hidden=shape["hidden"], heads=shape["heads"], kv_heads=max(1, shape["heads"] // 2),
                               vocab=shape["vocab"])
    return models.gpt(batch=shape["batch"], seq=shape["seq"], layers=shape["layers"], hidden=shape["hidden"],
                      heads=shape["heads"], vocab=shape["vocab"])


def plan_all(shape: dict, devices: int, profile: str, schedules: tuple[str, ...], name: str = "gpt"):
    """The candidates of ``plan_cluster`` (planned ones with their plans) and its planning seconds."""
    import warnings

    import autoshard
    from autoshard.api.cluster import plan_cluster

    model, args, kwargs = build(shape, name)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        chosen = plan_cluster(model, args, kwargs, devices=devices, search=autoshard.Search(profile=profile),
                              schedules=schedules)
    return chosen, time.perf_counter() - t0


def _worker(rank: int, world: int, files: list[str], shape: dict, warmup: int, steps: int, name: str = "gpt"
            ) -> list[dict]:
    import warnings

    import torch

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # the plans' notes, printed once by the planning process already
    out = []
    for path in files:
        try:
            out.append(_measure(rank, path, shape, warmup, steps, name))
        except Exception as e:  # the same on every rank: a row saying so, the run goes on
            out.append({"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"})
    return out


def _measure(rank: int, path: str, shape: dict, warmup: int, steps: int, name: str = "gpt") -> dict:
    import torch
    import torch.distributed as dist

    import autoshard
    from autoshard.compiler.plan import loss_of

    torch.manual_seed(0)
    model, args, kwargs = build(shape, name)
    plan = autoshard.load_plan(path, model, args, kwargs)
    pipelined = hasattr(plan, "microbatch_plan")
    sharded = autoshard.apply(model, plan)
    if pipelined:  # a pipelined module takes the global batch
        a, kw = args, kwargs
    else:
        a = tuple(autoshard.data_shard(x, plan.mesh, rank) for x in args)
        kw = {k: autoshard.data_shard(v, plan.mesh, rank) for k, v in kwargs.items()}
    optimizer = torch.optim.AdamW(list(sharded.parameters()), lr=1e-4)

    def step():
        optimizer.zero_grad(set_to_none=True)
        if pipelined:
            sharded(*a, **kw)
        else:
            loss_of(sharded(*a, **kw)).backward()
        optimizer.step()

    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        dist.barrier()
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return {"measured_s": statistics.median(slowest.tolist())}


def run(shape: dict, devices: int = 4, profile: str = "cpu-gloo", warmup: int = 2, steps: int = 5,
        schedules: tuple[str, ...] = ("1f1b", "gpipe", "interleaved"), timeout: float = 1800,
        start_method: str = "spawn", measure: int | None = None, name: str = "gpt") -> dict:
    """Plan, then measure every planned candidate (``measure``: the best that many by prediction) on ``devices``
    gloo processes: one row per candidate."""
    from autoshard.api.cluster import describe
    from autoshard.runtime import spawn

    chosen, planning_s = plan_all(shape, devices, profile, schedules, name)
    planned = chosen.planned[:measure]
    folder = tempfile.mkdtemp(prefix="auto_mesh")
    files = []
    for i, c in enumerate(planned):
        files.append(os.path.join(folder, f"candidate{i}.json"))
        c.plan.save(files[-1])
    results = spawn(_worker, devices, files, shape, warmup, steps, name, timeout=timeout, start_method=start_method)
    rows = []
    for i, c in enumerate(planned):
        got = results[0][i]
        rows.append({"config": describe(c), "predicted_s": c.step_time_s, "memory_bytes": c.memory_per_rank_bytes,
                     "measured_s": got.get("measured_s"), "error": got.get("error"), "chosen": i == 0})
    ok = [r for r in rows if r["measured_s"] is not None]
    for key, rank in (("predicted_s", "predicted_rank"), ("measured_s", "measured_rank")):
        for n, r in enumerate(sorted(ok, key=lambda r: r[key]), 1):
            r[rank] = n
    fastest = min(ok, key=lambda r: r["measured_s"]) if ok else None
    best = rows[0] if rows else None
    return {"rows": rows, "planning_s": planning_s, "devices": devices, "profile": profile, "shape": shape,
            "model": name,
            "not_planned": [(describe(c), c.pruned or c.failed) for c in chosen.candidates if c.plan is None],
            "chosen_fastest": bool(best and fastest and best is fastest),
            "chosen_over_fastest": (best["measured_s"] / fastest["measured_s"]
                                    if best and fastest and best["measured_s"] is not None else None)}


def format_table(result: dict) -> str:
    lines = [f"{'configuration':<36} {'predicted ms':>12} {'measured ms':>12} {'rank pred':>9} {'rank meas':>9}"]
    for r in result["rows"]:
        measured = f"{r['measured_s'] * 1e3:.2f}" if r["measured_s"] is not None else "-"
        note = "  chosen" if r["chosen"] else ""
        if r["error"]:
            note += f"  {r['error']}"
        lines.append(f"{r['config']:<36} {r['predicted_s'] * 1e3:>12.3f} {measured:>12} "
                     f"{r.get('predicted_rank', '-'):>9} {r.get('measured_rank', '-'):>9}{note}")
    for config, why in result["not_planned"]:
        lines.append(f"{config:<36} {'-':>12} {'-':>12} {'-':>9} {'-':>9}  not planned: {why[:80]}")
    ratio = result["chosen_over_fastest"]
    lines.append(f"chosen measured fastest: {'yes' if result['chosen_fastest'] else 'no'}"
                 + (f" (chosen / fastest measured: {ratio:.2f}x)" if ratio is not None else ""))
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description="plan_cluster's choice against every candidate measured on gloo.")
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--profile", default="cpu-gloo", help="a preset or a profile TOML (autoshard calibrate)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--measure", type=int, default=None, metavar="K",
                    help="measure only the K best by prediction (default: every planned candidate)")
    ap.add_argument("--model", choices=MODELS, default="gpt", help="the examples' GPT or HF LlamaForCausalLM")
    ap.add_argument("--quick", action="store_true",
                    help="tiny GPT, 1F1B pipelines only, the 3 best predicted measured for 2 steps")
    a = ap.parse_args(argv)
    shape, schedules = (QUICK, ("1f1b",)) if a.quick else (SHAPE, ("1f1b", "gpipe", "interleaved"))
    warmup, steps, measure = (1, 2, 3) if a.quick else (a.warmup, a.steps, a.measure)
    started = time.monotonic()
    result = run(shape, a.devices, a.profile, warmup, steps, schedules,
                 start_method="forkserver" if a.quick else "spawn", measure=measure, name=a.model)
    measured = "every planned candidate" if measure is None else f"the {measure} best predicted"
    model = "GPT" if a.model == "gpt" else "HF LlamaForCausalLM"
    print(f"auto_mesh: {model} {shape} on {a.devices} gloo ranks, {measured} measured, profile {a.profile}, "
          f"median of {steps} steps after {warmup} warm-up; planning {result['planning_s']:.1f} s, all "
          f"{time.monotonic() - started:.0f} s")
    print(format_table(result))
    return result


if __name__ == "__main__":
    main()
