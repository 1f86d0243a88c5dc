"""Smoke runs of benchmarks (``bench/*.py --quick``), in this process: their rows and tables are consistent, and
the ones that compare gradients compare every one of them (the runtime benchmarks spawn 2 gloo processes). How long
anything takes is the benchmarks' to report, not these tests'."""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

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


def test_infeasible_limit_quick(capsys):
    """The refusal's rows: refused, a lower bound named (said to be one when not proven) below the least plan
    found."""
    bench = _load("infeasible_limit")
    rows = bench.main(["--quick"])
    out = capsys.readouterr().out
    assert [r["what"] for r in rows] == ["far below", "just below"]
    for r in rows:
        assert r["refused"] and r["least"] > r["limit"] and r["least"] <= r["found"]
        assert ("needs is at least" in r["message"]) == (not r["proven"])
    assert "least plan found" in out


@pytest.mark.gloo
def test_zero_vs_fsdp2_quick_compares_every_gradient(capsys):
    """2 gloo processes: every gradient of the three autoshard programs is compared whole with FSDP2's, and they
    agree (a comparison that does not run fails the benchmark)."""
    bench = importlib.import_module("bench.zero_vs_fsdp2")  # (importable: spawned workers unpickle its functions)
    by_world = bench.main(["--quick", "--ranks", "2"])
    s = by_world[2]
    assert s["compared"] == s["expected"] > 0 and not s["missing"]
    assert s["loss"][1] <= bench.GRAD_TOLERANCE and bench.check(by_world) == []
    assert f"over {s['expected']} of {s['expected']} whole gradients" in capsys.readouterr().out


@pytest.mark.gloo
def test_runtime_quick_times_the_sharded_module_and_compares_its_gradients(capsys):
    """2 gloo processes, one case: the headline rows are the ShardedModule's, the bare rank module's a secondary
    row, and the headline gradients equal DTensor's and DDP's."""
    bench = importlib.import_module("bench.runtime")
    results = bench.main(["--quick", "--cases", "mlp", "--reps", "1"])
    out = capsys.readouterr().out
    assert bench.check(results, ["mlp"]) == []
    for key in ("tp/autoshard", "dp/autoshard", bench.TP_BARE, bench.DP_BARE):
        assert f"| {key} " in out
    grads = results[0]["mlp"]["gradients"]
    assert set(grads) == {"tp/autoshard", "dp/autoshard"} and all(c > 0 and not m for _, c, m in grads.values())


@pytest.mark.gloo
def test_fidelity_quick_runs_and_predicts_every_plan(capsys, tmp_path):
    """bench/fidelity.py --quick: every plan (each on one of the three models) trained on 4 gloo ranks, timed, its
    allocator peak read, and priced by the cost model; the errors are benchmark numbers, not asserted here. Its
    saved run priced again in one process (``--repredict``, no ranks) gives the ranks' own predictions."""
    fidelity = importlib.import_module("bench.fidelity")  # (importable: spawned workers unpickle its functions)
    saved = tmp_path / "run.json"
    result = fidelity.main(["--quick", "--profile", "cpu-gloo", "--json", str(saved)])
    rows = result["rows"]
    assert [r for r in rows if "error" in r] == []
    ran = {r["plan"].split(" ")[0] for r in rows}
    assert ran == set(fidelity.PLANS)
    assert {r["model"] for r in rows} == set(fidelity.MODELS)
    for r in rows:
        assert r["memory"] > 0 and r["pred_memory"] > 0, r
        if r["timed"]:
            assert r["time"] > 0 and r["pred_time"] > 0, r
    stages = [r for r in rows if r["plan"].startswith("pipeline")]
    assert [r["plan"] for r in stages] == ["pipeline s0", "pipeline s1"]  # one row per stage
    summary = result["summary"]
    assert summary["plans"] == len(fidelity.PLANS)
    assert -1 <= summary["rank_correlation"] <= 1
    out = capsys.readouterr().out
    assert "rank correlation" in out and "median error" in out
    # priced again in one process: a plan of each prediction path (plan.cost() of a forced layout and of an MoE
    # rewrite; the pipeline's stages), each row's measurements kept
    some = [r for r in rows if r["plan"].split(" ")[0] in ("tp_sp", "moe_ep", "pipeline")]
    subset = tmp_path / "some.json"
    subset.write_text(json.dumps({**json.loads(saved.read_text()), "rows": some}))
    again = fidelity.main(["--repredict", str(subset), "--profile", "cpu-gloo"])["rows"]
    assert len(some) == 4 and [(r["model"], r["plan"], r["time"], r["memory"]) for r in again] == \
        [(r["model"], r["plan"], r["time"], r["memory"]) for r in some]
    for a, r in zip(again, some):
        assert a["pred_memory"] == pytest.approx(r["pred_memory"], rel=1e-9), r
        if r["timed"]:
            assert a["pred_time"] == pytest.approx(r["pred_time"], rel=1e-9), r


