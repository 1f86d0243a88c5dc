"""Every rank runs one plan and makes the same calls (autoshard/runtime/agreement.py), on real processes and in the
simulator alike: a forward on some ranks only and ranks that planned differently are errors on every rank that name
the cause (never a gloo abort or a hang), and a searched plan is decided on rank 0 for every rank."""

from __future__ import annotations

import copy
from contextlib import contextmanager

import pytest
import torch

import autoshard
from autoshard.errors import AutoshardError
from autoshard.compiler.plan import loss_of
from autoshard.runtime import SimWorld, spawn
from examples import models

MESH = autoshard.Mesh(data=2, model=2)


_GPT, _ARGS, _ = models.gpt(layers=1)  # built once: simulated ranks are threads sharing torch's global generator


def _gpt():
    return copy.deepcopy(_GPT), _ARGS


def _local(args, rank):
    return tuple(autoshard.data_shard(x, MESH, rank) for x in args)


def _errors(fn) -> str:
    try:
        fn()
    except AutoshardError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _eval_on_rank0_only(rank, comm=None):
    """The DDP habit: a training step on every rank, then `if rank == 0: evaluate()`, then the next step."""
    model, args = _gpt()
    sharded = autoshard.compile(model, MESH, annotations=models.megatron(MESH, "gpt"), comm=comm)
    loss_of(sharded(*_local(args, rank))).backward()

    def next_calls():
        if rank == 0:
            sharded.eval()
            with torch.no_grad():
                sharded(*_local(args, rank))
        sharded.train()
        loss_of(sharded(*_local(args, rank))).backward()

    return _errors(next_calls)


def _planned_differently(rank, comm=None):
    """Rank 3 compiles with another annotation: its program differs from the others'."""
    model, args = _gpt()
    annotations = models.megatron(MESH, "gpt") if rank != 3 else None
    sharded = autoshard.compile(model, MESH, annotations=annotations, comm=comm)
    return _errors(lambda: loss_of(sharded(*_local(args, rank))).backward())


def _limit():
    """60% of the unconstrained searched plan's memory: the search recomputes and stores ZeRO shards to fit."""
    model, args = _gpt()
    return 0.6 * autoshard.compile(model, MESH, args, planner="search").plan.cost().memory.peak


@contextmanager
def _searches_counted():
    """[(rank, what) of each plan search run and each search problem built] while the block runs (a process's
    rank, or a simulator thread's; what: "search" or "problem")."""
    from autoshard.passes import plan_search
    from autoshard.runtime import current

    searched, originals = [], {"search": plan_search.search, "build_problem": plan_search.build_problem}

    def counting(name):
        def counted(*a, **k):
            real = torch.distributed.is_initialized()
            searched.append((torch.distributed.get_rank() if real else current().rank, name))
            return originals[name](*a, **k)
        return counted

    for name in originals:
        setattr(plan_search, name, counting(name))
    try:
        yield searched
    finally:
        for name, original in originals.items():
            setattr(plan_search, name, original)


def _searched_on_rank0(rank, limit, comm=None):
    """planner="search" under a memory limit: every rank gets rank 0's plan and trains equal to one device."""
    model, args = _gpt()
    sharded = autoshard.compile(model, MESH, planner="search", memory_limit=limit, comm=comm)
    loss = loss_of(sharded(*_local(args, rank)))
    loss.backward()
    return sharded.plan.digest(), loss.item()


def _aliased_examples(rank, comm=None):
    """Example inputs that are one tensor object for (idx, targets), then a training call with distinct ones."""
    model, (ids, labels) = _gpt()
    z = torch.zeros_like(ids)
    sharded = autoshard.compile(model, MESH, (z, z), comm=comm)
    loss = loss_of(sharded(*_local((ids, labels), rank)))
    loss.backward()
    return loss.item()


def _cases(rank, world_size, limit):
    with _searches_counted() as searched:
        search = _searched_on_rank0(rank, limit)
    return {"eval": _eval_on_rank0_only(rank), "plans": _planned_differently(rank), "search": (searched, *search),
            "aliased": _aliased_examples(rank)}


@pytest.fixture(scope="module")
def gloo_results():
    return spawn(_cases, 4, _limit(), timeout=240, start_method="forkserver")


def _sim(case, *args):
    world = SimWorld(MESH, timeout=120)
    return world.run(lambda rank: case(rank, *args, comm=world.communicator(rank)))


def _check_eval_errors(results):
    for rank, text in enumerate(results):
        assert text.startswith("AutoshardError"), (rank, text)
        # the eval call on rank 0 meets the others' next training call
        assert "in train mode on ranks 1-3 and in eval mode on ranks 0 at once" in text, text
        assert "call the module on every rank" in text, text


def _check_plan_errors(results):
    for rank, text in enumerate(results):
        assert text.startswith("PlanError: ranks planned differently"), (rank, text)
        assert "ranks 0-2" in text and "first difference" in text, text


