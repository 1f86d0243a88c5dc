"""Whole compile time of the exact planner: trace + plan search + propagation/collectives + codegen of one rank.

Each case is ``autoshard.compile(model, mesh, example, planner="search", profile="gpu-8x-nvlink")`` followed by
``.code(rank=0)``, with the model and its inputs on the meta device (no weights are allocated, so any size fits).
Phases, all from the same compile:

* trace: the ``trace`` call that :func:`autoshard.compiler.plan.build_plan` makes, timed by a wrapper around it;
* search build / solve: ``plan.context.report["plan_search"]["build_seconds" / "solve_seconds"]``;
* rest: everything else inside ``compile`` (propagation, collective insertion, the search's own bookkeeping);
* codegen: ``plan.code(0)``;
* total: wall time of ``compile`` + ``code`` — the sum of the columns before it.

Cases: GPT (examples.models.GPT; vocab 50304, hidden 768, 12 heads, seq 1024, batch 8) with 12, 24, 48, 96 layers
on Mesh(data=4, model=8), and a Llama-3-8B-shaped ``LlamaForCausalLM`` (32 layers, hidden 4096, intermediate
14336, 32 heads, 8 kv heads, vocab 128256, seq 1024) on Mesh(data=8, model=8), without a memory limit and at
``memory_limit="4GiB"`` (zero and recompute "auto": the search's Lagrangian walk). Every run is its own child
process (one at a time) that first compiles a small 2-layer GPT as a warm-up, so one case's caches and
torch.export's first-call imports do not flatter or penalise another. Each case runs ``--repeats`` times (3),
round-robin over the cases so that load drift on a shared machine hits every case alike; the table shows the run
with the median total (the lower middle one for an even count) and every run's total. A run whose process
(imports and warm-up included) goes past ``--case-timeout`` is killed and reported as such, and a case that
fails or times out is not run again.

    python bench/compile_time.py                  # the full table (minutes on a small machine)
    python bench/compile_time.py --max-layers 48  # skip GPT cases deeper than 48 layers (reported as skipped)
    python bench/compile_time.py --quick          # 2 and 4 layers of a small GPT, in this process (smoke test)

Goals: 12 layers < 2 s, Llama-3-8B < 5 s (without a limit and at 4 GiB), 96 layers within 10x of 12 layers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # run as a script: make `examples` importable
    sys.path.insert(0, str(_ROOT))


@dataclass(frozen=True)
class Case:
    model: str  # "gpt" or "llama3-8b"
    layers: int
    mesh: tuple[tuple[str, int], ...]
    hidden: int = 768
    heads: int = 12
    vocab: int = 50304
    seq: int = 1024
    batch: int = 8
    limit: str = ""  # memory_limit ("4GiB"; zero and recompute "auto"), "" for none

    @property
    def key(self) -> str:
        return (
            f"{self.model}:{self.layers}:{self.hidden}:{self.heads}:{self.vocab}:{self.seq}:{self.batch}:"
            + ",".join(f"{a}={n}" for a, n in self.mesh)
            + f":{self.limit}"
        )

    @staticmethod
    def from_key(key: str) -> Case:
        model, layers, hidden, heads, vocab, seq, batch, mesh, limit = key.split(":")
        axes = tuple((a, int(n)) for a, n in (part.split("=") for part in mesh.split(",")))
        return Case(model, int(layers), axes, int(hidden), int(heads), int(vocab), int(seq), int(batch), limit)

    @property
    def mesh_text(self) -> str:
        return "x".join(f"{a}={n}" for a, n in self.mesh)


GPT_MESH = (("data", 4), ("model", 8))
LLAMA = Case("llama3-8b", 32, (("data", 8), ("model", 8)), hidden=4096, heads=32, vocab=128256)
LLAMA_4GIB = Case("llama3-8b", 32, (("data", 8), ("model", 8)), hidden=4096, heads=32, vocab=128256, limit="4GiB")
FULL = [*(Case("gpt", n, GPT_MESH) for n in (12, 24, 48, 96)), LLAMA, LLAMA_4GIB]
QUICK = [Case("gpt", n, (("data", 2), ("model", 2)), hidden=64, heads=4, vocab=128, seq=16) for n in (2, 4)]
WARMUP = Case("gpt", 2, (("data", 2), ("model", 2)), hidden=64, heads=4, vocab=128, seq=16)

GOAL_12_S, GOAL_LLAMA_S, GOAL_96_RATIO = 2.0, 5.0, 10.0


def build(case: Case):
    """The model and its example inputs, on the meta device."""
    with torch.device("meta"):
        ids = torch.zeros(case.batch, case.seq, dtype=torch.long)
        labels = torch.zeros(case.batch, case.seq, dtype=torch.long)
        if case.model == "gpt":
            from examples.models import GPT

            return GPT(case.vocab, case.hidden, case.heads, case.layers, case.seq), (ids, labels), {}
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            num_hidden_layers=case.layers,
            hidden_size=case.hidden,
            intermediate_size=14336,
            num_attention_heads=case.heads,
            num_key_value_heads=8,
            vocab_size=case.vocab,
            max_position_embeddings=case.seq,
            use_cache=False,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        )
        return LlamaForCausalLM(cfg), (), {"input_ids": ids, "labels": labels}


def measure(case: Case) -> dict:
    """Compile ``case`` once and time its phases (see the module docstring)."""
    import autoshard
    import autoshard.compiler.plan as plan_module
    from autoshard import Mesh

    model, args, kwargs = build(case)
    traced = plan_module.trace
    trace_s = []

    def timed_trace(*a, **k):
        start = time.perf_counter()
        try:
            return traced(*a, **k)
        finally:
            trace_s.append(time.perf_counter() - start)

    plan_module.trace = timed_trace
    try:
        start = time.perf_counter()
        sharded = autoshard.compile(
            model, Mesh(**dict(case.mesh)), args, kwargs or None, planner="search", profile="gpu-8x-nvlink",
            memory_limit=case.limit or None,
        )
        compiled = time.perf_counter()
        code = sharded.code(0)
        end = time.perf_counter()
    finally:
        plan_module.trace = traced
    report = sharded.plan.context.report["plan_search"]
    compile_s = compiled - start
    build_s, solve_s = report["build_seconds"], report["solve_seconds"]
    return {
        "model": case.model,
        "layers": case.layers,
        "mesh": case.mesh_text,
        "limit": case.limit or "-",
        "status": "ok",
        "trace_s": trace_s[0],
        "build_s": build_s,
        "solve_s": solve_s,
        "rest_s": compile_s - trace_s[0] - build_s - solve_s,
        "codegen_s": end - compiled,
        "total_s": end - start,
        "decisions": report["decisions"],
        "tied_nodes": report["tied_nodes"],
        "code_lines": code.count("\n"),
    }


def run_isolated(case: Case, timeout_s: float) -> dict:
    """``measure(case)`` in a fresh child process (after a warm-up compile there), killed after ``timeout_s``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", case.key]
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=_ROOT)
    except subprocess.TimeoutExpired:
        return {
            "model": case.model,
            "layers": case.layers,
            "mesh": case.mesh_text,
            "limit": case.limit or "-",
            "status": f"timed out after {timeout_s:.0f} s (killed)",
            "wall_s": time.perf_counter() - start,
        }
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return {
            "model": case.model,
            "layers": case.layers,
            "mesh": case.mesh_text,
            "limit": case.limit or "-",
            "status": f"failed (exit {done.returncode}): {tail[0][:160]}",
        }
    return json.loads(lines[-1])


