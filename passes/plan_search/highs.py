"""HiGHS objects (the ``highspy`` package) made quietly, and a program's rows passed to one.

Both the warm-started LP of :mod:`.solver` and the one-off LP and MIP solves of :func:`.ilp.solve_program` go
through here. The MIP solves once went through ``scipy.optimize.milp``, whose bundled HiGHS prints a debugging line
(``HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();``) to the process's stderr for every
improving solution of a hard program, past any Python-level redirection; ``highspy``'s HiGHS does not.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
from dataclasses import dataclass

import highspy
import numpy as np

logger = logging.getLogger(__name__)

_first = threading.Lock()
_made = False


def new_highs() -> highspy.Highs:
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


def highs_with(a, lo, hi, cost: np.ndarray, integer: np.ndarray | None = None) -> highspy.Highs:
    """A quiet ``Highs`` holding ``min cost·x`` over ``lo ≤ a·x ≤ hi``, ``0 ≤ x ≤ 1`` (``a``: a scipy sparse
    matrix; ``integer``: 1 for the 0/1 columns of a MIP, None for an LP), presolve off (it would drop the basis a
    warm start keeps, and the programs are solved in their own scaling)."""
    a = a.tocsc()
    n = a.shape[1]
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = n, a.shape[0]
    lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = n, a.shape[0]
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.col_cost_ = np.asarray(cost, dtype=float)
    lp.col_lower_, lp.col_upper_ = np.zeros(n), np.ones(n)
    inf = highspy.kHighsInf
    lp.row_lower_ = np.maximum(np.asarray(lo, dtype=float), -inf)
    lp.row_upper_ = np.minimum(np.asarray(hi, dtype=float), inf)
    lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = a.indptr, a.indices, a.data
    if integer is not None:
        lp.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous
                           for i in integer]
    highs = new_highs()
    highs.setOptionValue("presolve", "off")
    highs.passModel(lp)
    return highs


@dataclass(frozen=True)
class Solution:
    """One run of HiGHS: the values (None: none found), proven optimal, stopped by the time limit, the MIP's
    relative gap (0 for an LP), HiGHS's status in words."""

    x: np.ndarray | None
    optimal: bool
    timed_out: bool
    gap: float
    message: str


def run(highs: highspy.Highs, time_limit: float, mip: bool) -> Solution:
    """Run ``highs`` for at most ``time_limit`` seconds (a MIP to a relative gap of 0)."""
    highs.setOptionValue("time_limit", float(max(time_limit, 0.01)))
    if mip:
        highs.setOptionValue("mip_rel_gap", 0.0)
    highs.run()
    status = highs.getModelStatus()
    info = highs.getInfo()
    found = status == highspy.HighsModelStatus.kOptimal or (mip and info.primal_solution_status == 2)
    x = np.array(highs.getSolution().col_value) if found else None
    gap = float(info.mip_gap) if mip and x is not None and np.isfinite(info.mip_gap) else 0.0
    return Solution(x, status == highspy.HighsModelStatus.kOptimal,
                    status == highspy.HighsModelStatus.kTimeLimit, gap, highs.modelStatusToString(status))
