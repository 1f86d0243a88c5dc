"""Pipeline split (one process): cut points, stage graphs run in sequence equal the model, balance against a
brute-force search, manual cuts, the report, and one test per error message."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autoshard
from autoshard.api.sharded_module import make_options
from autoshard.errors import MeshError, PlanError
from autoshard.compiler.pipeline import Pipeline, bubble_fraction, build_pipeline_plan
from autoshard.compiler.plan import loss_of
from examples import models

SMALL = {"layers": 4, "hidden": 32, "heads": 4, "seq": 8, "batch": 8}


def _pplan(model, args, kwargs, mesh_axes, **pipeline):
    mesh = autoshard.Mesh(**mesh_axes)
    return build_pipeline_plan(model, mesh, args, kwargs, make_options(None, "data", "error", mesh),
                               Pipeline(**pipeline))


def _run_stages(pplan, args, kwargs):
    """Every stage of a pipe-only plan, one after the other in this process, on the first microbatch."""
    inputs = pplan.shard_batch(0, args, kwargs)
    mb = pplan.batch // pplan.pipeline.microbatches
    inputs = {k: v[:mb] for k, v in inputs.items()}
    acts: tuple = ()
    for s in range(pplan.num_stages):
        sg = pplan.stages[s]
        out = pplan.stage_module(s, 0)(*acts, *(inputs[n] for n in sg.inputs))
        acts = tuple(out)
    return acts


@pytest.mark.parametrize("name", ["gpt", "hf_llama"])
def test_stages_in_sequence_equal_the_model(name):
    model, args, kwargs = models.FACTORIES[name](**SMALL)
    pplan = _pplan(model, args, kwargs, {"pipe": 4}, microbatches=4)
    assert pplan.num_stages == 4
    out = _run_stages(pplan, args, kwargs)
    mb = SMALL["batch"] // 4
    ref = loss_of(model(*[a[:mb] for a in args], **{k: v[:mb] for k, v in kwargs.items()}))
    torch.testing.assert_close(out[0], ref.detach(), rtol=1e-5, atol=1e-6)
    # only activations cross: integer inputs and recomputable tensors (positions, masks, rotary tables) stay local
    for b in pplan.split.boundaries:
        assert all(dt.is_floating_point for dt in b.dtypes)
        assert len(b.names) == 1, b.names  # the hidden state between layers


def test_tied_embedding_is_shared_between_first_and_last_stage():
    model, args, kwargs = models.gpt(**SMALL)
    pplan = _pplan(model, args, kwargs, {"pipe": 2}, microbatches=2)
    shared = dict(pplan.shared_params())
    assert list(shared.values()) == [(0, 1)]
    assert pplan.split.modules[0][0] == "wte" and pplan.split.modules[-1][-1] == "head"


def test_manual_split_by_module_path():
    model, args, kwargs = models.gpt(**SMALL)
    pplan = _pplan(model, args, kwargs, {"pipe": 2}, microbatches=2, split=["blocks.1"])
    assert pplan.split.manual
    assert pplan.split.modules[1][0] == "blocks.1"
    assert "blocks.0" in pplan.split.modules[0]


def test_every_stage_of_an_auto_split_holds_a_parameter():
    # On a model this small the data-parallel loss all-reduce (one latency per microbatch) outweighs the layers, and
    # the cheapest split by time alone puts the loss in a stage of its own: a stage with nothing to train.
    model, args, kwargs = models.gpt(layers=2, hidden=32, heads=4, seq=8, batch=8)
    pplan = _pplan(model, args, kwargs, {"pipe": 2, "data": 2}, microbatches=4)
    assert all(stage.params for stage in pplan.stages), [stage.params for stage in pplan.stages]
    assert pplan.split.modules[1] == ("ln_f", "head")


def test_error_manual_split_leaves_a_stage_without_parameters():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.ReLU(), nn.Tanh())
    with pytest.raises(PlanError, match=r"stage 1 holds no parameter .* cut so that every stage holds a layer"):
        _pplan(model, (torch.randn(4, 8),), {}, {"pipe": 2}, microbatches=2, split=["2"])


def test_skip_connection_across_stages_passes_through():
    class Skip(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

        def forward(self, x, y):
            h0 = self.layers[0](x)
            h = h0
            for layer in self.layers[1:]:
                h = torch.tanh(layer(h))
            return F.mse_loss(h + h0, y)  # h0 skips over stages 1 and 2

    torch.manual_seed(0)
    model = Skip()
    args = (torch.randn(8, 16), torch.randn(8, 16))
    pplan = _pplan(model, args, {}, {"pipe": 3}, microbatches=4, split=["layers.1", "layers.2"])
    names = [b.names for b in pplan.split.boundaries]
    assert len(names[0]) == 1 and len(names[1]) == 2 and names[1][0] == names[0][0]  # h0 passes through stage 1
    out = _run_stages(pplan, args, {})
    torch.testing.assert_close(out[0], model(args[0][:2], args[1][:2]).detach())


class Unequal(nn.Module):
    """A chain of linears of very different widths (and so costs)."""

    WIDTHS = (64, 512, 64, 64, 256, 64, 64, 64, 384, 64)

    def __init__(self):
        super().__init__()
        w = self.WIDTHS
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(w))

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return F.mse_loss(x, y)


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_auto_split_is_within_10_percent_of_brute_force(stages):
    from autoshard.cost_models.profile import load_profile
    from autoshard.passes.pipeline_split import analyse

    torch.manual_seed(0)
    model = Unequal()
    args = (torch.randn(64, 64), torch.randn(64, 64))
    pplan = _pplan(model, args, {}, {"pipe": stages}, microbatches=4)
    a = analyse(pplan.microbatch_plan.graph_module, pplan.submesh, load_profile("cpu-gloo"))
    best = min(max(costs) / (sum(costs) / len(costs))
               for cuts in itertools.combinations(range(1, a.n), stages - 1)
               if all(c in a.candidates for c in cuts) for costs in [a.costs_of(cuts)])
    # every layer boundary is a candidate
    assert {a.units[c] for c in a.candidates} >= {f"layers.{i}" for i in range(1, len(Unequal.WIDTHS) - 1)}
    got = pplan.split.imbalance
    assert got <= best * 1.10, (got, best)
    # the brute force over every cut at a layer boundary, by per-layer cost, agrees
    assert max(pplan.split.costs) == pytest.approx(max(a.costs_of(pplan.split.cuts)))


def test_report_lists_stages_boundaries_imbalance_and_bubble():
    model, args, kwargs = models.gpt(**SMALL)
    pplan = _pplan(model, args, kwargs, {"pipe": 2, "model": 2}, microbatches=4, schedule="gpipe")
    text = pplan.format()
    assert "stage  ranks" in text and "0,1" in text and "2,3" in text
    assert "boundary 0->1:" in text and "bytes per microbatch per rank" in text
    assert "imbalance (max/mean stage cost):" in text
    assert f"{bubble_fraction(2, 4):.3f}" in text and "0.200" in text
    assert "blocks.0" in text and "memory (MiB)" in text


def test_bubble_fraction():
    assert bubble_fraction(1, 8) == 0
    assert bubble_fraction(4, 4) == pytest.approx(3 / 7)
    assert bubble_fraction(2, 4, virtual=2) == pytest.approx(1 / 9)


# ---- errors -----------------------------------------------------------------------------------------------
def test_error_more_stages_than_cut_points():
    model, args, kwargs = models.mlp()
    with pytest.raises(PlanError, match="points where it can be cut into pipeline stages, but 8 stages need 7"):
        _pplan(model, args, kwargs, {"pipe": 8}, microbatches=8)


def test_error_manual_cut_names_no_module():
    model, args, kwargs = models.gpt(**SMALL)
    with pytest.raises(PlanError, match="cut point 'blocks.9' names no module of the model"):
        _pplan(model, args, kwargs, {"pipe": 2}, microbatches=2, split=["blocks.9"])


def test_error_manual_cut_count():
    model, args, kwargs = models.gpt(**SMALL)
    with pytest.raises(PlanError, match="has 2 cut points .* which needs 1 cut point"):
        _pplan(model, args, kwargs, {"pipe": 2}, microbatches=2, split=["blocks.1", "blocks.2"])


def test_error_microbatches_do_not_divide_batch():
    model, args, kwargs = models.gpt(**SMALL)
    with pytest.raises(PlanError, match=r"example batch has 8 rows, but Pipeline\(microbatches=3\) must divide it"):
        _pplan(model, args, kwargs, {"pipe": 2}, microbatches=3, schedule="gpipe")


def test_error_microbatch_not_divisible_by_data_axis():
    model, args, kwargs = models.gpt(**SMALL)
    with pytest.raises(PlanError, match="data axis `data` of size 2 must divide it"):
        _pplan(model, args, kwargs, {"pipe": 2, "data": 2}, microbatches=8)


def test_error_1f1b_with_fewer_microbatches_than_stages():
    model, args, kwargs = models.gpt(**SMALL)
    with pytest.raises(PlanError, match="needs at least as many microbatches as stages"):
        _pplan(model, args, kwargs, {"pipe": 4}, microbatches=2, schedule="1f1b")


def test_error_mesh_without_pipe_axis_and_bad_schedule():
    model, args, kwargs = models.gpt(**SMALL)
    with pytest.raises(MeshError, match="has no axis `pipe`"):
        _pplan(model, args, kwargs, {"data": 2}, microbatches=2)
    with pytest.raises(PlanError, match="schedule='zb'"):
        _pplan(model, args, kwargs, {"pipe": 2}, microbatches=2, schedule="zb")


def test_error_annotation_sharded_on_pipe_axis():
    model, args, kwargs = models.gpt(**SMALL)
    mesh = autoshard.Mesh(pipe=2, model=2)
    opts = make_options({"wte.weight": ("S(0)", "R")}, "data", "error", mesh)
    with pytest.raises(PlanError, match="on the pipeline axis `pipe`"):
        build_pipeline_plan(model, mesh, args, kwargs, opts, Pipeline(microbatches=2))


def test_compile_with_pipeline_returns_a_pipelined_module():
    from autoshard.api.pipelined_module import PipelinedModule

    model, args, kwargs = models.gpt(**SMALL)
    sm = autoshard.compile(model, autoshard.Mesh(pipe=2), args, kwargs,
                           pipeline=autoshard.Pipeline(microbatches=2, schedule="gpipe", split=["blocks.2"]))
    assert isinstance(sm, PipelinedModule)
    assert "blocks.2" in sm.plan.split.modules[1] and "boundary 0->1" in sm.format()
    assert "def forward(self, add_" in sm.code(rank=1)
    with pytest.raises(MeshError, match="torch.distributed is not|not initialised"):
        sm(*args)


def test_pipeline_parse():
    p = Pipeline.parse("microbatches=8,schedule=gpipe,split=blocks.1+blocks.3,stages_per_rank=1")
    assert p == Pipeline(microbatches=8, schedule="gpipe", split=("blocks.1", "blocks.3"))
    assert Pipeline.parse("microbatches=2").split == "auto"
    with pytest.raises(PlanError, match="each part is KEY=VALUE"):
        Pipeline.parse("stages=2")


def test_cli_show_pipeline_prints_the_stages(capsys):
    from autoshard.api.cli import main

    argv = ["show", "examples.models:gpt", "--mesh", "pipe=2,model=2", "--megatron", "--factory-arg", "layers=4",
            "--pipeline", "microbatches=4,schedule=gpipe,split=blocks.2"]
    assert main(argv) == 0
    out = " ".join(ln.strip() for ln in capsys.readouterr().out.splitlines())  # lines wrap at the width
    assert "2 stages (manual split), schedule gpipe, 4 microbatches" in out and "boundary 0->1" in out
    assert main([*argv[:-1], "microbatches=4,split=blocks.9"]) == 2
    assert "names no module of the model" in capsys.readouterr().err


def test_stage_programs_go_through_the_plans_collective_check(monkeypatch):
    """A stage's program is made by ``Plan.rank_program``: the stage's programs on different ranks are compared
    (here made to differ), each stage against its own first program."""
    import autoshard.compiler.plan as plan_module
    from autoshard.errors import AutoshardError

    model, args, kwargs = models.gpt(**SMALL)
    pplan = _pplan(model, args, kwargs, {"pipe": 2, "data": 2}, microbatches=2)
    made = itertools.count()
    monkeypatch.setattr(plan_module, "collective_signature", lambda module: (("all_reduce", (next(made),)),))
    pplan.stage_module(0, 0)
    pplan.stage_module(1, 2)  # stage 1's first program: its own reference, not stage 0's
    with pytest.raises(AutoshardError, match=r"^the rank passes made rank 1's program of stage 0 issue collectives "
                                             r"\(\('all_reduce', \(2,\)\),\), but rank 0's issues \(\('all_reduce', "
                                             r"\(0,\)\),\): ranks would wait on each other forever"):
        pplan.stage_module(0, 1)


def test_the_verifier_checks_every_stage_graph():
    """After build_stages the driver verifies each stage graph like the whole one: a stage whose consumer reads an
    input in another spec than its strategy needs is caught."""
    from autoshard import meta as M
    from autoshard.compiler.collective_kinds import kind_of
    from autoshard.errors import AutoshardError
    from autoshard.passes.manager import verify
    from autoshard.placements import Partial

    model, args, kwargs = models.gpt(**SMALL)
    pplan = _pplan(model, args, kwargs, {"pipe": 2, "data": 2}, microbatches=2)
    gm = pplan.microbatch_plan.graph_module
    ran = list(gm.meta[M.PASSES_RUN])
    verify(gm, ran)
    stage = pplan.stages[1].gm
    node, x = next((n, x) for n in stage.graph.nodes if M.STRATEGY in n.meta and kind_of(n) is None
                   for x, want in zip(n.all_input_nodes, n.meta[M.STRATEGY].input_specs) if want is not None)
    x.meta = {**x.meta, M.SPEC: (Partial(),)}  # the stage's own copy: the whole graph's node keeps its spec
    with pytest.raises(AutoshardError, match=rf"^pass 'build_stages' left node `{node.name}` \(.*\) reading input "
                                             rf"\d+ `{x.name}` as \(Partial\(.*\), but its strategy needs"):
        verify(gm, ran)
