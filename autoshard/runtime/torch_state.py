"""The one lock around torch's process-wide tracing state, for processes that run ranks as threads.

torch.export (strict=False) traces at the ``PreDispatch`` key, whose mode slots live in one process-global object
(``torch._ops._mode_stack_state_for_pre_dispatch``), not per thread. DTensor's sharding propagation, on a cache miss,
runs the op on FakeTensors under ``disable_proxy_modes_tracing()``, which empties and refills those slots. A simulated
rank (a thread) that runs a DTensor op while another rank traces therefore takes the tracer's proxy mode away from
it ("Trying to pop empty mode stack", "ProxyTorchDispatchMode slot already occupied", or a DTensor op traced into
the other rank's graph). Every graph traced from one model also shares its fake mode.

:data:`GRAPH_LOCK` serialises both: autoshard traces, runs its passes and builds rank programs under it, and
:func:`serialize_dtensor_propagation` makes DTensor's meta propagation take it too (the hook torch provides for
multi-threaded use, ``ShardingPropagator._fake_mode_lock``). Neither side communicates while holding it, so ranks
cannot deadlock on it. One process per rank (torchrun) never contends for it.
"""
from __future__ import annotations

import threading

# Re-entrant: a pass may trace again, and a DTensor op inside a locked compile takes it again.
GRAPH_LOCK = threading.RLock()


def serialize_dtensor_propagation() -> None:
    """Make DTensor's sharding propagation hold :data:`GRAPH_LOCK` while it runs an op on FakeTensors."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    if not hasattr(ShardingPropagator, "_fake_mode_lock"):
        raise RuntimeError("this torch has no ShardingPropagator._fake_mode_lock: simulated ranks cannot run DTensor "
                           "ops beside a trace safely; use the torch version pyproject.toml pins.")
    ShardingPropagator._fake_mode_lock = GRAPH_LOCK
