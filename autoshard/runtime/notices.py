"""What autoshard tells the user while it plans and runs: once per job, from rank 0.

Every rank of a job plans the same plan (rank 0 decides, the others replay its decisions), so every rank would
emit the same planning warnings; a job of 8 ranks printed each one 8 times. :func:`notice` emits a warning on rank 0
only (the rank of the calling thread's communicator, else of ``torch.distributed``, else 0: a process that is not
part of a job is rank 0). A sharded module plans again for the other training mode and for new input shapes; it
plans under :func:`said_once`, so a message one of its plans gave already is not given again.
"""

from __future__ import annotations

import threading
import warnings
from contextlib import contextmanager

__all__ = ["notice", "said_once", "this_rank"]

_LOCAL = threading.local()


@contextmanager
def said_once(said: set):
    """Within the block, :func:`notice` gives a message only if it is not in ``said`` (and adds it)."""
    stack = _LOCAL.__dict__.setdefault("said", [])
    stack.append(said)
    try:
        yield
    finally:
        stack.pop()


def this_rank() -> int:
    """The rank the calling thread runs: its communicator's (a simulator rank thread, a ShardedModule call), else
    ``torch.distributed``'s, else 0."""
    from autoshard.errors import AutoshardError
    from autoshard.runtime.communicator import current

    try:
        return current().rank
    except AutoshardError:
        pass
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0


def notice(message: str, stacklevel: int = 3) -> None:
    """``warnings.warn(message)`` (a UserWarning) on rank 0 only, and once per :func:`said_once` scope."""
    stack = getattr(_LOCAL, "said", None)
    if stack:
        if message in stack[-1]:
            return
        stack[-1].add(message)
    if this_rank() == 0:
        warnings.warn(message, stacklevel=stacklevel)
