"""What autoshard knows about each op, one registry entry per op: sharding rule, local form, FLOPs, saved bytes.

Layout:

* :mod:`~autoshard.compiler.ops.registry`: :class:`OpEntry` (the facets), :func:`op` (the one way to register them),
  :data:`DEFAULTS` (what an unstated facet is, written once), :func:`entry` / :func:`rule_for` (lookup: the
  ``OpOverload``'s own facets, then its ``OpOverloadPacket``'s, then the defaults);
* :mod:`~autoshard.compiler.ops.dimmap`: the rule vocabulary (import builders from there) (:class:`DimMap`,
  :class:`OpInfo`, ``einsum``, ``pointwise``, view groups, reductions) — pure functions of shapes;
* :mod:`~autoshard.compiler.ops.local`: helpers the local forms share;
* one module per op family, each stating every facet of its ops together: pointwise (with copies and casts),
  matmul, views, reductions, norms (with softmax), attention, losses, embedding, indexing, conv, factories,
  dropout, moe.

Adding an op touches its family module only (or, for an op of your own, one :func:`op` call anywhere imported
before compiling), e.g.::

    op(aten.mm.default, rule=einsum("mk,kn->mn"), flops=matmul_flops, backward=2.0, saves=(0, 1))

Why a package and not one table: the facets of an op depend on each other (a rule that names a ``bias`` input
needs a local form; an op that writes a shape into the program needs one too; a contraction's rule, FLOPs and
saved operands are read off the same einsum), so they sit side by side in the op's family, and
``tests/test_op_registry.py`` checks the dependencies. Consumers read facets only through :func:`entry`:
propagation the rule, ``passes/localize.py`` the local form, ``cost_models`` the FLOPs, bytes and saves — none
of them keeps a table of its own.
"""

from autoshard.compiler.ops import (  # noqa: F401  (each family registers its ops on import)
    attention,
    context,
    conv,
    dropout,
    embedding,
    factories,
    hf_moe,
    indexing,
    losses,
    matmul,
    moe,
    norms,
    pointwise,
    reductions,
    views,
)
from autoshard.compiler.ops.dimmap import DimMap, Labels, OpInfo, RuleFn, replicate_only
from autoshard.compiler.ops.registry import (
    DEFAULTS,
    MASK,
    OUTPUT,
    Localizer,
    OpEntry,
    Workspace,
    elementwise,
    entry,
    op,
    registered,
    rule_for,
    stated,
    unregister,
    zero,
)

__all__ = ["DEFAULTS", "MASK", "OUTPUT", "DimMap", "Labels", "Localizer", "OpEntry", "OpInfo", "RuleFn",
           "Workspace", "elementwise", "entry", "op", "registered", "replicate_only", "rule_for", "stated",
           "unregister", "zero"]
