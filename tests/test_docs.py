"""The README and docs/ as tests: short, linked, and in agreement with the code.

* README.md has at most 150 lines of at most 120 characters;
* its options table lists exactly ``autoshard.compile``'s keyword options, with their defaults, and every
  ``name=`` given to ``compile(...)`` in its code is one of them;
* its first Python block runs and prints the loss of eager PyTorch on every simulated rank;
* every link to a file points to one that exists, and docs/ and the README speak of the code, not its history;
* every module or file of the package that the README, docs/, bench/README.md or a docstring or comment of
  autoshard/, passes/ or cost_models/ names (``autoshard.x.y``, ``autoshard.passes.x``, ``passes/x.py``,
  ``cost_models/x.py``, ``autoshard/x.py``) exists, and so does the first name a dotted path takes from a module.
"""

from __future__ import annotations

import ast
import inspect
import io
import re
import tokenize
from pathlib import Path

import pytest

import autoshard

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "bench" / "README.md"]


def test_readme_is_short():
    lines = README.splitlines()
    assert len(lines) <= 150, len(lines)
    assert not [i for i, ln in enumerate(lines, 1) if len(ln) > 120]


OPTIONS = (ROOT / "docs" / "options.md").read_text()


def _options_table(heading: str) -> dict[str, str]:
    """{option: default} of the table under the ``## heading...`` of docs/options.md."""
    body = OPTIONS.split("## " + heading, 1)[1]
    rows = {}
    for line in body.splitlines()[1:]:
        if line.startswith("## "):
            break
        m = re.match(r"\| `(\w+)` \| `?([^`|]+?)`? \|", line)
        if m:
            rows[m.group(1)] = m.group(2)
    return rows


def _check_table(table: dict[str, str], params: dict) -> None:
    assert list(table) == list(params), (list(table), list(params))
    for name, default in table.items():
        assert default == repr(params[name]).replace("'", '"'), (name, default, params[name])


def test_options_tables_are_the_signatures():
    """docs/options.md's tables are plan's keywords, Search's fields and apply's keywords, in order, with their
    defaults; compile takes both sets (and its shorthand, listed in the doc)."""
    import dataclasses

    plan = {n: p.default for n, p in inspect.signature(autoshard.plan).parameters.items()
            if p.kind is inspect.Parameter.KEYWORD_ONLY}
    search = {f.name: f.default for f in dataclasses.fields(autoshard.Search)}
    apply = {n: p.default for n, p in inspect.signature(autoshard.apply).parameters.items()
             if p.kind is inspect.Parameter.KEYWORD_ONLY}
    _check_table(_options_table("What to shard, and explicit choices"), plan)
    _check_table(_options_table("How the search chooses"), search)
    _check_table(_options_table("How to run it here"), apply)
    compile_ = {n for n, p in inspect.signature(autoshard.compile).parameters.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY}
    shorthand = set(re.findall(r"`(\w+)(?:=|`)", OPTIONS.split("## `autoshard.compile`", 1)[1]))
    assert compile_ <= set(plan) | set(apply) | shorthand, compile_ - set(plan) - set(apply) - shorthand
    assert (set(plan) | set(apply)) - compile_ == set(), (set(plan) | set(apply)) - compile_


def test_options_named_in_readme_code_exist():
    known = set(inspect.signature(autoshard.compile).parameters) | set(inspect.signature(autoshard.plan).parameters)
    known |= set(inspect.signature(autoshard.apply).parameters) | {f.name for f in __import__("dataclasses").fields(
        autoshard.Search)}
    code = "\n".join(re.findall(r"```python\n(.*?)```", README, flags=re.S))
    calls = re.findall(r"autoshard\.(?:compile|plan|apply|Search)\((.*?)\)\n", code, flags=re.S)
    assert calls
    named = {k for call in calls for k in re.findall(r"\b(\w+)=", call)}
    assert named and named <= known, named - known
    prose = set(re.findall(r"`(\w+)=", README))  # `zero=1`, ... in the tables and text
    others = {"microbatches", "schedule", "layers", "num_experts", "use_cache"}  # Pipeline, MoE, the HF config
    assert prose <= known | others, prose - known


