"""Gradient accumulation without sync (``no_sync()``, ``set_requires_gradient_sync(False)``;
autoshard/runtime/grad_sync.py): micro-batches run with sync off leave every parameter gradient unreduced on its
rank, and the next synced micro-batch reduces their sum with its own. The gradients equal syncing every micro-batch
(to the order of the float sums) and one device; the data axis then carries one reduction per parameter or bucket
per window instead of one per micro-batch, while the activation collectives of tensor parallelism (the model axis)
and ZeRO-3's re-gathers run every micro-batch as before.

Data=2 at ZeRO 0-3 and data=2 x model=2 (Megatron annotations) at ZeRO 0 and 3 in the simulator; data=2 x model=2
at ZeRO 3 on 4 gloo processes. The models are built once, outside the rank threads (which share torch's global
generator), and copied per rank.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections import Counter

import pytest
import torch
import torch.distributed as dist

import autoshard
from autoshard.compiler.plan import loss_of
from autoshard.runtime import DistCommunicator, SimWorld, spawn, use
from examples import models

_GPT, _ARGS, _ = models.gpt(layers=1)
_BATCHES = [models._ids(4, 16, 128, seed) for seed in (11, 12, 13, 14)]  # global micro-batches
_REDUCTIONS = ("all_reduce", "reduce_scatter")

# (batch index, gradient sync on) per micro-step; "pre" syncs one micro-batch before its window, so .grad is
# already there when the window starts
SCHEDULES = {
    "synced": [(0, True), (1, True), (2, True)],
    "no_sync": [(0, False), (1, False), (2, True)],
    "flag": [(0, False), (1, False), (2, True)],
    "synced4": [(3, True), (0, True), (1, True), (2, True)],
    "pre": [(3, True), (0, False), (1, False), (2, True)],
}
CASES = {
    "data2-zero0": ({"data": 2}, 0),
    "data2-zero1": ({"data": 2}, 1),
    "data2-zero2": ({"data": 2}, 2),
    "data2-zero3": ({"data": 2}, 3),
    "data2xmodel2-zero0": ({"data": 2, "model": 2}, 0),
    "data2xmodel2-zero3": ({"data": 2, "model": 2}, 3),
}


def _compile(mesh, stage, comm):
    return autoshard.compile(copy.deepcopy(_GPT), mesh, _ARGS, annotations=models.megatron(mesh, "gpt"), zero=stage,
                             comm=comm)


def _plan(mesh, stage):
    """The plan ``_compile`` makes on each rank, made once (``autoshard.plan``, the first half of ``compile``): the
    simulated ranks apply it to their copies of the model instead of planning it once each."""
    return autoshard.plan(_GPT, mesh, _ARGS, annotations=models.megatron(mesh, "gpt"), zero=stage)


def _micro_step(sharded, batch, sync: bool, how: str) -> None:
    if sync:
        loss_of(sharded(*batch)).backward()
    elif how == "flag":
        sharded.set_requires_gradient_sync(False)
        loss_of(sharded(*batch)).backward()
        sharded.set_requires_gradient_sync(True)
    else:
        with sharded.no_sync():
            loss = loss_of(sharded(*batch))
        loss.backward()  # outside the block, as DDP allows: the forward's flag decides


def _backward_collectives(records) -> Counter:
    return Counter((r.kind, r.axis, r.numel) for r in records if r.phase == "backward")


def _train(rank, comm, mesh, stage, schedules=tuple(SCHEDULES), plan=None) -> dict:
    """Each of ``schedules`` on one sharded module, gradients set to None between them: {schedule: (every
    parameter's full gradient, the backward collectives of each micro-step)}. ``plan``: ``_plan(mesh, stage)``,
    applied to this rank's copy of the model (None: compiled on this rank)."""
    sharded = _compile(mesh, stage, comm) if plan is None else autoshard.apply(copy.deepcopy(_GPT), plan, comm=comm)
    local = [sharded.plan.shard_inputs(rank, b)[0] for b in _BATCHES]
    out = {}
    for name in schedules:
        steps = SCHEDULES[name]
        for p in sharded.parameters():
            p.grad = None
        counts = []
        for i, sync in steps:
            before = len(comm.log)
            _micro_step(sharded, local[i], sync, name)
            counts.append(_backward_collectives(comm.log[before:]))
        assert sharded.require_backward_grad_sync
        out[name] = ({n: p.grad.full_tensor() for n, p in sharded.named_parameters() if p.grad is not None}, counts)
    return out


def _reference(batches) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(_GPT)
    for b in batches:
        loss_of(model(*b)).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _assert_grads(got, want, what, rtol=1e-5, atol=1e-6):
    assert set(got) == set(want), (what, set(got) ^ set(want))
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=rtol, atol=atol, msg=lambda m, n=n: f"{what} {n}: {m}")


def _data_reductions(c: Counter) -> int:
    return sum(v for (kind, axis, _), v in c.items() if axis == "data" and kind in _REDUCTIONS)


def _others(c: Counter) -> Counter:
    """Every backward collective but the data axis's reductions: the model axis's, and ZeRO-3's re-gathers."""
    return Counter({k: v for k, v in c.items() if not (k[1] == "data" and k[0] in _REDUCTIONS)})


def _check(results, stage):
    ref3, ref4 = _reference(_BATCHES[:3]), _reference([_BATCHES[3], *_BATCHES[:3]])
    for rank, res in enumerate(results):
        synced, synced_counts = res["synced"]
        _assert_grads(synced, ref3, f"rank {rank} synced every step vs one device")
        for name, ref, base in (("no_sync", ref3, "synced"), ("flag", ref3, "synced"), ("pre", ref4, "synced4")):
            if name not in res:
                continue
            grads, counts = res[name]
            base_grads, base_counts = res[base]
            _assert_grads(grads, ref, f"rank {rank} {name} vs one device")
            _assert_grads(grads, base_grads, f"rank {rank} {name} vs synced every step", atol=1e-7)
            window = range(len(counts) - 3, len(counts))
            off, last = window[:2], window[-1]
            # the synced micro-step runs exactly the collectives of any synced micro-step: one reduction per
            # parameter or bucket for the whole window
            assert counts[last] == base_counts[last], (rank, name, counts[last] - base_counts[last])
            for i in off:
                # activation collectives (model axis) and ZeRO-3's re-gathers run every micro-step
                assert _others(counts[i]) == _others(base_counts[i]), (rank, name, i)
                # parameter gradients are not reduced over the data axis; under ZeRO the position embedding's
                # sum runs on the looked-up rows (an activation), every micro-step (grad_sync.py)
                assert _data_reductions(counts[i]) == (0 if stage == 0 else 1), (rank, name, i, counts[i])
                assert _data_reductions(base_counts[i]) > _data_reductions(counts[i])
            assert sum(map(_data_reductions, counts)) < sum(map(_data_reductions, base_counts))
        if "flag" in res:  # no_sync() and the flag are the same computation
            _assert_grads(res["flag"][0], res["no_sync"][0], f"rank {rank} flag vs no_sync", rtol=0, atol=0)


@pytest.mark.parametrize("case", list(CASES))
def test_accumulating_without_sync_equals_syncing_every_micro_batch_with_fewer_reductions(case):
    axes, stage = CASES[case]
    mesh = autoshard.Mesh(**axes)
    world = SimWorld(mesh, timeout=120)
    plan = _plan(mesh, stage)
    results = world.run(lambda rank: _train(rank, world.communicator(rank), mesh, stage, plan=plan))
    _check(results, stage)


# ---- a synced backward that does not reach every parameter ----------------------------------------------------
class _TwoLosses(torch.nn.Module):
    """A trunk and two heads with a loss each: a backward of the first loss does not reach the second head."""

    def __init__(self):
        super().__init__()
        self.trunk, self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4), torch.nn.Linear(16, 4)

    def forward(self, x, y):
        h = torch.relu(self.trunk(x))
        return torch.nn.functional.mse_loss(self.a(h), y), torch.nn.functional.mse_loss(self.b(h), y)


