"""What the simulator changes in this process while a simulated run is in progress, and nothing outside one.

:class:`~autoshard.runtime.sim.SimWorld` runs every rank of a mesh as a thread. For the length of a run
(:func:`simulated_run`, entered by :meth:`SimWorld.run` around starting and joining its rank threads) it installs:

* its lock, :data:`LOCK` (re-entrant), as the library's hook for work on torch's process-wide state
  (:data:`autoshard.runtime.torch_state.RANK_THREADS`), and as the lock DTensor's sharding propagation holds while
  it runs an op on FakeTensors (``ShardingPropagator._fake_mode_lock``, a ``nullcontext`` by default: the place
  torch leaves for multi-threaded use, which torch's own threaded DTensor tests set and restore the same way), so a
  rank running DTensor ops never breaks another rank's trace;
* per-thread ``torch.distributed`` worlds (not in serial runs, nor where the caller's thread already has a real
  process group): torch's threaded process group, ``torch.testing._internal.distributed.multi_threaded_pg``, what
  PyTorch's own DTensor tests run on — the default group, group registry and ranks become per thread, collectives
  meet in shared memory, and autograd's device threads are off (backward runs on the rank's thread); c10d's
  process-group registry is made per thread for the run as well (``_set_thread_isolation_mode``).

Each is put back as it was when the last run in progress ends (runs may overlap: a count). A process that never
simulates, such as every process of a torchrun job, is never changed.

Why torch's testing module, and only here: torch.distributed has one world per process — one default group
(``init_process_group`` in a second thread of the process fails: both threads write the one default-group slot
and its store barrier), ``get_rank()`` answers for the process, and DTensor finds its groups by name in a
process-wide registry. A ``ProcessGroupGloo`` per thread over one ``HashStore`` (public) runs plain collectives, but
``DeviceMesh.from_group`` and ``new_group`` need groups registered in that one world (``new_group`` needs the
default group; an unregistered group is refused), and registering a group, or giving a thread its own rank, is
private API (``distributed_c10d._world``, ``_register_process_group``, ``DeviceMesh(_rank=...)``). The threaded group
is the one implementation torch ships of "a rank per thread", so the simulator uses it, from this module alone
(tests/test_architecture.py allows ``torch.testing`` nowhere else in the library).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from autoshard.runtime.torch_state import RANK_THREADS

__all__ = ["LOCK", "simulated_run"]

#: The simulator's lock: held by a rank thread for tracing, planning, building its program, initialising and
#: checkpoint I/O (through :data:`RANK_THREADS`) and by DTensor's sharding propagation on FakeTensors.
LOCK = threading.RLock()

_state_lock = threading.Lock()
_runs = {"all": 0, "threaded": 0}  # runs in progress, and those of them with threaded process groups
_undo = {"all": contextlib.ExitStack(), "threaded": contextlib.ExitStack()}  # what puts each back


@contextlib.contextmanager
def simulated_run(process_groups: bool) -> Iterator[object | None]:
    """The process set up for one simulated run; yields the store of the run's threaded process groups (a fresh
    ``HashStore``: rank threads call ``init_process_group("threaded", rank, world_size, store=...)``), or None
    where the run has none (``process_groups`` false: a serial run, whose turn-taking the threaded group's blocking
    collectives would deadlock; or torch.distributed unavailable, or a real process group already initialised in
    the calling thread, which the per-thread worlds would hide)."""
    with _state_lock:
        threaded = process_groups and _can_thread_groups()
        _enter("all", _install_lock)
        if threaded:
            try:
                _enter("threaded", _install_threaded_groups)
            except BaseException:
                _leave("all")
                raise
    try:
        if threaded:
            import torch.distributed as dist

            yield dist.HashStore()
        else:
            yield None
    finally:
        with _state_lock:
            if threaded:
                _leave("threaded")
            _leave("all")


def _enter(kind: str, install) -> None:
    if _runs[kind] == 0:
        install(_undo[kind])
    _runs[kind] += 1


def _leave(kind: str) -> None:
    _runs[kind] -= 1
    if _runs[kind] == 0:
        _undo[kind].close()  # in reverse order of installing


def _can_thread_groups() -> bool:
    import torch.distributed as dist

    if not dist.is_available():
        return False
    # with the per-thread worlds in place, the caller's world is its own thread's
    return _runs["threaded"] > 0 or not dist.is_initialized()


def _install_lock(undo: contextlib.ExitStack) -> None:
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    if not hasattr(ShardingPropagator, "_fake_mode_lock"):
        raise RuntimeError("this torch has no ShardingPropagator._fake_mode_lock: simulated ranks cannot run DTensor "
                           "ops beside a trace safely; use the torch version pyproject.toml pins.")
    undo.enter_context(RANK_THREADS.installed(LOCK))
    undo.callback(setattr, ShardingPropagator, "_fake_mode_lock", ShardingPropagator._fake_mode_lock)
    ShardingPropagator._fake_mode_lock = LOCK


def _install_threaded_groups(undo: contextlib.ExitStack) -> None:
    import torch
    from torch.testing._internal.distributed import multi_threaded_pg  # registers the "threaded" backend

    multi_threaded_pg.ProcessLocalGroup.reset()  # no collective left over from an earlier run that failed
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    undo.callback(torch._C._distributed_c10d._set_thread_isolation_mode, False)
    multi_threaded_pg._install_threaded_pg()  # per-thread worlds; autograd's device threads off
    undo.callback(multi_threaded_pg._uninstall_threaded_pg)  # the process's own world back, autograd as it was
