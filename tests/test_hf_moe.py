"""Hugging Face sparse-MoE blocks with ``MoE(existing=True)`` (autoshard/frontend/hf_blocks.py) against the Hugging Face
model itself: loss (LM loss + HF's router load-balancing loss) and every gradient, in the simulator and on gloo.

Dropless (``capacity_factor=None``) the oracle is the unmodified HF model. With a capacity factor the oracle is the
HF model whose experts drop, per routing group (group ``g`` = the ``g``-th contiguous chunk of the flattened
tokens), every choice past the expert's capacity in GShard order (first choices, then second choices, each in token
order) — written here with Python loops, from that definition.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import autoshard
from autoshard.errors import PlanError
from autoshard.frontend import hf_blocks
from autoshard.placements import assemble
from autoshard.compiler.plan import loss_of
from autoshard.runtime import DistCommunicator, spawn, use
from autoshard.runtime.collective_ops import collective_counts
from examples import models

RTOL, ATOL = 1e-5, 1e-6
DROPLESS = autoshard.MoE(existing=True, expert_axis="data", capacity_factor=None)


def hf_reference(model, args, kwargs):
    model.zero_grad()
    out = model(*args, **kwargs)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return out.loss.detach(), grads


def check(model, args, kwargs, mesh, opts, reference=None):
    """Compile, simulate with backward, and compare loss and gradients to ``reference`` (default: HF's)."""
    main, grads = reference if reference is not None else hf_reference(model, args, kwargs)
    plan = autoshard.compile(model, autoshard.Mesh(**mesh), args, kwargs, moe=opts).plan
    sim = plan.simulate(args, kwargs)
    for out in sim.outputs:
        torch.testing.assert_close(loss_of(out).detach(), main, rtol=RTOL, atol=ATOL)
    assert set(sim.grads) == set(grads)
    for name, g in sim.grads.items():
        torch.testing.assert_close(g, grads[name], rtol=RTOL, atol=ATOL, msg=lambda m, name=name: f"{name}: {m}")
    return plan, sim


@pytest.mark.parametrize("factory", ["hf_mixtral", "hf_qwen2_moe"])
def test_dropless_equals_hugging_face_with_experts_sharded_and_four_all_to_alls(factory):
    layers = 2
    model, args, kwargs = getattr(models, factory)(layers=layers)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    plan, sim = check(model, args, kwargs, {"data": 2}, DROPLESS)
    report = plan.context.report["expert_rewrite"]
    assert [layer["path"] for layer in report["layers"]] == [f"model.layers.{i}.mlp" for i in range(layers)]
    assert all(layer["capacity"] == layer["tokens_per_group"] == 16 for layer in report["layers"])
    specs = plan.param_specs()
    for i in range(layers):
        for p in ("gate_up_proj", "down_proj"):
            fqn = f"model.layers.{i}.mlp.experts.{p}"
            assert specs[fqn] == (autoshard.Shard(0),)
            assert plan.rank_program(1).get_parameter(fqn).shape[0] == 2  # each rank holds half the experts
    for log in sim.logs:  # per MoE layer: dispatch and combine forward, their inverses backward
        assert collective_counts(log, "forward")[("all_to_all", "data")] == 2 * layers
        assert collective_counts(log, "backward")[("all_to_all", "data")] == 2 * layers
    # the user's model is untouched: same modules, forwards and values
    for block in hf_blocks.find_blocks(model).blocks:
        assert "forward" not in model.get_submodule(block.path).experts.__dict__
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])


def _dropping_forward(experts, groups, capacity_factor):
    """The eager oracle of a capacity-bounded experts module (see the module docstring)."""
    def forward(hidden, top_k_index, top_k_weights):
        tokens, k = top_k_index.shape
        e = experts.gate_up_proj.shape[0]
        per = tokens // groups
        cap = min(per, math.ceil(k * per / e * capacity_factor))
        keep = torch.zeros(tokens, k, dtype=torch.bool)
        for g in range(groups):
            used = [0] * e
            for c in range(k):
                for t in range(g * per, (g + 1) * per):
                    x = int(top_k_index[t, c])
                    keep[t, c] = used[x] < cap
                    used[x] += 1
        out = torch.zeros_like(hidden)
        for t in range(tokens):
            for c in range(k):
                if keep[t, c]:
                    x = int(top_k_index[t, c])
                    gate, up = torch.nn.functional.linear(hidden[t], experts.gate_up_proj[x]).chunk(2, dim=-1)
                    y = torch.nn.functional.linear(experts.act_fn(gate) * up, experts.down_proj[x])
                    out[t] = out[t] + y * top_k_weights[t, c]
        return out

    return forward


