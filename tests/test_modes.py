"""ShardedModule keeps PyTorch's habits: train()/eval() as the model's own, parameters() right after compile,
example_kwargs alone, only this rank's shards kept (the plan releases the model's weights).

Eval losses equal eager bit for bit (dropout off); in training mode anything traced with ``self.training`` follows
the mode (a Python branch on it, dropout) — dropout's masks are autoshard's one global mask per call, not eager's
stream, so training losses are compared with eager only where the mode changes values deterministically.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import autoshard
from autoshard.runtime.parameters import local_of
from autoshard.runtime import SimWorld, spawn
from examples import models


class ModeModel(nn.Module):
    """Dropout, and a Python branch on ``self.training`` (traced into the graph as a constant)."""

    def __init__(self, hidden: int = 16):
        super().__init__()
        self.fc1 = nn.Linear(hidden, 32)
        self.drop = nn.Dropout(0.25)
        self.fc2 = nn.Linear(32, hidden)

    def forward(self, x, target):
        h = self.drop(torch.relu(self.fc1(x)))
        if self.training:
            h = h * 2.0  # a branch the trace specialises on
        return nn.functional.mse_loss(self.fc2(h), target)


def _data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)


def _megatron_mlp(mesh):
    return {"fc1.weight": (autoshard.Replicate(), autoshard.Shard(0)),
            "fc1.bias": (autoshard.Replicate(), autoshard.Shard(0)),
            "fc2.weight": (autoshard.Replicate(), autoshard.Shard(1))}


@pytest.mark.parametrize("traced_in", ["train", "eval"])
def test_eval_and_train_follow_the_mode_as_eager_does(traced_in):
    torch.manual_seed(0)
    model = ModeModel()
    x, y = _data()
    mesh = autoshard.Mesh(data=2, model=2)
    model.train(traced_in == "train")
    ref = copy.deepcopy(model)
    ref_eval = ref.eval()(x, y).item()

    def body(rank):
        sharded = autoshard.compile(copy.deepcopy(model), mesh, (x, y), annotations=_megatron_mlp(mesh))
        xs, ys = autoshard.data_shard(x, mesh, rank), autoshard.data_shard(y, mesh, rank)
        sharded.eval()
        assert not sharded.training
        with torch.no_grad():
            eval_loss = sharded(xs, ys).item()
        sharded.train()
        train_losses = [sharded(xs, ys) for _ in range(2)]
        train_losses[0].backward()
        grads = {n: p.grad is not None for n, p in sharded.named_parameters()}
        sharded.eval()
        again = sharded(xs, ys).item()
        return eval_loss, [t.item() for t in train_losses], grads, again

    out = SimWorld(mesh).run(body)
    for eval_loss, train_losses, grads, again in out:
        assert eval_loss == pytest.approx(ref_eval, rel=1e-6, abs=1e-7)
        assert again == pytest.approx(ref_eval, rel=1e-6, abs=1e-7)
        assert all(grads.values()) and grads
        # training mode: the branch doubles h and dropout draws masks: not the eval value, and two calls differ
        assert abs(train_losses[0] - ref_eval) > 1e-3
        assert train_losses[0] != train_losses[1]
    assert len({round(o[1][0], 6) for o in out}) == 1  # the global loss is the same on every rank


def test_eval_mode_without_dropout_equals_eager_training_branch_too():
    """With p=0 the training-mode program is deterministic: its loss equals eager model.train()'s."""
    torch.manual_seed(1)
    model = ModeModel()
    model.drop.p = 0.0
    x, y = _data(1)
    mesh = autoshard.Mesh(model=2)
    model.eval()
    ref_train = copy.deepcopy(model).train()(x, y).item()
    ref_eval = copy.deepcopy(model).eval()(x, y).item()

    def body(rank):
        sharded = autoshard.compile(copy.deepcopy(model), mesh, (x, y),
                                    annotations={"fc1.weight": (autoshard.Shard(0),)})
        a = sharded(x, y).item()
        b = sharded.train()(x, y).item()
        return a, b

    for a, b in SimWorld(mesh).run(body):
        assert a == pytest.approx(ref_eval, rel=1e-6)
        assert b == pytest.approx(ref_train, rel=1e-6)


