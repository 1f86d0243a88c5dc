"""A pipelined module is a module like any other: parameters by the model's names, state dicts, load_state_dict,
init_weights for a meta-built model, train()/eval(), and checkpoints (DCP) that load on another mesh, into a
ShardedModule or into the plain model — equal to what was saved.

Real processes (gloo, 4): a GPT (tied embedding and LM head) trains 4 Adam steps pipelined on pipe=2 x data=2,
compared with the one-device model (every loss, the first step's gradients, the weights after); a second run saves
after 2 steps, and the checkpoint loads into (a) the same pipelined mesh from a meta-built model, (b) pipe=2 x
model=2, (c) a ShardedModule on data=2 x model=2 with ZeRO-3 storage, (d) the plain model (autoshard.load and
DCP's own reader): every loaded value equals the saved one exactly, and 2 more steps continue the 4-step run. The
stage state dicts saved with torch's ``dcp.save`` load with ``dcp.load`` into the pipeline on pipe=2 x model=2 too.
The simulator runs the same paths without the schedule (the simulator has no point-to-point process group).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import autoshard
from autoshard.api.pipelined_module import PipelinedModule
from autoshard.errors import AutoshardError
from autoshard.runtime import SimWorld, spawn
from examples import models

SMALL = {"layers": 2, "hidden": 32, "heads": 4, "seq": 8, "batch": 8}
LR = 1e-2
PIPE = autoshard.Pipeline(microbatches=2, schedule="1f1b")
PIPE_DATA, PIPE_MODEL = {"pipe": 2, "data": 2}, {"pipe": 2, "model": 2}


def new_model(seed: int = 0) -> nn.Module:
    return models.gpt(**SMALL, seed=seed)[0]


def meta_model() -> nn.Module:
    with torch.device("meta"):
        return models.GPT(128, SMALL["hidden"], SMALL["heads"], SMALL["layers"], SMALL["seq"])


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 128, (SMALL["batch"], SMALL["seq"]), generator=g)
        out.append((ids, (ids + 1) % 128))
    return out


def pipelined(model, mesh_axes: dict, **kw) -> PipelinedModule:
    return autoshard.compile(model, autoshard.Mesh(**mesh_axes), batches(1)[0], pipeline=PIPE, **kw)


def train(module, data, opt=None, mesh=None, rank: int = 0, grads: list | None = None):
    """Adam steps; a pipelined module takes the global batch, a ShardedModule (``mesh``) this rank's chunk.
    ``grads``: the first step's gradients appended (a pipelined module's stage-local ones)."""
    losses = []
    for ids, labels in data:
        opt = opt or torch.optim.Adam(module.parameters(), lr=LR)
        if mesh is not None:
            loss = module(autoshard.data_shard(ids, mesh, rank), autoshard.data_shard(labels, mesh, rank))
            loss.backward()
        else:
            loss = module(ids, labels)
            if not isinstance(module, PipelinedModule):
                loss.backward()
        if grads is not None and not grads:
            grads.append(module.runner().grads())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, opt


def reference(steps: int):
    """The one-device run: losses, the first step's gradients, the state after ``steps`` Adam steps."""
    model = new_model()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses, first = [], None
    for ids, labels in batches(steps):
        loss = model(ids, labels)
        loss.backward()
        if first is None:
            first = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, first, model


def assert_trained_close(got: dict, want: dict, steps: int, got_grads: dict, want_grads: dict) -> None:
    """Equal to 1e-5 but where a gradient is rounding noise: the attention key biases, whose gradient is zero in exact
    arithmetic (a bias on k adds the same q·b to every score of a row), and the elements where the two runs'
    first-step gradients differ by more than 1e-4 of the gradient plus Adam's eps (a weight element whose sum cancels
    to 1e-8 where its neighbours are 1e-4). Adam's normalisation turns noise into steps of up to ``lr`` that differ
    with the order of the sums (another mesh, another CPU's kernels): up to ``2·lr·steps`` there."""
    assert list(got) == list(want)
    for k, v in want.items():
        atol = torch.full_like(v, 1e-5)
        if k.endswith("attn.k.bias"):
            atol[:] = 2 * LR * steps
        elif k in want_grads and k in got_grads:
            noise = (got_grads[k] - want_grads[k]).abs() > 1e-4 * (want_grads[k].abs() + 1e-8)
            atol[noise] = 2 * LR * steps
        bad = (got[k] - v).abs() > atol + 1e-5 * v.abs()
        assert not bad.any(), (f"{k}: {int(bad.sum())} of {v.numel()} elements differ; largest "
                               f"{(got[k] - v).abs()[bad].max().item():.3e} (tolerance there "
                               f"{atol[bad].max().item():.1e})")


