"""Measure a hardware profile on the current machine (``autoshard calibrate``).

:func:`measure` spawns ``world_size`` processes on 127.0.0.1 (``torch.multiprocessing``, a free port,
``init_process_group(backend)``), and in them

1. times all_reduce, all_gather, reduce_scatter and all_to_all at each message size ``b`` in ``sizes`` (``b`` as defined
   in :mod:`autoshard.cost_models.alpha_beta`: the reduced tensor, the gathered output, the exchanged buffer), the
   fastest of ``repeats`` calls, each right after a barrier, sizes interleaved (:func:`_min_times`), keeping the slowest
   rank's. The calls are the runtime's own: a :class:`~autoshard.runtime.dist.DistCommunicator` over a
   one-axis mesh of all the ranks, so what is measured is the transport a compiled model uses (the backend's
   collectives on a process group made by the communicator, with the communicator's own copies around them);
2. on every rank at once, so that ranks share the machine as they will in a run (rates and times averaged over
   ranks): a 512×512 fp32 matmul and a 32 MiB copy; the **efficiency tables**: a linear layer at five sizes in fp32
   and bf16, its gradients' two matmuls (``g @ W`` and ``g.t() @ x``: backward's layouts, which bf16 kernels on a
   CPU run at another rate than the forward's) in both, causal attention (``scaled_dot_product_attention``) and its
   gradients at five sequence lengths, at a training step's batch x heads (bf16 attention's backward ran 3.4x slower
   than fp32's at [4, 8, 128, 32] on this CPU, its forward about as fast) and an elementwise add at five sizes,
   each in fp32 and bf16 — each size's rate less the per-op overhead, over the kind's best rate
   (:func:`fit_efficiency`); the
   **per-op overhead** of a generated program (a :class:`torch.fx.GraphModule` chain of ops on 8-element tensors,
   forward, and forward + backward); the **optimizer step** (``AdamW.step`` over DTensor parameters, as a compiled
   model's are: many small tensors and a few large ones, fitted to a cost per tensor and per element:
   :func:`fit_optimizer`); the **overlap** of an async all-reduce with matmuls run meanwhile (what gradient buckets
   do in backward): ``(serial - together) / min(comm, compute)``; the **contention**: how much slower a rank's
   matmuls run while every rank runs them than alone (:func:`_contention`), printed beside the profile, not
   applied to it;
3. the **step overhead**: a one-layer model compiled data-parallel over the ranks with the profile fitted so far,
   its fastest training step less ``plan.cost(profile)``'s (the call's checks, ``zero_grad``, the loop).

The alpha-beta model says ``time = steps(n)·alpha + wire(n)·b·beta`` (:func:`alpha_beta.model_coefficients`).
For each collective (all_reduce, all_gather, reduce_scatter, all_to_all), :func:`fit_line` fits
``time = intercept + slope·b`` and ``alpha = intercept / steps``, ``beta = slope / wire`` (the per-collective rows
of the table; the profile's link carries them as per-kind links, so each collective is priced as measured). The
link's default is one ``(alpha, beta)`` fitted to all samples of all collectives at once with the same
coefficients (:func:`fit_link`), for the kinds not measured (send/recv). Both fits are least squares on relative
error, so that the small messages, which fix ``alpha``, weigh as much as the large ones.

The whole run is bounded by ``timeout`` seconds; on a timeout or a failing rank every child is killed and an
:class:`~autoshard.errors.AutoshardError` says what happened. The default run takes about 25 s with 2 ranks and 60 s
with 4 on a 2-core machine (starting the processes, the tables and compiling the tiny model); a loaded machine takes
longer.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch

from autoshard.errors import AutoshardError, CollectiveTimeoutError

from . import alpha_beta
from .profile import HardwareProfile, LinkCost, save_profile

__all__ = [
    "COLLECTIVES",
    "DEFAULT_SIZES",
    "Calibration",
    "CollectiveFit",
    "calibrate",
    "fit_collective",
    "fit_efficiency",
    "fit_line",
    "fit_link",
    "fit_optimizer",
    "calibration_from_raw",
    "format_calibration",
    "main",
    "measure",
]

#: Message sizes in bytes of the default run.
DEFAULT_SIZES: tuple[int, ...] = (1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22)
COLLECTIVES: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")

_MATMUL_N = 512
_COPY_BYTES = 32 << 20


@dataclass(frozen=True)
class CollectiveFit:
    """Samples ``(bytes, seconds)`` of one collective and the alpha-beta fitted to them."""

    kind: str
    samples: tuple[tuple[int, float], ...]
    alpha: float
    beta: float


@dataclass(frozen=True)
class Calibration:
    """Everything one calibration run measured."""

    world_size: int
    backend: str
    fits: tuple[CollectiveFit, ...]
    link: LinkCost
    peak_flops: float
    mem_bandwidth: float
    memory_bytes: int
    seconds: float
    #: peak FLOP/s per dtype besides fp32's (``(("bfloat16", rate),)``)
    dtype_flops: tuple = ()
    #: seconds per op of a program's forward and backward
    op_overhead: tuple[float, float] = (0.0, 0.0)
    #: achieved fraction of the peak per compute kind and size (:attr:`HardwareProfile.efficiency`)
    efficiency: tuple = ()
    #: ``((optimizer, per_tensor, per_element),)`` seconds of the optimizer step
    optimizer_step: tuple = ()
    #: raw ``[(work, seconds)]`` per table kind, as measured
    tables: tuple = ()
    #: seconds a training step of a compiled model costs beyond its ops, collectives and optimizer
    step_overhead: float = 0.0
    #: how much slower a rank computes while every rank does than alone (:func:`_contention`): measured and
    #: printed, not applied to the profile (see :func:`_contention`)
    contention: float = 1.0

    def profile(self, name: str | None = None) -> HardwareProfile:
        return HardwareProfile(
            name=name or f"calibrated-{self.backend}",
            description=f"measured by autoshard calibrate: {self.world_size} {self.backend} processes on "
                        f"{socket.gethostname()}",
            peak_flops=self.peak_flops,
            mem_bandwidth=self.mem_bandwidth,
            memory_bytes=self.memory_bytes,
            overlap_comm=self.backend == "nccl",
            link=self.link,
            dtype_flops=self.dtype_flops,
            op_overhead=self.op_overhead[0],
            backward_op_overhead=self.op_overhead[1],
            efficiency=self.efficiency,
            optimizer_step=self.optimizer_step,
            step_overhead=self.step_overhead,
        )


# ---- fitting ---------------------------------------------------------------------------------------------
def _relative_lstsq(rows: np.ndarray, times: np.ndarray) -> np.ndarray:
    weights = 1.0 / times
    solution, *_ = np.linalg.lstsq(rows * weights[:, None], times * weights, rcond=None)
    return solution


def fit_line(samples) -> tuple[float, float]:
    """``(intercept, slope)`` of ``seconds = intercept + slope·bytes`` over ``(bytes, seconds)`` samples."""
    xs = np.array([s[0] for s in samples], dtype=float)
    ys = np.array([s[1] for s in samples], dtype=float)
    if len(set(xs)) < 2:
        raise AutoshardError(f"Calibration has samples at {len(set(xs))} message size(s), but fitting alpha and "
                             "beta needs at least 2 distinct sizes.")
    intercept, slope = _relative_lstsq(np.stack([np.ones_like(xs), xs], axis=1), ys)
    return float(intercept), float(slope)


def _checked(what: str, alpha: float, beta: float, samples) -> LinkCost:
    if not (math.isfinite(alpha) and math.isfinite(beta) and alpha > 0 and beta > 0):
        raise AutoshardError(
            f"Calibration of {what} fitted alpha={alpha:.3g} s and beta={beta:.3g} s/B, but both must be > 0: "
            f"the times {[f'{t:.3g}' for _, t in samples]} s at sizes {[b for b, _ in samples]} B do not grow "
            "linearly with size. Use a wider range of --sizes and more --repeats on a quiet machine.")
    return LinkCost(alpha, beta)


def fit_collective(kind: str, samples, world_size: int, others: dict | None = None) -> CollectiveFit:
    """Fit one collective's samples and divide out its model coefficients. ``others``: ``{group size: samples}``
    measured on smaller groups too (pairs of ranks), fitted together with the world's by the model's coefficients
    at each group size."""
    if not others:
        intercept, slope = fit_line(samples)
        steps, wire = alpha_beta.model_coefficients(kind, world_size)
        link = _checked(kind, intercept / steps, slope / wire, samples)
        return CollectiveFit(kind, tuple(samples), link.alpha, link.beta)
    link = fit_link({kind: samples}, world_size, {kind: others})
    return CollectiveFit(kind, tuple(samples), link.alpha, link.beta)


def fit_link(samples_by_kind: dict[str, list[tuple[int, float]]], world_size: int,
             others: dict | None = None) -> LinkCost:
    """One ``(alpha, beta)`` for all collectives: least squares of ``steps_k(n)·alpha + wire_k(n)·b·beta``
    (``others``: ``{kind: {group size: samples}}`` of smaller groups, fitted with the world's)."""
    rows, times, every = [], [], []
    for kind, samples in samples_by_kind.items():
        groups = {world_size: samples, **((others or {}).get(kind) or {})}
        for n, group in groups.items():
            steps, wire = alpha_beta.model_coefficients(kind, n)
            for nbytes, t in group:
                rows.append((steps, wire * nbytes))
                times.append(t)
                every.append((nbytes, t))
    a, b = _relative_lstsq(np.array(rows, dtype=float), np.array(times, dtype=float))
    what = "all collectives together" if len(samples_by_kind) > 1 else next(iter(samples_by_kind))
    return _checked(what, float(a), float(b), every)


# ---- the worker processes --------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _min_times(fns: list, repeats: int) -> list[float]:
    """Fastest seconds of each of ``fns`` over ``repeats`` rounds; a round calls every fn once, each right after a
    barrier. A busy machine only ever adds time, so the minimum is the estimate least disturbed by it, and
    interleaving the fns spreads a busy spell over all of them."""
    import torch.distributed as dist

    for fn in fns:  # warm up buffers, connections and caches
        fn()
        fn()
    best = [math.inf] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


#: The one mesh axis of the calibration's communicator, and the inner axis of the 2 x n/2 mesh of rank pairs.
AXIS = "ranks"
PAIR_AXIS = "pair"


def _collective_call(comm, kind: str, nbytes: int, world_size: int, axis: str = AXIS):
    """``(b, fn)``: ``fn`` runs collective ``kind`` of ``b`` bytes (:mod:`~autoshard.cost_models.alpha_beta`'s ``b``)
    through ``comm``, the runtime's communicator, over its ``axis`` of ``world_size`` ranks."""
    numel = max(world_size, nbytes // 4 // world_size * world_size)  # even splits
    if kind == "all_reduce":
        t = torch.ones(numel)
        return numel * 4, lambda: comm.all_reduce_(t, axis)
    if kind == "all_gather":
        inp = torch.ones(numel // world_size)  # b is the gathered output
        return numel * 4, lambda: comm.all_gather(inp, axis, 0)
    if kind == "reduce_scatter":
        inp = torch.ones(numel)  # b is the unscattered input
        return numel * 4, lambda: comm.reduce_scatter(inp, axis, 0)
    inp = torch.ones(numel)
    return numel * 4, lambda: comm.all_to_all(inp, axis, 0, 0)


#: Sizes of the efficiency tables: square matmuls of side n, causal attention of sequence s (heads of 32) and
#: elementwise adds of n elements, each in fp32 and in bf16 (a bf16 op's rate is not fp32's: CPUs without
#: bf16 units convert, GPUs have their own bf16 peak).
_SIDES, _ELEMENTS = (32, 64, 128, 256, 512), (1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22)
#: attention's sequence lengths, at batch x heads = 4 x 8 (:data:`_ATTENTION_BATCH_HEADS`): at one work a kernel's
#: rate depends on the shape — bf16 attention's backward at [4, 8, 128, 32] ran 3.4x slower than fp32's on this CPU,
#: at [1, 4, 512, 32] (the same work order) as fast — so the probes have the batch x heads of a training step
_SEQS = (16, 32, 64, 128, 256)
_ATTENTION_BATCH_HEADS = (4, 8)
_TABLE_SIZES = {"matmul": _SIDES, "matmul.bfloat16": _SIDES, "matmul.backward": _SIDES,
                "matmul.bfloat16.backward": _SIDES, "attention": _SEQS, "attention.bfloat16": _SEQS,
                "attention.backward": _SEQS, "attention.bfloat16.backward": _SEQS,
                "memory": _ELEMENTS, "memory.bfloat16": _ELEMENTS}
_CHAIN = 100  # ops in the per-op overhead chain


def _table_case(kind: str, size: int):
    """``(work, fn)``: one op of ``kind`` at ``size`` and its work as the cost model counts it (FLOPs, or bytes for
    memory: inputs read once and the output written)."""
    dtype = torch.bfloat16 if ".bfloat16" in kind else torch.float32
    if kind.startswith("matmul") and kind.endswith(".backward"):  # a linear layer's gradients: g @ W and g.t() @ x
        a = torch.randn(size, size).to(dtype)
        return 2 * 2 * size**3, lambda: (torch.mm(a, a), torch.mm(a.t(), a))
    if kind.startswith("matmul"):  # as models run them: a linear layer's
        a = torch.randn(size, size).to(dtype)
        return 2 * size**3, lambda: torch.nn.functional.linear(a, a)
    if kind.startswith("attention"):
        batch, heads = _ATTENTION_BATCH_HEADS
        work = 4 * batch * heads * size * size * 32  # the op registry's forward FLOPs
        q, k, v = (torch.randn(batch, heads, size, 32).to(dtype) for _ in range(3))
        if not kind.endswith(".backward"):
            return work, lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        # its gradients (the registry's backward: 2.5x the forward's FLOPs), the forward's graph kept
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        grad = torch.randn_like(out)
        return 2.5 * work, lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
    x, y = torch.randn(size).to(dtype), torch.randn(size).to(dtype)
    return 3 * x.element_size() * size, lambda: torch.add(x, y)


def _rate_table(kind: str, repeats: int) -> list[tuple[float, float]]:
    """``[(work, seconds)]`` of one op of ``kind`` at each size of :data:`_TABLE_SIZES` (the fastest of
    ``repeats``)."""
    cases = [_table_case(kind, n) for n in _TABLE_SIZES[kind]]
    return list(zip([w for w, _ in cases], _min_times([fn for _, fn in cases], repeats)))


def _op_overheads(repeats: int) -> tuple[float, float]:
    """Seconds per op of a generated program's forward and of its backward: a :class:`torch.fx.GraphModule` of
    :data:`_CHAIN` elementwise ops on 8-element tensors (their work is nothing), run as compiled programs run."""
    import torch.fx

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    y = x
    for _ in range(_CHAIN):
        y = graph.call_function(torch.ops.aten.mul.Tensor, (y, x))
    graph.output(graph.call_function(torch.ops.aten.sum.default, (y,)))
    program = torch.fx.GraphModule(torch.nn.Module(), graph)
    leaf = torch.ones(8, requires_grad=True)
    forward, both = _min_times([lambda: program(leaf.detach()), lambda: program(leaf).backward()], repeats)
    return forward / (_CHAIN + 1), max(0.0, both - forward) / (_CHAIN + 1)


def _optimizer_samples(comm, repeats: int) -> list[tuple[int, int, float]]:
    """``[(tensors, elements, seconds)]`` of ``torch.optim.AdamW.step`` over DTensor parameters (replicated over
    the calibration's ranks, as a compiled model's are DTensors): many small tensors and a few large ones, to fit
    a cost per tensor and one per element."""
    from torch.distributed.tensor import DeviceMesh, Replicate, distribute_tensor

    mesh = DeviceMesh("cpu", list(range(comm.mesh.size)))
    out = []
    fns = []
    for tensors, numel in ((32, 64), (4, 1 << 18), (8, 1 << 18)):
        params = [torch.nn.Parameter(distribute_tensor(torch.randn(numel), mesh, [Replicate()]))
                  for _ in range(tensors)]
        for p in params:
            p.grad = distribute_tensor(torch.randn(numel), mesh, [Replicate()])
        opt = torch.optim.AdamW(params, lr=1e-6)
        fns.append(opt.step)
        out.append((tensors, tensors * numel))
    times = _min_times(fns, max(3, repeats // 2))
    return [(nt, ne, t) for (nt, ne), t in zip(out, times)]


def _step_overhead(profile: HardwareProfile, world_size: int, repeats: int) -> float:
    """Seconds a training step of a compiled model (data-parallel over the calibration's ranks) takes beyond what
    ``profile`` prices of it: the call's checks and bookkeeping, ``zero_grad``, the loss outside the program. The
    fastest of ``repeats`` steps of a one-layer model whose work is nothing, less ``plan.cost(profile)``'s step."""
    import autoshard
    from autoshard.mesh import Mesh

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    x = torch.randn(2 * world_size, 8)
    sharded = autoshard.compile(model, Mesh(data=world_size), (x,), profile=profile)
    local = x.chunk(world_size)[0]
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-6)

    def step():
        opt.zero_grad(set_to_none=True)
        sharded(local).sum().backward()
        opt.step()

    (measured,) = _min_times([step], repeats)
    predicted = sharded.plan.cost(profile).step_time + 2 * (profile.op_overhead + profile.backward_op_overhead)
    return max(0.0, measured - predicted)


#: seconds of matmuls each rank runs per probe of :func:`_contention`: many scheduler slices, so that ranks that share
#: a core share it for most of the probe
_CONTENTION_SECONDS = 0.05


def _contention(rank: int, world_size: int, repeats: int) -> float:
    """How much slower a rank computes while every rank computes than alone: the same matmuls (about
    :data:`_CONTENTION_SECONDS`), timed on each rank in turn while the others wait in a barrier, then on every rank
    at once; the median of each over ``max(3, repeats // 3)`` rounds, their ratio averaged over the ranks, at least 1.

    The efficiency tables time each op right after a barrier, the fastest of their repeats: a short op that finds a
    core free. In a training step the ranks compute at the same time, so ranks that outnumber the cores (4 gloo
    ranks on 2 cores: about 1.85x) each get a share of one. It is not applied to the profile: scaling every compute
    time by it (measured side by side, bench/README.md) brought the predicted steps of 4 ranks on this 2-core machine
    closer (median error 55% -> 31%) but ranked plans worse (0.462 -> 0.422 on the same measurements) and made
    bench/auto_mesh.py's choice (GPT, 4 ranks) 1.31x the fastest measured (the previous stop's, unscaled: 1.00x),
    since the collectives and the sends, where a rank waits for peers that were descheduled, stay priced as timed
    with every rank arriving together. Applied alone it would move the search's choices towards more communication
    (bench/collective_wait.py measures that wait)."""
    import statistics

    import torch.distributed as dist

    a = torch.randn(256, 256)
    start = time.perf_counter()
    for _ in range(8):
        torch.mm(a, a)
    per_mm = torch.tensor([(time.perf_counter() - start) / 8], dtype=torch.float64)
    dist.all_reduce(per_mm, op=dist.ReduceOp.MIN)  # every rank runs the same count: the fastest rank's estimate
    count = max(1, int(_CONTENTION_SECONDS / max(per_mm.item(), 1e-9)))

    def work() -> float:
        t0 = time.perf_counter()
        for _ in range(count):
            torch.mm(a, a)
        return time.perf_counter() - t0

    rounds = max(3, repeats // 3)
    alone, together = [], []
    for _ in range(rounds):
        for r in range(world_size):
            dist.barrier()
            if r == rank:
                alone.append(work())
        dist.barrier()
        together.append(work())
    dist.barrier()
    ratio = torch.tensor([statistics.median(together) / statistics.median(alone)], dtype=torch.float64)
    dist.all_reduce(ratio)
    return max(1.0, ratio.item() / world_size)


def _overlap(comm, repeats: int) -> float:
    """Fraction of an async all-reduce's time hidden behind compute run meanwhile (what the gradient buckets do in
    backward): ``(serial - together) / min(comm, compute)``, clipped to [0, 1]."""
    t = torch.ones(1 << 20)
    a = torch.randn(256, 256)
    work = lambda: [torch.mm(a, a) for _ in range(8)]  # noqa: E731

    def together():
        handle = comm.all_reduce_async(t, AXIS)
        work()
        handle.wait()

    comm_s, compute_s, both_s = _min_times([lambda: comm.all_reduce_(t, AXIS), work, together], repeats)
    hidden = comm_s + compute_s - both_s
    return float(min(1.0, max(0.0, hidden / max(1e-12, min(comm_s, compute_s)))))


def _worker(rank: int, world_size: int, port: int, backend: str, sizes: tuple[int, ...], repeats: int,
            timeout: float, out_path: str) -> None:
    import torch.distributed as dist

    from autoshard.mesh import Mesh
    from autoshard.runtime.dist import DistCommunicator

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout))
    try:
        comm = DistCommunicator(Mesh(**{AXIS: world_size}), timeout=timeout)
        samples: dict[str, list[list[float]]] = {}
        for kind in COLLECTIVES:
            calls = [_collective_call(comm, kind, size, world_size) for size in sizes]
            best = _min_times([fn for _, fn in calls], repeats)
            samples[kind] = [[nbytes, t] for (nbytes, _), t in zip(calls, best)]
        # groups of 2 as well (the axes of a 2 x n/2 mesh): the fit then holds across group sizes
        pair_samples: dict[str, list[list[float]]] = {}
        if world_size >= 4 and world_size % 2 == 0:
            pairs = DistCommunicator(Mesh(**{"outer": world_size // 2, PAIR_AXIS: 2}), timeout=timeout)
            for kind in COLLECTIVES:
                calls = [_collective_call(pairs, kind, size, 2, PAIR_AXIS) for size in sizes]
                best = _min_times([fn for _, fn in calls], repeats)
                pair_samples[kind] = [[nbytes, t] for (nbytes, _), t in zip(calls, best)]
        a, c = torch.randn(_MATMUL_N, _MATMUL_N), torch.empty(_MATMUL_N, _MATMUL_N)
        src, dst = torch.ones(_COPY_BYTES // 4), torch.empty(_COPY_BYTES // 4)
        a16, c16 = a.to(torch.bfloat16), c.to(torch.bfloat16)
        matmul_s, copy_s, matmul16_s = _min_times([lambda: torch.mm(a, a, out=c), lambda: dst.copy_(src),
                                                   lambda: torch.mm(a16, a16, out=c16)], repeats)
        overhead = _op_overheads(repeats)
        tables = {kind: _rate_table(kind, repeats) for kind in _TABLE_SIZES}
        optimizer = _optimizer_samples(comm, repeats)
        overlap = _overlap(comm, repeats)
        contention = _contention(rank, world_size, repeats)

        times = torch.tensor([t for kind in COLLECTIVES for _, t in samples[kind]]
                             + [t for kind in pair_samples for _, t in pair_samples[kind]], dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a collective is as slow as its slowest rank
        rates = torch.tensor([2 * _MATMUL_N**3 / matmul_s, 2 * _COPY_BYTES / copy_s, 2 * _MATMUL_N**3 / matmul16_s],
                             dtype=torch.float64)
        dist.all_reduce(rates)
        rates /= world_size
        # ranks share the machine: per-op and per-size times averaged over ranks, as the rates are
        flat = torch.tensor([*overhead, *[t for k in _TABLE_SIZES for _, t in tables[k]],
                             *[t for _, _, t in optimizer], overlap], dtype=torch.float64)
        dist.all_reduce(flat)
        flat = iter((flat / world_size).tolist())
        overhead = [next(flat), next(flat)]
        tables = {k: [(w, next(flat)) for w, _ in tables[k]] for k in _TABLE_SIZES}
        optimizer = [(nt, ne, next(flat)) for nt, ne, _ in optimizer]
        overlap = next(flat)
        flat = iter(times.tolist())
        counts = {kind: sum(1 for r in comm.log if r.kind == kind) for kind in COLLECTIVES}
        result = {"samples": {kind: [[int(nb), next(flat)] for nb, _ in samples[kind]] for kind in COLLECTIVES},
                  "pair_samples": {kind: [[int(nb), next(flat)] for nb, _ in pair_samples[kind]]
                                   for kind in pair_samples},
                  "peak_flops": rates[0].item(), "mem_bandwidth": rates[1].item(),
                  "bfloat16_flops": rates[2].item(), "op_overhead": overhead, "tables": tables,
                  "optimizer": optimizer, "overlap": overlap, "contention": contention,
                  "transport": type(comm).__name__, "calls": counts}
        # every rank has the same numbers now: the profile they give prices a tiny compiled model's step, and
        # what its measured step takes beyond that is the fixed cost of a training step
        profile = calibration_from_raw(result, world_size, backend, 0.0).profile()
        result["step_overhead"] = _step_overhead(profile, world_size, repeats)
        if rank == 0:
            Path(out_path).write_text(json.dumps(result))
    finally:
        from autoshard.runtime.dist import shutdown

        shutdown()  # every group destroyed (and its gloo threads joined) before the interpreter exits


def _run_workers(world_size: int, backend: str, sizes: tuple[int, ...], repeats: int, timeout: float) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="autoshard-calibrate-") as tmp:
        out_path = os.path.join(tmp, "result.json")
        args = (world_size, _free_port(), backend, sizes, repeats, timeout, out_path)
        ctx = mp.start_processes(_worker, args=args, nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    raise CollectiveTimeoutError(
                        f"Calibration with {world_size} {backend} processes did not finish within {timeout:g} s; "
                        "its processes were killed. Raise --timeout or use smaller --sizes.")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            raise AutoshardError(f"Calibration rank {e.error_index} failed (exit code "
                                 f"{getattr(e, 'exit_code', '?')}): {e}") from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join(5)
        return json.loads(Path(out_path).read_text())


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def measure(world_size: int = 2, sizes: tuple[int, ...] = DEFAULT_SIZES, backend: str = "gloo",
            repeats: int = 10, timeout: float = 60.0) -> Calibration:
    """Run the measurements described in the module docstring and fit them."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
        raise AutoshardError(f"Calibration has world_size={world_size!r}, but needs at least 2 processes.")
    if repeats < 1:
        raise AutoshardError(f"Calibration has repeats={repeats!r}, but needs at least 1.")
    sizes = tuple(sorted({int(s) for s in sizes}))
    if len(sizes) < 2 or sizes[0] <= 0:
        raise AutoshardError(f"Calibration has sizes={list(sizes)}, but needs at least 2 distinct positive sizes "
                             "in bytes.")
    start = time.monotonic()
    raw = _run_workers(world_size, backend, sizes, repeats, timeout)
    return calibration_from_raw(raw, world_size, backend, time.monotonic() - start)


def calibration_from_raw(raw: dict, world_size: int, backend: str, seconds: float) -> Calibration:
    """The fits of one run's raw measurements (what the worker processes send back)."""
    samples = {kind: [(int(nb), float(t)) for nb, t in raw["samples"][kind]] for kind in COLLECTIVES}
    pairs = {kind: {2: [(int(nb), float(t)) for nb, t in v]} for kind, v in raw.get("pair_samples", {}).items()}
    fits = tuple(fit_collective(kind, samples[kind], world_size, pairs.get(kind)) for kind in COLLECTIVES)
    joint = fit_link(samples, world_size, pairs)
    overhead = (float(raw["op_overhead"][0]), float(raw["op_overhead"][1]))
    tables = {k: [(float(w), float(t)) for w, t in v] for k, v in raw["tables"].items()}
    peaks, efficiency = fit_efficiency(tables, overhead[0])
    return Calibration(
        world_size=world_size,
        backend=backend,
        fits=fits,
        link=LinkCost(joint.alpha, joint.beta, tuple((f.kind, LinkCost(f.alpha, f.beta)) for f in fits),
                      overlap=float(raw["overlap"])),
        peak_flops=peaks["matmul"],
        mem_bandwidth=peaks["memory"],
        memory_bytes=_physical_memory() // world_size,
        seconds=seconds,
        dtype_flops=(("bfloat16", peaks["matmul.bfloat16"]),),
        op_overhead=overhead,
        efficiency=efficiency,
        optimizer_step=tuple((name, *fit_optimizer(raw["optimizer"])) for name in ("adam", "adamw")),
        tables=tuple((k, tuple(v)) for k, v in tables.items()),
        step_overhead=float(raw.get("step_overhead", 0.0)),
        contention=float(raw.get("contention", 1.0)),
    )


def fit_efficiency(tables: dict, overhead: float) -> tuple[dict, tuple]:
    """The peaks and efficiency tables of measured ``{kind: [(work, seconds)]}``: each size's rate is its work over
    its time less the per-op ``overhead`` (the cost model adds that apart); a kind's peak is its best rate, except
    where the cost model prices the kind against another peak: attention against the matmul peak of its dtype, and
    memory in any dtype against the one memory bandwidth (fp32's adds). Each size's fraction is its rate over that
    peak."""
    def rate(w, t):
        return w / max(t - overhead, 0.1 * t)

    peaks = {k: max(rate(w, t) for w, t in v) for k, v in tables.items()}
    for k in tables:
        kind, _, rest = k.partition(".")
        dtype = rest.removesuffix("backward").rstrip(".")
        if kind in ("attention", "matmul") and k != "matmul" + (f".{dtype}" if dtype else ""):
            peaks[k] = peaks["matmul" + (f".{dtype}" if dtype else "")]  # (backward: the forward's peak)
        elif kind == "memory" and dtype:
            peaks[k] = peaks["memory"]
    efficiency = tuple((k, tuple((w, min(1.0, rate(w, t) / peaks[k])) for w, t in v)) for k, v in tables.items())
    return peaks, efficiency


def fit_optimizer(samples) -> tuple[float, float]:
    """``(per_tensor, per_element)`` seconds fitted to ``[(tensors, elements, seconds)]`` (least squares on relative
    error, clipped at 0)."""
    rows = np.array([(nt, ne) for nt, ne, _ in samples], dtype=float)
    times = np.array([t for _, _, t in samples], dtype=float)
    per_tensor, per_element = _relative_lstsq(rows, times)
    return max(0.0, float(per_tensor)), max(0.0, float(per_element))


def calibrate(world_size: int = 2, sizes: tuple[int, ...] = DEFAULT_SIZES, backend: str = "gloo",
              repeats: int = 10, timeout: float = 60.0, name: str | None = None) -> HardwareProfile:
    """A :class:`HardwareProfile` measured on this machine (see :func:`measure`)."""
    return measure(world_size, sizes, backend, repeats, timeout).profile(name)


# ---- output ----------------------------------------------------------------------------------------------
def _rows(cal: Calibration) -> list[tuple[str, str, str, str]]:
    rows = [(f.kind, f"{f.alpha * 1e6:.3g}", f"{1 / f.beta / 1e9:.3g}",
             ", ".join(f"{_human(b)}: {t * 1e6:.4g}" for b, t in f.samples)) for f in cal.fits]
    rows.append(("link (joint fit)", f"{cal.link.alpha * 1e6:.3g}", f"{cal.link.bandwidth / 1e9:.3g}", ""))
    return rows


def _human(nbytes: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{unit}"
    return f"{nbytes}B"


_HEADER = ("collective", "alpha (us)", "bandwidth (GB/s)", "time per size (us)")


def format_calibration(cal: Calibration) -> str:
    """Plain-text table of a calibration run (the CLI prints the same rows with rich)."""
    rows = [_HEADER, *_rows(cal)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(_HEADER))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    per = "".join(f" ({k} {v / 1e9:.3g})" for k, v in cal.dtype_flops)
    lines.append(f"peak {cal.peak_flops / 1e9:.3g} GFLOP/s{per}, memory bandwidth {cal.mem_bandwidth / 1e9:.3g} GB/s, "
                 f"memory {cal.memory_bytes / 2**30:.3g} GiB per rank ({cal.world_size} {cal.backend} ranks, "
                 f"{cal.seconds:.1f} s)")
    for kind, pts in cal.efficiency:
        lines.append(f"efficiency {kind}: " + ", ".join(f"{w:.3g}: {f:.2f}" for w, f in pts))
    lines.append(f"per op: forward {cal.op_overhead[0] * 1e6:.3g} us, backward {cal.op_overhead[1] * 1e6:.3g} us; "
                 f"per step {cal.step_overhead * 1e3:.3g} ms; gradient reductions hidden behind compute: "
                 f"{cal.link.overlap:.2f}; compute {cal.contention:.2f}x slower with every rank computing than "
                 "alone (not applied)")
    for name, per_tensor, per_element in cal.optimizer_step:
        lines.append(f"optimizer {name}: {per_tensor * 1e6:.3g} us per tensor, {per_element * 1e9:.3g} ns per element")
    return "\n".join(lines)


def _parse_size(text: str) -> int:
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    digits = t[:-1] if scale != 1 else t
    if not digits.isdigit():
        raise argparse.ArgumentTypeError(f"size {text!r} is not a byte count such as 4096, 64K or 4M")
    return int(digits) * scale


def main(argv: list[str] | None = None) -> int:
    """``autoshard calibrate``: measure this machine, write the profile TOML, print the fit."""
    parser = argparse.ArgumentParser(
        prog="autoshard calibrate",
        description="Measure alpha-beta links, FLOP/s and memory bandwidth of this machine with real processes, "
                    "and write them as a hardware profile TOML.")
    parser.add_argument("-o", "--output", default="calibrated.toml",
                        help="profile TOML to write (default: calibrated.toml)")
    parser.add_argument("--name", default=None, help="profile name (default: calibrated-<backend>)")
    parser.add_argument("--world-size", type=int, default=2, help="processes to spawn (default 2)")
    parser.add_argument("--sizes", default=",".join(_human(s) for s in DEFAULT_SIZES),
                        help="message sizes, comma-separated (e.g. 1K,16K,1M)")
    parser.add_argument("--backend", default="gloo", help="torch.distributed backend (default gloo)")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per size (default 10)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds before the run is killed")
    args = parser.parse_args(argv)
    try:
        sizes = tuple(_parse_size(s) for s in args.sizes.split(",") if s.strip())
    except argparse.ArgumentTypeError as e:
        parser.error(str(e))
    try:
        cal = measure(args.world_size, sizes, args.backend, args.repeats, args.timeout)
    except AutoshardError as e:
        print(f"autoshard calibrate: {e}", file=sys.stderr)
        return 1
    path = save_profile(cal.profile(args.name), args.output)

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"alpha-beta fit, {cal.world_size} {cal.backend} ranks")
    for h in _HEADER:
        table.add_column(h)
    for row in _rows(cal):
        table.add_row(*row)
    console = Console()
    console.print(table)
    console.print(format_calibration(cal).splitlines()[-1])
    console.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
