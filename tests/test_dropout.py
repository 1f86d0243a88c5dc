"""Dropout under sharding: replicated copies get the same mask, shards get their slice of one global mask."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard.compiler.plan import loss_of


class DropMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)

    def forward(self, x):
        h = F.dropout(F.gelu(self.fc1(x)), p=0.5, training=True)
        return (F.dropout(self.fc2(h), p=0.25, training=True) ** 2).mean()


def test_dropout_masks_agree_where_replicated_and_loss_is_the_global_mask_loss():
    torch.manual_seed(0)
    model = DropMLP()
    x = torch.randn(8, 16)
    mesh = autoshard.Mesh(data=2, model=2)
    plan = autoshard.compile(model, mesh, (x,), annotations={"fc1.weight": ("R", "S(0)"), "fc1.bias": ("R", "S(0)"),
                                                       "fc2.weight": ("R", "S(1)")}).plan
    sim = plan.simulate((x,))
    losses = [loss_of(o).item() for o in sim.outputs]
    assert max(losses) == min(losses)  # every rank agrees on the (all-reduced) loss
    # the same plan on one device (mesh of 1) with the same global masks gives the same loss
    single = autoshard.compile(model, autoshard.Mesh(data=1), (x,)).plan.simulate((x,))
    torch.testing.assert_close(torch.tensor(losses[0]), loss_of(single.outputs[0]).detach(), rtol=1e-5, atol=1e-6)
    for name, g in sim.grads.items():
        torch.testing.assert_close(g, single.grads[name], rtol=1e-4, atol=1e-6)
