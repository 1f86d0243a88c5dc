"""A plan is data: ``plan.save(path)`` writes the mesh, options and the search's decisions with what the plan was
made for, and ``autoshard.load_plan(path, model, examples)`` makes the same plan again on any rank without a search
(autoshard/compiler/plan_file.py); a model, mesh or inputs other than those planned for is an error naming the
difference, before anything is traced."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import autoshard
from autoshard.compiler.plan import loss_of
from autoshard.errors import PlanError
from autoshard.runtime import SimWorld, spawn
from examples import models
from tests.test_equivalence import reference
from tests.test_rank_agreement import _searches_counted

MESH = autoshard.Mesh(data=2, model=2)
#: per rank, 60% of the unconstrained searched plan's peak (1967104 bytes): the search shards to fit
LIMIT = 1_200_000


def _gpt(**kw):
    return models.gpt(layers=2, **kw)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(the searched plan, the path it was saved to)."""
    model, args, kwargs = _gpt()
    plan = autoshard.plan(model, MESH, args, kwargs, search=autoshard.Search(memory_limit=LIMIT))
    assert any(isinstance(p, autoshard.Shard) for spec in plan.param_specs().values() for p in spec)
    path = tmp_path_factory.mktemp("plans") / "gpt.json"
    plan.save(path)
    return plan, path


def test_a_loaded_plan_is_the_searched_plan_without_a_search(saved):
    plan, path = saved
    model, args, kwargs = _gpt()
    with _searches_counted() as searched:
        loaded = autoshard.load_plan(path, model, args, kwargs)
    assert searched == []  # no problem built, no search run
    assert loaded.digest() == plan.digest() and loaded.layout() == plan.layout()
    assert loaded.context.options == plan.context.options
    assert loaded.context.report["plan_search"] == plan.context.report["plan_search"]
    ref_loss, ref_grads = reference(model, args, kwargs)
    searched_sim, loaded_sim = plan.simulate(args, kwargs), loaded.simulate(args, kwargs)
    for a, b in zip(searched_sim.outputs, loaded_sim.outputs):
        assert torch.equal(loss_of(a), loss_of(b))
        torch.testing.assert_close(loss_of(b), ref_loss, rtol=1e-5, atol=1e-6)
    assert set(loaded_sim.grads) == set(searched_sim.grads) == set(ref_grads) - {"head.weight"}  # tied to wte
    for name, grad in loaded_sim.grads.items():
        assert torch.equal(grad, searched_sim.grads[name]), name
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-5)


def test_every_simulated_rank_loads_the_file_on_its_own(saved):
    plan, path = saved
    model, args, kwargs = _gpt()
    world = SimWorld(MESH, timeout=120)
    with _searches_counted() as searched:
        digests = world.run(lambda rank: autoshard.load_plan(path, copy.deepcopy(model), args, kwargs, mesh=MESH,
                                                             comm=world.communicator(rank)).digest())
    assert searched == [] and digests == [plan.digest()] * 4


def test_the_file_is_json_with_a_readable_header(saved):
    plan, path = saved
    text = path.read_text()
    assert text.splitlines()[1:3] == ['"format": "autoshard-plan",', '"version": 1,']
    doc = json.loads(text)
    assert doc["mesh"] == [["data", 2], ["model", 2]] and doc["model"] == "GPT" and doc["training"] is True
    assert doc["options"]["$"] == "Options" and doc["options"]["planner"] == "search"
    assert doc["options"]["memory_limit"] == LIMIT
    assert doc["parameters"]["blocks.0.mlp.0.weight"] == [[256, 64], "torch.float32"]
    assert doc["inputs"] == [{"name": "args[0]", "shape": [4, 16], "dtype": "torch.int64"},
                             {"name": "args[1]", "shape": [4, 16], "dtype": "torch.int64"}]
    assert doc["digest"] == plan.digest() and [d["$"] for d in doc["decisions"]] == ["Decided"]


