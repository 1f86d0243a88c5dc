"""Stress the multi-process path: K copies of the examples at once, R rounds, and every failure counted by kind.

Each round starts ``--copies`` jobs at the same time and waits for all of them; job ``i`` of round ``r`` runs
example ``(r * copies + i) % len(examples)`` of ``--examples``, so every round mixes them:

* ``gpt``   — ``torchrun --nproc-per-node 4 examples/train_gpt.py --steps 20`` (data=2 × model=2, DDP-like
  bucketed gradient all-reduces launched asynchronously in backward);
* ``zero3`` — the same under ``--zero 3 --bucket-cap-mb 0.05`` (ZeRO-3 gathers prefetched with
  ``all_gather_async``, gradients reduce-scattered, the rest in many small async buckets);
* ``pipe``  — ``examples/train_3d.py --steps 5`` (pipe=2 × data=2 × model=2: 8 gloo processes started by
  :func:`autoshard.runtime.spawn`, 1F1B schedule).

Every torchrun job gets its own free port on 127.0.0.1 (the ports of one round are held open together while
they are chosen, so two jobs never get the same one), runs with ``OMP_NUM_THREADS=1`` and Python's
``faulthandler`` on (a rank killed by a signal prints every Python thread's stack), and is bounded by
``--timeout``. ``--busy N`` runs N busy loops beside the jobs for the whole run (more contention).

A job counts as ``ok`` only when it exits 0 *and* printed its example's success line (losses equal to one
process). Anything else is a failure, classified by what the job printed (:func:`classify`): the abort of
issue 22 (``terminate called without an active exception``), another signal, a timeout, a loss mismatch, a port
already in use, or the job's last error line. The output is one line per kind, with the examples it came from::

    $ python bench/stress.py --copies 3 --rounds 10
    ok                                                     30  (gpt 10, pipe 10, zero3 10)
    failures                                                0
    30 jobs (3 at a time, 10 rounds) in 1234 s

With ``--logs DIR`` the whole output of every failed job is kept there (``round03-gpt-1.log``), and with
``--cores`` each job runs in a folder of its own under ``DIR`` with core dumps enabled (``ulimit -c unlimited``;
the machine's ``kernel.core_pattern`` decides where they go). The exit status is 1 when any job failed.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ("gpt", "zero3", "pipe")

#: A job's success line: the example compared its losses with one process and found them equal.
_SUCCESS = {"gpt": re.compile(r"^max \|sharded - single\| over \d+ steps: ([0-9.e+-]+)$", re.M),
            "zero3": re.compile(r"^max \|sharded - single\| over \d+ steps: ([0-9.e+-]+)$", re.M),
            "pipe": re.compile(r"^max \|loss difference\| over \d+ steps and 8 ranks: .* -> OK$", re.M)}


def _torchrun() -> list[str]:
    """torchrun as a module of this interpreter (the ``torchrun`` on PATH may belong to another Python)."""
    return [sys.executable, "-m", "torch.distributed.run"]


def command(example: str, port: int, steps: int | None = None) -> list[str]:
    """The command line of one job of ``example`` (a torchrun on 127.0.0.1:``port``, or the pipeline example);
    ``steps``: training steps (default 20 for the GPT examples, 5 for the pipeline)."""
    if example == "pipe":
        return [sys.executable, str(ROOT / "examples" / "train_3d.py"), "--steps", str(steps or 5)]
    extra = ["--zero", "3", "--bucket-cap-mb", "0.05"] if example == "zero3" else []
    return [*_torchrun(), "--nproc-per-node", "4", "--master-addr", "127.0.0.1", "--master-port", str(port),
            str(ROOT / "examples" / "train_gpt.py"), "--steps", str(steps or 20), *extra]


def classify(example: str, returncode: int | None, output: str) -> str:
    """The kind of a finished job: ``"ok"`` or a short description of how it failed (``returncode`` None: it
    was killed at the timeout)."""
    if returncode is None:
        return "timeout (killed after --timeout)"
    if returncode == 0 and _SUCCESS[example].search(output):
        return "ok"
    if "terminate called without an active exception" in output:
        return "SIGABRT: terminate called without an active exception"
    if "terminate called after throwing" in output:
        what = re.search(r"terminate called after throwing an instance of '([^']+)'", output)
        return f"SIGABRT: uncaught C++ exception {what.group(1) if what else ''}".rstrip()
    signal = re.search(r"Signal (\d+) \((SIG[A-Z]+)\) received by PID", output) or re.search(
        r"exitcode\s*:\s*-(\d+) \(pid", output)
    if signal:
        name = signal.group(2) if signal.lastindex and signal.lastindex >= 2 else f"signal {signal.group(1)}"
        return f"{name}: a rank was killed by a signal"
    if re.search(r"address already in use|EADDRINUSE", output, re.I):
        return "port already in use"
    if re.search(r"timed out|timeout", output, re.I) and returncode != 0:
        return "a collective or the rendezvous timed out"
    if returncode == 1 and ("max |" in output) and not _SUCCESS[example].search(output):
        return "loss mismatch"
    errors = [ln.strip() for ln in output.splitlines() if re.search(r"(Error|Exception)\b", ln)]
    return f"exit {returncode}: {errors[-1][:100] if errors else 'no error line'}"


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports on 127.0.0.1 that were free a moment ago (held open together while chosen)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class Job:
    name: str
    example: str
    proc: subprocess.Popen
    log: Path
    started: float


def _enable_cores() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def _busy() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def run(copies: int, rounds: int, examples: tuple[str, ...], timeout: float, workdir: Path, cores: bool,
        busy: int, verbose: bool, steps: int | None = None) -> list[tuple[str, str, Path]]:
    """Run the rounds; return ``(job name, kind, log path)`` for every job, in order."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", "PYTHONUNBUFFERED": "1"}
    results = []
    loops = [_busy() for _ in range(busy)]
    try:
        for r in range(rounds):
            ports = free_ports(copies)
            jobs = []
            for i in range(copies):
                example = examples[(r * copies + i) % len(examples)]
                name = f"round{r:02d}-{example}-{i}"
                cwd = workdir / name if cores else ROOT
                cwd.mkdir(parents=True, exist_ok=True)
                log = workdir / f"{name}.log"
                with open(log, "w") as out:
                    proc = subprocess.Popen(command(example, ports[i], steps), cwd=cwd, env=env, stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True,
                                            preexec_fn=_enable_cores if cores else None)
                jobs.append(Job(name, example, proc, log, time.monotonic()))
            for job in jobs:
                try:
                    code = job.proc.wait(max(timeout - (time.monotonic() - job.started), 1))
                except subprocess.TimeoutExpired:
                    os.killpg(job.proc.pid, 9)
                    job.proc.wait()
                    code = None
                kind = classify(job.example, code, job.log.read_text(errors="replace"))
                results.append((job.name, kind, job.log))
                if verbose:
                    print(f"{job.name}: {kind} ({time.monotonic() - job.started:.0f} s)", flush=True)
    finally:
        for p in loops:
            p.kill()
            p.wait()
    return results


