"""Plan quality: estimated step time of the searched plan vs two hand-written plans, by the cost model's own estimate.

Three plans per (model, mesh, profile), every one evaluated by ``Plan.cost(profile).step_time`` (compute +
communication, forward + backward, no overlap; ``cost_models/plan_cost.py``):

* auto: ``planner="search"`` for that profile, no annotations, no memory limit;
* Megatron: ``planner="greedy"``, ``plan=examples.models.megatron(mesh, "gpt")`` (vocabulary-parallel embeddings
  and head, column- then row-parallel linears on the ``model`` axis). On a mesh without a ``model`` axis the
  helper returns no annotations, so this column is then the greedy planner's own default plan;
* DP: ``planner="greedy"``, ``plan={"*": ("R", ...)}`` — every parameter replicated (checked on every plan
  built), inputs' batch dim sharded on ``data`` by default (checked too). On a mesh with a ``model`` axis the
  ranks along it then repeat the same work: that is what "pure data parallel" means on such a mesh.

The greedy planner does not read the profile, so each hand plan is built once per (model, mesh) and costed under
every profile; the search is run once per profile. Models are examples.models.GPT shaped like GPT-2 (vocab 50304,
GPT-2's 50257 padded to a multiple of 64 so that the vocabulary can be split 8 ways), seq 1024, batch 8, on the
meta device. The issue's requirement: auto never worse than the better hand plan (``auto <= best hand``); a row
that breaks it is printed in a loud banner, never dropped.

    python bench/plan_quality.py            # GPT-2 small (12 layers) and medium (24 layers), 4 meshes, 2 profiles
    python bench/plan_quality.py --quick    # a small GPT on two small meshes (smoke test)
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # run as a script: make `examples` importable
    sys.path.insert(0, str(_ROOT))

REL_TOL = 1e-9


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int
    hidden: int
    heads: int
    vocab: int = 50304
    seq: int = 1024
    batch: int = 8


FULL_MODELS = (ModelSpec("gpt2-small", 12, 768, 12), ModelSpec("gpt2-medium", 24, 1024, 16))
FULL_MESHES = ({"data": 8}, {"model": 8}, {"data": 2, "model": 4}, {"data": 4, "model": 2})
QUICK_MODELS = (ModelSpec("gpt-tiny", 2, 64, 4, vocab=128, seq=16),)
QUICK_MESHES = ({"data": 2, "model": 2}, {"model": 4})
PROFILES = ("gpu-8x-nvlink", "multi-node")
PLANS = ("auto", "megatron", "dp")


def build(spec: ModelSpec):
    from examples.models import GPT

    with torch.device("meta"):
        model = GPT(spec.vocab, spec.hidden, spec.heads, spec.layers, spec.seq)
        ids = torch.zeros(spec.batch, spec.seq, dtype=torch.long)
        labels = torch.zeros(spec.batch, spec.seq, dtype=torch.long)
    return model, (ids, labels)


def dp_annotations(mesh) -> dict:
    return {"*": tuple("R" for _ in mesh.names)}


def check_dp(plan, mesh) -> None:
    """The DP plan must replicate every parameter and shard the inputs' batch dim on ``data`` (when present)."""
    from autoshard import meta as M
    from autoshard.placements import Replicate, Shard

    wrong = {name: spec for name, spec in plan.param_specs().items() if any(p != Replicate() for p in spec)}
    if wrong:
        raise RuntimeError(f"DP plan has sharded parameters {wrong}, but every parameter must be replicated.")
    for n in plan.graph_module.graph.nodes:
        if n.op != "placeholder":
            continue
        want = tuple(Shard(0) if a == "data" else Replicate() for a in mesh.names)
        if n.meta[M.SPEC] != want:
            raise RuntimeError(f"DP plan has input `{n.name}` as {n.meta[M.SPEC]}, but the default is {want}.")


def _cost_dict(cost) -> dict:
    return {
        "step_ms": cost.step_time * 1e3,
        "compute_ms": cost.compute_time * 1e3,
        "comm_ms": cost.comm_time * 1e3,
        "memory": cost.memory_per_rank,
        "param_bytes": cost.parameter_bytes,
        "comm_bytes": dict(cost.comm_bytes),
    }


