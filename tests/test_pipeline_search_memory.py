"""The plan search of a pipelined model bounds each stage's memory: its stages are fixed before
the search (the layers dealt out evenly, :func:`autoshard.cost_models.memory.layer_cuts`), one memory row per
liveness point of a stage, its activations times the microbatches in flight under the schedule
(:class:`autoshard.cost_models.memory.StagedTimeline`); the split cuts where the search fixed the stages. Small
GPTs, one process."""

from __future__ import annotations

import copy

import pytest
import torch

import autoshard
from autoshard import meta as M
from autoshard.compiler.pipeline import Pipeline
from autoshard.compiler.plan import loss_of
from autoshard.errors import PlanError
from examples import models

GPT = {"layers": 8, "hidden": 64, "heads": 4, "seq": 32, "batch": 8}


def _search(pplan) -> dict:
    return M.plan_report(pplan.microbatch_plan.graph_module)["plan_search"]


def _limited_plan():
    """pipe=2, 1F1B over 4 microbatches, 4.5 MB per rank: one microbatch of the whole model needs at least 6.3 MB
    (all its parameters' state), each half of it fits with recomputation."""
    torch.manual_seed(0)
    model, args, kwargs = models.gpt(**GPT)
    ref = copy.deepcopy(model)
    limit = 4.5 * 2**20
    pplan = autoshard.plan(model, autoshard.Mesh(pipe=2), args, kwargs, pipeline=Pipeline(microbatches=4),
                           search=autoshard.Search(memory_limit=limit, recompute="auto"))
    return model, ref, args, kwargs, limit, pplan


