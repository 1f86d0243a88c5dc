"""Gradient sync on or off for one forward/backward: ``no_sync()`` / ``set_requires_gradient_sync(False)``.

A ShardedModule runs each program call under :func:`syncing`. With sync off, the backward of that call reduces no
parameter gradient over the mesh: each rank keeps the sum of its own unreduced gradients, and the next backward
of a call made with sync on reduces that sum together with its own gradient, in the collectives it runs anyway —
so the gradients come out as syncing every micro-step would give them (up to the order of the float sums), with
one reduction per parameter (or bucket) per accumulation window instead of one per micro-step. Collectives on
activations (tensor parallelism's all-reduces of input gradients, sequence parallelism's reduce-scatters, the
loss's sum) and ZeRO-3's re-gathers of parameters run in every backward as before.

Where a parameter's gradient is reduced, and what is kept instead with sync off:

* **Buckets** (data parallel, :class:`~autoshard.runtime.buckets.GradBucketer`): the hook adds the parameter's
  local gradient to this rank's unsynced sum for it (a tensor of the parameter's local shape) and ``.grad`` is left
  as it was (what the last synced backward gave); a synced backward copies its gradient into the bucket and adds
  the unsynced sum before the all-reduce — a parameter with an unsynced sum but no gradient this time joins its
  bucket with the sum alone. The bucketer follows the flag of the module's latest forward made with grad enabled
  (DDP's ``require_backward_grad_sync`` is read in forward the same way).
* **Reductions in the program** (:func:`note_site` at the op's ``setup_context``, :func:`unsynced` in its
  backward): ``grad_all_reduce`` (ZeRO-1's all-reduce of a gathered parameter's gradient, and any other sum whose
  input is a parameter), ``all_gather_sync`` and ``all_gather_reshard`` (ZeRO-2/3's reduce-scatter of a
  parameter's gradient), ``all_gather_reshard_group`` (ZeRO-3 by layer). An op is such a *site* when each tensor
  it reduces the gradient of comes from one parameter through maps that are the same in every micro-step
  (views, transposes, casts, ``all_gather`` of a ZeRO-1 shard: :data:`STATIC_MAPS`), found by walking the
  input's autograd graph down to the parameter's ``AccumulateGrad``. With sync off the site adds its incoming
  gradient (the full, unreduced gradient of the gathered parameter: FSDP2's unsharded accumulation) to the sum
  held for it and returns no gradient (autograd hands the maps below it zeros, so the shard's ``.grad`` gets
  zeros added: it keeps what the last synced backward gave, or becomes zeros); with sync on it adds the held sum
  to its incoming gradient and reduces as always. A site is named by the op, its arguments, and per tensor the
  parameter, the maps and the gradient's shape and dtype: two uses of one parameter through the same maps share a
  sum (their reductions are the same linear map, so either may reduce it). The flag is the one the forward ran
  under (kept on the op's context, as its communicator is), whenever its backward runs. A synced backward that
  does not run through a site holding a sum (its loss does not depend on that parameter) leaves the sum held for
  the next synced backward that does, and warns, since ``.grad`` lacks it until then; the buckets have no such
  gap (a held sum joins its bucket with any synced backward).

What is not deferred: a sum over the data axis of an *activation* computed from a parameter — the position
embedding's rows looked up from a ZeRO-gathered table (``embedding(all_gather(wpe), arange)``) — runs in every
backward: the lookup between the sum and the parameter depends on its indices, which need not be the same in every
micro-step, so a held sum of rows could not be reduced into another micro-step's lookup. Its gradient is synced
as always; only the count of collectives is larger by that one all-reduce per micro-step. Nor are the sites
inside a rank program compiled with ``torch.compile`` (traced once, without autograd graphs to walk): they reduce
in every backward, while the buckets, outside the compiled program, still hold their sums.

The unsynced sums live on the module's bucketer (:attr:`GradBucketer.unsynced`, one per rank: the simulator's
ranks are threads, each with its own module); the flag of a forward reaches the ops through this thread's state,
set for the call by :func:`syncing`. ``zero_grad()`` does not clear them: they belong to the next synced backward,
as FSDP2's unsharded gradients do. Every rank runs the same program under the same flag (the call's agreement
check includes it), so the sites, and the collectives they run or skip, are the same on every rank.
"""

