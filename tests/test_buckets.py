"""Bucketed, overlapped gradient sync (autoshard.runtime.buckets) gives exactly the unbucketed gradients."""

from __future__ import annotations

import pytest
import torch

import autoshard
from autoshard.runtime.parameters import local_of
from autoshard.errors import AutoshardError
from autoshard.compiler.plan import loss_of
from autoshard.runtime import DistCommunicator, SimWorld, collective_counts, current, spawn
from autoshard.runtime.buckets import GRAD_SYNC, GradBucketer
from examples import models


def _gpt_plan(mesh, layers=2):
    model, args, kwargs = models.gpt(layers=layers)
    return autoshard.compile(model, mesh, args, kwargs, annotations=models.megatron(mesh, "gpt")).plan, args, kwargs


def _run(plan, args, kwargs, cap, steps=2):
    """Every rank: ``steps`` backward passes without zero_grad (so accumulation is covered); grads and log."""

    def body(rank):
        module = plan.rank_program(rank, bucket_grads=cap is not None)
        bucketer = GradBucketer(module, bucket_cap_mb=cap) if cap is not None else None
        a, k = plan.shard_inputs(rank, args, kwargs)
        for _ in range(steps):
            loss_of(module(*a, **k)).backward()
        return {n: p.grad.clone() for n, p in module.named_parameters()}, list(current().log), bucketer

    return SimWorld(plan.mesh).run(body)


@pytest.fixture(scope="module")
def gpt_case():
    plan, args, kwargs = _gpt_plan(autoshard.Mesh(data=2, model=2))
    return plan, args, kwargs, _run(plan, args, kwargs, None)


@pytest.mark.parametrize("cap", [25.0, 0.01])
def test_bucketed_gradients_equal_unbucketed_exactly(gpt_case, cap):
    plan, args, kwargs, ref = gpt_case
    got = _run(plan, args, kwargs, cap)
    for rank in range(4):
        assert ref[rank][0].keys() == got[rank][0].keys()
        for name, g in ref[rank][0].items():
            assert torch.equal(g, got[rank][0][name]), (rank, name)
        # the parameters' syncs leave the program: one backward all-reduce per bucket and axis instead
        buckets = got[rank][2].buckets
        per_step = sum(len(b.axes) for b in buckets)
        ref_bwd = collective_counts(ref[rank][1], "backward")
        got_bwd = collective_counts(got[rank][1], "backward")
        ref_data = ref_bwd[("all_reduce", "data")]
        # 2 steps; 36 syncs over `data` leave the program: 35 parameters (row-parallel biases need no `model`
        # sync: their gradient passes straight through on every rank) and the position embedding's lookup, whose
        # activation-gradient sync becomes its parameter's
        assert len(got[rank][2].params) == 36
        assert got_bwd[("all_reduce", "data")] == ref_data - 2 * 36 + 2 * len(buckets)
        assert sum(got_bwd.values()) == sum(ref_bwd.values()) - 2 * 36 + 2 * per_step
    if cap == 25.0:
        assert len(got[0][2].buckets) == 1  # one axis set: ('data',)


def test_pure_data_parallel_is_one_fused_all_reduce():
    model, args, kwargs = models.mlp()
    plan = autoshard.compile(model, autoshard.Mesh(data=2), args, kwargs).plan
    ref, got = _run(plan, args, kwargs, None, steps=1), _run(plan, args, kwargs, 25.0, steps=1)
    for rank in range(2):
        for name, g in ref[rank][0].items():
            assert torch.equal(g, got[rank][0][name])
        assert collective_counts(ref[rank][1], "backward") == {("all_reduce", "data"): 4}
        assert collective_counts(got[rank][1], "backward") == {("all_reduce", "data"): 1}


@pytest.mark.parametrize("cap", [None, 25.0, 0.3])
def test_buckets_are_cut_as_ddp_cuts_them(cap):
    """DDP's rule (torch 2.13): a 1 MiB first bucket only when the cap is left at its default; the same cuts as
    DDP's own ``_compute_bucket_assignment_by_size`` over the parameters in gradient-ready order."""
    model, args, kwargs = models.mlp(hidden=512)  # fc weights of 2 MiB each
    plan = autoshard.compile(model, autoshard.Mesh(data=2), args, kwargs).plan

    def body(rank):
        module = plan.rank_program(rank, bucket_grads=True)
        bucketer = GradBucketer(module) if cap is None else GradBucketer(module, bucket_cap_mb=cap)
        return [b.names for b in bucketer.buckets], bucketer.params

    cuts, params = SimWorld(plan.mesh).run(body)[0]
    names = list(params)  # gradient-ready order: reverse graph order
    limits = [2**20, 25 * 2**20] if cap is None else [int(cap * 2**20)]
    ddp, _ = torch.distributed._compute_bucket_assignment_by_size([params[n] for n in names], limits, [False] * 4)
    assert cuts == [[names[i] for i in bucket] for bucket in ddp]
    assert len(cuts) == {None: 2, 25.0: 1, 0.3: 2}[cap]