def _child(key: str) -> None:
    measure(WARMUP)
    print(json.dumps(measure(Case.from_key(key))))


def skipped(case: Case, why: str) -> dict:
    return {"model": case.model, "layers": case.layers, "mesh": case.mesh_text, "limit": case.limit or "-",
            "status": f"skipped ({why})"}


# ---- output -------------------------------------------------------------------------------------------------
HEADERS = ["model", "layers", "mesh", "memory limit", "trace s", "search build s", "solve s", "rest s", "codegen s",
           "total s"]


def headers(rows: list[dict]) -> list[str]:
    base = ratio_base(rows)
    return [*HEADERS, f"ratio to {base['layers'] if base else '?'} layers", "totals of all runs s"]


def ratio_base(rows: list[dict]) -> dict | None:
    """The row totals are compared with: 12-layer GPT in the full run, the shallowest GPT otherwise."""
    gpts = [r for r in rows if r["model"] == "gpt" and r["status"] == "ok"]
    twelve = [r for r in gpts if r["layers"] == 12]
    return (twelve or sorted(gpts, key=lambda r: r["layers"]) or [None])[0]


def table_cells(rows: list[dict]) -> list[list[str]]:
    base = ratio_base(rows)
    out = []
    for r in rows:
        if r["status"] != "ok":
            out.append([r["model"], str(r["layers"]), r["mesh"], r.get("limit", "-"), r["status"], *[""] * 7])
            continue
        ratio = f"{r['total_s'] / base['total_s']:.2f}x" if base else "-"
        out.append(
            [
                r["model"],
                str(r["layers"]),
                r["mesh"],
                r.get("limit", "-"),
                *(f"{r[k]:.2f}" for k in ("trace_s", "build_s", "solve_s", "rest_s", "codegen_s", "total_s")),
                ratio,
                " ".join(f"{t:.2f}" for t in r["totals"]) or "-",
            ]
        )
    return out


