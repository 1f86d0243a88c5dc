"""Every entry that runs a plan checks its inputs and raises autoshard's errors (issue 22): ``Plan.simulate`` (global
inputs), ``Plan.rank_program(r)(...)`` and the ShardedModule (local inputs, with the ``data_shard`` hint when the
global batch comes instead), the pipelined module (the global batch of a step); an unknown hardware profile is a
``PlanError`` at compile (and a one-line CLI error); ``Plan.simulate`` runs the program of the module's mode."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from torch import nn

import autoshard
from autoshard.errors import PlanError, RuntimeShapeError
from autoshard.mesh import Mesh
from autoshard.runtime import SimWorld, use


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(8, 16), nn.Linear(16, 8), nn.Dropout(0.5)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x)))).square().mean()


def _x(rows: int) -> torch.Tensor:
    return torch.randn(rows, 8, generator=torch.Generator().manual_seed(rows))


def _compiled(**kw):
    torch.manual_seed(0)
    model = Net()
    return model, autoshard.compile(model, Mesh(data=2), (_x(8),), **kw)  # local batch 4 per rank


# ---- shapes and dtypes ------------------------------------------------------------------------------------------
def test_simulate_with_a_local_batch_names_the_input_and_asks_for_the_global_one():
    _, sm = _compiled()
    with pytest.raises(RuntimeShapeError) as info:
        sm.plan.simulate((_x(4),))
    msg = str(info.value)
    assert msg.startswith("input `x` has shape [4, 8], but the plan was compiled for the global shape [8, 8].")
    assert "one rank's local shape" in msg and "pass the whole batch" in msg and "(in Plan.simulate)" in msg


def test_simulate_with_another_batch_or_dtype():
    _, sm = _compiled()
    with pytest.raises(RuntimeShapeError, match=r"^input `x` has shape \[6, 8\], but the plan was compiled for the "
                                                r"global shape \[8, 8\]\. Shapes are static"):
        sm.plan.simulate((_x(6),))
    with pytest.raises(RuntimeShapeError, match=r"^input `x` has dtype torch.float64, but the plan was compiled for "
                                                r"torch.float32\. Cast the input"):
        sm.plan.simulate((_x(8).double(),))


def test_rank_module_called_with_the_global_batch_gets_the_data_shard_hint():
    _, sm = _compiled()
    module = sm.plan.rank_program(1)
    with pytest.raises(RuntimeShapeError) as info:
        module(_x(8))
    msg = str(info.value)
    assert msg.startswith("input `x` has local shape [8, 8], but the plan was compiled for [4, 8] on rank 1.")
    assert "autoshard.data_shard(x, mesh, rank)" in msg and "(in rank 1's program)" in msg
    with pytest.raises(RuntimeShapeError, match=r"^input `x` has dtype torch.float64"):
        module(_x(4).double())


def test_sharded_module_called_with_the_global_batch_gets_the_data_shard_hint():
    _, sm = _compiled(new_shapes="error")  # (by default a call with new shapes is planned for them)
    world = SimWorld(Mesh(data=2), timeout=10)
    with use(world.communicator(0)), pytest.raises(RuntimeShapeError) as info:
        sm(_x(8))
    msg = str(info.value)
    assert msg.startswith("input `x` has local shape [8, 8], but the plan was compiled for [4, 8] on this rank.")
    assert "autoshard.data_shard(x, mesh, rank)" in msg and "(in ShardedModule.forward)" in msg


def test_pipelined_module_checks_the_global_batch_of_a_step():
    class Chain(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

        def forward(self, x):
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return x.square().mean()

    pm = autoshard.compile(Chain(), Mesh(pipe=2), (_x(8),), pipeline=autoshard.Pipeline(microbatches=2))
    with pytest.raises(RuntimeShapeError) as info:
        pm(_x(6))  # checked before any process group is needed
    msg = str(info.value)
    assert msg.startswith("input `x` has shape [6, 8], but the plan was compiled for the global shape [8, 8].")
    assert "the pipelined module" in msg
    with pytest.raises(RuntimeShapeError, match=r"^input `x` has dtype torch.float64"):
        pm(_x(8).double())


# ---- profiles ---------------------------------------------------------------------------------------------------
def test_unknown_profile_is_a_plan_error_at_compile():
    with pytest.raises(PlanError) as info:
        autoshard.compile(Net(), Mesh(data=2), (_x(8),), profile="h100")
    msg = str(info.value)
    assert msg.startswith("option profile='h100': Hardware profile `h100` is unknown; the presets are [")
    assert "cpu-gloo" in msg
    with pytest.raises(PlanError, match=r"^option profile has type int, but must be a preset name"):
        autoshard.compile(Net(), Mesh(data=2), profile=3)


def test_cli_unknown_profile_is_one_error_line(capsys, monkeypatch):
    from autoshard.api.cli import main

    monkeypatch.setattr(sys, "path", list(sys.path))
    code = main(["show", "examples.models:mlp", "--mesh", "data=2", "--profile", "h100"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert "error: " in err and "option profile='h100'" in err and "cpu-gloo" in err


# ---- modes ------------------------------------------------------------------------------------------------------
def test_sharded_simulate_follows_the_module_mode():
    model, sm = _compiled()
    x = _x(8)
    reference = copy.deepcopy(model).eval()(x)
    sm.eval()
    sim = sm.simulate((x,), backward=False)
    assert torch.allclose(sim.outputs[0], reference, atol=1e-6), (sim.outputs[0], reference)
    sm.train()
    torch.manual_seed(1)
    trained = sm.simulate((x,), backward=False)  # the training program: dropout on
    assert not torch.allclose(trained.outputs[0], reference, atol=1e-3)
    # the plan itself runs the mode it was traced in, whatever its module's mode (no callback to the module)
    sm.eval()
    torch.manual_seed(1)
    assert torch.equal(sm.plan.simulate((x,), backward=False).outputs[0], trained.outputs[0])


def test_plan_simulate_in_the_other_mode_is_a_plan_error():
    _, sm = _compiled()
    with pytest.raises(PlanError) as info:
        sm.plan.simulate((_x(8),), train=False)
    msg = str(info.value)
    assert msg.startswith("Plan.simulate(train=False) needs the eval-mode program, but this plan was traced in "
                          "training mode")
    assert "sharded.simulate(...)" in msg and "plan the model in eval mode" in msg
