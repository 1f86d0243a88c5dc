"""Smoke runs of the compile-time and plan-quality benchmarks (``bench/*.py --quick``), in this process: their
rows and tables are consistent. How long anything takes is the benchmarks' to report, not these tests'."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

_BENCH = Path(__file__).resolve().parents[1] / "bench"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"autoshard_bench_{name}", _BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def test_compile_time_quick(capsys):
    bench = _load("compile_time")
    rows = bench.main(["--quick"])
    out = capsys.readouterr().out
    assert [r["layers"] for r in rows] == [2, 4]
    for r in rows:
        assert r["status"] == "ok"
        phases = r["trace_s"] + r["build_s"] + r["solve_s"] + r["rest_s"] + r["codegen_s"]
        assert math.isclose(phases, r["total_s"], rel_tol=1e-6)
        assert min(r["trace_s"], r["build_s"], r["solve_s"], r["codegen_s"]) > 0
    assert "ratio to 2 layers" in out and "1.00x" in out
    ratio = rows[1]["total_s"] / rows[0]["total_s"]
    assert f"{ratio:.2f}x" in out
    plain = bench.format_table(rows, quick=True)
    assert "ratio to 2 layers" in plain and f"{ratio:.2f}x" in plain


def test_plan_quality_quick(capsys):
    bench = _load("plan_quality")
    rows = bench.main(["--quick"])
    out = capsys.readouterr().out
    assert {(r["mesh"], r["profile"]) for r in rows} == {
        (m, p) for m in ("data=2xmodel=2", "model=4") for p in ("gpu-8x-nvlink", "multi-node")
    }
    for r in rows:
        costs = r["costs"]
        best = min(costs["megatron"]["step_ms"], costs["dp"]["step_ms"])
        assert costs["auto"]["step_ms"] <= best * (1 + 1e-9), r
        assert r["auto_ok"]
        # the searched plan's cost, re-evaluated on the final graph, is the search's own objective
        assert math.isclose(costs["auto"]["step_ms"], r["search_ms"], rel_tol=1e-9)
        assert f"{r['ratio']:.4f}" in out
    assert "auto <= best hand" in out and "WORSE" not in out
    plain = bench.format_table(rows)
    assert f"auto <= best hand plan in all {len(rows)} rows." in plain
