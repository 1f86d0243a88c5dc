"""Collective communication time by the alpha-beta model, as sympy formulas.

A collective over a group of ``n`` ranks, on a link of latency ``alpha`` (seconds per message step) and inverse
bandwidth ``beta`` (seconds per byte), costs ``steps·alpha + wire·beta`` where ``wire`` is the number of bytes
each rank sends (bandwidth-optimal ring algorithms). ``b`` is the size in bytes of the largest buffer a rank
holds in the collective: the whole tensor for all_reduce, the gathered output of all_gather, the unscattered
input of reduce_scatter, the (equal) input and output buffers of all_to_all, the message of send_recv.

=================  ======================  =====================
kind               wire bytes per rank     steps (alpha terms)
=================  ======================  =====================
all_reduce         2·(n-1)/n·b             2·(n-1)
all_gather         (n-1)/n·b               n-1
reduce_scatter     (n-1)/n·b               n-1
all_to_all         (n-1)/n·b               n-1
send_recv          b                       1
local_slice        0                       0
grad_all_reduce    as all_reduce           as all_reduce
=================  ======================  =====================

so, e.g., ``COLLECTIVE_TIME["all_reduce"] == 2*(n-1)/n*b*beta + 2*(n-1)*alpha``.

Why ``2·(n-1)`` latency terms for all_reduce where DESIGN.md writes ``(n-1)·alpha``: a ring all-reduce is a
reduce-scatter followed by an all-gather, ``n-1`` dependent message steps each, and every step pays the latency.
all_to_all is priced as the pairwise exchange (``n-1`` rounds, each rank sending ``b/n`` per round).
``local_slice`` (taking one's shard of a replicated tensor) moves nothing. ``send_recv`` is a pipeline transfer
between two ranks; ``n`` is not used in its formula.

Every kind costs 0 when ``n == 1`` (the formulas vanish there, and :func:`collective_time` returns 0.0 for
``send_recv`` to oneself too).

:func:`collective_time` evaluates the formulas with plain floats: each is turned into a Python function once with
``sympy.lambdify`` and cached, so the planner may call it many thousands of times.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import sympy

from autoshard.errors import PlanError

from .profile import LinkCost

__all__ = [
    "BYTES_ON_WIRE",
    "COLLECTIVE_TIME",
    "KINDS",
    "STEPS",
    "alpha",
    "b",
    "beta",
    "collective_bytes_on_wire",
    "collective_time",
    "model_coefficients",
    "n",
    "time_expr",
]

b, n, alpha, beta = sympy.symbols("b n alpha beta", positive=True)
_B, _N = b, n  # for functions whose parameters are named b/n after the formulas' symbols

#: Bytes each rank sends, per kind.
BYTES_ON_WIRE: dict[str, sympy.Expr] = {
    "all_reduce": 2 * (n - 1) / n * b,
    "all_gather": (n - 1) / n * b,
    "reduce_scatter": (n - 1) / n * b,
    "all_to_all": (n - 1) / n * b,
    "send_recv": b,
    "local_slice": sympy.Integer(0),
}
BYTES_ON_WIRE["grad_all_reduce"] = BYTES_ON_WIRE["all_reduce"]

#: Dependent message steps, each paying the latency ``alpha``, per kind.
STEPS: dict[str, sympy.Expr] = {
    "all_reduce": 2 * (n - 1),
    "all_gather": n - 1,
    "reduce_scatter": n - 1,
    "all_to_all": n - 1,
    "send_recv": sympy.Integer(1),
    "local_slice": sympy.Integer(0),
}
STEPS["grad_all_reduce"] = STEPS["all_reduce"]

#: Time in seconds of each kind: ``steps·alpha + wire·beta``.
COLLECTIVE_TIME: dict[str, sympy.Expr] = {k: STEPS[k] * alpha + BYTES_ON_WIRE[k] * beta for k in BYTES_ON_WIRE}

KINDS: tuple[str, ...] = tuple(COLLECTIVE_TIME)


def _check_kind(kind: str) -> None:
    if kind not in COLLECTIVE_TIME:
        raise PlanError(f"Collective kind {kind!r} has no cost formula; the kinds are {list(KINDS)}.")


def time_expr(kind: str, nbytes=b, group_size=n, link_alpha=alpha, link_beta=beta) -> sympy.Expr:
    """The time formula of ``kind`` with ``b``, ``n``, ``alpha``, ``beta`` replaced by the given values or
    expressions (e.g. ``nbytes=4*B*S*H`` from shape symbols); the bare formula when called with the kind only."""
    _check_kind(kind)
    return COLLECTIVE_TIME[kind].subs({b: nbytes, n: group_size, alpha: link_alpha, beta: link_beta},
                                      simultaneous=True)


@functools.cache
def _numeric(table: str, kind: str) -> Callable[..., float]:
    expr = (COLLECTIVE_TIME if table == "time" else BYTES_ON_WIRE)[kind]
    return sympy.lambdify((b, n, alpha, beta), expr, modules="math")


def collective_time(kind: str, nbytes: float, n: int, link: LinkCost) -> float:
    """Seconds for collective ``kind`` moving ``nbytes`` (see the module docstring for what ``b`` is) within a
    group of ``n`` ranks over ``link`` (its per-kind link for ``kind`` where it has one: :meth:`LinkCost.for_kind`). 0.0
    when ``n <= 1`` or ``nbytes == 0``."""
    _check_kind(kind)
    if n <= 1 or nbytes <= 0:
        return 0.0
    link = link.for_kind(kind)  # the link as measured for this collective, where the profile has that
    return float(_numeric("time", kind)(nbytes, n, link.alpha, link.beta))


def collective_bytes_on_wire(kind: str, nbytes=b, n=n):
    """Bytes each rank sends for ``kind``: a float when ``nbytes`` and ``n`` are numbers, otherwise the sympy
    expression (``collective_bytes_on_wire("all_gather")`` is the formula itself)."""
    _check_kind(kind)
    if isinstance(nbytes, sympy.Basic) or isinstance(n, sympy.Basic):
        return BYTES_ON_WIRE[kind].subs({_B: nbytes, _N: n}, simultaneous=True)
    if n <= 1 or nbytes <= 0:
        return 0.0
    return float(_numeric("wire", kind)(nbytes, n, 0.0, 0.0))


def model_coefficients(kind: str, group_size: int) -> tuple[float, float]:
    """``(steps, wire bytes per byte of b)`` of ``kind`` for a group of ``group_size`` ranks, so that
    ``time = steps·alpha + wire_per_byte·b·beta``; calibration divides these out of a fitted line."""
    _check_kind(kind)
    subs = {n: group_size}
    return float(STEPS[kind].subs(subs)), float((BYTES_ON_WIRE[kind] / b).subs(subs))
