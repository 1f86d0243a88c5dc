"""Context parallelism against data parallelism at a long sequence: HF Llama (hidden 256, 2 layers, GQA 8/4 heads)
at sequence 4096 on 4 gloo ranks, the same global batch, one training step (forward + backward) each:

* **context=1**: one rank, the whole batch and sequence (the same global shape; one gloo process);
* **data=4**: ``Mesh(data=4)`` — each rank the whole sequence of a quarter of the batch;
* **context=4**: ``Mesh(context=4)`` with ``context_axis="context"`` (ring attention, head-tail balanced) — each
  rank every sequence of the batch, a quarter of each.

Reported per rank (max over ranks), and as the ratio context=4 / context=1: peak memory of the step measured by
``torch.distributed._tools.mem_tracker.MemTracker`` (tensors allocated during forward + backward, parameters and
gradients included; its "Total" at the peak) and by the CPU allocator (``torch.profiler`` memory events above the
step's start, plus the parameters: it also sees what a custom op allocates inside its kernel, which MemTracker's
dispatch mode does not — ring attention's score blocks), the bytes autograd saves for attention (measured), the
memory model's estimate of the same step (``plan.cost().memory``: peak and activations), and the step time (median
of ``--steps`` steps after one warm-up, side by side in the same processes' run order).

    python bench/context_parallel.py              # seq 4096, batch 8 (several minutes on 2 cores)
    python bench/context_parallel.py --quick      # seq 512
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

MiB = 2**20
CASES = {"data=4": ("data=4", None), "context=4": ("context=4", "context")}


def _model(seq: int, batch: int):
    from examples import models

    return models.hf_llama(batch=batch, seq=seq, layers=2, hidden=256, heads=8, kv_heads=4, vocab=512)


def _allocator_peak(prof) -> int:
    """The most bytes the CPU allocator held above the profile's start: unlike MemTracker (a dispatch mode, blind
    inside a custom op's kernel), it sees every allocation, the score blocks of ring attention included. Read from
    the profiler's event tree (``function_events`` keeps only the allocation events outside any op)."""
    from torch._C._profiler import _EventType

    events, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        e = todo.pop()
        todo.extend(e.children)
        if e.tag == _EventType.Allocation:
            events.append((e.start_time_ns, e.extra_fields.alloc_size))
    cur = peak = 0
    for _, size in sorted(events, key=lambda x: x[0]):
        cur += size
        peak = max(peak, cur)
    return peak


def _worker(rank: int, world: int, seq: int, batch: int, steps: int, cases=CASES, comm_of=None):
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.profiler import ProfilerActivity, profile

    import autoshard
    from autoshard.compiler.plan import loss_of
    from autoshard.runtime import DistCommunicator, use
    from tests.test_context_parallel import _saved_by_attention

    torch.set_num_threads(1)
    out = {}
    for name, (mesh_text, axis) in cases.items():
        model, args, kwargs = _model(seq, batch)
        plan = autoshard.compile(model, autoshard.Mesh.parse(mesh_text), args, kwargs, context_axis=axis).plan
        comm = DistCommunicator(plan.mesh, timeout=600) if comm_of is None else comm_of(plan.mesh)
        module = plan.rank_program(rank)
        a, k = plan.shard_inputs(rank, args, kwargs)
        del model
        times = []
        with use(comm):
            for step in range(steps + 1):
                for p in module.parameters():
                    p.grad = None
                comm.barrier()
                t0 = time.perf_counter()
                if step == 0:
                    tracker = MemTracker()
                    tracker.track_external(module)
                    with tracker, profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                        loss = loss_of(module(*a, **k))
                        saved = _saved_by_attention(loss)
                        loss.backward()
                    alloc = _allocator_peak(prof) + sum(p.numel() * p.element_size() for p in module.parameters())
                    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] \
                        if torch.device("cpu") in tracker.get_tracker_snapshot("peak") else None
                else:
                    loss_of(module(*a, **k)).backward()
                comm.barrier()
                times.append(time.perf_counter() - t0)
        cost = plan.cost("cpu-gloo")
        out[name] = dict(peak=peak, alloc=alloc, saved=saved, time=statistics.median(times[1:]),
                         est_peak=cost.memory_per_rank, est_act=cost.memory.activations, est_time=cost.step_time)
    return out


def main(argv=None) -> None:
    from autoshard.runtime import spawn

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="sequence 512")
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    opts = ap.parse_args(argv)
    seq = opts.seq or (512 if opts.quick else 4096)
    # one gloo process, not a simulator thread: the profiler records the allocator's events of the main thread only
    (one,) = spawn(_worker, 1, seq, opts.batch, opts.steps, {"context=1": ("context=1", None)}, timeout=3000)
    results = spawn(_worker, 4, seq, opts.batch, opts.steps, timeout=3000)
    rows = {"context=1": one["context=1"]}
    rows.update({name: {key: max(r[name][key] for r in results) for key in results[0][name]} for name in CASES})
    print(f"HF Llama hidden 256, 2 layers, seq {seq}, global batch {opts.batch}, 4 gloo ranks (max over ranks)")
    print(f"{'':12} {'peak MiB':>10} {'alloc MiB':>10} {'attn saved MiB':>15} {'est peak MiB':>13} {'est act MiB':>12} "
          f"{'step s':>8} {'est step s':>11}")
    for name, r in rows.items():
        print(f"{name:12} {r['peak'] / MiB:10.1f} {r['alloc'] / MiB:10.1f} {r['saved'] / MiB:15.1f} "
              f"{r['est_peak'] / MiB:13.1f} {r['est_act'] / MiB:12.1f} {r['time']:8.3f} {r['est_time']:11.3f}")
    c4 = rows["context=4"]
    for base in ("context=1", "data=4"):
        c1 = rows[base]
        print(f"ratio context=4/{base}: peak memory {c4['peak'] / c1['peak']:.3f} (estimated "
              f"{c4['est_peak'] / c1['est_peak']:.3f}), attention saved {c4['saved'] / c1['saved']:.3f}, "
              f"step time {c4['time'] / c1['time']:.3f} (estimated {c4['est_time'] / c1['est_time']:.3f})")
    for name, r in rows.items():
        print(f"{name}: estimated / measured peak memory {r['est_peak'] / r['peak']:.3f} (MemTracker), "
              f"{r['est_peak'] / r['alloc']:.3f} (allocator), step time "
              f"{r['est_time'] / r['time']:.3f}")


if __name__ == "__main__":
    main()
