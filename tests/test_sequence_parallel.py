"""Sequence parallelism (Megatron-SP): norms and residuals sharded along the sequence on the model axis.

``sequence_parallel=True`` makes the greedy planner prefer sharded activations at equal communication; with the
block's input sharded along the sequence, every all-reduce of the Megatron plan becomes a reduce-scatter (into
the residual) and an all-gather (before the column-parallel linear), whose backward codegen fuses into a
reduce-scatter (``torch.ops.autoshard.all_gather_sync``). Checked: loss and gradients equal one device,
the collectives and their bytes on the wire equal Megatron's, activation memory per rank goes down (measured:
bytes autograd saves for backward on each rank, and the cost model's memory per rank).
"""

from __future__ import annotations

import pytest
import torch

import autoshard
from autoshard.compiler.plan import loss_of
from autoshard.runtime import SimWorld, collective_counts
from examples import models
from tests.test_equivalence import reference

B, S, H, HEADS = 2, 8, 32, 4


class BlockLoss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.block = models.Block(H, HEADS)

    def forward(self, x):
        return self.block(x).pow(2).mean()


ANN = {k.replace("blocks.*.", "block."): (v,) for k, v in models.MEGATRON["gpt"].items() if k.startswith("blocks")}


def _x():
    return torch.randn(B, S, H, generator=torch.Generator().manual_seed(1))


def _plans():
    model, x = BlockLoss(), _x()
    mesh = autoshard.Mesh(model=2)
    megatron = autoshard.compile(model, mesh, (x,), annotations=ANN).plan
    sp = autoshard.compile(model, mesh, (x,), annotations={**ANN, "x": ("S(1)",)}, sequence_parallel=True).plan
    return model, x, megatron, sp


@pytest.fixture(scope="module")
def plans():
    return _plans()


def _wire_bytes(log, n=2) -> float:
    """Bytes each rank sends by ring algorithms: all-reduce 2(n-1)/n·in, reduce-scatter (n-1)/n·in,
    all-gather (n-1)·in (its input is the shard)."""
    factor = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_gather": n - 1}
    return sum(factor[r.kind] * r.nbytes for r in log if r.kind in factor)


def test_sequence_parallel_block_equals_single_device(plans):
    model, x, _, sp = plans
    ref_loss, ref_grads = reference(model, (x,), {})
    sim = sp.simulate((x,))
    for out in sim.outputs:
        torch.testing.assert_close(loss_of(out), ref_loss, rtol=1e-5, atol=1e-6)
    assert ref_grads.keys() <= sim.grads.keys()
    for name, g in ref_grads.items():
        torch.testing.assert_close(sim.grads[name], g, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_sequence_parallel_replaces_each_all_reduce_by_reduce_scatter_and_all_gather(plans):
    _, x, megatron, sp = plans
    bsh = B * S * H
    code = sp.code(0)
    assert code.count("layer_norm.default(") == 2 and "autoshard.all_gather_sync.default(layer_norm" in code
    meg_log, sp_log = megatron.simulate((x,)).logs[0], sp.simulate((x,)).logs[0]
    act = [r for r in sp_log if r.numel in (bsh, bsh // 2)]
    assert collective_counts(act, "forward") == {("reduce_scatter", "model"): 2, ("all_gather", "model"): 2}
    assert collective_counts(act, "backward") == {("reduce_scatter", "model"): 2, ("all_gather", "model"): 2}
    meg_act = [r for r in meg_log if r.numel == bsh]
    assert collective_counts(meg_act) == {("all_reduce", "model"): 4}
    assert _wire_bytes(act) == _wire_bytes(meg_act)  # the same bytes on the wire as Megatron


def _saved_bytes(plan, x) -> list[int]:
    """Per rank: bytes of the distinct tensors autograd saves for backward (activation memory)."""

    def body(rank):
        module = plan.rank_program(rank)
        (a,), _ = plan.shard_inputs(rank, (x,))
        seen: dict[int, int] = {}
        params = {p.data_ptr() for p in module.parameters()}

        def pack(t):
            if t.data_ptr() not in params:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = loss_of(module(a))
        loss.backward()
        return sum(seen.values())

    return SimWorld(plan.mesh).run(body)


def test_sequence_parallel_reduces_activation_memory_per_rank(plans):
    _, x, megatron, sp = plans
    meg, seq = _saved_bytes(megatron, x), _saved_bytes(sp, x)
    bsh_bytes = B * S * H * 4
    for m, s in zip(meg, seq):
        # norms and residuals keep half the sequence: at least the two layer norms' inputs are halved
        assert s <= m - bsh_bytes, (m, s)
    # the estimate agrees: fewer activation bytes (the step's peak here is the optimizer step, which SP leaves alone)
    assert sp.cost().memory.activations < megatron.cost().memory.activations
    assert sp.cost().memory.end_of_forward < megatron.cost().memory.end_of_forward


def test_sequence_parallel_gpt_on_data_and_model_axes_equals_single_device():
    model, args, kwargs = models.gpt(layers=2)
    mesh = autoshard.Mesh(data=2, model=2)
    plan = autoshard.compile(model, mesh, args, kwargs, annotations=models.megatron(mesh, "gpt"),
                             sequence_parallel=True).plan
    assert "reduce_scatter" in plan.code(0)
    ref_loss, ref_grads = reference(model, args, kwargs)
    sim = plan.simulate(args, kwargs)
    for out in sim.outputs:
        torch.testing.assert_close(loss_of(out), ref_loss, rtol=1e-5, atol=1e-6)
    for name, g in ref_grads.items():
        if name in sim.grads:
            torch.testing.assert_close(sim.grads[name], g, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_search_shards_norms_along_the_sequence_when_activation_memory_binds():
    from autoshard import meta as M
    from autoshard.placements import Shard

    # GPU-sized activations (at the tiny shapes above latency dominates and the search shards the hidden dim)
    torch.manual_seed(0)
    block = models.Block(256, 8)

    class Big(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block = block

        def forward(self, x):
            return self.block(x).pow(2).mean()

    model, x, mesh, profile = Big(), torch.randn(8, 128, 256), autoshard.Mesh(model=2), "gpu-8x-nvlink"
    ann = {**ANN, "x": ("S(1)",)}
    megatron = autoshard.compile(model, mesh, (x,), annotations=ANN).plan
    sp = autoshard.compile(model, mesh, (x,), annotations=ann, sequence_parallel=True).plan
    assert sp.cost(profile).memory.activations < megatron.cost(profile).memory.activations
    # a limit just above the least memory any plan needs (the search's own memory model says how much that is)
    with pytest.raises(autoshard.PlanError) as least:
        autoshard.compile(model, mesh, (x,), annotations=ann, planner="search", profile=profile, memory_limit=1)
    limit = least.value.least_memory * 1.01
    searched = autoshard.compile(
        model, mesh, (x,), annotations=ann, planner="search", profile=profile, memory_limit=limit
    ).plan
    assert searched.context.report["plan_search"]["memory_per_rank"] <= limit
    assert searched.cost(profile).memory_per_rank <= limit
    norms = [n for n in searched.graph_module.graph.nodes if n.op == "call_function" and "layer_norm" in str(n.target)]
    assert any(n.meta[M.SPEC][0] == Shard(1) for n in norms)  # a norm runs on half the sequence
    ref_loss, ref_grads = reference(model, (x,), {})
    sim = searched.simulate((x,))
    torch.testing.assert_close(loss_of(sim.outputs[0]), ref_loss, rtol=1e-5, atol=1e-6)
    for name, g in ref_grads.items():
        torch.testing.assert_close(sim.grads[name], g, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
