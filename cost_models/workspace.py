"""What ops allocate besides their outputs, per rank, read from the op registry's ``workspace`` facet
(:class:`autoshard.compiler.ops.Workspace`), for the memory model (:mod:`.memory`):

- **kept** bytes live like an activation, from the op's forward to its backward: one storage per ``kept_key``
  (every attention reading one boolean mask keeps the same float copy), alive until the backward of the earliest
  op keeping it (:func:`kept_workspace`);
- **transient** bytes live only while the op runs, so they belong to the liveness point where it runs, on top of
  what is alive there — not to the whole step (:func:`transient_workspace`): a ring attention's score blocks at
  sequence 4096 are as large as its saved activations, but never alive together with the logits' gradient.

The functions take the plan's annotated global graph (``autoshard.strategy`` on every op) and price each op under
its chosen strategy at local sizes.
"""

from __future__ import annotations

from collections.abc import Callable

from torch.fx import Node

from autoshard import meta as M
from autoshard.compiler.ops import Workspace, entry

__all__ = ["kept_workspace", "op_workspace", "transient_workspace"]


def op_workspace(node: Node, mesh, strategy=None) -> Workspace:
    """The ``workspace`` facet of ``node``'s op under ``strategy`` (default: its chosen one); nothing for ops
    without one."""
    strategy = strategy if strategy is not None else node.meta.get(M.STRATEGY)
    if node.op != "call_function" or strategy is None:
        return Workspace()
    fn = entry(node.target).workspace
    return Workspace() if fn is None else fn(node, strategy, mesh)


def kept_workspace(gm, mesh, order: Callable[[Node], int]) -> list[tuple[int, Node]]:
    """``(bytes, first keeper)`` per storage the graph's ops keep for backward besides their outputs: one entry per
    ``kept_key`` (else per op), its first keeper the op earliest in ``order`` (the storage lives until that op's
    backward)."""
    found: dict[object, tuple[int, Node]] = {}
    for n in gm.graph.nodes:
        w = op_workspace(n, mesh)
        if not w.kept:
            continue
        key = w.kept_key if w.kept_key is not None else n
        size, first = found.get(key, (0, n))
        found[key] = (max(size, w.kept), first if order(first) <= order(n) else n)
    return list(found.values())


def transient_workspace(gm, mesh) -> list[tuple[int, Node]]:
    """``(bytes, op)`` for every op of the graph that holds transient bytes while it runs."""
    out = []
    for n in gm.graph.nodes:
        w = op_workspace(n, mesh)
        if w.transient:
            out.append((w.transient, n))
    return out
