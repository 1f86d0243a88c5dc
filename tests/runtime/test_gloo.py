"""Real torch.distributed processes (gloo on 127.0.0.1): the communicator agrees with the simulator, and
spawn reports child failures. Few and fast: every spawn costs a few seconds of process start-up.

The workers are module-level functions, because spawn pickles them into fresh processes. The comparison runs
with the default start method (spawn); the failure tests fork from a forkserver that has imported torch once,
which saves seconds of import per child on a small machine.
"""

from __future__ import annotations

import multiprocessing
import time

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
    for label, native in (("native", None), ("emulated", ())):  # gloo's own collectives
        comm = DistCommunicator(MESH, timeout=30, native_ops=native, shared_memory=False)
        with use(comm):
            results[label] = program(rank)
        results[label + "_ops"] = sorted(comm.native_ops)
    for label, flags in (("shared_flags", True), ("shared_tokens", False)):  # both axes are pairs of one host
        comm = DistCommunicator(MESH, timeout=30)
        for pair in comm._shared.values():
            pair.flags = flags
        with use(comm):
            results[label] = program(rank)
        results[label + "_calls"] = sum(pair.calls for pair in comm._shared.values())
    with use(DistCommunicator(MESH, device_mesh=MESH.to_device_mesh("cpu"))):
        results["device_mesh"] = program(rank)
    return results


@pytest.mark.gloo
def test_gloo_matches_simulator_forward_and_backward():
    expected = SimWorld(MESH, timeout=30).run(program)
    got = spawn(gloo_program, MESH.size, timeout=60)
    assert got[0]["native_ops"] == ["all_gather", "all_to_all", "reduce_scatter"]
    assert got[0]["emulated_ops"] == []
    # with flags every collective but the broadcast goes through shared memory (tokens: none is over 512 KiB)
    assert got[0]["shared_flags_calls"] > 10 and got[0]["shared_tokens_calls"] == 0
    for r in range(MESH.size):
        for label in ("native", "emulated", "shared_flags", "shared_tokens", "device_mesh"):
            ours = got[r][label]
            assert ours.keys() == expected[r].keys()
            for key, value in expected[r].items():
                if isinstance(value, torch.Tensor):
                    assert ours[key].dtype == value.dtype, (r, label, key)
                    assert torch.equal(ours[key], value), (r, label, key)
                else:
                    assert ours[key] == value, (r, label, key)  # the log: same logical collectives


