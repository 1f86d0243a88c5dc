"""Every strategy of every rule, checked numerically through the real pipeline (trace → passes → codegen → simulator).

For each op case of ``tests/opcases.py`` and each mesh, the op's node is found in the traced graph and its
candidate strategies are enumerated exactly as propagation does (``rule(OpInfo)`` → ``strategies_for``). Each
strategy is then *forced* on the node (``node.meta[M.PLANNED]``, which propagation honours) and the plan is run on
every rank in the thread simulator, forward and backward. Ground truth is eager PyTorch on the full tensors:

* every rank's outputs (left replicated by the output rule) equal the eager outputs;
* every parameter gradient, reassembled from the ranks' shards as ``Plan.simulate`` does, equals the eager one,
  and every rank's shard of a non-Partial parameter gradient is the matching piece of it;
* every input gradient on every rank is that rank's piece of the eager gradient (the whole gradient where the
  input is replicated or Partial).

The loss is ``Σ_i (out_i * w_i).sum()`` over the float outputs, with fixed random ``w_i``, computed outside the
traced graph on each rank's (replicated) outputs, so that only the op under test and the redistributions around
it are in the graph.

Input layouts vary per strategy: ``matched`` annotates every graph input and parameter feeding the op with the
spec the strategy wants (no redistribution before the op; ``Partial()`` inputs included), ``default`` leaves
them as the pipeline seeds them (replicated inputs on these meshes, free parameters), ``resharded`` gives the
float inputs a different sharding, so the op is fed through all-to-all / all-gather, and ``from_partial`` makes
them Partial on every axis, so they arrive through reduce-scatter / all-reduce (or stay Partial where the
strategy takes them so).

A Partial input is split into random summands across the coordinates of its Partial axes (not "whole value on
coordinate 0, zeros elsewhere", under which every op with f(0) = 0 would look linear).

No strategy may make a *parameter* ``Partial`` (its value would be split while every rank computes its whole
gradient, so no optimizer step could be right): a test checks the candidate lists, and one checks the greedy
planner on a hand-written bias add after a row-parallel matmul, where it used to happen. Compiler bugs the sweep
finds are listed in :data:`KNOWN_BUGS`: their sweep entries are strict xfails, so a fix shows up as XPASS and the
entry must go.

The passes are the plan phase of the greedy pass list (``autoshard.passes.manager.pass_list``): the search planner
would decide every other node too, and the rule under test is the one forced either way.
"""

from __future__ import annotations

import copy

import pytest
import torch

from autoshard import meta as M
from autoshard.compiler.ops import registered, rule_for, stated
from autoshard.errors import PlanError
from autoshard.mesh import Mesh
from autoshard.placements import Shard, format_spec
from tests import opcases
from tests.rule_sweep import (ATOL, CASES, MESHES, RTOL, _has_partial, _known_bug, _node, _partial_parameter,
                              _sweep_params, assert_close, build, candidates, check, sweep_entries, sweep_ids, tokens,
                              traced)

pytestmark = [pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),  # torch's own, from deepcopy
              # one pytest-xdist worker runs the whole file (--dist loadgroup), so that one process traces the op
              # cases, once each (functools.cache), and no other worker traces any
              pytest.mark.xdist_group("rule_sweep")]


SWEEP = _sweep_params()


@pytest.mark.parametrize("case_name, mesh_name, idx, variant", SWEEP)
def test_strategy(case_name, mesh_name, idx, variant):
    strat = candidates(case_name, mesh_name)[idx]
    what = f"{case_name} on {mesh_name}, strategy {','.join(tokens(strat))} ({variant})"
    plan = build(case_name, mesh_name, strat, variant)
    _, _, _, node_name = traced(case_name)
    assert _node(plan.graph_module, node_name).meta[M.STRATEGY] == strat, f"{what}: forced strategy not used"
    check(case_name, plan, what)


def test_the_sweeps_ids_kept_on_disk_are_the_ones_computed_now():
    """The parametrisation above reads :func:`sweep_ids`' file; the entries it would compute now are the same."""
    now = [(case_name, mesh_name, idx, variant, ",".join(tokens(strat)), _known_bug(case_name, strat))
           for case_name, mesh_name, idx, variant, strat in sweep_entries()]
    assert sweep_ids() == now
    assert len(now) == len(SWEEP) > 3000


