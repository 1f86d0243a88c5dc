"""Activation recomputation (passes/recompute.py): the model's own torch.utils.checkpoint regions and
``recompute="<glob>"`` regions are recomputed in backward, not saved — loss and every gradient as without them, and
fewer bytes kept by autograd between forward and backward (measured with saved_tensors_hooks)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from autoshard.cost_models.memory import activation_bytes
from autoshard.passes.recompute import module_regions, recompute_regions, region_cost
from torch import nn
from torch.utils.checkpoint import checkpoint

import autoshard
from autoshard import meta as M
from autoshard.errors import PlanError
from autoshard.compiler.plan import loss_of
from autoshard.runtime import SimWorld, current, use
from examples import models

MESH = autoshard.Mesh(data=2, model=2)


class DropBlock(models.Block):
    """The example GPT block with dropout on the MLP branch."""

    def __init__(self, hidden: int, heads: int, p: float):
        super().__init__(hidden, heads)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.drop(self.mlp(self.ln2(x)))


class CkptGPT(models.GPT):
    """The example GPT whose blocks the model itself checkpoints (``ckpt=False``: the same model without)."""

    def __init__(self, ckpt: bool = True, p: float = 0.1, layers: int = 2):
        super().__init__(vocab=128, hidden=64, heads=4, layers=layers, seq=16)
        torch.manual_seed(1)
        self.blocks = nn.ModuleList(DropBlock(64, 4, p) for _ in range(layers))
        self.ckpt = ckpt

    def forward(self, ids, labels):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for blk in self.blocks:
            x = checkpoint(blk, x, use_reentrant=False) if self.ckpt else blk(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


def _data():
    return models._ids(4, 16, 128, 1)


def _ckpt_gpt(ckpt=True, train=False):
    torch.manual_seed(0)
    return CkptGPT(ckpt).train(train)


def _sgd_step_per_rank(model, mesh, args, kwargs=None, plan=None, **options):
    """Compile per rank (simulator), one forward/backward and an SGD step of lr 1: (losses, full state dicts) —
    the state after the step compares every gradient."""
    world = SimWorld(mesh, timeout=120)
    kwargs = kwargs or {}

    def body(rank):
        sharded = compiled[rank]
        a = tuple(autoshard.data_shard(x, mesh, rank) for x in args)
        k = {n: autoshard.data_shard(x, mesh, rank) for n, x in kwargs.items()}
        loss = loss_of(sharded(*a, **k))
        loss.backward()
        with torch.no_grad():
            for p in sharded.parameters():
                if p.grad is not None:
                    p -= p.grad
        regions = [n for n, m in sharded.local.named_modules() if n.rsplit(".", 1)[-1].startswith("recompute_")]
        return loss.item(), autoshard.full_state_dict(sharded), regions

    compiled = [autoshard.compile(copy.deepcopy(model), mesh, args, kwargs or None, annotations=plan,
                                  comm=world.communicator(rank), **options) for rank in range(mesh.size)]
    return world.run(body)


def _eager_step(model, args, kwargs=None):
    ref = copy.deepcopy(model)
    loss = loss_of(ref(*args, **(kwargs or {})))
    loss.backward()
    with torch.no_grad():
        for p in ref.parameters():
            if p.grad is not None:
                p -= p.grad
    return loss.item(), ref.state_dict()


def _assert_equal_to_eager(results, ref_loss, ref_state, regions: int):
    for loss, state, found in results:
        assert loss == pytest.approx(ref_loss, abs=1e-5)
        assert state.keys() == ref_state.keys()
        for name, value in ref_state.items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-5, msg=name)
        assert len(found) == regions  # the rank program really calls its regions through checkpoint


def _saved_bytes(plan, args, rank=0) -> int:
    """Bytes autograd keeps from rank ``rank``'s forward for its backward: unique storages packed by
    saved_tensors_hooks (a recomputed region's inputs are saved by its checkpoint, its inner tensors are not)."""
    world = SimWorld(plan.mesh, timeout=120)

    def body(r):
        module = plan.rank_program(r)
        a, k = plan.shard_inputs(r, args)
        storages: dict[int, int] = {}

        def pack(t):
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = loss_of(module(*a, **k))
        loss.backward()
        params = {p.untyped_storage().data_ptr() for p in module.parameters()}
        return sum(n for ptr, n in storages.items() if ptr not in params)

    return world.run(body)[rank]


# ---- the model's own torch.utils.checkpoint regions ---------------------------------------------------------
def test_trace_marks_each_checkpoint_call_as_its_own_region():
    plan = autoshard.compile(_ckpt_gpt(), autoshard.Mesh(data=2), _data()).plan
    regions = recompute_regions(plan.graph_module)
    assert list(regions) == ["blocks.0", "blocks.1"]
    for region, nodes in regions.items():
        assert all(M.module_path(n).startswith(region) for n in nodes)
    plain = autoshard.compile(_ckpt_gpt(ckpt=False), autoshard.Mesh(data=2), _data()).plan
    assert recompute_regions(plain.graph_module) == {}
    assert "checkpoint" not in plain.code(0)  # nothing changes without regions


class Reentrant(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return checkpoint(self.fc, x, use_reentrant=True).pow(2).mean()


def test_a_reentrant_checkpoint_is_an_error_naming_its_line():
    """export runs a use_reentrant=True region under no_grad: its gradients would be lost."""
    from autoshard.errors import TraceError

    with pytest.raises(TraceError) as err:
        autoshard.compile(Reentrant(), autoshard.Mesh(data=2), (torch.randn(4, 8),))
    text = str(err.value)
    assert "use_reentrant=True at " in text and "test_recompute.py:" in text and "use_reentrant=False" in text
    assert "checkpoint(self.fc, x, use_reentrant=True)" in text


def test_checkpointed_blocks_megatron_equal_to_one_device():
    model = _ckpt_gpt()
    args = _data()
    results = _sgd_step_per_rank(model, MESH, args, plan=models.megatron(MESH, "gpt"))
    _assert_equal_to_eager(results, *_eager_step(model, args), regions=2)


def test_dropout_in_a_region_draws_the_same_masks_when_recomputed():
    """Train mode, dropout inside the checkpointed blocks: the same loss and gradients as the same model without
    checkpoint on one device (autoshard's dropout draws one global mask per call; eager's stream differs)."""
    args = _data()
    sharded = autoshard.compile(_ckpt_gpt(train=True), MESH, args, annotations=models.megatron(MESH, "gpt")).plan
    single = autoshard.compile(_ckpt_gpt(ckpt=False, train=True), autoshard.Mesh(data=1), args).plan
    assert "torch.ops.autoshard.dropout" in single.code(0)
    got, want = sharded.simulate(args), single.simulate(args)
    ref = loss_of(want.outputs[0]).item()
    eval_loss = _ckpt_gpt().eval()(*args).item()
    assert abs(ref - eval_loss) > 1e-3  # the masks matter
    for out in got.outputs:
        assert loss_of(out).item() == pytest.approx(ref, abs=1e-5)
    assert got.grads.keys() == want.grads.keys()
    for name, g in want.grads.items():
        torch.testing.assert_close(got.grads[name], g, rtol=1e-5, atol=1e-5, msg=name)


def test_recomputation_saves_fewer_bytes_than_the_plan_without():
    args = _data()
    plan = models.megatron(MESH, "gpt")
    with_rc = _saved_bytes(autoshard.compile(_ckpt_gpt(), MESH, args, annotations=plan).plan, args)
    without = _saved_bytes(autoshard.compile(_ckpt_gpt(ckpt=False), MESH, args, annotations=plan).plan, args)
    print(f"saved for backward on rank 0 (GPT 2 layers, data=2 x model=2): {without} B without recomputation, "
          f"{with_rc} B with")
    assert 0 < with_rc < 0.7 * without


def test_a_region_runs_its_collectives_again_in_backward_on_every_rank():
    args = _data()
    plan = models.megatron(MESH, "gpt")
    rc = autoshard.compile(_ckpt_gpt(), MESH, args, annotations=plan).plan
    plain = autoshard.compile(_ckpt_gpt(ckpt=False), MESH, args, annotations=plan).plan
    inside = [n for n in rc.rank_program(0).recompute_blocks_0.graph.nodes
              if n.target is torch.ops.autoshard.all_reduce.default]
    assert len(inside) == 2  # the block's two Megatron all-reduces (attention out, MLP out)
    logs, base = rc.simulate(args).logs, plain.simulate(args).logs
    for log, ref in zip(logs, base):
        entries = [(r.kind, r.axis, r.phase) for r in log]
        extra = list(entries)
        for e in [(r.kind, r.axis, r.phase) for r in ref]:
            extra.remove(e)
        assert sorted(extra) == [("all_reduce", "model", "forward")] * 4  # 2 blocks x 2, run again in backward
    assert len({tuple((r.kind, r.axis, r.numel) for r in log) for log in logs}) == 1  # same order on every rank


def test_torch_compiled_rank_program_with_dropout_in_a_region_equals_eager():
    """torch.compile (fullgraph) captures a region as a checkpointed subgraph; its compiled backward recomputes it
    but keeps dropout's outputs, so gradients equal the eager rank program's (train mode, one block, model=2)."""
    args = _data()
    torch.manual_seed(0)
    mesh = autoshard.Mesh(model=2)
    plan = autoshard.compile(CkptGPT(layers=1).train(), mesh, args, annotations=models.megatron(mesh, "gpt")).plan

    def body(rank, compiled):
        module = plan.rank_program(rank)
        fn = torch.compile(module, fullgraph=True, backend="aot_eager") if compiled else module
        a, k = plan.shard_inputs(rank, args)
        loss = loss_of(fn(*a, **k))
        with use(current()):  # a bare rank program's backward needs its communicator, as on a real rank
            loss.backward()
        return loss.item(), {n: p.grad for n, p in module.named_parameters()}

    eager = SimWorld(mesh, timeout=120).run(lambda r: body(r, False))
    compiled = SimWorld(mesh, timeout=300, serial=True).run(lambda r: body(r, True))  # one compile at a time
    for (loss, grads), (ref_loss, ref_grads) in zip(compiled, eager):
        assert loss == pytest.approx(ref_loss, abs=1e-6)
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=name)


# ---- recompute="<glob>" -------------------------------------------------------------------------------------
def test_glob_recomputes_blocks_of_a_model_without_checkpoint_calls():
    model, args, _ = models.gpt(layers=2)
    plan = models.megatron(MESH, "gpt")
    results = _sgd_step_per_rank(model, MESH, args, plan=plan, recompute="blocks.*")
    _assert_equal_to_eager(results, *_eager_step(model, args), regions=2)
    glob = autoshard.compile(copy.deepcopy(model), MESH, args, annotations=plan, recompute="blocks.*").plan
    plain = autoshard.compile(copy.deepcopy(model), MESH, args, annotations=plan).plan
    assert list(recompute_regions(glob.graph_module)) == ["blocks.0", "blocks.1"]
    with_rc, without = _saved_bytes(glob, args), _saved_bytes(plain, args)
    print(f"saved for backward on rank 0 (recompute='blocks.*'): {without} B without, {with_rc} B with")
    assert 0 < with_rc < 0.7 * without


def test_regions_written_by_another_pass_are_honoured():
    """What the plan search does under recompute="auto": RECOMPUTE on a layer's nodes of the planned graph."""
    model, args, _ = models.gpt(layers=2)
    plan = autoshard.compile(copy.deepcopy(model), MESH, args, annotations=models.megatron(MESH, "gpt")).plan
    for path, nodes in module_regions(plan.graph_module, "blocks.1").items():
        for n in nodes:
            n.meta[M.RECOMPUTE] = path
    assert [n for n, _ in plan.rank_program(0).named_children() if n.startswith("recompute_")] == ["recompute_blocks_1"]
    sim = plan.simulate(args)
    ref = copy.deepcopy(model)
    loss = ref(*args)
    loss.backward()
    for out in sim.outputs:
        assert loss_of(out).item() == pytest.approx(loss.item(), abs=1e-5)
    grads = {name: p.grad for name, p in ref.named_parameters(remove_duplicate=False)}
    assert sim.grads and all(name in grads for name in sim.grads)
    for name, g in sim.grads.items():
        torch.testing.assert_close(g, grads[name], rtol=1e-5, atol=1e-5, msg=name)


def test_hf_llama_layers_glob_equal_to_one_device():
    model, args, kwargs = models.hf_llama(layers=2)
    mesh = autoshard.Mesh(model=2)
    results = _sgd_step_per_rank(model, mesh, args, kwargs, plan=models.megatron(mesh, "hf_llama"),
                                 recompute="model.layers.*")
    _assert_equal_to_eager(results, *_eager_step(model, args, kwargs), regions=2)


def test_glob_matching_no_module_is_an_error_naming_the_paths():
    model, args, _ = models.gpt(layers=1)
    with pytest.raises(PlanError) as err:
        autoshard.compile(model, autoshard.Mesh(data=2), args, recompute="layers.*")
    text = str(err.value)
    assert "recompute='layers.*'" in text and "'blocks.0'" in text and "'blocks.*'" in text


def test_a_region_with_an_in_place_buffer_write_is_refused():
    model, args, _ = models.conv_bn()
    with pytest.raises(PlanError, match="in-place write .* twice"):
        autoshard.compile(model.train(), autoshard.Mesh(data=2), args, recompute="bn1").plan.rank_program(0)


# ---- the rank pass on a graph of its own ---------------------------------------------------------------------
def _marked(fn, region: dict[str, str]):
    gm = torch.fx.symbolic_trace(fn)
    for n in gm.graph.nodes:
        if n.name in region:
            n.meta[M.RECOMPUTE] = region[n.name]
    return gm


def _f(x, w):
    a = torch.tanh(x @ w)          # region r
    seen = a * 3.0                 # outside, between the region's ops: reads it (moves after the call)
    mid = torch.sin(a)             # unmarked, on a path from a to b: joins the region
    b = torch.sigmoid(mid) * a     # region r
    return (b.sum() + seen.sum()) ** 2


def test_the_rank_pass_makes_a_region_convex_and_moves_its_readers_after_it():
    from autoshard.passes.recompute import Recompute

    gm = _marked(_f, {"matmul": "r", "tanh": "r", "sigmoid": "r", "mul_1": "r"})
    out = Recompute().run(gm, None)
    child = out.recompute_r
    assert [n.name for n in child.graph.nodes if n.op == "call_function"] == ["matmul", "tanh", "sin", "sigmoid",
                                                                               "mul_1"]
    names = [n.name for n in out.graph.nodes]
    assert names.index("mul") > names.index("checkpoint")  # `seen` runs after the region
    x, w = torch.randn(4, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    want = _f(x, w)
    gx, gw = torch.autograd.grad(want, (x, w))
    got = out(x, w)
    torch.testing.assert_close(got, want)
    for a, b in zip(torch.autograd.grad(got, (x, w)), (gx, gw)):
        torch.testing.assert_close(a, b)


def test_interleaved_regions_are_an_error():
    from autoshard.passes.recompute import Recompute

    gm = _marked(_f, {"matmul": "r", "sin": "q", "mul_1": "r"})
    with pytest.raises(PlanError, match="regions 'r' and 'q' interleave"):
        Recompute().run(gm, None)


# ---- the memory model -----------------------------------------------------------------------------------------
def test_activation_bytes_of_the_plan_drop_with_recomputation_and_region_cost_prices_it():
    model, args, _ = models.gpt(layers=2)
    plain = autoshard.compile(copy.deepcopy(model), autoshard.Mesh(data=2), args).plan.graph_module
    glob = autoshard.compile(copy.deepcopy(model), autoshard.Mesh(data=2), args,
                             recompute="blocks.*").plan.graph_module
    without = sum(activation_bytes(n) for n in plain.graph.nodes)
    with_rc = sum(activation_bytes(n) for n in glob.graph.nodes)
    assert with_rc < 0.7 * without
    assert sum(activation_bytes(n, region_of=lambda _: None) for n in glob.graph.nodes) == without

    layers = module_regions(plain, "blocks.*")
    assert list(layers) == ["blocks.0", "blocks.1"]
    cost = region_cost(layers["blocks.0"])
    assert 0 < cost.saved_recomputed < cost.saved and cost.peak_extra > 0
    from autoshard.cost_models.compute import flops
    assert cost.extra_flops == sum(flops(n) for n in layers["blocks.0"]) > 0
    # pricing both layers as regions accounts for the whole difference of the two plans
    both = sum(region_cost(nodes).saving for nodes in layers.values())
    assert both == without - with_rc


# ---- real processes --------------------------------------------------------------------------------------------
GLOO_MESH = autoshard.Mesh(model=2)


def _gloo_plan():
    args = _data()
    return args, autoshard.compile(_ckpt_gpt(train=True), GLOO_MESH, args,
                                   annotations=models.megatron(GLOO_MESH, "gpt")).plan


def _gloo_worker(rank, world_size):
    from autoshard.runtime import DistCommunicator, use

    comm = DistCommunicator(GLOO_MESH, timeout=60)
    args, plan = _gloo_plan()
    module = plan.rank_program(rank)
    a, k = plan.shard_inputs(rank, args)
    with use(comm):  # as a ShardedModule's call: the communicator is active for the forward only
        loss = loss_of(module(*a, **k))
    loss.backward()  # the recomputed regions' collectives run here, as in a user's script
    return (loss.item(), {n: p.grad for n, p in module.named_parameters()},
            [(r.kind, r.axis, r.numel, r.phase) for r in comm.log])


@pytest.mark.gloo
def test_checkpointed_regions_with_dropout_on_gloo_equal_the_simulator():
    """2 gloo processes (model=2), train mode: each region's collectives run again in backward on every rank, in the
    same order as the simulator's, and the recomputed dropout masks give the simulator's loss and gradients."""
    from autoshard.placements import assemble
    from autoshard.runtime import spawn

    results = spawn(_gloo_worker, 2, timeout=120, start_method="forkserver")
    args, plan = _gloo_plan()
    sim = plan.simulate(args)
    specs = plan.param_specs()
    for rank in range(2):
        assert results[rank][0] == pytest.approx(loss_of(sim.outputs[rank]).item(), abs=1e-5)
        assert results[rank][2] == [(r.kind, r.axis, r.numel, r.phase) for r in sim.logs[rank]]
    for fqn, spec in specs.items():
        real = assemble([results[r][1][fqn] for r in range(2)], spec, plan.mesh)
        torch.testing.assert_close(real, sim.grads[fqn], rtol=1e-5, atol=1e-6, msg=fqn)