def test_moe_scale_quick(capsys):
    """2-layer narrowed DeepSeek-V3 and Mixtral on data=4 x model=4: each planned, priced sparse and dense, its
    experts' layout printed."""
    bench = _load("moe_scale")
    rows = bench.main(["--quick"])
    out = capsys.readouterr().out
    assert [r["model"] for r in rows] == ["deepseek-v3", "mixtral-8x7b"]
    for r in rows:
        assert r["layout"]["nodes"] >= 1 and r["memory"] > 0 and r["step"] > 0 and r["dense_step"] > 0
        assert f"mesh {r['mesh']}" in out
    assert "dense-experts estimate" in out and "experts (" in out


@pytest.mark.gloo
def test_auto_mesh_quick(capsys):
    """bench/auto_mesh.py --quick: plan_cluster on 4 devices (meshes and 1F1B pipelines), the 3 best predicted
    trained on 4 gloo ranks from their saved plans; the table ranks them both ways and says whether the chosen one
    was measured fastest."""
    bench = importlib.import_module("bench.auto_mesh")  # (importable: spawned workers unpickle its functions)
    result = bench.main(["--quick"])
    rows = result["rows"]
    assert len(rows) == 3 and [r for r in rows if r["error"]] == []
    assert rows[0]["chosen"] and not any(r["chosen"] for r in rows[1:])
    assert [r["predicted_s"] for r in rows] == sorted(r["predicted_s"] for r in rows)
    assert sorted(r["predicted_rank"] for r in rows) == sorted(r["measured_rank"] for r in rows) == [1, 2, 3]
    assert all(r["measured_s"] > 0 for r in rows)
    fastest = min(r["measured_s"] for r in rows)
    assert result["chosen_fastest"] == (rows[0]["measured_s"] == fastest)
    assert result["chosen_over_fastest"] == pytest.approx(rows[0]["measured_s"] / fastest)
    out = capsys.readouterr().out
    assert "chosen measured fastest: " in out and all(r["config"] in out for r in rows)


def test_fidelity_plans_on_any_power_of_two_ranks():
    """``--world``: every plan's mesh uses exactly the ranks asked for (an axis of size 1 left out)."""
    import autoshard

    fidelity = importlib.import_module("bench.fidelity")
    for world in (2, 4, 8):
        for plan in fidelity.PLANS:
            text, _ = fidelity.plan_options("gpt", plan, world)
            mesh = autoshard.Mesh.parse(text)
            assert mesh.size == world and 1 not in dict(mesh.axes).values(), (world, plan, text)


def test_fidelity_alone_times_and_prices_one_rank(capsys):
    """``--alone``: each model's rank program on one rank (no contention), fp32 and bf16, measured and priced; the
    1-rank process group it makes is gone afterwards (this worker runs other tests)."""
    import torch.distributed as dist

    fidelity = importlib.import_module("bench.fidelity")
    rows = fidelity.main(["--alone", "--quick", "--profile", "cpu-gloo", "--models", "gpt"])["alone"]
    assert [(r["model"], r["precision"]) for r in rows] == [("gpt", "fp32"), ("gpt", "bf16")]
    assert all(r["time"] > 0 and r["pred_time"] > 0 for r in rows)
    assert not dist.is_initialized()
    assert "compute predicted" in capsys.readouterr().out
