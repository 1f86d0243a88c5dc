"""The one exception hierarchy of autoshard.

Every error a user can cause is raised as a subclass of :class:`AutoshardError` with a message of the form
"<subject> has <actual>, but <expected>. <what to do>", naming the node, module path or option involved
(:func:`autoshard.frontend.graph_utils.node_location` words a node's place). A leaf: it imports nothing from autoshard.
"""

from __future__ import annotations


class AutoshardError(Exception):
    """Base class of every error autoshard raises on purpose."""


class TraceError(AutoshardError):
    """The model could not be captured as a graph with static shapes."""


class MeshError(AutoshardError):
    """The mesh is malformed or does not match the processes it runs on."""


class PlanError(AutoshardError):
    """An annotation or plan option is invalid (unknown parameter, bad placement, non-divisible dim...)."""


class UnsupportedOpError(AutoshardError):
    """An op in the graph has no sharding rule."""


class RuntimeShapeError(AutoshardError):
    """A call's inputs differ from the shapes the plan was compiled for."""


class CollectiveTimeoutError(AutoshardError):
    """A collective did not complete within the configured timeout (a peer died or hangs)."""


class PeerDiedError(CollectiveTimeoutError):
    """A collective could not complete because a peer's process died or left it (its connection closed): reported
    at once, not after a timeout. A subclass of :class:`CollectiveTimeoutError`, so handlers of a lost peer catch
    both."""


class CheckpointError(AutoshardError):
    """A checkpoint is missing, incomplete (no commit marker) or does not fit the model or optimizer loading it."""
