"""How fast a memory limit no plan meets is refused (``planner="search"``, ``zero="auto"``, ``recompute="auto"``).

Per model, one process, each row a fresh ``build_plan`` (trace + passes; the model built before the clock starts):

* ``far below``: half the least memory any plan needs (the bound the refusal names); with ``--quick``, 1 byte: the
  attempt that learns the bound is the row (its seconds include the first run's warm-up), one planning run fewer;
* ``just below``: 0.95 of it;
* ``above the bound`` (not with ``--quick``, and only when the refusal could not prove the least memory exactly):
  1.01 of the bound, where the bound (no solve) and the least-memory plan found (the least-peak ILP within
  ``PROOF_SECONDS``) leave the answer open: the search's walk decides, within its time limit (``--time-limit``,
  the search's default 120 s otherwise).

Printed per row: the limit, what came back (refused, or a plan and its memory), the wall seconds, and from the
refusal the least memory named (``least_memory``: a lower bound unless proven), the least-memory plan found
(``least_memory_found``) and whether the least memory is proven.

    python bench/infeasible_limit.py            # HF Llama (2 layers, data=2 x model=2) and the Llama-3-8B shape
                                                # (meta device, batch 8 x 1024, data=8 x model=8)
    python bench/infeasible_limit.py --quick    # HF Llama only, the two refusals (the far one at 1 byte)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import warnings
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # run as a script: make `examples` importable
    sys.path.insert(0, str(_ROOT))

#: (label, factory, factory keywords, mesh, profile)
CASES = (
    ("HF Llama, 2 layers", "hf_llama", {"layers": 2}, {"data": 2, "model": 2}, "cpu-gloo"),
    ("Llama-3-8B shape (meta)", "llama3_8b_meta", {"batch": 8, "seq": 1024}, {"data": 8, "model": 8},
     "gpu-8x-nvlink"),
)


def attempt(factory: str, kwargs: dict, mesh_axes: dict, profile: str, limit: float,
            time_limit: float | None = None) -> dict:
    """One planning run at ``limit`` bytes per rank: outcome, wall seconds, and the refusal's figures."""
    from autoshard.api.sharded_module import make_options
    from autoshard.errors import PlanError
    from autoshard.mesh import Mesh
    from autoshard.compiler.plan import build_plan
    from examples import models

    model, args, kw = getattr(models, factory)(**kwargs)
    mesh = Mesh(**mesh_axes)
    options = make_options({}, "data", "replicate", mesh, planner="search", profile=profile, memory_limit=limit,
                           zero="auto", recompute="auto")
    if time_limit is not None:
        options = dataclasses.replace(options, search_time_limit=time_limit)
    row = {"limit": limit, "refused": False}
    started = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = build_plan(model, mesh, args, kw, options)
        row["memory"] = plan.context.report["plan_search"]["memory_per_rank"]
    except PlanError as e:
        row.update(refused=True, least=getattr(e, "least_memory", None), found=getattr(e, "least_memory_found", None),
                   proven=getattr(e, "least_memory_proven", None), message=str(e))
    row["seconds"] = time.perf_counter() - started
    return row


def run_case(case, quick: bool, time_limit: float | None) -> list[dict]:
    label, factory, kwargs, mesh_axes, profile = case
    rows = []
    first = attempt(factory, kwargs, mesh_axes, profile, 1.0)  # the bound, named by the refusal (a row: --quick)
    if not first["refused"]:
        raise SystemExit(f"{label}: a limit of 1 byte was met: {first}")
    least = first["least"]
    if quick:  # the bound's own attempt, at 1 byte, is the far-below row
        rows.append({"case": label, "what": "far below", **first})
    for what, limit in (("far below", 0.5 * least), ("just below", 0.95 * least))[quick:]:
        rows.append({"case": label, "what": what, **attempt(factory, kwargs, mesh_axes, profile, limit)})
    if not quick and not first["proven"]:
        rows.append({"case": label, "what": "above the bound",
                     **attempt(factory, kwargs, mesh_axes, profile, 1.01 * least, time_limit)})
    return rows


def format_table(rows: list[dict]) -> str:
    from autoshard.passes.plan_search.objective import format_bytes

    lines = [f"{'case':<26}{'limit':<17}{'bytes/rank':>12}  {'outcome':<22}{'s':>7}  {'least named':>16}  "
             f"{'least plan found':>16}  proven"]
    for r in rows:
        outcome = "refused" if r["refused"] else f"plan, {format_bytes(r['memory'])}"
        least = format_bytes(r["least"]) if r.get("least") is not None else "-"
        found = format_bytes(r["found"]) if r.get("found") is not None else "-"
        proven = "-" if r.get("proven") is None else ("yes" if r["proven"] else "no (at least)")
        lines.append(f"{r['case']:<26}{r['what']:<17}{format_bytes(r['limit']):>12}  "
                     f"{outcome:<22}{r['seconds']:>7.2f}  "
                     f"{least:>16}  {found:>16}  {proven}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="HF Llama only, the two refusals (far below: 1 byte)")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="the search's time limit for the 'above the bound' row (default: the search's 120 s)")
    args = parser.parse_args(argv)
    rows = []
    for case in CASES[:1] if args.quick else CASES:
        rows += run_case(case, args.quick, args.time_limit)
    sys.stdout.write(format_table(rows))
    for r in rows:
        if r["refused"]:
            sys.stdout.write(f"\n{r['case']}, {r['what']}:\n  {r['message']}\n")
    return rows


if __name__ == "__main__":
    main()
