"""The Megatron plan's memory and communication: per-rank parameter bytes, and the collectives actually run."""

from __future__ import annotations

import re

import pytest
import torch

import autoshard
from autoshard.runtime import collective_counts
from examples import models

# Parameters the Megatron plan leaves replicated on the model axis: norms and the biases added after a
# row-parallel linear (they would otherwise be summed once per rank).
REPLICATED = {
    "gpt": r"(^|\.)ln\w*\.|attn\.out\.bias$|mlp\.2\.bias$",
    "hf_gpt2": r"\.ln_\w+\.|c_proj\.bias$",
    "hf_llama": r"norm\.weight$",
}


def _params(model) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())  # tied weights once, as they are stored


@pytest.mark.parametrize("name", ["gpt", "hf_gpt2", "hf_llama"])
def test_megatron_parameter_bytes_are_half_plus_replicated(name):
    model, args, kwargs = models.FACTORIES[name](layers=2)
    mesh = autoshard.Mesh(model=2)
    plan = autoshard.compile(model, mesh, args, kwargs, annotations=models.megatron(mesh, name)).plan
    params = _params(model)
    total = sum(p.numel() * p.element_size() for p in params.values())
    replicated = sum(p.numel() * p.element_size() for n, p in params.items() if re.search(REPLICATED[name], n))
    assert replicated > 0
    for rank in range(mesh.size):
        local = sum(p.numel() * p.element_size() for p in plan.rank_program(rank).parameters())
        expected = replicated + (total - replicated) / 2
        assert abs(local - expected) <= 0.01 * expected, (local, expected)
        assert local == expected  # exact: every non-replicated parameter is split in two


@pytest.mark.parametrize("n", [2, 4])
def test_gpt_block_runs_two_all_reduces_forward_and_two_backward(n):
    model, (x,), _, ann = models.gpt_block()
    bsh = x.numel()
    mesh = autoshard.Mesh(model=n)
    plan = autoshard.compile(model, mesh, (x,), annotations=ann).plan
    sim = plan.simulate((x,), {})
    for log in sim.logs:
        big = [r for r in log if r.numel == bsh]
        counts = collective_counts(big)
        assert counts == {("all_reduce", "model"): 4}, counts
        assert [r.phase for r in big].count("forward") == 2
        assert [r.phase for r in big].count("backward") == 2
        # nothing else of activation size moves: only the scalar loss and parameter-sized gradient syncs
        assert all(r.numel < bsh for r in log if r not in big)


@pytest.mark.parametrize("name", ["gpt", "hf_llama"])
def test_megatron_model_forward_all_reduces_per_layer(name):
    layers = 3
    model, args, kwargs = models.FACTORIES[name](layers=layers)
    mesh = autoshard.Mesh(model=2)
    plan = autoshard.compile(model, mesh, args, kwargs, annotations=models.megatron(mesh, name)).plan
    sim = plan.simulate(args, kwargs)
    ids = args[0] if args else kwargs["input_ids"]
    bsh = ids.numel() * 64
    fwd = [r for r in sim.logs[0] if r.kind == "all_reduce" and r.phase == "forward" and r.numel == bsh]
    bwd = [r for r in sim.logs[0] if r.kind == "all_reduce" and r.phase == "backward" and r.numel == bsh]
    # 2 per layer, plus one where the vocab-parallel embedding's Partial sum first meets a norm (forward) and one
    # for the gradient of the vocab-parallel LM head's replicated input (backward)
    assert len(fwd) == 2 * layers + 1
    assert len(bwd) == 2 * layers + 1