def test_options_of_every_kind_round_trip(tmp_path):
    """Annotations (placements), mixed precision (dtypes), a profile given as a TOML path (stored as the profile it
    holds: the file plans the same where the path is not), ZeRO and recomputation chosen by the search."""
    from autoshard.cost_models.profile import load_profile, save_profile

    toml = tmp_path / "mine.toml"
    save_profile(load_profile("gpu-8x-nvlink"), toml)
    profile = load_profile(toml)
    model, args, kwargs = _gpt()
    plan = autoshard.plan(model, MESH, args, kwargs, annotations=models.megatron(MESH, "gpt"),
                          precision=autoshard.MixedPrecision(param_dtype=torch.bfloat16),
                          search=autoshard.Search(profile=str(toml)))
    plan.save(tmp_path / "plan.json")
    toml.unlink()
    loaded = autoshard.load_plan(tmp_path / "plan.json", model, args, kwargs)
    assert loaded.digest() == plan.digest()
    assert loaded.context.options.precision == plan.context.options.precision
    assert loaded.context.options.annotations == plan.context.options.annotations
    assert loaded.context.options.profile == profile


# ---- what the plan was made for -----------------------------------------------------------------------------------
def _renamed():
    model, args, kwargs = _gpt()
    model.final_norm = model.ln_f
    del model.ln_f
    return model, args, kwargs


def _untied():
    model, args, kwargs = _gpt()
    model.head.weight = torch.nn.Parameter(model.wte.weight.detach().clone())
    return model, args, kwargs


def _eval():
    model, args, kwargs = _gpt()
    return model.eval(), args, kwargs


@pytest.mark.parametrize("make, load_kw, says", [
    (lambda: _gpt(hidden=128), {},
     ["the plan in", "was made for another model:",
      "parameter wte.weight has shape (128, 64) in the file, (128, 128) in this model",
      "parameter blocks.0.attn.k.weight has shape (64, 64) in the file, (128, 128) in this model", "(and 29 more)",
      "Build the model the plan was made for"]),
    (_renamed, {}, ["ln_f.weight is in the file's model but not in this GPT",
                    "parameter final_norm.weight is in this model but not in the file's"]),
    (lambda: (_gpt()[0].double(), *_gpt()[1:]), {},
     ["parameter wte.weight has dtype torch.float32 in the file, torch.float64 in this model"]),
    (_untied, {}, ["head.weight and wte.weight are one tensor in the file's model, not in this one"]),
    (_eval, {}, ["was made in training mode, but the model is in eval mode: call model.train()"]),
    (lambda: _gpt(batch=8), {}, ["was made for other example inputs: input args[0] has shape (4, 16) in the file, "
                                 "(8, 16) given", "Give example inputs of the shapes it was planned for"]),
    (_gpt, {"mesh": autoshard.Mesh(data=4)},
     ["is for the mesh data=2,model=2, but the mesh given is data=4: load it with mesh=data=2,model=2"]),
    (_gpt, {"comm": SimWorld(autoshard.Mesh(data=2, model=4)).communicator(0)},
     ["but the mesh given is data=2,model=4"]),
], ids=["sizes", "names", "dtypes", "tied", "mode", "inputs", "mesh", "comm"])
def test_a_model_mesh_or_inputs_other_than_planned_for_is_named(saved, make, load_kw, says):
    _, path = saved
    model, args, kwargs = make()
    with _searches_counted() as searched, pytest.raises(PlanError) as e:
        autoshard.load_plan(path, model, args, kwargs, **load_kw)
    for text in says:
        assert text in str(e.value), str(e.value)
    assert searched == []


def _edited(path, tmp_path, edit):
    doc = json.loads(path.read_text())
    edit(doc)
    out = tmp_path / "edited.json"
    out.write_text(json.dumps(doc))
    return out


def _rename_a_decision(doc):
    planned = doc["decisions"][0]["planned"]
    name = next(iter(planned))
    planned["no_such_node"] = planned.pop(name)


def _layout_changed(doc):
    """As a file saved where torch traces the first op otherwise."""
    name = next(n for n, text in doc["layout"].items() if text.startswith("call_function torch.ops.aten."))
    doc["layout"][name] = "call_function torch.ops.aten.mm.default (S(0), R) traced elsewhere"
    doc["digest"] = "0" * 64