def assert_equal_state(got: dict, want: dict, what: str) -> None:
    assert list(got) == list(want), what
    for k, v in want.items():
        assert torch.equal(got[k], v), f"{what}: `{k}` differs from the saved value by " \
                                       f"{(got[k].float() - v.float()).abs().max().item():.3e}"


# ---- real processes ---------------------------------------------------------------------------------------------
def _worker(rank: int, world: int, path: str):
    data = batches(4)
    out = {}
    # the uninterrupted 4 steps, then one eval step (forward only) and a train() step back
    run = pipelined(new_model(), PIPE_DATA, timeout=120)
    grads: list = []
    out["losses"], opt = train(run, data, grads=grads)
    out["grads"] = grads[0]
    out["final"] = autoshard.full_state_dict(run)
    run.eval()
    before = [p.grad for p in run.parameters()]
    micro: list = []
    out["eval"] = run.step(*data[0], losses=micro).item()
    out["eval_micro"] = [x.item() for x in micro]
    assert all(g is None for g in before) and all(p.grad is None for p in run.parameters())
    run.train()

    # 2 steps, saved with the optimizer
    first = pipelined(new_model(), PIPE_DATA, timeout=120)
    out["first"], opt = train(first, data[:2])
    out["saved"] = autoshard.full_state_dict(first)
    out["names"] = [n for n, _ in first.named_parameters()]
    out["keys"] = list(first.state_dict())
    autoshard.save(first, path, optimizer=opt)
    dcp.save(first.state_dict(), checkpoint_id=path + "-dcp")  # torch's own: each stage's DTensors

    # (a) the same mesh, from a model built on the meta device: nothing but the checkpoint gives it values
    same = pipelined(meta_model(), PIPE_DATA, timeout=120)
    assert not same.initialised
    autoshard.load(same, path)
    out["a"] = autoshard.full_state_dict(same)
    opt_a = torch.optim.Adam(same.parameters(), lr=0.5)  # a wrong lr: the checkpoint's wins
    autoshard.load(same, path, optimizer=opt_a)
    assert opt_a.param_groups[0]["lr"] == LR
    out["a_losses"] = train(same, data[2:], opt_a)[0]
    out["a_after"] = autoshard.full_state_dict(same)

    # (b) another pipelined mesh, other initial weights
    other = pipelined(new_model(seed=9), PIPE_MODEL, timeout=120)
    autoshard.load(other, path)
    out["b"] = autoshard.full_state_dict(other)
    opt_b = torch.optim.Adam(other.parameters(), lr=LR)
    autoshard.load(other, path, optimizer=opt_b)
    out["b_losses"] = train(other, data[2:], opt_b)[0]
    out["b_after"] = autoshard.full_state_dict(other)

    # (c) no pipeline: a ShardedModule on data=2 x model=2, parameters stored ZeRO-3 sharded over data
    mesh_c = autoshard.Mesh(data=2, model=2)
    ids, labels = data[0]
    flat = autoshard.compile(new_model(seed=9), mesh_c, (autoshard.data_shard(ids, mesh_c, rank),
                                                          autoshard.data_shard(labels, mesh_c, rank)),
                             zero=3, timeout=120)
    autoshard.load(flat, path)
    out["c"] = autoshard.full_state_dict(flat)
    opt_c = torch.optim.Adam(flat.parameters(), lr=LR)
    autoshard.load(flat, path, optimizer=opt_c)
    out["c_losses"] = train(flat, data[2:], opt_c, mesh=mesh_c, rank=rank)[0]
    out["c_after"] = autoshard.full_state_dict(flat)

    # torch's own DCP: the state dict of the pipeline on pipe=2 x data=2 into one on pipe=2 x model=2
    into = pipelined(new_model(seed=9), PIPE_MODEL, timeout=120)
    state = into.state_dict()
    dcp.load(state, checkpoint_id=path + "-dcp")
    out["dcp"] = autoshard.full_state_dict(into)
    return out


