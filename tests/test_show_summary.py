"""``autoshard show`` on real-model sizes: the summary of a Llama-3-8B-shaped model (built on meta) fits an
80-column terminal in under 80 lines, and ``--json`` of every subcommand and mode parses.

The summary is :func:`autoshard.compiler.report.plan_overview` (data) and
:func:`~autoshard.compiler.report.format_overview` (text), computed from the plan's node meta; the CLI only picks it
for graphs over ``SUMMARY_NODES`` nodes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import autoshard
from autoshard.api.cli import main
from autoshard.compiler.report import format_overview, plan_overview

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _from_repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "path", [str(REPO), *sys.path])


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_llama3_8b_summary_fits_80_columns(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    code, out, err = run(capsys, "show", "examples.models:llama3_8b_meta", "--mesh", "data=2,model=4", "--megatron")
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) < 80, out
    assert max(map(len, lines)) <= 80, out
    assert lines[0].startswith("plan for LlamaForCausalLM on Mesh(data=2, model=4): ")
    assert "8.03B parameters" in lines[0]
    for text in ("model.layers.0-31 x32", "self_attn.q_proj.weight", "[14336, 4096]", "(R, S(0))", "(R, S(1))",
                 "model.layers.0-31 (each)", "all_reduce[model]", "grad_all_reduce[data]", "memory per rank:",
                 "estimated step:", "bytes per step per axis:"):
        assert text in out, (text, out)
    assert "Traceback" not in err


def test_overview_is_computed_from_the_plan():
    from examples.models import gpt, megatron

    model, args, kwargs = gpt(layers=3)
    mesh = autoshard.Mesh(data=2, model=2)
    plan = autoshard.compile(model, mesh, args, kwargs, annotations=megatron(mesh, "gpt")).plan
    o = plan_overview(plan)
    assert o["groups"]["blocks.*"] == [0, 1, 2]
    # every inserted collective is counted once: per instance x instances, or as a total
    counted = sum(c["count"] * (c["instances"] if c["per_instance"] else 1) for c in o["collectives"])
    assert counted == len(plan.collectives())
    fwd = sum(c["bytes_forward"] * (c["instances"] if c["per_instance"] else 1) for c in o["collectives"])
    assert fwd == sum(info.bytes_forward for _, info in plan.collectives())
    params = {p["param"]: p for p in o["params"]}
    assert params["blocks.*.mlp.0.weight"]["spec_text"] == "(R, S(0))" and params["blocks.*.mlp.0.weight"]["count"] == 3
    assert params["blocks.*.mlp.0.weight"]["local_shape"] == [128, 64]
    text = format_overview(plan, width=80)
    assert "blocks.0-2 x3" in text and max(map(len, text.splitlines())) <= 80
    json.dumps(o)  # the --json form


def test_small_graph_keeps_the_node_table_and_nodes_flag_forces_it(capsys):
    code, out, err = run(capsys, "show", "examples.models:mlp", "--mesh", "data=2")  # no repeated layers
    assert code == 0 and "fc1_weight" in out, err
    code, out, err = run(capsys, "show", "examples.models:mlp", "--mesh", "data=2", "--summary")
    assert code == 0 and out.startswith("plan for MLP on Mesh(data=2): "), err
    code, out, err = run(capsys, "show", "examples.models:gpt", "--mesh", "data=2", "--nodes")
    assert code == 0 and "linear" in out and "plan for GPT" not in out, err


@pytest.mark.parametrize("argv", [
    ["show", "examples.models:mlp", "--mesh", "data=2"],
    ["show", "examples.models:gpt", "--mesh", "pipe=2,model=2", "--megatron", "--pipeline",
     "microbatches=2,schedule=1f1b"],
    ["plan", "examples.models:mlp", "--mesh", "data=2"],
    ["plan", "examples.models:mlp", "--mesh", "data=2", "--symbolic"],
], ids=["show", "show-pipeline", "plan", "plan-symbolic"])
def test_json_of_every_subcommand_parses(capsys, argv):
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["mesh"]
    if "--pipeline" in argv:
        assert [s["stage"] for s in doc["stages"]] == [0, 1] and doc["schedule"] == "1f1b"
    else:
        assert doc["nodes"] and doc["overview"]["cost"]["step_time_s"] > 0
    if "--symbolic" in argv:
        assert any("bytes" in line for line in doc["symbolic"])


def test_calibrate_json_prints_the_written_profile(capsys, monkeypatch, tmp_path):
    import autoshard.cost_models.calibrate as cal

    def fake_main(argv):  # the real one spawns processes; this writes a profile as it would and prints a table
        out = Path(argv[argv.index("-o") + 1])
        out.write_text('[profile]\nname = "calibrated-gloo"\nflops = 1e12\n')
        print("a rich table")
        return 0

    monkeypatch.setattr(cal, "main", fake_main)
    code, out, err = run(capsys, "calibrate", "--json", "-o", str(tmp_path / "p.toml"))
    assert code == 0, err
    doc = json.loads(out)
    assert doc["profile"]["profile"]["flops"] == 1e12 and doc["profile_file"].endswith("p.toml")