@pytest.mark.parametrize("edit, says", [
    (lambda d: d.update(version=2), "is a plan file of version 2, but this autoshard reads version 1"),
    (lambda d: d.update(format="something"), "is not an autoshard plan file"),
    (lambda d: d["options"].update({"$": "Popen"}), "holds a value tagged 'Popen', which a plan file may not hold"),
    (lambda d: d["options"].update(planner_v2=1), "gives Options the fields ['planner_v2'], which this autoshard's"),
    (lambda d: d.pop("decisions"), "is a damaged plan file (KeyError"),
    (_rename_a_decision, "does not replay on this model: the plan search's decisions name nodes this graph does not "
                         "have (no_such_node)"),
    (lambda d: d.update(decisions=[]), "planning the model asked for more decisions than the plan in"),
    (_layout_changed, "` in the file, `call_function torch.ops.aten."),
], ids=["version", "format", "tag", "field", "damaged", "nodes", "decisions", "digest"])
def test_a_file_that_is_not_this_plan_is_named(saved, tmp_path, edit, says):
    _, path = saved
    model, args, kwargs = _gpt()
    with _searches_counted() as searched, pytest.raises(PlanError) as e:
        autoshard.load_plan(_edited(path, tmp_path, edit), model, args, kwargs)
    assert says in str(e.value), str(e.value)
    if edit is _layout_changed:
        assert "replays to another plan here (node " in str(e.value) and "traced elsewhere` in the file" in str(e.value)
    assert searched == []


def test_no_file_and_not_json_are_named(tmp_path):
    model, args, kwargs = _gpt()
    with pytest.raises(PlanError, match="there is no plan file at .*: save one with plan.save"):
        autoshard.load_plan(tmp_path / "none.json", model, args, kwargs)
    (tmp_path / "x.json").write_text("not json")
    with pytest.raises(PlanError, match="is not a plan file \\(JSONDecodeError"):
        autoshard.load_plan(tmp_path / "x.json", model, args, kwargs)


def test_a_value_the_format_cannot_hold_is_named_when_saving(tmp_path):
    import dataclasses

    model, args, kwargs = models.mlp(hidden=16)
    plan = autoshard.plan(model, autoshard.Mesh(data=2), args, kwargs)
    plan.context.options = dataclasses.replace(plan.context.options, moe=object())
    with pytest.raises(PlanError, match="option.moe holds a builtins.object .*, but a plan file stores only"):
        plan.save(tmp_path / "plan.json")
    assert not (tmp_path / "plan.json").exists()


# ---- real processes -----------------------------------------------------------------------------------------------
def _load_and_train(rank: int, world: int, path) -> dict:
    model, args, kwargs = models.gpt(layers=1)
    with _searches_counted() as searched:
        plan = autoshard.load_plan(path, model, args, kwargs)  # the job's mesh and world size checked
    sharded = autoshard.apply(model, plan)
    a, k = plan.shard_inputs(rank, args, kwargs)
    loss = loss_of(sharded(*a, **k))
    loss.backward()
    return dict(searched=searched, digest=plan.digest(), loss=loss.detach(),
                grads={n: p.grad.full_tensor() for n, p in sharded.named_parameters()})


@pytest.mark.gloo
def test_a_plan_saved_before_the_job_trains_on_real_processes_without_a_search(tmp_path):
    """Planned on meta (no weights) by a process with no process group, as on a laptop, and loaded on 4 gloo ranks
    with the real model: no rank searches, each trains equal to the model on one device."""
    with torch.device("meta"):
        meta, meta_args, _ = models.gpt(layers=1)
    plan = autoshard.plan(meta, MESH, meta_args, search=autoshard.Search(memory_limit=600_000))
    assert any(isinstance(p, autoshard.Shard) for spec in plan.param_specs().values() for p in spec)
    plan.save(tmp_path / "plan.json")
    results = spawn(_load_and_train, 4, tmp_path / "plan.json", timeout=180, start_method="forkserver")
    model, args, kwargs = models.gpt(layers=1)
    ref_loss, ref_grads = reference(model, args, kwargs)
    for r in results:
        assert r["searched"] == [] and r["digest"] == plan.digest()
        torch.testing.assert_close(r["loss"], ref_loss, rtol=1e-5, atol=1e-6)
        assert set(r["grads"]) == set(ref_grads) - {"head.weight"}  # tied to wte.weight
        for name, grad in r["grads"].items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_a_job_of_another_size_is_named(saved, monkeypatch):
    import autoshard.api.planning as planning

    _, path = saved
    model, args, kwargs = _gpt()
    monkeypatch.setattr(planning, "_world_size", lambda: 8)  # as under torchrun --nproc-per-node 8
    with pytest.raises(PlanError, match=r"is for the mesh data=2,model=2 of 4 ranks, but this job has 8 ranks: start "
                                        r"4 ranks, or plan for 8 and save that plan"):
        autoshard.load_plan(path, model, args, kwargs)