with torch.random.fork_rng():
    torch.manual_seed(0)
    _TWO = _TwoLosses()
_TWO_BATCHES = [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g))
                for g in [torch.Generator().manual_seed(s) for s in (1, 2, 3)]]
# (batch, sync, which losses the backward runs from): the second micro-step's synced backward skips head b
_PARTIAL = [(0, False, (0, 1)), (1, True, (0,)), (2, True, (0, 1))]


def _partial_steps(model, step, batches):
    """Run ``_PARTIAL`` on ``model`` (``step(model, batch, sync, losses)``), returning the gradients after each
    synced micro-step."""
    out = []
    for i, sync, which in _PARTIAL:
        step(model, batches[i], sync, which)
        if sync:
            out.append({n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                        for n, p in model.named_parameters() if p.grad is not None})
    return out


def _partial_backward(sharded, batch, sync, which):
    with sharded.no_sync() if not sync else contextlib.nullcontext():
        losses = sharded(*batch)
    sum(losses[k] for k in which).backward()


@pytest.mark.parametrize("stage", [0, 2])
def test_a_synced_backward_that_misses_a_held_gradient_reduces_it_then_or_with_the_next_that_reaches_it(stage):
    """Buckets reduce a held gradient with any synced backward (it joins its bucket alone); a ZeRO op holds it until
    a synced backward runs through the op again, and the one that does not warns."""
    mesh = autoshard.Mesh(data=2)
    world = SimWorld(mesh, timeout=60)

    def body(rank):
        comm = world.communicator(rank)
        sharded = autoshard.compile(copy.deepcopy(_TWO), mesh, _TWO_BATCHES[0], zero=stage, comm=comm)
        local = [sharded.plan.shard_inputs(rank, b)[0] for b in _TWO_BATCHES]
        counts = []

        def step(*a):
            before = len(comm.log)
            _partial_backward(*a)
            counts.append(_data_reductions(_backward_collectives(comm.log[before:])))

        return _partial_steps(sharded, step, local), counts

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = world.run(body)
    ref = _partial_steps(copy.deepcopy(_TWO), lambda m, b, sync, which: sum(m(*b)[k] for k in which).backward(),
                         _TWO_BATCHES)
    held = [w for w in caught if "did not reach" in str(w.message)]
    for (after_second, after_third), counts in results:
        assert counts[0] == 0 and counts[1] > 0 and counts[2] > 0, counts  # nothing reduced without sync
        _assert_grads(after_third, ref[1], f"zero={stage} after the third micro-step")
        if stage == 0:
            _assert_grads(after_second, ref[0], "zero=0 after the second micro-step")
        else:  # head b's held gradient waits for the third (.grad: None, as the unsynced backward left it)
            assert "b.weight" not in after_second and "b.bias" not in after_second, sorted(after_second)
            _assert_grads({n: g for n, g in after_second.items() if not n.startswith("b.")},
                          {n: g for n, g in ref[0].items() if not n.startswith("b.")}, "zero=2 after the second")
    assert len(held) == (0 if stage == 0 else 2), [str(w.message) for w in caught]


# ---- real processes ------------------------------------------------------------------------------------------
def _gloo_worker(rank, world_size):
    mesh = autoshard.Mesh(data=2, model=2)
    comm = DistCommunicator(mesh, timeout=60)
    with use(comm):
        return _train(rank, comm, mesh, 3, ("synced", "no_sync"))


@pytest.mark.gloo
@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo")
def test_no_sync_on_four_gloo_processes_equals_syncing_every_micro_batch():
    results = spawn(_gloo_worker, 4, timeout=120, start_method="forkserver")
    _check(results, 3)