class DeviceBranchModel(nn.Module):
    """Arithmetic chosen by the device the model runs on (as Hugging Face's Mixtral picks ``torch.histc``'s dtype
    by ``x.device.type``): a program traced on any other device computes something else."""

    def __init__(self, hidden: int = 16):
        super().__init__()
        self.fc1 = nn.Linear(hidden, 32)
        self.fc2 = nn.Linear(32, hidden)

    def forward(self, x, target):
        h = torch.relu(self.fc1(x))
        h = h * 2.0 if h.device.type == "cpu" else h - 1.0  # this test runs on CPU: the first branch is eager's
        return nn.functional.mse_loss(self.fc2(h), target)


def test_a_model_branching_on_the_device_type_runs_its_branch_at_a_new_batch_shape_and_in_eval_mode():
    """The programs made after compile (for a new batch shape, for the other mode) are traced from the model's meta
    skeleton: traced for the device this rank runs on (FakeTensors there), the model's ``x.device.type`` branch is
    eager's, and so are the loss and every gradient (traced on meta, they took the other branch)."""
    torch.manual_seed(0)
    model = DeviceBranchModel()
    x, y = _data()
    mesh = autoshard.Mesh(data=2)
    calls = [(x[:4], y[:4], True), (x, y, False), (x[:4], y[:4], False)]  # a new shape; eval; both

    def eager(a, b, training):
        ref = copy.deepcopy(model).train(training)
        loss = ref(a, b)
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in ref.named_parameters()}

    def body(rank):
        sharded = autoshard.compile(copy.deepcopy(model), mesh, (x, y))
        out = []
        for a, b, training in calls:
            sharded.train(training)
            loss = sharded(autoshard.data_shard(a, mesh, rank), autoshard.data_shard(b, mesh, rank))
            loss.backward()
            out.append((loss.detach(), {n: local_of(p.grad).clone() for n, p in sharded.named_parameters()}))
            sharded.zero_grad()
        return out

    for out in SimWorld(mesh).run(body):
        for (a, b, training), (loss, grads) in zip(calls, out):
            want, want_grads = eager(a, b, training)
            torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-7)
            assert grads.keys() == want_grads.keys()
            for n, g in want_grads.items():
                torch.testing.assert_close(grads[n], g, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


def test_a_meta_built_model_branching_on_the_device_type_is_traced_for_the_device_it_runs_on():
    """A model built on the meta device has no real device to trace on: its plan and its eval program are traced for
    ``compile(device=...)``'s (FakeTensors there), so its ``x.device.type`` branch is eager's on that device."""
    torch.manual_seed(0)
    model = DeviceBranchModel()
    with torch.device("meta"):
        meta = DeviceBranchModel()
    x, y = _data()
    mesh = autoshard.Mesh(data=2)
    world = SimWorld(mesh)
    want = model(x, y).detach(), copy.deepcopy(model).eval()(x[:4], y[:4]).detach()

    def body(rank):
        sharded = autoshard.compile(meta, mesh, (x, y), comm=world.communicator(rank), device="cpu")
        sharded.load_state_dict(model.state_dict())
        sharded.mark_initialised()
        loss = sharded(autoshard.data_shard(x, mesh, rank), autoshard.data_shard(y, mesh, rank)).detach()
        sharded.eval()
        return loss, sharded(autoshard.data_shard(x[:4], mesh, rank), autoshard.data_shard(y[:4], mesh, rank))

    for loss, eval_loss in world.run(body):
        torch.testing.assert_close(loss, want[0], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(eval_loss.detach(), want[1], rtol=1e-6, atol=1e-7)


def test_parameters_right_after_compile_and_example_kwargs_alone():
    model, args, kwargs = models.gpt(layers=1)
    mesh = autoshard.Mesh(data=2)
    world = SimWorld(mesh)

    def body(rank):
        sharded = autoshard.compile(copy.deepcopy(model), mesh, example_kwargs={"ids": args[0], "labels": args[1]},
                                    comm=world.communicator(rank))
        names = [n for n, _ in sharded.named_parameters()]
        opt = torch.optim.SGD(sharded.parameters(), lr=0.1)  # before any call
        ids = autoshard.data_shard(args[0], mesh, rank)
        labels = autoshard.data_shard(args[1], mesh, rank)
        loss = sharded(ids=ids, labels=labels)
        loss.backward()
        opt.step()
        return names, loss.item()

    ref = model(*args).item()
    for names, loss in world.run(body):
        assert names and all(not n.startswith("_skeleton") for n in names)
        assert loss == pytest.approx(ref, rel=1e-5)


def test_the_plan_keeps_no_weight_once_the_rank_program_exists():
    model, args, kwargs = models.gpt(layers=1)
    mesh = autoshard.Mesh(model=2)
    world = SimWorld(mesh)

    def body(rank):
        sharded = autoshard.compile(copy.deepcopy(model), mesh, args, annotations=models.megatron(mesh, "gpt"),
                                    comm=world.communicator(rank))
        local = sum(local_of(p).numel() for p in sharded.parameters())  # first use: this rank's program is made
        plan_tensors = [*sharded.plan.graph_module.parameters(), *sharded.plan.graph_module.buffers()]
        skeleton = [*sharded._skeleton.parameters(), *sharded._skeleton.buffers()]
        return all(t.is_meta for t in plan_tensors), all(t.is_meta for t in skeleton), local

    full = sum(p.numel() for p in model.parameters())
    for plan_meta, skeleton_meta, local in world.run(body):
        assert plan_meta and skeleton_meta
        assert local < 0.75 * full  # this rank's shards, not the model


def test_meta_built_model_needs_init_or_load_before_running():
    from examples.models import GPT

    _, args, _ = models.gpt(layers=1)
    with torch.device("meta"):
        model = GPT(layers=1)
    mesh = autoshard.Mesh(model=2)
    world = SimWorld(mesh)

    def body(rank):
        sharded = autoshard.compile(model, mesh, args, annotations=models.megatron(mesh, "gpt"),
                                    comm=world.communicator(rank), device="cpu")
        devices = {p.device.type for p in sharded.parameters()}
        try:
            sharded(*args)
        except autoshard.AutoshardError as e:
            return devices, str(e)
        return devices, ""

    for devices, message in world.run(body):
        assert devices == {"cpu"}
        assert "init_weights()" in message and "autoshard.load" in message


def _gloo_modes_worker(rank, world_size):
    torch.manual_seed(0)
    model = ModeModel()
    x, y = _data()
    mesh = autoshard.Mesh(data=2, model=2)
    ref_eval = copy.deepcopy(model).eval()(x, y).item()
    sharded = autoshard.compile(model, mesh, (x, y), annotations=_megatron_mlp(mesh), timeout=60)
    xs, ys = autoshard.data_shard(x, mesh, rank), autoshard.data_shard(y, mesh, rank)
    sharded.eval()
    with torch.no_grad():
        got = sharded(xs, ys).item()
    sharded.train()
    train = sharded(xs, ys).item()
    return ref_eval, got, train


@pytest.mark.gloo
def test_eval_mode_on_gloo_equals_eager():
    for ref_eval, got, train in spawn(_gloo_modes_worker, 4, timeout=120, start_method="forkserver"):
        assert got == pytest.approx(ref_eval, rel=1e-6, abs=1e-7)
        assert abs(train - ref_eval) > 1e-3


# Adam divides by sqrt(v): an element whose gradient is rounding noise (attention key biases get none in exact
# arithmetic) steps by +-lr whatever the noise; eps of 1e-3 keeps such steps as small as their gradients.
EPS = 1e-3


def test_parameter_names_are_the_models_and_name_based_adamw_groups_equal_one_device():
    """Tied weights under their first name (as model.named_parameters()), no ``local.`` prefix: AdamW with a
    no-weight-decay group for biases and norms trains exactly as on one device."""
    model, args, _ = models.gpt(layers=1)
    mesh = autoshard.Mesh(data=2, model=2)
    world = SimWorld(mesh)
    ref = copy.deepcopy(model)

    def groups(named):
        named = list(named)
        decay = [p for n, p in named if not (n.endswith(".bias") or ".ln" in n)]
        no_decay = [p for n, p in named if n.endswith(".bias") or ".ln" in n]
        return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]

    def body(rank):
        sharded = autoshard.compile(copy.deepcopy(model), mesh, args, annotations=models.megatron(mesh, "gpt"),
                                    comm=world.communicator(rank))
        names = [n for n, _ in sharded.named_parameters()]
        opt = torch.optim.AdamW(groups(sharded.named_parameters()), lr=0.05, eps=EPS)
        a = tuple(autoshard.data_shard(x, mesh, rank) for x in args)
        for _ in range(3):
            sharded(*a).backward()
            opt.step()
            opt.zero_grad()
        return names, list(sharded.state_dict()), autoshard.full_state_dict(sharded)

    out = world.run(body)
    opt = torch.optim.AdamW(groups(ref.named_parameters()), lr=0.05, eps=EPS)
    for _ in range(3):
        ref(*args).backward()
        opt.step()
        opt.zero_grad()
    names, keys, full = out[0]
    assert names == [n for n, _ in model.named_parameters()]
    assert keys == list(model.state_dict())
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full[k], v, rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


def test_autoshard_checkpoint_loads_into_a_meta_built_model_and_computes_its_unsaved_buffers(tmp_path):
    """An autoshard checkpoint saved from a normally built HF Llama loads into the same model built on meta; the
    rotary ``inv_freq`` (a non-persistent buffer, never saved) is computed by its module's init, and the loss equals
    the original's."""
    pytest.importorskip("transformers")
    from transformers import LlamaForCausalLM

    model, args, kwargs = models.hf_llama(layers=1)
    mesh = autoshard.Mesh(model=2)
    path = str(tmp_path / "ck")
    world = SimWorld(mesh)
    ref = model(*args, **(kwargs or {})).loss.item()

    def save(rank):
        sharded = autoshard.compile(copy.deepcopy(model), mesh, args, kwargs,
                                    annotations=models.megatron(mesh, "hf_llama"), comm=world.communicator(rank))
        autoshard.save(sharded, path)

    world.run(save)

    def load(rank):
        with torch.device("meta"):  # each rank builds its own, as each process would
            meta_model = LlamaForCausalLM(model.config)
        sharded = autoshard.compile(meta_model, mesh, args, kwargs, annotations=models.megatron(mesh, "hf_llama"),
                                    comm=world.communicator(rank), device="cpu")
        autoshard.load(sharded, path)
        out = sharded(*args, **(kwargs or {}))
        return (out.loss if hasattr(out, "loss") else out).item()

    for loss in world.run(load):
        assert loss == pytest.approx(ref, rel=1e-6)


def test_eval_of_a_searched_plan_that_gathers_parameters_for_compute_equals_eager():
    """planner="search" under half the unconstrained memory, recompute=False: the training plan stores attention's
    output weights sharded on both axes and gathers them for compute. The eval program shares those tensors: its
    parameters keep the plan's layouts but may be gathered too (pinned as annotations, they could not be: the first
    eval() was a PlanError)."""
    from autoshard.compiler.plan import loss_of

    mesh = autoshard.Mesh(data=2, model=2)
    model, args, _ = models.gpt(layers=2)
    peak = autoshard.compile(copy.deepcopy(model), mesh, args, planner="search").plan.cost().memory.peak
    sharded = autoshard.compile(copy.deepcopy(model), mesh, args, planner="search", memory_limit=0.5 * peak,
                                recompute=False)
    specs, storage = sharded.plan.param_specs(), sharded.plan.param_storage()
    assert any(all(p.is_shard() for p in specs[n]) and n not in storage for n in specs)  # sharded twice, not ZeRO
    sharded.eval()
    sim = sharded.simulate(args, backward=False)
    with torch.no_grad():
        ref = loss_of(model.eval()(*args))
    for out in sim.outputs:
        torch.testing.assert_close(loss_of(out), ref, rtol=1e-5, atol=1e-6)
