"""Faults on real gloo processes: a rank that dies mid-step or mid-save never leaves its peers hanging, and a
checkpoint interrupted by a dying rank is never taken for a complete one.

``spawn`` kills every survivor a second after the first failure, which is right for tests but would hide what
the survivors do on their own; :func:`launch` here lets every process run to its own end and reports each one's
exit code and error text, so the tests can check that each survivor raised by itself, and with which error.

No test measures how fast anything happened. What shows that the compile ``timeout`` (6 s) bounds a survivor's
wait is the error itself (gloo raised its timeout on the communicator's groups, or a closed connection) and the
hang bound: the default group's timeout is 10 minutes and :func:`launch` kills whatever still runs after
:data:`DEADLINE`, so a survivor that waited on anything but the 6 s groups would have no report at all. The
messages are also checked against the README's error table (:func:`tests.test_error_catalogue.assert_row`).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch.distributed import TCPStore

import autoshard
from autoshard.errors import CheckpointError
from examples import models
from tests.test_error_catalogue import assert_row

pytestmark = pytest.mark.gloo

TIMEOUT = 6.0  # seconds: the communicator timeout the sharded model is compiled with
PG_TIMEOUT = 600.0  # the default group's: much longer than DEADLINE, so the compile option must bound the wait
DEADLINE = 240.0  # seconds launch lets the processes run (start-up and compiling included) before killing them
MESH = {"data": 2, "model": 2}


def _child(fn, rank, world, port, out, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=PG_TIMEOUT))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=PG_TIMEOUT), store=store)
    try:
        fn(rank, world, *args)
    except BaseException as e:  # noqa: BLE001 - the parent reports every failure
        _report(out, rank, (type(e).__name__, str(e), traceback.format_exc()), store)
        os._exit(1)  # like an uncaught exception under torchrun: non-zero, and no teardown that could block
    _report(out, rank, ("ok", "", ""), store)
    os._exit(0)


def _report(out: str, rank: int, report: tuple, store) -> None:
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    store.set(_reported(rank), "")  # for a rank that waits until another has ended (hangs_mid_step)


def _reported(rank: int) -> str:
    return f"rank {rank} reported"


def _wait_for_a_report(ranks) -> None:
    """Block until one of ``ranks`` has reported: one thread per rank waits for its key in the store
    :func:`launch` hosts (its address is in this child's environment)."""
    first = threading.Event()

    def wait(rank):
        TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                 timeout=timedelta(seconds=PG_TIMEOUT)).wait([_reported(rank)])
        first.set()

    for rank in ranks:
        threading.Thread(target=wait, args=(rank,), daemon=True).start()
    first.wait()


def launch(fn, world: int, out: str, *args, deadline: float = DEADLINE) -> tuple[dict, dict]:
    """Run ``fn(rank, world, *args)`` in ``world`` gloo processes; every process runs to its own end.

    Returns ({rank: exit code}, {rank: (error class, message, traceback)}) (reports travel through files in
    ``out``: a process that ends with ``os._exit`` may not flush a pipe). A process still running after
    ``deadline`` seconds is killed: it has no report.
    """
    ctx = mp.get_context("forkserver")
    # the store lives here, bound to a port the kernel picks (as autoshard.runtime.launch.spawn does): it outlives
    # every rank, so a rank's death never takes the rendezvous with it
    store = TCPStore("127.0.0.1", 0, world + 1, is_master=True, timeout=timedelta(seconds=PG_TIMEOUT),
                     wait_for_workers=False)
    port = store.port
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


def _compile(mesh, example_inputs=None, **kw):
    import inspect

    # The greedy planner when this version has a choice: these tests are about faults, not about plans.
    fast = {"planner": "greedy"} if "planner" in inspect.signature(autoshard.compile).parameters else {}
    return autoshard.compile(models.mlp()[0], mesh, example_inputs, annotations=models.megatron(mesh, "mlp"), **fast,
                             **kw)


def _steps(rank: int, n: int, fault=None, save_to: str | None = None):
    """Train the MLP on data=2 x model=2 for ``n`` Adam steps; ``fault(step, sharded, opt)`` runs after each
    forward, before the backward (mid-step)."""
    mesh = autoshard.Mesh(**MESH)
    sharded = _compile(mesh, _batch(0), timeout=TIMEOUT)  # planned here, in this process: no collective yet
    # Every rank starts together (the default group's wait is 10 minutes), however unevenly a loaded machine let
    # them plan: the 6 s of the communicator's groups then bound the steps, not a rank still planning (issue 22).
    torch.distributed.barrier()
    sharded.materialize()
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


def dies_mid_step(rank: int, world: int):
    def fault(step, sharded, opt):
        if rank == 3 and step == 1:
            os._exit(17)

    _steps(rank, 3, fault)


