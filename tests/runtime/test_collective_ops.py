"""Simulator tests of the runtime: raw collectives, autograd collectives, the log, and failure handling.

Expected values are computed here from the full (global) tensors with plain torch, never with the runtime.
Inputs are integer-valued floats, so sums are exact and comparisons can be bit-exact.
"""

from __future__ import annotations

import threading
import types

import pytest
import torch

from autoshard.errors import AutoshardError, CollectiveTimeoutError, MeshError, RuntimeShapeError
from autoshard.mesh import Mesh
from autoshard.runtime import sim
from autoshard.runtime import (
    CollectiveRecord,
    SimWorld,
    all_gather,
    all_reduce,
    all_to_all,
    collective_counts,
    current,
    grad_all_reduce,
    local_slice,
    reduce_scatter,
    use,
)
from tests.tolerance import assert_within_sum_bound

# (mesh, axis) pairs: a 1-D mesh of 2 and of 4, and both axes of a 2x2 mesh.
CASES = [
    (Mesh(x=2), "x"),
    (Mesh(data=2, model=2), "data"),
    (Mesh(data=2, model=2), "model"),
    (Mesh(a=4), "a"),
]
IDS = ["x2-x", "2x2-data", "2x2-model", "a4-a"]


def rank_input(rank: int, shape, dtype=torch.float32) -> torch.Tensor:
    """A different integer-valued tensor on every rank."""
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(-50, 50, shape, generator=g).to(dtype)


def global_input(shape, seed: int = 7) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-9, 10, shape, generator=g).float()


def run(mesh: Mesh, fn, timeout: float = 20.0):
    return SimWorld(mesh, timeout=timeout).run(fn)


def members(mesh: Mesh, rank: int, axis: str) -> list[int]:
    """The group of ``rank`` along ``axis`` in coordinate order, computed from row-major coordinates."""
    coords = mesh.coords(rank)
    return [r for r in range(mesh.size) if all(mesh.coords(r)[a] == coords[a] for a in mesh.names if a != axis)]


# ---- raw collectives ----------------------------------------------------------------------------------------
def test_groups_of_2x2_mesh_by_hand():
    mesh = Mesh(data=2, model=2)
    out = run(mesh, lambda r: (current().all_reduce(torch.tensor([float(r)]), "model"),
                               current().all_reduce(torch.tensor([float(r)]), "data"),
                               current().axis_index("data"), current().axis_index("model")))
    # model groups: {0,1} and {2,3}; data groups: {0,2} and {1,3}.
    assert [o[0].item() for o in out] == [1, 1, 5, 5]
    assert [o[1].item() for o in out] == [2, 4, 2, 4]
    assert [(o[2], o[3]) for o in out] == [(0, 0), (0, 1), (1, 0), (1, 1)]


@pytest.mark.parametrize("mesh,axis", CASES, ids=IDS)
@pytest.mark.parametrize("shape", [(3,), (2, 5), (2, 3, 4)])
def test_all_reduce(mesh, axis, shape):
    out = run(mesh, lambda r: current().all_reduce(rank_input(r, shape), axis))
    for r in range(mesh.size):
        expected = sum(rank_input(m, shape) for m in members(mesh, r, axis))
        assert torch.equal(out[r], expected)


@pytest.mark.parametrize("mesh,axis", CASES, ids=IDS)
@pytest.mark.parametrize("shape,dim", [((3,), 0), ((2, 5), 0), ((2, 5), 1), ((2, 3, 4), 1), ((2, 3, 4), -1)])
def test_all_gather(mesh, axis, shape, dim):
    out = run(mesh, lambda r: current().all_gather(rank_input(r, shape), axis, dim))
    for r in range(mesh.size):
        expected = torch.cat([rank_input(m, shape) for m in members(mesh, r, axis)], dim=dim)
        assert torch.equal(out[r], expected)


@pytest.mark.parametrize("mesh,axis", CASES, ids=IDS)
@pytest.mark.parametrize("shape,dim", [((8,), 0), ((4, 3), 0), ((3, 8), 1), ((2, 4, 4), -1), ((2, 8, 3), 1)])
def test_reduce_scatter(mesh, axis, shape, dim):
    out = run(mesh, lambda r: current().reduce_scatter(rank_input(r, shape), axis, dim))
    n = mesh.axis_size(axis)
    for r in range(mesh.size):
        total = sum(rank_input(m, shape) for m in members(mesh, r, axis))
        c = mesh.coords(r)[axis]
        size = shape[dim] // n
        assert torch.equal(out[r], total.narrow(dim, c * size, size))


