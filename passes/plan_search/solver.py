"""The LP relaxation of a program kept inside HiGHS (the ``highspy`` package), re-solved for many objectives from
the previous basis.

The Lagrangian walk (:mod:`.lagrangian`) and :func:`.lagrangian.lp_bound` solve the same rows for many objectives
``c + λ·mem``: :class:`WarmLP` passes the program to a ``highspy.Highs`` object once and changes only the column
costs, so each new λ starts from the last optimal basis (a few simplex pivots instead of a solve from scratch), and
:meth:`WarmLP.copy` starts a second object from that basis (two λ solve at once: HiGHS releases the GIL while it
runs). ``scipy.optimize.milp`` (:func:`.ilp.solve_program`) serves every solve that needs no warm start.

HiGHS's clock counts every run of an object: :meth:`WarmLP.solve` sets each run's time limit from the time already
spent, so a limit is seconds for this solve.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading

import highspy
import numpy as np
from autoshard.passes.plan_search.ilp import Program

logger = logging.getLogger(__name__)

_first = threading.Lock()
_made = False


def _new_highs() -> highspy.Highs:
    """A ``highspy.Highs`` that logs only at DEBUG. Its constructor prints HiGHS's banner to the process's stdout (C
    level, once per process, before any option can be set): the first one is made with file descriptor 1 on
    ``/dev/null`` so that the CLI's output and the user's stay clean."""
    global _made
    with _first:
        if not _made:
            _made = True
            highs = _quietly(highspy.Highs)
        else:
            highs = highspy.Highs()
    highs.setOptionValue("output_flag", logger.isEnabledFor(logging.DEBUG))
    return highs


def _quietly(make):
    try:
        sys.stdout.flush()
        saved, null = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    except (OSError, ValueError, AttributeError):  # no file descriptor 1 (embedded interpreters): print it
        return make()
    try:
        os.dup2(null, 1)
        return make()
    finally:
        ctypes.CDLL(None).fflush(None)  # what C's stdio buffered goes to /dev/null, not to the restored stdout
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)


class WarmLP:
    """The LP relaxation of one program inside a ``highspy.Highs`` object."""

    def __init__(self, highs: highspy.Highs, n: int):
        self.highs, self.n = highs, n
        self.columns = np.arange(n, dtype=np.int32)

    @classmethod
    def create(cls, prog: Program) -> WarmLP:
        a = prog.a.tocsc()
        n = a.shape[1]
        lp = highspy.HighsLp()
        lp.num_col_, lp.num_row_ = n, a.shape[0]
        lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = n, a.shape[0]
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.col_cost_ = prog.c * 1e9  # nanoseconds, as ilp.solve_program: HiGHS's absolute tolerances are ~1e-7
        lp.col_lower_, lp.col_upper_ = np.zeros(n), np.ones(n)
        inf = highspy.kHighsInf
        lp.row_lower_ = np.maximum(np.asarray(prog.lo, dtype=float), -inf)
        lp.row_upper_ = np.minimum(np.asarray(prog.hi, dtype=float), inf)
        lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = a.indptr, a.indices, a.data
        highs = _new_highs()
        highs.setOptionValue("presolve", "off")  # presolve would drop the basis between objectives
        highs.passModel(lp)
        return cls(highs, n)

    def copy(self, prog: Program) -> WarmLP:
        """Another HiGHS object for the same program, starting from this one's current basis."""
        other = type(self).create(prog)
        other.highs.setBasis(self.highs.getBasis())
        return other

    def solve(self, cost: np.ndarray, time_limit: float) -> np.ndarray | None:
        """The LP optimum for the column costs ``cost`` (seconds), or None when HiGHS did not reach it within
        ``time_limit`` seconds of this solve."""
        self.highs.changeColsCost(self.n, self.columns, cost * 1e9)
        self.highs.setOptionValue("time_limit", float(self.highs.getRunTime() + time_limit))
        self.highs.run()
        status = self.highs.getModelStatus()
        logger.debug("warm LP: %s after %d simplex iterations", status, self.highs.getInfo().simplex_iteration_count)
        if status != highspy.HighsModelStatus.kOptimal:
            return None
        return np.array(self.highs.getSolution().col_value)
