"""Devices in, configuration out (autoshard/api/cluster.py, ``autoshard plan --devices N``): the candidate meshes and
pipelines of N devices, the bounds that prune those that cannot fit, and the choice of the cheapest by
``plan.cost()`` (``PipelinePlan.cost()``), the figures ``--json`` prints agreeing with ``autoshard.plan`` on the
chosen configuration; a pipelined plan saved and loaded again."""

from __future__ import annotations

import contextlib
import io
import json
import warnings

import pytest
import torch
import torch.nn.functional as F

import autoshard
from autoshard.api.cli import main
from autoshard.api import planning
from autoshard.api.cluster import (CANDIDATE_TIME_LIMIT, candidate_meshes, candidate_pipelines, describe,
                                   least_state_bytes, plan_cluster, step_floor)
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


def test_each_candidate_searches_for_at_most_the_candidate_time_limit_unless_the_user_gives_one(monkeypatch):
    """A candidate's search is given CANDIDATE_TIME_LIMIT (not a single plan's 120 s) when Search.time_limit is None,
    and the user's time_limit otherwise; a search that refuses within it is recorded as failed with its words."""
    model, args, kwargs = models.gpt(layers=1)
    given = []

    def refuse(model, mesh, *a, search=None, **k):
        given.append(search.time_limit)
        raise PlanError(f"no plan within it was found in {search.time_limit} s of search")

    monkeypatch.setattr(planning, "plan", refuse)
    chosen = plan_cluster(model, args, kwargs, devices=4, search=autoshard.Search(memory_limit="1GiB"))
    assert given and set(given) == {CANDIDATE_TIME_LIMIT}  # (a pipeline's schedules share one search)
    assert all(c.failed == f"PlanError: no plan within it was found in {CANDIDATE_TIME_LIMIT} s of search"
               for c in chosen.candidates)
    given.clear()
    plan_cluster(model, args, kwargs, devices=4, pipelines=False,
                 search=autoshard.Search(memory_limit="1GiB", time_limit=7))
    assert given == [7] * len(candidate_meshes(4))


def test_a_data_axis_the_batch_does_not_divide_is_not_planned(monkeypatch):
    """batch 2 on 4 devices: data=4 would replicate the batch over its ranks (as a pipeline's microbatches must divide
    over the data axis, a mesh's batch must): pruned with that reason and not searched; data=2 x model=2 is."""
    from autoshard.passes import plan_search

    model, args, kwargs = models.gpt(batch=2, layers=1)
    searched, search = [], plan_search.search
    monkeypatch.setattr(plan_search, "search", lambda *a, **k: searched.append("search") or search(*a, **k))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        chosen = plan_cluster(model, args, kwargs, devices=4, pipelines=False)
    by_mesh = {c.mesh: c for c in chosen.candidates}
    assert by_mesh[M(data=4)].pruned == ("the batch of 2 does not divide over data=4: every rank of a data group "
                                         "would run the whole batch")
    assert by_mesh[M(data=2, model=2)].plan is not None and by_mesh[M(model=4)].plan is not None
    assert searched == ["search"] * 2