@pytest.mark.parametrize("mesh,axis", CASES, ids=IDS)
@pytest.mark.parametrize("shape,split_dim,cat_dim", [((8,), 0, 0), ((4, 4), 0, 1), ((4, 4), 1, 0),
                                                     ((2, 8, 3), 1, 2), ((4, 2, 4), -1, 0)])
def test_all_to_all(mesh, axis, shape, split_dim, cat_dim):
    out = run(mesh, lambda r: current().all_to_all(rank_input(r, shape), axis, split_dim, cat_dim))
    n = mesh.axis_size(axis)
    for r in range(mesh.size):
        c = mesh.coords(r)[axis]
        size = shape[split_dim] // n
        pieces = [rank_input(m, shape).narrow(split_dim, c * size, size) for m in members(mesh, r, axis)]
        assert torch.equal(out[r], torch.cat(pieces, dim=cat_dim))


@pytest.mark.parametrize("mesh,axis", CASES, ids=IDS)
@pytest.mark.parametrize("i,j", [(0, 1), (1, 0), (2, 0), (1, 2)])
def test_all_to_all_moves_a_shard_to_another_dim(mesh, axis, i, j):
    """Shard(i) → Shard(j) is all_to_all(split_dim=j, cat_dim=i): the result is the Shard(j) piece."""
    full = global_input((4, 8, 4))
    n = mesh.axis_size(axis)

    def shard(dim, c):
        return full.chunk(n, dim)[c]

    out = run(mesh, lambda r: current().all_to_all(shard(i, current().axis_index(axis)), axis, j, i))
    for r in range(mesh.size):
        assert torch.equal(out[r], shard(j, mesh.coords(r)[axis]))


@pytest.mark.parametrize("mesh,axis", CASES, ids=IDS)
def test_broadcast(mesh, axis):
    n = mesh.axis_size(axis)
    out = run(mesh, lambda r: current().broadcast(rank_input(r, (3,)), axis, src=n - 1))
    for r in range(mesh.size):
        assert torch.equal(out[r], rank_input(members(mesh, r, axis)[n - 1], (3,)))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.int64, torch.int32])
def test_dtypes_are_kept(dtype):
    out = run(Mesh(x=2), lambda r: (current().all_reduce(rank_input(r, (4,), dtype), "x"),
                                    current().reduce_scatter(rank_input(r, (4,), dtype), "x", 0)))
    expected = rank_input(0, (4,), dtype) + rank_input(1, (4,), dtype)
    for r, (a, b) in enumerate(out):
        assert a.dtype == b.dtype == dtype
        assert torch.equal(a, expected)
        assert torch.equal(b, expected.chunk(2)[r])


def test_results_are_bit_identical_across_ranks_and_runs():
    mesh = Mesh(a=4)

    def fn(r):
        g = torch.Generator().manual_seed(r)
        return current().all_reduce(torch.randn(1000, generator=g), "a")

    first, second = run(mesh, fn), run(mesh, fn)
    for t in first + second:
        assert torch.equal(t, first[0])
    xs = [torch.randn(1000, generator=torch.Generator().manual_seed(r)) for r in range(4)]
    assert torch.equal(first[0], ((xs[0] + xs[1]) + xs[2]) + xs[3])  # coordinate order


def test_results_are_new_tensors():
    def fn(r):
        x = torch.ones(4)
        y = current().all_gather(x, "x", 0)
        z = current().all_reduce(x, "x")
        x.add_(100)  # must not leak into any rank's results
        return y, z

    for y, z in run(Mesh(x=2), fn):
        assert torch.equal(y, torch.ones(8)) and torch.equal(z, torch.full((4,), 2.0))


