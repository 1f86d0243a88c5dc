"""A model that never exists whole on a rank: ``init_weights`` and loading a Hugging Face directory fill only this
rank's shards, and equal the single-device model bit for bit."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import autoshard
from autoshard.runtime.parameters import local_of
from autoshard.errors import AutoshardError, CheckpointError
from autoshard.api.materialize import init_local, load_local
from autoshard.placements import assemble
from autoshard.runtime import SimWorld
from autoshard.frontend.trace import fetch_attr
from examples import models

MESH = {"data": 2, "model": 2}
SEED = 7


def meta_model(name: str, layers: int = 2):
    """The factory's model class and config, built on the meta device; plus the factory's example inputs."""
    model, args, kwargs = models.FACTORIES[name](layers=layers)
    build = (lambda: type(model)(model.config)) if hasattr(model, "config") else (lambda: models.GPT(layers=layers))
    with torch.device("meta"):
        meta = build()
    return meta, build, args, kwargs


def eager_init(build, seed: int = SEED, init=None):
    """What a user does on one device: ``to_empty``, seed, the model's own init — ``init_weights()`` for a Hugging
    Face model (``initialize_weights()`` then ``tie_weights()``: ``to_empty`` untied the tied weights), the
    ``reset_parameters()`` loop otherwise (then the tie the constructor made, restored), or ``model.apply(init)``."""
    with torch.device("meta"):
        model = build()
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    if init is not None:
        with torch.no_grad():
            model.apply(init)
    elif hasattr(model, "init_weights") and hasattr(model, "config"):
        model.init_weights()
    else:
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
    if isinstance(model, models.GPT):
        model.head.weight = model.wte.weight
    return model


def rank_programs(plan):
    """Every rank's program of ``plan`` with uninitialised memory for its shards (as a meta-built model has)."""
    out = []
    for rank in range(plan.mesh.size):
        local = plan.rank_program(rank)
        local.to_empty(device="cpu")
        out.append(local)
    return out


def assembled(plan, locals_):
    """{target: global tensor reassembled from every rank's shard}."""
    out = {}
    for n in plan.graph_module.graph.nodes:
        if n.op == "get_attr" and isinstance(n.meta.get("val"), torch.Tensor):
            out[n.target] = assemble([fetch_attr(lo, n.target).detach() for lo in locals_], n.meta["autoshard.spec"],
                                     plan.mesh)
    return out


def state(model) -> dict:
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}


def own_bytes(skeleton) -> int:
    """The most bytes one module's own (recurse=False) parameters and buffers take."""
    return max(sum(t.numel() * t.element_size() for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)])
               for m in skeleton.modules())


@pytest.fixture(scope="module")
def compiled():
    cache = {}

    def get(name):
        if name not in cache:
            meta, build, args, kwargs = meta_model(name)
            mesh = autoshard.Mesh(**MESH)
            sharded = autoshard.compile(meta, mesh, args, kwargs, annotations=models.megatron(mesh, name))
            cache[name] = (sharded, build, args, kwargs)
        return cache[name]

    return get


@pytest.mark.parametrize("name", ["gpt", "hf_gpt2", "hf_llama"])
def test_init_weights_equals_single_device_init_bit_for_bit(compiled, name):
    sharded, build, _, _ = compiled(name)
    plan, skeleton = sharded.plan, sharded._skeleton
    locals_ = rank_programs(plan)
    for rank, local in enumerate(locals_):
        torch.manual_seed(SEED)
        stats = init_local(skeleton, local, plan, rank)
        # one module's own tensors whole at a time, never more
        assert 0 < stats["peak_bytes"] <= own_bytes(skeleton), (stats["peak_bytes"], own_bytes(skeleton))
    ref = state(eager_init(build))
    got = assembled(plan, locals_)
    assert got, name
    for target, full in got.items():
        assert torch.equal(full, ref[target]), f"{name} {target}: max |diff| {(full - ref[target]).abs().max()}"
    if name == "hf_llama":
        assert "model.rotary_emb.inv_freq" in got  # the non-persistent rotary table, computed on every rank
    if name in ("gpt", "hf_gpt2"):  # one tensor of two names: the embedding's draw, as the tie keeps it
        tied = [n.meta["autoshard.aliases"] for n in plan.graph_module.graph.find_nodes(op="get_attr")]
        assert any(len(a) == 2 for a in tied), tied
    # the skeleton stays on meta and as it was (init can run again: same seed, same result)
    assert all(t.is_meta for t in [*skeleton.parameters(), *skeleton.buffers()])
    local = plan.rank_program(3)
    local.to_empty(device="cpu")
    torch.manual_seed(SEED)
    init_local(skeleton, local, plan, 3)
    for target, t in [*local.named_parameters(), *local.named_buffers()]:
        assert torch.equal(t, fetch_attr(locals_[3], target)), target