def measure(spec: ModelSpec, axes: dict, profiles=PROFILES) -> list[dict]:
    """One row per profile: the three plans' costs for ``spec`` on ``Mesh(**axes)``."""
    import autoshard
    from autoshard import Mesh
    from examples.models import megatron

    mesh = Mesh(**axes)
    model, example = build(spec)
    start = time.perf_counter()
    hand = {
        "megatron": autoshard.compile(model, mesh, example, planner="greedy", annotations=megatron(mesh, "gpt")).plan,
        "dp": autoshard.compile(model, mesh, example, planner="greedy", annotations=dp_annotations(mesh)).plan,
    }
    check_dp(hand["dp"], mesh)
    rows = []
    for profile in profiles:
        auto = autoshard.compile(model, mesh, example, planner="search", profile=profile).plan
        costs = {"auto": _cost_dict(auto.cost(profile)), **{k: _cost_dict(p.cost(profile)) for k, p in hand.items()}}
        best = min(costs["megatron"]["step_ms"], costs["dp"]["step_ms"])
        rows.append(
            {
                "model": spec.name,
                "layers": spec.layers,
                "hidden": spec.hidden,
                "heads": spec.heads,
                "vocab": spec.vocab,
                "seq": spec.seq,
                "batch": spec.batch,
                "mesh": _mesh_text(axes),
                "profile": profile,
                "megatron_empty": "model" not in axes,
                "costs": costs,
                "search_ms": auto.context.report["plan_search"]["step_time"] * 1e3,
                "ratio": costs["auto"]["step_ms"] / best,
                "auto_ok": costs["auto"]["step_ms"] <= best * (1 + REL_TOL),
            }
        )
    print(f"  {spec.name} on {_mesh_text(axes)}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return rows


def _mesh_text(axes: dict) -> str:
    return "x".join(f"{a}={n}" for a, n in axes.items())


# ---- output -------------------------------------------------------------------------------------------------
STEP_HEADERS = ["model", "mesh", "profile", "auto ms", "Megatron ms", "DP ms", "auto/best hand", "auto <= best hand"]
DETAIL_HEADERS = [
    "model",
    "mesh",
    "profile",
    "plan",
    "step ms",
    "compute ms",
    "comm ms",
    "comm bytes per axis",
    "memory/rank",
    "params/rank",
]


def step_cells(rows: list[dict]) -> list[list[str]]:
    out = []
    for r in rows:
        c = r["costs"]
        meg = _ms(c["megatron"]["step_ms"]) + (" *" if r["megatron_empty"] else "")
        out.append(
            [
                f"{r['model']} ({r['layers']}L)",
                r["mesh"],
                r["profile"],
                _ms(c["auto"]["step_ms"]),
                meg,
                _ms(c["dp"]["step_ms"]),
                f"{r['ratio']:.4f}",
                "yes" if r["auto_ok"] else "NO  <-- WORSE",
            ]
        )
    return out


def _ms(x: float) -> str:
    return f"{x:.4g}"


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


def detail_cells(rows: list[dict]) -> list[list[str]]:
    out = []
    for r in rows:
        for plan in PLANS:
            c = r["costs"][plan]
            comm = ", ".join(f"{a} {_bytes(b)}" for a, b in c["comm_bytes"].items())
            out.append(
                [
                    f"{r['model']} ({r['layers']}L)",
                    r["mesh"],
                    r["profile"],
                    plan,
                    _ms(c["step_ms"]),
                    _ms(c["compute_ms"]),
                    _ms(c["comm_ms"]),
                    comm,
                    _bytes(c["memory"]),
                    _bytes(c["param_bytes"]),
                ]
            )
    return out


def title(rows: list[dict]) -> str:
    shapes = sorted(
        {(r["model"], r["layers"], r["hidden"], r["heads"], r["vocab"], r["seq"], r["batch"]) for r in rows}
    )
    return (
        "Estimated step time in ms by autoshard's cost model (Plan.cost().step_time: compute + comm, fwd + bwd, "
        "no overlap), Adam, meta device; models: "
        + "; ".join(f"{m} {n} layers h={h} heads={hd} vocab={v} seq={s} batch={b}" for m, n, h, hd, v, s, b in shapes)
    )


DETAIL_TITLE = (
    "Per plan: estimated times, bytes each rank sends per step per mesh axis (fwd + bwd), memory per "
    "rank (params + grads + Adam state + saved activations), parameter bytes per rank"
)
NOTES = [
    "* no `model` axis: megatron() gives no annotations, so this is the greedy planner's default plan.",
    "auto/best hand = auto / min(Megatron, DP); the requirement is auto <= best hand (rel tol 1e-9).",
]


def violations(rows: list[dict]) -> list[dict]:
    return [r for r in rows if not r["auto_ok"]]


def banner(rows: list[dict]) -> list[str]:
    bad = violations(rows)
    if not bad:
        return [f"auto <= best hand plan in all {len(rows)} rows."]
    lines = ["!" * 100, f"!!! AUTO PLAN WORSE THAN THE BEST HAND PLAN in {len(bad)} of {len(rows)} rows:"]
    lines += [f"!!!   {r['model']} {r['mesh']} {r['profile']}: auto/best = {r['ratio']:.6f}" for r in bad]
    return [*lines, "!" * 100]


def format_table(rows: list[dict]) -> str:
    """Plain-text tables (pure function)."""
    return "\n".join(
        [
            title(rows),
            *_plain([STEP_HEADERS, *step_cells(rows)]),
            *NOTES,
            "",
            DETAIL_TITLE,
            *_plain([DETAIL_HEADERS, *detail_cells(rows)]),
            "",
            *banner(rows),
        ]
    )


def _plain(cells: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def _print(rows: list[dict]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(format_table(rows))
        return
    console = Console(width=170)
    console.print(title(rows), soft_wrap=True)
    table = Table()
    for h in STEP_HEADERS:
        table.add_column(h, justify="right")
    for r, cells in zip(rows, step_cells(rows)):
        table.add_row(*cells, style=None if r["auto_ok"] else "bold red")
    console.print(table)
    for note in NOTES:
        console.print(note)
    detail = Table(title=DETAIL_TITLE)
    for h in DETAIL_HEADERS:
        detail.add_column(h, justify="right")
    for cells in detail_cells(rows):
        detail.add_row(*cells)
    console.print(detail)
    for line in banner(rows):
        console.print(line if not violations(rows) else f"[bold red]{line}[/]", soft_wrap=True)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small GPT on two small meshes (smoke test)")
    parser.add_argument("--layers", type=int, help="override every model's layer count")
    opts = parser.parse_args(argv)
    models = QUICK_MODELS if opts.quick else FULL_MODELS
    if opts.layers is not None:
        models = tuple(ModelSpec(**{**m.__dict__, "layers": opts.layers}) for m in models)
    meshes = QUICK_MESHES if opts.quick else FULL_MESHES
    rows = [row for spec in models for axes in meshes for row in measure(spec, axes)]
    _print(rows)
    return rows


if __name__ == "__main__":
    main()
