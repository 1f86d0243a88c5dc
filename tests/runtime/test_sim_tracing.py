"""Simulated ranks are threads of one process: a rank that runs DTensor ops while another rank traces must not
corrupt torch.export's process-global pre-dispatch mode state (the CI failures "Trying to pop empty mode stack" and
"ProxyTorchDispatchMode slot already occupied" came from exactly this overlap)."""
import threading

import torch
from torch.distributed.tensor import DTensor, Replicate

from autoshard import Mesh
from autoshard.runtime.parameters import device_mesh
from autoshard.runtime.sim import SimWorld
from autoshard.frontend.trace import trace


class _TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).sum()


def test_a_rank_running_dtensor_ops_beside_a_tracing_rank_leaves_the_trace_intact():
    mesh = Mesh(data=2)
    traced = threading.Event()

    def rank_fn(rank):
        if rank == 0:
            graphs = [trace(_TwoLayers(), (torch.randn(4, 16),)) for _ in range(6)]
            traced.set()
            return [len(g.graph.nodes) for g in graphs]
        dm = device_mesh(mesh, "cpu")
        rows = 0
        while (rows < 300 or not traced.is_set()) and rows < 20000:  # ops from the start to past the traces
            rows += 1  # a new shape each time: DTensor's sharding propagation misses its cache and runs on fakes
            t = DTensor.from_local(torch.ones(rows, 3), dm, [Replicate()], run_check=False)
            assert (t * 2 + 1).sum().to_local().item() == 9 * rows
        return rows

    counts, _ = SimWorld(mesh).run(rank_fn)
    assert len(set(counts)) == 1  # every trace gave the same graph