def _snapshot(gm: torch.fx.GraphModule):
    """The graph, every node's metadata (tensors by type, shape, dtype and strides) and the tensors' values."""
    def desc(v):
        if isinstance(v, torch.Tensor):
            return (type(v).__name__, tuple(v.shape), v.dtype, v.stride())
        if isinstance(v, (list, tuple)):
            return (type(v).__name__, *(desc(x) for x in v))
        if isinstance(v, dict):
            return {k: desc(x) for k, x in v.items()}
        return repr(v)

    nodes = [(n.name, n.op, str(n.target), repr(n.args), repr(n.kwargs), desc(dict(n.meta))) for n in gm.graph.nodes]
    tensors = {**dict(gm.named_parameters()), **dict(gm.named_buffers())}
    return nodes, desc(dict(gm.meta)), {k: (t.requires_grad, t.detach().clone()) for k, t in tensors.items()}


def test_fresh_copy_leaves_the_traced_program_as_it_was():
    """``build`` shares the traced program's tensors and node metadata values with its plans (``program_copy``):
    planning every (case, mesh) with its first swept strategy and variant, and making every rank's program, leaves
    the traced graph, its metadata and its tensors as they were."""
    first = {}
    for case_name, mesh_name, idx, variant, strat in sweep_entries():
        first.setdefault((case_name, mesh_name), (strat, variant))
    for (case_name, mesh_name), (strat, variant) in first.items():
        gm0 = traced(case_name)[2]
        before = _snapshot(gm0)
        plan = build(case_name, mesh_name, strat, variant)
        for rank in range(plan.mesh.size):
            plan.rank_program(rank)
        after = _snapshot(gm0)
        what = f"{case_name} on {mesh_name}"
        assert after[:2] == before[:2], f"{what}: planning changed the traced graph or its metadata"
        assert after[2].keys() == before[2].keys(), what
        for name, (grad, value) in before[2].items():
            assert after[2][name][0] == grad and torch.equal(after[2][name][1], value), f"{what}: tensor {name}"


# ---------------------------------------------------------------------------------------------------------
# Coverage of the table
# ---------------------------------------------------------------------------------------------------------
def _op_name(op) -> str:
    return str(op) if isinstance(op, torch._ops.OpOverload) else f"{op.__module__}.{op.__qualname__}"


def rule_ops() -> list:
    """Every registry key that states a sharding rule (the rule table)."""
    return [op for op in registered() if stated(op).rule is not None]


def uncovered_ops() -> list[str]:
    covered = {c.op for c in CASES}
    return sorted(_op_name(op) for op in rule_ops() if op not in covered)


def test_every_case_reaches_a_rule_with_strategies():
    """Each case's op has a rule in the registry, and on each mesh it has a sharded strategy unless the table runs it
    whole."""
    for c in CASES:
        assert rule_for(c.op) is not None, f"case {c.name}: {c.op} has no rule in autoshard/compiler/ops"
        assert candidates(c.name, "x2"), f"case {c.name}: no strategy at all"


def test_every_covered_op_is_swept():
    """Every op with a rule that some case reaches has at least one strategy checked numerically on each mesh kind."""
    swept = {(case_name, mesh_name) for case_name, mesh_name, *_ in sweep_entries()}
    for c in CASES:
        assert (c.name, "x2") in swept, f"case {c.name} has no entry in the 1-D sweep"
        if c.two_d and any("R" not in tokens(s) for s in candidates(c.name, "x2y2")):
            assert (c.name, "x2y2") in swept, f"case {c.name} has no entry in the 2-D sweep"
    ops_swept = {opcases.BY_NAME[case_name].op for case_name, _ in swept}
    assert ops_swept == {c.op for c in CASES}


