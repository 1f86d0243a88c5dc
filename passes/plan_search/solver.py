"""The LP relaxation of a program kept inside HiGHS (the ``highspy`` package), re-solved for many objectives from
the previous basis.

The Lagrangian walk (:mod:`.lagrangian`) and :func:`.lagrangian.lp_bound` solve the same rows for many objectives
``c + λ·mem``: :class:`WarmLP` passes the program to a ``highspy.Highs`` object once and changes only the column
costs, so each new λ starts from the last optimal basis (a few simplex pivots instead of a solve from scratch).
:func:`.ilp.solve_program` serves every solve that needs no warm start (its own HiGHS object, :mod:`.highs`).

HiGHS's clock counts every run of an object: :meth:`WarmLP.solve` sets each run's time limit from the time already
spent, so a limit is seconds for this solve.
"""

from __future__ import annotations

import logging

import highspy
import numpy as np
from autoshard.passes.plan_search.highs import highs_with
from autoshard.passes.plan_search.ilp import Program

logger = logging.getLogger(__name__)


class WarmLP:
    """The LP relaxation of one program inside a ``highspy.Highs`` object."""

    def __init__(self, highs: highspy.Highs, n: int):
        self.highs, self.n = highs, n
        self.columns = np.arange(n, dtype=np.int32)

    @classmethod
    def create(cls, prog: Program) -> WarmLP:
        highs = highs_with(prog.a, prog.lo, prog.hi, prog.c * 1e9)  # nanoseconds, as ilp.solve_program
        n = prog.a.shape[1]
        return cls(highs, n)

    def solve(self, cost: np.ndarray, time_limit: float) -> np.ndarray | None:
        """The LP optimum for the column costs ``cost`` (seconds), or None when HiGHS did not reach it within
        ``time_limit`` seconds of this solve."""
        self.highs.changeColsCost(self.n, self.columns, cost * 1e9)
        started = self.highs.getRunTime()
        self.highs.setOptionValue("time_limit", float(self.highs.getRunTime() + time_limit))
        self.highs.run()
        status = self.highs.getModelStatus()
        logger.debug("warm LP: %s after %d simplex iterations, %.2f s", status,
                     self.highs.getInfo().simplex_iteration_count, self.highs.getRunTime() - started)
        if status != highspy.HighsModelStatus.kOptimal:
            return None
        return np.array(self.highs.getSolution().col_value)