def test_context_candidates_put_the_context_axis_between_data_and_model_and_plan_context_parallel():
    assert candidate_meshes(4, context_axis="context") == [M(data=4), M(data=2, context=2), M(context=4),
                                                           M(data=2, model=2), M(context=2, model=2), M(model=4)]
    assert (M(pipe=2, context=2), autoshard.Pipeline(2, "1f1b")) in candidate_pipelines(4, batch=2,
                                                                                      context_axis="context")
    model, args, kwargs = models.hf_llama(batch=2, seq=32, layers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        chosen = plan_cluster(model, args, kwargs, devices=4, context_axis="context", schedules=("1f1b",))
    planned = {(c.mesh, c.pipeline): c.plan for c in chosen.candidates if c.plan is not None}
    assert {mesh for mesh, pipeline in planned if pipeline is None} >= {M(data=2, context=2), M(context=4)}
    assert (M(pipe=2, context=2), autoshard.Pipeline(2, "1f1b")) in planned
    for (mesh, pipeline), plan in planned.items():
        options = (plan.microbatch_plan if pipeline is not None else plan).context.options
        cp = options.context_parallel
        assert (cp is not None and cp.axis == "context") == ("context" in mesh.names)
    with pytest.raises(PlanError, match="give context_axis=NAME"):
        plan_cluster(model, args, kwargs, devices=4, context_parallel="context")


@pytest.mark.parametrize("factory,profile", [("gpt", "gpu-8x-nvlink"), ("hf_llama", "multi-node")])
def test_the_step_floor_is_below_every_planned_candidates_step(factory, profile, monkeypatch):
    """step_floor (the pipelines' pruning bound) is a lower bound of plan.cost() / PipelinePlan.cost() on every
    candidate of 4 devices, meshes and pipelines (pruning turned off: every candidate planned); so pruning by it
    never drops a candidate faster than the best found."""
    from autoshard.api import cluster
    from autoshard.compiler.pipeline.options import bubble_fraction
    from autoshard.cost_models.profile import load_profile

    model, args, kwargs = getattr(models, factory)(batch=8, seq=32, layers=2 if factory == "gpt" else 1)
    monkeypatch.setattr(cluster, "step_floor", lambda *a, **k: 0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        every = plan_cluster(model, args, kwargs, devices=4, search=autoshard.Search(profile=profile))
    graph = next(c.plan for c in every.candidates if c.plan is not None and c.pipeline is None).graph_module
    checked = 0
    for c in every.planned:
        m = c.pipeline.microbatches if c.pipeline else 1
        v = c.pipeline.stages_per_rank if c.pipeline and c.pipeline.schedule == "interleaved" else 1
        bubble = bubble_fraction(c.mesh.axis_size("pipe"), m, v) if c.pipeline else 0.0
        floor = step_floor(graph, load_profile(profile), 4, 8, m, bubble)
        assert 0 < floor <= c.step_time_s, (describe(c), floor, c.step_time_s)
        checked += 1
    assert checked >= 8


def _cluster_on_rank(rank, world_size):
    model, args, kwargs = models.gpt(batch=8, seq=16, layers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        chosen = plan_cluster(model, args, kwargs, search=autoshard.Search(profile="gpu-8x-nvlink"))
    return [(describe(c), c.step_time_s, c.memory_per_rank_bytes, c.pruned, c.failed) for c in chosen.candidates]


@pytest.mark.gloo
def test_every_rank_torchrun_started_makes_the_same_choice():
    """plan_cluster without devices, on 4 gloo processes (the world torchrun started): every rank gets the same
    candidates in the same order with the same figures (rank 0's searches replayed; the step floor's pruning the
    same), and the choice is the one planning the 4 devices in one process makes."""
    from autoshard.runtime import spawn

    out = spawn(_cluster_on_rank, 4, timeout=300, start_method="forkserver")
    assert all(out[r] == out[0] for r in range(4))
    model, args, kwargs = models.gpt(batch=8, seq=16, layers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        here = plan_cluster(model, args, kwargs, devices=4, search=autoshard.Search(profile="gpu-8x-nvlink"))
    assert out[0][0][0] == describe(here.best) and out[0][0][1] == pytest.approx(here.best.step_time_s)


def test_the_chosen_mesh_is_the_cheapest_candidate_by_plan_cost():
    model, args, kwargs = models.mlp(hidden=32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        chosen = plan_cluster(model, args, kwargs, devices=4, search=autoshard.Search(profile="gpu-8x-nvlink"))
    assert [c.mesh for c in chosen.candidates if c.plan is not None] != []
    assert {(c.mesh, c.pipeline) for c in chosen.candidates} == {(m, None) for m in candidate_meshes(4)} | set(
        candidate_pipelines(4, batch=args[0].shape[0]))
    steps = [c.step_time_s for c in chosen.planned]
    assert steps == sorted(steps) and chosen.best.step_time_s == min(steps)
    for c in chosen.planned:
        assert c.step_time_s == c.plan.cost().step_time and c.mesh == c.plan.mesh


@pytest.fixture(scope="module")
def devices_json(tmp_path_factory):
    path = tmp_path_factory.mktemp("cluster") / "plan.json"
    code, out = _cli("plan", "examples.models:gpt", "--devices", "4", "--memory-limit", LIMIT, "--zero", "0",
                     "--json", "--save", str(path), "--no-pipelines")
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


# ---- pipelines ------------------------------------------------------------------------------------------------
class Chain(torch.nn.Module):
    """Two square linears of an odd width: no mesh axis divides any dim of a weight, so only the pipe axis splits
    the state (with zero=0): on 4 devices every data x model mesh holds it whole, pipe=2 half on each stage."""

    def __init__(self, width: int = 63, layers: int = 2):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return F.mse_loss(x, y)


def chain(batch: int = 2, width: int = 63):
    """The factory of ``autoshard plan tests.test_cluster_plan:chain``: batch 2, so pipe=4 has no microbatch count
    (1F1B needs at least 4) and pipe=2 has 2 microbatches of one row, which only a model axis takes."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return Chain(width), (torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)), {}


#: under the whole state (0.123 MiB: every data x model mesh pruned), over a stage's (half, and one row in flight)
CHAIN_LIMIT = "100KB"


def test_pipeline_candidates_are_pipe_data_model_with_microbatches_the_batch_divides():
    P = autoshard.Pipeline
    got = candidate_pipelines(4, batch=8)
    assert (M(pipe=2, data=2), P(2, "1f1b")) in got and (M(pipe=2, data=2), P(4, "gpipe")) in got
    assert (M(pipe=2, data=2), P(8, "1f1b")) not in got  # a microbatch of one row: data=2 cannot split it
    assert (M(pipe=2, model=2), P(8, "1f1b")) in got
    assert (M(pipe=2, model=2), P(4, "interleaved", stages_per_rank=2)) in got
    assert (M(pipe=2, model=2), P(2, "interleaved", stages_per_rank=2)) not in got  # fewer than 2 x pipe
    assert {m for m, _ in got} == {M(pipe=2, data=2), M(pipe=2, model=2), M(pipe=4)}
    assert [m for m, _ in candidate_pipelines(8, gpus_per_node=2, batch=64) if m.axis_size("pipe") == 2] == [
        M(pipe=2, data=4)] * 8 + [M(pipe=2, data=2, model=2)] * 8  # m = 2 (two schedules), 4, 8 (three)
    assert candidate_pipelines(4, batch=2) == [(M(pipe=2, model=2), P(2, "1f1b")), (M(pipe=2, model=2),
                                                                                    P(2, "gpipe"))]


@pytest.fixture(scope="module")
def chain_json(tmp_path_factory):
    path = tmp_path_factory.mktemp("cluster") / "pipeline.json"
    code, out = _cli("plan", "tests.test_cluster_plan:chain", "--devices", "4", "--memory-limit", CHAIN_LIMIT,
                     "--zero", "0", "--json", "--save", str(path))
    assert code == 0
    return json.loads(out), path


def test_a_limit_only_pipe_2_meets_chooses_pipe_2(chain_json):
    doc, _ = chain_json
    assert doc["mesh"] == {"pipe": 2, "model": 2}
    assert doc["pipeline"] == {"stages": 2, "microbatches": 2, "schedule": "1f1b", "stages_per_rank": 1,
                               "axis": "pipe"}
    assert doc["memory_per_rank_bytes"] <= 100e3
    # both schedules of pipe=2 planned (1F1B first: the same step, fewer microbatches held), with the same fields
    assert [c["pipeline"]["schedule"] for c in doc["candidates"]] == ["1f1b", "gpipe"]
    assert all(set(c) >= {"mesh", "pipeline", "step_time_s", "memory_per_rank_bytes"} for c in doc["candidates"])
    assert doc["candidates"][0]["step_time_s"] == doc["step_time_s"]
    # every data x model mesh pruned before tracing: the whole state on every rank
    assert sorted(tuple(c["mesh"].items()) for c in doc["not_planned"]) == sorted(
        tuple(m.axes) for m in candidate_meshes(4))
    assert all(c["pipeline"] is None and "parameters, gradients and optimizer state need at least 0.123 MiB"
               in c["pruned"] for c in doc["not_planned"])


def test_the_chosen_pipeline_is_autoshard_plan_of_that_pipeline(chain_json):
    doc, path = chain_json
    model, args, kwargs = chain()
    mesh = autoshard.Mesh(**doc["mesh"])
    pipeline = autoshard.Pipeline(microbatches=doc["pipeline"]["microbatches"], schedule=doc["pipeline"]["schedule"])
    best = doc["candidates"][0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pplan = autoshard.plan(model, mesh, args, kwargs, pipeline=pipeline,
                               search=autoshard.Search(memory_limit=best["search_memory_limit_bytes"], zero=0))
    assert doc["step_time_s"] == pytest.approx(pplan.cost().step_time, rel=1e-9)
    assert doc["memory_per_rank_bytes"] == pplan.memory_per_rank() == max(
        pplan.stage_memory(s, r) for r in range(mesh.size) for s in pplan.stages_of(r))
    # --save wrote the pipelined plan: loaded without a search, the same stages and price
    with _searches_counted() as searched:
        loaded = autoshard.load_plan(path, model, args, kwargs)
    assert searched == [] and isinstance(loaded, type(pplan)) and loaded.pipeline == pipeline
    assert loaded.microbatch_plan.digest() == pplan.microbatch_plan.digest()
    assert loaded.split.cuts == pplan.split.cuts and loaded.cost() == pplan.cost()


def test_a_pipelined_plan_file_checks_inputs_and_asks_for_its_loss_fn(tmp_path):
    model, args, kwargs = chain(batch=4)
    mesh = autoshard.Mesh(pipe=2, data=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pplan = autoshard.plan(model, mesh, args, pipeline=autoshard.Pipeline(microbatches=2, loss_fn=F.mse_loss),
                               search=autoshard.Search())
    path = tmp_path / "p.json"
    pplan.save(path)
    with pytest.raises(PlanError, match="planned with a loss_fn, which a plan file does not hold: pass it again"):
        autoshard.load_plan(path, model, args)
    with pytest.raises(PlanError, match=r"input args\[0\] has shape \(4, 63\) in the file, \(2, 63\) given"):
        autoshard.load_plan(path, model, chain(batch=2)[1], loss_fn=F.mse_loss)
    with pytest.raises(PlanError, match="is for the mesh pipe=2,data=2, but the mesh given is data=4"):
        autoshard.load_plan(path, model, args, mesh=autoshard.Mesh(data=4), loss_fn=F.mse_loss)
    loaded = autoshard.load_plan(path, model, args, loss_fn=F.mse_loss)
    assert loaded.pipeline.loss_fn is F.mse_loss and loaded.mesh == mesh and loaded.cost() == pplan.cost()


def test_interleaved_memory_per_rank_adds_the_stages_a_rank_holds():
    model, args, kwargs = models.gpt(batch=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pplan = autoshard.plan(model, autoshard.Mesh(pipe=2), args, kwargs, search=autoshard.Search(),
                               pipeline=autoshard.Pipeline(microbatches=4, schedule="interleaved", stages_per_rank=2))
    per_rank = [pplan.stage_memory(0) + pplan.stage_memory(2, 0), pplan.stage_memory(1, 1) + pplan.stage_memory(3, 1)]
    assert pplan.memory_per_rank() == max(per_rank) > max(pplan.stage_memory(s) for s in range(4))