def test_sharded_module_init_weights_then_trains_like_one_device():
    """Through the ShardedModule (compile of a meta-built model, init_weights, a forward/backward step in the
    simulator): the loss equals the single-device model's."""
    meta, build, args, kwargs = meta_model("gpt", layers=1)
    mesh = autoshard.Mesh(**MESH)
    world = SimWorld(mesh, timeout=60)
    ranks = []
    for rank in range(mesh.size):
        sharded = autoshard.compile(meta, mesh, args, kwargs, annotations=models.megatron(mesh, "gpt"),
                                    comm=world.communicator(rank), device="cpu")
        with pytest.raises(AutoshardError, match="uninitialised"):
            sharded(*sharded.plan.shard_inputs(rank, args, kwargs)[0])
        torch.manual_seed(SEED)
        sharded.init_weights()
        ranks.append(sharded)
    ref = eager_init(build)
    want = ref(*args, **kwargs)
    want.backward()

    def step(rank):
        a, k = ranks[rank].plan.shard_inputs(rank, args, kwargs)
        loss = ranks[rank](*a, **k)
        loss.backward()
        return loss.detach()

    for loss in world.run(step):
        torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6)
    specs = ranks[0].plan.param_specs()
    grads = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)}
    for fqn, spec in specs.items():
        got = assemble([local_of(dict(r.named_parameters(remove_duplicate=False))[fqn].grad) for r in ranks], spec,
                       mesh)
        torch.testing.assert_close(got, grads[fqn], rtol=1e-4, atol=1e-6)


def test_init_callable_runs_in_apply_order():
    def init(m):
        for p in m.parameters(recurse=False):
            nn.init.uniform_(p, -0.1, 0.1)

    meta, build, args, kwargs = meta_model("gpt", layers=1)
    mesh = autoshard.Mesh(**MESH)
    sharded = autoshard.compile(meta, mesh, args, kwargs, annotations=models.megatron(mesh, "gpt"))
    plan = sharded.plan
    locals_ = rank_programs(plan)
    for rank, local in enumerate(locals_):
        torch.manual_seed(SEED)
        init_local(sharded._skeleton, local, plan, rank, init=init)
    ref = state(eager_init(build, init=init))
    for target, full in assembled(plan, locals_).items():
        assert torch.equal(full, ref[target]), target


class Scaled(nn.Module):
    """A linear and a non-persistent buffer that only ``__init__`` computes."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 2.0), persistent=False)

    def forward(self, x):
        return (self.lin(x) * self.scale).sum()


class Normed(nn.Module):
    """A parent whose init reads its child's whole weight (a norm over it)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def reset_parameters(self):
        self.lin.weight.div_(self.lin.weight.norm())

    def forward(self, x):
        return self.lin(x).sum()


def _plan(model_cls, spec=("S(0)",)):
    with torch.device("meta"):
        meta = model_cls()
    plan = autoshard.compile(meta, autoshard.Mesh(model=2), (torch.randn(4, 8),), annotations={"lin.weight": spec}).plan
    return meta, plan


def test_a_tensor_no_init_writes_is_named_with_the_fix():
    meta, plan = _plan(Scaled)
    local = rank_programs(plan)[0]
    with pytest.raises(AutoshardError, match=r"no init wrote \['scale'\].*outside torch.device\('meta'\).*init="):
        init_local(meta, local, plan, 0)

    def init(m):
        if isinstance(m, nn.Linear):
            m.reset_parameters()
        if isinstance(m, Scaled):
            m.scale.fill_(2.0)

    torch.manual_seed(0)
    init_local(meta, local, plan, 0, init=init)
    scale = local.get_buffer("scale")  # this rank's part (the plan may shard it like the linear's output)
    assert scale.numel() and torch.equal(scale, torch.full_like(scale, 2.0))
    ref = nn.Linear(8, 8, device="meta").to_empty(device="cpu")
    torch.manual_seed(0)
    ref.reset_parameters()
    assert torch.equal(local.get_parameter("lin.weight"), ref.weight[:4])


