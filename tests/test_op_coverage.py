"""Op coverage on real architectures (issue "Any model: op coverage"): models built from tiny configs compile on
data=2 x model=2 with default options, and the simulated ranks reproduce one device's loss and every gradient;
in-place writes are functionalised; unsupported ops run replicated with one warning; plans that leave a mesh
axis unused say so; the greedy planner keeps data parallelism on small batches."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from autoshard.passes.propagate import functionalize, mutates_first_arg, written_inputs

import autoshard
from autoshard import Mesh
from autoshard import meta as M
from autoshard.errors import UnsupportedOpError
from autoshard.placements import Shard
from autoshard.compiler.plan import loss_of
from examples import models

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")

MESH = Mesh(data=2, model=2)
TOL = {"rtol": 1e-4, "atol": 1e-4}


def _check(factory, *, mesh=MESH, **kw):
    """Compile ``factory()``'s model on ``mesh`` with default options; loss and every gradient as on one device."""
    model, args, kwargs = factory(**kw)
    model.train()
    ref = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sharded = autoshard.compile(model, mesh, example_inputs=args, example_kwargs=kwargs)
        plan = sharded.plan
        sim = plan.simulate(args, kwargs)
    loss = loss_of(ref(*args, **kwargs))
    loss.backward()
    for r, out in enumerate(sim.outputs):
        torch.testing.assert_close(loss_of(out).detach(), loss.detach(), **TOL, msg=f"loss on rank {r}")
    grads = dict(ref.named_parameters(remove_duplicate=False))  # a tied weight under any of its names
    assert {id(grads[n]) for n in sim.grads} == {id(p) for p in grads.values() if p.grad is not None}
    for name, g in sim.grads.items():
        torch.testing.assert_close(g, grads[name].grad, **TOL, msg=f"grad of {name}")
    return plan, [str(w.message) for w in caught]


def _unsupported_warnings(messages):
    return [m for m in messages if "have no sharding rule" in m]


@pytest.mark.parametrize("factory", [models.hf_t5, models.hf_bart, models.hf_vit, models.hf_bloom, models.hf_gptj],
                         ids=lambda f: f.__name__)
def test_hf_architectures_match_one_device(factory):
    _, messages = _check(factory)
    assert not _unsupported_warnings(messages), messages  # every op of these models has a rule


def check_running_stats(plan) -> None:
    """After one step of ``plan`` on the CNN, every rank's buffers (BatchNorm's running statistics and
    num_batches_tracked; a buffer sharded on channels reassembled) equal one device's."""
    from autoshard.placements import assemble
    from autoshard.runtime.sim import SimWorld

    model, args, kwargs = models.conv_bn()
    ref = copy.deepcopy(model)
    ref(*args).backward()

    def body(rank):
        module = plan.rank_program(rank)
        a, k = plan.shard_inputs(rank, args, kwargs)
        loss_of(module(*a, **k)).backward()
        return {n: b.detach().clone() for n, b in module.named_buffers()}

    buffers = SimWorld(plan.mesh, timeout=60).run(body)
    specs = plan.param_specs()
    for name, want in ref.named_buffers():
        for rank, got in enumerate(buffers):
            key = name if name in got else name.replace(".", "_")
            assert key in got, (name, sorted(got))
            value = got[key]
            if value.shape != want.shape:  # a buffer sharded on channels: this rank's piece
                value = assemble([b[key] for b in buffers], specs.get(name), plan.mesh)
            torch.testing.assert_close(value.float(), want.float(), **TOL, msg=f"{name} on rank {rank}")


def test_cnn_with_batch_norm_matches_one_device_and_running_stats():
    """Conv + BatchNorm: batch-sharded BatchNorm uses the global batch's statistics (SyncBN), and every rank's
    running statistics (and num_batches_tracked) after a step equal one device's."""
    plan, messages = _check(models.conv_bn)
    assert not _unsupported_warnings(messages)
    bn = [n for n in plan.graph_module.graph.nodes if n.target == torch.ops.aten.batch_norm.default]
    assert len(bn) == 2 and all(n.meta[M.SPEC][0] == Shard(0) for n in bn)  # batch-sharded: SyncBN
    check_running_stats(plan)


def test_batch_norm_writes_its_running_statistics_in_training_mode_only():
    """aten.batch_norm's schema marks no argument written, yet in training mode it updates running_mean and
    running_var in place: both must be read in the layout they are stored in (a redistributed copy would take the
    write; found by the memory-limited search storing them replicated while BatchNorm ran channel-sharded)."""
    from autoshard.frontend.trace import trace

    for training, written in ((True, ["bn1_running_mean", "bn1_running_var"]), (False, [])):
        model, args, _ = models.conv_bn()
        model.train(training)
        gm = trace(model, args)
        bn = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.batch_norm.default)
        assert [x.name for x in written_inputs(bn)] == written
        add = [n for n in gm.graph.nodes if n.target == torch.ops.aten.add_.Tensor]
        assert all(written_inputs(n) == [n.args[0]] for n in add)  # num_batches_tracked.add_(1)


