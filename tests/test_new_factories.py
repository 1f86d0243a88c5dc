"""``x.new_empty(size)`` and kin (``new_zeros``, ``new_ones``, ``new_full``) shard their output on any dim: each rank
makes its local shape, and ``x``, which lends only its dtype and device, is taken as it is when it is sharded as the
output (autoshard/compiler/ops/factories.py).

The pattern is Hugging Face's DeepSeek-V3 attention's (``expand_kv``): keys assembled by copying two parts into the
slices of ``kv.new_empty(b, heads, s, d)``. Replicated, that tensor was held whole on every rank and ``kv`` gathered
to make it (at DeepSeek-V3's size, 48 GiB per layer on each rank). Loss and every gradient equal one device."""

from __future__ import annotations

import copy

import pytest
import torch

import autoshard
from autoshard import meta as M
from autoshard.compiler.plan import loss_of
from autoshard.placements import Replicate, Shard

aten = torch.ops.aten


class _Keys(torch.nn.Module):
    """``kv -> (k_nope, v)``, keys = ``[k_nope | k_rot]`` written into ``kv.new_empty``, then attention-like use."""

    def __init__(self, hidden=16, heads=4, nope=4, rot=2, fill: str = "empty"):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.heads, self.nope, self.rot, self.fill = heads, nope, rot, fill
        self.kv = torch.nn.Parameter(torch.randn(hidden, heads * 2 * nope, generator=g) * 0.3)
        self.k_rot = torch.nn.Parameter(torch.randn(hidden, rot, generator=g) * 0.3)
        self.q = torch.nn.Parameter(torch.randn(hidden, heads * (nope + rot), generator=g) * 0.3)

    def forward(self, x):
        b, s, _ = x.shape
        kv = (x @ self.kv).view(b, s, self.heads, 2 * self.nope).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.nope], dim=-1)
        k_rot = (x @ self.k_rot).view(b, 1, s, self.rot).expand(-1, self.heads, -1, -1)
        shape = (*kv.shape[:-1], self.nope + self.rot)
        keys = {"empty": lambda: kv.new_empty(shape), "zeros": lambda: kv.new_zeros(shape),
                "full": lambda: kv.new_full(shape, 3.0)}[self.fill]()
        keys[..., : self.nope].copy_(k_nope)
        keys[..., self.nope:].copy_(k_rot)
        q = (x @ self.q).view(b, s, self.heads, self.nope + self.rot).transpose(1, 2)
        out = torch.nn.functional.scaled_dot_product_attention(q, keys, v, is_causal=True)
        return out.square().mean()


def _check(model, x, mesh, annotations=None):
    ref = copy.deepcopy(model)
    want = ref(x)
    want.backward()
    plan = autoshard.plan(model, mesh, (x,), annotations=annotations)
    sim = plan.simulate((x,))
    for out in sim.outputs:
        torch.testing.assert_close(loss_of(out).detach(), want.detach(), rtol=1e-5, atol=1e-6)
    grads = dict(ref.named_parameters())
    assert set(sim.grads) == set(grads)
    for name, g in sim.grads.items():
        torch.testing.assert_close(g, grads[name].grad, rtol=1e-5, atol=1e-6)
    (node,) = [n for n in plan.graph_module.graph.nodes if n.op == "call_function"
               and n.target in (aten.new_empty.default, aten.new_zeros.default, aten.new_full.default)]
    return plan, node


@pytest.mark.parametrize("fill", ["empty", "zeros", "full"])
def test_data_parallel_keys_are_made_sharded_and_nothing_is_gathered(fill):
    """Batch on ``data``: the keys are made sharded as their batch (half per rank) and no collective runs in forward
    (replicated, ``kv`` was all-gathered into the keys' input)."""
    x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(1))
    plan, node = _check(_Keys(fill=fill), x, autoshard.Mesh(data=2))
    assert node.meta[M.SPEC] == (Shard(0),)
    assert not [name for name, info in plan.collectives() if "gather" in info.kind]


def test_heads_on_model_keys_are_made_sharded_on_heads():
    """``data=2 x model=2`` with the heads' projections column-parallel on ``model``: the keys are made sharded on
    batch and heads, a quarter per rank."""
    x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(1))
    col = (Replicate(), Shard(1))
    plan, node = _check(_Keys(), x, autoshard.Mesh(data=2, model=2), {"kv": col, "q": col})
    assert node.meta[M.SPEC] == (Shard(0), Shard(1))
    assert not [name for name, info in plan.collectives() if "gather" in info.kind]
