"""The architecture as tests: layering rules a refactor must keep.

* ``autoshard/errors.py`` is a leaf (imports nothing of autoshard);
* the runtime never imports the compiler (passes, codegen, plan, rules, cost models);
* no import cycles among autoshard's modules (imports at module level);
* every pass class in ``passes/`` is in the one pass list (:func:`autoshard.passes.manager.pass_list`);
* no home-made transport: the runtime names no ``/dev/shm`` and no shared-memory mapping.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
from pathlib import Path

import pytest

import autoshard
from autoshard.context import Options

ROOT = Path(__file__).resolve().parent.parent
#: package directory -> import name (passes/ and cost_models/ install as autoshard.passes, autoshard.cost_models)
PACKAGES = {ROOT / "autoshard": "autoshard", ROOT / "passes": "autoshard.passes",
            ROOT / "cost_models": "autoshard.cost_models"}


def _modules() -> dict[str, Path]:
    out = {}
    for folder, name in PACKAGES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([name, *parts])] = path
    return out


MODULES = _modules()


def _imports(path: Path, module: str, top_level_only: bool) -> set[str]:
    """autoshard modules imported by ``path`` (relative imports resolved)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m in MODULES}


def test_errors_is_a_leaf():
    assert _imports(MODULES["autoshard.errors"], "autoshard.errors", top_level_only=False) == set()


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("autoshard.runtime")))
def test_runtime_never_imports_the_compiler(module):
    compiler = ("autoshard.passes", "autoshard.codegen", "autoshard.plan", "autoshard.rules", "autoshard.strategies",
                "autoshard.cost_models", "autoshard.api", "autoshard.report", "autoshard.ops", "autoshard.collectives")
    imported = _imports(MODULES[module], module, top_level_only=False)
    assert not [m for m in imported if m.startswith(compiler)], f"{module} imports the compiler: {sorted(imported)}"


def test_no_import_cycles_at_module_level():
    graph = {m: _imports(p, m, top_level_only=True) - {m} for m, p in MODULES.items()}
    # a package importing its own submodules (re-exports) is not a cycle through the package
    for m in graph:
        graph[m] = {d for d in graph[m] if not (MODULES[m].name == "__init__.py" and d.startswith(m + "."))}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_every_pass_is_in_the_one_pass_list():
    from autoshard.moe import MoE
    from autoshard.passes import manager

    classes = set()
    for name, path in MODULES.items():
        if not name.startswith("autoshard.passes.") or name == "autoshard.passes.manager":
            continue
        mod = importlib.import_module(name)
        for obj in vars(mod).values():
            if (inspect.isclass(obj) and obj.__module__ == name and dataclasses.is_dataclass(obj)
                    and callable(getattr(obj, "run", None)) and any(f.name == "name" for f in dataclasses.fields(obj))):
                classes.add(obj)
    from autoshard.context_parallel import ContextParallel
    from autoshard.precision import MixedPrecision

    everything = manager.pass_list(Options(planner="search", moe=MoE(layers="*", num_experts=2), zero=3,
                                           recompute="blocks.*", precision=MixedPrecision(),
                                           context=ContextParallel()),
                                   pipeline=manager.PipelineOptions(stages=2),
                                   program=manager.ProgramOptions(bucket_grads=True))
    listed = {type(p) for phase in everything.values() for p in phase}
    assert classes, "found no pass classes"
    assert classes == listed, f"passes outside the list: {sorted(c.__name__ for c in classes - listed)}"
    for phase in everything.values():
        for p in phase:
            assert dataclasses.fields(p) is not None and type(p).__dataclass_params__.frozen, p


def test_the_runtime_has_no_transport_of_its_own():
    runtime = ROOT / "autoshard" / "runtime"
    for path in runtime.rglob("*.py"):
        text = path.read_text()
        assert "/dev/shm" not in text and "mmap" not in text, path


def test_generated_code_names_operators_for_every_collective():
    from examples import models

    model, args, kwargs = models.gpt(layers=1)
    mesh = autoshard.Mesh(data=2, model=2)
    code = autoshard.compile(model, mesh, args, kwargs, plan=models.megatron(mesh, "gpt")).plan.code(0)
    assert "torch.ops.autoshard.all_reduce.default(" in code
    assert "autoshard_runtime_collectives" not in code