def test_an_init_that_reads_beyond_the_ranks_slice_is_refused():
    def init(m):  # children first: the parent's norm reads the child's whole weight, of which a rank kept half
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()

    meta, plan = _plan(Normed)
    with pytest.raises(AutoshardError,
                       match=r"module `\(the model\)` read tensor `lin.weight` outside this rank's slice"):
        init_local(meta, rank_programs(plan)[0], plan, 0, init=init)
    meta, plan = _plan(Normed, spec=("R",))  # replicated: the rank has it whole, and the result is eager's
    local = rank_programs(plan)[1]
    torch.manual_seed(0)
    init_local(meta, local, plan, 1, init=init)
    with torch.device("meta"):
        ref = Normed()
    ref.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        ref.apply(init)
    assert torch.equal(local.get_parameter("lin.weight"), ref.lin.weight)


# ---- loading a Hugging Face directory --------------------------------------------------------------------------
@pytest.mark.parametrize("name,shard_size", [("hf_gpt2", "20KB"), ("hf_llama", None)])
def test_load_reads_only_the_ranks_slices(compiled, tmp_path, name, shard_size):
    model, _, _ = models.FACTORIES[name](layers=2, seed=3)
    model.save_pretrained(tmp_path, **({"max_shard_size": shard_size} if shard_size else {}))
    files = sorted(os.listdir(tmp_path))
    assert ("model.safetensors.index.json" in files) == bool(shard_size)
    sharded, _, _, _ = compiled(name)
    plan = sharded.plan
    locals_ = rank_programs(plan)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for rank, local in enumerate(locals_):
        stats = load_local(sharded._skeleton, local, plan, rank, tmp_path)
        held = sum(t.numel() * t.element_size() for t in local.parameters())
        print(f"{name} rank {rank}: read {stats['bytes_read']} B, holds {held} B of {total} B of parameters")
        assert stats["bytes_read"] <= 0.6 * total and held <= 0.6 * total
    want = state(model)
    for target, full in assembled(plan, locals_).items():
        assert torch.equal(full, want[target]), target
    if name == "hf_gpt2":  # tied: saved once, under the embedding's name
        from safetensors import safe_open

        keys = set()
        for f in files:
            if f.endswith(".safetensors"):
                with safe_open(str(tmp_path / f), framework="pt") as h:
                    keys |= set(h.keys())
        assert "transformer.wte.weight" in keys and "lm_head.weight" not in keys
    else:
        assert stats["computed"] == ["model.rotary_emb.inv_freq"]


def test_load_refuses_missing_tensors_and_wrong_shapes(compiled, tmp_path):
    from safetensors.torch import save_file

    model, _, _ = models.hf_llama(layers=2, seed=3)
    sharded, _, _, _ = compiled("hf_llama")
    plan = sharded.plan
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    lacking = tmp_path / "lacking"
    lacking.mkdir()
    save_file({k: v for k, v in sd.items() if k != "model.norm.weight"}, str(lacking / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"lacking.*has no tensor `model.norm.weight`"):
        load_local(sharded._skeleton, rank_programs(plan)[0], plan, 0, lacking)
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    save_file({**sd, "model.norm.weight": torch.ones(65)}, str(wrong / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"wrong/model.safetensors.*`model.norm.weight` has shape \[65\]"):
        load_local(sharded._skeleton, rank_programs(plan)[0], plan, 0, wrong)


def test_autoshard_load_dispatches_a_hugging_face_directory(tmp_path):
    model, _, _ = models.hf_gpt2(layers=1, seed=3)
    model.save_pretrained(tmp_path)
    other, _, _ = models.hf_gpt2(layers=1, seed=4)
    stats = autoshard.load(other, tmp_path)  # a plain nn.Module: whole tensors, ties kept
    assert stats["tensors"] == len(model.state_dict()) - 1  # lm_head.weight is the embedding
    for k, v in model.state_dict().items():
        assert torch.equal(other.state_dict()[k], v), k
    assert other.lm_head.weight is other.transformer.wte.weight
    with pytest.raises(CheckpointError, match="Hugging Face directory.*optimizer"):
        autoshard.load(other, tmp_path, optimizer=torch.optim.SGD(other.parameters(), lr=0.1))
