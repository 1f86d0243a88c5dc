"""The table "Errors autoshard detects" of docs/errors.md, checked row by row.

Every row of the table has an id, an error class, and a message excerpt in which ``…`` stands for the parts that
vary (names, shapes). :data:`TRIGGERS` holds, per id, a function that makes the library detect that error in this
process; the test runs it and checks the class and that the excerpt's pieces appear in the message, in order
(:func:`assert_row`). Rows that need real processes (a peer dying under gloo) name the test that triggers them
instead: that test raises the error on real ranks and checks each raised message with :func:`assert_row` and the
row's id, which the test here makes sure it does. Rows and triggers must match one to one, so the table cannot
drift from the code.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib
import inspect
import os
import re
import tempfile
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import autoshard
from autoshard import errors
from autoshard.api.cluster import plan_cluster
from autoshard.placements import Partial, Shard, parse_placement
from examples import models
from tests.test_checkpoint_integrity import CATALOGUE_TRIGGERS  # the checkpoint integrity rows
from tests.test_cluster_plan import chain
from tests.test_plan_file import _edited, _eval, _gpt, _layout_changed, _rename_a_decision, _renamed, _untied

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "docs" / "errors.md"  # the catalogue (docs/errors.md); the name is kept for its users
SECTION = "## Errors autoshard detects"


def rows() -> list[tuple[str, str, str, str]]:
    """(id, error class, when, excerpt) of every row of the README table."""
    text = README.read_text()
    if SECTION not in text:
        return []
    body = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    out = []
    for line in body.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if len(cells) != 4 or not cells[0].startswith("`") or cells[0] == "`id`":
            continue
        out.append(tuple(c.strip("`").replace("\\|", "|") if i < 2 else c.replace("\\|", "|")
                         for i, c in enumerate(cells)))
    return out


def pieces(excerpt: str) -> list[str]:
    text = excerpt.strip()
    if text.startswith("`") and text.endswith("`"):
        text = text[1:-1]
    return [p for p in (s.strip() for s in text.split("…")) if p]


def assert_row(rid: str, cls_name: str, message: str) -> None:
    """The README row ``rid`` describes an error of class ``cls_name`` with ``message``: same class, and the
    pieces of the row's excerpt appear in the message, in order."""
    found = [r for r in rows() if r[0] == rid]
    assert found, f"README's table has no row {rid!r}"
    _, row_cls, _, excerpt = found[0]
    assert cls_name == row_cls, f"{rid}: raised {cls_name}, but the README says {row_cls}"
    at = 0
    for piece in pieces(excerpt):
        where = message.find(piece, at)
        assert where >= 0, f"{rid}: {piece!r} not in (the rest of) {message!r}"
        at = where + len(piece)


# ---- models that trigger errors ---------------------------------------------------------------------------------
class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow
            return self.fc(x)
        return -self.fc(x)


