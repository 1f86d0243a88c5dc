"""Expert rewrite (passes/expert_rewrite.py) against an eager MoE oracle, in one process and in the simulator.

The oracle is ``tests/moe/reference.py`` (python loops, written from the spec), applied per routing group: with
``G`` groups (one per rank of the expert axis) the tokens ``x.reshape(G, -1, h)`` are routed group by group with
``C = ceil(k·T_g/E·cf)``, exactly as each data rank routes its own tokens. The load-balancing loss uses global
``f_i``, ``P_i`` (all tokens); the z-loss is the mean over all tokens. Reference gradients are those of
``loss + α·lb + β·z``: the rewrite attaches the aux losses to the activation, so the model's own ``backward``
must give them.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autoshard
from autoshard import meta as M
from autoshard.errors import PlanError
from autoshard.compiler.plan import loss_of
from autoshard.runtime.collective_ops import collective_counts
from autoshard.frontend.trace import fetch_attr
from examples import models


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


ref = _load("autoshard_tests_moe_reference", Path(__file__).resolve().parent / "moe" / "reference.py")

RTOL, ATOL = 1e-4, 1e-5


class RefMoE(nn.Module):
    """The eager oracle as a module at the FFN's path: same parameter names as the rewrite's."""

    def __init__(self, plan, path: str, opts: autoshard.MoE, groups: int, activation: str):
        super().__init__()
        gm = plan.graph_module
        self.experts = nn.Module()
        for name in ("w1", "b1", "w3", "b3", "w2", "b2"):
            try:
                t = fetch_attr(gm, f"{path}.experts.{name}")
            except AttributeError:
                continue
            self.experts.register_parameter(name, nn.Parameter(t.detach().clone()))
        self.router = nn.Module()
        self.router.weight = nn.Parameter(fetch_attr(gm, f"{path}.router.weight").detach().clone())
        self.opts, self.groups, self.activation = opts, groups, activation
        self.result = None

    def forward(self, x):
        e = self.experts
        gated = hasattr(e, "w3")
        w_in, b_in = (e.w3, getattr(e, "b3", None)) if gated else (e.w1, getattr(e, "b1", None))
        w_gate = e.w1 if gated else None
        xg = x.reshape(self.groups, -1, x.shape[-1])
        results = [ref.reference_moe(xg[g], self.router.weight, w_in, b_in, e.w2, getattr(e, "b2", None),
                                     top_k=self.opts.top_k, capacity_factor=self.opts.capacity_factor,
                                     activation=self.activation, w_gate=w_gate) for g in range(self.groups)]
        tokens = xg.shape[0] * xg.shape[1]
        E = self.router.weight.shape[0]
        logits = xg.reshape(tokens, -1).float() @ self.router.weight.float().t()
        probs = torch.softmax(logits, dim=-1)
        firsts = [c[0] for r in results for c in r.choices]
        f = torch.tensor([firsts.count(i) / tokens for i in range(E)])
        lb = E * (f * probs.mean(dim=0)).sum()
        z = sum(r.z_loss for r in results) / self.groups
        self.result = {"lb": lb, "z": z, "dropped": sum(not k for r in results for row in r.keep for k in row),
                       "capacity": results[0].capacity}
        return torch.stack([r.out for r in results]).reshape(x.shape)


def reference_run(model, plan, path, opts, groups, args, activation="gelu"):
    ref_model = copy.deepcopy(model)
    parent, leaf = path.rsplit(".", 1)
    moe = RefMoE(plan, path, opts, groups, activation)
    setattr(ref_model.get_submodule(parent), leaf, moe)
    main = loss_of(ref_model(*args))
    total = main + opts.aux_loss_weight * moe.result["lb"] + opts.z_loss_weight * moe.result["z"]
    total.backward()
    grads = {n: p.grad for n, p in ref_model.named_parameters(remove_duplicate=False) if p.grad is not None}
    return main.detach(), moe.result, grads


def check_against_reference(mesh_axes, opts, batch=4, ann=None, factory="gpt", path="blocks.1.mlp", **kw):
    model, args, _ = models.FACTORIES[factory](batch=batch, seq=8, layers=2, hidden=32, **kw)
    mesh = autoshard.Mesh(**mesh_axes)
    plan = autoshard.compile(model, mesh, args, moe=opts, annotations=ann).plan
    groups = plan.context.report["expert_rewrite"]["groups"]
    main, result, grads = reference_run(model, plan, path, opts, groups, args)
    sim = plan.simulate(args)
    for rank, out in enumerate(sim.outputs):
        torch.testing.assert_close(loss_of(out).detach(), main, rtol=RTOL, atol=ATOL)
        losses = autoshard.moe_losses(plan, rank=rank)["layers"][path]
        torch.testing.assert_close(losses["load_balancing"], opts.aux_loss_weight * result["lb"].detach(),
                                   rtol=RTOL, atol=1e-7)
        torch.testing.assert_close(losses["z"], opts.z_loss_weight * result["z"].detach(), rtol=RTOL, atol=1e-7)
        assert autoshard.moe_stats(plan, rank=rank)[path]["dropped"] == result["dropped"]
    assert set(sim.grads) == set(plan.param_specs()) & set(grads)
    assert {f"{path}.experts.w1", f"{path}.experts.w2", f"{path}.router.weight"} <= set(sim.grads)
    for name, g in sim.grads.items():
        torch.testing.assert_close(g, grads[name], rtol=RTOL, atol=ATOL, msg=lambda m, name=name: f"grad {name}: {m}")
    return plan, sim, result


OPTS = {"layers": "blocks.*.mlp", "every": 2, "num_experts": 4, "top_k": 2, "capacity_factor": 1.0, "init": "random",
            "router_std": 0.5, "aux_loss_weight": 0.1, "z_loss_weight": 0.01}


def test_single_rank_matches_reference_with_drops():
    plan, sim, result = check_against_reference({"data": 1}, autoshard.MoE(**OPTS))
    assert result["dropped"] > 0  # capacity_factor 1.0 with a skewed router drops tokens
    layer = plan.context.report["expert_rewrite"]["layers"][0]
    assert layer["path"] == "blocks.1.mlp" and layer["capacity"] == result["capacity"] == math.ceil(2 * 32 / 4)
    assert not any(c for c in collective_counts(sim.logs[0]) if c[0] == "all_to_all")


@pytest.mark.parametrize("n", [2, 4])
def test_expert_parallel_matches_reference_and_runs_four_all_to_alls(n):
    plan, sim, result = check_against_reference({"data": n}, autoshard.MoE(**OPTS))
    assert result["capacity"] == math.ceil(2 * (32 // n) / 4)
    for log in sim.logs:  # one MoE layer: dispatch and combine forward, their inverses backward
        assert collective_counts(log, "forward")[("all_to_all", "data")] == 2
        assert collective_counts(log, "backward")[("all_to_all", "data")] == 2
    specs = plan.param_specs()
    assert specs["blocks.1.mlp.experts.w1"] == (autoshard.Shard(0),)
    assert plan.rank_program(1).get_submodule("blocks.1.mlp.experts").w1.shape == (4 // n, 32, 128)


def test_expert_parallel_composes_with_model_axis():
    # experts on data, and each expert column/row-parallel over model (Megatron inside every expert)
    S, R = autoshard.Shard, autoshard.Replicate
    ann = {"blocks.1.mlp.experts.w1": (S(0), S(2)), "blocks.1.mlp.experts.b1": (S(0), S(1)),
           "blocks.1.mlp.experts.w2": (S(0), S(1)), "blocks.1.mlp.experts.b2": (S(0), R())}
    plan, sim, _ = check_against_reference({"data": 2, "model": 2}, autoshard.MoE(**OPTS), ann=ann)
    assert plan.rank_program(3).get_submodule("blocks.1.mlp.experts").w1.shape == (2, 32, 64)
    assert collective_counts(sim.logs[0], "forward")[("all_to_all", "data")] == 2


def test_capacity_drops_counted_independently_and_none_with_large_factor():
    model, args, _ = models.gpt(batch=4, seq=8, layers=2, hidden=32)
    for cf, expect_drops in ((0.5, True), (8.0, False)):
        opts = autoshard.MoE(**{**OPTS, "capacity_factor": cf})
        plan = autoshard.compile(model, autoshard.Mesh(data=2), args, moe=opts).plan
        _, result, _ = reference_run(model, plan, "blocks.1.mlp", opts, 2, args)
        plan.simulate(args, backward=False)
        stats = autoshard.moe_stats(plan, rank=0)["blocks.1.mlp"]
        assert stats["dropped"] == result["dropped"]
        assert (stats["dropped"] > 0) == expect_drops
        assert sum(stats["routed_per_expert"]) == 2 * 32
        assert sum(stats["tokens_per_expert"]) == 2 * 32 - stats["dropped"]
        assert stats["dropped_fraction"] == pytest.approx(stats["dropped"] / 64)


class FFNModel(nn.Module):
    def __init__(self, hidden=16, gated=False):
        super().__init__()
        self.gated = gated
        if gated:
            self.mlp = LlamaMLP(hidden)
        else:
            self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x):
        return self.mlp(x)


class LlamaMLP(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, 2 * hidden, bias=False)
        self.up_proj = nn.Linear(hidden, 2 * hidden, bias=False)
        self.down_proj = nn.Linear(2 * hidden, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize("gated", [False, True], ids=["gelu", "swiglu"])
def test_upcycled_experts_reproduce_the_dense_ffn(gated):
    torch.manual_seed(0)
    model = FFNModel(gated=gated)
    x = torch.randn(4, 8, 16)
    dense = model(x).detach()
    for k in (1, 2):
        opts = autoshard.MoE(layers="mlp", num_experts=4, top_k=k, capacity_factor=100.0, init="upcycle",
                             router_std=0.5)
        plan = autoshard.compile(model, autoshard.Mesh(data=2), (x,), moe=opts).plan
        sim = plan.simulate((x,), backward=False)
        out = torch.cat([o.detach() for o in sim.outputs])  # batch shards stay local
        if k == 2:  # renormalised top-2 gates sum to 1 and every expert is the dense FFN
            torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-6)
        else:  # Switch: the expert output scaled by the raw gate
            router = fetch_attr(plan.graph_module, "mlp.router.weight")
            gate = torch.softmax(x.float() @ router.t(), dim=-1).max(dim=-1).values
            torch.testing.assert_close(out, gate[..., None] * dense, rtol=1e-5, atol=1e-6)


def test_gated_ffn_expert_parallel_matches_reference():
    torch.manual_seed(1)
    model = FFNModel(hidden=16, gated=True)
    x = torch.randn(4, 8, 16)
    opts = autoshard.MoE(layers="mlp", num_experts=4, top_k=2, capacity_factor=1.0, init="upcycle", noise=0.5,
                         router_std=0.5, aux_loss_weight=0.1, z_loss_weight=0.01)
    plan = autoshard.compile(model, autoshard.Mesh(data=2), (x,), moe=opts).plan
    report = plan.context.report["expert_rewrite"]["layers"][0]
    assert report["gated"] and report["expert_params"] == ["mlp.experts.w1", "mlp.experts.w3", "mlp.experts.w2"]

    class Loss(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x).square().mean()

    ref_model = Loss(copy.deepcopy(model))
    moe = RefMoE(plan, "mlp", opts, 2, "silu")
    ref_model.inner.mlp = moe
    main = ref_model(x)
    (main + opts.aux_loss_weight * moe.result["lb"] + opts.z_loss_weight * moe.result["z"]).backward()
    sim = plan.simulate((x,), backward=False)
    out = torch.cat([o.detach() for o in sim.outputs])
    torch.testing.assert_close(out.square().mean(), main.detach(), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(autoshard.moe_losses(plan, rank=1)["layers"]["mlp"]["load_balancing"],
                               0.1 * moe.result["lb"].detach(), rtol=RTOL, atol=1e-7)


def test_selection_by_glob_every_and_list():
    model, args, _ = models.gpt(batch=2, seq=8, layers=4, hidden=16)
    rewrite = autoshard.MoE(layers="blocks.*.mlp", every=2, num_experts=2, top_k=1)
    plan = autoshard.compile(model, autoshard.Mesh(data=1), args, moe=rewrite).plan
    assert [entry["path"] for entry in plan.context.report["expert_rewrite"]["layers"]] == [
        "blocks.1.mlp", "blocks.3.mlp"]
    listed = autoshard.MoE(layers=["blocks.0.mlp", "blocks.2.mlp"], num_experts=2, top_k=1)
    plan = autoshard.compile(model, autoshard.Mesh(data=1), args, moe=listed).plan
    assert [entry["path"] for entry in plan.context.report["expert_rewrite"]["layers"]] == [
        "blocks.0.mlp", "blocks.2.mlp"]
    text = plan.format()
    assert "MoE blocks.0.mlp" in text and "capacity" in text


@pytest.mark.parametrize("kwargs, message", [
    ({"layers": "blocks.*.attn"}, "is not a dense FFN|but an expert rewrite needs a dense FFN"),
    ({"num_experts": 3}, "divisible by the size 2 of expert axis"),
    ({"top_k": 5, "num_experts": 4}, "top_k has 5"),
    ({"capacity_factor": 0.0}, "capacity_factor has 0.0"),
    ({"capacity_factor": -1.0}, "capacity_factor has -1.0"),
    ({"layers": "nothing.*"}, "matches no module"),
])
def test_bad_input_gives_clear_errors(kwargs, message):
    model, args, _ = models.gpt(batch=2, seq=8, layers=1, hidden=16)
    with pytest.raises(PlanError, match=message):
        opts = autoshard.MoE(**{"layers": "blocks.*.mlp", "num_experts": 4, "top_k": 2, **kwargs})
        autoshard.compile(model, autoshard.Mesh(data=2), args, moe=opts)


def test_cli_show_marks_moe_layers(capsys):
    from autoshard.api.cli import main

    code = main(["show", "examples.models:gpt", "--mesh", "data=2", "--factory-arg", "layers=2",
                 "--factory-arg", "hidden=32", "--moe", "layers=blocks.*.mlp,every=2,num_experts=4,top_k=2"])
    out = capsys.readouterr().out
    assert code == 0
    lines = out.splitlines()  # the MoE line, with the lines it wrapped onto (indented) at the terminal's width
    first = next(i for i, ln in enumerate(lines) if ln.startswith("MoE blocks.1.mlp"))
    rest = [ln.strip() for ln in lines[first + 1:]]
    line = " ".join([lines[first], *rest[:next((i for i, ln in enumerate(lines[first + 1:]) if not ln.startswith("  ")),
                                               len(rest))]])
    assert "capacity 20 per expert per group" in line and "2 per rank on `data`" in line
    assert "all-to-all: 2 forward + 2 backward" in line
    assert main(["show", "examples.models:gpt", "--mesh", "data=2", "--moe", "layers=blocks.*.mlp,top_k=x"]) == 2


def test_router_runs_in_float32_in_a_bf16_model():
    torch.manual_seed(0)
    model = FFNModel(hidden=16).to(torch.bfloat16)
    x = torch.randn(4, 8, 16, dtype=torch.bfloat16)
    opts = autoshard.MoE(layers="mlp", num_experts=4, top_k=2, capacity_factor=100.0, router_std=0.5)
    plan = autoshard.compile(model, autoshard.Mesh(data=2), (x,), moe=opts).plan
    gm = plan.graph_module
    assert fetch_attr(gm, "mlp.router.weight").dtype == torch.float32
    assert fetch_attr(gm, "mlp.experts.w1").dtype == torch.bfloat16
    logits = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default)
    assert logits.meta["val"].dtype == torch.float32
    out = torch.cat([o.detach() for o in plan.simulate((x,), backward=False).outputs])
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), model(x).float(), rtol=2e-2, atol=2e-2)  # upcycled, top-2, no drops


@pytest.mark.parametrize("name, layers", [("hf_gpt2", "transformer.h.*.mlp"), ("hf_llama", "model.layers.*.mlp")])
def test_hugging_face_ffns_upcycle_to_the_dense_model(name, layers):
    # GPT-2's Conv1D FFN (view → addmm → view, tanh-GELU formula, p=0 dropout) and Llama's SwiGLU
    model, args, kwargs = models.FACTORIES[name](layers=1, batch=4, seq=8, hidden=32)
    opts = autoshard.MoE(layers=layers, num_experts=4, top_k=2, capacity_factor=100.0, router_std=0.5)
    plan = autoshard.compile(model, autoshard.Mesh(data=2), args, kwargs, moe=opts).plan
    assert len(plan.context.report["expert_rewrite"]["layers"]) == 1
    sim = plan.simulate(args, kwargs, backward=False)
    with torch.no_grad():
        dense = loss_of(model(*args, **kwargs))
    torch.testing.assert_close(loss_of(sim.outputs[0]).detach(), dense, rtol=1e-5, atol=1e-6)


def test_no_tokens_by_experts_by_capacity_tensor():
    # index dispatch: nothing shaped like GShard's one-hot [T, E, C] mask; the buffer is [E, G, C, h]
    model, args, _ = models.gpt(batch=4, seq=8, layers=2, hidden=32)
    opts = autoshard.MoE(**{**OPTS, "num_experts": 8, "capacity_factor": 3.0})
    plan = autoshard.compile(model, autoshard.Mesh(data=2), args, moe=opts).plan
    layer = plan.context.report["expert_rewrite"]["layers"][0]
    sizes = {layer["tokens_per_group"], 8, layer["capacity"]}
    assert len(sizes) == 3  # 16 tokens, 8 experts, capacity 12: distinguishable
    shapes = []
    for n in plan.graph_module.graph.nodes:
        if n.op == "call_function" and M.module_path(n).startswith("blocks.1.mlp"):
            vals = n.meta["val"] if isinstance(n.meta["val"], tuple) else (n.meta["val"],)
            shapes += [tuple(v.shape) for v in vals]
    assert (8, 2, layer["capacity"], 32) in shapes
    assert not [s for s in shapes if sizes <= set(s)]


def _moe_op_cases():
    from autoshard.runtime.moe import graph_ops as ops

    g = torch.Generator().manual_seed(3)
    G, T, E, k, C, h = 2, 6, 4, 2, 3, 5
    logits = torch.randn(G, T, E, generator=g)
    ei, pos, keep = ops.route_groups(logits, k, C)
    probs = torch.softmax(logits, -1)
    gate = ops.gate_groups(probs, ei)
    x, y = torch.randn(G, T, h, generator=g), torch.randn(E, G, C, h, generator=g)
    frac = ops.first_fraction(ei, E, G * T)
    terms = ops.aux_terms(probs, logits, frac, E, G * T)
    stats = ops.routing_stats(ei, keep, terms, E)
    out = ops.combine_groups(y, ei, pos, gate, keep)
    return [(ops.route_groups, (logits, k, C)), (ops.gate_groups, (probs, ei)),
            (ops.dispatch_groups, (x, ei, pos, keep, E, C)), (ops.combine_groups, (y, ei, pos, gate, keep)),
            (ops.first_fraction, (ei, E, G * T)), (ops.aux_terms, (probs, logits, frac, E, G * T)),
            (ops.routing_stats, (ei, keep, terms, E)), (ops.attach, (out, terms, stats, "sweep", "mlp", 0.1, 0.01, k))]


@pytest.mark.parametrize("mesh_axes", [{"data": 2}, {"data": 2, "model": 2}], ids=["data2", "data2xmodel2"])
def test_moe_rules_every_strategy_equals_the_global_op(mesh_axes):
    # the rule table's ground-truth check for the MoE ops: run each strategy on shards, reassemble, compare
    from autoshard.compiler.ops import OpInfo, rule_for
    from autoshard.placements import assemble, shard_tensor
    from autoshard.compiler.strategies import strategies_for

    mesh = autoshard.Mesh(**mesh_axes)
    checked = 0
    for op, args in _moe_op_cases():
        full = op(*args)
        outs = full if isinstance(full, tuple) else (full,)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        info = OpInfo([tuple(t.shape) for t in tensors], [tuple(o.shape) for o in outs], args)
        strategies = strategies_for(rule_for(op)(info), info.in_shapes, info.out_shapes, mesh)
        assert len(strategies) > 1, op.__name__  # the group dim can always be sharded on some axis
        for strat in strategies:
            per_rank = []
            for rank in range(mesh.size):
                it = iter(strat.input_specs)
                local = [shard_tensor(a, next(it), mesh, rank) if isinstance(a, torch.Tensor) else a for a in args]
                res = op(*local)
                per_rank.append(res if isinstance(res, tuple) else (res,))
            specs = strat.output_spec if isinstance(strat.output_spec[0], tuple) else (strat.output_spec,)
            for i, (o, spec) in enumerate(zip(outs, specs)):
                got = assemble([r[i] for r in per_rank], spec, mesh)
                torch.testing.assert_close(got.to(o.dtype), o, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, op=op, strat=strat: f"{op.__name__} {strat.note}: {m}")
            checked += 1
    assert checked >= 16


def test_lazy_sharded_module_reports_losses_and_stats_per_forward():
    from autoshard.runtime import SimWorld

    model, (ids, labels), _ = models.gpt(batch=4, seq=8, layers=2, hidden=32)
    mesh = autoshard.Mesh(data=2)
    world = SimWorld(mesh)

    def body(rank):
        sharded = autoshard.compile(model, mesh, moe=autoshard.MoE(**OPTS), comm=world.communicator(rank))
        loss = sharded(autoshard.data_shard(ids, mesh, rank), autoshard.data_shard(labels, mesh, rank))
        loss.backward()
        return float(autoshard.moe_losses(sharded)["total"]), autoshard.moe_stats(sharded)

    results = world.run(body)
    assert results[0] == results[1]
    total, stats = results[0]
    assert total > 0 and set(stats) == {"blocks.1.mlp"}
    assert stats["blocks.1.mlp"]["tokens"] == 32


def test_rewrite_reports_on_graph_meta_and_leaves_the_options_alone():
    model, args, _ = models.gpt(batch=4, seq=8, layers=2, hidden=32)
    plan = autoshard.compile(model, autoshard.Mesh(data=2), args, moe=autoshard.MoE(**OPTS)).plan
    assert plan.context.options.annotations == ()  # the expert annotations are implied on the graph, not added here
    rewrite = plan.graph_module.meta[M.MOE_REWRITE]
    assert isinstance(rewrite, autoshard.compiler.moe.MoERewrite)
    assert [la.path for la in rewrite.layers] == ["blocks.1.mlp"]
    assert rewrite.report() == plan.context.report["expert_rewrite"]
    implied = dict(plan.graph_module.meta[M.IMPLIED_ANNOTATIONS])
    assert set(implied) == set(rewrite.layers[0].expert_params)
    assert implied["blocks.1.mlp.experts.w1"] == (autoshard.Shard(0),)
    assert plan.param_specs()["blocks.1.mlp.experts.w1"] == (autoshard.Shard(0),)


def test_two_models_in_one_process_keep_their_own_records():
    model, args, _ = models.gpt(batch=4, seq=8, layers=2, hidden=32)
    mesh = autoshard.Mesh(data=2)
    drops = autoshard.compile(model, mesh, args, moe=autoshard.MoE(**{**OPTS, "capacity_factor": 0.5})).plan
    roomy = autoshard.compile(model, mesh, args, moe=autoshard.MoE(**{**OPTS, "capacity_factor": 8.0})).plan
    assert drops.graph_module.meta[M.MOE_REWRITE].key != roomy.graph_module.meta[M.MOE_REWRITE].key
    drops.simulate(args, backward=False)
    roomy.simulate(args, backward=False)  # same layer path, same process: must not overwrite the other's record
    assert autoshard.moe_stats(drops, rank=0)["blocks.1.mlp"]["dropped"] > 0
    assert autoshard.moe_stats(roomy, rank=0)["blocks.1.mlp"]["dropped"] == 0
    assert autoshard.moe_stats(rank=1) == autoshard.moe_stats(roomy, rank=1)  # no module: the last one that ran
    assert autoshard.moe_stats(drops.rank_program(0), rank=0) == autoshard.moe_stats(drops, rank=0)
    autoshard.compiler.moe.clear_records(drops)
    assert autoshard.moe_stats(drops, rank=0) == {} and autoshard.moe_stats(roomy, rank=0)


@pytest.mark.parametrize("in_place", [False, True], ids=["compile", "shard"])
def test_the_moe_layers_parameters_are_the_modules_and_an_optimizer_trains_them(in_place):
    """The experts and router the rewrite creates are the module's parameters (named under the FFN's path, in its
    state dict) and the dense FFN's weights they replaced are gone: a user's optimizer built from ``parameters()``
    steps the experts (before, it was given the unused dense weights and the experts never trained)."""
    from autoshard.runtime import SimWorld

    model, args, _ = models.gpt(batch=4, seq=8, layers=2, hidden=16)
    mesh = autoshard.Mesh(data=2)
    world = SimWorld(mesh, timeout=60)
    copies = [copy.deepcopy(model) for _ in range(2)]
    moe = autoshard.MoE(layers="blocks.*.mlp", num_experts=2, top_k=1, expert_axis="data")

    def body(rank):
        comm = world.communicator(rank)
        local = tuple(a.chunk(2)[rank] for a in args)
        if in_place:
            sm = autoshard.shard(copies[rank], mesh, example_inputs=local, moe=moe, comm=comm)
        else:
            sm = autoshard.compile(copies[rank], mesh, args, moe=moe, comm=comm)
        names = [n for n, _ in sm.named_parameters()]
        opt = torch.optim.AdamW(sm.parameters(), lr=1e-2)
        before = {n: p.to_local().detach().clone() for n, p in sm.named_parameters()}
        loss_of(sm(*local)).backward()
        opt.step()
        moved = {n for n, p in sm.named_parameters() if not torch.equal(p.to_local(), before[n])}
        return names, sorted(sm.state_dict()), moved

    for names, keys, moved in world.run(body):
        experts = [n for n in names if ".mlp.experts." in n or ".mlp.router." in n]
        assert "blocks.0.mlp.experts.w1" in experts and "blocks.1.mlp.router.weight" in experts
        assert not [n for n in names + keys if n.startswith("blocks.0.mlp.0.")]  # the replaced dense weights
        assert set(experts) <= set(keys)
        assert set(experts) <= moved, set(experts) - moved
