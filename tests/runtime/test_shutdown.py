"""``autoshard.runtime.shutdown()`` ends a run with no gloo backend left for interpreter teardown (issue 22).

Four gloo processes each leave what made the torchrun example abort at exit now and then under load: an async
all-reduce nobody waited for, the communicator's groups (still referenced by it), and the default group pinned
by ``torch.distributed.nn.functional`` (imported by the first ``torch.export`` after ``init_process_group``, it
holds ``group.WORLD`` in its default arguments). After ``shutdown()`` the collective has completed with the right
sum, the communicator refuses further work, and not one gloo thread (``pt_gloo_runloop`` workers,
``gloo_tcp_loop`` socket loops) is left in the process.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from autoshard.errors import AutoshardError
from autoshard.mesh import Mesh
from autoshard.runtime import DistCommunicator, shutdown, spawn

pytestmark = [pytest.mark.gloo, pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                                   reason="torch.distributed with gloo is not available")]

GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")


def _threads() -> list[str]:
    names = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            names.append(f.read().strip())
    return sorted(names)


def _leave_work_behind(rank: int, world_size: int) -> dict:
    comm = DistCommunicator(Mesh(data=2, model=2), timeout=60)
    torch.export.export(torch.nn.Linear(2, 2), (torch.ones(1, 2),))  # pins the default group (see the docstring)
    comm.barrier()
    x = torch.full((1000,), float(rank))
    handle = comm.all_reduce_async(x, "model")  # never waited on by the caller
    before = _threads()
    shutdown()
    after = _threads()
    try:
        comm.all_reduce(torch.ones(1), "data")
        refused = ""
    except AutoshardError as e:
        refused = str(e)
    return {"before": before, "after": after, "sum": x[:3].tolist(), "completed": handle.is_completed(),
            "initialized": dist.is_initialized(), "refused": refused}


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc to list threads")
def test_shutdown_completes_pending_work_and_leaves_no_gloo_thread():
    results = spawn(_leave_work_behind, 4, timeout=120, start_method="forkserver")
    for rank, r in enumerate(results):
        partner = rank ^ 1  # the other rank of this rank's `model` group (row-major data=2 x model=2)
        assert r["completed"] and r["sum"] == [float(rank + partner)] * 3, (rank, r)
        assert sum(r["before"].count(t) for t in GLOO_THREADS) >= 9, r["before"]  # 3 groups x (2 workers + loop)
        assert not any(t in GLOO_THREADS for t in r["after"]), (rank, r["after"])
        assert not r["initialized"]
        assert "communicator was closed" in r["refused"] and "shutdown()" in r["refused"], r["refused"]


def test_shutdown_without_a_process_group_does_nothing():
    assert not dist.is_initialized()
    shutdown()
    shutdown()


def _pipeline_then_shutdown(rank: int, world_size: int) -> dict:
    import autoshard

    class Chain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

        def forward(self, x):
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return x.square().mean()

    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
    pm = autoshard.compile(Chain(), Mesh(pipe=2), (x,), pipeline=autoshard.Pipeline(microbatches=2))
    loss = float(pm(x))
    shutdown()  # the module, its schedule and stages are still referenced here
    try:
        pm(x)
        refused = ""
    except AutoshardError as e:
        refused = str(e)
    return {"loss": loss, "after": _threads(), "refused": refused}


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc to list threads")
def test_shutdown_frees_the_pipe_group_a_live_pipelined_module_holds():
    results = spawn(_pipeline_then_shutdown, 2, timeout=120, start_method="forkserver")
    assert results[0]["loss"] == results[1]["loss"]
    for r in results:
        assert not any(t in GLOO_THREADS for t in r["after"]), r["after"]
        assert "communicator was closed" in r["refused"], r["refused"]


def _torchrun(script: str, *args: str) -> subprocess.CompletedProcess:
    # torchrun as a module of this interpreter (see tests/test_examples.py); --standalone picks its own port
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, check=False)


BARE_DESTROY = str(Path(__file__).parent / "scripts" / "ends_with_bare_destroy.py")


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc to list threads")
def test_a_script_that_ends_with_a_bare_destroy_leaves_no_gloo_thread_to_interpreter_teardown():
    # the module (DTensor parameters), the optimizer and the loss are all alive when the script ends
    proc = _torchrun(BARE_DESTROY)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert len(set(re.findall(r"rank \d: loss (\S+)", out))) == 1 and out.count(": loss ") == 2, out[-4000:]
    assert sorted(re.findall(r"rank (\d): (\d+) gloo threads at exit", out)) == [(str(r), "0") for r in range(2)], \
        out[-4000:]


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc to list threads")
def test_a_script_that_ends_in_an_exception_exits_with_its_error_and_no_gloo_thread():
    proc = _torchrun(BARE_DESTROY, "--raise")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "the script's own error, after training" in out, out[-4000:]
    assert "terminate called" not in out, out[-4000:]
    assert sorted(re.findall(r"rank (\d): (\d+) gloo threads at exit", out)) == [(str(r), "0") for r in range(2)], \
        out[-4000:]