def test_noncontiguous_input():
    def fn(r):
        x = rank_input(r, (4, 6)).t()  # (6, 4), not contiguous
        return current().all_gather(x, "x", 1), current().reduce_scatter(x, "x", 0)

    out = run(Mesh(x=2), fn)
    xs = [rank_input(r, (4, 6)).t() for r in range(2)]
    assert torch.equal(out[0][0], torch.cat(xs, 1))
    assert torch.equal(out[1][1], (xs[0] + xs[1])[3:])


def test_send_recv_and_barrier():
    mesh = Mesh(pipe=2, model=2)

    def fn(r):
        comm = current()
        c = comm.mesh.coords(r)
        if c["pipe"] == 0:
            comm.send(rank_input(r, (2, 3)), comm.mesh.rank_of({**c, "pipe": 1}))
            out = None
        else:
            out = comm.recv((2, 3), torch.float32, comm.mesh.rank_of({**c, "pipe": 0}))
        comm.barrier()
        return out

    out = run(mesh, fn)
    assert out[0] is None and out[1] is None
    assert torch.equal(out[2], rank_input(0, (2, 3))) and torch.equal(out[3], rank_input(1, (2, 3)))


# ---- the log --------------------------------------------------------------------------------------------
def test_log_records_forward_collectives():
    world = SimWorld(Mesh(data=2, model=2), timeout=20)

    def fn(r):
        comm = current()
        comm.all_reduce(torch.ones(2, 3), "model")
        comm.all_gather(torch.ones(4, dtype=torch.float64), "data", 0)
        comm.reduce_scatter(torch.ones(4, 2), "model", 0)
        comm.all_to_all(torch.ones(2, 6), "data", 0, 1)

    world.run(fn)
    for r in range(4):
        assert world.communicator(r).log == [
            CollectiveRecord("all_reduce", "model", 6, torch.float32, "forward"),
            CollectiveRecord("all_gather", "data", 4, torch.float64, "forward"),
            CollectiveRecord("reduce_scatter", "model", 8, torch.float32, "forward"),
            CollectiveRecord("all_to_all", "data", 12, torch.float32, "forward"),
        ]
    assert world.communicator(0).log[1].nbytes == 32
    assert world.communicator(0).log[0].nbytes == 24


def test_log_records_backward_phase():
    world = SimWorld(Mesh(data=2, model=2), timeout=20)

    def fn(r):
        x = torch.ones(4, 2, requires_grad=True)
        y = reduce_scatter(x, "model", 0)            # fwd reduce_scatter(8), bwd all_gather(4)
        y = all_gather(y, "model", 0)                # fwd all_gather(4), bwd: local slice, no comm
        y = all_to_all(y, "data", 1, 0)              # fwd all_to_all(8), bwd all_to_all(8)
        y = all_reduce(y, "data")                    # fwd all_reduce(8), bwd identity
        y = grad_all_reduce(y, ("data", "model"))    # fwd identity, bwd all_reduce data + model (8 each)
        y = local_slice(y, "model", 0)               # fwd no comm, bwd all_gather(4)
        y.sum().backward()

    world.run(fn)
    f32 = torch.float32
    for r in range(4):
        log = world.communicator(r).log
        assert log == [
            CollectiveRecord("reduce_scatter", "model", 8, f32, "forward"),
            CollectiveRecord("all_gather", "model", 4, f32, "forward"),
            CollectiveRecord("all_to_all", "data", 8, f32, "forward"),
            CollectiveRecord("all_reduce", "data", 8, f32, "forward"),
            CollectiveRecord("all_gather", "model", 4, f32, "backward"),
            CollectiveRecord("all_reduce", "data", 8, f32, "backward"),
            CollectiveRecord("all_reduce", "model", 8, f32, "backward"),
            CollectiveRecord("all_to_all", "data", 8, f32, "backward"),
            CollectiveRecord("all_gather", "model", 4, f32, "backward"),
        ]
        assert collective_counts(log, "backward") == {("all_gather", "model"): 2, ("all_reduce", "data"): 1,
                                                      ("all_reduce", "model"): 1, ("all_to_all", "data"): 1}
        assert collective_counts(log)[("all_gather", "model")] == 3
        assert sum(collective_counts(log, "forward").values()) == 4


def test_collective_counts_rejects_unknown_phase():
    with pytest.raises(AutoshardError, match="phase='fwd'"):
        collective_counts([], "fwd")