def goals(rows: list[dict]) -> list[tuple[str, str, str]]:
    """(goal, measured, PASS/MISS/not measured) for the issue's three goals."""

    def find(model, layers, limit="-"):
        return next((r for r in rows if r["model"] == model and r["layers"] == layers
                     and r.get("limit", "-") == limit), None)

    def verdict(r, ok):
        if r is None:
            return "not run"
        if r["status"] != "ok":
            return f"MISS ({r['status']})" if r["status"].startswith("timed out") else f"not measured ({r['status']})"
        return "PASS" if ok(r) else "MISS"

    g12, g96, llama, limited = find("gpt", 12), find("gpt", 96), find("llama3-8b", 32), find("llama3-8b", 32, "4GiB")
    out = [
        (
            "GPT 12 layers total < 2 s",
            f"{g12['total_s']:.2f} s" if g12 and g12["status"] == "ok" else "-",
            verdict(g12, lambda r: r["total_s"] < GOAL_12_S),
        ),
        (
            "Llama-3-8B total < 5 s",
            f"{llama['total_s']:.2f} s" if llama and llama["status"] == "ok" else "-",
            verdict(llama, lambda r: r["total_s"] < GOAL_LLAMA_S),
        ),
        (
            "Llama-3-8B at memory_limit 4GiB (zero, recompute auto) total < 5 s",
            f"{limited['total_s']:.2f} s" if limited and limited["status"] == "ok" else "-",
            verdict(limited, lambda r: r["total_s"] < GOAL_LLAMA_S),
        ),
    ]
    ok96 = g96 and g96["status"] == "ok" and g12 and g12["status"] == "ok"
    if g96 and g96["status"] == "ok" and not ok96:
        v96 = "not measured (no 12-layer time to compare with)"
    else:
        v96 = verdict(g96, lambda r: r["total_s"] / g12["total_s"] <= GOAL_96_RATIO)
    out.append(
        ("GPT 96 layers within 10x of 12 layers", f"{g96['total_s'] / g12['total_s']:.2f}x" if ok96 else "-", v96)
    )
    return out


def title(quick: bool) -> str:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    where = (
        "one run each, in this process, after one warm-up compile"
        if quick
        else "each run in its own process after a warm-up compile there; cases interleaved; the run with the median "
        "total is shown"
    )
    return (
        f"autoshard.compile(planner='search', profile='gpu-8x-nvlink') + code(0), meta device, batch 8; "
        f"seconds, {where}; {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads, load average "
        f"{load} (at print time)"
    )


def format_table(rows: list[dict], quick: bool = False) -> str:
    """Plain-text table and goals (pure apart from the title's load average)."""
    lines = [title(quick), *_plain([headers(rows), *table_cells(rows)])]
    if quick:
        lines.append("(quick run: ratios are to the 2-layer row; the goals apply to the full run)")
    else:
        lines += ["", *_plain([["goal", "measured", "verdict"], *map(list, goals(rows))])]
    return "\n".join(lines)


def _plain(cells: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def _print(rows: list[dict], quick: bool) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(format_table(rows, quick))
        return
    console = Console(width=170)
    console.print(title(quick), soft_wrap=True)
    table = Table()
    for h in headers(rows):
        table.add_column(h, justify="right")
    for cells in table_cells(rows):
        table.add_row(*cells)
    console.print(table)
    if quick:
        console.print("(quick run: ratios are to the 2-layer row; the goals apply to the full run)")
        return
    goal_table = Table(title="goals from the issue, as measured above")
    for h in ("goal", "measured", "verdict"):
        goal_table.add_column(h)
    for g, m, v in goals(rows):
        goal_table.add_row(g, m, f"[bold red]{v}[/]" if v != "PASS" else v)
    console.print(goal_table)


def run_full(opts) -> list[dict]:
    """Every case ``opts.repeats`` times, round-robin (so load drift hits every case alike); per case the run with
    the median total, with every total kept. A case that fails or times out is not run again."""
    runs: dict[Case, list[dict]] = {}
    final: dict[Case, dict] = {}
    for case in FULL:
        if case.model == "gpt" and case.layers > opts.max_layers:
            final[case] = skipped(case, f"--max-layers {opts.max_layers}")
        elif case.model != "gpt" and opts.no_llama:
            final[case] = skipped(case, "--no-llama")
    for repeat in range(opts.repeats):
        for case in FULL:
            if case in final:
                continue
            row = run_isolated(case, opts.case_timeout)
            took = f"{row['total_s']:.2f} s" if row["status"] == "ok" else row["status"]
            print(f"  run {repeat + 1}/{opts.repeats} {case.model} {case.layers} layers: {took}", file=sys.stderr)
            if row["status"] != "ok":
                final[case] = row
                continue
            runs.setdefault(case, []).append(row)
    rows = []
    for case in FULL:
        if case in final:
            rows.append(final[case])
            continue
        done = sorted(runs[case], key=lambda r: r["total_s"])
        rows.append({**done[(len(done) - 1) // 2], "totals": [r["total_s"] for r in runs[case]]})
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 and 4 layers of a small GPT, in-process (smoke test)")
    parser.add_argument("--max-layers", type=int, default=96, help="skip GPT cases deeper than this (default 96)")
    parser.add_argument("--no-llama", action="store_true", help="skip the Llama-3-8B cases")
    parser.add_argument(
        "--case-timeout",
        type=float,
        default=600.0,
        help="seconds one run's process may take (imports and warm-up included) before it is killed (600)",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs per case, interleaved across cases; the median is shown (3)"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.child:
        _child(opts.child)
        return []
    if opts.quick:
        measure(WARMUP)
        rows = [{**measure(case), "totals": []} for case in QUICK]
    else:
        rows = run_full(opts)
    _print(rows, opts.quick)
    return rows


if __name__ == "__main__":
    main()
