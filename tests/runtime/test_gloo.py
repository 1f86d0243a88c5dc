"""Real torch.distributed processes (gloo on 127.0.0.1): the communicator agrees with the simulator and with sums
computed here, a collective mismatch between ranks is an error (never a wrong result), and spawn reports child
failures. Few: every spawn costs a few seconds of process start-up.

The workers are module-level functions, because spawn pickles them into fresh processes. The comparison runs
with the default start method (spawn); the failure tests fork from a forkserver that has imported torch once,
which saves seconds of import per child on a small machine.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from autoshard.errors import AutoshardError, CollectiveTimeoutError, MeshError
from autoshard.mesh import Mesh
from autoshard.runtime import (
    DistCommunicator,
    SimWorld,
    all_gather,
    all_reduce,
    all_to_all,
    current,
    grad_all_reduce,
    local_slice,
    reduce_scatter,
    spawn,
    use,
)

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available")

MESH = Mesh(data=2, model=2)


def _input(rank: int, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    return torch.randint(-20, 20, shape, generator=g).float()


def program(rank: int) -> dict:
    """Every collective, raw and autograd (forward and backward), under the current communicator."""
    comm = current()
    x = _input(rank, (4, 4))
    out = {
        "all_reduce": comm.all_reduce(x, "model"),
        "all_gather": comm.all_gather(x, "data", 1),
        "reduce_scatter": comm.reduce_scatter(x, "model", 1),
        "all_to_all": comm.all_to_all(x, "data", 0, 1),
        "broadcast": comm.broadcast(x, "data", src=1),
        "all_reduce_i64": comm.all_reduce(x.long(), "data"),
    }
    leaf = x.clone().requires_grad_()
    y = grad_all_reduce(leaf, ("data", "model"))
    y = reduce_scatter(y * (rank + 1), "model", 0)
    y = all_to_all(y, "data", 1, 0)
    y = all_gather(y, "data", 0)
    y = local_slice(y, "model", 1)
    y = all_reduce(y, "data")
    (y * _input(10 + rank, y.shape)).sum().backward()
    out["autograd_out"] = y.detach()
    out["autograd_grad"] = leaf.grad
    out["log"] = [(r.kind, r.axis, r.numel, r.phase) for r in comm.log]
    return out


def gloo_program(rank: int, world_size: int) -> dict:
    results = {}
    for label, native in (("native", None), ("emulated", ())):  # gloo's tensor-form collectives, and the fallbacks
        comm = DistCommunicator(MESH, timeout=30, native_ops=native)
        with use(comm):
            results[label] = program(rank)
        results[label + "_ops"] = sorted(comm.native_ops)
    with use(DistCommunicator(MESH, device_mesh=MESH.to_device_mesh("cpu"))):
        results["device_mesh"] = program(rank)
    return results


@pytest.mark.gloo
def test_gloo_matches_simulator_forward_and_backward():
    expected = SimWorld(MESH, timeout=30).run(program)
    got = spawn(gloo_program, MESH.size, timeout=60)
    assert got[0]["native_ops"] == ["all_gather", "all_to_all", "reduce_scatter"]
    assert got[0]["emulated_ops"] == []
    for r in range(MESH.size):
        for label in ("native", "emulated", "device_mesh"):
            ours = got[r][label]
            assert ours.keys() == expected[r].keys()
            for key, value in expected[r].items():
                if isinstance(value, torch.Tensor):
                    assert ours[key].dtype == value.dtype, (r, label, key)
                    assert torch.equal(ours[key], value), (r, label, key)
                else:
                    assert ours[key] == value, (r, label, key)  # the log: same logical collectives


def two_rank_program(rank: int, world_size: int) -> dict:
    """Every collective over a 2-rank axis, of random floats, integers and booleans, along dim 0 and another dim;
    all-reduces blocking (also of a non-contiguous tensor), in place, and async with a blocking one started while
    they are in flight; a point-to-point transfer each way."""
    comm = DistCommunicator(Mesh(x=2), timeout=30)
    g = torch.Generator().manual_seed(rank)
    sums = [torch.randn(n, generator=g) for n in (1, 1000, 3 << 18)]
    sums += [torch.randn(64, 32, generator=g).double(), torch.randint(-9, 9, (100,), generator=g),
             torch.randn(70, 30, generator=g).t()]
    out = {"inputs": sums, "copies": [comm.all_reduce(t, "x") for t in sums]}
    inplace = [t.contiguous().clone() for t in sums]
    for t in inplace:
        comm.all_reduce_(t, "x")
    out["inplace"] = inplace
    handles = [comm.all_reduce_async(t.contiguous().clone(), "x") for t in sums]
    out["between"] = comm.all_reduce(sums[1], "x")  # blocking, while the async ones are in flight
    out["async"] = [h.wait() for h in handles]
    moved = [torch.randn(6, 4, generator=g), torch.randint(-9, 9, (8, 6), generator=g),
             torch.randint(0, 2, (4, 2), generator=g).bool()]
    out["moved_inputs"] = moved
    out["moved"] = []
    for t in moved:
        res = [comm.all_gather(t, "x", 0), comm.all_gather(t, "x", 1)]
        res += [comm.all_to_all(t, "x", 0, 1), comm.all_to_all(t, "x", 1, 0)]
        if t.dtype != torch.bool:
            res += [comm.reduce_scatter(t, "x", 0), comm.reduce_scatter(t, "x", 1)]
        out["moved"].append(res)
    if rank == 0:
        comm.send(moved[0] * 3, 1)
        out["received"] = comm.recv((4,), torch.int64, 1)
    else:
        out["received"] = comm.recv((6, 4), torch.float32, 0)
        comm.send(torch.arange(4), 0)
    out["log"] = [(r.kind, r.axis, r.numel) for r in comm.log]
    return out


@pytest.mark.gloo
def test_two_rank_collectives_on_gloo_equal_the_sums_and_pieces_of_both_ranks():
    got = spawn(two_rank_program, 2, timeout=60)
    for r in range(2):
        for name in ("copies", "inplace", "async"):
            for a, b, total in zip(got[0]["inputs"], got[1]["inputs"], got[r][name]):
                expected = a + b
                assert total.dtype == expected.dtype and total.shape == expected.shape
                assert torch.equal(total, expected), (r, name)  # one IEEE addition per element
            for x, y in zip(got[0][name], got[1][name]):
                assert torch.equal(x, y), name  # both ranks hold the same sum, bit for bit
        assert torch.equal(got[r]["between"], got[0]["inputs"][1] + got[1]["inputs"][1])
        for i, res in enumerate(got[r]["moved"]):
            a, b = got[0]["moved_inputs"][i], got[1]["moved_inputs"][i]
            mine = (a, b)[r]
            expected = [torch.cat([a, b], 0), torch.cat([a, b], 1),
                        torch.cat([a.chunk(2, 0)[r], b.chunk(2, 0)[r]], 1),
                        torch.cat([a.chunk(2, 1)[r], b.chunk(2, 1)[r]], 0)]
            if mine.dtype != torch.bool:
                expected += [(a + b).chunk(2, 0)[r], (a + b).chunk(2, 1)[r]]
            assert len(res) == len(expected)
            for ours, theirs in zip(res, expected):
                assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), (r, i)
    assert torch.equal(got[1]["received"], got[0]["moved_inputs"][0] * 3)
    assert torch.equal(got[0]["received"], torch.arange(4))
    kinds = [k for k, _, _ in got[0]["log"]]
    assert kinds.count("all_reduce") == 3 * 6 + 1 and kinds.count("send") == kinds.count("recv") == 1


def mismatched_all_reduce(rank: int, world_size: int):
    comm = DistCommunicator(Mesh(x=2), timeout=30)
    return comm.all_reduce(torch.ones(100 if rank == 0 else 200), "x")


@pytest.mark.gloo
def test_mismatched_all_reduces_fail_instead_of_returning_sums():
    """Two ranks all-reduce 100 and 200 elements: gloo detects it (its enforce aborts the receiving rank), so no
    rank returns a sum of the wrong size or of garbage."""
    with pytest.raises(AutoshardError, match=r"rank \d of 2 running mismatched_all_reduce (raised|exited with code)"):
        spawn(mismatched_all_reduce, 2, timeout=30, start_method="forkserver")
    assert multiprocessing.active_children() == []


def wrong_mesh_on_rank_1(rank: int, world_size: int):
    if rank == 1:
        DistCommunicator(MESH)  # 4 ranks on a world of 2: MeshError
    dist.barrier()  # rank 0 would wait forever: spawn must kill it


def _store() -> dist.TCPStore:
    """A client of the store spawn hosts (its address is in this child's environment)."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=300))


def skips_a_collective(rank: int, world_size: int):
    dist.barrier()  # arrive together: creating the groups is bounded by the same 1 s timeout
    comm = DistCommunicator(Mesh(x=2), timeout=1)
    store = _store()
    if rank == 0:
        try:
            comm.all_reduce(torch.ones(1), "x")
        finally:
            store.set("rank 0 left its all_reduce", "")
    else:
        # alive, sockets open, never in the all_reduce, until rank 0 has left it (had rank 1 exited first, rank 0
        # would see a closed connection, not a timeout)
        store.wait(["rank 0 left its all_reduce"])


def hangs(rank: int, world_size: int):
    """Never returns, as a hung rank does: waits for an event nobody sets until spawn kills the process. (The bound
    only turns a spawn that never kills it into this error, which fails the test, instead of a hang.)"""
    threading.Event().wait(timeout=300)
    raise AssertionError("spawn never killed this rank")


@pytest.mark.gloo
def test_spawn_propagates_a_child_exception_and_kills_the_others():
    """The error of rank 1 (not rank 0's later "connection reset") comes back with its class and traceback."""
    with pytest.raises(MeshError, match=r"(?s)^rank 1 of 2 running wrong_mesh_on_rank_1 raised MeshError.*"
                                        r"Traceback.*in wrong_mesh_on_rank_1.*mesh Mesh\(data=2, model=2\) has 4 "
                                        r"ranks, but the process group has world size 2: launch 4 processes"):
        spawn(wrong_mesh_on_rank_1, 2, timeout=30, start_method="forkserver")
    assert multiprocessing.active_children() == []


@pytest.mark.gloo
def test_gloo_collective_timeout_becomes_collective_timeout_error():
    with pytest.raises(CollectiveTimeoutError, match=r"(?s)all_reduce on axis `x` \(group of ranks \[0, 1\]\) did "
                                                     r"not complete within 1 s on rank 0"):
        spawn(skips_a_collective, 2, timeout=30, start_method="forkserver")
    assert multiprocessing.active_children() == []


@pytest.mark.gloo
def test_spawn_kills_everything_past_its_deadline():
    # the child never returns by itself: only spawn's deadline ends it, with this error
    with pytest.raises(CollectiveTimeoutError, match=r"ranks \[0\] had not returned"):
        spawn(hangs, 1, timeout=1, startup_slack=1, start_method="forkserver")
    assert multiprocessing.active_children() == []


def test_spawn_rejects_functions_it_cannot_pickle():
    with pytest.raises(AutoshardError, match="defined at module level"):
        spawn(lambda rank, world_size: None, 2)
