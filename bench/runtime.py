"""Runtime speed of autoshard's per-rank programs next to DTensor (tensor parallel) and DDP (data parallel).

Two gloo processes on 127.0.0.1 run, side by side in one run, on the same model, the same data, the same
2-rank mesh and the same transport (gloo's collectives: autoshard's ``DistCommunicator`` calls
``torch.distributed`` on its process groups, as DTensor and DDP do), forward + backward steps (gradients set to
None before each; no optimizer) of:

* tensor parallel, ``Mesh(model=2)``, Megatron plan (column-parallel q/k/v and first MLP linear, row-parallel
  output projections; embeddings and LM head replicated):
  - **autoshard** (headline): the ``ShardedModule`` a user runs — ``autoshard.compile(model, mesh, args,
    annotations=..., comm=..., bucket_cap_mb=25)`` called as a module: its DTensor parameters bound to the rank program
    per call (``autoshard.runtime.parameters.bound``), the agreement check of every call (started before the forward,
    settled before the program's first collective), gradients as DTensors;
    ``autoshard-SP`` (the block) the same with sequence parallelism;
  - **autoshard rank module** (secondary): the bare program the ShardedModule runs,
    ``plan.rank_program(rank, bucket_grads=True)`` with a ``GradBucketer`` (plain tensors, direct collectives; the
    few parameter gradient syncs, here the row-parallel biases, bucketed): what the ShardedModule adds per call is
    the difference;
  - **DTensor**: ``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel`` and ``PrepareModuleInput`` on
    the attention and MLP inputs (the torchtitan layout: one input all-reduce in backward per sub-block);
* data parallel, ``Mesh(data=2)``:
  - **autoshard** (headline): the ``ShardedModule`` (``bucket_cap_mb=25``: the buckets DDP cuts with that cap,
    launched asynchronously as they fill; the loss all-reduce left in flight);
  - **autoshard rank module** / **autoshard-unbucketed rank module** (secondary): the bare program with
    :class:`~autoshard.runtime.buckets.GradBucketer`, and without buckets (one blocking all-reduce per parameter);
  - **DDP**: ``DistributedDataParallel(bucket_cap_mb=25)``, and DDP plus an async all-reduce of its loss (waited
    at the end of backward): DDP returns each rank's local loss, autoshard the global one.

Gradients: after the warm-up steps every headline row's gradients are compared with its reference's (tp: DTensor,
dp: DDP), every parameter whole (``full_tensor()``); the run fails (exit status 1, a banner) when one differs by
more than 1e-5 of the reference's largest entry, or when any parameter was not compared.

Cases: an MLP, one GPT block, a 4-layer GPT. Repetitions are interleaved: in each, every system in turn (the
order rotating) runs one untimed step and then two timed steps back to back, as a training loop runs its steps
(caches warm with its own weights, not another system's); its time in that repetition is the mean of the two
timed steps of the slower rank. The reported step time is the median over repetitions, so load from other
work on the machine hits every system alike; the ratio is the median over repetitions of the
per-repetition ratio to the baseline (paired: drift in machine speed cancels), with a 95% bootstrap interval of
that median; absolute times are noisy.
Per-rank peak memory is measured in one extra, untimed step per system with
``torch.distributed._tools.mem_tracker.MemTracker`` (parameters, gradients, activations, temporaries). Bytes are
autoshard's own collective log (``CollectiveRecord``: each rank's input bytes per collective) for one step,
next to the analytic Megatron count (2 all-reduces of b·s·h per layer forward and 2 backward) and, for data
parallel, the parameter bytes that DDP all-reduces; DTensor's collectives are counted with ``CommDebugMode``.

    python bench/runtime.py               # the README table (a few minutes on 2 cores)
    python bench/runtime.py --quick       # small shapes, few repetitions, forked processes: a smoke run
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # run as a script (and in spawned workers): make `examples` importable
    sys.path.insert(0, str(_ROOT))

# Each repetition runs every system in turn for 1 untimed + TIMED_PER_BURST timed steps back to back, as a
# training loop runs them (warm caches); the repetition's time of a system is the mean of its timed steps.
TIMED_PER_BURST = 2
SIZES = {
    "full": {
        "mlp": {"batch": 64, "hidden": 512},
        "block": {"batch": 8, "seq": 128, "hidden": 256, "heads": 8},
        "gpt4": {"batch": 8, "seq": 64, "hidden": 256, "heads": 8, "vocab": 1024, "layers": 4},
        # repetitions per case: the short steps get more, so every ratio's interval is about as narrow
        "reps": {"mlp": 120, "block": 50, "gpt4": 30},
    },
    "quick": {
        "mlp": {"batch": 8, "hidden": 64},
        "block": {"batch": 2, "seq": 16, "hidden": 64, "heads": 4},
        "gpt4": {"batch": 2, "seq": 16, "hidden": 64, "heads": 4, "vocab": 128, "layers": 4},
        "reps": {"mlp": 3, "block": 3, "gpt4": 3},
    },
}


#: the secondary rows: the bare rank programs (``plan.rank_program``) the ShardedModule binds its parameters to
TP_BARE, SP_BARE = "tp/autoshard rank module", "tp/autoshard-SP rank module"
DP_BARE, DP_UNBUCKETED = "dp/autoshard rank module", "dp/autoshard-unbucketed rank module"
#: row order: the reference, the headline ShardedModule rows, then the secondary ones
ORDER = ("tp/DTensor", "tp/autoshard", "tp/autoshard-SP", TP_BARE, SP_BARE,
         "dp/DDP", "dp/DDP+loss all-reduce", "dp/autoshard", DP_BARE, DP_UNBUCKETED)


class BlockLoss(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        from examples.models import Block

        self.block = Block(hidden, heads)

    def forward(self, x):
        return self.block(x).pow(2).mean()


def _case(name: str, size: dict):
    """(model, args, autoshard Megatron annotations on the model axis, DTensor plan, analytic (fwd, bwd, numel))."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    from examples import models

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)

    def block_plan(prefix):
        prep = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False
        )
        return {
            f"{prefix}attn": prep,
            f"{prefix}attn.q": ColwiseParallel(),
            f"{prefix}attn.k": ColwiseParallel(),
            f"{prefix}attn.v": ColwiseParallel(),
            f"{prefix}attn.out": RowwiseParallel(),
            f"{prefix}mlp": prep,
            f"{prefix}mlp.0": ColwiseParallel(),
            f"{prefix}mlp.2": RowwiseParallel(),
        }

    def block_ann(prefix):
        return {k.replace("blocks.*.", prefix): v for k, v in models.MEGATRON["gpt"].items() if k.startswith("blocks")}

    if name == "mlp":
        b, h = size["batch"], size["hidden"]
        model = models.MLP(h, 4 * h)
        args = (torch.randn(b, h, generator=g), torch.randn(b, h, generator=g))
        # the input needs no gradient, so no backward all-reduce: 1 forward all-reduce of b·h
        return model, args, models.MEGATRON["mlp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}, (1, 0, b * h)
    if name == "block":
        b, s, h = size["batch"], size["seq"], size["hidden"]
        model = BlockLoss(h, size["heads"])
        args = (torch.randn(b, s, h, generator=g),)
        return model, args, block_ann("block."), block_plan("block."), (2, 2, b * s * h)
    b, s, h, layers = size["batch"], size["seq"], size["hidden"], size["layers"]
    model = models.GPT(size["vocab"], h, size["heads"], layers, s)
    ids = torch.randint(0, size["vocab"], (b, s), generator=g)
    labels = torch.randint(0, size["vocab"], (b, s), generator=g)
    plan = {}
    for i in range(layers):
        plan.update(block_plan(f"blocks.{i}."))
    return model, (ids, labels), block_ann("blocks.*."), plan, (2 * layers, 2 * layers, b * s * h)


def _local_heads_forward(self, x):
    # DTensor's ColwiseParallel hands out local shards: the attention works on its local heads (as in torchtitan).
    b, s, _ = x.shape
    q, k, v = (p(x).view(b, s, self.local_heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.out(y.transpose(1, 2).reshape(b, s, -1))


def _step(fn, params):
    for p in params:
        p.grad = None
    loss = fn()
    loss.backward()
    return loss


def _peak_bytes(fn, params, modules) -> int | None:
    try:
        from torch.distributed._tools.mem_tracker import MemTracker

        mt = MemTracker()
        mt.track_external(*modules)
        with mt:
            _step(fn, params)
        snap = mt.get_tracker_snapshot("peak")
        return int(sum(v.get("Total", 0) for v in snap.values()))
    except Exception:  # noqa: BLE001 - a tracker failure must not lose the timings
        return None


def _worker(rank, world_size, quick, cases=("mlp", "block", "gpt4"), reps=None):
    import copy
    import warnings

    warnings.filterwarnings("ignore")

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.nn.parallel import DistributedDataParallel

    import autoshard
    from autoshard.compiler.plan import loss_of
    from autoshard.runtime import DistCommunicator, use
    from autoshard.runtime.buckets import GradBucketer

    sizes = SIZES["quick" if quick else "full"]
    reps_of = {name: reps or sizes["reps"][name] for name in cases}
    tp_mesh, dp_mesh = autoshard.Mesh(model=2), autoshard.Mesh(data=2)
    tp_comm, dp_comm = DistCommunicator(tp_mesh, timeout=300), DistCommunicator(dp_mesh, timeout=300)
    device_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("model",))
    out = {}
    for name in cases:
        model, args, ann, dt_plan, analytic = _case(name, sizes[name])
        systems = {}
        # ---- tensor parallel ----
        tp_plan = autoshard.compile(model, tp_mesh, args, annotations={k: (v,) for k, v in ann.items()}).plan
        # as ShardedModule runs it (bucket_cap_mb=25); the weights given again: compiling on a known rank released them
        tp_mod = tp_plan.rank_program(rank, weights=model, bucket_grads=True)
        GradBucketer(tp_mod, comm=tp_comm, bucket_cap_mb=25)
        tp_args, _ = tp_plan.shard_inputs(rank, args)

        def as_tp(m=tp_mod, a=tp_args):
            with use(tp_comm):
                return loss_of(m(*a))

        systems[TP_BARE] = (as_tp, list(tp_mod.parameters()), [tp_mod], tp_comm)
        sp_ann = {**{k: (v,) for k, v in ann.items()}, "x": ("S(1)",)}
        if name == "block":  # sequence parallelism: the block's input and residual sharded along the sequence
            sp_plan = autoshard.compile(model, tp_mesh, args, annotations=sp_ann, sequence_parallel=True).plan
            sp_mod = sp_plan.rank_program(rank, weights=model, bucket_grads=True)
            GradBucketer(sp_mod, comm=tp_comm, bucket_cap_mb=25)
            sp_args, _ = sp_plan.shard_inputs(rank, args)

            def as_sp(m=sp_mod, a=sp_args):
                with use(tp_comm):
                    return loss_of(m(*a))

            systems[SP_BARE] = (as_sp, list(sp_mod.parameters()), [sp_mod], tp_comm)
        dt_model = copy.deepcopy(model)
        for m in dt_model.modules():
            if hasattr(m, "heads") and hasattr(m, "q"):
                m.local_heads = m.heads // 2
                m.forward = types.MethodType(_local_heads_forward, m)
        parallelize_module(dt_model, device_mesh, dt_plan)

        def dt_tp(m=dt_model, a=args):
            return m(*a)

        systems["tp/DTensor"] = (dt_tp, list(dt_model.parameters()), [dt_model], None)
        # ---- data parallel ----
        dp_plan = autoshard.compile(model, dp_mesh, args).plan
        dp_args, _ = dp_plan.shard_inputs(rank, args)
        dp_mod = dp_plan.rank_program(rank, weights=model, bucket_grads=True)
        GradBucketer(dp_mod, comm=dp_comm, bucket_cap_mb=25)
        dp_plain = dp_plan.rank_program(rank, weights=model)

        def as_dp(m=dp_mod, a=dp_args):
            with use(dp_comm):
                return loss_of(m(*a))

        def as_dp_plain(m=dp_plain, a=dp_args):
            with use(dp_comm):
                return loss_of(m(*a))

        ddp = DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=25)

        def ddp_step(m=ddp, a=dp_args):
            return m(*a)

        systems[DP_BARE] = (as_dp, list(dp_mod.parameters()), [dp_mod], dp_comm)
        systems[DP_UNBUCKETED] = (as_dp_plain, list(dp_plain.parameters()), [dp_plain], dp_comm)
        systems["dp/DDP"] = (ddp_step, list(ddp.parameters()), [ddp], None)
        # DDP returns each rank's local loss; autoshard returns the global one (for a mean cross-entropy, the exact
        # global mean, which needs the global target count). The cheapest way to give DDP the same: all-reduce the
        # loss asynchronously after forward and wait at the end of backward.
        ddp_g = DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=25)

        def ddp_global_loss_step(m=ddp_g, a=dp_args):
            loss = m(*a)
            total = loss.detach().clone()
            work = dist.all_reduce(total, async_op=True)

            def wait_after_backward(grad):  # runs as backward starts; the wait runs when it ends
                torch.autograd.Variable._execution_engine.queue_callback(work.wait)

            loss.register_hook(wait_after_backward)
            return loss

        systems["dp/DDP+loss all-reduce"] = (ddp_global_loss_step, list(ddp_g.parameters()), [ddp_g], None)
        # the headline rows: what a user runs, the ShardedModule (``autoshard.compile(...)`` called as a module, its
        # DTensor parameters bound to the same rank programs per call, bucket_cap_mb=25), made last, on copies of
        # the model (compiling on a known rank lets go of the model's own weights)
        sm_tp = autoshard.compile(copy.deepcopy(model), tp_mesh, args, annotations={k: (v,) for k, v in ann.items()},
                                  comm=tp_comm, bucket_cap_mb=25)
        sm_dp = autoshard.compile(copy.deepcopy(model), dp_mesh, args, comm=dp_comm, bucket_cap_mb=25)

        def sm_step(m, a):
            return loss_of(m(*a))

        systems["tp/autoshard"] = (functools.partial(sm_step, sm_tp, tp_args), list(sm_tp.parameters()),
                                   [sm_tp], tp_comm)
        if name == "block":
            sm_sp = autoshard.compile(copy.deepcopy(model), tp_mesh, args, annotations=sp_ann, sequence_parallel=True,
                                      comm=tp_comm, bucket_cap_mb=25)
            systems["tp/autoshard-SP"] = (functools.partial(sm_step, sm_sp, sp_args), list(sm_sp.parameters()),
                                          [sm_sp], tp_comm)
        systems["dp/autoshard"] = (functools.partial(sm_step, sm_dp, dp_args), list(sm_dp.parameters()),
                                   [sm_dp], dp_comm)
        compared_with = {"tp/autoshard": (sm_tp, "tp/DTensor", dt_model), "dp/autoshard": (sm_dp, "dp/DDP", ddp)}
        if name == "block":
            compared_with["tp/autoshard-SP"] = (sm_sp, "tp/DTensor", dt_model)

        # warm-up, losses, bytes and collective counts of one step
        info = {}
        for key, (fn, params, mods, comm) in systems.items():
            _step(fn, params)
            if comm is not None:
                comm.log.clear()
            with CommDebugMode() as cdm:
                loss = _step(fn, params)
            rec = {"loss": float(loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach())}
            if comm is not None:
                rec["bytes"] = sum(r.nbytes for r in comm.log)
                rec["act_bytes"] = sum(r.nbytes for r in comm.log if r.numel == analytic[2])
                rec["wire"] = _wire_bytes(comm.log, 2)
                rec["n_coll"] = len(comm.log)
            else:  # DTensor's collectives (CommDebugMode sees DTensor dispatch, not DDP's reducer)
                rec["n_coll"] = cdm.get_total_counts() if key.startswith("tp/") else "-"
            rec["peak"] = _peak_bytes(fn, params, mods)
            info[key] = rec
        # every headline row's gradients against its reference's, whole (the last step above left them: the
        # same inputs and weights everywhere); DDP's parameters are under `module.`
        info["gradients"] = _compare_gradients(compared_with)
        times = {k: [] for k in systems}
        keys = list(systems)
        for rep in range(reps_of[name]):
            order = keys[rep % len(keys) :] + keys[: rep % len(keys)]
            for key in order:
                fn, params = systems[key][0], systems[key][1]
                _step(fn, params)  # a training loop runs its own steps back to back: warm up after the switch
                burst = []
                for _ in range(TIMED_PER_BURST):
                    dist.barrier()
                    t0 = time.perf_counter()
                    _step(fn, params)
                    burst.append(time.perf_counter() - t0)
                times[key].append(burst)
        for key in systems:
            info[key]["times"] = times[key]
        info["analytic"] = analytic
        info["params"] = sum(p.numel() for p in model.parameters())
        out[name] = info
    return out


