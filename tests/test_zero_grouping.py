"""Grouped ZeRO-3 gathers (passes/group_gathers.py, runtime/zero.py's ``all_gather_reshard_group``).

The grouped program equals one device (loss and every gradient) on GPT and HF Llama, data=2 and data=2 x model=2
(simulator), also with recomputed blocks; it issues fewer collectives than the per-parameter program for the same
bytes; gathered copies are
still freed after forward and gathered again, per group, in backward; the op itself equals per-tensor gathers for
mixed dtypes, dims and gradient axes."""

from __future__ import annotations

import copy
import itertools
from collections import Counter

import pytest
import torch
from autoshard.passes.group_gathers import GroupGathers, layer_of

import autoshard
from autoshard.compiler.collective_kinds import kind_of
from autoshard.runtime import SimWorld
from autoshard.runtime import zero as zero_runtime
from autoshard.runtime.communicator import current
from examples import models
from tests.test_equivalence import assert_simulated_equals_one_device
from tests.test_zero import run_resharded

MESHES = {"data=2": {"data": 2}, "data=2 x model=2": {"data": 2, "model": 2}}


def _plan(name, mesh_axes, layers=2):
    model, args, kwargs = models.FACTORIES[name](layers=layers)
    mesh = autoshard.Mesh(**mesh_axes)
    ann = models.megatron(mesh, name) if "model" in mesh_axes else None
    plan = autoshard.compile(copy.deepcopy(model), mesh, args, kwargs, annotations=ann, zero=3).plan
    return model, args, kwargs, plan


def _kinds(module) -> Counter:
    return Counter(kind_of(n).name for n in module.graph.nodes if kind_of(n) is not None)


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("name", ["gpt", "hf_llama"])
def test_grouped_program_equals_one_device(name, mesh):
    model, args, kwargs, plan = _plan(name, MESHES[mesh])
    module = plan.rank_program(0)
    assert _kinds(module)["all_gather_reshard_group"] == 3  # the root (embeddings, final norm, head) and 2 layers
    groups = [n for n in module.graph.nodes if kind_of(n) is not None and kind_of(n).name == "all_gather_reshard_group"]
    assert [len(g.args[5]) > 0 for g in groups] == [True, True, False]  # each starts the next one's gather
    assert all(list(a.args[5]) == list(b.args[0]) for a, b in itertools.pairwise(groups))
    assert_simulated_equals_one_device(model, args, kwargs, plan)


def test_grouped_gathers_compose_with_recomputed_blocks():
    model, args, kwargs = models.gpt(layers=2)
    mesh = autoshard.Mesh(**MESHES["data=2 x model=2"])
    plan = autoshard.compile(copy.deepcopy(model), mesh, args, kwargs, annotations=models.megatron(mesh, "gpt"), zero=3,
                             recompute="blocks.*").plan
    assert _kinds(plan.rank_program(0))["all_gather_reshard_group"] == 3
    assert_simulated_equals_one_device(model, args, kwargs, plan)


@pytest.mark.parametrize("mesh", MESHES)
def test_grouping_drops_the_collectives_and_moves_the_same_bytes(monkeypatch, mesh):
    _, args, kwargs, grouped = _plan("gpt", MESHES[mesh])
    sims = {"grouped": grouped.simulate(args, kwargs)}
    monkeypatch.setattr(GroupGathers, "run", lambda self, gm, ctx: gm)  # the program before the pass
    _, _, _, single = _plan("gpt", MESHES[mesh])
    assert _kinds(single.rank_program(0))["all_gather_reshard_group"] == 0
    sims["single"] = single.simulate(args, kwargs)
    logs = {k: s.logs[0] for k, s in sims.items()}

    def nbytes(log, kind, phase):
        return sum(r.nbytes for r in log if r.kind == kind and r.phase == phase and r.axis == "data")

    def count(log, kind):
        return sum(r.kind == kind and r.axis == "data" for r in log)

    for kind in ("all_gather", "reduce_scatter"):
        assert count(logs["grouped"], kind) * 4 <= count(logs["single"], kind), kind
    assert nbytes(logs["grouped"], "all_gather", "forward") == nbytes(logs["single"], "all_gather", "forward")
    assert nbytes(logs["grouped"], "reduce_scatter", "backward") == nbytes(logs["single"], "reduce_scatter",
                                                                           "backward")
    # backward re-gathers whole groups: also the members autograd saved nothing of (biases), a few bytes more
    regather = [nbytes(logs[k], "all_gather", "backward") for k in ("grouped", "single")]
    assert regather[1] <= regather[0] <= 1.1 * regather[1]
    for fqn, g in sims["single"].grads.items():
        torch.testing.assert_close(sims["grouped"].grads[fqn], g, rtol=1e-6, atol=1e-7)


