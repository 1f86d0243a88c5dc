"""Pipeline parallelism at run time: stage modules driven by ``torch.distributed.pipelining``.

No home-made scheduler: each rank wraps the GraphModule(s) of the stage(s) it holds in :class:`StageModule`, gives
them to ``PipelineStage`` with static metadata (example tensors of the received activations and of the outputs,
``requires_grad=True`` on every stage's outputs and on every input but stage 0's, which avoids the dynamic shape
exchange), and runs one of the schedules of :data:`SCHEDULES`. The per-rank program inside a stage still calls the
collectives of :mod:`autoshard.runtime.collective_ops` on the data/model axes, through the communicator made current
with :func:`autoshard.runtime.use`.

Inputs of the model reach every stage as keyword arguments (the schedules chunk them into microbatches on every
rank and pass them to every stage), so a stage that needs the labels or the input ids reads them directly and
only activations travel between stages. Parameters used by several stages (a tied embedding and LM head) exist
once per stage; :func:`sum_shared_grads` adds their gradients over the pipe group after the schedule's backward.

This module never imports the compiler: it receives GraphModules, names and shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from autoshard.errors import AutoshardError

__all__ = ["SCHEDULES", "StageModule", "broadcast_loss", "broadcast_losses", "build_schedule", "make_stage",
           "sum_shared_grads", "sync_grads_once"]


def _schedules() -> dict[str, tuple[type, type]]:
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleLoopedBFS

    # name -> (class with one stage per rank, class with several stages per rank)
    return {"gpipe": (ScheduleGPipe, ScheduleLoopedBFS), "1f1b": (Schedule1F1B, ScheduleInterleaved1F1B),
            "interleaved": (Schedule1F1B, ScheduleInterleaved1F1B)}


SCHEDULES = ("gpipe", "1f1b", "interleaved")


class StageModule(torch.nn.Module):
    """One stage: ``forward(*activations, **model_inputs)`` calls the stage's GraphModule with the activations
    received from the previous stage followed by the model inputs it reads (``inputs``, by name)."""

    def __init__(self, inner: torch.nn.Module, inputs: Sequence[str]):
        super().__init__()
        self.inner = inner
        self.inputs = tuple(inputs)

    def forward(self, *acts, **model_inputs):
        missing = [n for n in self.inputs if n not in model_inputs]
        if missing:
            raise AutoshardError(f"pipeline stage needs model inputs {missing}, but the step got only "
                                 f"{sorted(model_inputs)}: pass every input of the model to step().")
        from autoshard.runtime.zero import running

        with running(self.inner):  # ZeRO-3 gathers: not kept for backward (autoshard.runtime.zero)
            return self.inner(*acts, *(model_inputs[n] for n in self.inputs))


def make_stage(module: StageModule, stage_index: int, num_stages: int, act_meta, out_meta, group,
               device: torch.device | None = None):
    """A ``PipelineStage`` with static metadata. ``act_meta``/``out_meta``: ``(shape, dtype)`` per tensor."""
    from torch.distributed.pipelining import PipelineStage

    device = device or torch.device("cpu")

    def examples(meta, grad: bool):
        return tuple(torch.zeros(s, dtype=d, device=device).requires_grad_(grad) for s, d in meta)

    inputs = examples(act_meta, stage_index > 0) if act_meta else None
    return PipelineStage(module, stage_index, num_stages, device, input_args=inputs,
                         output_args=examples(out_meta, True), group=group)


def build_schedule(stages: list, schedule: str, microbatches: int, loss_fn: Callable):
    """The ``torch.distributed.pipelining`` schedule ``schedule`` over this rank's ``stages``."""
    table = _schedules()
    if schedule not in table:
        raise AutoshardError(f"pipeline schedule is {schedule!r}, but must be one of {list(table)}.")
    single, multi = table[schedule]
    if len(stages) == 1 and schedule != "interleaved":
        return single(stages[0], microbatches, loss_fn=loss_fn)
    return multi(stages, microbatches, loss_fn=loss_fn)


