"""The simulator changes the process only while a simulated run is in progress (autoshard/runtime/sim_threads.py):
its lock is the library's hook (``RANK_THREADS``) and DTensor's propagation lock, and each rank thread has its own
``torch.distributed`` world; before and after a run — and in every process of a real job, which never simulates —
the hook takes no lock and torch is as it was."""
import threading

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor._sharding_prop import ShardingPropagator

from autoshard import Mesh
from autoshard.runtime import sim_threads
from autoshard.runtime.communicator import current
from autoshard.runtime.sim import SimWorld
from autoshard.runtime.torch_state import RANK_THREADS


def _process_state():
    """What a simulated run may change, as seen from the calling thread."""
    return (RANK_THREADS.lock, ShardingPropagator._fake_mode_lock, torch.autograd.is_multithreading_enabled(),
            dist.distributed_c10d._world, dist.is_initialized())


def _inside(rank):
    """What a rank thread sees during the run."""
    held = RANK_THREADS.lock
    with RANK_THREADS.exclusive():  # re-entrant, as a pass that traces again needs
        with RANK_THREADS.exclusive():
            pass
    world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else None
    return held, ShardingPropagator._fake_mode_lock, world


def test_outside_a_run_the_hook_takes_no_lock_and_torch_is_untouched():
    before = _process_state()
    assert before[0] is None  # every process of a real job: no lock, nothing patched
    with RANK_THREADS.exclusive():  # a no-op context
        pass
    results = SimWorld(Mesh(data=2)).run(_inside)
    assert results == [(sim_threads.LOCK, sim_threads.LOCK, (r, 2)) for r in range(2)]
    after = _process_state()
    assert after[0] is None and after[1] is before[1] and after[2] == before[2]
    assert after[3] is before[3] and after[4] is False  # the process's own c10d world again, no group in it


def test_a_serial_run_has_the_lock_but_no_process_groups():
    before = _process_state()
    results = SimWorld(Mesh(data=2), serial=True).run(_inside)
    assert results == [(sim_threads.LOCK, sim_threads.LOCK, None)] * 2
    assert _process_state() == before


def test_a_failed_run_puts_the_process_back():
    before = _process_state()

    def fail(rank):
        if rank == 1:
            raise ValueError("boom")
        current().barrier()  # rank 0 waits for rank 1, which never comes: the abort wakes it

    with pytest.raises(ValueError, match="boom"):
        SimWorld(Mesh(data=2), timeout=30).run(fail)
    assert _process_state() == before
    assert SimWorld(Mesh(data=2)).run(_inside)[1][2] == (1, 2)  # and the next run works


def test_overlapping_runs_share_the_setup_until_the_last_ends():
    before = _process_state()
    first_in = threading.Event()
    second_done = threading.Event()
    out = {}

    def first(rank):
        first_in.set()
        assert second_done.wait(60)
        return _inside(rank)  # still set up: the second run ended, this one did not

    def run_first():
        out["first"] = SimWorld(Mesh(data=2)).run(first)

    t = threading.Thread(target=run_first)
    t.start()
    assert first_in.wait(60)
    out["second"] = SimWorld(Mesh(model=2)).run(_inside)
    second_done.set()
    t.join(60)
    assert out["second"] == [(sim_threads.LOCK, sim_threads.LOCK, (r, 2)) for r in range(2)]
    assert out["first"] == [(sim_threads.LOCK, sim_threads.LOCK, (r, 2)) for r in range(2)]
    assert _process_state() == before
