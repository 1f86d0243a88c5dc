"""``MoE(existing=True)`` (Hugging Face's own sparse-MoE blocks, expanded by ``expert_rewrite``) under
``precision=MixedPrecision(torch.bfloat16)``: the experts compute in bf16 from fp32 masters, the router is the model's
own code as the bf16 compute copy runs it (Mixtral: a bf16 gate linear, its softmax and top-k weights in float32),
so the sharded program equals the one-device run under the same policy (tests/test_mixed_precision.py's reference
and bounds: bf16 rounding in other places, a few 1e-3 relative per gradient tensor; a missing or doubled sync is
50 % or more) on data=2 x model=2, experts sharded on ``data`` (dropless: every routed token kept, as HF's block).
"""

from __future__ import annotations

import copy

import pytest
import torch

import autoshard
from autoshard import meta as M
from autoshard.compiler.plan import loss_of
from autoshard.runtime import spawn
from autoshard.frontend.trace import fetch_attr
from examples import models
from tests.test_mixed_precision import _check_grads, _fp32, _rel, _under_policy

BF16 = autoshard.MixedPrecision(torch.bfloat16)
MESH = {"data": 2, "model": 2}
MOE = autoshard.MoE(existing=True, expert_axis="data", capacity_factor=None)
EXPERTS = ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj")


def _case():
    return models.hf_mixtral(layers=1)


def _check(losses, grads):
    model, args, kwargs = _case()
    ref_loss, ref_grads = _under_policy(model, args, kwargs, BF16)
    _, fp32_grads = _fp32(model, args, kwargs)
    for loss in losses:
        assert loss.dtype == ref_loss.dtype  # HF computes its loss in float32
        torch.testing.assert_close(loss, losses[0], rtol=0, atol=0)
        torch.testing.assert_close(loss.float(), ref_loss.float(), rtol=8e-3, atol=0)  # one bf16 ulp
    _check_grads(grads, ref_grads, tol=6e-2)
    # bf16 computes: the experts' gradients are not the fp32 model's
    assert min(_rel(grads[n], fp32_grads[n], 1e-6) for n in EXPERTS) > 1e-3


def test_hf_mixtral_experts_in_bf16_equal_the_policy_on_one_device_in_the_simulator():
    model, args, kwargs = _case()
    plan = autoshard.compile(copy.deepcopy(model), autoshard.Mesh(**MESH), args, kwargs, moe=MOE,
                             precision=BF16).plan
    sim = plan.simulate(args, kwargs)
    _check([loss_of(o).detach() for o in sim.outputs], sim.grads)
    assert plan.param_specs()[EXPERTS[0]][0] == autoshard.Shard(0)  # the experts sharded on `data`
    nodes = list(plan.graph_module.graph.nodes)
    bmms = [n for n in nodes if n.target in (torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default)]
    assert bmms and all(n.meta["val"].dtype == torch.bfloat16 for n in bmms)  # the experts run in bf16
    casts = {n.args[0].target for n in nodes if n.meta.get(M.PRECISION_CAST)}
    assert set(EXPERTS) <= {str(t) for t in casts}  # ... on casts of their fp32 masters


def _gloo_worker(rank, world_size):
    model, args, kwargs = _case()
    mesh = autoshard.Mesh(**MESH)
    sharded = autoshard.compile(model, mesh, moe=MOE, precision=BF16)
    loss = loss_of(sharded(**{k: autoshard.data_shard(v, mesh, rank) for k, v in kwargs.items()}))
    loss.backward()
    return loss.detach(), {n: p.grad.full_tensor() for n, p in sharded.named_parameters()}


@pytest.mark.gloo
def test_hf_mixtral_experts_in_bf16_equal_the_policy_on_one_device_on_gloo_processes():
    results = spawn(_gloo_worker, 4, timeout=120, start_method="forkserver")
    _check([r[0] for r in results], results[0][1])
    for _, grads in results[1:]:
        for name, g in grads.items():
            torch.testing.assert_close(g, results[0][1][name], rtol=0, atol=0)


# ---- MoE layers autoshard builds (a dense FFN rewritten), under the policy ----------------------------------------
def test_rewritten_moe_experts_in_bf16_router_in_float32_equal_the_policy_on_one_device():
    """``MoE(layers=..., num_experts=4)`` on the example GPT under ``MixedPrecision(bf16)``, experts sharded on
    data=2: the new expert weights are fp32 masters computing in bf16 (cast like every other parameter), the router
    weight a fp32 master never cast (the rewrite's router is float32 by design). Equal to the same MoE layer on one
    device under the same policy: tests/test_expert_rewrite.py's eager oracle with every parameter in bf16 but the
    router (same weights; bounds as above)."""
    from tests.test_expert_rewrite import OPTS, RefMoE, reference_run

    model, args, _ = models.gpt(batch=4, seq=8, layers=2, hidden=32)
    opts, path = autoshard.MoE(**OPTS), "blocks.1.mlp"
    plan = autoshard.compile(copy.deepcopy(model), autoshard.Mesh(data=2), args, moe=opts, precision=BF16).plan
    sim = plan.simulate(args)
    groups = plan.context.report["expert_rewrite"]["groups"]

    ref_model = copy.deepcopy(model)
    moe = RefMoE(plan, path, opts, groups, "gelu")
    setattr(ref_model.get_submodule(path.rsplit(".", 1)[0]), path.rsplit(".", 1)[1], moe)
    params = {n: p if n == f"{path}.router.weight" else p.to(torch.bfloat16) for n, p in ref_model.named_parameters()}
    main = loss_of(torch.func.functional_call(ref_model, params, args))
    (main + opts.aux_loss_weight * moe.result["lb"] + opts.z_loss_weight * moe.result["z"]).backward()
    ref_grads = {n: p.grad for n, p in ref_model.named_parameters() if p.grad is not None}
    assert moe.result["dropped"] > 0  # capacity 1.0 drops choices: the same ones as the oracle's, or far off
    for out in sim.outputs:
        loss = loss_of(out).detach()
        assert loss.dtype == main.dtype == torch.bfloat16
        torch.testing.assert_close(loss.float(), main.float(), rtol=8e-3, atol=0)  # one bf16 ulp
    _check_grads(sim.grads, ref_grads, tol=6e-2)
    _, _, fp32_grads = reference_run(model, plan, path, opts, groups, args)
    experts = [f"{path}.experts.{w}" for w in ("w1", "w2")]
    assert min(_rel(sim.grads[n], fp32_grads[n], 1e-6) for n in experts) > 1e-3  # bf16 computes, not fp32

    gm = plan.graph_module
    masters = {n: fetch_attr(gm, n) for n in (*experts, f"{path}.router.weight")}
    assert all(t.dtype == torch.float32 for t in masters.values())
    nodes = list(gm.graph.nodes)
    bmms = [n for n in nodes if n.target in (torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default)]
    assert bmms and all(n.meta["val"].dtype == torch.bfloat16 for n in bmms)  # the experts run in bf16 ...
    cast = {str(n.args[0].target) for n in nodes if n.meta.get(M.PRECISION_CAST)}
    assert set(experts) <= cast and f"{path}.router.weight" not in cast  # ... on casts of their masters
    router = next(n for n in nodes if n.op == "get_attr" and n.target == f"{path}.router.weight")
    reads = list(router.users)  # its gradient's sync, in float32, then the logits' linear
    while reads[0].target != torch.ops.aten.linear.default:
        assert len(reads) == 1 and reads[0].meta["val"].dtype == torch.float32, reads
        reads = list(reads[0].users)
    assert reads[0].meta["val"].dtype == torch.float32  # float32 logits from the fp32 router
