"""Devices in, configuration out (autoshard/api/cluster.py, ``autoshard plan --devices N``): the candidate meshes of
N devices, the bounds that prune those that cannot fit, and the choice of the cheapest by ``plan.cost()``, the
figures ``--json`` prints agreeing with ``autoshard.plan`` on the chosen mesh."""

from __future__ import annotations

import contextlib
import io
import json
import warnings

import pytest
import torch

import autoshard
from autoshard.api.cli import main
from autoshard.api.cluster import candidate_meshes, least_state_bytes, plan_cluster
from autoshard.cost_models.memory import training_state_bytes
from autoshard.errors import PlanError
from examples import models
from tests.test_rank_agreement import _searches_counted

M = autoshard.Mesh
#: per rank, between the least memory the search can bound on data=2,model=2 for gpt(layers=2) with zero=0 (485.2
#: KiB) and that of data=4 (473.9 KiB) and model=4 (469.9 KiB): the search refuses the first and plans the others
LIMIT = "484KiB"


def _cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = main(list(argv))
    return code, out.getvalue()


def test_candidates_are_the_factorisations_with_the_model_axis_inside_a_node():
    assert candidate_meshes(8) == [M(data=8), M(data=4, model=2), M(data=2, model=4), M(model=8)]
    assert candidate_meshes(8, gpus_per_node=4) == [M(data=8), M(data=4, model=2), M(data=2, model=4)]
    assert candidate_meshes(12, gpus_per_node=4) == [M(data=12), M(data=6, model=2), M(data=3, model=4)]
    assert candidate_meshes(6, gpus_per_node=4) == [M(data=6), M(data=3, model=2)]  # 3 does not divide a node of 4
    assert candidate_meshes(1) == [M(data=1)]
    with pytest.raises(PlanError, match="devices is 0, but must be a positive int"):
        candidate_meshes(0)


def test_the_state_bound_splits_each_tensor_as_far_as_the_mesh_can():
    model = torch.nn.Linear(6, 3)  # weight (3, 6), bias (3,)
    w, b = training_state_bytes(18), training_state_bytes(3)
    mesh = M(data=2, model=4)
    # with ZeRO the data axis stores anything sharded; model=4 divides no dim of either
    assert least_state_bytes(model, mesh) == pytest.approx(w / 2 + b / 2)
    # without it: data=2 over the weight's 6 (one axis per dim), nothing splits the bias
    assert least_state_bytes(model, mesh, zero=False) == pytest.approx(w / 2 + b)
    assert least_state_bytes(torch.nn.Linear(8, 4), M(data=2, model=4), zero=False) == pytest.approx(
        training_state_bytes(32) / 8 + training_state_bytes(4) / 4)


def test_a_limit_no_mesh_can_hold_prunes_every_mesh_before_any_search():
    model, args, kwargs = models.gpt(layers=1)
    with _searches_counted() as searched:
        chosen = plan_cluster(model, args, kwargs, devices=4, search=autoshard.Search(memory_limit="1KiB"))
    assert searched == [] and all(c.plan is None for c in chosen.candidates)
    assert all("parameters, gradients and optimizer state need at least" in c.pruned for c in chosen.candidates)
    with pytest.raises(PlanError, match="no mesh of 4 devices has a plan: data=4: its parameters"):
        chosen.best