def test_group_copies_are_freed_after_forward_and_gathered_again_once_per_group_in_backward():
    _, args, kwargs, plan = _plan("gpt", MESHES["data=2"])
    world = SimWorld(plan.mesh)

    def body(rank):
        session, alive, regathers = run_resharded(plan.rank_program(rank), *plan.shard_inputs(rank, args, kwargs))
        return alive, sum(isinstance(g, zero_runtime._GroupMember) for g in session.values()), len(regathers)

    for alive, members, regathers in world.run(body):
        assert members >= 30 and alive == 0, (members, alive)
        assert 1 <= regathers <= 4  # the 3 groups (and the lone position embedding's gather, if autograd saved it)


@pytest.mark.parametrize("mesh_axes, axes", [({"data": 2}, ["data"]), ({"data": 2}, []),
                                             ({"data": 2, "model": 2}, ["model", "data"]),
                                             ({"data": 2, "model": 2}, ["data", "model"])])
def test_the_group_op_equals_one_gather_per_tensor(mesh_axes, axes):
    """Shards of two dtypes, gathered along dims 0, 1 and 0; gradients summed over ``axes``: the group op's values
    and gradients equal ``all_gather_reshard``'s per tensor (the ops the pass replaces)."""
    mesh = autoshard.Mesh(**mesh_axes)
    world = SimWorld(mesh)
    shapes, dims, dtypes = [(3, 4), (2, 6), (5,)], [0, 1, 0], [torch.float32, torch.float64, torch.float32]

    def body(rank):
        g = torch.Generator().manual_seed(rank)
        shards = [torch.randn(s, generator=g, dtype=dt) for s, dt in zip(shapes, dtypes)]
        upstream = [torch.randn(*(s[:d] + (2 * s[d],) + s[d + 1:]), generator=g, dtype=dt)
                    for s, d, dt in zip(shapes, dims, dtypes)]
        results = []
        for grouped in (True, False):
            xs = [s.clone().requires_grad_() for s in shards]
            if grouped:
                outs = torch.ops.autoshard.all_gather_reshard_group(xs, "data", dims, 2, axes, [])
            else:
                outs = [torch.ops.autoshard.all_gather_reshard(x, "data", d, 2, axes) for x, d in zip(xs, dims)]
            sum((o * u).sum() for o, u in zip(outs, upstream)).backward()
            results.append(([o.detach() for o in outs], [x.grad for x in xs]))
        n = len(current().log)
        return results, n

    for (grouped, single), _ in world.run(body):
        for a, b in zip(grouped[0] + grouped[1], single[0] + single[1]):
            assert a.dtype == b.dtype and a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_a_prefetched_gather_is_used_unless_its_shards_changed_since():
    """Group A starts group B's gather; B's op waits on it — or, when B's shards were written in between (an
    optimizer step), completes it, drops it and gathers the new values."""
    world = SimWorld(autoshard.Mesh(data=2))

    def body(rank):
        a = [torch.full((2, 3), 1.0 + rank)]
        b = [torch.full((2,), 10.0 + rank), torch.full((1, 2), 20.0 + rank)]
        op = torch.ops.autoshard.all_gather_reshard_group
        out = []
        for write in (False, True):
            op(a, "data", [0], 2, ["data"], b)
            if write:
                with torch.no_grad():
                    b[0].add_(100.0)
            out.append(op(b, "data", [0, 1], 2, ["data"], []))
        return out, len(current().log)

    results = world.run(body)
    for (fresh, stale), n in results:
        torch.testing.assert_close(fresh[0], torch.tensor([10.0, 10.0, 11.0, 11.0]))
        torch.testing.assert_close(fresh[1], torch.tensor([[20.0, 20.0, 21.0, 21.0]]))
        torch.testing.assert_close(stale[0], torch.tensor([110.0, 110.0, 111.0, 111.0]))
        assert n == 5  # A, B's prefetch (used); A, B's prefetch (dropped), B again


def test_layer_of():
    assert layer_of("blocks.3.attn.q.weight") == "blocks.3"
    assert layer_of("model.layers.0.mlp.up_proj.weight") == "model.layers.0"
    assert layer_of("wte.weight") == layer_of("lm_head.weight") == ""
    assert layer_of("mlp.2.weight") == "mlp.2"