@pytest.mark.parametrize("path", [ROOT / "README.md", *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_links_point_to_files(path):
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", path.read_text()):
        if "://" not in target:
            assert (path.parent / target).exists(), f"{path.name} links to {target}, which does not exist"


@pytest.mark.parametrize("path", [ROOT / "README.md", *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_speak_of_the_code_not_its_history(path):
    text = path.read_text()
    for word in (r"\bissues?\b(?! (the|its|one|mismatched))", r"\bnot done yet\b", r"\bearlier session\b",
                 r"\bsee the open\b"):
        assert not re.search(word, text, flags=re.I), (path.name, word)


def test_readme_script_runs_and_matches_eager(capsys):
    """The README's first Python block, run as written: the same loss on every simulated rank as eager."""
    block = re.findall(r"```python\n(.*?)```", README, flags=re.S)[0]
    exec(compile(block, "README.md", "exec"), {})
    *_, losses_line, worst_line = capsys.readouterr().out.strip().splitlines()
    losses, ref = losses_line.rsplit("] ", 1)
    assert all(abs(float(x) - float(ref)) <= 1e-5 for x in losses.strip("[").split(", "))
    assert float(worst_line) <= 1e-4


# ---- names of modules and files ---------------------------------------------------------------------------
# autoshard.passes and autoshard.cost_models are installed from the top-level passes/ and cost_models/.
PACKAGE_DIRS = {"autoshard": ROOT / "autoshard", "autoshard.passes": ROOT / "passes",
                "autoshard.cost_models": ROOT / "cost_models"}
CODE_DIRS = ("autoshard", "passes", "cost_models")
# `autoshard.x.y` not preceded by a word or a dot (`torch.ops.autoshard.all_reduce` is an op, `model.autoshard.plan`
# an attribute); a path under autoshard/, passes/ or cost_models/ not inside another folder (`tests/cost_models/`).
DOTTED = re.compile(r"(?<![\w.])autoshard(?:\.[A-Za-z_]\w*)+")
FILE_PATH = re.compile(r"(?<![\w/.-])(?:\.\./)*((?:autoshard|passes|cost_models)/(?:[\w.-]*[\w/])?)")


def _doc_texts(path: Path) -> list[tuple[int, str]]:
    """The comments and docstrings of a Python file, with their line numbers (not its code or other strings)."""
    src = path.read_text()
    out = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(src).readline)
           if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                out.append((first.lineno, first.value.value))
    return out


def _named_texts() -> list[tuple[str, str]]:
    """(where, text) of every place whose module and file names must exist."""
    texts = [(str(p.relative_to(ROOT)), p.read_text()) for p in [ROOT / "README.md", *DOCS]]
    for d in CODE_DIRS:
        for p in sorted((ROOT / d).rglob("*.py")):
            texts += [(f"{p.relative_to(ROOT)}:{line}", text) for line, text in _doc_texts(p)]
    return texts


def _string_constants() -> set[str]:
    """Every ``autoshard.``-prefixed string the code itself uses (graph metadata keys such as
    ``autoshard.recompute``, the checkpoint marker ``autoshard.json``): names, not modules."""
    found = set()
    for d in CODE_DIRS:
        for p in (ROOT / d).rglob("*.py"):
            for node in ast.walk(ast.parse(p.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                        and re.fullmatch(r"autoshard(\.\w+)+", node.value):
                    found.add(node.value)
    return found


def _bound(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """The names a module or class body binds (also under if/try/with), and what binds them."""
    names: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for n in ast.walk(target):
                    if isinstance(n, ast.Name):
                        names[n.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            inner = node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
            inner += [s for h in getattr(node, "handlers", []) for s in h.body]
            names.update(_bound(inner))
    return names


def _has_attribute(module: Path, names: list[str]) -> bool:
    """Whether ``module`` (a .py file) defines ``names[0]`` — bound at top level, listed in ``__all__`` or, for a
    module with ``__getattr__``, one of its strings — and, when that is a class of the module, whether the class
    defines ``names[1]`` (in its body or as ``self.<name>``; a class with bases may inherit it)."""
    tree = ast.parse(module.read_text())
    top = _bound(tree.body)
    name = names[0]
    if name not in top:
        strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        return "__getattr__" in top and name in strings
    cls = top[name]
    if len(names) < 2 or not isinstance(cls, ast.ClassDef) or cls.bases:
        return True
    member = names[1]
    assigned = {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                and n.value.id == "self" and isinstance(n.ctx, ast.Store)}
    return member in _bound(cls.body) or member in assigned


def _dotted_exists(dotted: str) -> bool:
    parts = dotted.split(".")
    cur = PACKAGE_DIRS["autoshard"]
    for i, part in enumerate(parts[1:], 1):
        prefix = ".".join(parts[:i + 1])
        if cur.is_dir():
            if prefix in PACKAGE_DIRS:
                cur = PACKAGE_DIRS[prefix]
                continue
            if (cur / part / "__init__.py").is_file():
                cur = cur / part
                continue
            if (cur / f"{part}.py").is_file():
                cur = cur / f"{part}.py"
                continue
        module = cur / "__init__.py" if cur.is_dir() else cur
        return _has_attribute(module, parts[i:])
    return True


def stale_names() -> list[str]:
    """Every module or file name that is named somewhere (see :func:`_named_texts`) but does not exist."""
    constants = _string_constants()
    stale = []
    for where, text in _named_texts():
        for dotted in sorted(set(DOTTED.findall(text))):
            if any(dotted == c or dotted.startswith(c + ".") for c in constants):
                continue
            if not _dotted_exists(dotted):
                stale.append(f"{where}: {dotted}")
        for path in sorted(set(FILE_PATH.findall(text))):
            if not (ROOT / path).exists():
                stale.append(f"{where}: {path}")
    return stale


def test_named_modules_and_files_exist():
    """A module moved or removed leaves no name of it behind in the docs, docstrings or comments."""
    assert stale_names() == []


def test_stale_name_check_catches_a_moved_module():
    """The check itself: names that exist pass, names of missing modules, attributes and files fail."""
    assert _dotted_exists("autoshard.runtime.sim.SimWorld")
    assert _dotted_exists("autoshard.passes.manager.pass_list")
    assert _dotted_exists("autoshard.cost_models.memory")
    assert _dotted_exists("autoshard.compile")  # lazily imported by the package's __getattr__
    assert not _dotted_exists("autoshard.runtime.no_such_module")
    assert not _dotted_exists("autoshard.passes.manager.no_such_function")
    assert not _dotted_exists("autoshard.runtime.sim.SimWorld.no_such_method")
    assert FILE_PATH.findall("see passes/manager.py, ../cost_models/memory.py and tests/cost_models/x.py.") == \
        ["passes/manager.py", "cost_models/memory.py"]
    assert DOTTED.findall("`torch.ops.autoshard.all_reduce` and `autoshard.runtime.spawn`.") == \
        ["autoshard.runtime.spawn"]


def test_design_pass_diagram_is_the_pass_list():
    """docs/design.md's diagram names every pass of ``pass_list`` (every option on), in its order and phase."""
    import torch

    from autoshard.passes import manager

    options = manager.Options(moe=object(), recompute="blocks.*", planner="search", zero=3, context_parallel=object(),
                              precision=autoshard.MixedPrecision(param_dtype=torch.bfloat16))
    passes = manager.pass_list(options, manager.PipelineOptions(stages=2), manager.ProgramOptions(bucket_grads=True))
    diagram = (ROOT / "docs" / "design.md").read_text().split("plan phase — ", 1)[1].split("──runtime──", 1)[0]
    plan, rank = diagram.split("rank phase — ", 1)
    for phase, text in (("plan", plan), ("rank", rank)):
        assert re.findall(r"^ {3}(\w+)", text, flags=re.M) == [p.name for p in passes[phase]], phase
