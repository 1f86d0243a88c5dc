"""The ``autoshard`` command line: ``show`` output in each mode, plan files, and one-line user errors (exit 2).

Most tests call :func:`autoshard.cli.main` in-process and read its output with ``capsys``; one runs the installed
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

from autoshard.cli import main

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
    assert nodes["x"]["spec"] == "(S(0))"


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
    assert nodes["fc1_weight"]["spec"] == "(S(0))"
    assert nodes["fc2_weight"]["spec"] == "(S(1))"


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