def summary(results: list[tuple[str, str, Path]]) -> list[str]:
    """One line per kind (``ok`` first, then the failures, most frequent first), with the examples it came from,
    and the failure total."""
    by_kind: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for name, kind, _ in results:
        by_kind[kind][name.split("-")[1]] += 1
    lines = []
    order = sorted(by_kind, key=lambda k: (k != "ok", -sum(by_kind[k].values()), k))
    for kind in order:
        counts = by_kind[kind]
        where = ", ".join(f"{ex} {n}" for ex, n in sorted(counts.items()))
        lines.append(f"{kind:<55} {sum(counts.values()):>3}  ({where})")
    failed = sum(1 for _, kind, _ in results if kind != "ok")
    lines.append(f"{'failures':<55} {failed:>3}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copies", type=int, default=3, help="jobs running at the same time (default 3)")
    ap.add_argument("--rounds", type=int, default=10, help="rounds of --copies jobs (default 10)")
    ap.add_argument("--examples", default=",".join(EXAMPLES),
                    help=f"comma-separated, cycled through the jobs (default {','.join(EXAMPLES)})")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds a job may run before it is killed")
    ap.add_argument("--steps", type=int, default=None,
                    help="training steps per job (default 20, pipe 5; fewer steps exercise start-up and exit more)")
    ap.add_argument("--busy", type=int, default=0, help="busy loops to run beside the jobs (default 0)")
    ap.add_argument("--logs", type=Path, default=None, help="keep the logs of failed jobs in this folder")
    ap.add_argument("--cores", action="store_true", help="enable core dumps, one working folder per job")
    ap.add_argument("-v", "--verbose", action="store_true", help="print each job's kind as it ends")
    a = ap.parse_args(argv)
    examples = tuple(e.strip() for e in a.examples.split(",") if e.strip())
    unknown = [e for e in examples if e not in EXAMPLES]
    if unknown or not examples or a.copies < 1 or a.rounds < 1:
        ap.error(f"--examples takes {', '.join(EXAMPLES)} (got {a.examples!r}); --copies and --rounds are >= 1")
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="autoshard-stress-") as tmp:
        workdir = a.logs if (a.logs and a.cores) else Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        results = run(a.copies, a.rounds, examples, a.timeout, workdir, a.cores, a.busy, a.verbose, a.steps)
        if a.logs:
            a.logs.mkdir(parents=True, exist_ok=True)
            for _, kind, log in results:
                if kind != "ok" and log.parent != a.logs:
                    shutil.copy(log, a.logs / log.name)
    for line in summary(results):
        print(line)
    print(f"{len(results)} jobs ({a.copies} at a time, {a.rounds} rounds) in {time.monotonic() - start:.0f} s")
    return 1 if any(kind != "ok" for _, kind, _ in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
