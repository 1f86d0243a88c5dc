"""Property tests (hypothesis): random op chains with random shapes and random annotations, sharded and run in the
simulator, reassemble to the unsharded output, loss and gradients.

A program is an input ``x`` of 2 or 3 dims and a chain of 1-6 ops drawn from: linear (with or without bias),
matmul by a parameter, broadcasting mul/add with a parameter, gelu/tanh, views that merge or split dims,
transpose, sum/mean over a dim, softmax over a dim, and ``h @ h^T``. The loss is ``(h * R).sum()`` for a fixed
random buffer ``R``, and the module returns ``(loss, h)``. Every parameter and the input get a random valid
placement per mesh axis (Replicate or Shard of a divisible dim, a dim on one axis at most); the planner fills in
the rest. Checked: every rank's loss, ``h`` reassembled by its output spec, and every parameter's gradient
reassembled from the shards, against eager PyTorch on the full tensors.

Shrunk failures are kept below as explicit regression tests (``REGRESSIONS``).
"""

from __future__ import annotations

import inspect
import math
import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

import autoshard
from autoshard import meta as M
from autoshard.placements import Replicate, Shard, assemble

MESHES = ({"x": 2}, {"data": 2}, {"data": 2, "model": 2})
SIZES = (2, 4, 6)
ODD = (2, 3, 4)  # sizes of dims that the planner must learn not to split (3 on an axis of 2)


class Chain(torch.nn.Module):
    """``ops`` applied in order to ``x``; parameters ``w0``, ``w1``... as the ops ask for them."""

    def __init__(self, in_shape, ops, final_mean: bool = False, seed: int = 0):
        super().__init__()
        self.final_mean = final_mean
        g = torch.Generator().manual_seed(seed)
        self.ops = ops
        for i, (kind, arg) in enumerate(ops):
            if kind in ("linear", "linear_bias", "matmul", "mul", "add", "div"):
                shape = arg["param"]
                fan = shape[-1] if kind.startswith("linear") else shape[0]
                scale = 1.0 / math.sqrt(fan) if kind in ("linear", "linear_bias", "matmul") else 1.0
                w = torch.randn(*shape, generator=g) * scale
                if kind == "div":
                    w = w.abs() + 1.0  # away from zero
                setattr(self, f"w{i}", torch.nn.Parameter(w))
                if kind == "linear_bias":
                    setattr(self, f"b{i}", torch.nn.Parameter(torch.randn(shape[0], generator=g)))
        self.register_buffer("readout", torch.randn(*out_shape(in_shape, ops), generator=g))

    def forward(self, x):
        h = x
        for i, (kind, arg) in enumerate(self.ops):
            w = getattr(self, f"w{i}", None)
            if kind == "linear":
                h = F.linear(h, w)
            elif kind == "linear_bias":
                h = F.linear(h, w, getattr(self, f"b{i}"))
            elif kind == "matmul":
                h = h @ w
            elif kind == "mul":
                h = h * w
            elif kind == "add":
                h = h + w
            elif kind == "gelu":
                h = F.gelu(h)
            elif kind == "tanh":
                h = torch.tanh(h)
            elif kind in ("merge", "split"):
                h = h.reshape(arg["shape"])
            elif kind == "transpose":
                h = h.transpose(*arg["dims"])
            elif kind == "div":
                h = h / w
            elif kind == "scalar":
                h = h * 0.5 + 1.0
            elif kind == "sum":
                h = h.sum(arg["dim"], keepdim=arg["keepdim"])
            elif kind == "mean":
                h = h.mean(arg["dim"], keepdim=arg["keepdim"])
            elif kind == "softmax":
                h = torch.softmax(h, arg["dim"])
            elif kind == "gram":
                h = h @ h.transpose(-1, -2)
            else:
                raise ValueError(kind)
        loss = h * self.readout
        return (loss.mean() if self.final_mean else loss.sum()), h


