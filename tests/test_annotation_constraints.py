"""Annotations are hard constraints under both planners: an annotated parameter is computed with in the layout the
user gave it, never all-gathered (or all-to-all'ed) into another one, and the numbers stay those of one device."""

from __future__ import annotations

import pytest
import torch

import autoshard
from autoshard import meta as M
from autoshard.errors import PlanError
from autoshard.frontend.graph_utils import tensor_inputs
from autoshard.compiler.plan import loss_of
from examples import models

ANNOTATED = "fc2.weight"
SPEC = (autoshard.Shard(1),)  # row-parallel fc2
GATHERS = ("all_gather", "all_to_all")


def _compile(planner: str, plan=None, **kwargs):
    model, args, kw = models.mlp()
    compiled = autoshard.compile(model, autoshard.Mesh(model=2), args, kw,
                                 annotations=plan if plan is not None else {ANNOTATED: SPEC}, planner=planner, **kwargs)
    return model, args, kw, compiled.plan


def _derived_only_from(gm, param: str) -> set:
    """The annotated parameter's get_attr node and every value computed from it alone."""
    out = set()
    for n in gm.graph.nodes:
        if n.op == "get_attr" and n.meta.get(M.PARAM) == param:
            out.add(n)
        elif n.op == "call_function" and n.all_input_nodes and all(x in out for x in n.all_input_nodes):
            out.add(n)
    return out


@pytest.mark.parametrize("planner", ["greedy", "search"])
def test_annotated_parameter_is_never_gathered(planner):
    _, _, _, plan = _compile(planner)
    gm = plan.graph_module
    assert plan.param_specs()[ANNOTATED] == SPEC
    pinned = _derived_only_from(gm, ANNOTATED)
    assert pinned
    # (a) no gathering collective reads the parameter or a value computed only from it
    for name, info in plan.collectives():
        node = next(n for n in gm.graph.nodes if n.name == name)
        if info.kind in GATHERS:
            assert not (set(node.all_input_nodes) & pinned), (planner, name, info)
    # every consumer's strategy takes the parameter exactly as annotated
    param = next(n for n in pinned if n.op == "get_attr")
    consumers = [u for u in param.users if u.op == "call_function"]
    assert consumers
    for u in consumers:
        if M.COLLECTIVE in u.meta:  # a collective straight off the parameter: only its grad sync may be one
            assert u.meta[M.COLLECTIVE].kind not in GATHERS, (planner, u.name)
            continue
        strat = u.meta[M.STRATEGY]
        for x, want in zip(tensor_inputs(u), strat.input_specs):
            if x is param:
                assert want == SPEC, (planner, u.name, want)


@pytest.mark.parametrize("planner", ["greedy", "search"])
def test_annotated_plan_equals_one_device(planner):
    model, args, kw, plan = _compile(planner)
    # (b) the simulated loss and every gradient equal the single-device model's
    model.zero_grad(set_to_none=True)
    ref_loss = loss_of(model(*args, **kw))
    ref_loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    sim = plan.simulate(args, kw)
    for rank, out in enumerate(sim.outputs):
        torch.testing.assert_close(loss_of(out).detach(), ref_loss.detach(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{planner}: loss on rank {rank}: {m}")
    assert set(sim.grads) == set(ref)
    for fqn, g in sim.grads.items():
        torch.testing.assert_close(g, ref[fqn], rtol=1e-4, atol=1e-6, msg=lambda m: f"{planner}: grad {fqn}: {m}")


class _Transposed(torch.nn.Module):
    """A weight used through its transpose: the transpose is computed only from the parameter."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16, 8))

    def forward(self, x):
        return (x @ self.w.t()).square().mean()


@pytest.mark.parametrize("planner", ["greedy", "search"])
def test_value_computed_only_from_an_annotated_parameter_is_not_gathered(planner):
    torch.manual_seed(0)
    model, x = _Transposed(), torch.randn(4, 8)
    plan = autoshard.compile(model, autoshard.Mesh(model=2), (x,), annotations={"w": ("S(0)",)}, planner=planner).plan
    gm = plan.graph_module
    pinned = _derived_only_from(gm, "w")
    for name, info in plan.collectives():
        node = next(n for n in gm.graph.nodes if n.name == name)
        if info.kind in GATHERS:
            assert not (set(node.all_input_nodes) & pinned), (planner, name, info)
    ref = model(x)
    ref.backward()
    sim = plan.simulate((x,))
    torch.testing.assert_close(loss_of(sim.outputs[0]).detach(), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sim.grads["w"], model.w.grad, rtol=1e-4, atol=1e-6)


class _Cumsum(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 8))

    def forward(self, x):
        return (x * torch.cumsum(self.w, dim=-1)).sum()


@pytest.mark.parametrize("planner", ["greedy", "search"])
def test_impossible_annotation_names_the_parameter_and_the_op(planner):
    # a cumulative sum keeps its dim whole: no strategy takes ``w`` split along it
    torch.manual_seed(0)
    model, x = _Cumsum(), torch.randn(4, 8)
    with pytest.raises(PlanError, match=r"cumsum.*parameter `w`.*annotation 'w'.*Annotate `w` with"):
        autoshard.compile(model, autoshard.Mesh(model=2), (x,), annotations={"w": ("S(1)",)}, planner=planner)
