"""ZeRO/FSDP storage (``zero=1|2|3``): parameters stored sharded over the data axis, gathered for use.

Each stage equals one device (loss and every gradient; three AdamW steps), on the simulator and on 4 gloo
processes; stage 3 stores at most 30% of the parameters per rank with Megatron TP on the model axis, and frees the
gathered copies after forward (gathering them again in backward)."""

from __future__ import annotations

import copy

import pytest
import torch

import autoshard
from autoshard.compiler.collective_kinds import kind_of
from autoshard.compiler.plan import loss_of
from autoshard.runtime import DistCommunicator, SimWorld, spawn, use
from autoshard.runtime import zero as zero_runtime
from examples import models
from tests.test_equivalence import assert_simulated_equals_one_device, reference

MESH = {"data": 2, "model": 2}
EPS = 1e-3  # Adam's eps: large enough that 1e-7 gradient differences stay 1e-7 parameter differences


def _model(name):
    return models.FACTORIES[name](layers=1) if name != "mlp" else models.mlp()


def _plan(name, stage, **kw):
    model, args, kwargs = _model(name)
    mesh = autoshard.Mesh(**MESH)
    sharded = autoshard.compile(copy.deepcopy(model), mesh, args, kwargs, annotations=models.megatron(mesh, name),
                                zero=stage, **kw)
    return model, args, kwargs, sharded.plan


def run_resharded(module, args, kwargs) -> tuple[dict, int, list]:
    """Forward under ZeRO-3's reshard hooks, then backward: (the gathered copies the forward registered, how many of
    them are still alive when it returns, the all-gathers backward ran)."""
    from autoshard.runtime.communicator import current

    with zero_runtime.reshard_after_forward():
        session = zero_runtime._LOCAL.session
        loss = loss_of(module(*args, **kwargs))
        alive = sum(g.ref() is not None for g in session.values())
    log = current().log
    before = len(log)
    loss.backward()
    return session, alive, [r for r in log[before:] if r.kind == "all_gather" and r.phase == "backward"]


def _stored_fraction(plan) -> float:
    from autoshard.placements import local_shape

    total = stored = 0
    for n in plan.graph_module.graph.nodes:
        if n.op == "get_attr" and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].requires_grad:
            shape = tuple(n.meta["val"].shape)
            total += n.meta["val"].numel()
            stored += torch.Size(local_shape(shape, plan.param_specs()[n.meta.get("autoshard.param", n.target)],
                                             plan.mesh)).numel()
    return stored / total


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("name", ["gpt", "hf_llama"])
def test_each_stage_equals_one_device(name, stage):
    model, args, kwargs, plan = _plan(name, stage)
    assert_simulated_equals_one_device(model, args, kwargs, plan)
    stored = plan.param_storage()
    assert stored and all(s.stage == stage for s in stored.values())
    # the collectives each stage is defined by, in rank 0's program
    kinds = [kind_of(n).name for n in plan.rank_program(0).graph.nodes if kind_of(n) is not None]
    if stage == 1:
        assert "all_gather_reshard" not in kinds and kinds.count("all_gather") >= len(stored)
    elif stage == 2:
        # a parameter whose users compute replicated over the data axis (the position embedding) has no gradient
        # to reduce: its gather's backward keeps this rank's slice (a plain all_gather)
        assert "all_gather_reshard" not in kinds and kinds.count("all_gather_sync") >= len(stored) - 1
        assert kinds.count("all_gather_sync") + kinds.count("all_gather") >= len(stored)
    else:  # one gather per parameter, or several in one all_gather_reshard_group (passes/group_gathers.py)
        grouped = sum(len(n.args[0]) for n in plan.rank_program(0).graph.nodes if kind_of(n) is not None
                      and kind_of(n).name == "all_gather_reshard_group")
        assert kinds.count("all_gather_reshard") + grouped >= len(stored) and "all_gather_sync" not in kinds


def test_stage_3_stores_at_most_30_percent_of_the_parameters_per_rank():
    for name in ("gpt", "hf_llama"):
        _, _, _, plan = _plan(name, 3)
        _, _, _, plain = _plan(name, 0)
        assert _stored_fraction(plan) <= 0.30, (name, _stored_fraction(plan))
        assert _stored_fraction(plain) > 0.45  # Megatron TP alone: about half