def test_a_limit_the_whole_model_cannot_meet_is_met_by_each_stage():
    model, _, args, kwargs, limit, pplan = _limited_plan()
    microbatch = tuple(a[: GPT["batch"] // 4] for a in args)
    with pytest.raises(PlanError, match="least memory any plan needs"):
        autoshard.plan(model, autoshard.Mesh(data=1), microbatch, kwargs,
                       search=autoshard.Search(memory_limit=limit, recompute="auto"))
    section = _search(pplan)
    assert section["stage_cuts"] == ["blocks.4"]
    assert pplan.split.modules[1][0].startswith("blocks.4")  # the split cuts where the search fixed the stages
    memory = [pplan.stage_memory(s) for s in range(pplan.num_stages)]
    assert all(m <= limit for m in memory), memory
    assert section["recomputed"]  # the limit binds: some layers are recomputed
    # the search counts a recomputed share of each stage's copies rounded up: never less than the plan keeps
    for searched, priced in zip(section["stage_memory"], memory):
        assert searched >= 0.99 * priced, (section["stage_memory"], memory)


@pytest.mark.parametrize("limit", [3.0, 3.4])
def test_the_searchs_stage_memory_is_the_pipeline_plans(limit):
    """HF Llama (untied embeddings, as Llama-3), pipe=2 x data=2, 1F1B (stage 0 holds 2 microbatches in flight,
    stage 1 one), ZeRO chosen per parameter: each stage's memory as the search counts it for the plan it chose
    equals PipelinePlan.stage_memory within 3% (0.5-0.6% under here, stage 1; stage 0 exact, 0.9-1.1% under before
    the stage output it keeps per microbatch in flight was counted: values a stage's graph makes again, which the
    whole graph makes once, and the boundary sent in its reader's layout, not its producer's); the plan is searched
    again where its largest stage is over the limit."""
    model, args, kwargs = models.hf_llama(**GPT)
    pplan = autoshard.plan(model, autoshard.Mesh(pipe=2, data=2), args, kwargs, pipeline=Pipeline(microbatches=4),
                           search=autoshard.Search(memory_limit=limit * 2**20, zero="auto", recompute=False))
    searched = _search(pplan)["stage_memory"]
    memory = [pplan.stage_memory(s) for s in range(pplan.num_stages)]
    assert len(searched) == len(memory) == 2
    for a, b in zip(searched, memory):
        assert abs(a - b) <= 0.03 * b, (searched, memory)
    assert max(memory) <= limit * 2**20


@pytest.mark.parametrize("schedule, microbatches", [("gpipe", 4), ("1f1b", 2)])
def test_a_stage_with_every_microbatch_in_flight_is_priced_at_its_first_backward_and_its_later_ones(schedule,
                                                                                                  microbatches):
    """GPipe, and 1F1B with as many microbatches as stages: no microbatch starts after a stage's first backward, which
    holds every microbatch's activations and no gradient; the later backwards hold one microbatch fewer and every
    gradient (:class:`autoshard.cost_models.memory.StagedTimeline`'s twin points). The search's stage memory equals
    PipelinePlan.stage_memory within 1% (measured: within 0.01%), at a limit its old count (every gradient at the
    first backward) met with no plan: 1F1B over 2 microbatches at 3.4 MiB found none in 120 s; GPipe over 4 at 4.0
    MiB counted 7.9-8.6% over."""
    model, args, kwargs = models.hf_llama(**GPT)
    limit = 3.4 * 2**20
    pplan = autoshard.plan(model, autoshard.Mesh(pipe=2, data=2), args, kwargs,
                           pipeline=Pipeline(microbatches=microbatches, schedule=schedule),
                           search=autoshard.Search(memory_limit=limit, zero="auto", recompute=False))
    searched = _search(pplan)["stage_memory"]
    memory = [pplan.stage_memory(s) for s in range(pplan.num_stages)]
    for a, b in zip(searched, memory):
        assert abs(a - b) <= 0.01 * b, (searched, memory)
    assert max(memory) <= limit


def test_without_a_limit_the_split_is_the_cost_balanced_one():
    model, args, kwargs = models.gpt(**GPT)
    pplan = autoshard.plan(model, autoshard.Mesh(pipe=2), args, kwargs, pipeline=Pipeline(microbatches=4),
                           search=autoshard.Search())
    assert _search(pplan)["stage_cuts"] is None and _search(pplan)["stage_memory"] is None


def test_the_limited_pipeline_equals_one_device():
    """Every microbatch through the stage programs in sequence (forward, then backward from the loss): the mean
    loss and every gradient equal the model's on the whole batch."""
    _, ref, args, kwargs, _, pplan = _limited_plan()
    ref_loss = loss_of(ref(*args, **kwargs))
    ref_loss.backward()
    m = pplan.pipeline.microbatches
    rows = pplan.batch // m
    inputs = pplan.shard_batch(0, args, kwargs)
    stages = [pplan.stage_module(s, 0) for s in range(pplan.num_stages)]
    losses = []
    for k in range(m):
        acts: tuple = ()
        for s, sg in enumerate(pplan.stages):
            acts = tuple(stages[s](*acts, *(inputs[n][k * rows:(k + 1) * rows] for n in sg.inputs)))
        (acts[0] / m).backward()
        losses.append(acts[0].detach())
    torch.testing.assert_close(torch.stack(losses).mean(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    grads: dict[str, torch.Tensor] = {}
    for s, module in enumerate(stages):
        for t in pplan.stage_tensors(s):
            if not t.is_param:
                continue
            g = _attr(module, t.target).grad
            for name in t.aliases:
                grads[name] = g if name not in grads else grads[name] + g
    expected = dict(ref.named_parameters())
    assert set(expected) <= set(grads)
    for name, p in expected.items():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=lambda e, n=name: f"{n}: {e}")


def _attr(module, target: str):
    for part in target.split("."):
        module = getattr(module, part)
    return module


def test_the_searchs_stage_memory_is_stage_memory_on_a_llama3_8b_shape():
    """Llama-3-8B shape on meta with 4 layers (vocab 128256: the head's logits dominate the last stage), pipe=4,
    1F1B over 4 microbatches, no ZeRO or recomputation, a limit that does not bind (it makes the search count
    stages): each stage's memory as the search counts it equals PipelinePlan.stage_memory within 3%, as on the
    small HF Llama above. The first stage has every microbatch in flight at its first backward and none starts after
    it: the search counted every gradient there too, 40.4 GiB against 36.7 (+10%); it now prices that backward and
    the later ones (one microbatch fewer, every gradient) at points of their own: 35.7 GiB (-2.7%); counting too
    the stage output every stage but the last keeps per microbatch in flight, 36.7 GiB, and every stage within 0.1%
    (they were 2.6-3.1% under); asserted within 1%."""
    model, args, kwargs = models.llama3_8b_meta(batch=32, seq=2048, layers=4)
    pplan = autoshard.plan(model, autoshard.Mesh(pipe=4), args, kwargs, pipeline=Pipeline(microbatches=4),
                           search=autoshard.Search(profile="multi-node", memory_limit="100GiB", zero=0,
                                                   recompute=False))
    searched = _search(pplan)["stage_memory"]
    memory = [pplan.stage_memory(s) for s in range(pplan.num_stages)]
    for a, b in zip(searched, memory):
        assert abs(a - b) <= 0.01 * b, (searched, memory)


def test_an_axis_of_size_one_beside_pipe_costs_the_last_stage_no_copy():
    """A ``data`` axis of size 1 beside ``pipe``: the batch-shaped output (the logits) leaves in the layout it is made
    in, since every layout of a size-1 axis is the whole tensor on its one rank. It was sliced to this rank's chunk
    there, a clone of the 7.8 GiB logits per microbatch in the last stage that the search did not count (44.6 GiB
    by stage_memory against its 36.8). (The token ids are still all-gathered on that axis where a stage reads them
    replicated: a copy of 128 KiB.)"""
    model, args, kwargs = models.llama3_8b_meta(batch=32, seq=2048, layers=4)
    pplan = autoshard.plan(model, autoshard.Mesh(pipe=4, data=1), args, kwargs, pipeline=Pipeline(microbatches=4),
                           search=autoshard.Search(profile="multi-node", memory_limit="100GiB", zero=0,
                                                   recompute=False))
    last = pplan.num_stages - 1
    assert _search(pplan)["stage_memory"][last] == pytest.approx(pplan.stage_memory(last), rel=0.03)
    kinds = [n.meta[M.COLLECTIVE].kind for n in pplan.stages[last].gm.graph.nodes if M.COLLECTIVE in n.meta]
    assert "local_slice" not in kinds, kinds
