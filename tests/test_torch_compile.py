"""torch.compile on a generated rank module gives the eager results (loss, gradients, collectives run).

The collectives are autograd functions over the thread's communicator, which dynamo cannot trace: it breaks the
graph at each one and compiles the pure-tensor code between them (inductor), so results match eager exactly
up to inductor's float reassociation. Bucketed gradient sync (hooks on the parameters) works under it too.
"""

from __future__ import annotations

import pytest
import torch

import autoshard
from autoshard.plan import loss_of
from autoshard.runtime import SimWorld, current
from autoshard.runtime.buckets import GradBucketer
from examples import models


def _run(plan, args, kwargs, compiled, bucket: bool = False):
    """``compiled``: False (eager) or the torch.compile backend."""

    def body(rank):
        module = plan.rank_module(rank, bucket_grads=bucket)
        if bucket:
            GradBucketer(module)
        fn = torch.compile(module, backend=compiled) if compiled else module
        a, k = plan.shard_inputs(rank, args, kwargs)
        losses = []
        for _ in range(2):  # the second call runs the cached compiled code
            loss = loss_of(fn(*a, **k))
            loss.backward()
            losses.append(loss.detach())
        log = [(r.kind, r.axis, r.numel, r.phase) for r in current().log]
        return losses, {n: p.grad.clone() for n, p in module.named_parameters()}, log

    return SimWorld(plan.mesh, timeout=300).run(body)


def _check(ref, got, bucket_log_may_differ=False):
    for r_ref, r_got in zip(ref, got):
        for a, b in zip(r_ref[0], r_got[0]):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        assert r_ref[1].keys() == r_got[1].keys()
        for name, g in r_ref[1].items():
            torch.testing.assert_close(r_got[1][name], g, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        if not bucket_log_may_differ:
            assert r_got[2] == r_ref[2]  # the same collectives, in the same order, as eager


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_inductor_compiled_megatron_mlp_equals_eager():
    model, args, kwargs = models.mlp()
    mesh = autoshard.Mesh(model=2)
    plan = autoshard.compile(model, mesh, args, kwargs, plan=models.megatron(mesh, "mlp")).plan
    _check(_run(plan, args, kwargs, False), _run(plan, args, kwargs, "inductor"))


# The larger cases use the aot_eager backend: the same dynamo capture and AOT autograd as inductor, without
# inductor's C++ builds (minutes on a shared 2-core machine). Each simulated rank compiles its own module (the
# guards see different parameters), so the cases keep to 2 ranks.
def test_compiled_megatron_block_equals_eager():
    model, (x,), _, ann = models.gpt_block()
    x = x.detach()
    plan = autoshard.compile(model, autoshard.Mesh(model=2), (x,), plan=ann).plan
    _check(_run(plan, (x,), {}, False), _run(plan, (x,), {}, "aot_eager"))


def test_compiled_rank_module_with_bucketed_gradients_equals_eager():
    model, args, kwargs = models.mlp()
    plan = autoshard.compile(model, autoshard.Mesh(data=2), args, kwargs).plan
    _check(
        _run(plan, args, kwargs, False), _run(plan, args, kwargs, "aot_eager", bucket=True), bucket_log_may_differ=True
    )
