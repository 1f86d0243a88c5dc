"""Pipelined plans on real gloo processes: loss and every gradient equal one device.

One ``spawn`` per mesh runs every (model, schedule) case in the same processes (8-process runs are slow on small
machines). Models are tiny (hidden 32, seq 8, 4 layers); GPT ties its embedding and LM head across the stages.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autoshard
from autoshard.api.sharded_module import make_options
from autoshard.api.pipelined_module import PipelineRunner
from autoshard.compiler.pipeline import Pipeline, build_pipeline_plan
from autoshard.runtime import DistCommunicator, spawn
from examples import models
from tests.test_equivalence import reference

SMALL = {"layers": 4, "hidden": 32, "heads": 4, "seq": 8, "batch": 8}
NAMES = ("gpt", "hf_gpt2", "hf_llama")
SCHEDULES = ("gpipe", "1f1b")


class Regressor(nn.Module):
    """Returns its output, not a loss: the pipeline applies the user's loss_fn on the last stage."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def user_loss(output, target):
    return F.mse_loss(output, target)


def _regressor():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return Regressor(), (torch.randn(8, 16, generator=g),), {}, torch.randn(8, 16, generator=g)


def _plan(name: str, mesh_axes: dict, microbatches: int = 4, stages_per_rank: int = 1):
    mesh = autoshard.Mesh(**mesh_axes)
    if name == "regressor":
        model, args, kwargs, target = _regressor()
        ann, loss_fn = {}, user_loss
    else:
        model, args, kwargs = models.FACTORIES[name](**SMALL)
        ann, loss_fn, target = models.megatron(mesh, name), None, None
    pplan = build_pipeline_plan(model, mesh, args, kwargs, make_options(ann, "data", "error", mesh),
                                Pipeline(microbatches=microbatches, stages_per_rank=stages_per_rank,
                                         loss_fn=loss_fn))
    return model, args, kwargs, target, pplan


def _reference(model, args, kwargs, target):
    if target is None:
        return reference(model, args, kwargs)
    loss = user_loss(model(*args, **kwargs), target)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _with_schedule(pplan, schedule: str):
    # the plan does not depend on the schedule: compile once per model, run it under each schedule
    return replace(pplan, pipeline=replace(pplan.pipeline, schedule=schedule))


def _cases(cases):
    """(name, schedule, bucket_cap_mb) of each case (a case without a third entry: None, the default)."""
    return [(*c, None) if len(c) == 2 else tuple(c) for c in cases]


def _worker(rank, world_size, mesh_axes, cases, stages_per_rank):
    comm = DistCommunicator(autoshard.Mesh(**mesh_axes), timeout=120)
    out = {}
    cases = _cases(cases)
    for name in dict.fromkeys(n for n, _, _ in cases):
        _, args, kwargs, target, pplan = _plan(name, mesh_axes, stages_per_rank=stages_per_rank)
        for case in [c for c in cases if c[0] == name]:
            cap = case[2]
            runner = PipelineRunner(_with_schedule(pplan, case[1]), comm=comm, sync_once=cap != 0,
                                    bucket_cap_mb=cap or None)
            comm.log.clear()
            losses: list = []
            loss = runner.step(*args, target=target, losses=losses, **kwargs)
            syncs = sum(1 for r in comm.log if (r.kind, r.axis, r.phase) == ("all_reduce", "data", "backward"))
            nbytes = sum(p.numel() * p.element_size() for m in runner.modules for p in m.inner.parameters())
            out[case] = (loss, runner.grads(), syncs, losses, nbytes)
    return out


def _check(mesh_axes: dict, cases, stages_per_rank: int = 1):
    mesh = autoshard.Mesh(**mesh_axes)
    results = spawn(_worker, mesh.size, mesh_axes, cases, stages_per_rank, timeout=400, start_method="forkserver")
    cases = _cases(cases)
    for name in dict.fromkeys(n for n, _, _ in cases):
        model, args, kwargs, target, pplan = _plan(name, mesh_axes, stages_per_rank=stages_per_rank)
        ref_loss, ref_grads = _reference(model, args, kwargs, target)
        for case in [c for c in cases if c[0] == name]:
            for rank in range(mesh.size):
                loss, _, _, losses, _ = results[rank][case]
                torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
                # the microbatch losses, on every rank: their mean is the step's loss
                assert len(losses) == pplan.pipeline.microbatches
                torch.testing.assert_close(torch.stack(losses).mean(), loss)
            syncs = [results[r][case][2] for r in range(mesh.size)]
            if case[2] is None:
                # the data-parallel gradient sync runs once per step (one flat all-reduce), not once per microbatch
                assert all(n <= 1 for n in syncs), syncs
            elif case[2] == 0:  # bucket_cap_mb=0: each parameter's all-reduce inside every microbatch's backward
                assert max(syncs) >= 2 * pplan.pipeline.microbatches, syncs
            else:  # once per step, in buckets of at most bucket_cap_mb: about the stage's bytes / the cap
                assert max(syncs) > 1, syncs
                for r in range(mesh.size):
                    assert syncs[r] <= math.ceil(results[r][case][4] / (case[2] * 2 ** 20)) + 1, (syncs, r)
            grads = pplan.assemble_grads([results[r][case][1] for r in range(mesh.size)])
            missing = sorted(set(pplan.param_specs()) - set(grads))
            assert not [m for m in missing if m in ref_grads], missing
            for fqn, g in grads.items():
                torch.testing.assert_close(g, ref_grads[fqn], rtol=1e-4, atol=1e-5,
                                           msg=lambda m, w=f"{case} {fqn}": f"{w}: {m}")


ALL = [(n, s) for n in NAMES for s in SCHEDULES]


@pytest.mark.gloo
def test_pipe2_gloo_matches_single_device():
    _check({"pipe": 2}, ALL)


@pytest.mark.gloo
def test_pipe2_model2_gloo_matches_single_device():
    _check({"pipe": 2, "model": 2}, ALL)


@pytest.mark.gloo
def test_pipe2_data2_gloo_matches_single_device():
    # the regressor returns its output; the user's loss_fn runs on the last stage over batch-sharded outputs;
    # bucket_cap_mb: the once-per-step sync in buckets of at most 64 KiB, or (0) each parameter's sync per microbatch
    _check({"pipe": 2, "data": 2}, [*ALL, ("regressor", "1f1b"), ("gpt", "1f1b", 1 / 16), ("gpt", "gpipe", 0)])


@pytest.mark.gloo
def test_interleaved_two_stages_per_rank_gloo_matches_single_device():
    _check({"pipe": 2}, [("gpt", "interleaved"), ("gpt", "gpipe")], stages_per_rank=2)


@pytest.mark.gloo
def test_train_3d_example_matches_one_process(capsys):
    # pipe=2 x data=2 x model=2: 8 processes; the example itself runs 20 steps, 2 keep the suite short
    from examples.train_3d import main

    assert main(["--steps", "2"]) == 0
    assert "-> OK" in capsys.readouterr().out