def test_codegen_lists_only_parameters_whose_sync_it_dropped():
    plan, _, _ = _gpt_plan(autoshard.Mesh(data=2, model=2), layers=1)
    module = plan.rank_program(0, bucket_grads=True)
    syncs = dict(module.meta[GRAD_SYNC])
    assert syncs["blocks.0.attn.q.weight"] == ("data",)
    assert syncs["blocks.0.attn.out.bias"] == ("data",)  # no `model` sync: its gradient passes straight through
    code = module.code
    assert "grad_all_reduce.default(blocks_0_attn_q_weight" not in code
    assert "linears_grad_all_reduce.default(layer_norm" in code  # activation syncs (Megatron's f) stay
    assert GRAD_SYNC not in plan.rank_program(0).meta


def test_bucketer_needs_a_sync_list():
    plan, _, _ = _gpt_plan(autoshard.Mesh(model=2), layers=1)
    world = SimWorld(autoshard.Mesh(model=2))
    with pytest.raises(AutoshardError, match="bucket_grads=True"):
        world.run(lambda r: GradBucketer(plan.rank_program(r)))
    with pytest.raises(AutoshardError, match="bucket_cap_mb is 0"):
        world.run(lambda r: GradBucketer(plan.rank_program(r, bucket_grads=True), bucket_cap_mb=0))


MESH = {"data": 2, "model": 2}


def _gloo_worker(rank, world_size):
    comm = DistCommunicator(autoshard.Mesh(**MESH), timeout=60)
    out = {}
    for cap in (0, 25, 0.01):
        model, args, kwargs = models.gpt(layers=1)
        mesh = autoshard.Mesh(**MESH)
        sm = autoshard.compile(
            model, mesh, args, kwargs, annotations=models.megatron(mesh, "gpt"), comm=comm, bucket_cap_mb=cap
        )
        a = tuple(autoshard.data_shard(x, mesh, rank) for x in args)
        comm.log.clear()
        for _ in range(2):
            sm(*a).backward()
        out[cap] = (
            {n: local_of(p.grad).clone() for n, p in sm.named_parameters()},
            collective_counts(comm.log, "backward"),
            sm.bucketer is not None,
        )
    return out


@pytest.mark.gloo
def test_sharded_module_buckets_by_default_on_gloo_and_equals_unbucketed():
    results = spawn(_gloo_worker, 4, timeout=120, start_method="forkserver")
    for rank in range(4):
        ref, ref_counts, ref_bucketed = results[rank][0]
        assert not ref_bucketed
        for cap in (25, 0.01):
            got, counts, bucketed = results[rank][cap]
            assert bucketed
            for name, g in ref.items():
                torch.testing.assert_close(
                    got[name], g, rtol=1e-6, atol=1e-7, msg=lambda m, c=cap, n=name: f"{c} {n}: {m}"
                )
            assert sum(counts.values()) < sum(ref_counts.values())


def test_bucket_buffer_is_reused_only_when_nothing_else_holds_it():
    model, args, kwargs = models.mlp()
    plan = autoshard.compile(model, autoshard.Mesh(data=2), args, kwargs).plan

    def body(rank):
        module = plan.rank_program(rank, bucket_grads=True)
        GradBucketer(module)
        a, k = plan.shard_inputs(rank, args, kwargs)
        p = next(module.parameters())
        loss_of(module(*a, **k)).backward()
        first = p.grad.untyped_storage().data_ptr()
        kept = p.grad  # the user still holds last step's gradient: its buffer must not be overwritten
        kept_value = kept.clone()
        for q in module.parameters():
            q.grad = None
        loss_of(module(*a, **k)).backward()
        second = p.grad.untyped_storage().data_ptr()
        held_intact = torch.equal(kept, kept_value)
        del kept
        for q in module.parameters():
            q.grad = None  # now nothing holds the second buffer: the third backward reuses it
        loss_of(module(*a, **k)).backward()
        third = p.grad.untyped_storage().data_ptr()
        return first != second, held_intact, second == third, p.grad.clone()

    got = SimWorld(plan.mesh).run(body)
    ref = _run(plan, args, kwargs, None, steps=1)
    for rank, (fresh, intact, reused, grad) in enumerate(got):
        assert fresh and intact and reused
        assert torch.equal(grad, next(iter(ref[rank][0].values())))


def test_autograd_stores_each_gradient_in_its_bucket_without_a_copy():
    """The hook hands autograd an alias of the bucket slice: the .grad autograd stores during backward is the
    bucket's memory (each gradient held once, as with DDP's gradient_as_bucket_view), not a second copy."""
    model, args, kwargs = models.gpt(layers=1)
    plan = autoshard.compile(model, autoshard.Mesh(data=2), args, kwargs).plan

    def body(rank):
        module = plan.rank_program(rank, bucket_grads=True)
        bucketer = GradBucketer(module)
        stored = {}
        for name, p in bucketer.params.items():
            p.register_post_accumulate_grad_hook(
                lambda q, n=name: stored.__setitem__(n, q.grad.untyped_storage().data_ptr())
            )
        a, k = plan.shard_inputs(rank, args, kwargs)
        loss_of(module(*a, **k)).backward()
        buffers = {b.spare.untyped_storage().data_ptr() for b in bucketer.buckets}
        return stored, buffers, set(bucketer.params)

    for stored, buffers, names in SimWorld(plan.mesh).run(body):
        assert set(stored) == names
        assert set(stored.values()) <= buffers