def test_recording_can_be_turned_off():
    world = SimWorld(Mesh(x=2))
    for r in range(2):
        world.communicator(r).recording = False
    world.run(lambda r: current().all_reduce(torch.ones(1), "x"))
    assert world.communicator(0).log == []


def test_p2p_is_recorded_on_the_axis_between_the_ranks():
    world = SimWorld(Mesh(pipe=2, model=2), timeout=20)

    def fn(r):
        if r == 0:
            current().send(torch.ones(3), 2)
        elif r == 2:
            current().recv((3,), torch.float32, 0)

    world.run(fn)
    assert world.communicator(0).log == [CollectiveRecord("send", "pipe", 3, torch.float32, "forward")]
    assert world.communicator(2).log == [CollectiveRecord("recv", "pipe", 3, torch.float32, "forward")]


# ---- autograd collectives against full-tensor references --------------------------------------------------
def weight(shape, r=0):
    return rank_input(100 + r, shape)


@pytest.mark.parametrize("mesh,axis", CASES, ids=IDS)
def test_all_reduce_grad_is_identity(mesh, axis):
    shape = (2, 4)

    def fn(r):
        x = rank_input(r, shape).requires_grad_()
        y = all_reduce(x, axis)
        (gx,) = torch.autograd.grad((y * weight(shape, r)).sum(), x)
        return y.detach(), gx

    for r, (y, gx) in enumerate(run(mesh, fn)):
        assert torch.equal(y, sum(rank_input(m, shape) for m in members(mesh, r, axis)))
        assert torch.equal(gx, weight(shape, r))


@pytest.mark.parametrize("mesh,axis", CASES, ids=IDS)
def test_all_reduce_partial_to_replicate_matches_full_grad(mesh, axis):
    """Partial inputs x_m summed, then a replicated loss: each x_m gets d loss / d (sum)."""
    shape = (4, 2)
    w = weight(shape)

    def fn(r):
        x = rank_input(r, shape).requires_grad_()
        y = all_reduce(x, axis)
        (gx,) = torch.autograd.grad((y.sin() * w).sum(), x)
        return gx

    out = run(mesh, fn)
    for r in range(mesh.size):
        xs = [rank_input(m, shape).requires_grad_() for m in members(mesh, r, axis)]
        ref = torch.autograd.grad((sum(xs).sin() * w).sum(), xs)
        assert torch.allclose(out[r], ref[0]) and all(torch.equal(ref[0], g) for g in ref)


@pytest.mark.parametrize("axes", [("data",), ("model",), ("data", "model"), ("model", "data")])
def test_grad_all_reduce_sums_upstream_grads_over_the_axes(axes):
    mesh = Mesh(data=2, model=2)
    shape = (3, 2)

    def fn(r):
        x = global_input(shape).requires_grad_()
        y = grad_all_reduce(x, axes)
        (gx,) = torch.autograd.grad((y * weight(shape, r)).sum(), x)
        return y.detach(), gx

    out = run(mesh, fn)
    for r, (y, gx) in enumerate(out):
        assert torch.equal(y, global_input(shape))
        group = {r}
        for a in axes:
            group = {m for g in group for m in members(mesh, g, a)}
        assert torch.equal(gx, sum(weight(shape, m) for m in sorted(group)))


def test_grad_all_reduce_accepts_a_single_axis_name():
    def fn(r):
        x = torch.ones(2, requires_grad=True)
        (grad_all_reduce(x, "x") * (r + 1)).sum().backward()
        return x.grad

    assert [g.tolist() for g in run(Mesh(x=2), fn)] == [[3.0, 3.0], [3.0, 3.0]]


@pytest.mark.parametrize("mesh,axis", CASES, ids=IDS)
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_all_gather_shard_to_replicate_matches_full_grad(mesh, axis, dim):
    shape = (4, 8)
    full, w = global_input(shape), weight(shape)
    n = mesh.axis_size(axis)

    def fn(r):
        x = full.chunk(n, dim)[current().axis_index(axis)].clone().requires_grad_()
        y = all_gather(x, axis, dim)
        (gx,) = torch.autograd.grad((y.exp() * w).sum() / 1000, x)
        return y.detach(), gx

    fx = full.clone().requires_grad_()
    (gfull,) = torch.autograd.grad((fx.exp() * w).sum() / 1000, fx)
    for r, (y, gx) in enumerate(run(mesh, fn)):
        assert torch.equal(y, full)
        assert torch.equal(gx, gfull.chunk(n, dim)[mesh.coords(r)[axis]])


