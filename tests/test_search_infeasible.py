"""A memory limit no plan meets is refused before the search's walk, naming the least memory and what to change
(passes/plan_search/lagrangian.py, step 0 of ``search``); the search's time limit is an option
(``Options.search_time_limit``, the CLI's ``--search-time-limit``). How fast the refusal is, is
``bench/infeasible_limit.py``'s to report, not these tests'."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

import autoshard
from autoshard.api.sharded_module import make_options
from autoshard.errors import PlanError
from autoshard.passes import plan_search
from autoshard.compiler.plan import build_plan
from examples import models

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning",
                                        "ignore::DeprecationWarning")


def _plan(factory, mesh, profile, limit, time_limit=None, **kwargs):
    model, args, kw = getattr(models, factory)(**kwargs)
    options = make_options({}, "data", "replicate", mesh, planner="search", profile=profile, memory_limit=limit,
                           zero="auto", recompute="auto")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_plan(model, mesh, args, kw, dataclasses.replace(options, search_time_limit=time_limit))


def _refusal(factory, mesh, profile, limit, **kwargs) -> PlanError:
    with pytest.raises(PlanError) as err:
        _plan(factory, mesh, profile, limit, **kwargs)
    return err.value


def _check_message(error: PlanError, limit: float) -> None:
    text = str(error)
    least = plan_search.objective.format_bytes(error.least_memory)
    assert text.startswith(f"option memory_limit is {plan_search.objective.format_bytes(limit)} per rank, but the "
                           "least memory any plan needs is ")
    if error.least_memory_proven:
        assert f"needs is {least} per rank" in text and error.least_memory == error.least_memory_found
    else:  # the bound is not shown to be met: said so
        assert f"needs is at least {least} per rank (a lower bound" in text
        assert error.least_memory <= error.least_memory_found
    assert f"Raise memory_limit to at least {least}" in text and "or use a larger mesh" in text


@pytest.fixture(scope="module")
def hf_llama_refused() -> PlanError:
    """HF Llama (2 layers) on data=2 x model=2 refused at a 1000-byte limit, once for the two tests below (the
    refusal's least-peak ILP has a few seconds to prove the least peak: both tests read the same figures)."""
    return _refusal("hf_llama", autoshard.Mesh(data=2, model=2), "cpu-gloo", 1000, layers=2)


def test_hf_llama_infeasible_limit_names_a_true_lower_bound(hf_llama_refused):
    mesh = autoshard.Mesh(data=2, model=2)
    error = hf_llama_refused
    least = error.least_memory
    assert least > 1000
    _check_message(error, 1000)
    # the bound is below what the search reaches at a limit a little above the least plan found
    limit = 1.05 * error.least_memory_found
    plan = _plan("hf_llama", mesh, "cpu-gloo", limit, layers=2)
    searched = plan.context.report["plan_search"]["memory_per_rank"]
    assert least <= searched <= limit
    assert plan.cost().memory_per_rank == pytest.approx(searched, rel=1e-9)
    # just below the bound: refused, the same bound named
    again = _refusal("hf_llama", mesh, "cpu-gloo", 0.99 * least, layers=2)
    assert again.least_memory == pytest.approx(least) and again.least_memory_found == pytest.approx(
        error.least_memory_found)


def test_hf_llama_limit_just_above_the_bound_is_met_or_said_to_be_a_bound(hf_llama_refused):
    """Just above the bound either a plan is found, or the refusal says the bound is only a bound (with a short time
    limit the walk gives up quickly: the message says so and what to change)."""
    mesh = autoshard.Mesh(data=2, model=2)
    least = hf_llama_refused.least_memory
    limit = 1.01 * least
    try:
        plan = _plan("hf_llama", mesh, "cpu-gloo", limit, time_limit=2.0, layers=2)
    except PlanError as error:
        assert not error.least_memory_proven and error.least_memory <= limit < error.least_memory_found
        text = str(error)
        assert "no plan within it was found in" in text and "needs is at least" in text
        assert "give the search more time (search_time_limit)" in text
    else:
        assert plan.context.report["plan_search"]["memory_per_rank"] <= limit


def test_llama3_8b_meta_infeasible_limit_names_a_true_lower_bound():
    mesh = autoshard.Mesh(data=8, model=8)
    kwargs = {"batch": 8, "seq": 64}  # 32 layers, traced once (layer reuse)
    error = _refusal("llama3_8b_meta", mesh, "gpu-8x-nvlink", 2**30, **kwargs)
    least = error.least_memory
    assert least > 2**30
    _check_message(error, 2**30)
    limit = 1.05 * error.least_memory_found
    # 3 s of search (a small share of its unbounded time here): the bound holds whatever plan the search reaches.
    # The plan "found" is the refusal's least-peak ILP's, as far as it got in its second (load-dependent): the
    # search may not reach one within 5% of it in its time, and then says the bound is only a bound
    try:
        plan = _plan("llama3_8b_meta", mesh, "gpu-8x-nvlink", limit, time_limit=3.0, **kwargs)
    except PlanError as refused:
        assert not refused.least_memory_proven and refused.least_memory == pytest.approx(least)
        assert "no plan within it was found in" in str(refused) and "search_time_limit" in str(refused)
    else:
        searched = plan.context.report["plan_search"]["memory_per_rank"]
        assert least <= searched <= limit


def test_the_bound_is_below_the_least_memory_plan_and_the_least_peak():
    """``least_memory_bound`` against plans the search can reach: the least-memory plan and the least-peak ILP's."""
    from autoshard.passes.plan_search import lagrangian

    problems = []
    search = plan_search.search

    def keep(problem, *args, **kwargs):
        problems.append(problem)
        return search(problem, *args, **kwargs)

    plan_search.search = keep
    try:
        _plan("gpt", autoshard.Mesh(data=2, model=2), "cpu-gloo", 10 * 2**20, layers=2)
    finally:
        plan_search.search = search
    problem = problems[0]
    bound = plan_search.least_memory_bound(problem)
    least = plan_search.least_memory_plan(problem)
    peak, _ = lagrangian._least_peak_plan(problem, 2 * least.memory, least.time, 60.0)
    assert 0 < bound <= least.memory
    assert peak is None or bound <= peak.memory


def test_search_time_limit_reaches_the_search():
    mesh = autoshard.Mesh(data=2, model=2)
    plan = _plan("gpt", mesh, "cpu-gloo", None, time_limit=1e-3, layers=2)
    report = plan.context.report["plan_search"]
    assert report["timed_out"]  # 1 ms is too short for the unconstrained ILP: the fallback plan is used


def test_cli_search_time_limit_flag():
    from autoshard.api.cli import _search_options, build_parser

    args = build_parser().parse_args(["plan", "examples.models:gpt", "--mesh", "data=2", "--planner", "search",
                                      "--search-time-limit", "7.5"])
    assert args.search_time_limit == 7.5 and _search_options(args) == {"search_time_limit": 7.5}
    args = build_parser().parse_args(["plan", "examples.models:gpt", "--mesh", "data=2"])
    assert _search_options(args) == {}
