"""Per-rank memory: parameters, gradients, optimizer state, saved activations."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from autoshard.cost_models.memory import (
    activation_bytes,
    grad_bytes,
    optimizer_state_bytes,
    param_bytes,
    training_state_bytes,
)
from torch import nn

from autoshard.errors import PlanError


def test_params_grads_optimizer_state():
    assert param_bytes(1000) == 4000
    assert param_bytes(1000, torch.bfloat16) == 2000
    assert grad_bytes(1000, torch.bfloat16) == 2000
    assert optimizer_state_bytes(4000, "sgd") == 0
    assert optimizer_state_bytes(4000, "sgd_momentum") == 4000
    assert optimizer_state_bytes(4000, "adam") == 8000  # two fp32 moments
    assert optimizer_state_bytes(2000, "AdamW", torch.bfloat16) == 8000  # moments stay fp32
    assert training_state_bytes(1000, optimizer="adam") == 4000 + 4000 + 8000


def test_unknown_optimizer_lists_the_known_ones():
    with pytest.raises(PlanError, match=r"'lion'.*\['adam', 'adamw', 'sgd', 'sgd_momentum'\]"):
        optimizer_state_bytes(100, "lion")


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.down = nn.Linear(64, 16)

    def forward(self, x):
        h = self.up(x)
        y = self.down(F.gelu(h))
        z = torch.relu(y + x)
        return z.sum()


@pytest.fixture(scope="module")
def nodes():
    gm = torch.export.export(MLP(), (torch.randn(8, 16),), strict=False).module()
    return {nd.name: nd for nd in gm.graph.nodes}


def test_saved_activations(nodes):
    assert activation_bytes(nodes["x"]) == 8 * 16 * 4  # saved by the first linear
    assert activation_bytes(nodes["linear"]) == 8 * 64 * 4  # gelu's input
    assert activation_bytes(nodes["gelu"]) == 8 * 64 * 4  # the second linear's input
    assert activation_bytes(nodes["linear_1"]) == 0  # read only by add
    assert activation_bytes(nodes["add"]) == 0  # read only by relu, which saves its output instead
    assert activation_bytes(nodes["relu"]) == 8 * 16 * 4
    assert activation_bytes(nodes["sum_1"]) == 0


def test_parameters_are_not_activations(nodes):
    params = [nd for nd in nodes.values() if nd.op == "get_attr"]
    assert params and all(activation_bytes(nd) == 0 for nd in params)


def test_local_numel_scales(nodes):
    assert activation_bytes(nodes["gelu"], local_numel=8 * 64 // 4) == 8 * 64


def test_dropout_keeps_its_mask():
    class M(nn.Module):
        def forward(self, x):
            return F.dropout(x, 0.5, training=True) + x

    gm = torch.export.export(M(), (torch.randn(4, 8),), strict=False).module()
    drop = next(nd for nd in gm.graph.nodes if "dropout" in nd.name)
    assert activation_bytes(drop) == 4 * 8  # one byte per element of mask; the output itself is not saved


def test_views_of_parameters_are_parameters():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 4))

        def forward(self, x):
            return (x @ self.w.t()).sum()

    gm = torch.export.export(M(), (torch.randn(2, 4),), strict=False).module()
    transposed = next(nd for nd in gm.graph.nodes if getattr(nd.target, "overloadpacket", None) is torch.ops.aten.t)
    assert activation_bytes(transposed) == 0
    assert activation_bytes(next(nd for nd in gm.graph.nodes if nd.op == "placeholder")) == 2 * 4 * 4


def test_a_product_keeps_an_operand_only_for_the_other_operands_gradient():
    class M(nn.Module):
        def forward(self, x, y):
            h = x * 0.5  # keeps no x (its gradient needs only 0.5)
            g = h * y  # keeps h and y: each is the other's gradient
            return (g / 3.0).sum() + (y / g).sum()  # g / 3 keeps no g; y / g keeps y and g

    gm = torch.export.export(M(), (torch.randn(4, 8), torch.randn(4, 8)), strict=False).module()
    nodes = {nd.name: nd for nd in gm.graph.nodes}
    assert activation_bytes(nodes["x"]) == 0
    assert activation_bytes(nodes["mul"]) == 4 * 8 * 4  # h
    assert activation_bytes(nodes["y"]) == 4 * 8 * 4
    assert activation_bytes(nodes["mul_1"]) == 4 * 8 * 4  # g, kept by y / g


def test_a_dropout_at_p_0_keeps_no_mask():
    class M(nn.Module):
        def forward(self, x):
            return F.dropout(x, 0.0, training=True) + x

    gm = torch.export.export(M(), (torch.randn(4, 8),), strict=False).module()
    drop = next(nd for nd in gm.graph.nodes if "dropout" in nd.name)
    assert activation_bytes(drop) == 0


def test_a_1f1b_stage_holds_its_microbatches_in_flight_with_every_gradient():
    """Pipe=2 x data=2, 4 microbatches, 1F1B: stage 0 runs two microbatches' forwards before the first backward,
    then one forward per backward — its later forwards run with every gradient made. Stage 1's step holds the
    once-per-step gradient sync: the gradients, their flat copy and the all-reduced one."""
    import autoshard
    from autoshard.cost_models.memory import plan_memory
    from examples import models

    model, args, _ = models.gpt(batch=32, seq=64, layers=2, hidden=32, heads=4, vocab=64)
    mesh = autoshard.Mesh(pipe=2, data=2)
    pplan = autoshard.compile(model, mesh, args, pipeline=autoshard.Pipeline(microbatches=4, schedule="1f1b")).plan
    one = [plan_memory(sg.gm, pplan.submesh) for sg in pplan.stages]  # one microbatch, nothing kept for the schedule
    first, last = pplan.stage_breakdown(0, 0), pplan.stage_breakdown(1, 2)
    outputs = sum(math.prod(s) * d.itemsize for s, d in pplan.act_meta(0, 0, "outputs"))
    assert first.activations == 2 * (one[0].activations + outputs)  # the stage's output kept per microbatch
    assert first.accumulated == first.gradients == one[0].gradients
    assert first.buffers == 4 * outputs  # a receive buffer per microbatch for the gradient of its output
    assert first.peak >= first.end_of_forward >= one[0].end_of_forward + one[0].activations + one[0].gradients
    assert last.gradient_sync == 2 * last.gradients
    assert last.optimizer_step == last.parameters + last.optimizer + last.buffers + 3 * last.gradients
