"""Alpha-beta collective formulas: symbolic form, hand-computed values, n == 1, the cached float path."""

from __future__ import annotations

import math

import pytest
import sympy
from autoshard.cost_models import alpha_beta
from autoshard.cost_models.alpha_beta import (
    COLLECTIVE_TIME,
    KINDS,
    alpha,
    b,
    beta,
    collective_bytes_on_wire,
    collective_time,
    model_coefficients,
    n,
    time_expr,
)
from autoshard.cost_models.profile import LinkCost

from autoshard.errors import PlanError

LINK = LinkCost(alpha=1e-5, beta=1e-9)
MIB = 1 << 20


def test_formulas_are_the_documented_ones():
    expected = {
        "all_reduce": 2 * (n - 1) / n * b * beta + 2 * (n - 1) * alpha,
        "all_gather": (n - 1) / n * b * beta + (n - 1) * alpha,
        "reduce_scatter": (n - 1) / n * b * beta + (n - 1) * alpha,
        "all_to_all": (n - 1) / n * b * beta + (n - 1) * alpha,
        "send_recv": b * beta + alpha,
        "local_slice": sympy.Integer(0),
        "grad_all_reduce": 2 * (n - 1) / n * b * beta + 2 * (n - 1) * alpha,
    }
    assert set(COLLECTIVE_TIME) == set(expected)
    for kind, expr in expected.items():
        assert sympy.simplify(COLLECTIVE_TIME[kind] - expr) == 0, kind


@pytest.mark.parametrize("kind, seconds", [
    # 2·3/4·1 MiB·1e-9 + 2·3·1e-5
    ("all_reduce", 1.5 * MIB * 1e-9 + 6e-5),
    ("grad_all_reduce", 1.5 * MIB * 1e-9 + 6e-5),
    # 3/4·1 MiB·1e-9 + 3·1e-5
    ("all_gather", 0.75 * MIB * 1e-9 + 3e-5),
    ("reduce_scatter", 0.75 * MIB * 1e-9 + 3e-5),
    ("all_to_all", 0.75 * MIB * 1e-9 + 3e-5),
    ("send_recv", MIB * 1e-9 + 1e-5),
    ("local_slice", 0.0),
])
def test_one_mib_on_four_ranks(kind, seconds):
    assert collective_time(kind, MIB, 4, LINK) == pytest.approx(seconds, rel=1e-12)


def test_all_reduce_by_hand():
    assert collective_time("all_reduce", MIB, 4, LINK) == pytest.approx(0.001632864, rel=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_one_rank_costs_nothing(kind):
    assert collective_time(kind, MIB, 1, LINK) == 0.0
    assert collective_bytes_on_wire(kind, MIB, 1) == 0.0
    if kind != "send_recv":  # a transfer between two ranks: n is not in its formula
        assert COLLECTIVE_TIME[kind].subs(n, 1) == 0


def test_zero_bytes_cost_nothing():
    assert collective_time("all_reduce", 0, 8, LINK) == 0.0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("nbytes, ranks", [(1, 2), (4096, 3), (123456789, 8), (7, 64)])
def test_float_path_equals_the_sympy_formula(kind, nbytes, ranks):
    link = LinkCost(3.7e-6, 1 / 23e9)
    exact = COLLECTIVE_TIME[kind].subs({b: nbytes, n: ranks, alpha: link.alpha, beta: link.beta})
    assert collective_time(kind, nbytes, ranks, link) == pytest.approx(float(exact), rel=1e-12)


def test_bytes_on_wire_numeric_and_symbolic():
    assert collective_bytes_on_wire("all_reduce", 1000, 4) == 1500.0
    assert collective_bytes_on_wire("all_gather", 1000, 4) == 750.0
    assert collective_bytes_on_wire("send_recv", 1000, 2) == 1000.0
    assert collective_bytes_on_wire("local_slice", 1000, 4) == 0.0
    assert sympy.simplify(collective_bytes_on_wire("all_reduce") - 2 * (n - 1) / n * b) == 0
    B, S, H = sympy.symbols("B S H", positive=True)
    expr = collective_bytes_on_wire("all_gather", 4 * B * S * H, 2)
    assert sympy.simplify(expr - 2 * B * S * H) == 0


def test_time_expr_of_shapes():
    B, S, H = sympy.symbols("B S H", positive=True)
    expr = time_expr("all_reduce", nbytes=4 * B * S * H, group_size=2)
    assert sympy.simplify(expr - (4 * B * S * H * beta + 2 * alpha)) == 0
    assert time_expr("all_to_all") == COLLECTIVE_TIME["all_to_all"]
    value = time_expr("all_to_all", 1000, 4, 1e-5, 1e-9)
    assert float(value) == pytest.approx(collective_time("all_to_all", 1000, 4, LINK))


def test_model_coefficients():
    assert model_coefficients("all_reduce", 4) == (6.0, 1.5)
    assert model_coefficients("all_gather", 2) == (1.0, 0.5)
    assert model_coefficients("send_recv", 2) == (1.0, 1.0)


def test_unknown_kind_lists_the_kinds():
    with pytest.raises(PlanError) as e:
        collective_time("broadcast", 10, 2, LINK)
    assert "'broadcast'" in str(e.value) and all(k in str(e.value) for k in KINDS)
    with pytest.raises(PlanError):
        collective_bytes_on_wire("gather", 10, 2)
    with pytest.raises(PlanError):
        time_expr("scatter")


def test_float_path_does_not_touch_sympy_once_built(monkeypatch):
    """The planner calls collective_time thousands of times: after the first call per kind, the float path is the
    cached lambdified function (no sympy substitution, no new lambdify)."""
    for kind in KINDS:
        collective_time(kind, 1024, 4, LINK)

    def forbidden(*args, **kwargs):
        raise AssertionError("sympy used on the float path")

    monkeypatch.setattr(sympy.Basic, "subs", forbidden)
    monkeypatch.setattr(sympy, "lambdify", forbidden)
    for i in range(200):
        kind = KINDS[i % len(KINDS)]
        value = collective_time(kind, 1024 + i, 2 + i % 7, LINK)
        assert isinstance(value, float) and math.isfinite(value)


def test_numeric_functions_are_built_once():
    alpha_beta._numeric.cache_clear()
    for _ in range(100):
        collective_time("all_reduce", 10, 4, LINK)
    assert alpha_beta._numeric.cache_info().misses == 1
    assert math.isfinite(collective_time("all_reduce", 1e30, 1024, LINK))
