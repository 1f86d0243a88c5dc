"""Mixed precision as the plan search prices it (:class:`ComputeCopies`): the program the ``mixed_precision`` and
``reduce_precision`` passes (after the search) make of a plan, so that the search's seconds and bytes of its plan
are ``plan.cost()``'s (``tests/test_search_memory_model.py``)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.fx

from autoshard import meta as M
from autoshard.cost_models.plan_cost import op_time
from autoshard.cost_models.profile import HardwareProfile
from autoshard.mesh import Mesh
from autoshard.placements import Spec

__all__ = ["ComputeCopies"]


@dataclass
class ComputeCopies:
    """Mixed precision as the search prices it (``precision=MixedPrecision(...)``; nothing without one). The
    ``mixed_precision`` pass (after the search) casts every floating parameter and input to ``param_dtype`` in the
    layout it lies in (:func:`autoshard.passes.mixed_precision.casts`), so the ops read, and the redistributions,
    ZeRO gathers and gradient syncs move, the ``param_dtype`` copy. Within :meth:`read` those values read
    (``meta["val"]``) as their copies, so the op, redistribution and gather prices are the compiled program's; the
    memory model is asked outside it (it counts the masters and their copies itself). A cast's own seconds
    (forward, and its gradient's cast back) are :meth:`cast_seconds`: ``op_time`` of such a cast node, as
    ``plan.cost()`` prices the compiled one; a sync in ``reduce_dtype`` bytes (:meth:`sync_size`) and the casts
    around it (:meth:`sync_casts`). Not priced: with ``reduce_dtype`` the masters' own dtype, the two casts
    ``reduce_precision`` puts around a sync that is not on the master itself (a pair of choices)."""

    values: dict  # cast value -> its param_dtype value
    precision: object  # autoshard.frontend.precision.MixedPrecision, or None
    profile: HardwareProfile
    mesh: Mesh
    _seconds: dict = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, gm, precision, profile: HardwareProfile, mesh: Mesh) -> ComputeCopies:
        if precision is None:
            return cls({}, None, profile, mesh)
        from torch._guards import detect_fake_mode

        from autoshard.passes.mixed_precision import casts
        from autoshard.frontend.precision import fake_like

        nodes = [n for n in gm.graph.nodes if casts(gm, n, precision.param_dtype)]
        mode = detect_fake_mode([n.meta["val"] for n in nodes])
        return cls({n: fake_like(n.meta["val"], precision.param_dtype, mode) for n in nodes}, precision, profile,
                   mesh)

    @contextmanager
    def read(self, nodes=None):
        """Within: ``nodes`` (default every cast value) that mixed precision casts read as their copies."""
        swapped = {n: self.values[n] for n in (self.values if nodes is None else nodes) if n in self.values}
        saved = {n: n.meta["val"] for n in swapped}
        try:
            for n, v in swapped.items():
                n.meta["val"] = v
            yield
        finally:
            for n, v in saved.items():
                n.meta["val"] = v

    def sync_size(self, u: torch.fx.Node) -> int | None:
        """Bytes per element of a cast parameter's gradient sync: ``reduce_dtype``'s (``reduce_precision``); None
        for any other value (its own)."""
        if u not in self.values:
            return None
        return self.precision.grad_reduce_dtype.itemsize

    def sync_casts(self, u: torch.fx.Node, spec: Spec) -> float:
        """Seconds of the two casts ``reduce_precision`` puts around a cast parameter's gradient sync in ``spec``
        when ``reduce_dtype`` is neither ``param_dtype`` nor the master's dtype (never on the master then); 0
        otherwise. (With ``reduce_dtype`` the master's, it casts around a sync only where the sync is not on the
        parameter's own cast: that pair of choices is not priced, 0.03-0.2% of GPT's and Llama's step at batch 64.)"""
        if u not in self.values:
            return 0.0
        low, reduce = self.values[u], self.precision.grad_reduce_dtype
        if reduce in (low.dtype, u.meta["val"].dtype):
            return 0.0
        from autoshard.frontend.precision import fake_like

        wide = fake_like(low, reduce)
        return self.cast_time(low, wide, True, spec) + self.cast_time(wide, low, True, spec)

    def cast_seconds(self, u: torch.fx.Node, spec: Spec | None) -> float:
        """Seconds of mixed precision's cast of ``u`` run in ``spec`` (0 for a value it does not cast)."""
        if u not in self.values or spec is None:
            return 0.0
        return self.cast_time(u.meta["val"], self.values[u], bool(u.meta.get(M.REQUIRES_GRAD)), spec)

    def cast_time(self, val, out, requires_grad: bool, spec: Spec) -> float:
        """``op_time`` of ``aten._to_copy`` from ``val`` to ``out``'s dtype in ``spec`` (same spec in and out, as
        the casting passes place it), cached by shape, dtypes and spec."""
        key = (tuple(val.shape), val.dtype, out.dtype, requires_grad, spec)
        if key not in self._seconds:
            g = torch.fx.Graph()
            x = g.placeholder("x")
            x.meta["val"] = val
            cast = g.call_function(torch.ops.aten._to_copy.default, (x,), {"dtype": out.dtype})
            cast.meta["val"], cast.meta[M.REQUIRES_GRAD] = out, requires_grad
            self._seconds[key] = op_time(cast, M.Strategy((spec,), spec, ((),)), self.mesh, self.profile)
        return self._seconds[key]
