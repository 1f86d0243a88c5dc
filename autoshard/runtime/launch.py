"""Run a function on N fresh processes joined by ``torch.distributed`` on 127.0.0.1, bounded in time.

For tests, examples and ``autoshard run`` on one machine::

    def work(rank, world_size, x):          # module level: it is pickled into the children
        comm = DistCommunicator(Mesh(data=2, model=2))
        return comm.all_reduce(x, "model")

    results = spawn(work, 4, torch.ones(2))  # [tensor([2., 2.]), ...] in rank order

The parent hosts the rendezvous: a ``TCPStore`` it binds to port 0 (the kernel picks a free port and the store
holds it, so no other process can take it between choosing and binding, as it could with a port chosen first and
bound later by rank 0: concurrent test runs and gloo's own listening sockets draw from the same ephemeral range).
Each child (``multiprocessing`` *spawn* context by default, so scripts calling this need
``if __name__ == "__main__":``; *forkserver* on request) sets ``MASTER_ADDR=127.0.0.1`` and ``MASTER_PORT`` to the
store's port, runs with ``OMP_NUM_THREADS=1``, calls ``init_process_group(backend, rank, world_size,
timeout=timeout, store=...)`` on a client of that store, runs ``fn(rank, world_size, *args)``, and
sends back the result (pickled with tensors moved to CPU) or its traceback through its own pipe; it always
ends with :func:`autoshard.runtime.shutdown` (every process group destroyed before the interpreter exits). The parent
waits on every pipe at once:

* a child raises → the others are killed and the child's error is raised here with its traceback text (as the
  same :mod:`autoshard.errors` class when it was one, else :class:`~autoshard.errors.AutoshardError`);
* a child dies without a word (segfault, OOM kill) → the others are killed, ``AutoshardError`` with its exit code;
* nothing finished within ``timeout + startup_slack`` seconds → all are killed,
  :class:`~autoshard.errors.CollectiveTimeoutError`.

No child outlives :func:`spawn`: the parent kills stragglers in a ``finally``, and each child also exits on its
own when its parent disappears (a watchdog thread), so even a killed test run leaves no orphans.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import threading
import time
import traceback
from contextlib import contextmanager
from datetime import timedelta
from multiprocessing.connection import wait

import torch

from autoshard import errors
from autoshard.errors import AutoshardError, CollectiveTimeoutError

__all__ = ["free_port", "spawn"]

_env_lock = threading.Lock()
_GRACE = 1.0  # seconds to wait for the other ranks' errors once one rank has failed


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Imported by the forkserver before it forks the first child: the compiler and the model libraries the children
# of a test suite import, and what their first trace, plan search and pipeline import lazily (torch.export's
# tracer, the search's solvers, torch's pipelining): 14% of the children's CPU in two gloo tests before these were
# preloaded; multiprocessing skips a name that fails to import.
_PRELOAD = ("autoshard.api.sharded_module", "autoshard.api.entry", "autoshard.api.in_place", "autoshard.passes",
            "autoshard.passes.plan_search", "autoshard.compiler.plan", "torch.export._trace",
            "torch.distributed.pipelining", "torch.distributed.checkpoint", "transformers",
            "transformers.models.llama.modeling_llama")


def spawn(fn, world_size: int, *args, timeout: float = 120.0, backend: str = "gloo",
          startup_slack: float = 30.0, start_method: str = "spawn") -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes; return the results in rank order.

    ``timeout`` (seconds) is the process group's timeout and, with ``startup_slack`` for starting Python and
    importing torch in every child, the bound on the whole run. ``start_method="forkserver"`` forks the children
    from a server process that has imported torch and this module once (per calling process), which saves the
    import in every child: seconds per child on a small machine, so test suites with many spawns use it.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise AutoshardError(f"spawn got world_size={world_size!r}, but needs a positive int.")
    if start_method not in ("spawn", "forkserver"):
        raise AutoshardError(f"spawn got start_method={start_method!r}, but it is 'spawn' or 'forkserver'.")
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        pickle.dumps(fn)
    except Exception as e:  # noqa: BLE001 - any pickling failure means the same thing here
        raise AutoshardError(f"spawn needs a function defined at module level of an importable module (it is "
                             f"pickled into fresh processes), but {name} cannot be pickled: {e}") from None
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":  # what every child imports, imported once in the server (ignored if absent)
        ctx.set_forkserver_preload([__name__, *_PRELOAD])
    from torch.distributed import TCPStore

    # the parent hosts the store on a port the kernel picks at bind time: no window for another process to take it
    store = TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, timeout=timedelta(seconds=timeout),
                     wait_for_workers=False)
    port = store.port
    procs, conns = [], {}
    try:
        with _child_env(OMP_NUM_THREADS="1"):
            for rank in range(world_size):
                recv_end, send_end = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_child, name=f"autoshard-rank{rank}",
                                args=(fn, rank, world_size, args, port, backend, timeout, os.getpid(), send_end))
                p.start()
                send_end.close()  # the child's copy stays open; ours would hide the child's EOF
                procs.append(p)
                conns[recv_end] = rank
        return _collect(procs, conns, name, world_size, time.monotonic() + timeout + startup_slack,
                        timeout + startup_slack)
    finally:
        _kill(procs)
        for c in conns:
            c.close()
        del store  # after every child is gone: a live child may still read it


def _collect(procs, conns: dict, name: str, world_size: int, deadline: float, budget: float) -> list:
    results: dict[int, object] = {}
    failures: list[tuple[float, int, str, str]] = []  # (when raised, rank, class name, traceback)
    pending = dict(conns)
    while pending:
        left = deadline - time.monotonic()
        ready = wait(list(pending), timeout=left) if left > 0 else []
        if not ready:
            break
        for conn in ready:
            rank = pending.pop(conn)
            try:
                status, payload = conn.recv()
            except (EOFError, OSError):
                procs[rank].join(5)
                why = (f"exited with code {procs[rank].exitcode} without a result (killed by a signal, out of "
                       "memory, or os._exit)")
                failures.append((time.time(), rank, "", why))
                continue
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                failures.append((payload[2], rank, payload[0], payload[1]))
        if failures:
            # When one rank fails its peers soon fail too ("Connection reset by peer"): listen a moment longer
            # and report the failure that happened first, the cause.
            deadline = min(deadline, time.monotonic() + _GRACE)
            if not pending or time.monotonic() >= deadline:
                break
    if failures:
        _, rank, cls_name, text = min(failures)
        if not cls_name:
            raise AutoshardError(f"rank {rank} of {world_size} running {name} {text}; the other processes were "
                                 "killed.")
        cls = getattr(errors, cls_name, None)
        if not (isinstance(cls, type) and issubclass(cls, AutoshardError)):
            cls = AutoshardError
        raise cls(f"rank {rank} of {world_size} running {name} raised {cls_name}; the other processes were "
                  f"killed. Traceback of rank {rank}:\n{text}")
    if pending:
        missing = sorted(pending.values())
        raise CollectiveTimeoutError(f"spawn of {world_size} processes running {name} did not finish within "
                                     f"{budget:g} s: ranks {missing} had not returned (a collective hangs or a "
                                     "rank waits forever); all processes were killed.")
    return [results[r] for r in range(world_size)]


def _kill(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 5
    for p in procs:
        p.join(max(deadline - time.monotonic(), 0))
        if p.is_alive():
            p.kill()
            p.join()


@contextmanager
def _child_env(**values: str):
    """Set environment variables while children start (a spawned child copies the parent's environment)."""
    with _env_lock:
        old = {k: os.environ.get(k) for k in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _watch_parent(parent_pid: int) -> None:
    # Not os.getppid(): under forkserver the parent process is the server, not the caller of spawn.
    while True:
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            os._exit(3)
        except PermissionError:
            pass
        time.sleep(0.5)


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(_to_cpu(o) for o in obj)
    if isinstance(obj, dict) and type(obj) is dict:
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj


def _child(fn, rank, world_size, args, port, backend, timeout, parent_pid, conn) -> None:
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import torch.distributed as dist

    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout))
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout),
                                store=store)
        reply = ("ok", pickle.dumps(_to_cpu(fn(rank, world_size, *args))))
    except BaseException as e:  # noqa: BLE001 - the parent must hear about every failure
        reply = ("err", (type(e).__name__, traceback.format_exc(), time.time()))
    # Reply before tearing down the process group: the teardown makes the peers fail, and the parent ranks
    # failures by the time they happened.
    conn.send(reply)
    conn.close()
    from autoshard.runtime.dist import shutdown

    shutdown()
