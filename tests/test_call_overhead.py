"""What a ShardedModule call adds to its rank program, kept small without weakening anything (issue 35, part 6):

* the agreement check runs during the forward (started before it, settled by the communicator before the program's
  first collective): a call the check refuses still runs no collective of its program, draws no random number and
  changes no buffer, on every rank, and every rank raises the same error;
* each DTensor parameter's alias is made once and read by every call; its gradient goes into an empty ``p.grad``
  without DTensor's dispatch — the same gradients, bit for bit, as the bare rank program's, with hooks,
  ``autograd.grad``, accumulation and a parameter used outside the program as before.

Simulated ranks (threads with torch's threaded process group, so parameters are DTensors); the real gloo path of
the overlapped check is run by tests/test_rank_agreement.py and the benchmarks."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

import autoshard
from autoshard.errors import AutoshardError
from autoshard.compiler.plan import loss_of
from autoshard.runtime import SimWorld, current
from autoshard.runtime.agreement import check_call, quiet_until_collective
from examples import models

MODEL = autoshard.Mesh(model=2)
MEGATRON_MLP = {k: (v,) for k, v in models.MEGATRON["mlp"].items()}


class DropoutMLP(nn.Module):
    """Dropout before the first linear: a random draw before the program's first collective (the row-parallel
    all-reduce after fc2)."""

    def __init__(self, hidden: int = 16, ffn: int = 32):
        super().__init__()
        self.drop = nn.Dropout(0.25)
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x, target):
        return nn.functional.mse_loss(self.fc2(nn.functional.gelu(self.fc1(self.drop(x)))), target)


class NormMLP(nn.Module):
    """A BatchNorm (its step counter is an in-place update of a buffer) before the first linear."""

    def __init__(self, hidden: int = 16, ffn: int = 32):
        super().__init__()
        self.norm = nn.BatchNorm1d(hidden)
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x, target):
        return nn.functional.mse_loss(self.fc2(nn.functional.gelu(self.fc1(self.norm(x)))), target)


def _inputs(hidden: int = 16, batch: int = 8):
    g = torch.Generator().manual_seed(3)
    return torch.randn(batch, hidden, generator=g), torch.randn(batch, hidden, generator=g)


def _errors(fn) -> str:
    try:
        fn()
    except AutoshardError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


# ---- the overlapped check ------------------------------------------------------------------------------------
@pytest.mark.parametrize("digests, refused", [((7, 7), False), ((7, 8), True)])
def test_an_overlapped_check_is_settled_by_the_next_collective(digests, refused):
    """check_call(overlap=True) returns at once; the next collective settles it first: where the ranks differ it
    raises on every rank and the collective never runs, else the collective runs as usual."""
    world = SimWorld(autoshard.Mesh(a=2), timeout=30)

    def rank(r):
        comm = current()
        check_call(comm, digests[r], True, overlap=True)
        held = comm._pending is not None
        text = _errors(lambda: comm.all_reduce(torch.ones(2), "a"))
        return held, text, len(comm.log), comm._pending is None

    for held, text, logged, settled in world.run(rank):
        assert held and settled
        if refused:
            assert text.startswith("PlanError: ranks planned differently"), text
            assert logged == 0  # the collective after the refused check never ran
        else:
            assert text == "no error" and logged == 1


#: (rank 0's value, rank 1's): far apart in magnitude, an exact cancellation, a sum that rounds, float64
_CARRIED = [(torch.tensor(3.0e7), torch.tensor(1.5e-5)), (torch.tensor(0.1), torch.tensor(-0.1)),
            (torch.tensor([0.3]), torch.tensor([0.7000001])), (torch.tensor(1 / 3, dtype=torch.float64),
                                                                torch.tensor(2 / 7, dtype=torch.float64))]


@pytest.mark.parametrize("digests", [(7, 7), (7, 8)])
def test_the_check_carries_a_small_all_reduce_with_the_very_sum_the_collective_gives(digests):
    """check_call(overlap=True, carry=True) sends nothing; the first all-reduce (one value, two ranks) then goes in
    the check's own exchange: the same sum as the collective's, one record in the log, one exchange; nothing where
    the ranks differ."""
    world = SimWorld(autoshard.Mesh(data=2), timeout=30)

    def rank(r):
        comm = current()
        out = []
        for pair in _CARRIED:
            want = comm.all_reduce(pair[r], "data")
            logged = len(comm.log)
            exchanges, inner = [], comm._all_reduce

            def counted(t, axis, inner=inner, exchanges=exchanges):
                exchanges.append(t.numel())
                return inner(t, axis)

            comm._all_reduce = counted
            check_call(comm, digests[r], True, overlap=True, carry=True)
            sent_at_once = list(exchanges)
            got = []
            text = _errors(lambda: got.append(comm.all_reduce(pair[r], "data")))
            del comm._all_reduce
            out.append((want, got, text, len(comm.log) - logged, sent_at_once, exchanges))
        return out

    for results in world.run(rank):
        for want, got, text, logged, sent_at_once, exchanges in results:
            assert sent_at_once == []  # deferred: nothing sent before the collective
            if digests[0] == digests[1]:
                assert text == "no error" and logged == 1, text
                assert got[0].dtype == want.dtype and got[0].shape == want.shape and torch.equal(got[0], want)
                assert len(exchanges) == 1  # the check's exchange did the all-reduce: one exchange, not two
            else:
                assert text.startswith("PlanError: ranks planned differently") and logged == 0 and got == []


def test_which_programs_let_the_check_carry_their_first_collective():
    """A data-parallel loss (an all-reduce of one value, or a cross-entropy's target count) is carried; a tensor-
    parallel activation all-reduce, or anything else that communicates first, leaves the check overlapped."""
    from autoshard.runtime.agreement import first_collective_carries

    x, t = _inputs()
    gpt, args, _ = models.gpt(layers=1)
    for model, inputs, mesh, ann, carries in (
            (models.MLP(16, 32), (x, t), autoshard.Mesh(data=2), None, True),
            (models.MLP(16, 32), (x, t), MODEL, MEGATRON_MLP, False),
            (DropoutMLP(), (x, t), autoshard.Mesh(data=2), None, False),
            (gpt, args, autoshard.Mesh(data=2), None, True),
            (gpt, args, autoshard.Mesh(model=2), {k: (v,) for k, v in models.MEGATRON["gpt"].items()}, False)):
        plan = autoshard.compile(copy.deepcopy(model), mesh, inputs, annotations=ann).plan
        assert first_collective_carries(plan.rank_program(0, bucket_grads=True)) is carries, (type(model), mesh)


def test_rank_programs_are_quiet_until_their_first_collective_unless_they_change_state():
    """Which programs may run their compute while the check is in flight: pure ops, the runtime's collectives and
    dropout (which settles the check before it draws); not a program that updates a buffer in place."""
    x, t = _inputs()
    for model, mesh, ann, quiet in ((models.MLP(16, 32), MODEL, MEGATRON_MLP, True),
                                    (models.MLP(16, 32), autoshard.Mesh(data=2), None, True),
                                    (DropoutMLP(), MODEL, MEGATRON_MLP, True),
                                    (NormMLP(), autoshard.Mesh(data=2), None, False)):
        plan = autoshard.compile(model, mesh, (x, t), annotations=ann).plan
        assert quiet_until_collective(plan.rank_program(0, bucket_grads=True)) is quiet, type(model).__name__
    gpt, args, _ = models.gpt(layers=1)
    mesh = autoshard.Mesh(data=2, model=2)
    plan = autoshard.compile(gpt, mesh, args, annotations=models.megatron(mesh, "gpt")).plan
    assert quiet_until_collective(plan.rank_program(0, bucket_grads=True))


def _refused_call(model, mesh, ann, how, rank, comm):
    """Every rank trains a step (and, for ``how="eval"``, evaluates once: both programs made), then rank 0 alone
    makes another call — an evaluation, or a training-mode forward under ``no_grad`` — while the others train: the
    refused call. Returns (error, whether the check was in flight when each program of the refused call started,
    collectives the refused call recorded, random draws it made, buffers it changed)."""
    x, t = _inputs()
    local = tuple(autoshard.data_shard(v, mesh, rank) for v in (x, t))
    sharded = autoshard.compile(model, mesh, (x, t), annotations=ann, comm=comm)
    loss_of(sharded(*local)).backward()
    if how == "eval":
        sharded.eval()
        with torch.no_grad():
            sharded(*local)
        sharded.train()
    started = []
    for program in (*sharded._local_box, *sharded._other_box):
        program.register_forward_pre_hook(lambda *_: started.append(comm._pending is not None))
    logged, draws = len(comm.log), comm.random_calls
    buffers = {k: v.detach().clone() for k, v in sharded.named_buffers()}

    def next_calls():
        if rank == 0:
            sharded.train(how != "eval")
            with torch.no_grad():
                sharded(*local)
        sharded.train()
        loss_of(sharded(*local)).backward()

    text = _errors(next_calls)
    changed = [k for k, v in sharded.named_buffers() if not torch.equal(v.detach(), buffers[k])]
    return text, started, len(comm.log) - logged, comm.random_calls - draws, changed


@pytest.mark.parametrize("case", ["mlp", "dropout", "batch_norm"])
def test_a_refused_call_runs_no_collective_draws_nothing_and_changes_no_buffer(case):
    model, mesh, ann, how, overlapped = {
        "mlp": (models.MLP(16, 32), MODEL, MEGATRON_MLP, "eval", True),
        "dropout": (DropoutMLP(), MODEL, MEGATRON_MLP, "eval", True),
        "batch_norm": (NormMLP(), autoshard.Mesh(data=2), None, "no_grad", False)}[case]
    world = SimWorld(mesh, timeout=120)
    torch.manual_seed(0)
    results = world.run(lambda r: _refused_call(copy.deepcopy(model), mesh, ann, how, r, world.communicator(r)))
    expected = ("in train mode on ranks 1 and in eval mode on ranks 0 at once" if how == "eval" else
                "with gradients on ranks 1 and under torch.no_grad() on ranks 0 at once")
    for rank, (text, started, logged, draws, changed) in enumerate(results):
        assert expected in text, (rank, text)
        # the program ran with the check in flight (a quiet program) or not at all (one that updates a buffer in
        # place settles the check first), and either way the refused call reached no collective, drew nothing and
        # changed no buffer
        assert started == ([True] if overlapped else []), (rank, started)
        assert logged == 0 and draws == 0 and changed == [], (rank, logged, draws, changed)


def test_a_sync_flag_that_differs_is_refused_before_the_first_collective():
    """no_sync() on one rank only: the calls differ in their flag, which the overlapped check names."""
    x, t = _inputs()
    mesh = autoshard.Mesh(data=2)
    model = models.MLP(16, 32)
    world = SimWorld(mesh, timeout=120)

    def rank(r):
        comm = world.communicator(r)
        sharded = autoshard.compile(copy.deepcopy(model), mesh, (x, t), comm=comm)
        local = tuple(autoshard.data_shard(v, mesh, r) for v in (x, t))
        loss_of(sharded(*local)).backward()
        logged = len(comm.log)
        sharded.set_requires_gradient_sync(r != 0)
        text = _errors(lambda: loss_of(sharded(*local)).backward())
        return text, len(comm.log) - logged, sharded.bucketer.sync

    for text, logged, sync in world.run(rank):
        assert "called differently on its ranks" in text and "gradient sync" in text, text
        assert logged == 0 and sync is True  # the buckets keep the flag of the last call that ran


def test_ranks_that_planned_differently_are_refused_with_the_check_overlapped():
    """Rank 1 planned another layout: the first call meets the check in flight and every rank raises PlanError."""
    x, t = _inputs()
    world = SimWorld(MODEL, timeout=120)

    def rank(r):
        comm = world.communicator(r)
        sharded = autoshard.compile(models.MLP(16, 32), MODEL, (x, t), annotations=MEGATRON_MLP if r == 0 else None,
                                    comm=comm)
        return _errors(lambda: loss_of(sharded(x, t)).backward()), len(comm.log)

    for text, logged in world.run(rank):
        assert text.startswith("PlanError: ranks planned differently"), text
        assert logged == 0


# ---- DTensor parameters bound once, gradients stored without DTensor dispatch ---------------------------------
def _train(model, rank, comm, mesh, ann, steps=3):
    """Three AdamW steps of the ShardedModule and of its bare rank program from ``model``'s weights: every gradient
    (local tensors) and loss of each step, and the alias objects the ShardedModule's calls read."""
    x, t = _inputs()
    sharded = autoshard.compile(copy.deepcopy(model), mesh, (x, t), annotations=ann, comm=comm)
    local = tuple(autoshard.data_shard(v, mesh, rank) for v in (x, t))
    plan = autoshard.compile(copy.deepcopy(model), mesh, (x, t), annotations=ann).plan
    bare = plan.rank_program(rank, weights=model, bucket_grads=True)
    from autoshard.runtime import use
    from autoshard.runtime.buckets import GradBucketer

    GradBucketer(bare, comm=comm)
    opt_s = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    opt_b = torch.optim.AdamW(bare.parameters(), lr=1e-2)
    out, aliases = [], []
    for _ in range(steps):
        opt_s.zero_grad()
        opt_b.zero_grad()
        ls = loss_of(sharded(*local))
        ls.backward()
        aliases.append({k: v[2] for k, v in sharded._views.items()})
        with use(comm):
            lb = loss_of(bare(*local))
        lb.backward()
        out.append((ls.item(), lb.item(),
                    {n: p.grad._local_tensor.clone() for n, p in sharded.named_parameters()},
                    {n: p.grad.clone() for n, p in bare.named_parameters()}))
        opt_s.step()
        opt_b.step()
    return out, aliases


@pytest.mark.parametrize("layout", ["tp", "dp"])
def test_sharded_module_gradients_equal_the_bare_program_bit_for_bit(layout):
    mesh, ann = (MODEL, MEGATRON_MLP) if layout == "tp" else (autoshard.Mesh(data=2), None)
    world = SimWorld(mesh, timeout=120)
    torch.manual_seed(0)
    model = models.MLP(16, 32)
    for out, aliases in world.run(lambda r: _train(model, r, world.communicator(r), mesh, ann)):
        for ls, lb, gs, gb in out:
            assert ls == lb
            assert sorted(gs) == sorted(gb)
            for name in gs:
                assert torch.equal(gs[name], gb[name]), name
        # every step read the aliases the first one made (optimizer steps update the parameters in place)
        assert all(a.keys() == aliases[0].keys() and all(a[k] is aliases[0][k] for k in a) for a in aliases)


def _grad_paths(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    from autoshard.runtime.parameters import _LocalView

    dm = init_device_mesh("cpu", (world_size,))
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(1))

    def param():  # (a generator of its own: simulated ranks are threads sharing torch's)
        local = torch.randn(4, 3, generator=torch.Generator().manual_seed(rank))
        return nn.Parameter(DTensor.from_local(local, dm, (Shard(0),), run_check=False))

    def loss(v):
        return (x @ v.t()).pow(2).sum()

    reference = param()
    loss(reference.to_local()).backward()  # torch's own to_local: AccumulateGrad on the DTensor leaf
    ref = reference.grad
    out = {}
    p = param()
    alias = _LocalView.apply(p)
    from torch.utils._python_dispatch import TorchDispatchMode

    dispatched = []

    class DTensorOps(TorchDispatchMode):  # the aten ops run on DTensors (DTensor's dispatch) during backward
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(t, DTensor) for t in types):
                dispatched.append(str(func))
            return func(*args, **(kwargs or {}))

    y = loss(alias)
    with DTensorOps():
        y.backward()
    ours = list(dispatched)
    dispatched.clear()
    check = loss(reference.to_local())
    reference.grad = None
    with DTensorOps():
        check.backward()  # the mode sees DTensor's ops: torch's own path detaches the gradient through them
    out["dispatched"] = (ours, dispatched)
    out["stored"] = (type(p.grad) is DTensor and p.grad.placements == ref.placements
                     and torch.equal(p.grad._local_tensor, ref._local_tensor))
    loss(alias).backward()  # accumulation: AccumulateGrad adds to the existing gradient, as before
    out["accumulated"] = torch.equal(p.grad._local_tensor, ref._local_tensor + ref._local_tensor)
    p.grad = None
    (g,) = torch.autograd.grad(loss(alias), p)
    out["autograd.grad"] = p.grad is None and torch.equal(g._local_tensor, ref._local_tensor)
    seen = []
    handle = p.register_hook(lambda grad: seen.append(type(grad).__name__))
    loss(alias).backward()
    handle.remove()
    p.register_post_accumulate_grad_hook(lambda q: seen.append(q.grad is not None))
    p.grad = None
    loss(alias).backward()
    out["hooks"] = seen == ["DTensor", True] and torch.equal(p.grad._local_tensor, ref._local_tensor)
    both, alone = param(), param()
    direct = (both * both).sum().full_tensor()
    (loss(_LocalView.apply(both)) + direct).backward()
    (loss(alone.to_local()) + (alone * alone).sum().full_tensor()).backward()
    out["used outside"] = torch.equal(both.grad._local_tensor, alone.grad._local_tensor)
    return out


