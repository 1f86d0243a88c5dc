"""bench/stress.py sorts a job's end into one kind (no processes are started here: only the classification and the
summary lines, from outputs such as the jobs print)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "bench" / "stress.py"
_spec = importlib.util.spec_from_file_location("autoshard_bench_stress", _PATH)
stress = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = stress
_spec.loader.exec_module(stress)

OK_GPT = "step  0  sharded loss 4.8  single-process loss 4.8\nmax |sharded - single| over 20 steps: 9.54e-07\n"
OK_PIPE = "max |loss difference| over 5 steps and 8 ranks: 4.77e-07 -> OK\n"


def test_classify_each_kind():
    assert stress.classify("gpt", 0, OK_GPT) == "ok"
    assert stress.classify("pipe", 0, OK_PIPE) == "ok"
    assert stress.classify("gpt", 0, "no success line") != "ok"
    assert stress.classify("gpt", None, OK_GPT) == "timeout (killed after --timeout)"
    abort = "terminate called without an active exception\nSignal 6 (SIGABRT) received by PID 12\n"
    assert stress.classify("gpt", 1, abort) == "SIGABRT: terminate called without an active exception"
    assert stress.classify("zero3", 1, "  traceback : Signal 11 (SIGSEGV) received by PID 7") == (
        "SIGSEGV: a rank was killed by a signal")
    assert stress.classify("gpt", 1, "RuntimeError: Address already in use") == "port already in use"
    assert stress.classify("gpt", 1, "max |sharded - single| over 20 steps: 3.00e-02 -> bad") == "loss mismatch"
    assert stress.classify("gpt", 1, "ValueError: boom") == "exit 1: ValueError: boom"


def test_summary_has_one_line_per_kind_and_the_failure_count():
    results = [("round00-gpt-0", "ok", None), ("round00-pipe-1", "ok", None),
               ("round01-gpt-0", "SIGABRT: terminate called without an active exception", None)]
    lines = stress.summary(results)
    assert lines[0].startswith("ok") and lines[0].rstrip().endswith("2  (gpt 1, pipe 1)")
    assert lines[1].startswith("SIGABRT: terminate called") and lines[1].rstrip().endswith("1  (gpt 1)")
    assert lines[2].split() == ["failures", "1"]


def test_free_ports_are_distinct():
    ports = stress.free_ports(5)
    assert len(set(ports)) == 5