def pair_exchange_program(rank: int, world_size: int) -> dict:
    """All-reduces over a 2-rank axis through shared memory synchronised by flags (in chunks of 1 MiB) and by
    token messages, by exchange with shared memory off, and by gloo (both off): blocking (also of a
    non-contiguous tensor), in place and async with blocking ones started while they are in flight."""
    from autoshard.runtime.dist import PAIR_EXCHANGE_MAX_BYTES

    mesh = Mesh(x=2)
    flags, tokens = DistCommunicator(mesh, timeout=30), DistCommunicator(mesh, timeout=30)
    flags._shared["x"].flags, flags._shared["x"].chunk_bytes = True, 1 << 20  # the 3 MiB tensor: 3 chunks
    tokens._shared["x"].flags = False
    exchange_only = DistCommunicator(mesh, timeout=30, shared_memory=False)
    plain = DistCommunicator(mesh, timeout=30, pair_exchange=False)
    g = torch.Generator().manual_seed(rank)
    tensors = [torch.randn(n, generator=g) for n in (1, 1000, PAIR_EXCHANGE_MAX_BYTES // 4, 3 << 18)]
    tensors += [torch.randn(64, 32, generator=g).double(), torch.randint(-9, 9, (100,), generator=g)]
    tensors += [torch.randn(700, 300, generator=g).t(), torch.randint(-9, 9, (1 << 17,), generator=g)]
    comms = {"flags": flags, "tokens": tokens, "exchange_only": exchange_only, "plain": plain}
    out = {"routes": {label: [comm._route(t, "x") for t in tensors] for label, comm in comms.items()},
           "in_flight": {label: [comm._route(t, "x", in_flight=True) for t in tensors] for label, comm in comms.items()}}
    for label, comm in comms.items():
        copies = [comm.all_reduce(t, "x") for t in tensors]
        inplace = [t.contiguous().clone() for t in tensors]
        for t in inplace:
            comm.all_reduce_(t, "x")
        handles = [comm.all_reduce_async(t.contiguous().clone(), "x") for t in tensors]
        between = comm.all_reduce(tensors[1], "x")  # blocking, while the async ones are in flight
        out[label] = (copies, inplace, [h.wait() for h in handles], between)
    out["shared"] = {label: (comms[label]._shared["x"].failed, comms[label]._shared["x"].calls,
                             comms[label]._shared["x"].slot_bytes) for label in ("flags", "tokens")}
    return out


@pytest.mark.gloo
def test_two_rank_all_reduce_by_exchange_and_shared_memory_equals_gloo_bit_for_bit():
    got = spawn(pair_exchange_program, 2, timeout=60)
    sh, ex, gr, side = "shared", "exchange", "group", "side"
    assert got[0]["routes"] == {
        "flags": [sh] * 8,  # flags cost microseconds: every size goes through shared memory
        "tokens": [ex, ex, sh, sh, ex, ex, sh, sh],  # a token message costs as much as an exchange up to 512 KiB
        "exchange_only": [ex, ex, ex, gr, ex, ex, gr, ex],  # the exchange up to 1 MiB, contiguous only
        "plain": [gr] * 8,
    }
    # in flight: on gloo up to 4 KiB with flags (the loss), up to 512 KiB with tokens
    assert got[0]["in_flight"] == {"flags": [side, side, sh, sh, sh, side, gr, sh],
                                   "tokens": [side, side, sh, sh, side, side, gr, sh],
                                   "exchange_only": [side, side, side, gr, side, side, gr, side], "plain": [gr] * 8}
    # flags: 10 chunks blocking, 10 in place, 7 async (the 3 MiB one in 3 chunks each), 1 between, in 1 MiB
    # slots; tokens: the 4 tensors over 512 KiB blocking, in place and async, in the 3 MiB one's slots
    assert got[0]["shared"] == got[1]["shared"] == {"flags": (None, 28, 1 << 20), "tokens": (None, 12, 3 << 20)}
    for r in range(2):
        for label in ("flags", "tokens", "exchange_only"):
            for ours, plain in zip(got[r][label], got[r]["plain"]):
                for a, b in zip(ours if isinstance(ours, list) else [ours], plain if isinstance(plain, list) else [plain]):
                    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    for a, b in zip(got[0]["flags"][0], got[1]["flags"][0]):
        assert torch.equal(a, b)  # both ranks hold the same sum


def pair_collectives_program(rank: int, world_size: int) -> dict:
    """all_gather, reduce_scatter and all_to_all over a 2-rank axis, through shared memory (in 1 MiB chunks) and
    by gloo, along dim 0 and another dim, of random floats (bit for bit), integers and booleans."""
    mesh = Mesh(x=2)
    shared, plain = DistCommunicator(mesh, timeout=30), DistCommunicator(mesh, timeout=30, shared_memory=False)
    shared._shared["x"].flags, shared._shared["x"].chunk_bytes = True, 1 << 20
    g = torch.Generator().manual_seed(rank)
    tensors = [torch.randn(6, 4, generator=g), torch.randn(4, 300, 500, generator=g),  # 2.4 MB: 3 chunks
               torch.randint(-9, 9, (8, 6), generator=g), torch.randint(0, 2, (4, 2), generator=g).bool()]
    out = {}
    for label, comm in (("shared", shared), ("plain", plain)):
        res = []
        for t in tensors:
            res += [comm.all_gather(t, "x", 0), comm.all_gather(t, "x", 1)]
            res += [comm.all_to_all(t, "x", 0, 1), comm.all_to_all(t, "x", 1, 0)]
            if t.dtype != torch.bool:
                res += [comm.reduce_scatter(t, "x", 0), comm.reduce_scatter(t, "x", 1)]
        out[label] = res
    out["calls"] = shared._shared["x"].calls
    return out


@pytest.mark.gloo
def test_two_rank_gather_scatter_and_all_to_all_through_shared_memory_equal_gloo():
    got = spawn(pair_collectives_program, 2, timeout=60)
    # per tensor 6 collectives (4 for the booleans), the large one's sends in chunks: all_gather 2.4 MB,
    # all_to_all and reduce_scatter 1.2 MB each (2 chunks)
    assert got[0]["calls"] == got[1]["calls"] == 6 + (3 + 3 + 2 + 2 + 2 + 2) + 6 + 4
    for r in range(2):
        assert len(got[r]["shared"]) == len(got[r]["plain"]) == 22
        for a, b in zip(got[r]["shared"], got[r]["plain"]):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def shared_memory_fallback_program(rank: int, world_size: int, failing_rank: int) -> dict:
    """One rank cannot use /dev/shm (rank 0: cannot create the file; rank 1: cannot open rank 0's)."""
    import glob
    import os

    import autoshard.runtime.shm as shm

    if rank == failing_rank:
        shm.SHM_DIR = "/nonexistent-autoshard-shm"
    comm, plain = DistCommunicator(Mesh(x=2), timeout=30), DistCommunicator(Mesh(x=2), timeout=30, pair_exchange=False)
    g = torch.Generator().manual_seed(rank)
    tensors = [torch.randn(n, generator=g) for n in (1 << 19, 3 << 16, 100)]  # 2 MiB, 768 KiB, 400 B
    out = {"routes": [comm._route(t, "x") for t in tensors]}
    out["sums"] = [comm.all_reduce(t, "x") for t in tensors]
    out["expected"] = [plain.all_reduce(t, "x") for t in tensors]
    out["routes_after"] = [comm._route(t, "x") for t in tensors]
    out["failed"] = comm._shared["x"].failed
    comm.barrier()
    out["left"] = glob.glob(os.path.join("/dev/shm", f"autoshard-{os.getpid()}-*"))
    return out


@pytest.mark.gloo
@pytest.mark.parametrize("failing_rank", [0, 1])
def test_shared_memory_that_fails_on_one_rank_falls_back_on_both(failing_rank):
    from autoshard.runtime.shm import FLAGS_SYNC

    got = spawn(shared_memory_fallback_program, 2, failing_rank, timeout=60)
    for r in range(2):
        first = ["shared"] * 3 if FLAGS_SYNC else ["shared", "shared", "exchange"]
        assert got[r]["routes"] == first
        assert got[r]["routes_after"] == ["group", "exchange", "exchange"]  # the exchange up to 1 MiB
        for a, b in zip(got[r]["sums"], got[r]["expected"]):
            assert torch.equal(a, b)
        assert got[r]["left"] == []
    assert "nonexistent-autoshard-shm" in got[failing_rank]["failed"]
    assert got[1 - failing_rank]["failed"] == "the peer rank could not share memory with this one"


def wrong_mesh_on_rank_1(rank: int, world_size: int):
    if rank == 1:
        DistCommunicator(MESH)  # 4 ranks on a world of 2: MeshError
    dist.barrier()  # rank 0 would wait forever: spawn must kill it


def skips_a_collective(rank: int, world_size: int):
    dist.barrier()  # arrive together: creating the groups is bounded by the same 1 s timeout
    comm = DistCommunicator(Mesh(x=2), timeout=1)
    if rank == 0:
        comm.all_reduce(torch.ones(1), "x")
    else:
        time.sleep(30)


def sleeps(rank: int, world_size: int):
    time.sleep(60)


@pytest.mark.gloo
def test_spawn_propagates_a_child_exception_and_kills_the_others():
    """The error of rank 1 (not rank 0's later "connection reset") comes back with its class and traceback."""
    start = time.monotonic()
    with pytest.raises(MeshError, match=r"(?s)^rank 1 of 2 running wrong_mesh_on_rank_1 raised MeshError.*"
                                        r"Traceback.*in wrong_mesh_on_rank_1.*mesh Mesh\(data=2, model=2\) has 4 "
                                        r"ranks, but the process group has world size 2: launch 4 processes"):
        spawn(wrong_mesh_on_rank_1, 2, timeout=30, start_method="forkserver")
    assert time.monotonic() - start < 25
    assert multiprocessing.active_children() == []


@pytest.mark.gloo
def test_gloo_collective_timeout_becomes_collective_timeout_error():
    with pytest.raises(CollectiveTimeoutError, match=r"(?s)all_reduce on axis `x` \(group of ranks \[0, 1\]\) did "
                                                     r"not complete within 1 s on rank 0"):
        spawn(skips_a_collective, 2, timeout=30, start_method="forkserver")
    assert multiprocessing.active_children() == []


@pytest.mark.gloo
def test_spawn_kills_everything_past_its_deadline():
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match=r"ranks \[0\] had not returned"):
        spawn(sleeps, 1, timeout=1, startup_slack=1, start_method="forkserver")
    assert time.monotonic() - start < 10
    assert multiprocessing.active_children() == []


def test_spawn_rejects_functions_it_cannot_pickle():
    with pytest.raises(AutoshardError, match="defined at module level"):
        spawn(lambda rank, world_size: None, 2)


def _waiting_pair(peer_pid: int, timeout: float):
    """A SharedMemoryPair whose peer never writes its flag (an anonymous mapping stands for the shared one)."""
    import mmap

    from autoshard.runtime.shm import SharedMemoryPair

    pair = SharedMemoryPair(group=None, peer=1, first=True, next_tag=lambda: 0, flags=True, timeout=timeout)
    pair._map, pair._peer_pid = mmap.mmap(-1, 4096), peer_pid
    return pair


def test_shared_memory_wait_on_an_exited_peer_says_so():
    import subprocess

    from autoshard.runtime.shm import PeerExitedError

    child = subprocess.Popen(["true"])
    child.wait()  # exited and reaped: its pid is gone
    start = time.monotonic()
    with pytest.raises(PeerExitedError, match=rf"peer rank 1 \(pid {child.pid}\) exited during shared-memory "
                                              r"all-reduce #0"):
        _waiting_pair(child.pid, timeout=30)._meet(0)
    assert time.monotonic() - start < 5


def test_shared_memory_wait_times_out():
    import os

    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^timed out after 0.3 s waiting for rank 1's signal of shared-memory "
                                           r"all-reduce #3$"):
        _waiting_pair(os.getpid(), timeout=0.3)._meet(3)  # a live "peer" that never arrives
    assert 0.3 <= time.monotonic() - start < 5