#: Ops with a rule that no op case reaches, and why none can: a new rule needs an op case, or an entry here.
NO_OP_CASE = {
    # allocate without initialising: no values to compare with eager
    "aten.empty.memory_format": "uninitialised values",
    "aten.empty_like.default": "uninitialised values",
    "aten.new_empty.default": "uninitialised values",
    # the expert-parallel graph ops exist only inside ExpertRewrite's output, checked end to end by tests/moe
    # and tests/test_expert_rewrite.py
    **{f"autoshard.runtime.moe.graph_ops.{name}": "MoE rewrite only"
       for name in ("attach", "aux_terms", "combine_groups", "dispatch_groups", "first_fraction", "gate_groups",
                    "route_groups", "routing_stats")},
    # the Hugging Face MoE blocks' ops exist only inside the HF-block rewrite (tests/test_hf_moe.py checks them
    # end to end against the Hugging Face model)
    "autoshard.hf_experts.default": "HF MoE rewrite only",
    "autoshard.runtime.moe.graph_ops.slot_groups": "HF MoE rewrite only",
    # inserted only by context_axis=... (passes/context_parallel.py), checked end to end there
    "autoshard.compiler.ops.context.sequence_cut": "context_axis only (tests/test_context_parallel.py)",
}


def test_every_op_with_a_rule_has_an_op_case_or_says_why_not():
    """Every op of the rule table is reached by an op case (swept numerically above) or listed in
    :data:`NO_OP_CASE` with the reason; every listed op still has a rule and still has no case (no stale entry)."""
    missing = set(uncovered_ops())
    assert sorted(missing - set(NO_OP_CASE)) == [], "ops with a rule but no op case: add a case to tests/opcases.py"
    assert sorted(set(NO_OP_CASE) - missing) == [], "NO_OP_CASE lists ops that now have a case or no rule"


# ---------------------------------------------------------------------------------------------------------
# Parameters that a strategy would make Partial
# ---------------------------------------------------------------------------------------------------------
def test_no_strategy_makes_a_parameter_partial():
    """A Partial parameter would hold a share of its value on each rank while each rank computes its whole
    gradient (the summed update would be n times too large): no candidate strategy may ask for one."""
    with_params = [c.name for c in CASES if c.params]
    assert with_params
    for case_name in with_params:
        for mesh_name in MESHES:
            bad = [tokens(s) for s in candidates(case_name, mesh_name) if _partial_parameter(case_name, s)]
            assert not bad, f"{case_name} on {mesh_name}: strategies {bad} make a parameter Partial"


class _RowParallelBias(torch.nn.Module):
    """``x @ w + b`` written out (no linear/addmm), as many hand-written models do."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(8, 6, generator=g))
        self.b = torch.nn.Parameter(torch.randn(6, generator=g))

    def forward(self, x):
        return (x @ self.w + self.b).square().mean()


def test_bias_added_to_row_parallel_matmul_is_not_partial():
    """With w row-parallel, x @ w is Partial; adding the free parameter b with add's Partial strategy used to cost
    nothing to the greedy planner, making b Partial and its assembled gradient twice the true one."""
    import autoshard

    model, x = _RowParallelBias(), torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    plan = autoshard.compile(model, Mesh(model=2), (x,), annotations={"w": (Shard(0),)}, planner="greedy").plan
    assert not _has_partial(plan.param_specs()["b"])
    sim = plan.simulate((x,))
    model(x).backward()
    for name, p in model.named_parameters():
        assert_close(sim.grads[name], p.grad, f"grad of {name} ({format_spec(plan.param_specs()[name])})")


def test_plan_simulate_agrees_with_the_sweep_runner():
    """The sweep's runner and ``Plan.simulate`` (loss = first output) give the same parameter gradients."""
    from autoshard.compiler.plan import loss_of

    model, args, _, _ = traced("linear_loss")
    for strat in candidates("linear_loss", "x2"):
        plan = build("linear_loss", "x2", strat, "matched")
        sim = plan.simulate(args)
        ref = copy.deepcopy(model)
        loss_of(ref(*[a.detach() for a in args])).backward()
        assert set(sim.grads) == {"w", "b"}
        for name, p in ref.named_parameters():
            torch.testing.assert_close(sim.grads[name], p.grad, rtol=RTOL, atol=ATOL)


def test_forced_strategy_outside_the_rule_is_refused():
    strat = candidates("mm", "x2")[-1]
    bogus = M.Strategy(strat.input_specs, strat.output_spec, strat.grad_sync, strat.note + "?")
    with pytest.raises(PlanError, match="was given strategy .* but its rule does not allow it"):
        build("mm", "x2", bogus, "matched")
