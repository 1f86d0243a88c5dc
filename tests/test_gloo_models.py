"""Real processes: each model on data=2 x model=2 (4 gloo ranks on 127.0.0.1) equals one device and the simulator."""

from __future__ import annotations

import pytest
import torch

import autoshard
from autoshard.placements import assemble
from autoshard.compiler.plan import loss_of
from autoshard.runtime import DistCommunicator, spawn, use
from examples import models
from tests.test_equivalence import reference

MESH = dict(data=2, model=2)
NAMES = ["mlp", "gpt", "hf_gpt2", "hf_llama"]


def _plan(name):
    model, args, kwargs = models.FACTORIES[name](layers=1) if name != "mlp" else models.mlp()
    mesh = autoshard.Mesh(**MESH)
    ann = models.megatron(mesh, name)
    return model, args, kwargs, autoshard.compile(model, mesh, args, kwargs, annotations=ann).plan


def _worker(rank, world_size):
    comm = DistCommunicator(autoshard.Mesh(**MESH), timeout=60)
    out = {}
    for name in NAMES:
        _, args, kwargs, plan = _plan(name)
        module = plan.rank_program(rank)
        a, k = plan.shard_inputs(rank, args, kwargs)
        comm.log.clear()
        with use(comm):
            loss = loss_of(module(*a, **k))
            loss.backward()
        out[name] = (loss.detach(), {n: p.grad for n, p in module.named_parameters()},
                     [(r.kind, r.axis, r.numel, r.phase) for r in comm.log])
    return out


@pytest.mark.gloo
def test_models_on_gloo_match_single_device_and_simulator():
    results = spawn(_worker, 4, timeout=240, start_method="forkserver")  # no torch import per rank
    for name in NAMES:
        model, args, kwargs, plan = _plan(name)
        ref_loss, ref_grads = reference(model, args, kwargs)
        sim = plan.simulate(args, kwargs)
        specs = plan.param_specs()
        for rank in range(4):
            real_loss = results[rank][name][0]
            torch.testing.assert_close(real_loss, ref_loss, rtol=1e-4, atol=1e-6)
            # simulator and real processes run the same collectives and agree on values
            torch.testing.assert_close(real_loss, loss_of(sim.outputs[rank]).detach(), rtol=1e-5, atol=1e-6)
            assert results[rank][name][2] == [(r.kind, r.axis, r.numel, r.phase) for r in sim.logs[rank]], name
        for fqn, spec in specs.items():
            if fqn not in ref_grads:
                continue
            real = assemble([results[r][name][1][fqn] for r in range(4)], spec, plan.mesh)
            torch.testing.assert_close(real, ref_grads[fqn], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} {fqn}: {m}")
            torch.testing.assert_close(real, sim.grads[fqn], rtol=1e-5, atol=1e-6)
