"""Mixed precision (``precision=autoshard.MixedPrecision(...)``) and models with ``torch.autocast`` regions.

References: the unsharded model run under the same policy on one device — parameters cast to ``param_dtype`` for
compute (``functional_call`` with ``p.to(param_dtype)``), floating inputs cast, the fp32 parameters receiving the
gradients — and the plain fp32 model. A sharded bf16 program sums in other orders and rounds partial sums to bf16,
so it equals the policy's reference to bf16 rounding (a few 1e-3 relative per gradient tensor), not bit for bit;
the tolerances below are set to catch a missing or doubled gradient sync (errors of 50 % or more).
"""

from __future__ import annotations

import copy
import warnings

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

import pytest
import torch
from autoshard.cost_models.compute import compute_time
from autoshard.cost_models.profile import HardwareProfile, LinkCost, load_profile, profile_from_dict, profile_to_toml
from autoshard.passes.mixed_precision import autocast_input_dtypes
from torch import nn

import autoshard
from autoshard import Partial, Shard
from autoshard import meta as M
from autoshard.compiler.collective_kinds import is_kind
from autoshard.errors import PlanError
from autoshard.compiler.plan import loss_of
from autoshard.runtime import SimWorld
from examples import models

BF16 = autoshard.MixedPrecision(torch.bfloat16)
MESH = {"data": 2, "model": 2}


def _three_adamw_steps(sharded, rank, args, kwargs):
    """(losses, state before, state after, parameter dtypes, optimizer state dtypes) of 3 AdamW steps on this
    rank's share of the batch."""
    a, k = sharded.plan.shard_inputs(rank, args, kwargs)
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    before = autoshard.full_state_dict(sharded)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = loss_of(sharded(*a, **k))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    dtypes = {p.dtype for p in sharded.parameters()}
    state = {t.dtype for s in opt.state.values() for t in s.values() if t.dim() > 0}
    return losses, before, autoshard.full_state_dict(sharded), dtypes, state


def _model(name, layers=2):
    model, args, kwargs = models.FACTORIES[name](layers=layers)
    return model, tuple(args), kwargs


def _cast_inputs(tree, dtype):
    return torch.utils._pytree.tree_map(
        lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, tree)


def _under_policy(model, args, kwargs, policy):
    """One device, eager, under ``policy``: (loss, {name: fp32 gradient})."""
    model = copy.deepcopy(model)
    params = {n: p.to(policy.param_dtype) for n, p in model.named_parameters()}
    a, k = _cast_inputs((args, kwargs), policy.param_dtype)
    loss = loss_of(torch.func.functional_call(model, params, a, k))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _fp32(model, args, kwargs):
    model = copy.deepcopy(model)
    loss = loss_of(model(*args, **kwargs))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _rel(a, b, floor):
    return ((a.float() - b.float()).norm() / max(b.float().norm().item(), floor)).item()


def _by_model_name(grads, plan):
    """``grads`` (by the program's names) under every name the model gives each tensor (tied weights)."""
    out = dict(grads)
    for node in plan.graph_module.graph.nodes:
        if node.op == "get_attr" and node.meta.get(M.PARAM) in grads:
            for alias in node.meta.get(M.ALIASES, ()):
                out.setdefault(alias, grads[node.meta[M.PARAM]])
    return out


def _check_grads(grads, ref, tol):
    """Every gradient of ``ref`` against ``grads``, relative per tensor (floored at 1e-3 of the global norm: the
    attention key bias's gradient is zero up to rounding) and over all tensors together."""
    total = torch.cat([g.flatten() for g in ref.values()]).norm().item()
    assert set(ref) <= set(grads), sorted(set(ref) - set(grads))
    for name, g in ref.items():
        assert grads[name].dtype == g.dtype == torch.float32, name
        err = _rel(grads[name], g, 1e-3 * total)
        assert err < tol, f"{name}: relative error {err:.3g}"
    mine = torch.cat([grads[n].flatten() for n in ref])
    theirs = torch.cat([g.flatten() for g in ref.values()])
    assert _rel(mine, theirs, 0.0) < tol / 3


