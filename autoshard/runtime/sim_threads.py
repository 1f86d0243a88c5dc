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
  process-group registry is made per thread for the run as well (``_set_thread_isolation_mode``);
* per-thread ``torch.compiler.is_compiling()`` and ``is_exporting()`` (every run): torch keeps the flags they
  read (``torch.compiler._is_compiling_flag``, ``_is_exporting_flag``) in one process-wide slot, set for the length
  of a ``torch.export`` (``torch._export.utils._compiling_state_context``) or of a dynamo compile
  (``torch.compiler._compile_session_context``). One rank thread's trace would make every other rank thread, running
  its program meanwhile, answer "compiling": torch's own code takes its compile-time paths there, and an in-place
  sharded model (``autoshard.shard``) takes the call for a ``torch.compile(model)``'s and compiles its rank programs
  with dynamo's default backend — concurrently with that trace, in a world that is not serial (dynamo fails there:
  ``InternalTorchDynamoError``). For the run each thread has its own flags: the module's class gets properties that
  keep them per thread (what export's ``torch.compiler._is_compiling_flag = ...`` writes), the two functions read
  them through those (their code replaced; the function objects, which dynamo folds to constants while it traces,
  stay the same), and the compile session sets its thread's flag only.

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

import torch

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
        _enter("all", _install_for_every_run)
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
        try:
            install(_undo[kind])
        except BaseException:
            _undo[kind].close()  # what was installed before the failure
            raise
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


def _install_for_every_run(undo: contextlib.ExitStack) -> None:
    _install_lock(undo)
    _install_compile_flags_per_thread(undo)


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


#: torch.compiler's flags kept per thread during a run (see the module docstring).
_COMPILE_FLAGS = ("_is_compiling_flag", "_is_exporting_flag")


class _ThreadFlags(threading.local):
    """The compile flags of one thread; a thread starts with the values the process had when the run began."""

    def __init__(self, initial: dict) -> None:
        self.__dict__.update(initial)


def _install_compile_flags_per_thread(undo: contextlib.ExitStack) -> None:
    import torch.compiler as compiler

    readers = ((compiler.is_compiling, _is_compiling), (compiler.is_exporting, _is_exporting))
    if any(name not in vars(compiler) for name in _COMPILE_FLAGS) or \
            any(fn.__code__.co_names != _TORCH_READS[fn.__name__] for fn, _ in readers) or \
            not hasattr(compiler, "_compile_session_context"):
        raise RuntimeError("this torch's torch.compiler keeps its compile flags otherwise than the simulator knows: "
                           "simulated ranks cannot keep them per thread; use the torch version pyproject.toml pins.")
    flags = _ThreadFlags({name: vars(compiler)[name] for name in _COMPILE_FLAGS})

    def per_thread(name: str) -> property:
        return property(lambda module: getattr(flags, name), lambda module, value: setattr(flags, name, value),
                        doc=f"torch.compiler.{name}, per thread for the length of a simulated run")

    original = type(compiler)
    compiler.__class__ = type("CompileFlagsPerThread", (original,), {n: per_thread(n) for n in _COMPILE_FLAGS})
    undo.callback(setattr, compiler, "__class__", original)
    for fn, replacement in readers:
        undo.callback(setattr, fn, "__code__", fn.__code__)
        fn.__code__ = replacement.__code__  # the same function object: dynamo still knows it
    undo.callback(setattr, compiler, "_compile_session_context", compiler._compile_session_context)
    compiler._compile_session_context = _compile_session


#: the globals torch's readers read in the version pinned (checked before their code is replaced)
_TORCH_READS = {"is_compiling": ("torch", "jit", "is_scripting", "_is_compiling_flag"),
                "is_exporting": ("_is_exporting_flag",)}


# The code of torch.compiler.is_compiling and is_exporting during a run. It runs as those functions, in
# torch.compiler's namespace (whose global ``torch`` it reads): the flag is read as the module's attribute, which
# the run's module class answers for the calling thread.
def _is_compiling() -> bool:
    if torch.jit.is_scripting():
        return False
    return torch.compiler._is_compiling_flag


def _is_exporting() -> bool:
    return torch.compiler._is_exporting_flag


@contextlib.contextmanager
def _compile_session() -> Iterator[None]:
    """torch.compiler._compile_session_context for the run: the compiling thread's flag, not the process's."""
    import torch.compiler as compiler

    old = compiler._is_compiling_flag
    compiler._is_compiling_flag = True
    try:
        yield
    finally:
        compiler._is_compiling_flag = old