def test_stage_3_frees_gathered_parameters_after_forward_and_gathers_them_again_in_backward():
    """Weak references to every gathered copy: all dead once forward returns at stage 3 (stage 2 keeps them for
    backward); backward then gathers each again, and the gradients equal stage 2's."""
    out = {}
    for stage in (2, 3):
        _, args, kwargs, plan = _plan("gpt", stage)
        world = SimWorld(plan.mesh)

        def body(rank, plan=plan, args=args, kwargs=kwargs):
            module = plan.rank_program(rank)
            session, alive, regathers = run_resharded(module, *plan.shard_inputs(rank, args, kwargs))
            return len(session), alive, len(regathers), {n: p.grad for n, p in module.named_parameters()}

        out[stage] = world.run(body)
    gathered3, alive3, regathers3, grads3 = out[3][0]
    gathered2, _, regathers2, grads2 = out[2][0]
    assert gathered3 > 0 and alive3 == 0, (gathered3, alive3)
    assert gathered2 == 0 and regathers2 == 0  # stage 2: plain all_gather_sync, kept by autograd
    assert regathers3 >= 1  # every saved gathered weight came back through a gather in backward
    for n in grads2:
        torch.testing.assert_close(grads3[n], grads2[n], rtol=0, atol=0)


def test_zero_composes_with_the_other_mode_program_and_keeps_names():
    """eval() makes the other mode's program with the same storage; parameters keep the model's names."""
    model, (x, t), _ = models.mlp()
    mesh = autoshard.Mesh(**MESH)
    world = SimWorld(mesh)

    def body(rank):
        sharded = autoshard.compile(copy.deepcopy(model), mesh, (x, t), zero=3, comm=world.communicator(rank))
        a = tuple(autoshard.data_shard(v, mesh, rank) for v in (x, t))
        train_loss = sharded(*a)
        sharded.eval()
        with torch.no_grad():
            eval_loss = sharded(*a)
        return [n for n, _ in sharded.named_parameters()], train_loss.detach(), eval_loss

    out = world.run(body)
    with torch.no_grad():
        ref = model(x, t)
    for names, train_loss, eval_loss in out:
        assert names == [n for n, _ in model.named_parameters()]
        torch.testing.assert_close(train_loss, ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(eval_loss, ref, rtol=1e-5, atol=1e-6)


def test_parameters_that_cannot_be_sharded_are_named_in_a_warning():
    mesh = autoshard.Mesh(**MESH)
    model, args, _ = _model("gpt")
    with pytest.warns(UserWarning, match=r"zero=3: \d+ parameter\(s\) stay stored whole \(blocks\.0\.attn\.q\.bias"):
        autoshard.compile(model, mesh, args, annotations=models.megatron(mesh, "gpt"), zero=3)


def test_bad_zero_options_are_refused():
    model, args, _ = _model("mlp")
    with pytest.raises(autoshard.PlanError, match="option zero is 4"):
        autoshard.compile(model, autoshard.Mesh(**MESH), args, zero=4)
    with pytest.raises(autoshard.PlanError, match="zero='auto' lets the plan search choose"):
        autoshard.compile(model, autoshard.Mesh(**MESH), args, zero="auto")


# ---- real processes ------------------------------------------------------------------------------------------
def _gloo_worker(rank, world_size):
    mesh = autoshard.Mesh(**MESH)
    comm = DistCommunicator(mesh, timeout=60)
    out = {}
    for name in ("gpt", "hf_llama"):
        for stage in (1, 2, 3):
            model, args, kwargs = _model(name)
            with use(comm):
                sharded = autoshard.compile(model, mesh, args, kwargs, annotations=models.megatron(mesh, name),
                                            zero=stage, comm=comm)
                a, k = sharded.plan.shard_inputs(rank, args, kwargs)
                opt = torch.optim.AdamW(sharded.parameters(), lr=0.01, eps=EPS)
                losses = []
                for _ in range(3):
                    loss = loss_of(sharded(*a, **k))
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    losses.append(loss.detach())
                out[name, stage] = (losses, autoshard.full_state_dict(sharded))
    return out


@pytest.mark.gloo
def test_three_adamw_steps_on_four_gloo_processes_equal_one_device():
    results = spawn(_gloo_worker, 4, timeout=240, start_method="forkserver")
    for name in ("gpt", "hf_llama"):
        model, args, kwargs = _model(name)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, eps=EPS)
        ref_losses = []
        for _ in range(3):
            loss = loss_of(model(*args, **kwargs))
            loss.backward()
            opt.step()
            opt.zero_grad()
            ref_losses.append(loss.detach())
        for stage in (1, 2, 3):
            for rank_out in results:
                losses = rank_out[name, stage][0]
                for got, want in zip(losses, ref_losses):
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            for k, v in model.state_dict().items():
                torch.testing.assert_close(results[0][name, stage][1][k], v, rtol=1e-4, atol=1e-5,
                                           msg=lambda m, k=k, s=stage, n=name: f"{n} zero={s} {k}: {m}")


def _pipeline_worker(rank, world_size, stage):
    from autoshard.api.sharded_module import make_options
    from autoshard.api.pipelined_module import PipelineRunner
    from autoshard.compiler.pipeline import Pipeline, build_pipeline_plan

    mesh = autoshard.Mesh(pipe=2, data=2)
    comm = DistCommunicator(mesh, timeout=60)
    model, args, kwargs = models.gpt(layers=4, hidden=32, heads=4, seq=8, batch=8)
    pplan = build_pipeline_plan(model, mesh, args, kwargs, make_options(None, "data", "error", mesh, zero=stage),
                                Pipeline(microbatches=4))
    runner = PipelineRunner(pplan, comm=comm)
    return runner.step(*args, **kwargs), runner.grads()