def test_in_place_writes_are_functionalised():
    """T5/BART's shift_tokens_right (copy_ into a slice, fill_ into a select, masked_fill_) and T5's add_ leave
    no in-place op on activations; BatchNorm's num_batches_tracked.add_ stays (a buffer, updated in place)."""
    from autoshard.passes.propagate import mutates_first_arg

    from autoshard.frontend.trace import trace

    model, args, kwargs = models.hf_t5()
    gm = trace(model, args, kwargs)
    assert any(mutates_first_arg(n.target) for n in gm.graph.nodes if n.op == "call_function")
    assert functionalize(gm) == []
    assert not any(mutates_first_arg(n.target) for n in gm.graph.nodes if n.op == "call_function")
    targets = {str(n.target) for n in gm.graph.nodes}
    assert {"aten.slice_scatter.default", "aten.select_scatter.default"} <= targets


class _WritesIntoSlices(torch.nn.Module):
    """Float in-place writes with gradients: ``z[:, 2:] = y``, ``z[:, 0] = 1``, ``z.mul_(...)``."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.fc2 = torch.nn.Linear(8, 6)

    def forward(self, x):
        z = self.fc(x) * 1.0
        z[:, 2:] = self.fc2(x)
        z[:, 0] = 1.0
        z.mul_(torch.sigmoid(x))
        z.masked_fill_(x > 1.5, 0.0)
        return z.square().mean()


def test_float_in_place_writes_match_one_device():
    torch.manual_seed(0)
    model, x = _WritesIntoSlices(), torch.randn(4, 8)
    plan = autoshard.compile(model, MESH, example_inputs=(x,)).plan
    assert not any(mutates_first_arg(n.target) for n in plan.graph_module.graph.nodes if n.op == "call_function")
    sim = plan.simulate((x,))
    ref = copy.deepcopy(model)
    loss = ref(x)
    loss.backward()
    torch.testing.assert_close(sim.outputs[0].detach(), loss.detach(), **TOL)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(sim.grads[name], p.grad, **TOL, msg=name)


class _Unsupported(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.ops.autoshard_test.twice(self.fc(x)).square().mean()


@pytest.fixture
def twice_op():
    lib = torch.library.Library("autoshard_test", "FRAGMENT")
    lib.define("twice(Tensor x) -> Tensor")
    lib.impl("twice", lambda x: 2 * x, "CompositeExplicitAutograd")
    lib.impl("twice", lambda x: 2 * x, "Meta")
    yield torch.ops.autoshard_test.twice.default
    lib._destroy()


def test_unsupported_op_runs_replicated_with_one_warning(twice_op):
    torch.manual_seed(0)
    model, x = _Unsupported(), torch.randn(4, 8)
    with pytest.warns(UserWarning, match=r"1 op\(s\) have no sharding rule and run replicated") as rec:
        plan = autoshard.compile(model, Mesh(data=2), example_inputs=(x,)).plan
    msgs = _unsupported_warnings([str(w.message) for w in rec])
    assert len(msgs) == 1 and "twice" in msgs[0] and "File" in msgs[0]
    node = next(n for n in plan.graph_module.graph.nodes if n.target == twice_op)
    assert "no rule" in node.meta["autoshard.strategy"].note
    sim = plan.simulate((x,))
    ref = copy.deepcopy(model)
    ref(x).backward()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(sim.grads[name], p.grad, **TOL)
    with pytest.raises(UnsupportedOpError, match="has no sharding rule"):
        autoshard.compile(model, Mesh(data=2), example_inputs=(x,), on_unsupported="error")


def test_small_batch_greedy_keeps_data_parallelism():
    """batch=2 on data=2: the greedy planner used to all-gather the activations and run the whole batch on both
    data ranks (fewer bytes); it keeps the batch sharded now."""
    model, args, _ = models.gpt(batch=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = autoshard.compile(model, Mesh(data=2), example_inputs=args, planner="greedy").plan
    assert not [w for w in caught if "plan:" in str(w.message)]
    assert not [c for _, c in plan.collectives() if c.kind == "all_gather"]
    use = plan.context.report["axis_use"]["data"]
    assert use[1] < use[0]


def test_unused_axis_is_reported():
    """An MLP on data=2 x model=2 without annotations: the greedy plan never shards on `model`, and says so."""
    model, args, _ = models.mlp()
    with pytest.warns(UserWarning, match=r"axis `model` \(size 2\) is unused"):
        autoshard.compile(model, MESH, example_inputs=args)