def hangs_mid_step(rank: int, world: int):
    def fault(step, sharded, opt):
        if rank == 3 and step == 1:
            # alive, sockets open, but never joins the backward, until one of its direct peers (rank 1 on data,
            # rank 2 on model) has failed and reported: exiting earlier would close its sockets, and its peers
            # would report a closed connection, not a timeout. Its exit then ends the waits that only end with it.
            _wait_for_a_report((1, 2))
            os._exit(18)

    _steps(rank, 3, fault)


def _check_survivors(codes, reports, culprit_code, expect, row):
    assert codes[3] == culprit_code, (codes, reports)
    for rank in (0, 1, 2):
        assert codes[rank] not in (0, None), (rank, codes, reports)
        assert rank in reports, f"rank {rank} was still waiting after {DEADLINE:g} s and was killed: {codes}"
        cls, msg, tb = reports[rank]
        assert cls in ("CollectiveTimeoutError", "PeerDiedError"), (rank, cls, msg, tb)
        assert re.search(expect, msg), (rank, msg)
        if row is not None:
            assert_row(row, cls, msg)


def test_a_rank_dying_mid_step_makes_every_other_rank_fail_within_the_timeout(tmp_path):
    codes, reports = launch(dies_mid_step, 4, str(tmp_path))
    # Every survivor names the collective, its group and the peer it lost (a direct peer of rank 3 names it;
    # ranks further away see their own peer go as the failure spreads, or the world's check before the next call).
    _check_survivors(codes, reports, 17,
                     r"^((all_reduce|all_gather|reduce_scatter|all_to_all) on axis `(data|model)` \(group of ranks "
                     r"\[\d, \d\]\)|all_reduce_host) did not complete on rank \d: (one of )?peer ranks? [\d, \[\]]+ "
                     r"closed its connection", "peer-died")
    assert any("peer rank 3 closed" in reports[r][1] for r in (1, 2))


def test_a_rank_hanging_mid_step_makes_every_other_rank_time_out(tmp_path):
    codes, reports = launch(hangs_mid_step, 4, str(tmp_path))
    _check_survivors(codes, reports, 18,
                     r"^((all_reduce|all_gather|reduce_scatter|all_to_all) on axis `(data|model)` \(group of ranks "
                     r"\[\d, \d\]\)|all_reduce_host) did not complete (within 6 s|on rank)", None)
    # the direct peers of the hanging rank hit the timeout itself (it still had its sockets open)
    timed_out = [reports[r][1] for r in (1, 2) if "did not complete within 6 s" in reports[r][1]]
    assert timed_out, reports
    for msg in timed_out:
        assert_row("peer-hangs", "CollectiveTimeoutError", msg)


def dies_while_saving(rank: int, world: int, path: str):
    sharded, opt = _steps(rank, 1)
    autoshard.save(sharded, path, optimizer=opt)  # a complete checkpoint of step 1
    _steps_more(sharded, opt, rank)
    if rank == 1:
        from torch.distributed.checkpoint import FileSystemWriter

        write = FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            write(self, plan, planner).wait()  # its shards reach the disk, then the process is gone
            os._exit(19)

        FileSystemWriter.write_data = write_then_die
    autoshard.save(sharded, path, optimizer=opt)  # overwrite with step 2: rank 1 dies half-way


def _steps_more(sharded, opt, rank):
    mesh = autoshard.Mesh(**MESH)
    x, y = _batch(1)
    sharded(autoshard.data_shard(x, mesh, rank), autoshard.data_shard(y, mesh, rank)).backward()
    opt.step()


def test_a_rank_dying_during_save_leaves_no_checkpoint_that_loads(tmp_path):
    path = str(tmp_path / "ckpt")
    codes, reports = launch(dies_while_saving, 4, str(tmp_path), path)
    assert codes[1] == 19
    for rank in (0, 2, 3):
        assert codes[rank] not in (0, None), (rank, codes, reports)
        assert rank in reports, f"rank {rank} was still waiting after {DEADLINE:g} s and was killed: {codes}"
        cls, msg, tb = reports[rank]
        assert cls == "CheckpointError", (rank, cls, msg, tb)
        assert f"save to '{path}' failed on rank {rank} before its commit" in msg
        assert_row("checkpoint-save-interrupted", cls, msg)
    partial = [n for n in os.listdir(tmp_path) if n.startswith("ckpt.tmp-")]
    assert len(partial) == 1 and any(n.endswith(".distcp") for n in os.listdir(tmp_path / partial[0]))
    with pytest.raises(CheckpointError, match="has no commit marker autoshard.json"):
        autoshard.load(models.mlp()[0], str(tmp_path / partial[0]))
    # the step-1 checkpoint it was replacing is intact and loads
    model = models.mlp()[0]
    autoshard.load(model, path)
    assert not torch.equal(model.fc1.weight, models.mlp()[0].fc1.weight)
