"""Pipelined plans on real gloo processes: loss and every gradient equal one device.

One ``spawn`` per mesh runs every (model, schedule) case in the same processes (8-process runs are slow on small
machines). Models are tiny (hidden 32, seq 8, 4 layers); GPT ties its embedding and LM head across the stages.
"""

from __future__ import annotations

import pytest
import torch

import autoshard
from autoshard.api import make_options
from autoshard.pipeline import Pipeline, PipelineRunner, build_pipeline_plan
from autoshard.runtime import DistCommunicator, spawn
from examples import models
from tests.test_equivalence import reference

SMALL = {"layers": 4, "hidden": 32, "heads": 4, "seq": 8, "batch": 8}
NAMES = ("gpt", "hf_gpt2", "hf_llama")
SCHEDULES = ("gpipe", "1f1b")


def _case(name: str, mesh_axes: dict, schedule: str, microbatches: int = 4):
    model, args, kwargs = models.FACTORIES[name](**SMALL)
    mesh = autoshard.Mesh(**mesh_axes)
    ann = models.megatron(mesh, name)
    pplan = build_pipeline_plan(model, mesh, args, kwargs, make_options(ann, "data", "error", mesh),
                                Pipeline(microbatches=microbatches, schedule=schedule))
    return model, args, kwargs, pplan


def _worker(rank, world_size, mesh_axes, cases):
    comm = DistCommunicator(autoshard.Mesh(**mesh_axes), timeout=120)
    out = {}
    for name, schedule in cases:
        _, args, kwargs, pplan = _case(name, mesh_axes, schedule)
        runner = PipelineRunner(pplan, comm=comm)
        loss = runner.step(*args, **kwargs)
        out[(name, schedule)] = (loss, runner.grads())
    return out


def _check(mesh_axes: dict, cases):
    mesh = autoshard.Mesh(**mesh_axes)
    results = spawn(_worker, mesh.size, mesh_axes, cases, timeout=400, start_method="forkserver")
    for name, schedule in cases:
        model, args, kwargs, pplan = _case(name, mesh_axes, schedule)
        ref_loss, ref_grads = reference(model, args, kwargs)
        for rank in range(mesh.size):
            torch.testing.assert_close(results[rank][(name, schedule)][0], ref_loss, rtol=1e-5, atol=1e-6)
        grads = pplan.assemble_grads([results[r][(name, schedule)][1] for r in range(mesh.size)])
        missing = sorted(set(pplan.param_specs()) - set(grads))
        assert not [m for m in missing if m in ref_grads], missing
        for fqn, g in grads.items():
            torch.testing.assert_close(g, ref_grads[fqn], rtol=1e-4, atol=1e-5,
                                       msg=lambda m, w=f"{name} {schedule} {fqn}": f"{w}: {m}")


ALL = [(n, s) for n in NAMES for s in SCHEDULES]


@pytest.mark.gloo
def test_pipe2_gloo_matches_single_device():
    _check({"pipe": 2}, ALL)


@pytest.mark.gloo
def test_pipe2_model2_gloo_matches_single_device():
    _check({"pipe": 2, "model": 2}, ALL)


@pytest.mark.gloo
def test_pipe2_data2_gloo_matches_single_device():
    _check({"pipe": 2, "data": 2}, ALL)