@pytest.mark.parametrize("mesh,axis", CASES, ids=IDS)
@pytest.mark.parametrize("dim", [0, 1])
def test_reduce_scatter_partial_to_shard_matches_full_grad(mesh, axis, dim):
    shape = (4, 8)
    w = weight(shape)
    n = mesh.axis_size(axis)

    def fn(r):
        x = rank_input(r, shape).requires_grad_()
        y = reduce_scatter(x, axis, dim)
        c = current().axis_index(axis)
        (gx,) = torch.autograd.grad((y * w.chunk(n, dim)[c]).sum(), x)
        return y.detach(), gx

    out = run(mesh, fn)
    for r, (y, gx) in enumerate(out):
        xs = [rank_input(m, shape).requires_grad_() for m in members(mesh, r, axis)]
        total = sum(xs)
        ref = torch.autograd.grad((total * w).sum(), xs)
        assert torch.equal(y, total.detach().chunk(n, dim)[mesh.coords(r)[axis]])
        assert torch.equal(gx, ref[0])  # the full gradient of the sum, on every partial holder


@pytest.mark.parametrize("mesh,axis", CASES, ids=IDS)
@pytest.mark.parametrize("i,j", [(0, 1), (1, 0), (2, 1)])
def test_all_to_all_matches_full_grad(mesh, axis, i, j):
    shape = (4, 8, 4)
    full, w = global_input(shape), weight(shape)
    n = mesh.axis_size(axis)

    def fn(r):
        c = current().axis_index(axis)
        x = full.chunk(n, i)[c].clone().requires_grad_()
        y = all_to_all(x, axis, j, i)
        (gx,) = torch.autograd.grad((y.cos() * w.chunk(n, j)[c]).sum(), x)
        return y.detach(), gx

    fx = full.clone().requires_grad_()
    (gfull,) = torch.autograd.grad((fx.cos() * w).sum(), fx)
    for r, (y, gx) in enumerate(run(mesh, fn)):
        c = mesh.coords(r)[axis]
        assert torch.equal(y, full.chunk(n, j)[c])
        assert torch.allclose(gx, gfull.chunk(n, i)[c])


@pytest.mark.parametrize("mesh,axis", CASES, ids=IDS)
def test_all_to_all_then_inverse_is_identity(mesh, axis):
    def fn(r):
        x = rank_input(r, (4, 8)).requires_grad_()
        y = all_to_all(all_to_all(x, axis, 1, 0), axis, 0, 1)
        (gx,) = torch.autograd.grad((y * weight((4, 8), r)).sum(), x)
        return torch.equal(y, x), gx

    for r, (same, gx) in enumerate(run(mesh, fn)):
        assert same and torch.equal(gx, weight((4, 8), r))


@pytest.mark.parametrize("mesh,axis", CASES, ids=IDS)
@pytest.mark.parametrize("dim", [0, 1])
def test_local_slice_replicate_to_shard_matches_full_grad(mesh, axis, dim):
    shape = (4, 8)
    full, w = global_input(shape), weight(shape)
    n = mesh.axis_size(axis)

    def fn(r):
        x = full.clone().requires_grad_()
        y = local_slice(x, axis, dim)
        c = current().axis_index(axis)
        (gx,) = torch.autograd.grad((y.tanh() * w.chunk(n, dim)[c]).sum(), x)
        y.detach().add_(1000)  # the slice is a copy: the replica must not change
        return y.detach(), gx, torch.equal(x, full)

    fx = full.clone().requires_grad_()
    (gfull,) = torch.autograd.grad((fx.tanh() * w).sum(), fx)
    for r, (y, gx, untouched) in enumerate(run(mesh, fn)):
        assert untouched
        assert torch.equal(y, full.chunk(n, dim)[mesh.coords(r)[axis]] + 1000)
        assert torch.allclose(gx, gfull)