@pytest.mark.gloo
def test_zero_3_composes_with_pipeline_stages_on_gloo():
    """pipe=2 x data=2 (4 processes), 1F1B over 4 microbatches, ZeRO-3 on the data axis: loss and every gradient
    equal one device; parameters are stored sharded over the data axis inside each stage."""
    from autoshard.api.sharded_module import make_options
    from autoshard.compiler.pipeline import Pipeline, build_pipeline_plan

    model, args, kwargs = models.gpt(layers=4, hidden=32, heads=4, seq=8, batch=8)
    mesh = autoshard.Mesh(pipe=2, data=2)
    pplan = build_pipeline_plan(copy.deepcopy(model), mesh, args, kwargs,
                                make_options(None, "data", "error", mesh, zero=3), Pipeline(microbatches=4))
    storage = pplan.microbatch_plan.param_storage()
    assert storage and all(s.stage == 3 for s in storage.values())
    results = spawn(_pipeline_worker, 4, 3, timeout=240, start_method="forkserver")
    ref_loss, ref_grads = reference(model, args, kwargs)
    for loss, _ in results:
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    grads = pplan.assemble_grads([g for _, g in results])
    assert set(grads) >= {n for n in ref_grads if n in pplan.param_specs()}
    for fqn, g in grads.items():
        torch.testing.assert_close(g, ref_grads[fqn], rtol=1e-4, atol=1e-5, msg=lambda m, f=fqn: f"{f}: {m}")


def test_zero_3_composes_with_expert_parallel_moe():
    """MoE experts sharded over the data axis (expert parallel) stay as they are; the dense parameters are stored
    ZeRO-3 over it: loss and every gradient equal the same MoE plan without ZeRO."""
    opts = autoshard.MoE(layers="blocks.*.mlp", every=2, num_experts=4, top_k=2, capacity_factor=2.0, init="random")
    mesh = autoshard.Mesh(**MESH)
    out = {}
    for stage in (0, 3):
        model, args, _ = models.gpt(batch=4, seq=8, layers=2, hidden=32)
        plan = autoshard.compile(model, mesh, args, moe=opts, annotations=models.megatron(mesh, "gpt"), zero=stage).plan
        out[stage] = (plan, plan.simulate(args))
    plan3, sim3 = out[3]
    _, sim0 = out[0]
    storage = plan3.param_storage()
    assert storage and not any(".experts." in name for name in storage)  # experts: already sharded over data
    torch.testing.assert_close(loss_of(sim3.outputs[0]), loss_of(sim0.outputs[0]), rtol=1e-5, atol=1e-6)
    assert set(sim3.grads) == set(sim0.grads)
    for fqn, g in sim0.grads.items():
        torch.testing.assert_close(sim3.grads[fqn], g, rtol=1e-5, atol=1e-6, msg=lambda m, f=fqn: f"{f}: {m}")


def test_zero_3_checkpoint_resumes_on_another_mesh_and_in_plain_pytorch(tmp_path):
    """Train 2 steps with ZeRO-3 on data=2 x model=2 and save (model and Adam state, both stored sharded); resume
    without ZeRO on model=4 and in plain PyTorch: the next 2 steps equal an uninterrupted run on one device."""
    from tests.test_checkpoint import _sim, assert_state_close, batches, compile_gpt, new_model, resume, train

    data = batches(4)
    path = str(tmp_path / "ckpt")
    base = new_model()
    mesh22, mesh4 = autoshard.Mesh(**MESH), autoshard.Mesh(model=4)

    def first(rank, comm):
        sharded = compile_gpt(copy.deepcopy(base), mesh22, comm=comm, example_inputs=data[0], zero=3)
        assert sharded.plan.param_storage()
        losses, opt = train(sharded, mesh22, rank, data[:2])
        autoshard.save(sharded, path, optimizer=opt)
        return losses

    losses = _sim(mesh22, first)[0]
    ref = copy.deepcopy(base)
    ref_losses, _ = train(ref, None, 0, data)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses[:2])) < 1e-5

    def second(rank, comm):
        sharded = compile_gpt(new_model(seed=5), mesh4, example_inputs=data[0], comm=comm)
        opt = resume(sharded, path)
        return train(sharded, mesh4, rank, data[2:], opt)[0], autoshard.full_state_dict(sharded)

    out = _sim(mesh4, second)
    assert max(abs(a - b) for a, b in zip(out[0][0], ref_losses[2:])) < 1e-5
    assert_state_close(out[0][1], ref.state_dict(), steps=4)
    plain = new_model(seed=5)
    opt = resume(plain, path)
    assert max(abs(a - b) for a, b in zip(train(plain, None, 0, data[2:], opt)[0], ref_losses[2:])) < 1e-5