def _whole(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _compare_gradients(compared_with: dict) -> dict:
    """{system: (max |grad diff| over the reference's parameters, how many compared, the names not compared)}:
    every parameter's whole gradient (``full_tensor()`` where it is a DTensor; collectives in the same order on
    every rank) against the reference module's; a gradient missing on either side is not compared and named."""
    out = {}
    for key, (module, _, reference) in compared_with.items():
        ours = dict(module.named_parameters())
        diff, compared, missing = 0.0, 0, []
        for name, p in reference.named_parameters():
            name = name.removeprefix("module.")
            mine = ours.pop(name, None)
            if mine is None or mine.grad is None or p.grad is None:
                missing.append(name)
                continue
            a, b = _whole(mine.grad), _whole(p.grad)
            if a.shape != b.shape:
                missing.append(f"{name} (shapes {list(a.shape)} vs {list(b.shape)})")
                continue
            compared += 1
            diff = max(diff, (a - b).abs().max().item() / max(1.0, b.abs().max().item()))
        missing += [f"{name} (not in the reference)" for name in ours]
        out[key] = (diff, compared, missing)
    return out


#: the largest |grad diff| (relative to the reference gradient's largest entry, or absolute below 1) counted equal
GRAD_TOLERANCE = 1e-5


def check(results, cases) -> list[str]:
    """The headline rows whose gradients differ from their reference's beyond ``GRAD_TOLERANCE`` or were not all
    compared, on any rank; empty when every comparison ran and agreed."""
    problems = []
    for name in cases:
        for r, per_rank in enumerate(results):
            for key, (diff, compared, missing) in per_rank[name]["gradients"].items():
                if not diff <= GRAD_TOLERANCE:  # (nan fails too)
                    problems.append(f"{name} {key} rank {r}: max |grad diff| {diff:.3e} > {GRAD_TOLERANCE:g}")
                if missing or not compared:
                    problems.append(f"{name} {key} rank {r}: {compared} gradients compared, not compared: "
                                    + ", ".join(missing[:10]))
    return problems


def _bootstrap_ci(values: list[float], reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of the median of ``values`` (fixed seed: the same data gives the same interval)."""
    import random

    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(reps))
    return medians[int(0.025 * reps)], medians[int(0.975 * reps) - 1]


def _wire_bytes(log, n: int) -> float:
    """Bytes each rank sends under ring algorithms: all-reduce 2(n-1)/n of its input, reduce-scatter (n-1)/n,
    all-gather (n-1) (its input is the shard)."""
    factor = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_gather": n - 1}
    return sum(factor.get(r.kind, 1) * r.nbytes for r in log)


def _fmt_bytes(n) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def report(results, cases) -> str:
    lines = []
    rows = [
        (
            "case",
            "system",
            "step (ms)",
            "ratio [95% CI]",
            "peak mem/rank",
            "bytes/rank/step",
            "analytic bytes",
            "wire bytes (analytic)",
            "collectives/step",
        )
    ]
    for name in cases:
        per_rank = [r[name] for r in results]
        fwd, bwd, numel = per_rank[0]["analytic"]
        params = per_rank[0]["params"]

        def slower(key, per_rank=per_rank):
            # per repetition: the mean over its timed steps of the slower rank's time
            return [
                statistics.fmean(max(step) for step in zip(*bursts))
                for bursts in zip(*(pr[key]["times"] for pr in per_rank))
            ]

        def med(key):
            return statistics.median(slower(key)) * 1e3

        def paired_ratio(key, base):
            # the systems of one repetition run back to back: their ratio cancels the machine's slow drift
            ratios = [t / b for t, b in zip(slower(key), slower(base))]
            return statistics.median(ratios), _bootstrap_ci(ratios)

        for group, base in (("tp", "tp/DTensor"), ("dp", "dp/DDP")):
            keys = sorted((k for k in per_rank[0] if k.startswith(group + "/")), key=ORDER.index)
            for key in keys:
                rec = per_rank[0][key]
                t = med(key)
                ratio, interval = paired_ratio(key, base)
                if group == "tp":
                    analytic = (fwd + bwd) * numel * 4
                else:
                    analytic = params * 4  # DDP all-reduces every gradient once
                bytes_ = rec.get("bytes")
                if "-SP" in key:
                    b_txt = _fmt_bytes(bytes_)
                elif bytes_ is not None and group == "tp":
                    extra = bytes_ - rec["act_bytes"]
                    b_txt = f"{_fmt_bytes(rec['act_bytes'])} + {_fmt_bytes(extra)} bias"
                else:
                    b_txt = _fmt_bytes(bytes_) if bytes_ is not None else "-"
                peak = max((pr[key]["peak"] or 0) for pr in per_rank) or None
                wire_analytic = analytic  # Megatron and DDP only all-reduce: 2(n-1)/n = 1 for n=2
                wire = _fmt_bytes(rec["wire"]) if "wire" in rec else "-"
                rows.append(
                    (
                        name,
                        key,
                        f"{t:.1f}",
                        "{:.2f} [{:.2f}, {:.2f}]".format(ratio, *interval),
                        _fmt_bytes(peak),
                        b_txt,
                        _fmt_bytes(analytic),
                        f"{wire} ({_fmt_bytes(wire_analytic)})",
                        str(rec["n_coll"]),
                    )
                )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for i, r in enumerate(rows):
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
        if i == 0:
            lines.append("| " + " | ".join("-" * w for w in widths) + " |")
    losses, grads = [], []
    for name in cases:
        rec = results[0][name]
        losses.append(f"{name}: " + ", ".join(f"{k} {rec[k]['loss']:.6f}" for k in rec if "/" in k))
        for key in rec["gradients"]:
            diff = max(r[name]["gradients"][key][0] for r in results)
            compared = min(r[name]["gradients"][key][1] for r in results)
            grads.append(f"{name} {key}: {diff:.1e} over {compared}")
    return (
        "\n".join(lines) + "\n\nlosses (rank 0; DDP's is its local half-batch loss, the others the global "
        "batch's): " + "; ".join(losses) + "\n\nmax |grad diff| of the headline rows against their reference "
        "(tp: DTensor, dp: DDP; every parameter's whole gradient, relative to its largest entry, max over ranks): "
        + "; ".join(grads)
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes and 3 repetitions (a smoke run)")
    parser.add_argument("--cases", nargs="+", default=["mlp", "block", "gpt4"], choices=["mlp", "block", "gpt4"])
    parser.add_argument("--reps", type=int, default=None,
                        help="repetitions per system and case (default mlp 120, block 50, gpt4 30; quick 3), each "
                        f"1 untimed + {TIMED_PER_BURST} timed steps")
    a = parser.parse_args(argv)
    from autoshard.runtime import spawn

    t0 = time.time()
    # --quick forks the 2 processes from a forkserver that has imported torch and autoshard once (a smoke run; the
    # full run starts 2 fresh interpreters)
    results = spawn(_worker, 2, a.quick, tuple(a.cases), a.reps, timeout=1800,
                    start_method="forkserver" if a.quick else "spawn")
    sizes = SIZES["quick" if a.quick else "full"]
    reps = {name: a.reps or sizes["reps"][name] for name in a.cases}
    print(
        f"2 gloo processes, 1 thread each; step = median over {reps} interleaved repetitions of 1 untimed + "
        f"{TIMED_PER_BURST} timed steps back to back (slower rank); "
        f"ratio = median over repetitions of (step time / DTensor's (tp) or DDP's (dp) in the same repetition), "
        f"with a 95% bootstrap interval of that median; sizes { ({k: v for k, v in sizes.items() if k != 'reps'}) }"
    )
    print(report(results, a.cases))
    print(f"\n({time.time() - t0:.0f} s)")
    problems = check(results, a.cases)
    if problems:  # loudly: rows that compute different gradients are not comparable timings
        print("\n" + "!" * 100 + "\nGRADIENTS DIFFER, OR A COMPARISON DID NOT RUN:\n  " + "\n  ".join(problems)
              + "\n" + "!" * 100)
        raise SystemExit(1)
    return results


if __name__ == "__main__":
    main()