def test_megatron_mlp_with_data_parallel_matches_single_device():
    """Data parallel over `data` and Megatron column/row parallel over `model`: loss and every gradient equal
    the single-device ones, with the expected collectives (1 fwd all-reduce, 3 bwd all-reduces per rank)."""
    mesh = Mesh(data=2, model=2)
    torch.manual_seed(0)
    X, W1, W2 = torch.randn(8, 6), torch.randn(16, 6), torch.randn(4, 16)
    world = SimWorld(mesh, timeout=20)

    def fn(r):
        d, m = current().axis_index("data"), current().axis_index("model")
        x = X.chunk(2, 0)[d].clone().requires_grad_()
        w1 = W1.chunk(2, 0)[m].clone().requires_grad_()   # column parallel: output features
        w2 = W2.chunk(2, 1)[m].clone().requires_grad_()   # row parallel: input features
        h = torch.relu(grad_all_reduce(x, ("model",)) @ grad_all_reduce(w1, ("data",)).T)
        out = all_reduce(h @ grad_all_reduce(w2, ("data",)).T, "model")
        loss = (out ** 2).sum()
        loss.backward()
        return all_reduce(loss.detach(), "data"), x.grad, w1.grad, w2.grad

    out = world.run(fn)

    def loss_and_grads(tensors):
        leaves = [t.double().requires_grad_() for t in tensors]
        loss = ((torch.relu(leaves[0] @ leaves[1].T) @ leaves[2].T) ** 2).sum()
        loss.backward()
        return [loss.detach()] + [t.grad for t in leaves]

    # float64 reference from the same operands; the terms' magnitudes: the same computation on |operands|
    ref, mag = loss_and_grads((X, W1, W2)), loss_and_grads((X.abs(), W1.abs(), W2.abs()))
    # roundings on the longest path: sums of 6 (h), 16 (out), 4 (dh = dout W2), 8 (the batch) or 16 (dX = dpre W1),
    # 32 (the loss), +1 per product; the kernels and the all-reduces add in other orders than the reference
    n = {"loss": 6 + 16 + 1 + 32, "x": 6 + 16 + 1 + 4 + 16, "w1": 6 + 16 + 1 + 4 + 8, "w2": 6 + 16 + 1 + 8}
    for r, (loss, gx, g1, g2) in enumerate(out):
        d, m = mesh.coords(r)["data"], mesh.coords(r)["model"]
        shard = {"loss": lambda t: t, "x": lambda t: t.chunk(2, 0)[d], "w1": lambda t: t.chunk(2, 0)[m],
                 "w2": lambda t: t.chunk(2, 1)[m]}
        for i, (name, got) in enumerate(zip(("loss", "x", "w1", "w2"), (loss, gx, g1, g2))):
            assert_within_sum_bound(got, shard[name](ref[i]), shard[name](mag[i]), n[name], what=f"rank {r} {name}")
        log = world.communicator(r).log
        assert collective_counts(log, "forward") == {("all_reduce", "model"): 1, ("all_reduce", "data"): 1}
        assert collective_counts(log, "backward") == {("all_reduce", "model"): 1, ("all_reduce", "data"): 2}


def test_backward_outside_the_use_block_uses_the_forward_communicator():
    world = SimWorld(Mesh(x=2), timeout=20)
    grads, errors = [None, None], []

    def rank_main(r):
        try:
            x = torch.ones(2, requires_grad=True)
            with use(world.communicator(r)):
                y = grad_all_reduce(x, ("x",)) * (r + 1)
            y.sum().backward()  # no communicator is current here
            grads[r] = x.grad
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert [g.tolist() for g in grads] == [[3.0, 3.0], [3.0, 3.0]]
    assert world.communicator(0).log[-1].phase == "backward"


def test_double_backward_through_a_collective_raises_instead_of_dropping_terms():
    def fn(r):
        x = torch.ones(2, requires_grad=True)
        y = all_gather(x, "x", 0)
        (g,) = torch.autograd.grad((y ** 3).sum(), x, create_graph=True)  # the grad flows through the gather
        g.sum().backward()

    with pytest.raises(RuntimeError, match=r"rank \d.*no autograd formula was registered"):
        run(Mesh(x=2), fn)


# ---- the current communicator -----------------------------------------------------------------------------
def test_current_without_use_raises():
    with pytest.raises(AutoshardError, match="no communicator is active"):
        current()
    with pytest.raises(AutoshardError, match="no communicator is active"):
        all_reduce(torch.ones(1), "x")


