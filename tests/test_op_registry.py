"""The op registry (``autoshard/compiler/ops``): no entry lacks a facet it needs, lookups fall back as documented,
and an op registered in one place (a toy ``torch.library`` op, here) is sharded end to end.

Facets an entry needs:

* an op that can be sharded and writes a shape into the program (a ``size``/``shape``/``sizes`` list argument:
  view, reshape, expand, unflatten) has a ``localize`` facet — the shape must become the local one;
* an op whose rule can name ``bias`` inputs (added once where the output is Partial) has a ``localize`` facet;
* every op with a sharding rule states its FLOPs and what it saves (explicitly or by a named default such as
  ``flops=elementwise``, ``saves=()``), on its overload or its packet;
* a ``localize`` facet belongs to an op with a rule (a local form of an op that is never sharded is dead code).
"""

from __future__ import annotations

import math

import pytest
import torch
from autoshard.cost_models.compute import flops
from autoshard.cost_models.memory import activation_bytes
from torch import nn

import autoshard
from autoshard.frontend.graph_utils import out_vals, shape, tensor_inputs
from autoshard.compiler.ops import DEFAULTS, OpEntry, entry, op, registered, rule_for, stated, unregister
from autoshard.compiler.ops.dimmap import OpInfo, factory, pointwise, reduce_rule, replicate_only
from autoshard.compiler.ops.local import input_spec, scale_by
from autoshard.compiler.ops.registry import elementwise, zero
from autoshard.placements import local_shape
from autoshard.compiler.plan import loss_of
from tests import opcases

aten = torch.ops.aten
SHAPE_ARGS = {"size", "shape", "sizes"}


def _rule_keys() -> list:
    return [k for k in registered() if stated(k).rule is not None]


def _overloads(key) -> list:
    if isinstance(key, torch._ops.OpOverload):
        return [key]
    if isinstance(key, torch._ops.OpOverloadPacket):
        return [getattr(key, name) for name in key.overloads()]
    return []  # a plain callable (MoE graph ops): no schema


def _shape_args(overload) -> list[str]:
    return [a.name for a in overload._schema.arguments
            if a.name in SHAPE_ARGS and str(a.type).startswith(("List[int]", "List[SymInt]"))]


# ---------------------------------------------------------------------------------------------------------
# Facet checks
# ---------------------------------------------------------------------------------------------------------
def test_shardable_ops_that_write_a_shape_have_a_local_form():
    missing, checked = [], 0
    for key in _rule_keys():
        if stated(key).rule in (replicate_only, factory):
            continue  # never sharded: the global shape is the local one
        for ov in _overloads(key):
            if _shape_args(ov):
                checked += 1
                if entry(ov).localize is None:
                    missing.append(f"{ov} ({', '.join(_shape_args(ov))})")
    assert checked >= 5  # view, reshape, _unsafe_view, expand, unflatten at least
    assert not missing, f"ops writing a global shape into rank code without a localize facet: {missing}"


def test_rules_with_bias_inputs_have_a_local_form():
    """Evaluated on the traced op cases (real OpInfos): a rule that names a bias needs its add-once local form."""
    from tests.rule_sweep import traced

    with_bias, missing, seen = set(), [], set()
    for c in opcases.CASES:
        if c.op in seen:
            continue
        seen.add(c.op)
        _, _, gm, name = traced(c.name)
        node = next(n for n in gm.graph.nodes if n.name == name)
        info = OpInfo([shape(x) for x in tensor_inputs(node)], [tuple(v.shape) for v in out_vals(node)], node.args,
                      dict(node.kwargs), [v.dtype for v in out_vals(node)])
        if rule_for(c.op)(info).bias:
            with_bias.add(c.op)
            if entry(c.op).localize is None:
                missing.append(str(c.op))
    assert {aten.linear.default, aten.addmm.default} <= with_bias
    assert not missing, f"rules with bias inputs but no localize facet: {missing}"


def test_every_op_with_a_rule_states_its_flops_and_saves():
    missing = [f"{k}: {f}" for k in _rule_keys() for f in ("flops", "saves") if getattr(stated(k), f) is None]
    assert not missing, f"ops with a sharding rule but no stated cost facet: {missing}"


def test_local_forms_belong_to_ops_with_rules():
    dead = [str(k) for k, e in registered().items() if e.localize is not None and rule_for(k) is None]
    assert not dead, dead


# ---------------------------------------------------------------------------------------------------------
# The registry's mechanics
# ---------------------------------------------------------------------------------------------------------
def test_lookup_goes_overload_then_packet_then_defaults():
    mm = entry(aten.mm.default)
    assert mm.rule is not None and mm.backward == 2.0 and mm.saves == (0, 1)  # rule on the overload, cost on mm
    assert entry(aten.mm.out).rule is None and entry(aten.mm.out).backward == 2.0  # cost only, from the packet
    # priced, not sharded
    assert entry(aten.diagonal.default).rule is None and entry(aten.diagonal.default).flops is zero
    unknown = entry(aten.cosh.default)
    assert unknown == DEFAULTS and DEFAULTS.rule is None and DEFAULTS.flops is elementwise


