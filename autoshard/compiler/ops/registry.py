"""The op registry: everything autoshard knows about one op, in one :class:`OpEntry`, registered by :func:`op`.

An entry has these facets (every one optional; :data:`DEFAULTS` says, once, what a facet that nobody stated is):

==================  ==========================================================================  =================
facet               meaning                                                                     default
==================  ==========================================================================  =================
``rule``            sharding rule, ``OpInfo -> DimMap`` (:mod:`autoshard.compiler.ops.dimmap`)  none: unsupported
``localize``        rank-local rewrite, :data:`Localizer` (``passes/localize.py`` calls it)     local = global
``flops``           forward FLOPs, ``Shapes -> number`` (a multiply-add counts 2)               :func:`elementwise`
``backward``        backward FLOPs / forward FLOPs                                              1.0
``backward_flops``  backward FLOPs when not ``backward × flops`` (embedding's scatter-add)      none
``bytes``           how bytes are counted: ``"io"`` (inputs + outputs), ``"view"`` (0),         ``"io"``
                    ``"embedding"`` (indices + 2·output)
``saves``           what autograd keeps for backward: positions of the args it saves (a list   ``()``: nothing
                    argument saves every tensor in it), :data:`OUTPUT` (its own outputs),
                    :data:`MASK` (a one-byte-per-element mask, dropout)
``comm``            seconds the op's *local form itself* communicates under a strategy (context-  none: 0
                    parallel attention passes K/V around the axis), ``(node, strategy, mesh,
                    profile, backward=True) -> seconds``, forward + backward (forward alone with
                    ``backward=False``: a recomputed region's); redistributions are priced apart
``workspace``       bytes one rank's op allocates besides its outputs under a strategy,         none: nothing
                    ``(node, strategy, mesh) -> Workspace``: ``kept`` (autograd keeps them for
                    backward, e.g. attention's float copy of a boolean mask) and ``transient``
                    (alive only while the op runs forward or backward, e.g. ring attention's
                    score blocks)
==================  ==========================================================================  =================

Keys are what an FX node's ``target`` is: an ``OpOverload`` (``aten.mm.default``), an ``OpOverloadPacket``
(``aten.mm``: every overload of the op) or a plain callable (``operator.getitem``, the MoE graph ops).
:func:`entry` resolves a target facet by facet: the overload's own entry, then its packet's, then
:data:`DEFAULTS`. So an op's cost, the same for every overload, is usually stated once on the packet, and the
rule and local form, which read one overload's arguments, on the overload; an op with one overload states all
its facets in one call::

    op(aten.mm.default, rule=einsum("mk,kn->mn"), flops=matmul_flops, backward=2.0, saves=(0, 1))

    @op(aten.transpose.int, flops=zero, bytes="view", backward=0.0, saves=())
    def _transpose(info: OpInfo) -> DimMap:   # used as a decorator, op() registers the function as the rule
        ...

``tests/test_op_registry.py`` checks that no entry lacks a facet it needs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any, Protocol

import torch

from autoshard.compiler.ops.dimmap import RuleFn

__all__ = ["DEFAULTS", "MASK", "OUTPUT", "Localizer", "OpEntry", "Shapes", "Workspace", "elementwise", "entry", "op",
           "registered", "rule_for", "stated", "unregister", "zero"]

#: ``localize(graph, new_node, old_node, mesh, rank) -> node``: rewrites the copied node ``new_node`` of the
#: rank-local graph (the global ``old_node`` carries the plan's meta: spec, strategy, global ``val``) and returns
#: the node that replaces it.
Localizer = Callable[[torch.fx.Graph, torch.fx.Node, torch.fx.Node, Any, int], torch.fx.Node]

#: In ``saves``: the op saves its own outputs (relu, softmax, attention).
OUTPUT = "output"
#: In ``saves``: the op saves a boolean mask the size of its output (dropout).
MASK = "mask"


class Shapes(Protocol):
    """What a FLOP formula may ask of a node (``cost_models.compute`` passes one; sizes may be sympy symbols)."""

    def arg(self, i: int, default=None): ...
    def shape(self, x) -> tuple: ...
    def numel(self, x) -> object: ...
    def out_numel(self) -> object: ...


FlopsFn = Callable[[Shapes], object]
#: ``comm(node, strategy, mesh, profile, backward=True) -> seconds`` (forward + backward; forward alone with
#: ``backward=False``) the local form communicates by itself
CommFn = Callable[..., float]


@dataclass(frozen=True)
class Workspace:
    """Bytes one rank's op allocates besides its outputs (the ``workspace`` facet).

    - ``kept``: what autograd keeps from the op's forward to its backward that is neither an argument nor an
      output of the node (those are the ``saves`` facet): attention's float copy of a boolean mask;
    - ``kept_key``: when not None, ops with the same key keep one storage between them (count ``kept`` once per
      key): every attention reading one boolean mask saves the same float copy (the rank program converts it once,
      :func:`autoshard.runtime.ops.additive_mask`);
    - ``transient``: the most the op holds at once while it runs, forward or backward, freed when it returns
      (ring attention's score blocks); the memory model adds it where the op runs, not to the whole step.
    """

    kept: int = 0
    transient: int = 0
    kept_key: object = None


#: ``workspace(node, strategy, mesh) -> Workspace`` of the op under ``strategy`` on one rank
WorkspaceFn = Callable[[Any, Any, Any], Workspace]
#: ``(node, strategy, mesh) -> float``: how many ways the strategy splits the op's work
SplitFn = Callable[[Any, Any, Any], float]


def elementwise(op: Shapes):
    """One FLOP per output element: the default for ops nobody priced."""
    return op.out_numel()


def zero(op: Shapes):
    """No arithmetic: views, copies, factories, lookups."""
    return 0


@dataclass(frozen=True)
class OpEntry:
    """Facets of one registry key; ``None`` means "not stated here" (see :func:`entry` for the fallbacks)."""

    rule: RuleFn | None = None
    localize: Localizer | None = None
    flops: FlopsFn | None = None
    backward: float | None = None
    backward_flops: FlopsFn | None = None
    bytes: str | None = None
    saves: tuple[int | str, ...] | None = None
    comm: CommFn | None = None
    workspace: WorkspaceFn | None = None
    #: what bounds the op's time, for the hardware profile's efficiency tables: "matmul", "attention" or "memory"
    compute_kind: str | None = None
    #: how many ways a strategy splits the op's work, where that is not the largest global/local size ratio of one
    #: of its operands (the default, :func:`autoshard.cost_models.plan_cost.shard_factor`): e.g. tokens split on one
    #: axis and the experts they run through on another
    split: SplitFn | None = None

    def stated(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


#: What an unstated facet is: no rule (an unsupported op), no local form, one FLOP per output element, backward
#: as costly as forward, bytes in + out, nothing saved, no workspace.
DEFAULTS = OpEntry(rule=None, localize=None, flops=elementwise, backward=1.0, backward_flops=None, bytes="io",
                   saves=(), comm=None, workspace=None, compute_kind="memory", split=None)

_REGISTRY: dict[object, OpEntry] = {}
_RESOLVED: dict[object, OpEntry] = {}  # entry()'s answers; cleared whenever the table changes
_BYTES = ("io", "view", "embedding")
_COMPUTE_KINDS = ("matmul", "attention", "memory")


def _check(target, e: OpEntry) -> None:
    if e.bytes is not None and e.bytes not in _BYTES:
        raise ValueError(f"op {target} has bytes={e.bytes!r}, but bytes is one of {_BYTES}")
    if e.compute_kind is not None and e.compute_kind not in _COMPUTE_KINDS:
        raise ValueError(f"op {target} has compute_kind={e.compute_kind!r}, but it is one of {_COMPUTE_KINDS}")
    if e.saves is not None and (not isinstance(e.saves, tuple)
                                or any(not (isinstance(s, int) or s in (OUTPUT, MASK)) for s in e.saves)):
        raise ValueError(f"op {target} has saves={e.saves!r}, but saves is a tuple of argument positions, "
                         "OUTPUT and MASK")
    if e.backward is not None and not (isinstance(e.backward, (int, float)) and e.backward >= 0):
        raise ValueError(f"op {target} has backward={e.backward!r}, but it is a ratio >= 0")


class _Registration:
    """What :func:`op` returns: used as a decorator, it makes the decorated function the targets' rule."""

    def __init__(self, targets: tuple):
        self.targets = targets

    def __call__(self, fn: RuleFn) -> RuleFn:
        for t in self.targets:
            if _REGISTRY[t].rule is not None:
                raise ValueError(f"op {t} already has a rule; decorate a function only when op() names none")
            _REGISTRY[t] = replace(_REGISTRY[t], rule=fn)
        _RESOLVED.clear()
        return fn


def op(*targets, rule: RuleFn | None = None, localize: Localizer | None = None, flops: FlopsFn | None = None,
       backward: float | None = None, backward_flops: FlopsFn | None = None, bytes: str | None = None,
       saves: tuple[int | str, ...] | None = None, comm: CommFn | None = None,
       workspace: WorkspaceFn | None = None, compute_kind: str | None = None,
       split: SplitFn | None = None) -> _Registration:
    """Register the given facets for each target (an OpOverload, an OpOverloadPacket or a callable).

    A target is registered once: a second ``op()`` for it raises (:func:`unregister` first to replace it).
    Used as a decorator, the decorated function becomes the rule."""
    if not targets:
        raise ValueError("op() needs at least one target")
    e = OpEntry(rule, localize, flops, backward, backward_flops, bytes, saves, comm, workspace, compute_kind, split)
    for t in targets:
        if t in _REGISTRY:
            raise ValueError(f"op {t} is registered twice; each op has one entry in autoshard/compiler/ops")
        _check(t, e)
    for t in targets:
        _REGISTRY[t] = e
    _RESOLVED.clear()
    return _Registration(targets)


def unregister(*targets) -> None:
    """Remove the entries of ``targets`` (tests registering toy ops undo it with this)."""
    for t in targets:
        _REGISTRY.pop(t, None)
    _RESOLVED.clear()


def _packet(target):
    return getattr(target, "overloadpacket", None)


def stated(target) -> OpEntry:
    """The facets stated for ``target`` (its own, then its packet's), without :data:`DEFAULTS`."""
    own = _REGISTRY.get(target, OpEntry())
    packet = _packet(target)
    if packet is None or packet not in _REGISTRY:
        return own
    return replace(_REGISTRY[packet], **own.stated())


def entry(target) -> OpEntry:
    """Every facet of ``target``: its own, else its packet's, else :data:`DEFAULTS`."""
    try:
        return _RESOLVED[target]
    except KeyError:
        pass
    except TypeError:  # an unhashable target is no op of the table
        return DEFAULTS
    resolved = _RESOLVED[target] = replace(DEFAULTS, **stated(target).stated())
    return resolved


def rule_for(target) -> RuleFn | None:
    """The sharding rule of ``target``; ``None`` for an op autoshard cannot shard."""
    return entry(target).rule


def registered() -> dict[object, OpEntry]:
    """A copy of the table: key → the facets stated under that key."""
    return dict(_REGISTRY)