def test_use_is_thread_local_and_nests():
    world = SimWorld(Mesh(x=2))
    seen = []
    with use(world.communicator(0)):
        with use(world.communicator(1)):
            assert current().rank == 1
        assert current().rank == 0
        t = threading.Thread(target=lambda: seen.append(_current_or_none()))
        t.start()
        t.join()
    assert seen == [None]
    assert _current_or_none() is None


def _current_or_none():
    try:
        return current()
    except AutoshardError:
        return None


def test_use_rejects_non_communicators():
    with pytest.raises(AutoshardError, match="needs an autoshard.runtime Communicator"), use("rank0"):
        pass


# ---- failures -------------------------------------------------------------------------------------------
def test_error_on_one_rank_aborts_the_others_at_once():
    ended = {}

    def fn(r):
        if r == 2:
            raise ValueError("bad input on this rank")
        try:
            current().all_reduce(torch.ones(1), "a")  # ranks 0, 1, 3 would wait for rank 2 until their timeout
        except AutoshardError as e:
            ended[r] = e
            raise
        return r

    with pytest.raises(ValueError, match="rank 2: bad input on this rank") as info:
        SimWorld(Mesh(a=4), timeout=30).run(fn)
    assert isinstance(info.value.__cause__, ValueError)
    # The others were stopped by rank 2's failure, not by their own timeout (which would have raised a
    # CollectiveTimeoutError naming rank 2 as missing).
    assert sorted(ended) == [0, 1, 3]
    for r, e in ended.items():
        assert not isinstance(e, CollectiveTimeoutError), (r, e)
        assert f"all_reduce on axis `a` on rank {r} was aborted because rank 2 failed (ValueError: bad input" in str(e)


def test_world_is_reusable_after_an_error():
    world = SimWorld(Mesh(x=2), timeout=30)

    def bad(r):
        if r == 0:
            raise KeyError("k")
        current().all_reduce(torch.ones(1), "x")

    with pytest.raises(KeyError, match="rank 0"):
        world.run(bad)
    assert [t.item() for t in world.run(lambda r: current().all_reduce(torch.ones(1), "x"))] == [2.0, 2.0]


def test_skipped_collective_times_out_naming_the_collective_axis_and_missing_rank():
    def fn(r):
        if r != 1:
            current().all_reduce(torch.ones(1), "model")

    with pytest.raises(CollectiveTimeoutError) as info:
        SimWorld(Mesh(data=2, model=2), timeout=1).run(fn)
    msg = str(info.value)
    assert msg.startswith("rank 0: all_reduce on axis `model` (group of ranks [0, 1]) waited 1 s on rank 0"), msg
    assert "ranks [1] did not arrive" in msg
    assert "rank 1 has returned from its function" in msg


class _ScriptedClock:
    """The simulator's clock in a test (``monkeypatch.setattr(sim, "time", clock)``): rank ``r``'s readings follow
    ``script[r]``, steps of (event to wait for first or None, the reading, event to set then or None), the last
    step repeating; any other thread reads ``rest``. Which wait times out first is then set by the script, not by
    the machine's load."""

    def __init__(self, script: dict[int, list[tuple]], rest: float):
        self.script, self.rest, self.count = script, rest, dict.fromkeys(script, 0)

    def monotonic(self) -> float:
        try:
            rank = current().rank
        except AutoshardError:  # not a rank's thread
            return self.rest
        steps = self.script[rank]
        wait_for, reading, then = steps[min(self.count[rank], len(steps) - 1)]
        self.count[rank] += 1
        if wait_for is not None:
            assert wait_for.wait(timeout=60), f"rank {rank}'s clock waited for an event that never came"
        if then is not None:
            then.set()
        return reading


