"""The LP relaxation of a program kept inside HiGHS, re-solved for many objectives from the previous basis.

The Lagrangian walk (:mod:`.lagrangian`) and :func:`.lagrangian.lp_bound` solve the same rows for many
objectives ``c + λ·mem``: :class:`WarmLP` passes the program to HiGHS once and changes only the column costs, so
each new λ starts from the last optimal basis (a few simplex pivots instead of a solve from scratch). Where the
HiGHS object is missing, :meth:`WarmLP.create` returns None and every λ is solved anew by ``scipy.optimize.milp``.
"""

from __future__ import annotations

import logging

import numpy as np
from autoshard.passes.plan_search.ilp import Program

logger = logging.getLogger(__name__)


class WarmLP:
    """The LP relaxation of one program inside HiGHS (``scipy.optimize._highspy``)."""

    def __init__(self, highs, n: int):
        self.highs, self.n = highs, n

    @classmethod
    def create(cls, prog: Program) -> WarmLP | None:
        try:
            from scipy.optimize._highspy import _core as h
        except ImportError:
            return None
        a = prog.a.tocsc()
        n = a.shape[1]
        lp = h.HighsLp()
        lp.num_col_, lp.num_row_ = n, a.shape[0]
        lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = n, a.shape[0]
        lp.a_matrix_.format_ = h.MatrixFormat.kColwise
        lp.col_cost_ = prog.c * 1e9
        lp.col_lower_, lp.col_upper_ = np.zeros(n), np.ones(n)
        inf = h.kHighsInf
        lp.row_lower_ = np.array([max(x, -inf) for x in prog.lo], dtype=float)
        lp.row_upper_ = np.array([min(x, inf) for x in prog.hi], dtype=float)
        lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = a.indptr, a.indices, a.data
        highs = h._Highs()
        highs.setOptionValue("output_flag", logger.isEnabledFor(logging.DEBUG))
        highs.setOptionValue("presolve", "off")
        highs.passModel(lp)
        return cls(highs, n)

    def copy(self, prog: Program) -> WarmLP:
        """Another HiGHS object for the same program, starting from this one's current basis."""
        other = type(self).create(prog)
        other.highs.setBasis(self.highs.getBasis())
        return other

    def solve(self, cost: np.ndarray, time_limit: float) -> np.ndarray | None:
        """The LP optimum for the column costs ``cost`` (seconds), or None when HiGHS did not reach it."""
        from scipy.optimize._highspy import _core as h

        self.highs.changeColsCost(self.n, np.arange(self.n, dtype=np.int32), cost * 1e9)
        self.highs.setOptionValue("time_limit", float(time_limit))
        self.highs.run()
        logger.debug("warm LP: %s after %d simplex iterations", self.highs.getModelStatus(),
                     self.highs.getInfo().simplex_iteration_count)
        if self.highs.getModelStatus() != h.HighsModelStatus.kOptimal:
            return None
        return np.array(self.highs.getSolution().col_value)
