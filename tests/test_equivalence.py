"""Sharded loss and every gradient equal the single-device ones (simulator; fp32, rtol 1e-4)."""

from __future__ import annotations

import pytest
import torch

import autoshard
from autoshard.compiler.plan import loss_of
from examples import models

MESHES = {"data2": dict(data=2), "model2": dict(model=2), "data2xmodel2": dict(data=2, model=2)}


def reference(model, args, kwargs):
    model.zero_grad(set_to_none=True)
    loss = loss_of(model(*args, **kwargs))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False) if p.grad is not None}
    return loss.detach(), grads


def assert_simulated_equals_one_device(model, args, kwargs, plan, rtol: float = 1e-5, atol: float = 1e-6):
    """Every rank's loss and every assembled gradient of ``plan`` on the simulator equal ``model`` on one device;
    every parameter the plan uses gets one. Returns the simulation."""
    ref_loss, ref_grads = reference(model, args, kwargs)
    sim = plan.simulate(args, kwargs)
    for out in sim.outputs:
        torch.testing.assert_close(loss_of(out).detach(), ref_loss, rtol=rtol, atol=atol)
    assert set(sim.grads) == set(plan.param_specs()) & set(ref_grads)
    for fqn, g in sim.grads.items():
        torch.testing.assert_close(g, ref_grads[fqn], rtol=rtol, atol=atol, msg=lambda m, f=fqn: f"grad {f}: {m}")
    return sim


def check(name: str, mesh_axes: dict, megatron: bool, planner: str = "greedy", profile: str = "cpu-gloo",
          **factory_kwargs):
    model, args, kwargs = models.FACTORIES[name](**factory_kwargs)
    mesh = autoshard.Mesh(**mesh_axes)
    ann = models.megatron(mesh, name) if megatron else None
    plan = autoshard.compile(model, mesh, args, kwargs, annotations=ann, planner=planner, profile=profile).plan
    ref_loss, ref_grads = reference(model, args, kwargs)
    sim = plan.simulate(args, kwargs)
    for rank, out in enumerate(sim.outputs):
        torch.testing.assert_close(loss_of(out).detach(), ref_loss, rtol=1e-4, atol=1e-6,
                                   msg=lambda m: f"loss on rank {rank}: {m}")
    assert sim.grads, "no gradients came back"
    for fqn, g in sim.grads.items():
        torch.testing.assert_close(g, ref_grads[fqn], rtol=1e-4, atol=1e-5, msg=lambda m: f"grad {fqn}: {m}")
    # every parameter the graph uses has a gradient
    assert set(sim.grads) == set(plan.param_specs()) & set(ref_grads)
    return plan, sim


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("megatron", [True, False], ids=["megatron", "inputs-only"])
@pytest.mark.parametrize("name", ["mlp", "gpt", "hf_gpt2", "hf_llama"])
def test_equivalence(name, mesh, megatron):
    check(name, MESHES[mesh], megatron)


@pytest.mark.parametrize("profile", ["gpu-8x-nvlink"])
@pytest.mark.parametrize("name", ["mlp", "gpt", "hf_gpt2", "hf_llama"])
def test_searched_plans_are_exact(name, profile):
    """Whatever the search picks (often unusual layouts on tiny models), the numbers stay right."""
    check(name, MESHES["data2xmodel2"], False, planner="search", profile=profile)


class _ChunkFeedsColumnParallel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x):
        u, v = self.a(x).chunk(2, -1)
        return (self.b(u) * v.sum(-1, keepdim=True)).square().mean()


def test_gradient_through_getitem_of_a_multi_output_op():
    """A chunk's pieces require grad too: the backward all-reduce in front of a column-parallel linear stays."""
    torch.manual_seed(0)
    model, x = _ChunkFeedsColumnParallel(), torch.randn(4, 8)
    mesh = autoshard.Mesh(model=2)
    plan = autoshard.compile(model, mesh, (x,), annotations={"b.weight": ("S(0)",), "b.bias": ("S(0)",)}).plan
    ref_loss, ref_grads = reference(model, (x,), {})
    sim = plan.simulate((x,))
    torch.testing.assert_close(loss_of(sim.outputs[0]).detach(), ref_loss, rtol=1e-5, atol=1e-6)
    for fqn, g in sim.grads.items():
        torch.testing.assert_close(g, ref_grads[fqn], rtol=1e-4, atol=1e-6, msg=lambda m: f"{fqn}: {m}")