@pytest.mark.parametrize("name", ["gpt", "hf_llama"])
def test_megatron_bf16_equals_the_policy_on_one_device(name):
    # two GPT layers: one traced, one copied by layer reuse (both must read masters); one HF Llama layer (time)
    model, args, kwargs = _model(name, layers=2 if name == "gpt" else 1)
    mesh = autoshard.Mesh(**MESH)
    plan = autoshard.compile(copy.deepcopy(model), mesh, args, kwargs, annotations=models.megatron(mesh, name),
                             precision=BF16).plan
    sim = plan.simulate(args, kwargs)
    ref_loss, ref_grads = _under_policy(model, args, kwargs, BF16)
    fp32_loss, fp32_grads = _fp32(model, args, kwargs)
    losses = [loss_of(o).detach() for o in sim.outputs]
    assert all(torch.equal(x, losses[0]) for x in losses)
    assert losses[0].dtype == ref_loss.dtype  # bf16 for the GPT; HF Llama computes its loss in fp32
    torch.testing.assert_close(losses[0].float(), ref_loss.float(), rtol=8e-3, atol=0)  # one bf16 ulp
    assert abs(losses[0].item() - fp32_loss.item()) / fp32_loss.item() < 2e-2  # the acceptance bound
    grads = _by_model_name(sim.grads, plan)
    _check_grads(grads, ref_grads, tol=6e-2)
    # bf16 computes: the gradients are not the fp32 model's
    assert max(_rel(grads[n], g, 1e-6) for n, g in fp32_grads.items() if g.norm() > 0) > 1e-3
    # the program: parameters stay fp32 (the masters), every matmul runs in bf16, the Megatron plan is kept
    rank1 = plan.rank_program(1)
    assert {p.dtype for p in rank1.parameters()} == {torch.float32}
    casts = [n for n in plan.graph_module.graph.nodes if n.meta.get(M.PRECISION_CAST)]
    params = {n for n in plan.graph_module.graph.nodes if n.op == "get_attr" and n.meta.get(M.REQUIRES_GRAD)}
    assert {c.args[0] for c in casts} == params and len(casts) == len(params)  # one cast per parameter
    for n in casts:
        assert n.meta[M.SPEC] == n.args[0].meta[M.SPEC]  # the cast runs where the parameter lies (its shard)
    linears = [n for n in plan.graph_module.graph.nodes if n.target is torch.ops.aten.linear.default]
    assert linears and all(n.meta["val"].dtype == torch.bfloat16 for n in linears)
    fp32_plan = autoshard.compile(copy.deepcopy(model), mesh, args, kwargs,
                                  annotations=models.megatron(mesh, name)).plan
    assert _kinds(plan) == _kinds(fp32_plan)
    # gradient syncs of parameters run on the bf16 compute copies (reduce_dtype defaults to param_dtype)
    syncs = [n for n in plan.graph_module.graph.nodes if is_kind(n, "grad_all_reduce")
             and n.args[0].meta.get(M.PRECISION_CAST)]
    assert syncs and all(n.meta["val"].dtype == torch.bfloat16 for n in syncs)


def _kinds(plan):
    return sorted((info.kind, info.axes) for _, info in plan.collectives())


def test_reduce_dtype_fp32_syncs_gradients_on_the_fp32_masters():
    model, args, kwargs = _model("gpt")
    mesh = autoshard.Mesh(**MESH)
    policy = autoshard.MixedPrecision(torch.bfloat16, reduce_dtype=torch.float32)
    plan = autoshard.compile(copy.deepcopy(model), mesh, args, kwargs, annotations=models.megatron(mesh, "gpt"),
                             precision=policy).plan
    graph = plan.graph_module.graph
    syncs = [n for n in graph.nodes if is_kind(n, "grad_all_reduce") and n.args[0].op == "get_attr"]
    assert syncs and all(n.meta["val"].dtype == torch.float32 for n in syncs)
    assert not [n for n in graph.nodes if is_kind(n, "grad_all_reduce") and n.args[0].meta.get(M.PRECISION_CAST)]
    assert all(len(n.users) == 1 and next(iter(n.users)).meta.get(M.PRECISION_CAST) for n in syncs)
    assert plan.context.report["reduce_precision"]["on_master"] == len(syncs)
    sim = plan.simulate(args, kwargs)
    _check_grads(_by_model_name(sim.grads, plan), _under_policy(model, args, kwargs, policy)[1], tol=6e-2)


