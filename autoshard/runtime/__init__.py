"""autoshard's runtime: what per-rank code needs to communicate, independent of the compiler.

* :mod:`.communicator` — the :class:`Communicator` interface, :func:`use` / :func:`current` (the communicator of the
  calling thread) and the :class:`CollectiveRecord` log;
* :mod:`.collective_ops` — autograd-aware collectives that generated rank modules call;
* :mod:`.sim` — :class:`SimWorld`, every rank in one process (one thread per rank);
* :mod:`.dist` — :class:`DistCommunicator` over ``torch.distributed`` (gloo, NCCL), and :func:`shutdown`, the
  clean end of a run (waits for in-flight collectives, destroys every process group);
* :mod:`.launch` — :func:`spawn`, N local processes with a process group, bounded in time.

Nothing here imports the compiler (``autoshard.passes``, codegen): the runtime only needs a :class:`Mesh`.
"""

from autoshard.runtime.collective_ops import (
    all_gather,
    all_reduce,
    all_to_all,
    collective_counts,
    grad_all_reduce,
    local_slice,
    reduce_scatter,
)
from autoshard.runtime.communicator import CollectiveRecord, Communicator, current, use
from autoshard.runtime.dist import DistCommunicator, shutdown
from autoshard.runtime.launch import spawn
from autoshard.runtime.sim import SimCommunicator, SimWorld

__all__ = [
    "CollectiveRecord",
    "Communicator",
    "DistCommunicator",
    "SimCommunicator",
    "SimWorld",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "collective_counts",
    "current",
    "grad_all_reduce",
    "local_slice",
    "reduce_scatter",
    "shutdown",
    "spawn",
    "use",
]
