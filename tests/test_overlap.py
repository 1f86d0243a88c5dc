"""Runtime overlap: column-parallel linears whose backward all-reduce overlaps the weight gradients
(linears_grad_all_reduce) and bucketed data-parallel gradients give the unsharded model's numbers."""

from __future__ import annotations

import pytest
import torch

import autoshard
from autoshard.compiler.plan import loss_of
from autoshard.runtime import SimWorld, spawn
from autoshard.runtime.buckets import GradBucketer
from autoshard.runtime.collective_ops import grad_all_reduce, linears_grad_all_reduce
from examples import models


def test_codegen_fuses_column_parallel_linears_after_their_grad_all_reduce():
    model, args, kwargs = models.gpt(layers=1)
    mesh = autoshard.Mesh(model=2)
    code = autoshard.compile(model, mesh, args, kwargs, annotations=models.megatron(mesh, "gpt")).plan.code(0)
    fused = [ln for ln in code.splitlines() if "linears_grad_all_reduce.default(" in ln]
    # q/k/v share one (3 linears), fc1 one, the replicated LM head one: no plain grad_all_reduce on `model` is left
    assert [ln.split(";")[0].count("_weight") for ln in fused] == [3, 1, 1]
    assert "autoshard.grad_all_reduce.default(layer_norm" not in code


def test_linears_grad_all_reduce_equals_grad_all_reduce_then_linear():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8)
    ws = [torch.randn(4, 8, requires_grad=True) for _ in range(3)]
    bs = [torch.randn(4, requires_grad=True), None, torch.randn(4, requires_grad=True)]
    weights = [torch.randn(2, 3, 4) for _ in range(3)]

    def body(rank, fused):
        xr = (x + rank).requires_grad_()
        params = [p.detach().clone().requires_grad_() if p is not None else None for p in (ws[0], bs[0], ws[1],
                                                                                             bs[1], ws[2], bs[2])]
        if fused:
            outs = linears_grad_all_reduce(xr, ("model",), *params)
        else:
            g = grad_all_reduce(xr, ("model",))
            outs = [torch.nn.functional.linear(g, params[2 * i], params[2 * i + 1]) for i in range(3)]
        # the second output is unused: its gradient is None in the fused backward
        (outs[0] * weights[0]).sum().add((outs[2] * weights[2]).sum()).backward()
        return xr.grad, [p.grad if p is not None else None for p in params], [o.detach() for o in outs]

    world = SimWorld(autoshard.Mesh(model=2))
    ref = world.run(lambda r: body(r, False))
    got = world.run(lambda r: body(r, True))
    for (gx, gp, out), (rx, rp, rout) in zip(got, ref):
        torch.testing.assert_close(gx, rx)
        torch.testing.assert_close(out, rout)
        for a, b in zip(gp, rp):
            assert (a is None) == (b is None) or (b is None and a is not None and not a.any())
            if a is not None and b is not None:
                torch.testing.assert_close(a, b)


def _dp_bucketed_worker(rank, world_size):
    from autoshard.runtime import DistCommunicator, use

    model, args, kwargs = models.gpt(layers=2)
    ref_loss = model(*args, **kwargs)
    ref_loss.backward()
    mesh = autoshard.Mesh(data=2, model=1)
    plan = autoshard.compile(model, mesh, args, kwargs).plan
    comm = DistCommunicator(mesh, timeout=60)
    module = plan.rank_program(rank, bucket_grads=True)
    GradBucketer(module, comm=comm)
    a, k = plan.shard_inputs(rank, args, kwargs)
    out = {}
    with use(comm):
        loss = loss_of(module(*a, **k))
        out["read_before_backward"] = loss.item()
        loss = loss_of(module(*a, **k))
        for p in module.parameters():
            p.grad = None
        loss.backward()  # the bucketer all-reduces the gradients, overlapped with backward
        out["read_after_backward"] = loss.item()
    full = {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}
    errs = []
    for name, p in module.named_parameters():
        errs.append(float((p.grad - full[name]).abs().max()))
    out["max_grad_err"] = max(errs)
    out["ref"] = float(ref_loss)
    return out


def test_data_parallel_bucketed_gradients_on_gloo_equal_single_device():
    got = spawn(_dp_bucketed_worker, 2, timeout=90, start_method="forkserver")
    for r in got:
        assert abs(r["read_before_backward"] - r["ref"]) < 1e-5
        assert abs(r["read_after_backward"] - r["ref"]) < 1e-5
        assert r["max_grad_err"] < 1e-5


class _WeightedCE(torch.nn.Module):
    def __init__(self, nll: bool):
        super().__init__()
        self.proj = torch.nn.Linear(8, 5)
        self.register_buffer("class_weight", torch.tensor([1.0, 2.0, 0.5, 1.5, 1.0]))
        self.nll = nll

    def forward(self, x, y):
        logits = self.proj(x)
        if self.nll:
            return torch.nn.functional.nll_loss(logits.log_softmax(-1), y, weight=self.class_weight)
        return torch.nn.functional.cross_entropy(logits, y, weight=self.class_weight, label_smoothing=0.1)


@pytest.mark.parametrize("nll", [False, True], ids=["cross_entropy", "nll_loss"])
def test_bucketed_mean_loss_with_weights_and_ignored_targets_equals_single_device(nll):
    torch.manual_seed(0)
    model = _WeightedCE(nll)
    x = torch.randn(8, 8)
    y = torch.tensor([0, 1, -100, 3, 4, -100, -100, 2])  # rank 1's half has more ignored targets
    ref = model(x, y)
    ref.backward()
    plan = autoshard.compile(model, autoshard.Mesh(data=2), (x, y)).plan
    code = plan.rank_program(0, bucket_grads=True).code
    assert "cross_entropy_partial_mean" in code  # divides by the global count of (weighted) targets

    def body(rank):
        module = plan.rank_program(rank, bucket_grads=True)
        GradBucketer(module)
        a, _ = plan.shard_inputs(rank, (x, y))
        loss = loss_of(module(*a))
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in module.named_parameters()}

    for loss, grads in SimWorld(plan.mesh).run(body):
        torch.testing.assert_close(loss, ref.detach())
        for name, g in grads.items():
            torch.testing.assert_close(g, dict(model.named_parameters())[name].grad)