from __future__ import annotations

import threading
import warnings
from contextlib import contextmanager

import torch

from autoshard.errors import AutoshardError

__all__ = ["STATIC_MAPS", "Unsynced", "note_site", "parameter_of", "syncing", "unsynced"]

#: Autograd nodes whose backward is the same linear map in every micro-step (no saved activations): a gradient
#: may be held on their output side and pushed through them later. Anything else between a reduction and its
#: parameter (a lookup, a product with an activation) makes the op no site.
STATIC_MAPS = frozenset({
    "_LocalViewBackward",  # autoshard.runtime.parameters.bound: the program's view of a DTensor parameter
    "ViewBackward0", "UnsafeViewBackward0", "AliasBackward0", "TBackward0", "CloneBackward0",
    "ToCopyBackward0",  # a cast (mixed precision) or a device move
    "GeneratedBackwardFor_autoshard_all_gather_defaultBackward",  # ZeRO-1's gather of a shard: backward a slice
})
_ACCUMULATE = "torch::autograd::AccumulateGrad"
_MAX_DEPTH = 16

_LOCAL = threading.local()


class Unsynced:
    """This rank's gradients held unreduced until the next synced backward, by site (see the module docstring).

    ``held``: {site key: [held gradient or None, one per tensor of the site]}: plain tensors of the gradient's
    shape, summed in its dtype or float32 where that is wider (a bf16 compute copy's gradients add up in float32,
    and the synced backward reduces the sum in the gradient's own dtype, as it reduces its own gradient: ``dtypes``
    keeps that dtype per tensor)."""

    def __init__(self):
        self.held: dict[tuple, list[torch.Tensor | None]] = {}
        self.dtypes: dict[tuple, list[torch.dtype | None]] = {}
        self._checking = False  # a check of what a synced backward left held is queued

    def check_after_backward(self) -> None:
        """Queue, once per backward, a warning for the sums this (synced) backward leaves held."""
        if self._checking:
            return
        self._checking = True
        torch.autograd.Variable._execution_engine.queue_callback(self._check)

    def _check(self) -> None:
        self._checking = False
        if self.held:
            warnings.warn(f"a backward with gradient sync on did not reach {len(self.held)} place(s) where "
                          "parameter gradients were held under no_sync() / set_requires_gradient_sync(False) (its "
                          "loss does not depend on those parameters): their held gradients are not in .grad yet, "
                          "and are reduced by the next synced backward that reaches them.", stacklevel=1)

    def add(self, key: tuple, grads) -> None:
        """Add ``grads`` (None: nothing for that tensor) to the sums held for ``key``."""
        if key not in self.held:
            self.held[key], self.dtypes[key] = [None] * len(grads), [None] * len(grads)
        have, dtypes = self.held[key], self.dtypes[key]
        for i, g in enumerate(grads):
            if g is None:
                continue
            if have[i] is None:
                have[i], dtypes[i] = _accumulator(g), g.dtype
            else:
                have[i].add_(g)

    def take(self, key: tuple, grads) -> list[torch.Tensor | None]:
        """``grads`` (None: none for that tensor) with the sums held for ``key`` added (gone from here), each in
        the gradient's dtype."""
        held = self.held.pop(key, None)
        if held is None:
            return grads
        dtypes = self.dtypes.pop(key)
        return [g if h is None else h.to(dt) if g is None else (g + h).to(g.dtype)
                for g, h, dt in zip(grads, held, dtypes)]

    def __len__(self) -> int:
        return len(self.held)


