"""The one hook through which a process that runs several ranks as threads (the simulator) serialises autoshard's
work on torch's process-wide state.

A process of a real job (torchrun, :func:`autoshard.runtime.spawn`) is one rank: nothing here does anything there.
The simulator (:mod:`autoshard.runtime.sim`) runs every rank as a thread of one process, and some work must then not
interleave between ranks:

* tracing (torch.export, ``strict=False``): it traces at the ``PreDispatch`` key, whose mode slots live in one
  process-global object, not per thread; a rank that traces while another runs a DTensor op (whose sharding
  propagation empties and refills those slots) loses its proxy mode ("Trying to pop empty mode stack");
* the passes and the rank programs of a plan: every graph traced from one model shares its fake mode, and a rank
  program's copy shares the plan's FakeTensors;
* initialising a meta-built model (:mod:`autoshard.api.materialize`): transformers patches ``torch.nn.init``
  process-wide while it initialises, and the skeleton, which simulated ranks share, gets temporaries meanwhile;
* reading and writing a checkpoint without a process group (DCP's ``no_dist`` path).

The library wraps each in ``with RANK_THREADS.exclusive():``. Outside a simulated run that is a no-op (no lock is
taken, as none is needed); :class:`~autoshard.runtime.sim.SimWorld` installs its lock for the duration of a run
(:meth:`RankThreads.installed`) and restores what was there when the run ends. The lock must be re-entrant (a pass
may trace again), and no work under it communicates, so ranks cannot deadlock on it.
"""
from __future__ import annotations

import contextlib
import threading
from typing import ContextManager, Iterator

__all__ = ["RANK_THREADS", "RankThreads"]


class RankThreads:
    """Where the library asks for exclusive use of torch's process-wide state (:meth:`exclusive`), and where a
    process running ranks as threads supplies the lock that gives it (:meth:`installed`). One instance:
    :data:`RANK_THREADS`."""

    def __init__(self) -> None:
        self._lock: ContextManager | None = None
        self._guard = threading.Lock()

    @property
    def lock(self) -> ContextManager | None:
        """The lock installed now (None: ranks are processes; :meth:`exclusive` takes nothing)."""
        return self._lock

    def exclusive(self) -> ContextManager:
        """The installed lock, held for the ``with`` block; a no-op context when none is installed."""
        lock = self._lock
        return lock if lock is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def installed(self, lock: ContextManager) -> Iterator[None]:
        """Make ``lock`` (re-entrant: a ``threading.RLock``) what :meth:`exclusive` takes inside the ``with`` block;
        the lock installed before is restored after it. For whoever owns the rank threads (the simulator), set once
        around a run."""
        with self._guard:
            before, self._lock = self._lock, lock
        try:
            yield
        finally:
            with self._guard:
                self._lock = before


#: The hook (see the module docstring).
RANK_THREADS = RankThreads()