@pytest.mark.parametrize(("reduce_dtype", "zero"), [(torch.float16, 0), (torch.float32, 1)])
def test_reduce_dtype_between_casts(reduce_dtype, zero):
    """A sync that cannot sit on the master (another reduce dtype; behind ZeRO's gather) runs between casts."""
    model, args, kwargs = _model("gpt")
    mesh = autoshard.Mesh(**MESH)
    policy = autoshard.MixedPrecision(torch.bfloat16, reduce_dtype=reduce_dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # parameters too small to shard over the data axis are named in a warning
        plan = autoshard.compile(copy.deepcopy(model), mesh, args, kwargs, annotations=models.megatron(mesh, "gpt"),
                                 precision=policy, zero=zero).plan
    assert plan.context.report["reduce_precision"]["cast_around"] > 0
    for n in plan.graph_module.graph.nodes:
        if is_kind(n, "grad_all_reduce") and n.meta["val"].dtype == reduce_dtype and n.args[0].op != "get_attr":
            up, (down,) = n.args[0], n.users
            assert up.target is down.target is torch.ops.aten._to_copy.default
            assert down.meta["val"].dtype == up.args[0].meta["val"].dtype == torch.bfloat16
    sim = plan.simulate(args, kwargs)
    _check_grads(_by_model_name(sim.grads, plan), _under_policy(model, args, kwargs, policy)[1], tol=6e-2)


def test_reduce_dtype_under_zero2_is_named_in_a_warning():
    model, args, kwargs = _model("gpt")
    policy = autoshard.MixedPrecision(torch.bfloat16, reduce_dtype=torch.float32)
    with pytest.warns(UserWarning, match=r"reduce_dtype=torch.float32\) is not honoured for \d+ parameter"):
        mesh = autoshard.Mesh(**MESH)
        autoshard.compile(model, mesh, args, kwargs, annotations=models.megatron(mesh, "gpt"), precision=policy, zero=2)


def test_zero3_gathers_bf16_copies_and_output_dtype_casts_the_loss():
    model, args, kwargs = _model("gpt")
    mesh = autoshard.Mesh(**MESH)
    policy = autoshard.MixedPrecision(torch.bfloat16, output_dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # parameters too small to shard over the data axis are named in a warning
        plan = autoshard.compile(copy.deepcopy(model), mesh, args, kwargs, annotations=models.megatron(mesh, "gpt"),
                                 precision=policy, zero=3).plan
    gathers = [n for n in plan.graph_module.graph.nodes if M.COLLECTIVE in n.meta
               and n.meta[M.COLLECTIVE].kind.startswith("all_gather") and n.meta[M.COLLECTIVE].axes == ("data",)]
    # the cast runs on the stored shard, so the gather moves bf16 bytes (FSDP2 casts at all-gather)
    assert gathers and all(n.meta["val"].dtype == torch.bfloat16 and n.args[0].meta.get(M.PRECISION_CAST)
                           for n in gathers)
    sim = plan.simulate(args, kwargs)
    ref_loss, ref_grads = _under_policy(model, args, kwargs, policy)
    loss = loss_of(sim.outputs[0])
    assert loss.dtype == torch.float32 and loss.item() == loss.to(torch.bfloat16).item()  # bf16 loss, cast
    torch.testing.assert_close(loss, ref_loss.float(), rtol=8e-3, atol=0)
    _check_grads(_by_model_name(sim.grads, plan), ref_grads, tol=6e-2)


def test_floating_inputs_are_cast_and_get_fp32_gradients():
    model, (x,), _, plan = models.gpt_block()
    policy = autoshard.MixedPrecision(torch.bfloat16)
    compiled = autoshard.compile(copy.deepcopy(model), autoshard.Mesh(model=2), (x,), annotations=plan,
                                 precision=policy).plan
    holder = next(n for n in compiled.graph_module.graph.nodes if n.op == "placeholder")
    assert holder.meta["val"].dtype == torch.float32  # the caller passes fp32
    assert [u.meta.get(M.PRECISION_CAST) for u in holder.users] == [True]
    world = SimWorld(compiled.mesh)

    def body(rank):
        xs = x.detach().clone().requires_grad_(True)  # no data axis: every rank takes the whole input
        loss = compiled.rank_program(rank)(xs)
        loss.backward()
        return loss.detach(), xs.grad

    out = world.run(body)
    ref_x = x.detach().clone().requires_grad_(True)
    ref = copy.deepcopy(model)
    params = {n: p.to(torch.bfloat16) for n, p in ref.named_parameters()}
    ref_loss = torch.func.functional_call(ref, params, (ref_x.to(torch.bfloat16),))
    ref_loss.backward()
    for loss, grad in out:
        torch.testing.assert_close(loss.float(), ref_loss.detach().float(), rtol=8e-3, atol=0)
        assert grad.dtype == torch.float32
        assert _rel(grad, ref_x.grad, 0.0) < 2e-2


def test_pipeline_stages_compute_in_bf16_and_send_bf16_activations():
    from autoshard.api.sharded_module import make_options
    from autoshard.compiler.pipeline import Pipeline, build_pipeline_plan
    from tests.test_pipeline import SMALL, _run_stages

    model, args, kwargs = models.FACTORIES["gpt"](**{**SMALL, "layers": 2})
    mesh = autoshard.Mesh(pipe=2)
    pplan = build_pipeline_plan(model, mesh, args, kwargs, make_options(None, "data", "error", mesh, precision=BF16),
                                Pipeline(microbatches=2))
    assert [b.dtypes for b in pplan.split.boundaries] == [(torch.bfloat16,)]
    mb = SMALL["batch"] // 2
    ref, _ = _under_policy(model, tuple(a[:mb] for a in args), {}, BF16)
    out = _run_stages(pplan, args, kwargs)[0]
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=8e-3, atol=0)


def test_three_adamw_steps_update_fp32_masters_like_the_policy_on_one_device():
    model, args, kwargs = _model("gpt")
    mesh = autoshard.Mesh(**MESH)
    policy = autoshard.MixedPrecision(torch.bfloat16, reduce_dtype=torch.float32)
    world = SimWorld(mesh)

    def body(rank):
        sharded = autoshard.compile(copy.deepcopy(model), mesh, args, kwargs, annotations=models.megatron(mesh, "gpt"),
                                    precision=policy, comm=world.communicator(rank))
        return _three_adamw_steps(sharded, rank, args, kwargs)

    _check_training(model, args, kwargs, policy, world.run(body))


def _check_training(model, args, kwargs, policy, out):
    """Per rank ``(losses, weights before, weights after, parameter dtypes, optimizer state dtypes)`` of 3 AdamW
    steps (lr 1e-2) against the policy's own 3 steps on one device."""
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_losses = []
    for _ in range(3):
        opt.zero_grad()
        params = {n: p.to(policy.param_dtype) for n, p in ref.named_parameters()}
        loss = loss_of(torch.func.functional_call(ref, params, args, kwargs))
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    want = ref.state_dict()
    for losses, before, after, dtypes, state in out:
        assert dtypes == {torch.float32} and state == {torch.float32}  # fp32 masters and optimizer state
        # the GPT's loss is a bf16 number (one ulp is 0.8 %), and data ranks average their rounded losses
        assert losses == pytest.approx(ref_losses, rel=2e-2)
        assert losses[-1] < losses[0]
        for name, w in want.items():
            assert after[name].dtype == torch.float32
            if w.is_floating_point() and name in before and not name.endswith("attn.k.bias"):
                # (softmax ignores the key bias: its gradient is rounding noise, AdamW's step its sign)
                moved = (after[name] - before[name]).abs().max().item()
                assert moved > 1e-3, f"{name} did not change"  # lr 1e-2: AdamW moves every weight
                # the policy's own steps: equal up to updates whose sign bf16 rounding flips
                assert (after[name] - w).abs().max().item() <= 3 * 2e-2 + 1e-6, name
                assert _rel(after[name] - before[name], w - before[name], 1e-6) < 0.35, name


def test_memory_model_counts_fp32_masters_and_bf16_compute_copies():
    model, args, kwargs = _model("gpt")
    mesh = autoshard.Mesh(**MESH)
    costs = {}
    for policy in (None, BF16):
        plan = autoshard.compile(copy.deepcopy(model), mesh, args, kwargs, annotations=models.megatron(mesh, "gpt"),
                                 precision=policy).plan
        costs[policy] = plan.cost().memory
    fp32, bf16 = costs[None], costs[BF16]
    # parameters: the fp32 masters (what fp32 holds) plus a bf16 compute copy (half of them); gradients and Adam's
    # state stay the masters'; activations saved for backward are bf16 (half)
    assert bf16.parameters == fp32.parameters * 3 // 2
    assert (bf16.gradients, bf16.optimizer) == (fp32.gradients, fp32.optimizer)
    assert bf16.activations == fp32.activations // 2


# ---- torch.autocast regions -------------------------------------------------------------------------------
class AutocastMLP(nn.Module):
    """A Megatron MLP inside ``torch.autocast`` with a nested region that turns autocast off."""

    def __init__(self, hidden: int = 16):
        super().__init__()
        self.fc1 = nn.Linear(hidden, 32)
        self.fc2 = nn.Linear(32, hidden)

    def forward(self, x, target):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.relu(self.fc1(x))
            with torch.autocast("cpu", enabled=False):
                h = h.float() * 2.0  # fp32 here, cast back to bf16 by fc2's autocast
            out = self.fc2(h)
        return nn.functional.mse_loss(out.float(), target)


_MLP_PLAN = {"fc1.weight": ("R", "S(0)"), "fc1.bias": ("R", "S(0)"), "fc2.weight": ("R", "S(1)")}


@pytest.mark.parametrize("mesh_dims", [{"data": 2}, MESH])
def test_autocast_region_shards_and_equals_eager_autocast(mesh_dims):
    torch.manual_seed(0)
    model = AutocastMLP()
    x, t = torch.randn(8, 16), torch.randn(8, 16)
    mesh = autoshard.Mesh(**mesh_dims)
    plan = {k: v for k, v in _MLP_PLAN.items()} if "model" in mesh_dims else {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "no sharding rule ... runs replicated" warning
        compiled = autoshard.compile(copy.deepcopy(model), mesh, (x, t), annotations=plan).plan
    graph = compiled.graph_module.graph
    assert not [n for n in graph.nodes if "autocast" in str(n.target)]
    linears = [n for n in graph.nodes if n.target is torch.ops.aten.linear.default]
    assert [n.meta["val"].dtype for n in linears] == [torch.bfloat16, torch.bfloat16]
    if "model" in mesh_dims:  # column- then row-parallel, batch on data: the plan of the same model without autocast
        assert [n.meta[M.SPEC] for n in linears] == [(Shard(0), Shard(1)), (Shard(0), Partial())]
    sim = compiled.simulate((x, t))
    ref = copy.deepcopy(model)
    loss = ref(x, t)
    loss.backward()
    # data parallel only, the forward is eager's on half batches (the loss to fp32 rounding); a row-parallel
    # linear sums bf16 partial products, and gradients of the bf16 weight copies are summed over ranks in bf16
    exact = "model" not in mesh_dims
    for out in sim.outputs:
        torch.testing.assert_close(out, loss.detach(), **({"rtol": 1e-6, "atol": 1e-7} if exact else
                                                           {"rtol": 2e-3, "atol": 0}))
    for name, p in ref.named_parameters():
        torch.testing.assert_close(sim.grads[name], p.grad, rtol=2e-2, atol=2e-3)
        assert _rel(sim.grads[name], p.grad, 0.0) < 1e-2, name


def test_autocast_casts_are_asked_of_autocast_itself():
    cpu = ("cpu", torch.bfloat16, True)
    assert autocast_input_dtypes(torch.ops.aten.mm.default, (((4, 8), torch.float32), ((8, 2), torch.float32)),
                                 cpu) == (torch.bfloat16, torch.bfloat16)
    assert autocast_input_dtypes(torch.ops.aten.relu.default, (((4,), torch.float32),), cpu) == (None,)


# ---- profiles: FLOP peaks per dtype ----------------------------------------------------------------------
def test_profiles_carry_flop_peaks_per_dtype_and_compute_time_uses_the_node_dtype():
    gpu = load_profile("gpu-8x-nvlink")
    assert gpu.peak_flops == 6.7e13 and gpu.flops_for(torch.float32) == 6.7e13
    assert gpu.flops_for(torch.bfloat16) == 9.89e14 and gpu.flops_for("float16") == 9.89e14
    assert gpu.flops_for(torch.float64) == 6.7e13  # not listed: the fp32 peak
    old = profile_from_dict({"name": "old", "peak_flops": 1e12, "mem_bandwidth": 1e20, "memory_bytes": 1 << 30,
                             "link": {"alpha": 0.0, "beta": 0.0}})
    assert old.flops_for(torch.bfloat16) == 1e12 and old.dtype_flops == ()
    fast_bf16 = HardwareProfile("t", {"float32": 1e12, "bfloat16": 8e12}, 1e20, 1 << 30, False, LinkCost(0, 0))

    def matmul_time(dtype):
        exported = torch.export.export(nn.Linear(64, 64, bias=False).to(dtype), (torch.randn(32, 64, dtype=dtype),))
        node = next(n for n in exported.graph.nodes if n.target is torch.ops.aten.linear.default)
        return compute_time(node, fast_bf16)

    assert matmul_time(torch.float32) == pytest.approx(8 * matmul_time(torch.bfloat16))
    assert profile_from_dict(tomllib.loads(profile_to_toml(fast_bf16))) == fast_bf16  # written and read back
    with pytest.raises(PlanError, match="float32 entry"):
        HardwareProfile("t", {"bfloat16": 8e12}, 1e9, 1 << 30, False, LinkCost(0, 0))
    with pytest.raises(PlanError, match="give fp32's peak once"):
        HardwareProfile("t", 1e12, 1e9, 1 << 30, False, LinkCost(0, 0), dtype_flops={"float32": 2e12})
    with pytest.raises(PlanError, match="int8"):
        HardwareProfile("t", {"float32": 1e12, "int8": 8e12}, 1e9, 1 << 30, False, LinkCost(0, 0))


# ---- options ---------------------------------------------------------------------------------------------
def test_bad_precision_options_are_refused():
    model, args, kwargs = _model("gpt")
    mesh = autoshard.Mesh(**MESH)
    with pytest.raises(PlanError, match="param_dtype"):
        autoshard.MixedPrecision(param_dtype=torch.int32)
    with pytest.raises(PlanError, match="reduce_dtype"):
        autoshard.MixedPrecision(torch.bfloat16, reduce_dtype="float32")
    with pytest.raises(PlanError, match="option precision"):
        autoshard.compile(model, mesh, args, kwargs, precision="bf16")


# ---- real processes ------------------------------------------------------------------------------------------
# one layer of HF Llama on 2 processes (data=2: the gradients all-reduced in bf16 by gloo); data=2 x model=2 and
# the fp32 reduction are the simulator's tests above
_GLOO_CASES = {"hf_llama": autoshard.MixedPrecision(torch.bfloat16)}
_GLOO_MESH = {"data": 2}


def _gloo_worker(rank, world_size):
    from autoshard.runtime import DistCommunicator, use

    mesh = autoshard.Mesh(**_GLOO_MESH)
    comm = DistCommunicator(mesh, timeout=60)
    out = {}
    for name, policy in _GLOO_CASES.items():
        model, args, kwargs = _model(name, layers=1)
        with use(comm):
            sharded = autoshard.compile(model, mesh, args, kwargs, annotations=models.megatron(mesh, name),
                                        precision=policy, comm=comm)
            out[name] = _three_adamw_steps(sharded, rank, args, kwargs)
    return out


@pytest.mark.gloo
def test_three_adamw_steps_on_two_gloo_processes_equal_the_policy_on_one_device():
    from autoshard.runtime import spawn

    results = spawn(_gloo_worker, 2, timeout=240, start_method="forkserver")
    for name, policy in _GLOO_CASES.items():
        model, args, kwargs = _model(name, layers=1)
        _check_training(model, args, kwargs, policy, [r[name] for r in results])
