"""Simulated ranks are threads of one process, and torch keeps ``torch.compiler.is_compiling()``'s flag (and
``is_exporting()``'s) in one process-wide slot, set while a ``torch.export`` or a dynamo compile runs. A rank that
traces (torch.export: new input shapes, a replayed plan) must not make the other ranks, running their programs
meanwhile, answer "compiling": an in-place sharded model then took its call for a ``torch.compile(model)``'s and
compiled its rank programs with dynamo's default backend, beside the trace, in a world that is not serial —
``InternalTorchDynamoError: TypeError: 'NoneType' object is not subscriptable`` on rank 0 of
tests/test_shard_in_place.py's new-shapes test, in a loaded full-suite run. The simulator keeps the flags per thread
for the length of a run (autoshard/runtime/sim_threads.py); these tests order the overlap with events."""
from __future__ import annotations

import threading

import torch

import autoshard
from autoshard import Mesh
from autoshard.runtime.communicator import current
from autoshard.runtime.sim import SimWorld
from autoshard.runtime.torch_state import RANK_THREADS

_WAIT = 120  # seconds an event may take on a loaded machine (a bound on a hang, not a timing)


def _flags():
    return torch.compiler.is_compiling(), torch.compiler.is_exporting()


class _PausesInItsTrace(torch.nn.Module):
    """Says when torch.export has entered its forward, and waits there until told to go on."""

    def __init__(self, inside: threading.Event, go_on: threading.Event, seen: list):
        super().__init__()
        self.inside, self.go_on, self.seen = inside, go_on, seen

    def forward(self, x):
        self.seen.append(_flags())  # the tracing thread's own answer
        self.inside.set()
        assert self.go_on.wait(_WAIT)
        return x + 1


def _export_pausing(inside: threading.Event, go_on: threading.Event):
    """torch.export of a module that pauses in its trace, as the library traces a rank's program (under the
    simulator's lock); returns what the tracing thread saw inside its trace."""
    seen: list = []
    try:
        with RANK_THREADS.exclusive():
            torch.export.export(_PausesInItsTrace(inside, go_on, seen), (torch.ones(2),), strict=False)
    finally:
        inside.set()  # never leave the other rank waiting
    return seen[0]


def test_a_rank_tracing_does_not_make_the_other_ranks_compiling():
    inside, read = threading.Event(), threading.Event()
    code = (torch.compiler.is_compiling.__code__, torch.compiler.is_exporting.__code__)
    before = (type(torch.compiler), torch.compiler._compile_session_context, _flags())

    def body(rank):
        if rank == 1:
            return _export_pausing(inside, read)
        try:
            assert inside.wait(_WAIT)
            return _flags()  # while rank 1 is inside torch.export
        finally:
            read.set()

    tracer_saw = SimWorld(Mesh(data=2), timeout=_WAIT).run(body)
    assert tracer_saw == [(False, False), (True, True)]  # the tracing thread itself still answers True
    # torch as it was after the run
    assert (type(torch.compiler), torch.compiler._compile_session_context, _flags()) == before
    assert (torch.compiler.is_compiling.__code__, torch.compiler.is_exporting.__code__) == code


def test_a_compile_session_sets_only_its_own_threads_flag():
    started, done = threading.Event(), threading.Event()

    def body(rank):
        if rank == 1:
            with torch.compiler._compile_session_context():  # what dynamo enters around a frame's compile
                inside = _flags()
                started.set()
                assert done.wait(_WAIT)
            return inside, _flags()
        try:
            assert started.wait(_WAIT)
            return _flags()
        finally:
            done.set()

    results = SimWorld(Mesh(data=2), timeout=_WAIT).run(body)
    assert results == [(False, False), ((True, False), (False, False))]


class _MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_an_in_place_sharded_model_called_beside_another_ranks_trace_runs_eagerly():
    """The failure's own path: rank 0 calls its in-place sharded model while rank 1 is inside torch.export. The
    call must run the rank program as it is (no torch.compile of it), with the one-device result."""
    mesh = Mesh(data=2)
    torch.manual_seed(0)
    model = _MLP()
    copies = [_MLP() for _ in range(mesh.size)]
    for c in copies:
        c.load_state_dict(model.state_dict())
    x = torch.randn(4, 8)
    chunks = x.chunk(2)
    inside, go_on = threading.Event(), threading.Event()

    def body(rank):
        m = copies[rank]
        autoshard.shard(m, mesh, example_inputs=(chunks[rank],))
        current().barrier()  # both sharded (rank 1's trace below holds the simulator's lock)
        if rank == 1:
            _export_pausing(inside, go_on)
            return m(chunks[rank]).detach(), m.autoshard._compile_options
        # rank 0's call goes on (past the choice between the eager and the compiled call) while rank 1 traces;
        # rank 1 goes on once rank 0's sharded module is called, and joins the call's collectives
        hook = m.autoshard.register_forward_pre_hook(lambda *_: go_on.set())
        try:
            assert inside.wait(_WAIT)
            out = m(chunks[rank]).detach()
        finally:
            go_on.set()
            hook.remove()
        return out, m.autoshard._compile_options

    results = SimWorld(mesh, timeout=_WAIT).run(body)
    with torch.no_grad():
        expected = model(x).chunk(2)
    for rank, (out, compile_options) in enumerate(results):
        assert compile_options is None  # no torch.compile of the rank programs
        torch.testing.assert_close(out, expected[rank])