def test_rank_waiting_in_another_collective_is_named(monkeypatch):
    # Rank 1 starts waiting at t=0 (its deadline: 1); rank 0 enters its all_gather only after that, at t=0.5
    # (deadline 1.5); rank 1's next reading, taken once rank 0 waits in the all_gather, is t=1.2: rank 1 times out
    # first, while rank 0 still waits.
    rank1_waits, rank0_waits = threading.Event(), threading.Event()
    clock = _ScriptedClock({1: [(None, 0.0, rank1_waits), (rank0_waits, 1.2, None)],
                            0: [(rank1_waits, 0.5, rank0_waits), (None, 1.2, None)]}, rest=1.2)
    monkeypatch.setattr(sim, "time", types.SimpleNamespace(monotonic=clock.monotonic))

    def fn(r):
        comm = current()
        if r == 0:
            comm.all_gather(torch.ones(1), "data", 0)  # rank 2 never joins
        elif r == 1:
            comm.all_reduce(torch.ones(1), "model")    # rank 0 is elsewhere

    with pytest.raises(CollectiveTimeoutError, match=r"rank 1: all_reduce on axis `model`.*ranks \[0\] did not "
                                                     r"arrive \(rank 0 is waiting in all_gather on axis `data`\)"):
        SimWorld(Mesh(data=2, model=2), timeout=1).run(fn)


def test_recv_without_send_times_out():
    def fn(r):
        if r == 1:
            current().recv((2,), torch.float32, 0)

    with pytest.raises(CollectiveTimeoutError, match="recv from rank 0 on rank 1 waited 1 s"):
        SimWorld(Mesh(x=2), timeout=1).run(fn)


def test_mismatched_collectives_are_reported():
    def fn(r):
        if r == 0:
            current().all_reduce(torch.ones(2), "x")
        else:
            current().all_gather(torch.ones(2), "x", 0)

    with pytest.raises(AutoshardError, match=r"rank 0 called all_reduce\(shape \[2\], float32\), "
                                             r"rank 1 called all_gather\(shape \[2\], float32, dim=0\)"):
        run(Mesh(x=2), fn)


def test_mismatched_shapes_are_reported():
    with pytest.raises(RuntimeShapeError, match=r"rank 0 called all_reduce\(shape \[2\].*rank 1 called "
                                                r"all_reduce\(shape \[3\]"):
        run(Mesh(x=2), lambda r: current().all_reduce(torch.ones(2 + r), "x"))


def test_indivisible_split_is_reported():
    with pytest.raises(RuntimeShapeError, match="3 is not divisible by 2"):
        run(Mesh(x=2), lambda r: current().reduce_scatter(torch.ones(3, 4), "x", 0))


def test_bad_dim_is_reported():
    with pytest.raises(RuntimeShapeError, match=r"dim=2, but the tensor of rank \d has shape \[3, 4\]"):
        run(Mesh(x=2), lambda r: current().all_gather(torch.ones(3, 4), "x", 2))


def test_unknown_axis_is_reported():
    with pytest.raises(MeshError, match="has no axis `model`"):
        run(Mesh(x=2), lambda r: all_reduce(torch.ones(1), "model"))


def test_serial_world_runs_one_rank_at_a_time_and_hands_the_turn_over_in_collectives():
    world = SimWorld(Mesh(x=4), timeout=20, serial=True)
    inside = []
    overlap = []
    met = []
    lock = threading.Lock()
    # Ranks running side by side would all meet here: each reaches its first computation before any collective.
    # In a serial world the rank holding the turn waits alone until the bound breaks the barrier (once: every
    # later wait raises at once), so nobody ever passes it.
    everyone = threading.Barrier(4, timeout=0.5)

    def fn(r):
        for _ in range(3):
            with lock:
                inside.append(r)
                if len(inside) > 1:
                    overlap.append(list(inside))
            try:  # computing: no other rank may run meanwhile
                everyone.wait()
                met.append(r)
            except threading.BrokenBarrierError:
                pass
            with lock:
                inside.remove(r)
            x = all_reduce(torch.full((2,), float(r)), "x")  # waits: the turn passes on
        return x

    out = world.run(fn)
    assert not overlap and not met
    assert everyone.broken
    assert all(torch.equal(x, torch.full((2,), 6.0)) for x in out)


def test_serial_world_reports_a_failing_rank_without_hanging():
    world = SimWorld(Mesh(x=2), timeout=5, serial=True)

    def fn(r):
        if r == 1:
            raise ValueError("boom")
        return all_reduce(torch.ones(1), "x")

    with pytest.raises(ValueError, match="rank 1.*boom"):
        world.run(fn)