def _check_search(results, searched):
    # rank 0 built the problem and searched it; the other ranks applied its decisions without either
    assert sorted(searched) == [(0, "build_problem"), (0, "search")]
    assert len({r[0] for r in results}) == 1
    model, args = _gpt()
    ref = loss_of(model(*args)).item()
    for r in results:
        assert r[1] == pytest.approx(ref, abs=1e-5)


@pytest.mark.gloo
def test_eval_on_rank0_only_is_an_error_on_every_real_rank(gloo_results):
    _check_eval_errors([r["eval"] for r in gloo_results])


@pytest.mark.gloo
def test_ranks_that_planned_differently_are_an_error_naming_the_difference_on_real_ranks(gloo_results):
    _check_plan_errors([r["plans"] for r in gloo_results])


@pytest.mark.gloo
def test_searched_plan_is_decided_on_rank0_for_every_real_rank(gloo_results):
    results = [r["search"] for r in gloo_results]
    _check_search([r[1:] for r in results], sum((r[0] for r in results), []))


def test_eval_on_rank0_only_is_an_error_on_every_simulated_rank():
    _check_eval_errors(_sim(_eval_on_rank0_only))


def test_ranks_that_planned_differently_are_an_error_in_the_simulator():
    _check_plan_errors(_sim(_planned_differently))


def test_searched_plan_is_decided_on_rank0_in_the_simulator():
    limit = _limit()
    with _searches_counted() as searched:
        results = _sim(_searched_on_rank0, limit)
    _check_search(results, searched)


def test_plan_digest_names_a_layout_change():
    model, args = _gpt()
    a = autoshard.compile(model, MESH, args, annotations=models.megatron(MESH, "gpt")).plan
    b = autoshard.compile(_gpt()[0], MESH, args, annotations=models.megatron(MESH, "gpt")).plan
    c = autoshard.compile(_gpt()[0], MESH, args).plan
    assert a.digest() == b.digest() != c.digest()


def _check_aliased(losses):
    ref = loss_of(_GPT(*_ARGS)).item()
    assert losses == [pytest.approx(ref, abs=1e-5)] * 4  # (z, z) traced as one input read only targets: 3.75


@pytest.mark.gloo
def test_aliased_example_inputs_train_as_distinct_inputs_on_real_ranks(gloo_results):
    _check_aliased([r["aliased"] for r in gloo_results])


def test_aliased_example_inputs_train_as_distinct_inputs_in_the_simulator():
    _check_aliased(_sim(_aliased_examples))


def test_example_inputs_that_share_memory_are_traced_as_distinct_inputs():
    """The same object twice, and a view of another input: each placeholder is read where the model reads it."""
    from autoshard.frontend.trace import unaliased

    x = torch.ones(4, 3)
    args, kwargs = unaliased((x, x, x[1:]), {"y": x.view(12)})
    assert args[0] is x and all(t is not x and t.data_ptr() != x.data_ptr() for t in (args[1], args[2], kwargs["y"]))
    assert torch.equal(args[2], x[1:]) and torch.equal(kwargs["y"], x.view(12))
    meta = torch.empty(2, 2, device="meta")
    margs, _ = unaliased((meta, meta, torch.empty(2, 2, device="meta")), {})
    assert margs[0] is meta and margs[1] is not meta and margs[2] is not meta


def _rank0_cannot_plan(rank, comm=None):
    """Rank 0's search cannot meet its memory limit (1 KiB); the other ranks wait for rank 0's plan."""
    model, args = _gpt()
    sharded = autoshard.compile(model, MESH, planner="search", memory_limit=1024 if rank == 0 else None, comm=comm)
    return _errors(lambda: sharded(*_local(args, rank)))


def test_a_plan_rank0_cannot_make_is_an_error_on_every_rank():
    texts = _sim(_rank0_cannot_plan)
    assert texts[0].startswith("PlanError") and "least memory" in texts[0], texts[0]
    for text in texts[1:]:
        assert text.startswith("PlanError: rank 0 failed to plan (PlanError): "), text
        assert "least memory" in text, text


@pytest.mark.parametrize("digests, modes, grads, equal", [
    ([7, 7, 7, 7], [1, 1, 1, 1], [1, 1, 1, 1], True),
    ([2**59 + 5] * 4, [0] * 4, [0] * 4, True),
    ([7, 7, 7, 7 + 2**20], [1] * 4, [1] * 4, False),  # only the second 20-bit piece differs
    ([3, 5, 4, 4], [1] * 4, [1] * 4, False),  # same sum as four 4s: the squares tell
    ([7] * 4, [1, 1, 0, 1], [1] * 4, False),
    ([7] * 4, [1] * 4, [0, 1, 1, 1], False),
])
def test_the_check_before_each_call_is_one_sum_that_sees_any_difference(digests, modes, grads, equal):
    from autoshard.runtime import current
    from autoshard.runtime.agreement import _all_equal

    world = SimWorld(autoshard.Mesh(a=2, b=2), timeout=30)
    got = world.run(lambda r: _all_equal(current(), digests[r], bool(modes[r]), bool(grads[r])))
    assert got == [equal] * 4
