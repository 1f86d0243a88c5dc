"""Faults on real gloo processes: a rank that dies mid-step or mid-save never leaves its peers hanging, and a
checkpoint interrupted by a dying rank is never taken for a complete one.

``spawn`` kills every survivor a second after the first failure, which is right for tests but would hide what
the survivors do on their own; :func:`launch` here lets every process run to its own end and reports each one's
exit code, error text and the time of its error, so the tests can check that each survivor raised by itself,
within the configured timeout.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import autoshard
from autoshard.errors import CheckpointError
from autoshard.runtime.launch import free_port
from examples import models

pytestmark = pytest.mark.gloo

TIMEOUT = 6.0  # seconds: the communicator timeout the sharded model is compiled with
PG_TIMEOUT = 60.0  # the default group's: much longer, so the compile option is what must bound the wait
MESH = {"data": 2, "model": 2}


def _child(fn, rank, world, port, out, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=PG_TIMEOUT))
    try:
        fn(rank, world, *args)
    except BaseException as e:  # noqa: BLE001 - the parent reports every failure
        _report(out, rank, (type(e).__name__, str(e), time.time(), traceback.format_exc()))
        os._exit(1)  # like an uncaught exception under torchrun: non-zero, and no teardown that could block
    _report(out, rank, ("ok", "", time.time(), ""))
    os._exit(0)


def _report(out: str, rank: int, report: tuple) -> None:
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


def launch(fn, world: int, out: str, *args, deadline: float = 120.0) -> tuple[dict, dict]:
    """Run ``fn(rank, world, *args)`` in ``world`` gloo processes; every process runs to its own end.

    Returns ({rank: exit code}, {rank: (error class, message, time.time() of the error, traceback)}) (reports
    travel through files in ``out``: a process that ends with ``os._exit`` may not flush a pipe).
    """
    ctx = mp.get_context("forkserver")
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world, port, out, args), name=f"fault-rank{r}")
             for r in range(world)]
    for p in procs:
        p.start()
    reports = {}
    end = time.monotonic() + deadline
    try:
        for p in procs:
            p.join(max(end - time.monotonic(), 0))
        for r in range(world):
            name = os.path.join(out, f"rank{r}.json")
            if os.path.exists(name):
                reports[r] = tuple(json.loads(Path(name).read_text()))
        return {r: p.exitcode for r, p in enumerate(procs)}, reports
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 32, generator=g), torch.randn(8, 32, generator=g)


def _compile(mesh, **kw):
    import inspect

    # The greedy planner when this version has a choice: these tests are about faults, not about plans.
    fast = {"planner": "greedy"} if "planner" in inspect.signature(autoshard.compile).parameters else {}
    return autoshard.compile(models.mlp()[0], mesh, plan=models.megatron(mesh, "mlp"), **fast, **kw)


def _steps(rank: int, n: int, fault=None, save_to: str | None = None):
    """Train the MLP on data=2 x model=2 for ``n`` Adam steps; ``fault(step, sharded, opt)`` runs after each
    forward, before the backward (mid-step)."""
    mesh = autoshard.Mesh(**MESH)
    sharded = _compile(mesh, timeout=TIMEOUT)
    opt = None
    for step in range(n):
        x, y = _batch(step)
        loss = sharded(autoshard.data_shard(x, mesh, rank), autoshard.data_shard(y, mesh, rank))
        if fault is not None:
            fault(step, sharded, opt)
        loss.backward()
        opt = opt or torch.optim.Adam(sharded.parameters(), lr=1e-3)
        opt.step()
        opt.zero_grad()
    return sharded, opt


def _stamp(path: str) -> None:
    with open(path, "w") as f:  # when the peer failed, for the survivors' clocks
        f.write(repr(time.time()))


def dies_mid_step(rank: int, world: int, stamp: str):
    def fault(step, sharded, opt):
        if rank == 3 and step == 1:
            _stamp(stamp)
            os._exit(17)

    _steps(rank, 3, fault)


def hangs_mid_step(rank: int, world: int, stamp: str):
    def fault(step, sharded, opt):
        if rank == 3 and step == 1:
            _stamp(stamp)
            time.sleep(2 * TIMEOUT + 3)  # alive, sockets open, but never joins the backward; outlives the others
            os._exit(18)

    _steps(rank, 3, fault)


def _check_survivors(codes, reports, stamp, culprit_code, expect):
    failed_at = float(Path(stamp).read_text())
    assert codes[3] == culprit_code, (codes, reports)
    for rank in (0, 1, 2):
        assert codes[rank] not in (0, None), (rank, codes, reports)
        cls, msg, when, tb = reports[rank]
        print(f"rank {rank}: {cls} {when - failed_at:.2f} s after rank 3 failed: {msg}")
        assert cls == "CollectiveTimeoutError", (rank, cls, msg, tb)
        assert when - failed_at < 2 * TIMEOUT, (rank, when - failed_at, msg)
        assert re.search(expect, msg), (rank, msg)


def test_a_rank_dying_mid_step_makes_every_other_rank_fail_within_the_timeout(tmp_path):
    stamp = str(tmp_path / "failed_at")
    codes, reports = launch(dies_mid_step, 4, str(tmp_path), stamp, deadline=PG_TIMEOUT + 60)
    # Every survivor names the collective, its group and the peer it lost (a direct peer of rank 3 names it;
    # ranks further away see their own peer go as the failure spreads).
    _check_survivors(codes, reports, stamp, 17,
                     r"^(all_reduce|all_gather|reduce_scatter|all_to_all) on axis `(data|model)` \(group of ranks "
                     r"\[\d, \d\]\) did not complete on rank \d \(timeout 6 s\): peer rank \d (closed its "
                     r"connection|exited \(pid \d+\))")
    assert any(re.search("peer rank 3 (closed|exited)", reports[r][1]) for r in (1, 2))


def test_a_rank_hanging_mid_step_makes_every_other_rank_time_out(tmp_path):
    stamp = str(tmp_path / "failed_at")
    codes, reports = launch(hangs_mid_step, 4, str(tmp_path), stamp, deadline=PG_TIMEOUT + 60)
    _check_survivors(codes, reports, stamp, 18,
                     r"^(all_reduce|all_gather|reduce_scatter|all_to_all) on axis `(data|model)` \(group of ranks "
                     r"\[\d, \d\]\) did not complete (within 6 s|on rank)")
    # the direct peers of the hanging rank hit the timeout itself
    assert any("did not complete within 6 s" in reports[r][1] for r in (1, 2))


def dies_while_saving(rank: int, world: int, path: str, stamp: str):
    sharded, opt = _steps(rank, 1)
    autoshard.save(sharded, path, optimizer=opt)  # a complete checkpoint of step 1
    _steps_more(sharded, opt, rank)
    if rank == 1:
        from torch.distributed.checkpoint import FileSystemWriter

        write = FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            write(self, plan, planner).wait()  # its shards reach the disk, then the process is gone
            _stamp(stamp)
            os._exit(19)

        FileSystemWriter.write_data = write_then_die
    autoshard.save(sharded, path, optimizer=opt)  # overwrite with step 2: rank 1 dies half-way


def _steps_more(sharded, opt, rank):
    mesh = autoshard.Mesh(**MESH)
    x, y = _batch(1)
    sharded(autoshard.data_shard(x, mesh, rank), autoshard.data_shard(y, mesh, rank)).backward()
    opt.step()


def test_a_rank_dying_during_save_leaves_no_checkpoint_that_loads(tmp_path):
    path, stamp = str(tmp_path / "ckpt"), str(tmp_path / "failed_at")
    codes, reports = launch(dies_while_saving, 4, str(tmp_path), path, stamp, deadline=PG_TIMEOUT + 60)
    failed_at = float(Path(stamp).read_text())
    assert codes[1] == 19
    for rank in (0, 2, 3):
        assert codes[rank] not in (0, None), (rank, codes, reports)
        cls, msg, when, tb = reports[rank]
        print(f"rank {rank}: {cls} {when - failed_at:.2f} s after rank 1 died: {msg[:300]}")
        assert cls == "CheckpointError", (rank, cls, msg, tb)
        assert f"save to '{path}' failed on rank {rank} before its commit" in msg
        assert when - failed_at < 2 * TIMEOUT
    partial = [n for n in os.listdir(tmp_path) if n.startswith("ckpt.tmp-")]
    assert len(partial) == 1 and any(n.endswith(".distcp") for n in os.listdir(tmp_path / partial[0]))
    with pytest.raises(CheckpointError, match="has no commit marker autoshard.json"):
        autoshard.load(models.mlp()[0], str(tmp_path / partial[0]))
    # the step-1 checkpoint it was replacing is intact and loads
    model = models.mlp()[0]
    autoshard.load(model, path)
    assert not torch.equal(model.fc1.weight, models.mlp()[0].fc1.weight)
