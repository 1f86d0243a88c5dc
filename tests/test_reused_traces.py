"""One trace per model and inputs while a call plans it many times (``autoshard.compiler.plan.reused_traces``):
``plan_cluster``'s candidate meshes and the search's re-plans plan copies of one trace (``traced_copy``). A plan
made from a copy is the plan made from a fresh trace — graph, every rank's code, layouts, step time and memory —
and planning a copy leaves the kept trace as it was traced."""

from __future__ import annotations

import warnings

import pytest
import torch

import autoshard.compiler.plan as plan_module
from autoshard.api.sharded_module import make_options
from autoshard.compiler.plan import build_plan, reused_traces
from autoshard.frontend.precision import MixedPrecision
from autoshard.mesh import Mesh
from examples import models


def _plan(model, args, kwargs, mesh, **options):
    opts = make_options(None, "data", "replicate", mesh, planner="search", **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_plan(model, mesh, args, kwargs or {}, opts)


def _what(plan) -> tuple:
    cost = plan.cost()
    return (str(plan.graph_module.graph), [plan.code(r) for r in range(plan.mesh.size)],
            sorted(plan.layout().items()), cost.step_time, cost.memory_per_rank)


def _snapshot(gm: torch.fx.GraphModule) -> tuple:
    nodes = [(n.name, n.op, str(n.target), repr(n.args), sorted(map(str, n.meta))) for n in gm.graph.nodes]
    tensors = [(k, id(t), t.requires_grad, t.dtype) for k, t in
               [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]]
    return nodes, sorted(map(str, gm.meta)), tensors


@pytest.mark.parametrize("name, options", [
    ("gpt", {}),
    ("gpt", {"zero": 3, "recompute": "blocks.*"}),
    ("gpt", {"precision": MixedPrecision(param_dtype=torch.bfloat16), "zero": "auto"}),
], ids=["gpt", "gpt-zero3-recompute", "gpt-bf16"])
def test_plans_of_one_trace_equal_plans_of_fresh_traces(name, options):
    model, args, kwargs = models.FACTORIES[name](layers=2)
    meshes = (Mesh(data=2, model=2), Mesh(data=4))
    fresh = [_what(_plan(model, args, kwargs, mesh, **options)) for mesh in meshes]
    with reused_traces():
        reused = [_what(_plan(model, args, kwargs, mesh, **options)) for mesh in meshes * 2]
        kept = plan_module._TRACES.get()
        assert len(kept) == 1, "one trace for one model and inputs"
        (_, traced), = kept.values()
        before = _snapshot(traced)
        _plan(model, args, kwargs, meshes[0], **options)
        assert _snapshot(traced) == before, "planning a copy changed the kept trace"
    assert reused == fresh * 2
    assert plan_module._TRACES.get() is None


def test_other_inputs_or_mode_are_traced_again():
    model, args, kwargs = models.FACTORIES["gpt"](layers=1)
    mesh = Mesh(data=2)
    with reused_traces():
        _plan(model, args, kwargs, mesh)
        _plan(model, tuple(a[:2] for a in args), kwargs, mesh)  # another batch
        model.eval()
        _plan(model, args, kwargs, mesh)
        assert len(plan_module._TRACES.get()) == 3


def test_a_copy_has_every_tensor_of_the_trace_as_it_is_there():
    """HF Llama's trace holds a buffer no node reads and a non-persistent one (the rotary ``inv_freq``): the copy has
    every parameter and buffer at the same name, the same tensor, persistent or not as in the trace."""
    from autoshard.compiler.plan import traced_copy
    from autoshard.frontend.trace import trace

    model, args, kwargs = models.hf_llama(layers=1)
    traced = trace(model, args, kwargs)
    copy = traced_copy(traced)

    def tensors(gm):
        return {name: (id(t), name.rpartition(".")[2] in gm.get_submodule(name.rpartition(".")[0])
                       ._non_persistent_buffers_set)
                for name, t in [*gm.named_parameters(remove_duplicate=False),
                                *gm.named_buffers(remove_duplicate=False)]}

    assert any(non_persistent for _, non_persistent in tensors(traced).values())
    assert tensors(copy) == tensors(traced)
    assert list(copy.state_dict()) == list(traced.state_dict())
