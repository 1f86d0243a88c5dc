"""The plan search under memory limits vs the hand-written torchtitan-style plan, Llama-3 8B and 70B shapes.

Per (model, mesh, memory limit), three plans, every one priced by the same cost model (``Plan.cost(profile)``:
estimated step time = compute + communication, forward + backward, no overlap; memory per rank = the step's peak
of ``cost_models``' memory model) for profile ``gpu-8x-nvlink``, fp32 parameters, Adam:

* hand: FSDP on ``data`` × Megatron TP on ``model`` — ``planner="greedy"``, ``plan=megatron(mesh, name)``,
  ``zero=3`` (torchtitan's 2-D layout);
* hand+AC: the same with every decoder layer recomputed (``recompute="model.layers.*"``, torchtitan's full
  activation checkpointing);
* searched: ``planner="search"``, ``zero="auto"``, ``recompute="auto"``, ``memory_limit=<limit>``, no annotations.

Printed per row: step time (ms), memory per rank (GiB), the searched plan's ratios to each hand plan, the search's
own seconds (building the program, solving it: from ``Plan.context.report["plan_search"]``), the whole planning
wall time (trace + passes), whether the plan is proven optimal or the gap left to the search's lower bound, the
ZeRO stages and recomputed layers chosen. The issue's goal: the searched plan never worse than a hand plan that
fits the same limit (``searched <= hand`` in step time, memory within the limit); a row that breaks it is printed
in a loud banner, never dropped.

    python bench/search_plans.py            # 8B (data=8 x model=8, 4 GiB) and 70B (data=16 x model=8, 10 GiB),
                                            # the searched plan planned 5 times (--repeat): the median wall time
    python bench/search_plans.py --quick    # the 8B shape only

Then (not with ``--quick``) the 8B case under bf16 mixed precision: the search's own estimate of its plan against
``Plan.cost``'s, with FSDP2's default reduction (bf16) and torchtitan's (fp32).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # run as a script: make `examples` importable
    sys.path.insert(0, str(_ROOT))

GiB = 2**30
PROFILE = "gpu-8x-nvlink"
#: (factory, mesh, memory limit, batch, seq): one sequence of 1024 tokens per data rank
CASES = (
    ("llama3_8b_meta", {"data": 8, "model": 8}, "4GiB", 8, 1024),
    ("llama3_70b_meta", {"data": 16, "model": 8}, "10GiB", 16, 1024),
)


def plan_of(name: str, mesh_axes: dict, batch: int, seq: int, **options):
    """(plan, planning wall seconds) of factory ``name`` under ``options`` (autoshard.compile's keywords)."""
    from autoshard.api.sharded_module import make_options
    from autoshard.mesh import Mesh
    from autoshard.compiler.plan import build_plan
    from examples import models

    model, args, kwargs = getattr(models, name)(batch=batch, seq=seq)
    mesh = Mesh(**mesh_axes)
    annotations = models.megatron(mesh, name) if options.pop("megatron", False) else None
    opts = make_options(annotations, "data", "replicate", mesh, profile=PROFILE, **options)
    t0 = time.perf_counter()
    plan = build_plan(model, mesh, args, kwargs, opts)
    return plan, time.perf_counter() - t0


@contextlib.contextmanager
def _keeping_problems(problems: list):
    """The search's Problem objects, appended to ``problems`` (for :func:`lp_bound` after planning)."""
    from autoshard.passes import plan_search

    search = plan_search.search

    def keeping(problem, *args, **kwargs):
        problems.append(problem)
        return search(problem, *args, **kwargs)

    plan_search.search = keeping
    try:
        yield
    finally:
        plan_search.search = search


def lp_bound(problem, multiplier):
    from autoshard.passes.plan_search import lp_bound as bound

    return bound(problem, multiplier)


def run_case(name, mesh_axes, limit, batch, seq, repeat: int = 1) -> dict:
    from autoshard.api.sharded_module import parse_bytes

    rows = {}
    for label, options in (("hand", {"megatron": True, "zero": 3}),
                           ("hand+AC", {"megatron": True, "zero": 3, "recompute": "model.layers.*"}),
                           ("searched", {"planner": "search", "zero": "auto", "recompute": "auto",
                                         "memory_limit": limit})):
        walls = []
        for _ in range(repeat if label == "searched" else 1):  # the searched plan is planned `repeat` times
            problems = []
            with warnings.catch_warnings(record=True) as caught, _keeping_problems(problems):
                warnings.simplefilter("always")
                plan, wall = plan_of(name, mesh_axes, batch, seq, **options)
            walls.append(wall)
        wall = statistics.median(walls)
        cost = plan.cost()
        report = plan.context.report.get("plan_search")
        if problems and report and report.get("multiplier") is not None:
            # the bound over every recomputation choice too (the search's own fixes the recomputed layers per λ);
            # computed after the timed planning
            report["lp_bound"] = lp_bound(problems[-1], np.asarray(report["multiplier"]))
        rows[label] = {"step": cost.step_time, "memory": cost.memory_per_rank, "wall": wall, "walls": walls,
                       "report": plan.context.report.get("plan_search"),
                       "warnings": [str(w.message) for w in caught if "plan_search" in str(w.message)]}
    rows["limit"] = parse_bytes(limit)
    return rows


def format_case(name, mesh_axes, limit, rows) -> str:
    mesh = "×".join(f"{k}={v}" for k, v in mesh_axes.items())
    s = rows["searched"]
    rep = s["report"]
    lines = [f"{name}  mesh {mesh}  memory_limit {limit}  profile {PROFILE}  fp32 Adam",
             f"  {'plan':<10}{'step ms':>10}{'GiB/rank':>10}{'fits':>6}{'searched/plan':>15}{'plan s':>9}"]
    worse = []
    for label in ("hand", "hand+AC", "searched"):
        r = rows[label]
        fits = r["memory"] <= rows["limit"] * (1 + 1e-9)
        ratio = s["step"] / r["step"]
        lines.append(f"  {label:<10}{r['step'] * 1e3:>10.2f}{r['memory'] / GiB:>10.2f}{'yes' if fits else 'no':>6}"
                     f"{ratio:>15.3f}{r['wall']:>9.1f}")
        if label != "searched" and fits and s["step"] > r["step"] * (1 + 1e-9):
            worse.append(label)
    status = "optimal" if rep["optimal"] else f"gap {rep['gap']:.2%} to the lower bound"
    if rep.get("lp_bound") is not None:  # the bound over every recomputation choice (plan_search.lp_bound)
        status += (f"; {(rep['step_time'] - rep['lp_bound']) / rep['step_time']:.2%} to the LP bound over every "
                   f"recomputation choice too ({rep['lp_bound'] * 1e3:.2f} ms, λ on "
                   f"{sum(1 for v in rep['multiplier'] if v)} liveness points)")
    lines.append(f"  search: build {rep['build_seconds']:.2f} s + solve {rep['solve_seconds']:.2f} s wall, "
                 f"{rep['cpu_seconds']:.2f} s CPU "
                 f"({rep['method']}); {status}")
    lines.append(f"  search's own estimate: step {rep['step_time'] * 1e3:.2f} ms (with recomputation's extra forward, "
                 f"as Plan.cost prices it too), memory {rep['memory_per_rank'] / GiB:.2f} GiB "
                 "(the peak by cost_models.memory)")
    if len(s["walls"]) > 1:
        lines.append(f"  searched planning wall s over {len(s['walls'])} runs (median above): "
                     + " ".join(f"{w:.2f}" for w in s["walls"]))
    lines.append(f"  chosen: ZeRO stages {rep['zero_stages']} (stage: parameters), recomputed layers "
                 f"{len(rep['recomputed'])}")
    for w in s["warnings"]:
        lines.append(f"  warning: {w}")
    if worse:
        lines.append("  " + "!" * 72)
        lines.append(f"  !! the searched plan is SLOWER than {', '.join(worse)}, which fits the same limit")
        lines.append("  " + "!" * 72)
    return "\n".join(lines)


def mixed_precision_rows(name, mesh_axes, limit, batch, seq) -> str:
    """The searched plan under bf16 mixed precision (``MixedPrecision(param_dtype=bf16)``, FSDP2's default
    reduction, and torchtitan's fp32 reduction): the search's estimate of its plan against ``Plan.cost``'s."""
    import torch

    from autoshard.frontend.precision import MixedPrecision

    lines = [f"{name}  mixed precision (bf16 compute, fp32 masters), same mesh and limit: search's estimate / "
             "Plan.cost", "  reduce_dtype   step ms (search / cost)   GiB/rank (search / cost)   fits"]
    for reduce in (None, torch.float32):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan, _ = plan_of(name, mesh_axes, batch, seq, planner="search", zero="auto", recompute="auto",
                              memory_limit=limit, precision=MixedPrecision(torch.bfloat16, reduce_dtype=reduce))
        report, cost = plan.context.report["plan_search"], plan.cost()
        fits = cost.memory_per_rank <= plan.context.options.memory_limit
        lines.append(f"  {str(reduce or 'bf16'):<13}  {report['step_time'] * 1e3:8.2f} / {cost.step_time * 1e3:8.2f}"
                     f" ({report['step_time'] / cost.step_time:.4f})   {report['memory_per_rank'] / GiB:5.2f} / "
                     f"{cost.memory_per_rank / GiB:5.2f} ({report['memory_per_rank'] / cost.memory_per_rank:.4f})"
                     f"   {'yes' if fits else 'NO'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the 8B shape only, planned once")
    ap.add_argument("--repeat", type=int, default=5, help="times the searched plan is planned (median printed)")
    args = ap.parse_args(argv)
    cases = CASES[:1] if args.quick else CASES
    for case in cases:
        rows = run_case(*case, repeat=1 if args.quick else args.repeat)
        print(format_case(case[0], case[1], case[2], rows), flush=True)
        print()
    if not args.quick:
        print(mixed_precision_rows(*CASES[0]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