def test_parameter_gradients_are_stored_without_dtensor_dispatch_and_hooks_still_run():
    world = SimWorld(autoshard.Mesh(a=2), timeout=60)
    for out in world.run(lambda r: _grad_paths(r, 2)):
        assert out == {"dispatched": ([], ["aten.detach.default"]), "stored": True, "accumulated": True,
                       "autograd.grad": True, "hooks": True, "used outside": True}, out


# ---- real processes: the overlapped and the carrying check on gloo ----------------------------------------------
def _gloo_calls(rank: int, world_size: int) -> dict:
    """Two gloo processes, data=2 (the check carries the loss all-reduce) and model=2 (it runs during the forward):
    three AdamW steps of the ShardedModule against its bare program (losses and gradients), then a call on rank 0
    only."""
    from autoshard.runtime import DistCommunicator, use
    from autoshard.runtime import agreement
    from autoshard.runtime.buckets import GradBucketer

    out = {}
    x, t = _inputs()
    for layout, mesh, ann in (("dp", autoshard.Mesh(data=2), None), ("tp", MODEL, MEGATRON_MLP)):
        comm = DistCommunicator(mesh, timeout=60)
        torch.manual_seed(0)
        model = models.MLP(16, 32)
        sharded = autoshard.compile(copy.deepcopy(model), mesh, (x, t), annotations=ann, comm=comm)
        bare = autoshard.compile(copy.deepcopy(model), mesh, (x, t), annotations=ann).plan.rank_program(
            rank, weights=model, bucket_grads=True)
        GradBucketer(bare, comm=comm)
        local = tuple(autoshard.data_shard(v, mesh, rank) for v in (x, t))
        started, issue = [], comm.all_reduce_host_async
        comm.all_reduce_host_async = lambda v: started.append(1) or issue(v)
        opts = torch.optim.AdamW(sharded.parameters(), lr=1e-2), torch.optim.AdamW(bare.parameters(), lr=1e-2)
        same = True
        for _ in range(3):
            for opt in opts:
                opt.zero_grad()
            n = len(comm.log)
            ls = loss_of(sharded(*local))
            ls.backward()
            logged = len(comm.log) - n
            with use(comm):
                lb = loss_of(bare(*local))
            lb.backward()
            same &= logged == len(comm.log) - n - logged and ls.item() == lb.item()
            mine, theirs = dict(sharded.named_parameters()), dict(bare.named_parameters())
            same &= all(torch.equal(mine[k].grad._local_tensor, theirs[k].grad) for k in theirs)
            for opt in opts:
                opt.step()
        carried = agreement.first_collective_carries(sharded.local)
        n = len(comm.log)

        def refused():
            if rank == 0:
                sharded.eval()
                with torch.no_grad():
                    sharded(*local)
            sharded.train()
            loss_of(sharded(*local)).backward()

        out[layout] = (same, carried, len(started), _errors(refused), len(comm.log) - n)
    return out


@pytest.mark.gloo
def test_on_gloo_the_check_overlaps_or_carries_and_still_refuses_a_call_on_one_rank():
    from autoshard.runtime import spawn

    for result in spawn(_gloo_calls, 2, timeout=300, start_method="forkserver"):  # no torch import per rank
        for layout, (same, carried, started, text, logged) in result.items():
            assert same, layout  # every loss and gradient equal to the bare program's, the collectives logged alike
            # data parallel: no exchange started ahead (the loss all-reduce carries the check); tensor parallel: one
            # started before each of the three forwards
            assert (carried, started) == ((True, 0) if layout == "dp" else (False, 3)), (layout, carried, started)
            assert "in train mode on ranks 1 and in eval mode on ranks 0 at once" in text, (layout, text)
            assert logged == 0, (layout, logged)  # the refused call ran no collective