def _accumulator(g: torch.Tensor) -> torch.Tensor:
    g = g.detach()
    if g.is_floating_point() and torch.finfo(g.dtype).bits < 32:
        return g.to(torch.float32)
    return g.clone()


@contextmanager
def syncing(enabled: bool, bucketer=None):
    """Run one program call's forward with parameter-gradient sync ``enabled`` (or not) for its backward.

    ``bucketer``: the module's :class:`~autoshard.runtime.buckets.GradBucketer`, which holds the unsynced sums;
    sync can only be turned off with one (a module with ``bucket_cap_mb=0`` reduces each gradient inside
    backward, and :class:`~autoshard.api.sharded_module.ShardedModule` refuses the flag there). Re-entrant per thread:
    an inner call runs under its own flag and restores the outer one."""
    if bucketer is None:
        if not enabled:
            raise AutoshardError("gradient sync cannot be turned off without a GradBucketer: the unsynced sums "
                                 "are kept on it. Leave bucket_cap_mb at its default (or > 0).")
        yield
        return
    was = bucketer.sync
    if torch.is_grad_enabled():
        bucketer.sync = enabled  # the buckets' flag for the backward of this forward
    outer = getattr(_LOCAL, "state", None)
    _LOCAL.state = (enabled, bucketer.unsynced)
    try:
        yield
    except BaseException:
        bucketer.sync = was  # a forward that failed (or was refused) has no backward: the flag stays the last one's
        raise
    finally:
        _LOCAL.state = outer


def parameter_of(t: torch.Tensor) -> tuple[torch.Tensor, tuple[str, ...]] | None:
    """The parameter ``t`` is computed from through :data:`STATIC_MAPS` alone, with the names of those maps from
    ``t`` down; None where ``t`` is anything else (an activation, a function of several tensors, an input that
    requires grad)."""
    node = t.grad_fn
    if node is None:
        return (t, ()) if isinstance(t, torch.nn.Parameter) and t.requires_grad else None
    chain = []
    for _ in range(_MAX_DEPTH):
        name = node.name()
        if name == _ACCUMULATE:
            return (node.variable, tuple(chain)) if isinstance(node.variable, torch.nn.Parameter) else None
        if name not in STATIC_MAPS:
            return None
        nexts = [f for f, _ in node.next_functions if f is not None]
        if len(nexts) != 1:
            return None
        chain.append(name)
        node = nexts[0]
    return None


def note_site(ctx, tensors, *signature) -> None:
    """At the ``setup_context`` of an op whose backward reduces the gradients of ``tensors``: note on ``ctx`` the
    flag this forward runs under and the site's key, when the op is a site (see the module docstring) and there is
    something to do — sync off, or sums held from earlier backwards. ``signature``: the op's name and the
    arguments its reduction depends on (hashable)."""
    ctx.unsynced = None
    state = getattr(_LOCAL, "state", None)
    if state is None or torch.compiler.is_compiling():
        return
    enabled, store = state
    if enabled and not store.held:
        return
    key = list(signature)
    for t in tensors:
        found = parameter_of(t)
        if found is None:
            return
        param, chain = found
        key.append((id(param), chain, tuple(t.shape), t.dtype))
    ctx.unsynced = (enabled, store, tuple(key))


def unsynced(ctx, grads: list) -> list | None:
    """In the backward of an op that :func:`note_site` noted: None when the forward ran with sync off (``grads``
    are now held, and the op returns no gradient for them); else ``grads`` with the sums held for the site added,
    for the op to reduce as always. ``grads``: the op's incoming gradients, one per tensor of the site (None
    allowed)."""
    site = getattr(ctx, "unsynced", None)
    if site is None:
        return grads
    enabled, store, key = site
    if not enabled:
        store.add(key, grads)
        return None
    store.check_after_backward()
    return store.take(key, grads)
