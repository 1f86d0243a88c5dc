"""Gradient sync on or off for one forward/backward: ``no_sync()`` / ``set_requires_gradient_sync(False)``.

A ShardedModule runs each program call under :func:`syncing`; the parameter-gradient reductions of that call's
backward (the bucketer's all-reduces, ZeRO's reduce-scatters) follow the flag the forward ran under.
(Stub: the runtime side is being written; see tests/runtime/test_no_sync.py.)
"""

from __future__ import annotations

from contextlib import contextmanager

__all__ = ["syncing"]


@contextmanager
def syncing(enabled: bool, bucketer=None):
    """Run one program call's forward with parameter-gradient sync ``enabled`` (or not) for its backward."""
    yield