class Det(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.linalg.det(self.fc(x).view(-1, 2, 2)).sum()  # no sharding rule for linalg_det


class NoLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return {"y": self.fc(x)}


def _mlp():
    return models.mlp()  # fc1 [64, 32], fc2 [32, 64]; inputs x, target [8, 32]


def _compile(mesh, plan=None, model=None, **kw):
    m, args, kwargs = _mlp()
    return autoshard.compile(model or m, autoshard.Mesh(**mesh) if isinstance(mesh, dict) else mesh, args, kwargs,
                             annotations=plan, **kw)


def _run_mlp_on_data2(call):
    """Compile the MLP on data=2 in the simulator and, on each rank, ``call(sharded, x, t)``."""
    m, (x, t), _ = _mlp()
    mesh = autoshard.Mesh(data=2)
    world = autoshard.runtime.SimWorld(mesh, timeout=30)
    world.run(lambda r: call(autoshard.compile(m, mesh, (x, t), comm=world.communicator(r)), x, t))


def _run_mlp_on_data2_no_new_shapes(call):
    m, (x, t), _ = _mlp()
    mesh = autoshard.Mesh(data=2)
    world = autoshard.runtime.SimWorld(mesh, timeout=30)
    world.run(lambda r: call(autoshard.compile(m, mesh, (x, t), comm=world.communicator(r), new_shapes="error"),
                             x, t))


def _runtime_shape():
    # the compiled local batch is 4, then a call with 2 (new_shapes="error": by default it is planned for)
    _run_mlp_on_data2_no_new_shapes(lambda sharded, x, t: (sharded(x[:4], t[:4]), sharded(x[:2], t[:2])))


def _called_differently():
    # rank 1 calls with a batch of 2 while rank 0 calls with 4
    m, (x, t), _ = _mlp()
    mesh = autoshard.Mesh(data=2)
    world = autoshard.runtime.SimWorld(mesh, timeout=30)
    world.run(lambda r: autoshard.compile(m, mesh, (x, t), comm=world.communicator(r))(x[:4 - 2 * r], t[:4 - 2 * r]))


def _shard_twice():
    m = _mlp()[0]
    x = _mlp()[1]
    autoshard.shard(m, autoshard.Mesh(data=1), example_inputs=x)
    autoshard.shard(m, autoshard.Mesh(data=1), example_inputs=x)


def _sharded_model_moved():
    m, x, _ = _mlp()
    autoshard.shard(m, autoshard.Mesh(data=1), example_inputs=x).to(torch.float64)


def _runtime_dtype():
    # a float64 input to a float32 plan
    _run_mlp_on_data2(lambda sharded, x, t: sharded(x[:4].double(), t[:4]))


def _run_mlp_per_rank(call, options=None):
    """Compile the MLP on data=2 (in each rank's thread, with ``options[rank]``), then on each rank
    ``call(rank, sharded, x, t)``."""
    m, (x, t), _ = _mlp()
    mesh = autoshard.Mesh(data=2)
    world = autoshard.runtime.SimWorld(mesh, timeout=30)

    def body(rank):
        opts = (options or {}).get(rank, {})
        sharded = autoshard.compile(copy.deepcopy(m), mesh, (x, t), comm=world.communicator(rank), **opts)
        call(rank, sharded, x[4 * rank:4 * rank + 4], t[4 * rank:4 * rank + 4])

    world.run(body)


def _eval_on_rank0():
    _run_mlp_per_rank(lambda rank, sharded, x, t: sharded.train(rank != 0)(x, t))


def _no_grad_on_rank0():
    def call(rank, sharded, x, t):
        with torch.set_grad_enabled(rank != 0):
            sharded(x, t)

    _run_mlp_per_rank(call)


def _planned_differently():
    _run_mlp_per_rank(lambda rank, sharded, x, t: sharded(x, t), {1: {"plan": {"fc1.weight": (Shard(0),)}}})


def _sim_timeout():
    world = autoshard.runtime.SimWorld(autoshard.Mesh(x=2), timeout=0.5)

    def body(rank):
        if rank == 0:
            autoshard.runtime.current().all_reduce(torch.ones(2), "x")

    world.run(body)


@contextlib.contextmanager
def _one_rank_process_group():
    """torch.distributed initialised in this process alone (gloo, world size 1), as a job of one rank."""
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=0, world_size=1,
                                timeout=timedelta(seconds=30))
        try:
            yield
        finally:
            dist.destroy_process_group()


def _world_size_mismatch():
    with _one_rank_process_group():
        autoshard.runtime.DistCommunicator(autoshard.Mesh(data=2, model=2))


def _no_dist():
    m, (x, t), _ = _mlp()
    autoshard.compile(m, autoshard.Mesh(data=2), (x, t))(x[:4], t[:4])


def _ckpt(fn):
    def run():
        with tempfile.TemporaryDirectory() as d:
            fn(d)
    return run


def _ckpt_partial(d):
    model = _mlp()[0]
    autoshard.save(model, f"{d}/ck")
    os.rename(f"{d}/ck", f"{d}/ck.tmp-1")
    autoshard.load(model, f"{d}/ck")


