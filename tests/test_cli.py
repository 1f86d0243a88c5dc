"""The ``autoshard`` command line: ``show`` output in each mode, plan files, and one-line user errors (exit 2).

Most tests call :func:`autoshard.api.cli.main` in-process and read its output with ``capsys``; one runs the installed
console script end to end.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from autoshard.api.cli import main

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _from_repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    # The CLI puts the working directory on sys.path; restore it after each test.
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "path", list(sys.path))


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_user_error(code: int, err: str, *fragments: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for f in fragments:
        assert f in err, err


# ---- show --------------------------------------------------------------------------------------------------
def test_show_table_has_nodes_and_placements(capsys):
    code, out, err = run(capsys, "show", "examples.models:mlp", "--mesh", "data=2")
    assert code == 0, err
    for text in ("fc1_weight", "linear", "mse_loss", "all_reduce", "S(0)", "(R)", "collectives:"):
        assert text in out


def test_show_code_prints_the_rank_module(capsys):
    code, out, err = run(capsys, "show", "examples.models:mlp", "--mesh", "model=2", "--megatron", "--code",
                         "--rank", "1")
    assert code == 0, err
    assert out.startswith("def forward(self, x, target):")
    assert "all_reduce" in out


def test_show_json_parses(capsys):
    code, out, err = run(capsys, "show", "examples.models:mlp", "--mesh", "data=2", "--json",
                         "--factory-arg", "hidden=16")
    assert code == 0, err
    doc = json.loads(out)
    nodes = {n["node"]: n for n in doc["nodes"]}
    assert doc["mesh"] == {"data": 2}
    assert nodes["fc1_weight"]["shape"] == [32, 16]
    assert nodes["x"]["spec"] == [{"axis": "data", "type": "Shard", "dim": 0}] and nodes["x"]["spec_text"] == "(S(0))"


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_show_plan_file(capsys, tmp_path, suffix):
    path = tmp_path / f"plan{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps({"fc1.weight": ["S(0)"], "fc1.bias": ["S(0)"], "fc2.weight": ["S(1)"]}))
    else:
        path.write_text('[plan]\n"fc1.weight" = ["S(0)"]\n"fc1.bias" = ["S(0)"]\n"fc2.weight" = ["S(1)"]\n')
    code, out, err = run(capsys, "show", "examples.models:mlp", "--mesh", "model=2", "--plan", str(path), "--json")
    assert code == 0, err
    nodes = {n["node"]: n for n in json.loads(out)["nodes"]}
    assert nodes["fc1_weight"]["spec"] == [{"axis": "model", "type": "Shard", "dim": 0}]
    assert nodes["fc2_weight"]["spec_text"] == "(S(1))"


def test_factory_returning_model_and_args_from_the_working_directory(capsys, tmp_path, monkeypatch):
    name = f"cli_factory_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        "import torch\n"
        "def build(width=8):\n"
        "    return torch.nn.Linear(width, 4), (torch.randn(2, width),)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, name, raising=False)
    try:
        code, out, err = run(capsys, "show", f"{name}:build", "--mesh", "data=2", "--json",
                             "--factory-arg", "width=6")
        assert code == 0, err
        assert {n["node"]: n for n in json.loads(out)["nodes"]}["weight"]["shape"] == [4, 6]
        # --megatron knows only the examples' factories
        code, _, err = run(capsys, "show", f"{name}:build", "--mesh", "model=2", "--megatron")
        assert_user_error(code, err, "--megatron has no plan for factory `build`", "--plan")
    finally:
        sys.modules.pop(name, None)


# ---- user errors -------------------------------------------------------------------------------------------
def test_unknown_factory_names_module_and_attribute(capsys):
    code, _, err = run(capsys, "show", "examples.models:nope", "--mesh", "data=2")
    assert_user_error(code, err, "examples.models", "`nope`", "mlp")


def test_unknown_module_is_named(capsys):
    code, _, err = run(capsys, "show", "no_such_pkg.models:gpt", "--mesh", "data=2")
    assert_user_error(code, err, "`no_such_pkg.models`", "cannot be imported")


def test_factory_path_without_colon(capsys):
    code, _, err = run(capsys, "show", "examples.models.gpt", "--mesh", "data=2")
    assert_user_error(code, err, "MODULE:FACTORY")


def test_unknown_factory_argument(capsys):
    code, _, err = run(capsys, "show", "examples.models:mlp", "--mesh", "data=2", "--factory-arg", "depth=3")
    assert_user_error(code, err, "depth", "batch")


def test_plan_naming_no_parameter_gives_the_plan_error(capsys, tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"encoder.*.weight": ["S(0)"]}))
    code, _, err = run(capsys, "show", "examples.models:mlp", "--mesh", "model=2", "--plan", str(path))
    assert_user_error(code, err, "annotation 'encoder.*.weight' names no parameter or input of the model")


def test_missing_plan_file(capsys, tmp_path):
    code, _, err = run(capsys, "show", "examples.models:mlp", "--mesh", "data=2", "--plan",
                       str(tmp_path / "absent.json"))
    assert_user_error(code, err, "absent.json", "does not exist")


def test_malformed_plan_json(capsys, tmp_path):
    path = tmp_path / "plan.json"
    path.write_text('{"fc1.weight": ["S(0)"],}')
    code, _, err = run(capsys, "show", "examples.models:mlp", "--mesh", "data=2", "--plan", str(path))
    assert_user_error(code, err, "plan.json", "not valid JSON", "line 1")


def test_plan_entry_must_be_a_list(capsys, tmp_path):
    path = tmp_path / "plan.json"
    path.write_text('{"fc1.weight": "S(0)"}')
    code, _, err = run(capsys, "show", "examples.models:mlp", "--mesh", "data=2", "--plan", str(path))
    assert_user_error(code, err, "'fc1.weight'", "one per mesh axis ['data']")


def test_bad_mesh(capsys):
    code, _, err = run(capsys, "show", "examples.models:mlp", "--mesh", "data:2")
    assert_user_error(code, err, "NAME=SIZE")


def test_rank_outside_mesh(capsys):
    code, _, err = run(capsys, "show", "examples.models:mlp", "--mesh", "data=2", "--code", "--rank", "2")
    assert_user_error(code, err, "Rank 2")


def test_argparse_usage_errors_return_2(capsys):
    assert main(["show", "examples.models:mlp"]) == 2  # --mesh missing
    assert "--mesh" in capsys.readouterr().err


# ---- the installed console script --------------------------------------------------------------------------
def test_console_script_show():
    exe = Path(sys.executable).with_name("autoshard")
    script = str(exe) if exe.exists() else shutil.which("autoshard")
    if script is None:
        pytest.skip("the autoshard console script is not installed (pip install -e .)")
    env = {**os.environ, "COLUMNS": "200"}
    proc = subprocess.run([script, "show", "examples.models:mlp", "--mesh", "data=2"], check=False, cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "fc1_weight" in proc.stdout and "S(0)" in proc.stdout


# ---- readable output: widths, wrapping, JSON, defaults ------------------------------------------------------
LLAMA = ["show", "examples.models:hf_llama", "--mesh", "data=2,model=2", "--megatron"]


def _widths(text: str) -> int:
    """The widest line in characters and in UTF-8 bytes (what `awk '{print length}'` counts with mawk)."""
    return max(max(len(ln), len(ln.encode())) for ln in text.splitlines())


def test_repeated_layers_print_the_summary_in_80_columns_when_piped(capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)  # captured stdout is no terminal: 80 columns
    code, out, err = run(capsys, *LLAMA)
    assert code == 0, err
    assert out.startswith("plan for LlamaForCausalLM on Mesh(data=2, model=2): 244 nodes"), out
    assert _widths(out) <= 80, out
    for name in ("self_attn.q_proj.weight", "post_attention_layernorm.weight", "model.embed_tokens.weight"):
        assert name in out, (name, out)
    assert "…" not in out


@pytest.mark.parametrize("columns", [60, 100])
def test_node_table_fits_columns_and_keeps_whole_names(capsys, monkeypatch, columns):
    monkeypatch.setenv("COLUMNS", str(columns))
    code, out, err = run(capsys, *LLAMA, "--nodes")
    assert code == 0, err
    assert out.startswith("autoshard plan: LlamaForCausalLM"), out
    assert _widths(out) <= columns, out
    assert "…" not in out and "model_layers_1_post_attention_layernorm_weight"[:6] in out
    # a wrapped name reads back whole: the first column's pieces of one row joined
    joined = "".join(ln.lstrip().split("  ")[0] for ln in out.splitlines())
    assert "model_layers_1_post_attention_layernorm_weight" in joined


def test_wrapped_cells_lose_nothing():
    from autoshard.compiler.report import _wrap_cell

    for text in ("model_layers_0_self_attn_q_proj_weight", "  self_attn.q_proj.weight", "x" * 30, "a.b",
                 "    model.layers.0-31 x32"):
        for width in (8, 11, 17, 40):
            pieces = _wrap_cell(text, width)
            assert all(len(p) <= width for p in pieces), (text, width, pieces)
            assert "".join(pieces).replace(" ", "") == text.replace(" ", ""), (text, width, pieces)
            assert all(p.strip() for p in pieces), (text, width, pieces)


def test_code_wraps_long_lines_into_the_same_program(capsys, monkeypatch):
    import ast

    import autoshard
    from examples import models

    monkeypatch.delenv("COLUMNS", raising=False)
    code, out, err = run(capsys, "show", "examples.models:gpt", "--mesh", "model=2", "--megatron", "--code",
                         "--rank", "1", "--factory-arg", "layers=1")
    assert code == 0, err
    assert _widths(out) <= 80, [ln for ln in out.splitlines() if len(ln) > 80]
    model, args, kwargs = models.gpt(layers=1)
    mesh = autoshard.Mesh(model=2)
    original = autoshard.compile(model, mesh, args, kwargs, annotations=models.megatron(mesh, "gpt")).plan.code(1)
    assert max(map(len, original.splitlines())) > 80  # there was something to wrap
    assert ast.dump(ast.parse(out)) == ast.dump(ast.parse(original))


def _display_strings(value, path="$"):
    """Strings in a JSON document that are numbers or placements written as text."""
    import re

    if isinstance(value, dict):
        for k, v in value.items():
            if not k.endswith("_text"):  # the *_text fields are the display form, next to the data
                yield from _display_strings(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _display_strings(v, f"{path}[{i}]")
    elif isinstance(value, str) and re.fullmatch(r"[-\d.e+]+ ?(B|KiB|MiB|us|ms|s)?|\d+/\d+|\(.*\)", value):
        yield path, value


def test_json_numbers_are_numbers_and_counts_agree(capsys):
    from autoshard.compiler.report import JSON_SCHEMA

    code, out, err = run(capsys, *LLAMA, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["schema"] == JSON_SCHEMA
    assert len(doc["nodes"]) == doc["overview"]["nodes"] == 244
    assert not list(_display_strings(doc)), list(_display_strings(doc))[:5]
    colls = [n["collective"] for n in doc["nodes"] if n["collective"]]
    assert len(colls) == doc["collectives"]["count"] == sum(doc["collectives"]["by_kind"].values())
    assert all(isinstance(c["bytes_forward"], int) and isinstance(c["bytes_backward"], int) for c in colls)
    costs = [n["cost"] for n in doc["nodes"] if n["cost"]]
    assert costs and all(isinstance(c["value"], float) and c["unit"] in ("s", "bytes") for c in costs)
    q = {p["param"]: p for p in doc["overview"]["params"]}["model.layers.*.self_attn.q_proj.weight"]
    assert q["spec"] == [{"axis": "data", "type": "Replicate"}, {"axis": "model", "type": "Shard", "dim": 0}]
    assert isinstance(doc["overview"]["cost"]["step_time_s"], float)


def test_cli_defaults_are_compiles_defaults():
    import inspect

    import autoshard
    from autoshard.api.cli import build_parser

    defaults = {k: p.default for k, p in inspect.signature(autoshard.compile).parameters.items()}
    args = build_parser().parse_args(["show", "examples.models:mlp", "--mesh", "data=2"])
    for flag in ("on_unsupported", "data_axis", "planner", "profile", "memory_limit", "recompute", "precision",
                 "moe", "pipeline"):
        assert getattr(args, flag) == defaults[flag], flag
    assert args.zero == defaults["zero"]  # None: "auto" for the search with a memory limit, else 0
    assert f"(default: {defaults['on_unsupported']})" in build_parser()._subparsers._group_actions[0].choices[
        "show"].format_help().replace("\n", " ").replace("  ", " ")


def test_plan_show_prints_the_summary_for_repeated_layers():
    import io

    from rich.console import Console

    import autoshard
    from examples import models

    model, args, kwargs = models.gpt(layers=2)
    mesh = autoshard.Mesh(data=2, model=2)
    plan = autoshard.compile(model, mesh, args, kwargs, annotations=models.megatron(mesh, "gpt")).plan
    for nodes, start in ((None, "plan for GPT"), (True, "autoshard plan: GPT")):
        buf = io.StringIO()
        plan.show(Console(file=buf, width=72), nodes=nodes)
        assert buf.getvalue().startswith(start) and _widths(buf.getvalue()) <= 72, buf.getvalue()
