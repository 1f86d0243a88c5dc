"""Shared pytest options and fixtures of the test suite."""

from __future__ import annotations

import inspect
import math
import os

import pytest


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker per core this process may use, its CPU affinity bounded by the cgroup's CPU quota.
    pytest-xdist counts the affinity (or, with psutil installed, the host's physical cores), but a container limited
    to 2 cores by a quota still shows every core of its host there: up to ``--maxprocesses`` (4) workers on 2 cores
    (3 workers measured 5-15% slower than 2 on this 2-core machine)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(n, _cgroup_cpus() or n))


def _cgroup_cpus() -> int | None:
    """The cores the cgroup's CPU quota allows (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``), None: no quota."""
    for path, period_path in (("/sys/fs/cgroup/cpu.max", None),
                              ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us")):
        try:
            with open(path) as f:
                fields = f.read().split()
            if period_path is not None:
                with open(period_path) as f:
                    fields.append(f.read().strip())
        except OSError:
            continue
        if len(fields) == 2 and fields[0] not in ("max", "-1"):
            try:
                return math.ceil(int(fields[0]) / int(fields[1]))
            except (ValueError, ZeroDivisionError):
                return None
        return None
    return None


def pytest_configure(config: pytest.Config) -> None:
    """One intra-op thread per pytest-xdist worker: ``-n auto`` runs a worker per core, and each worker's default
    of one thread per core made the workers' OpenMP threads contend for the same cores (the multi-process tests'
    ranks run one thread each already, ``autoshard.runtime.launch``)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--update-golden", action="store_true", default=False,
                     help="rewrite the golden files under tests/golden/ instead of comparing with them")


@pytest.fixture
def update_golden(request: pytest.FixtureRequest) -> bool:
    """True when pytest runs with ``--update-golden``: golden tests then rewrite their files."""
    return bool(request.config.getoption("--update-golden"))


_TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``--dist loadgroup`` (pyproject's addopts) a test with no ``xdist_group`` is a unit of its own, sent to
    whichever worker is free, so the tests sharing one of our module-scoped fixtures (a module's gloo run of every
    case, a torchrun reference) would each run that fixture again on their own worker: test_matrix's 4-process
    fixture ran twice (40 s each) in the first run that way. Such tests are grouped by their module, so that one
    worker runs them, and the fixture once. (Runs before pytest-xdist's hook, which reads the groups.) Groups are
    sent in collection order (``--no-loadscope-reorder``): xdist's default sends the largest groups first, so every
    module group, most of them multi-process, started before any other test; in the clean-clone run that did so the
    torchrun nanoGPT test took 94 s (66 s in the run before) and the suite 885 s (796 s); in collection order,
    844 s."""
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        for name in info.names_closure:
            defs = info.name2fixturedefs.get(name)
            if defs and defs[-1].scope in ("module", "package", "session") and _ours(defs[-1].func):
                item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
                break


def _ours(func) -> bool:
    try:
        path = inspect.getsourcefile(func)
    except TypeError:
        return False
    return path is not None and os.path.abspath(path).startswith(_TESTS + os.sep)