def _ckpt_no_marker(d):
    model = _mlp()[0]
    autoshard.save(model, f"{d}/ck")
    os.remove(f"{d}/ck/autoshard.json")
    autoshard.load(model, f"{d}/ck")


def _ckpt_shape(d):
    autoshard.save(_mlp()[0], f"{d}/ck")
    autoshard.load(models.mlp(hidden=16)[0], f"{d}/ck")


def _ckpt_missing(d):
    autoshard.save(_mlp()[0], f"{d}/ck")
    autoshard.load(nn.Sequential(nn.Linear(2, 2)), f"{d}/ck")


def _ckpt_no_optim(d):
    model = _mlp()[0]
    autoshard.save(model, f"{d}/ck")
    autoshard.load(model, f"{d}/ck", optimizer=torch.optim.Adam(model.parameters()))


def _ckpt_optim_type(d):
    model = _mlp()[0]
    autoshard.save(model, f"{d}/ck", optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    autoshard.load(model, f"{d}/ck", optimizer=torch.optim.Adam(model.parameters()))


def _ckpt_foreign_param(d):
    autoshard.save(_mlp()[0], f"{d}/ck", optimizer=torch.optim.SGD([nn.Parameter(torch.ones(3))], lr=0.1))


def _moe(**kw):
    def run():
        importlib.import_module("autoshard.compiler.moe")
        autoshard.MoE(**kw)
    return run


def _pipeline(mesh, **kw):
    return lambda: autoshard.Pipeline(**kw).check(autoshard.Mesh(**mesh))


# ---- plan files (autoshard/compiler/plan_file.py, autoshard.load_plan) ----------------------------------------------
@functools.cache
def _plan_text() -> str:
    """tests/test_plan_file.py's GPT planned by the search on data=2, as Plan.save writes it (planned once)."""
    model, args, kwargs = _gpt()
    plan = autoshard.plan(model, autoshard.Mesh(data=2), args, kwargs, search=autoshard.Search())
    with tempfile.TemporaryDirectory() as d:
        plan.save(f"{d}/plan.json")
        return Path(f"{d}/plan.json").read_text()


@functools.cache
def _pipeline_text() -> str:
    """tests/test_cluster_plan.py's chain pipelined on pipe=2 with a loss_fn, as PipelinePlan.save writes it."""
    model, args, _ = chain(batch=4)
    plan = autoshard.plan(model, autoshard.Mesh(pipe=2), args,
                          pipeline=autoshard.Pipeline(microbatches=2, loss_fn=F.mse_loss))
    with tempfile.TemporaryDirectory() as d:
        plan.save(f"{d}/plan.json")
        return Path(f"{d}/plan.json").read_text()


def _load_plan(text=_plan_text, make=_gpt, edit=None, **load_kw):
    """A trigger: the plan file ``text()`` written to a temporary directory (``edit``: its JSON edited first, by
    tests/test_plan_file.py's ``_edited``), then ``autoshard.load_plan`` for ``make()``'s model and inputs."""
    def run():
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "plan.json"
            path.write_text(text())
            if edit is not None:
                path = _edited(path, Path(d), edit)
            model, args, kwargs = make()
            autoshard.load_plan(path, model, args, kwargs, **load_kw)
    return run


def _load_plan_text(text: str):
    """A trigger: ``autoshard.load_plan`` of a file holding ``text``."""
    def run():
        with tempfile.TemporaryDirectory() as d:
            Path(d, "plan.json").write_text(text)
            autoshard.load_plan(Path(d, "plan.json"), *_gpt())
    return run


def _plan_file_world_size():
    with _one_rank_process_group():  # a job of one rank loads the plan of data=2
        _load_plan()()


def _plan_file_unstorable():
    model, args, kwargs = _mlp()
    plan = autoshard.plan(model, autoshard.Mesh(data=2), args, kwargs)
    plan.context.options = dataclasses.replace(plan.context.options, moe=object())
    with tempfile.TemporaryDirectory() as d:
        plan.save(f"{d}/plan.json")


def _swap_stages(doc):
    """As a file saved where the pipeline cut the stages otherwise."""
    doc["split"]["modules"] = doc["split"]["modules"][::-1]


def _cluster(**kw):
    """A trigger: ``plan_cluster`` of the MLP on 2 devices, ``kw`` its keywords."""
    def run():
        model, args, kwargs = _mlp()
        return plan_cluster(model, args, kwargs, **{"devices": 2, **kw})
    return run


TRIGGERS = {
    # model capture and ops
    "model-not-module": lambda: autoshard.compile(lambda x: x, autoshard.Mesh(x=2), (torch.ones(2),)),
    "untraceable-model": lambda: autoshard.compile(Branchy(), autoshard.Mesh(x=2), (torch.ones(4, 8),)),
    "unsupported-op": lambda: autoshard.compile(Det(), autoshard.Mesh(x=2), (torch.ones(4, 8),),
                                                annotations={"fc.weight": ("S(0)",)}, on_unsupported="error"),
    # meshes
    "mesh-no-axes": lambda: autoshard.Mesh(),
    "mesh-axis-name": lambda: autoshard.Mesh({"2d": 2}),
    "mesh-axis-twice": lambda: autoshard.Mesh({"data": 2}, data=2),
    "mesh-axis-size": lambda: autoshard.Mesh(data=0),
    "mesh-text": lambda: autoshard.Mesh.parse("data:2"),
    "mesh-type": lambda: _compile([2, 2]),
    "mesh-unknown-axis": lambda: autoshard.Mesh(data=2).index("model"),
    "rank-outside-mesh": lambda: _compile({"data": 2}).rank_program(2),
    "world-size-mismatch": _world_size_mismatch,
    "no-process-group": _no_dist,
    # annotations and options
    "annotation-not-tuple": lambda: _compile({"model": 2}, {"fc1.weight": "S(0)"}),
    "annotation-length": lambda: _compile({"data": 2, "model": 2}, {"fc1.weight": ("S(0)",)}),
    "annotation-placement": lambda: _compile({"model": 2}, {"fc1.weight": (3,)}),
    "annotation-placement-text": lambda: parse_placement("Shard"),
    "annotation-dim-range": lambda: _compile({"model": 2}, {"fc1.weight": (Shard(2),)}),
    "annotation-dim-twice": lambda: _compile({"data": 2, "model": 2}, {"fc1.weight": (Shard(0), Shard(0))}),
    "non-divisible-dim": lambda: _compile({"model": 3}, {"fc1.weight": (Shard(1),)}),
    "annotation-matches-nothing": lambda: _compile({"model": 2}, {"fc9.weight": (Shard(0),)}),
    "annotation-partial-param": lambda: _compile({"model": 2}, {"fc1.weight": (Partial(),)}),
    "option-on-unsupported": lambda: _compile({"model": 2}, on_unsupported="skip"),
    "option-data-axis": lambda: _compile({"model": 2}, data_axis=0),
    "option-planner": lambda: _compile({"model": 2}, planner="best"),
    "option-optimizer": lambda: _compile({"model": 2}, optimizer="lion"),
    "option-memory-limit": lambda: _compile({"model": 2}, memory_limit="lots"),
    "batch-not-divisible": lambda: autoshard.data_shard(torch.ones(3, 2), autoshard.Mesh(data=2), 0),
    # MoE and pipeline options
    "moe-num-experts": _moe(num_experts=0),
    "moe-top-k": _moe(num_experts=4, top_k=5),
    "moe-capacity-factor": _moe(capacity_factor=0.0),
    "moe-init": _moe(init="zeros"),
    "moe-option-type": lambda: _compile({"data": 2}, moe={"num_experts": 4}),
    "pipeline-axis": _pipeline({"data": 2}),
    "pipeline-microbatches": _pipeline({"pipe": 2}, microbatches=0),
    "pipeline-schedule": _pipeline({"pipe": 2}, microbatches=4, schedule="zigzag"),
    "pipeline-too-few-microbatches": _pipeline({"pipe": 4}, microbatches=2, schedule="1f1b"),
    # running
    "runtime-shape": _runtime_shape,
    "runtime-dtype": _runtime_dtype,
    "no-plan-yet": lambda: autoshard.compile(_mlp()[0], autoshard.Mesh(data=2)).show(),
    "no-parameters-yet": lambda: list(autoshard.compile(_mlp()[0], autoshard.Mesh(data=2)).parameters()),
    "no-loss": lambda: autoshard.compile(NoLoss(), autoshard.Mesh(x=2), (torch.ones(4, 8),)).plan.simulate(
        (torch.ones(4, 8),)),
    "collective-timeout": _sim_timeout,
    "ranks-in-other-modes": _eval_on_rank0,
    "ranks-in-other-grad-modes": _no_grad_on_rank0,
    "ranks-planned-differently": _planned_differently,
    "ranks-called-differently": _called_differently,
    "no-sync-unbucketed": lambda: autoshard.compile(_mlp()[0], autoshard.Mesh(data=2), bucket_cap_mb=0).no_sync(
        ).__enter__(),
    "shard-needs-examples": lambda: autoshard.shard(_mlp()[0], autoshard.Mesh(data=1)),
    "shard-twice": _shard_twice,
    "shard-pipeline": lambda: autoshard.shard(_mlp()[0], autoshard.Mesh(pipe=1), example_inputs=_mlp()[1],
                                              pipeline=autoshard.Pipeline(microbatches=1)),
    "sharded-model-moved": _sharded_model_moved,
    "peer-died": "tests/test_faults.py::test_a_rank_dying_mid_step_makes_every_other_rank_fail_within_the_timeout",
    "peer-hangs": "tests/test_faults.py::test_a_rank_hanging_mid_step_makes_every_other_rank_time_out",
    # checkpoints
    "checkpoint-missing": _ckpt(lambda d: autoshard.load(_mlp()[0], f"{d}/nothing")),
    "checkpoint-partial": _ckpt(_ckpt_partial),
    "checkpoint-no-marker": _ckpt(_ckpt_no_marker),
    "checkpoint-shape": _ckpt(_ckpt_shape),
    "checkpoint-missing-tensor": _ckpt(_ckpt_missing),
    "checkpoint-no-optimizer": _ckpt(_ckpt_no_optim),
    "checkpoint-optimizer-type": _ckpt(_ckpt_optim_type),
    "checkpoint-foreign-param": _ckpt(_ckpt_foreign_param),
    "checkpoint-target": _ckpt(lambda d: autoshard.save("model", f"{d}/ck")),
    "checkpoint-comm-mesh": lambda: autoshard.full_state_dict(
        _compile({"model": 2}, comm=autoshard.runtime.SimWorld(autoshard.Mesh(x=2)).communicator(0))),
    "checkpoint-save-interrupted":
        "tests/test_faults.py::test_a_rank_dying_during_save_leaves_no_checkpoint_that_loads",
    # plan files
    "plan-file-missing": lambda: autoshard.load_plan(Path(tempfile.gettempdir(), "no-such-dir", "plan.json"), *_gpt()),
    "plan-file-not-json": _load_plan_text("not json"),
    "plan-file-format": _load_plan(edit=lambda d: d.update(format="something")),
    "plan-file-version": _load_plan(edit=lambda d: d.update(version=2)),
    "plan-file-damaged": _load_plan(edit=lambda d: d.pop("decisions")),
    "plan-file-malformed-value": _load_plan(edit=lambda d: d["options"].update(memory_limit={"$": "float"})),
    "plan-file-dtype": _load_plan(edit=lambda d: d["options"].update(memory_limit={"$": "dtype", "name": "float4"})),
    "plan-file-tag": _load_plan(edit=lambda d: d["options"].update({"$": "Popen"})),
    "plan-file-fields": _load_plan(edit=lambda d: d["options"].update(planner_v2=1)),
    "plan-file-unstorable": _plan_file_unstorable,
    "plan-file-model-type": lambda: autoshard.load_plan("plan.json", lambda x: x, (torch.ones(2),)),
    "plan-file-other-model": _load_plan(make=_renamed),
    "plan-file-other-tying": _load_plan(make=_untied),
    "plan-file-other-mode": _load_plan(make=_eval),
    "plan-file-other-inputs": _load_plan(make=lambda: _gpt(batch=8)),
    "plan-file-other-mesh": _load_plan(mesh=autoshard.Mesh(data=4)),
    "plan-file-other-world-size": _plan_file_world_size,
    "plan-file-foreign-nodes": _load_plan(edit=_rename_a_decision),
    "plan-file-too-few-decisions": _load_plan(edit=lambda d: d.update(decisions=[])),
    "plan-file-too-many-decisions": _load_plan(edit=lambda d: d.update(decisions=d["decisions"] * 2)),
    "plan-file-replays-otherwise": _load_plan(edit=_layout_changed),
    "plan-file-other-stages": _load_plan(_pipeline_text, lambda: chain(batch=4), _swap_stages, loss_fn=F.mse_loss),
    "plan-file-needs-loss-fn": _load_plan(_pipeline_text, lambda: chain(batch=4)),
    "plan-file-loss-fn-without-pipeline": _load_plan(loss_fn=F.mse_loss),
    # choosing the mesh for N devices
    "cluster-devices": _cluster(devices=0),
    "cluster-gpus-per-node": _cluster(gpus_per_node=0),
    "cluster-annotations": _cluster(annotations={"fc1.weight": ("S(0)",)}),
    "cluster-pipeline": _cluster(pipeline=autoshard.Pipeline(microbatches=2)),
    "cluster-context-parallel": _cluster(context_parallel="context"),
    "cluster-no-devices": _cluster(devices=None),
    "cluster-search-type": _cluster(search={"memory_limit": "80GiB"}),
    "cluster-no-plan": lambda: _cluster(search=autoshard.Search(memory_limit="1KiB"))().best,
}

TRIGGERS.update(CATALOGUE_TRIGGERS)


def test_every_row_has_a_trigger_and_every_trigger_a_row():
    assert SECTION in README.read_text(), f"README has no section {SECTION!r}"
    ids = [r[0] for r in rows()]
    assert len(ids) == len(set(ids)), "duplicate ids in the README table"
    assert sorted(set(ids) - set(TRIGGERS)) == [], "README rows without a trigger"
    assert sorted(set(TRIGGERS) - set(ids)) == [], "triggers without a README row"


@pytest.mark.parametrize("row", rows(), ids=lambda r: r[0])
def test_row(row):
    rid, cls_name, _, _ = row
    cls = getattr(errors, cls_name)
    trigger = TRIGGERS[rid]
    if isinstance(trigger, str):
        # raised on real processes by that test, which checks every raised message against this row
        path, name = trigger.split("::")
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        test = getattr(module, name, None)
        assert callable(test), f"{trigger} does not exist"
        assert getattr(module, "assert_row", None) is assert_row, f"{path} does not use assert_row"
        assert f'"{rid}"' in inspect.getsource(test), f"{trigger} does not check its messages against row {rid!r}"
        return
    if rid.startswith("moe-"):
        pytest.importorskip("autoshard.compiler.moe")
    with pytest.raises(cls) as info:
        trigger()
    assert_row(rid, cls_name, str(info.value))


def test_running_on_a_communicator_of_another_mesh_is_detected():
    model, (x, t), _ = models.mlp()
    mesh4 = autoshard.Mesh(model=4)
    world = autoshard.runtime.SimWorld(autoshard.Mesh(data=2, model=2), timeout=30)

    def body(rank):
        sharded = autoshard.compile(model, mesh4, (x, t), annotations=models.megatron(mesh4, "mlp"),
                                    comm=world.communicator(rank))
        return sharded(x, t)

    with pytest.raises(errors.MeshError):
        world.run(body)