def test_an_op_is_registered_once_and_facets_are_checked():
    with pytest.raises(ValueError, match="registered twice"):
        op(aten.mm.default, flops=zero)
    with pytest.raises(ValueError, match="saves"):
        op(aten.diagonal.default, saves=[0])
    assert aten.diagonal.default not in registered()


# ---------------------------------------------------------------------------------------------------------
# A toy op, registered in one place, sharded end to end
# ---------------------------------------------------------------------------------------------------------
@torch.library.custom_op("autoshard_test::scaled_add", mutates_args=())
def scaled_add(x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
    return x + alpha * y


@scaled_add.register_fake
def _(x, y, alpha):
    return torch.empty_like(x)


scaled_add.register_autograd(lambda ctx, g: (g, g * ctx.alpha, None),
                             setup_context=lambda ctx, inputs, output: setattr(ctx, "alpha", inputs[2]))


@torch.library.custom_op("autoshard_test::global_mean", mutates_args=())
def global_mean(x: torch.Tensor) -> torch.Tensor:
    return x.mean()


@global_mean.register_fake
def _(x):
    return x.new_empty(())


global_mean.register_autograd(lambda ctx, g: g.expand(ctx.shape) / math.prod(ctx.shape),
                              setup_context=lambda ctx, inputs, output: setattr(ctx, "shape", inputs[0].shape))


def _global_mean_local(graph, new, old, mesh, rank):
    # a sharded input gives a Partial output: scale the local mean by local/global element count
    x = old.args[0].meta["val"]
    return scale_by(graph, new, math.prod(local_shape(x.shape, input_spec(old), mesh)) / x.numel())


@pytest.fixture
def toy_ops():
    """The whole registration of both toy ops: rule, local form, FLOPs, saves — one place each."""
    scaled, mean = torch.ops.autoshard_test.scaled_add.default, torch.ops.autoshard_test.global_mean.default
    op(scaled, rule=pointwise("sum", linear_inputs=(0, 1)), flops=lambda o: 2 * o.out_numel(), saves=())
    op(mean, rule=lambda info: reduce_rule(info, None, False, linear=True), localize=_global_mean_local,
       flops=lambda o: o.numel(0), saves=())
    yield scaled, mean
    unregister(scaled, mean)
    assert rule_for(scaled) is None and entry(mean) == DEFAULTS


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(8, 16)

    def forward(self, x):
        h = torch.ops.autoshard_test.scaled_add(self.a(x), self.b(x), 0.5)
        return torch.ops.autoshard_test.global_mean(torch.tanh(h) * h)


@pytest.mark.parametrize("mesh_axes", [{"data": 2}, {"model": 2}], ids=["data2", "model2"])
def test_toy_op_registered_in_one_place_is_sharded_end_to_end(toy_ops, mesh_axes):
    scaled, mean = toy_ops
    torch.manual_seed(0)
    model, x = Toy(), torch.randn(4, 8)
    ann = {"a.weight": ("S(0)",), "a.bias": ("S(0)",), "b.weight": ("S(0)",), "b.bias": ("S(0)",)} \
        if "model" in mesh_axes else None
    plan = autoshard.compile(model, autoshard.Mesh(**mesh_axes), (x,), annotations=ann).plan

    # the toy ops are in the plan, sharded, and priced from their registry facets
    nodes = {n.target: n for n in plan.graph_module.graph.nodes if n.op == "call_function"}
    assert scaled in nodes and mean in nodes
    assert any(not isinstance(p, autoshard.Replicate) for p in plan.graph_module.graph.find_nodes(
        op="call_function", target=scaled)[0].meta["autoshard.spec"])
    assert flops(nodes[scaled]) == 2 * 4 * 16 and activation_bytes(nodes[scaled]) > 0  # tanh and mul keep h

    model.zero_grad()
    ref = model(x)
    ref.backward()
    sim = plan.simulate((x,))
    for rank, out in enumerate(sim.outputs):
        torch.testing.assert_close(loss_of(out).detach(), ref.detach(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, r=rank: f"loss on rank {r}: {m}")
    assert set(sim.grads) == {n for n, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        torch.testing.assert_close(sim.grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_an_entry_is_a_frozen_dataclass_of_facets():
    e = OpEntry(flops=zero)
    with pytest.raises(AttributeError):
        e.flops = elementwise  # type: ignore[misc]
    assert e.stated() == {"flops": zero}
