"""Shared pytest options and fixtures of the test suite."""

from __future__ import annotations

import os

import pytest


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
