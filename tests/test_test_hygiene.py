"""The test suite stays free of wall-clock timing: no test sleeps, and no test asserts on elapsed time.

A sleep orders nothing (a loaded machine can run the other side later still) and slows every run; an assert on
elapsed time fails on a busy machine and passes on a fast one whatever the code does. Order is made with events,
barriers and locks, a test checks what the code records (the error it raised, the order it ran in) and a clock
that a deadline is computed from is a scripted one; timings belong in bench/, which reports them measured side by
side. This file reads every Python file under tests/ (with the ast module, so comments and strings never count)
and fails on:

* a call of ``time.sleep`` (also imported as ``from time import sleep`` or under another name);
* an ``assert`` that reads a wall clock — ``time.time``, ``time.perf_counter``, ``time.monotonic`` (and their
  ``_ns`` forms) — directly or through a variable assigned from one, such as ``elapsed = time.monotonic() - t0``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
CLOCKS = {"time", "perf_counter", "monotonic", "time_ns", "perf_counter_ns", "monotonic_ns"}


class _Finder(ast.NodeVisitor):
    """Sleeps and clock-reading asserts of one module (``found``: (line, what) pairs)."""

    def __init__(self) -> None:
        self.found: list[tuple[int, str]] = []
        self.time_modules: set[str] = set()  # names the time module is bound to
        self.sleeps: set[str] = set()  # names time.sleep is bound to
        self.clocks: set[str] = set()  # names a clock function is bound to
        self.tainted: list[set[str]] = [set()]  # per scope: variables assigned from a clock reading

    # ---- what the names mean
    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name == "time":
                self.time_modules.add(alias.asname or "time")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module == "time":
            for alias in node.names:
                if alias.name == "sleep":
                    self.sleeps.add(alias.asname or alias.name)
                elif alias.name in CLOCKS:
                    self.clocks.add(alias.asname or alias.name)

    def _is(self, func: ast.expr, names: set[str], bound: set[str]) -> bool:
        if isinstance(func, ast.Attribute):
            return (func.attr in names and isinstance(func.value, ast.Name)
                    and func.value.id in self.time_modules)
        return isinstance(func, ast.Name) and func.id in bound

    def _reads_clock(self, expr: ast.AST) -> bool:
        for n in ast.walk(expr):
            if isinstance(n, ast.Call) and self._is(n.func, CLOCKS, self.clocks):
                return True
            if isinstance(n, ast.Name) and any(n.id in scope for scope in self.tainted):
                return True
        return False

    # ---- scopes: a variable assigned from a clock is tracked in its function (and the functions inside it)
    def _scope(self, node: ast.AST) -> None:
        self.tainted.append(set())
        self.generic_visit(node)
        self.tainted.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _scope

    def _assigned(self, targets: list[ast.expr], value: ast.expr | None) -> None:
        if value is not None and self._reads_clock(value):
            for target in targets:
                self.tainted[-1].update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))

    def visit_Assign(self, node: ast.Assign) -> None:
        self._assigned(node.targets, node.value)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._assigned([node.target], node.value)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._assigned([node.target], node.value)
        self.generic_visit(node)

    def visit_NamedExpr(self, node: ast.NamedExpr) -> None:
        self._assigned([node.target], node.value)
        self.generic_visit(node)

    # ---- what is refused
    def visit_Call(self, node: ast.Call) -> None:
        if self._is(node.func, {"sleep"}, self.sleeps):
            self.found.append((node.lineno, "time.sleep"))
        self.generic_visit(node)

    def visit_Assert(self, node: ast.Assert) -> None:
        if self._reads_clock(node.test):
            self.found.append((node.lineno, "assert on a wall clock"))
        self.generic_visit(node)


def timing_in(source: str) -> list[tuple[int, str]]:
    """(line, what) of every sleep and every assert on a wall clock in ``source``."""
    finder = _Finder()
    finder.visit(ast.parse(source))
    return sorted(finder.found)


def test_no_test_sleeps_or_asserts_on_elapsed_time():
    found = [f"{path.relative_to(TESTS.parent)}:{line}: {what}" for path in sorted(TESTS.rglob("*.py"))
             for line, what in timing_in(path.read_text())]
    assert found == []


@pytest.mark.parametrize("source, expected", [
    ("import time\ntime.sleep(0.1)\n", [(2, "time.sleep")]),
    ("import time as t\nt.sleep(1)\n", [(2, "time.sleep")]),
    ("from time import sleep as nap\nnap(1)\n", [(2, "time.sleep")]),
    ("import time\ndef f():\n    start = time.monotonic()\n    g()\n    assert time.monotonic() - start < 5\n",
     [(5, "assert on a wall clock")]),
    ("from time import perf_counter\ndef f():\n    t0 = perf_counter()\n    g()\n    elapsed = perf_counter() - t0\n"
     "    assert elapsed < 1\n", [(6, "assert on a wall clock")]),
    ("import time\nassert time.time() > 0\n", [(2, "assert on a wall clock")]),
    # allowed: a deadline for a join, a clock read outside asserts, an event's bounded wait, a `sleep` of another
    # module, a variable of the same name in another function
    ("import time\nend = time.monotonic() + 5\np.join(max(end - time.monotonic(), 0))\n", []),
    ("import threading\nassert threading.Event().wait(timeout=1)\n", []),
    ("import asyncio\nasyncio.sleep(0)\n", []),
    ("import time\ndef f():\n    t = time.monotonic()\ndef g(t):\n    assert t\n", []),
])
def test_the_check_finds_sleeps_and_clock_asserts(source, expected):
    assert timing_in(source) == expected