@pytest.mark.parametrize("n", [1, 2])
def test_capacity_factor_drops_as_the_expert_rewrite(n):
    model, args, kwargs = models.hf_mixtral(layers=1)
    experts = model.model.layers[0].mlp.experts
    experts.forward = _dropping_forward(experts, n, 0.5)
    try:
        reference = hf_reference(model, args, kwargs)
    finally:
        del experts.forward
    assert not torch.equal(reference[0], hf_reference(model, args, kwargs)[0])  # the drops change the loss
    opts = autoshard.MoE(existing=True, capacity_factor=0.5)
    plan, _ = check(model, args, kwargs, {"data": n}, opts, reference)
    layer = plan.context.report["expert_rewrite"]["layers"][0]
    assert layer["capacity"] == math.ceil(2 * (32 // n) / 4 * 0.5)
    stats = autoshard.moe_stats(plan, rank=0)["model.layers.0.mlp"]
    assert stats["dropped"] > 0 and stats["tokens"] == 32


def test_without_moe_option_hf_moe_runs_data_parallel_and_exact():
    model, args, kwargs = models.hf_qwen2_moe(layers=1)
    plan, sim = check(model, args, kwargs, {"data": 2}, None)
    assert not any(c[0] == "all_to_all" for c in collective_counts(sim.logs[0]))
    assert plan.param_specs()["model.layers.0.mlp.experts.gate_up_proj"] == (autoshard.Replicate(),)


def test_existing_without_a_recognised_block_names_the_model_and_what_was_looked_for():
    model, args, kwargs = models.hf_llama(layers=1, batch=2, seq=8, hidden=32)
    with pytest.raises(PlanError, match=r"LlamaForCausalLM has no sparse-MoE block.*`gate`/`router`.*gate_up_proj"):
        _ = autoshard.compile(model, autoshard.Mesh(data=2), args, kwargs, moe=DROPLESS).plan


@pytest.mark.parametrize("kwargs, message", [
    ({"num_experts": 16}, r"existing=True\) has num_experts=16"),
    ({"aux_loss_weight": 0.1}, "auxiliary losses are the model's own"),
    ({"capacity_factor": 0.0}, r"capacity_factor has 0.0, but must be a finite number > 0, or None"),
    ({"existing": "yes"}, "existing has 'yes'"),
])
def test_existing_options_are_validated(kwargs, message):
    with pytest.raises(PlanError, match=message):
        autoshard.MoE(**{"existing": True, **kwargs})


def test_parse_existing_and_dropless():
    assert autoshard.MoE.parse("existing=true,capacity_factor=none,expert_axis=data") == DROPLESS


def test_experts_divisible_by_expert_axis():
    model, args, kwargs = models.hf_mixtral(layers=1, experts=3, top_k=2)
    with pytest.raises(PlanError, match="3 experts, but they must be divisible by the size 2"):
        _ = autoshard.compile(model, autoshard.Mesh(data=2), args, kwargs, moe=DROPLESS).plan


@pytest.mark.parametrize("mesh, groups, origin", [({"model": 4}, None, "one per rank of expert axis `model`"),
                                                  ({"data": 2, "model": 2}, 4, "MoE groups=4")])
def test_tokens_not_divisible_by_the_routing_groups_say_where_the_groups_came_from(mesh, groups, origin):
    """14 tokens, experts over `model`: 4 groups by default on model=4, or the user's 4 on data=2 x model=2 (the
    message said "one per rank of expert axis" for an explicit groups= too)."""
    model, args, kwargs = models.hf_mixtral(layers=1, batch=2, seq=7)
    opts = autoshard.MoE(existing=True, expert_axis="model", capacity_factor=None, groups=groups)
    with pytest.raises(PlanError, match=rf"routes 14 tokens, but they must be divisible by the 4 routing groups "
                                        rf"\({origin}\)\. Use a batch whose tokens are a multiple of 4\."):
        _ = autoshard.compile(model, autoshard.Mesh(**mesh), args, kwargs, moe=opts).plan


def _worker(rank, world_size):
    comm = DistCommunicator(autoshard.Mesh(data=2), timeout=60)
    model, args, kwargs = models.hf_mixtral(layers=2)
    plan = autoshard.compile(model, autoshard.Mesh(data=2), args, kwargs, moe=DROPLESS).plan
    module = plan.rank_program(rank)
    a, kw = plan.shard_inputs(rank, args, kwargs)
    with use(comm):
        loss = loss_of(module(*a, **kw))
        loss.backward()
    return (loss.detach(), {n: p.grad for n, p in module.named_parameters()}, plan.param_specs(),
            dict(collective_counts(comm.log, "forward")), dict(collective_counts(comm.log, "backward")))


@pytest.mark.gloo
def test_mixtral_dropless_on_two_gloo_processes_equals_hugging_face():
    results = spawn(_worker, 2, timeout=300, start_method="forkserver")
    model, args, kwargs = models.hf_mixtral(layers=2)
    main, grads = hf_reference(model, args, kwargs)
    specs = results[0][2]
    for rank in range(2):
        loss, local, _, fwd, bwd = results[rank]
        torch.testing.assert_close(loss, main, rtol=RTOL, atol=ATOL)
        assert fwd[("all_to_all", "data")] == 4 and bwd[("all_to_all", "data")] == 4  # 2 layers x (2 + 2)
        assert local["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 2
    for fqn, g in grads.items():
        real = assemble([results[r][1][fqn] for r in range(2)], specs[fqn], autoshard.Mesh(data=2))
        torch.testing.assert_close(real, g, rtol=RTOL, atol=ATOL, msg=lambda m, fqn=fqn: f"{fqn}: {m}")


def test_mixtral_at_a_new_batch_shape_traces_hugging_faces_branch_for_the_run_device():
    """A sharded Mixtral (with its router load-balancing loss) called at a batch shape other than the example's."""
    from autoshard.runtime import SimWorld

    mesh = autoshard.Mesh(data=2)
    model, args, kwargs = models.hf_mixtral(batch=4)
    half = {k: v[:2] for k, v in kwargs.items()}
    want = loss_of(model(**half)).detach()

    def body(rank):  # a copy each: models built in rank threads at once would draw their weights from one generator
        sharded = autoshard.compile(copy.deepcopy(model), mesh, args, kwargs)
        return loss_of(sharded(**{k: v.chunk(2)[rank] for k, v in half.items()})).detach()

    losses = SimWorld(mesh, timeout=120).run(body)
    torch.testing.assert_close(sum(losses) / 2, want, rtol=1e-5, atol=1e-6)