def sum_shared_grads(modules: Sequence[StageModule], shared: Sequence[tuple[str, tuple[int, ...], torch.dtype]],
                     group) -> None:
    """Sum the gradients of parameters held by several stages over the pipe ``group`` (every rank of the group
    calls this with the same ``shared`` list; ranks without a copy contribute zeros). Two stages of one rank that
    hold the same parameter share one tensor (:class:`autoshard.api.pipelined_module.PipelineRunner` ties them): its
    gradient, already the sum of both stages', is counted once."""
    for fqn, shape, dtype in shared:
        copies = _unique(p for m in modules if (p := _param(m.inner, fqn)) is not None)
        total = torch.zeros(shape, dtype=dtype, device=copies[0].device if copies else None)
        for p in copies:
            if p.grad is not None:
                total += p.grad
        dist.all_reduce(total, group=group)
        for p in copies:
            if p.grad is None:
                p.grad = total.clone()
            else:
                p.grad.copy_(total)


def _unique(params) -> list:
    out, seen = [], set()
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def sync_grads_once(modules: Sequence[StageModule], comm, bucket_bytes: int | None = None) -> None:
    """The data-parallel gradient sync, once per step instead of once per microbatch.

    Stage programs generated with ``bucket_grads=True`` leave out the ``grad_all_reduce`` of each parameter and
    list it in ``module.meta[GRAD_SYNC]`` as ``(name, axes)``. After the schedule has run every microbatch's
    backward, the accumulated gradients of those parameters are all-reduced here over their axes, flattened into
    one buffer per (axes, dtype) — or, with ``bucket_bytes``, into buckets of at most that many bytes each (a
    parameter larger than that is a bucket of its own), in the programs' order: the same sums as per-microbatch
    syncs (summation is linear), with ``m`` times fewer collectives. Every rank of a group lists the same
    parameters in the same order (same stage program); a parameter two stages of this rank share is synced once.
    """
    from autoshard.runtime.buckets import GRAD_SYNC

    groups: dict[tuple, list[torch.nn.Parameter]] = {}
    seen: set[int] = set()
    for m in modules:
        for name, axes in getattr(m.inner, "meta", {}).get(GRAD_SYNC, ()):
            p = _param(m.inner, name)
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                groups.setdefault((tuple(axes), p.dtype), []).append(p)
    for (axes, _), params in groups.items():
        for bucket in _buckets(params, bucket_bytes):
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in bucket])
            for axis in axes:
                flat = comm.all_reduce(flat, axis, phase="backward")
            offset = 0
            for p in bucket:
                g = flat[offset: offset + p.numel()].view_as(p)
                offset += p.numel()
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)


def _buckets(params: list, cap: int | None) -> list[list]:
    """``params`` cut, in order, into runs of at most ``cap`` bytes each (one run: no cap)."""
    if cap is None:
        return [params]
    out, current, size = [], [], 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if current and size + nbytes > cap:
            out.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        out.append(current)
    return out


def _param(module: torch.nn.Module, fqn: str):
    obj = module
    for part in fqn.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if isinstance(obj, torch.nn.Parameter) else None


def broadcast_loss(losses: list, is_last: bool, last_group_rank: int, group) -> torch.Tensor:
    """The step's loss (mean of the microbatch losses) from the rank holding the last stage, on every rank of the
    pipe group."""
    return broadcast_losses(losses, is_last, last_group_rank, group, len(losses) or 1).mean()


def broadcast_losses(losses: list, is_last: bool, last_group_rank: int, group, microbatches: int,
                     device: torch.device | None = None) -> torch.Tensor:
    """The ``microbatches`` losses of one step (the schedule fills ``losses`` on the rank of the last stage), as a
    float32 vector on ``device`` (default: the CPU) on every rank of the pipe group."""
    if is_last:
        value = torch.stack([x.detach().reshape(()).float() for x in losses]).to(device or "cpu")
    else:
        value = torch.zeros(microbatches, device=device)
    dist.broadcast(value, src=dist.get_global_rank(group, last_group_rank), group=group)
    return value


def model_loss(out_spec, loss_fn: Callable | None, pick_loss: Callable) -> Callable:
    """The schedule's ``loss_fn(output, target)``: rebuild the model's output from the last stage's flat outputs,
    then apply the user's ``loss_fn(output, target)`` or take the model's own loss (``pick_loss``)."""

    def fn(output, target):
        leaves = list(output) if isinstance(output, (tuple, list)) else [output]
        value = pytree.tree_unflatten(leaves, out_spec) if out_spec is not None else output
        return loss_fn(value, target) if loss_fn is not None else pick_loss(value)

    return fn
