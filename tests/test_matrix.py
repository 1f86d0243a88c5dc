"""The real-process matrix (issue 33, part 3): every feature as a user's training script runs it (compile on every
rank, this rank's share of the batch, forward, ``loss.backward()`` outside any ``use()`` block,
``clip_grad_norm_`` over the DTensor parameters, an AdamW step, a second forward), in the simulator and on 4 gloo
processes, each equal to eager on one device: both losses, the clipped total norm and every parameter after the step
(tests/matrix_cases.py holds the cases, the eager reference and the tolerances).

The gloo processes are started once for the module (a module-scoped fixture) and run every case in sequence, each
case in its own ``try``: one failing case reports its traceback and hides none of the others. The simulator refuses
the pipeline cases with an error that says so (:data:`SIM_REFUSES`); every other case runs in both.
"""

from __future__ import annotations

import pytest

from autoshard.errors import AutoshardError
from tests import matrix_cases as mc

#: cases the simulator refuses with an error that says so: it has no point-to-point process group for
#: torch.distributed.pipelining's schedules (torch's threaded process group has collectives only)
SIM_REFUSES = ("pipeline_1f1b", "pipeline_interleaved")

_refs: dict[str, dict] = {}
_sim: dict[str, list] = {}


def _reference(name: str) -> dict:
    if name not in _refs:
        _refs[name] = mc.references(name)
    return _refs[name]


def _simulated(name: str) -> list:
    if name not in _sim:
        _sim[name] = mc.simulate(name)
    return _sim[name]


@pytest.fixture(scope="module")
def real_processes() -> dict:
    """{case: per-rank results, or the first failing rank's traceback text}, from one spawn of 4 processes."""
    from autoshard.runtime import spawn

    names = list(mc.CASES)
    limits = {name: mc.memory_limit(name) for name in names if mc.CASES[name].search_limit}
    try:
        per_rank = spawn(mc.gloo_all, mc.WORLD, names, limits, timeout=420, start_method="forkserver")
    except Exception as e:  # noqa: BLE001 - the processes died: every case reports it
        return {name: f"the gloo processes failed: {type(e).__name__}: {e}" for name in names}
    out = {}
    for name in names:
        errors = [r[name][1] for r in per_rank if r[name][0] == "error"]
        out[name] = _first_cause(errors) if errors else [r[name][1] for r in per_rank]
    return out


def _first_cause(errors: list[str]) -> str:
    """The error that is not a peer's timeout or abort, if any (the cause, not its echo on the other ranks)."""
    echoes = ("CollectiveTimeoutError", "PeerDiedError", "Connection reset", "Connection closed")
    causes = [e for e in errors if not any(x in e for x in echoes)]
    return (causes or errors)[0]


@pytest.mark.parametrize("name", list(mc.CASES))
def test_simulator_equals_eager(name):
    if name in SIM_REFUSES:
        with pytest.raises(AutoshardError, match="Run pipelines on real processes"):
            _simulated(name)
        return
    mc.check(name, _simulated(name), _reference(name))
    _check_case_premise(name, _simulated(name))


@pytest.mark.gloo
@pytest.mark.parametrize("name", list(mc.CASES))
def test_real_processes_equal_eager(name, real_processes):
    got = real_processes[name]
    if isinstance(got, str):
        pytest.fail(f"{name} on 4 gloo processes raised:\n{got}", pytrace=False)
    mc.check(name, got, _reference(name))
    _check_case_premise(name, got)
    if name not in SIM_REFUSES:
        mc.check_same(name, _simulated(name), got)


def _check_case_premise(name: str, results: list) -> None:
    """What makes the case the case it names: under the memory limit the search turned on ZeRO and
    recomputation by itself, and its plan fits the limit."""
    if mc.CASES[name].search_limit:
        limit = mc.memory_limit(name)
        for r in results:
            search = r["search"]
            assert search["zero_stages"] and search["recomputed"], search
            assert search["memory"] <= limit, (search["memory"], limit)