def step_shape(cur: list[int], kind: str, arg: dict) -> list[int]:
    if kind in ("linear", "linear_bias"):
        return cur[:-1] + [arg["param"][0]]
    if kind == "matmul":
        return cur[:-1] + [arg["param"][1]]
    if kind in ("merge", "split"):
        return list(arg["shape"])
    if kind == "transpose":
        a, b = arg["dims"]
        out = list(cur)
        out[a], out[b] = out[b], out[a]
        return out
    if kind in ("sum", "mean"):
        if arg["keepdim"]:
            return cur[:arg["dim"]] + [1] + cur[arg["dim"] + 1:]
        return cur[:arg["dim"]] + cur[arg["dim"] + 1:]
    if kind == "gram":
        return cur[:-1] + [cur[-2]]
    return list(cur)


def out_shape(in_shape, ops) -> list[int]:
    cur = list(in_shape)
    for kind, arg in ops:
        cur = step_shape(cur, kind, arg)
    return cur


@st.composite
def programs(draw):
    mesh_axes = draw(st.sampled_from(MESHES))
    ndim = draw(st.integers(2, 3))
    in_shape = [draw(st.sampled_from(SIZES))] + [draw(st.sampled_from(ODD)) for _ in range(ndim - 1)]
    ops = []
    cur = list(in_shape)
    for _ in range(draw(st.integers(1, 7))):
        kinds = ["linear", "linear_bias", "matmul", "mul", "add", "div", "scalar", "gelu", "tanh", "softmax"]
        if len(cur) >= 2:
            kinds.append("transpose")
        if len(cur) >= 3:
            kinds += ["merge", "gram"]
        if len(cur) <= 3 and cur[-1] % 2 == 0:
            kinds.append("split")
        if len(cur) >= 2:
            kinds += ["sum", "mean"]
        kind = draw(st.sampled_from(kinds))
        arg: dict = {}
        if kind in ("linear", "linear_bias"):
            arg["param"] = (draw(st.sampled_from(SIZES)), cur[-1])
        elif kind == "matmul":
            arg["param"] = (cur[-1], draw(st.sampled_from(SIZES)))
        elif kind in ("mul", "add", "div"):
            k = draw(st.integers(1, len(cur)))
            arg["param"] = tuple(c if draw(st.booleans()) else 1 for c in cur[-k:])
        elif kind == "merge":
            i = draw(st.integers(0, len(cur) - 2))
            arg["shape"] = tuple(cur[:i] + [cur[i] * cur[i + 1]] + cur[i + 2:])
        elif kind == "split":
            arg["shape"] = tuple(cur[:-1] + [2, cur[-1] // 2])
        elif kind == "transpose":
            a, b = draw(st.lists(st.integers(0, len(cur) - 1), min_size=2, max_size=2, unique=True))
            arg["dims"] = (a, b)
        elif kind in ("sum", "mean", "softmax"):
            arg["dim"] = draw(st.integers(0, len(cur) - 1))
            if kind != "softmax":
                arg["keepdim"] = draw(st.booleans())
        ops.append((kind, arg))
        cur = step_shape(cur, kind, arg)
    final_mean = draw(st.booleans())
    model = Chain(in_shape, ops, final_mean)
    mesh = autoshard.Mesh(**mesh_axes)
    plan = {}
    targets = [(n, tuple(p.shape)) for n, p in model.named_parameters()] + [("x", tuple(in_shape))]
    for name, shape in targets:
        if draw(st.booleans()):
            plan[name] = draw(specs(shape, mesh))
    return mesh_axes, tuple(in_shape), tuple(ops), plan, final_mean


@st.composite
def specs(draw, shape, mesh):
    out, used = [], set()
    for _, size in mesh.axes:
        dims = [d for d in range(len(shape)) if shape[d] % size == 0 and d not in used]
        d = draw(st.sampled_from([None] + dims))
        if d is None:
            out.append(Replicate())
        else:
            used.add(d)
            out.append(Shard(d))
    return tuple(out)


def describe(mesh_axes, in_shape, ops, plan, final_mean) -> str:
    ann = {k: "(" + ", ".join("R" if isinstance(p, Replicate) else f"S({p.dim})" for p in v) + ")"
           for k, v in plan.items()}
    return f"mesh={mesh_axes} x={list(in_shape)} ops={list(ops)} plan={ann} loss={'mean' if final_mean else 'sum'}"


def check(mesh_axes, in_shape, ops, plan, final_mean=False, refusals: bool = False) -> bool:
    """The sharded program equals eager PyTorch: loss on every rank, the output, every parameter gradient.

    ``refusals``: random annotations may contradict each other (a weight pinned replicated, its bias pinned
    sharded on the output features): annotations are hard constraints, so compile refuses such a plan with a
    PlanError naming the parameter — the one outcome accepted besides exact numbers; returns False then."""
    model = Chain(in_shape, list(ops), final_mean)
    x = torch.randn(*in_shape, generator=torch.Generator().manual_seed(1))
    mesh = autoshard.Mesh(**mesh_axes)
    # the greedy planner (fast); AUTOSHARD_PROPERTY_PLANNER=search explores the exact search's plans instead
    planner = os.environ.get("AUTOSHARD_PROPERTY_PLANNER", "greedy")
    fast = {"planner": planner} if "planner" in inspect.signature(autoshard.compile).parameters else {}
    try:
        compiled = autoshard.compile(model, mesh, (x,), annotations=dict(plan), **fast).plan
    except autoshard.PlanError as e:
        if refusals and "as annotated" in str(e):
            return False
        raise
    loss, h = model(x)
    backward = loss.requires_grad  # False for a chain without parameters
    if backward:
        loss.backward()
    sim = compiled.simulate((x,), backward=backward)
    out_node = next(n for n in compiled.graph_module.graph.nodes if n.op == "output")
    h_spec = out_node.args[0][1].meta[M.SPEC]
    for rank, (rank_loss, _) in enumerate(sim.outputs):
        torch.testing.assert_close(rank_loss.detach(), loss.detach(), rtol=1e-4, atol=1e-4,
                                   msg=lambda m, rank=rank: f"loss on rank {rank}: {m}")
    got_h = assemble([o[1].detach() for o in sim.outputs], h_spec, mesh)
    torch.testing.assert_close(got_h, h.detach(), rtol=1e-4, atol=1e-5, msg=lambda m: f"output h: {m}")
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        assert name in sim.grads, f"no gradient for {name}"
        torch.testing.assert_close(sim.grads[name], p.grad, rtol=1e-4, atol=1e-4,
                                   msg=lambda m, name=name: f"grad {name}: {m}")
    return True


# CI: 200 fixed examples. Exploring: AUTOSHARD_PROPERTY_EXAMPLES=2000 AUTOSHARD_PROPERTY_RANDOM=1 pytest ...
@settings(max_examples=int(os.environ.get("AUTOSHARD_PROPERTY_EXAMPLES", "200")), deadline=None,
          derandomize=not os.environ.get("AUTOSHARD_PROPERTY_RANDOM"), database=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(programs())
def test_random_op_chains_reassemble_to_the_unsharded_result(program):
    try:
        ran = check(*program, refusals=True)
    except Exception as e:
        raise AssertionError(f"{describe(*program)}: {type(e).__name__}: {e}") from e
    if not ran:
        reject()  # contradictory annotations, refused by name (hypothesis fails the test if this happens too often)


# Shrunk failures found by the property above, kept as regression tests: (mesh, x shape, ops, annotations, mean).
REGRESSIONS: list = [
    # Wrong gradient of w6 (the broadcast add after three linears that follow a sum over the batch): found on
    # the working tree of 2026-12-02 15:12 UTC; passes since "parameters are never Partial" (b2a8f4a).
    pytest.param(({"x": 2}, (2, 2), (("linear", {"param": (2, 2)}), ("linear", {"param": (2, 2)}),
                                     ("sum", {"dim": 0, "keepdim": False}), ("linear", {"param": (2, 2)}),
                                     ("linear", {"param": (2, 2)}), ("linear", {"param": (2, 2)}),
                                     ("add", {"param": (1,)})),
                  {"w5": (Shard(1),)}, False), id="sum-then-linears-w5-S1"),
]


@pytest.mark.parametrize("program", REGRESSIONS)
def test_regressions(program):
    check(*program)