@pytest.mark.gloo
def test_pipeline_saved_on_pipe_data_loads_anywhere_and_resumes(tmp_path):
    path = str(tmp_path / "ckpt")
    results = spawn(_worker, 4, path, timeout=400, start_method="forkserver")
    ref_losses, ref_grads, ref_model = reference(4)
    r0 = results[0]

    # the pipelined run equals the one-device run: every loss, the first step's gradients, the weights
    for r in results:
        assert r["losses"] == r0["losses"] and r["first"] == r0["first"]
    torch.testing.assert_close(torch.tensor(r0["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    mesh = autoshard.Mesh(**PIPE_DATA)
    pplan = pipelined(new_model(), PIPE_DATA).plan
    grads = pplan.assemble_grads([r["grads"] for r in results])
    public = pplan.microbatch_plan.public_names()
    assert {public.get(k, k) for k in grads} == {n for n, _ in ref_model.named_parameters()}
    for target, g in grads.items():
        torch.testing.assert_close(g, ref_grads[public.get(target, target)], rtol=1e-4, atol=1e-6,
                                   msg=lambda m, t=target: f"{t}: {m}")
    first_grads = {public.get(t, t): g for t, g in grads.items()}
    assert_trained_close(r0["final"], ref_model.state_dict(), 4, first_grads, ref_grads)

    # eval(): the forward only, the loss of the trained weights (the one-device model's, in eval mode)
    ref_model.eval()
    ids, labels = batches(1)[0]
    with torch.no_grad():
        micro = [ref_model(ids[:4], labels[:4]).item(), ref_model(ids[4:], labels[4:]).item()]
        want = ref_model(ids, labels).item()
    for r in results:
        assert r["eval"] == pytest.approx(want, rel=1e-5, abs=1e-6)
        assert r["eval_micro"] == pytest.approx(micro, rel=1e-5, abs=1e-6)

    # each stage's ranks hold that stage's parameters only, by the model's names, in the model's order
    names = [n for n, _ in new_model().named_parameters()]
    for r in range(mesh.size):
        stage = pplan.stages_of(r)[0]
        held = {public.get(t, t) for t in pplan.stages[stage].params}
        assert results[r]["names"] == [n for n in names if n in held]
    assert "head.weight" in results[2]["keys"] and "wte.weight" in results[2]["keys"]  # tied: both names

    # every target holds exactly what was saved, and continues the 4-step run
    saved = r0["saved"]
    assert list(saved) == list(new_model().state_dict())
    for what in ("a", "b", "c", "dcp"):
        for rank, r in enumerate(results):
            assert_equal_state(r[what], saved, f"({what}) on rank {rank}")
    ref_after = ref_losses[2:]
    for r in results:
        assert r["a_losses"] == r0["losses"][2:]  # the same mesh and plan: the same numbers
        for what in ("b_losses", "c_losses"):
            torch.testing.assert_close(torch.tensor(r[what]), torch.tensor(ref_after), rtol=1e-5, atol=1e-5,
                                       msg=lambda m, w=what: f"{w}: {m}")
    for what in ("a_after", "b_after", "c_after"):  # the weights after the 2 more steps: the one-device run's
        assert_trained_close(r0[what], ref_model.state_dict(), 4, first_grads, ref_grads)

    # (d) the plain model: autoshard.load, and DCP's own reader (the model's tensors under "model.<name>")
    plain = new_model(seed=5)
    opt = torch.optim.Adam(plain.parameters(), lr=LR)
    autoshard.load(plain, path, optimizer=opt)
    assert_equal_state(plain.state_dict(), saved, "(d) the plain model")
    assert plain.head.weight is plain.wte.weight  # tied weights stay tied
    plain_losses, _ = train(plain, batches(4)[2:], opt)
    torch.testing.assert_close(torch.tensor(plain_losses), torch.tensor(ref_after), rtol=1e-5, atol=1e-5)

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, str(tmp_path / "whole.pt"))
    whole = torch.load(tmp_path / "whole.pt")
    for k, v in saved.items():
        key = f"model.{k}" if f"model.{k}" in whole else "model.head.weight"  # a tied weight is stored once
        assert torch.equal(whole[key], v), k


# ---- the simulator -----------------------------------------------------------------------------------------------
def _sim(mesh_axes: dict, fn):
    world = SimWorld(autoshard.Mesh(**mesh_axes), timeout=120)
    return world.run(lambda r: fn(r, world.communicator(r)))


def _fake_step(module, opt) -> None:
    """An optimizer step with made-up gradients (the simulator runs no schedule): Adam's state gets values."""
    for i, p in enumerate(module.parameters()):
        p.grad = torch.full_like(p, 0.01 * (i + 1))
    opt.step()
    opt.zero_grad(set_to_none=True)


def _dcp_contents(path: str) -> dict:
    import os
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = os.path.join(tempfile.mkdtemp(), "whole.pt")
    dcp_to_torch_save(path, out)
    return torch.load(out)


def test_simulated_pipeline_checkpoint_loads_on_another_mesh_a_sharded_module_and_plain_pytorch(tmp_path):
    base = new_model()
    path, again, flat_path = str(tmp_path / "ckpt"), str(tmp_path / "again"), str(tmp_path / "flat")

    def first(rank, comm):
        module = pipelined(copy.deepcopy(base), PIPE_DATA, comm=comm)
        opt = torch.optim.Adam(module.parameters(), lr=LR)
        _fake_step(module, opt)
        autoshard.save(module, path, optimizer=opt)
        return autoshard.full_state_dict(module)

    saved = _sim(PIPE_DATA, first)
    for r in range(1, 4):
        assert_equal_state(saved[r], saved[0], f"full_state_dict on rank {r}")
    saved = saved[0]

    def second(rank, comm):  # another pipelined mesh; saved again from there
        module = pipelined(new_model(seed=3), PIPE_MODEL, comm=comm)
        autoshard.load(module, path)
        opt = torch.optim.Adam(module.parameters(), lr=0.5)
        autoshard.load(module, path, optimizer=opt)
        autoshard.save(module, again, optimizer=opt)
        return autoshard.full_state_dict(module)

    for r, got in enumerate(_sim(PIPE_MODEL, second)):
        assert_equal_state(got, saved, f"pipe=2 x model=2, rank {r}")

    def third(rank, comm):  # no pipeline: a ShardedModule, ZeRO-1 storage; saved again from there
        mesh = autoshard.Mesh(data=2, model=2)
        ids, labels = batches(1)[0]
        module = autoshard.compile(new_model(seed=3), mesh, (autoshard.data_shard(ids, mesh, rank),
                                                             autoshard.data_shard(labels, mesh, rank)),
                                   comm=comm, zero=1)
        autoshard.load(module, path)
        opt = torch.optim.Adam(module.parameters(), lr=0.5)
        autoshard.load(module, path, optimizer=opt)
        autoshard.save(module, flat_path, optimizer=opt)
        return autoshard.full_state_dict(module)

    for r, got in enumerate(_sim({"data": 2, "model": 2}, third)):
        assert_equal_state(got, saved, f"ShardedModule data=2 x model=2, rank {r}")

    # every tensor (the model's and Adam's moments and steps) went through each target unchanged
    want = _dcp_contents(path)
    assert any(k.startswith("optim.") and k.endswith("exp_avg") for k in want)
    for other in (again, flat_path):
        got = _dcp_contents(other)
        assert sorted(got) == sorted(want)
        for k, v in want.items():
            assert torch.equal(got[k], v), (other, k)

    plain = new_model(seed=5)
    autoshard.load(plain, path)
    assert_equal_state(plain.state_dict(), saved, "the plain model")

    def from_plain(rank, comm):  # and the other way: the plain model's checkpoint into a pipeline
        module = pipelined(new_model(seed=3), PIPE_DATA, comm=comm)
        autoshard.load(module, plain_path)
        return autoshard.full_state_dict(module)

    plain_path = str(tmp_path / "plain")
    ref = new_model(seed=11)
    autoshard.save(ref, plain_path)
    assert_equal_state(_sim(PIPE_DATA, from_plain)[3], ref.state_dict(), "plain -> pipeline")


def test_simulated_pipeline_parameters_state_dict_and_load_state_dict():
    base, other = new_model(), new_model(seed=4)

    def run(rank, comm):
        module = pipelined(copy.deepcopy(base), PIPE_DATA, comm=comm)
        named = list(module.named_parameters())
        state = {k: v.clone() for k, v in module.state_dict().items()}
        info = {"names": [n for n, _ in named], "keys": list(state),
                "meshes": {tuple(p.device_mesh.mesh_dim_names) for _, p in named},
                "dtensor": all(isinstance(p, torch.distributed.tensor.DTensor) for _, p in named),
                "stages": module.stages}
        # a whole model's state dict loads on every rank: each stage takes its entries (whole tensors: its slices)
        result = module.load_state_dict(other.state_dict())
        info["missing"], info["unexpected"] = result.missing_keys, result.unexpected_keys
        info["full"] = autoshard.full_state_dict(module)
        with pytest.raises(RuntimeError, match="Unexpected key.*not_a_tensor"):
            module.load_state_dict({**other.state_dict(), "not_a_tensor": torch.zeros(1)})
        # DTensor values of this very layout (a state dict of the module itself) load too
        module.load_state_dict(state)
        info["back"] = autoshard.full_state_dict(module)
        with pytest.raises(AutoshardError, match="moving or casting"):
            module.to(torch.float64)
        return info

    out = _sim(PIPE_DATA, run)
    names = [n for n, _ in base.named_parameters()]
    for r, info in enumerate(out):
        assert info["dtensor"] and info["meshes"] == {("data",)}  # the stage's DeviceMesh: the non-pipe axes
        assert info["names"] and set(info["names"]) < set(names)
        assert info["names"] == [n for n in names if n in info["names"]]  # the model's order
        assert not info["missing"] and not info["unexpected"]
        assert_equal_state(info["full"], other.state_dict(), f"load_state_dict, rank {r}")
        assert_equal_state(info["back"], base.state_dict(), f"load_state_dict of DTensors, rank {r}")
    assert out[0]["stages"] == [0] and out[3]["stages"] == [1]
    assert set(out[0]["names"]).isdisjoint(set(out[2]["names"]) - {"wte.weight"})  # only the tied weight in both
    assert "head.weight" in out[2]["keys"] and "wte.weight" in out[2]["keys"]


def test_simulated_meta_built_pipeline_init_weights_equals_one_device_init():
    # The ranks initialise one after the other here (the global RNG is one per process: simulated ranks in threads
    # would draw from it in turns), each as a process of its own would: seeded, then the model's whole init.
    seed = 7
    world = SimWorld(autoshard.Mesh(**PIPE_DATA), timeout=120)
    modules = []
    for rank in range(4):
        module = pipelined(meta_model(), PIPE_DATA, comm=world.communicator(rank))
        assert not module.initialised
        with pytest.raises(AutoshardError, match=r"uninitialised memory .*init_weights\(\)"):
            module.step(*batches(1)[0])
        torch.manual_seed(seed)
        module.init_weights()
        assert module.initialised
        modules.append(module)
    out = world.run(lambda r: autoshard.full_state_dict(modules[r]))
    model = meta_model()
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    model.head.weight = model.wte.weight  # to_empty untied it; the first name's init is the one kept
    for r, got in enumerate(out):
        assert_equal_state(got, model.state_dict(), f"init_weights, rank {r}")


def test_simulated_meta_built_pipeline_takes_a_whole_state_dict_and_a_plan_takes_another_models_tensors():
    from autoshard.api.sharded_module import make_options
    from autoshard.compiler.pipeline import build_pipeline_plan

    base, other = new_model(), new_model(seed=6)

    def run(rank, comm):
        module = pipelined(meta_model(), PIPE_DATA, comm=comm)
        module.load_state_dict(base.state_dict())  # every entry of this rank's stages: ready to run
        assert module.initialised
        # a plan made from one model, applied to another with the same tensors: the other's values
        mesh = autoshard.Mesh(**PIPE_DATA)
        pplan = build_pipeline_plan(new_model(seed=8), mesh, batches(1)[0], {},
                                    make_options(None, "data", "replicate", mesh), PIPE)
        applied = PipelinedModule.of_plan(copy.deepcopy(other), pplan, comm=comm)
        return autoshard.full_state_dict(module), autoshard.full_state_dict(applied)

    for r, (loaded, applied) in enumerate(_sim(PIPE_DATA, run)):
        assert_equal_state(loaded, base.state_dict(), f"load_state_dict into a meta-built module, rank {r}")
        assert_equal_state(applied, other.state_dict(), f"of_plan, rank {r}")


def test_simulated_pipeline_step_runs_on_real_processes_only():
    def run(rank, comm):
        module = pipelined(new_model(), PIPE_DATA, comm=comm)
        with pytest.raises(AutoshardError, match="Run pipelines on real processes"):
            module.step(*batches(1)[0])
        with pytest.raises(AutoshardError, match=r"step\(return_outputs=True\) would return the last stage's"):
            module.step(*batches(1)[0], return_outputs=True)
        with pytest.raises(AutoshardError, match=r"step got loss_kwargs=\['scale'\], but the loss is"):
            module.step(*batches(1)[0], loss_kwargs={"scale": 2})
        with pytest.raises(TypeError, match="losses must be a list"):
            module.step(*batches(1)[0], losses=())
        return True

    assert all(_sim(PIPE_DATA, run))


class _Dropping(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, y):
        return nn.functional.mse_loss(self.b(nn.functional.dropout(self.a(x), 0.1, self.training)), y)


def test_eval_of_a_pipeline_traced_with_dropout_says_what_differs():
    torch.manual_seed(0)
    model = _Dropping()
    x, y = torch.randn(4, 8), torch.randn(4, 8)

    def run(rank, comm):
        module = autoshard.compile(copy.deepcopy(model), autoshard.Mesh(pipe=2), (x, y), comm=comm,
                                   pipeline=autoshard.Pipeline(microbatches=2, schedule="gpipe", split=["b"]))
        assert module.eval() is module and not module.training
        with pytest.raises(AutoshardError, match=r"in eval mode, but its stage programs were traced in training mode "
                                                 r"and compute something else in eval mode: node .*dropout"):
            module.step(x, y)
        return [n for n, _ in module.named_parameters()]  # a pipe-only mesh: whole tensors

    assert _sim({"pipe": 2}, run) == [["a.weight", "a.bias"], ["b.weight", "b.bias"]]


def test_bucket_cap_mb_is_checked_and_kept():
    model, args, _ = models.gpt(**SMALL)
    mesh = autoshard.Mesh(**PIPE_DATA)
    from autoshard.api.sharded_module import make_options

    options = make_options(None, "data", "replicate", mesh)
    with pytest.raises(AutoshardError, match="bucket_cap_mb is -1, but must be a number of MiB >= 0"):
        PipelinedModule(model, mesh, options, args, pipeline=PIPE, bucket_cap_mb=-1)
    assert PipelinedModule(model, mesh, options, args, pipeline=PIPE, bucket_cap_mb=2).bucket_cap_mb == 2


def test_compile_gives_bucket_cap_mb_to_the_pipeline():
    model, args, _ = models.gpt(**SMALL)
    module = autoshard.compile(model, autoshard.Mesh(**PIPE_DATA), args, pipeline=PIPE, bucket_cap_mb=2)
    assert module.bucket_cap_mb == 2
