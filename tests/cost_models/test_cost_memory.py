"""Per-rank memory: parameters, gradients, optimizer state, saved activations."""

from __future__ import annotations

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