def test_the_chosen_mesh_is_the_cheapest_candidate_by_plan_cost():
    model, args, kwargs = models.mlp(hidden=32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        chosen = plan_cluster(model, args, kwargs, devices=4, search=autoshard.Search(profile="gpu-8x-nvlink"))
    assert [c.mesh for c in chosen.candidates if c.plan is not None] != []
    assert {c.mesh for c in chosen.candidates} == set(candidate_meshes(4))
    steps = [c.step_time_s for c in chosen.planned]
    assert steps == sorted(steps) and chosen.best.step_time_s == min(steps)
    for c in chosen.planned:
        assert c.step_time_s == c.plan.cost().step_time and c.mesh == c.plan.mesh


@pytest.fixture(scope="module")
def devices_json(tmp_path_factory):
    path = tmp_path_factory.mktemp("cluster") / "plan.json"
    code, out = _cli("plan", "examples.models:gpt", "--devices", "4", "--memory-limit", LIMIT, "--zero", "0",
                     "--json", "--save", str(path))
    assert code == 0
    return json.loads(out), path


def test_devices_json_has_the_chosen_configuration_and_the_candidates(devices_json):
    doc, _ = devices_json
    assert set(doc) >= {"mesh", "pipeline", "step_time_s", "memory_per_rank_bytes", "candidates"}
    assert doc["pipeline"] is None and doc["devices"] == 4
    planned = doc["candidates"]
    assert [c["mesh"] for c in planned] == [{"model": 4}, {"data": 4}]
    assert all(set(c) >= {"mesh", "pipeline", "step_time_s", "memory_per_rank_bytes"} for c in planned)
    best = min(planned, key=lambda c: c["step_time_s"])
    assert doc["mesh"] == best["mesh"] and doc["step_time_s"] == best["step_time_s"]
    assert all(c["memory_per_rank_bytes"] <= 484 * 1024 for c in planned)
    # the mesh that cannot fit is pruned by the search's bound, before its walk
    [pruned] = doc["not_planned"]
    assert pruned["mesh"] == {"data": 2, "model": 2} and pruned["step_time_s"] is None
    assert "the least memory any plan needs is 485.2 KiB per rank" in pruned["pruned"]


def test_devices_json_agrees_with_planning_the_chosen_mesh(devices_json):
    doc, path = devices_json
    model, args, kwargs = models.gpt()
    mesh = autoshard.Mesh(**doc["mesh"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autoshard.plan(model, mesh, args, kwargs, search=autoshard.Search(memory_limit=LIMIT, zero=0))
    cost = plan.cost()
    assert doc["step_time_s"] == pytest.approx(cost.step_time, rel=1e-9)
    assert doc["memory_per_rank_bytes"] == cost.memory_per_rank
    # --save wrote the chosen plan: it loads without a search, the same plan
    with _searches_counted() as searched:
        loaded = autoshard.load_plan(path, model, args, kwargs)
    assert searched == [] and loaded.digest() == plan.digest()


def test_json_of_a_given_mesh_has_its_step_time_and_memory():
    code, out = _cli("plan", "examples.models:mlp", "--mesh", "data=2", "--json", "--factory-arg", "hidden=16")
    assert code == 0
    doc = json.loads(out)
    model, args, kwargs = models.mlp(hidden=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cost = autoshard.plan(model, autoshard.Mesh(data=2), args, kwargs, search=autoshard.Search()).cost()
    assert doc["pipeline"] is None and doc["mesh"] == {"data": 2}
    assert doc["step_time_s"] == pytest.approx(cost.step_time) and doc["memory_per_rank_bytes"] == cost.memory_per_rank


def test_mesh_and_devices_are_one_or_the_other(capsys):
    for argv in (["--mesh", "data=2", "--devices", "2"], []):
        assert main(["plan", "examples.models:mlp", *argv]) == 2
        err = capsys.readouterr().err
        assert "needs either --mesh NAME=SIZE,... (plan that mesh) or --devices N" in err and "Traceback" not in err
    assert main(["plan", "examples.models:mlp", "--devices", "2", "--megatron"]) == 2
    assert "--megatron needs one mesh, but --devices chooses among several" in capsys.readouterr().err


def test_json_of_a_given_pipeline_has_its_options_step_time_and_largest_stage_memory():
    code, out = _cli("show", "examples.models:gpt", "--mesh", "pipe=2,model=2", "--megatron", "--pipeline",
                     "microbatches=4,schedule=1f1b", "--json")
    assert code == 0
    doc = json.loads(out)
    model, args, kwargs = models.gpt()
    mesh = autoshard.Mesh(pipe=2, model=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pplan = autoshard.plan(model, mesh, args, kwargs, annotations=models.megatron(mesh, "gpt"),
                               pipeline=autoshard.Pipeline(microbatches=4, schedule="1f1b"))
    assert doc["pipeline"]["microbatches"] == 4 and doc["pipeline"]["schedule"] == "1f1b"
    assert doc["step_time_s"] == pytest.approx(pplan.cost().step_time)
    assert doc["memory_per_rank_bytes"] == max(pplan.stage_memory(s, r) for r in range(mesh.size)
                                               for s in pplan.stages_of(r))
