"""Does the cost model predict the clock? Predicted vs measured step time and peak memory, 4 gloo ranks.

One run, on this machine:

1. ``autoshard calibrate`` on 4 gloo processes (:func:`autoshard.cost_models.calibrate.measure`), the profile the
   cost model reads (unless ``--profile`` names one);
2. for each model (a GPT, Hugging Face Llama and GPT-2) and each plan below, on 4 fresh gloo processes: compile
   with that profile, run ``--warmup`` training steps and ``--steps`` timed ones (``zero_grad``, forward, backward,
   ``AdamW.step``; each rank's step timed from a barrier, the slowest rank's time kept, the median over steps),
   then one step under the allocator's eye (``torch.profiler`` memory events with every CPU block sized, from one
   step before: the most bytes the CPU allocator held above the step's start, plus the blocks alive at the start
   that the step frees, plus what lives across steps: parameters, optimizer state, buffers);
3. the prediction of the same plan from the same profile: ``plan.cost(profile)`` (step time with the optimizer
   step, the memory peak per rank), and for the pipeline the stages' estimate (``stages_json``) and
   ``stage_memory`` of the rank's stage.

Plans (each on the 4 ranks): ``dp`` data=4; ``zero3`` data=4 with ``zero=3``; ``tp`` Megatron on model=4; ``tp_sp``
the same with sequence parallelism; ``recompute`` Megatron on data=2 x model=2 with every layer recomputed;
``bf16`` data=4 under ``MixedPrecision(bf16)``; ``moe_ep`` every FFN as a 4-expert top-2 MoE with experts on
data=4 (all-to-all); ``cp_ring`` context=4 with ring attention; ``pipeline`` pipe=2 x data=2, 1F1B, 4
microbatches.

Printed: one row per (model, plan) with predicted and measured step time and memory and their errors
(``predicted / measured - 1``), then the Spearman rank correlation of step times over all plans and the median and
largest absolute errors. These are benchmark numbers, not asserts; ``--quick`` (a smoke run in the test suite)
uses small shapes (one layer), each plan once on one of the models in turn, one warm-up and one timed step, its 4
processes forked from a forkserver that has imported torch, autoshard and transformers once (the full run starts 4
fresh interpreters).

    python bench/fidelity.py                 # calibrate, then 3 models x 9 plans (about 10 minutes on 2 cores)
    python bench/fidelity.py --quick         # small shapes, 1 layer, 1 timed step
    python bench/fidelity.py --models gpt --plans dp,tp
    python bench/fidelity.py --world 2 --json run.json   # 2 ranks (on a 2-core machine: one core each)
    python bench/fidelity.py --repredict run.json --profile other.toml   # run.json's plans priced by another profile
    python bench/fidelity.py --alone --profile cal.toml   # the compute model alone: one rank, no contention
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

MiB = 2**20
WORLD = 4
PLANS = ("dp", "zero3", "tp", "tp_sp", "recompute", "bf16", "moe_ep", "cp_ring", "pipeline")
MODELS = ("gpt", "hf_llama", "hf_gpt2")
#: (batch, seq, layers, hidden) of the full run and of --quick
SHAPES = {"full": dict(batch=16, seq=128, layers=4, hidden=256), "quick": dict(batch=8, seq=32, layers=1, hidden=64)}
#: module globs of each model's decoder layers and FFNs
LAYERS = {"gpt": "blocks.*", "hf_llama": "model.layers.*", "hf_gpt2": "transformer.h.*"}
FFNS = {"gpt": "blocks.*.mlp", "hf_llama": "model.layers.*.mlp", "hf_gpt2": "transformer.h.*.mlp"}


def build_model(name: str, shape: dict):
    from examples import models

    kw = dict(batch=shape["batch"], seq=shape["seq"], layers=shape["layers"], hidden=shape["hidden"], vocab=512)
    if name == "hf_llama":
        return models.hf_llama(heads=8, kv_heads=4, **kw)
    return getattr(models, name)(heads=8, **kw)


def plan_options(name: str, plan: str, world: int = WORLD):
    """(mesh text, compile options) of ``plan`` on model ``name`` over ``world`` ranks (a power of 2, at least 2:
    the meshes above with 4 read as ``world``, and data=2 x model=2 as data=world/2 x model=2, pipe=2 x data=2 as
    pipe=2 x data=world/2; an axis of size 1 is left out)."""
    import torch

    import autoshard
    from examples import models

    def text(**axes) -> str:
        return ",".join(f"{k}={v}" for k, v in axes.items() if v > 1)

    if plan == "dp":
        return text(data=world), {}
    if plan == "zero3":
        return text(data=world), {"zero": 3}
    if plan in ("tp", "tp_sp"):
        mesh = autoshard.Mesh(model=world)
        return text(model=world), {"annotations": models.megatron(mesh, name), "sequence_parallel": plan == "tp_sp"}
    if plan == "recompute":
        mesh = autoshard.Mesh.parse(text(data=world // 2, model=2))
        return text(data=world // 2, model=2), {"annotations": models.megatron(mesh, name), "recompute": LAYERS[name]}
    if plan == "bf16":
        return text(data=world), {"precision": autoshard.MixedPrecision(param_dtype=torch.bfloat16)}
    if plan == "moe_ep":
        return text(data=world), {"moe": autoshard.MoE(layers=FFNS[name], num_experts=4, top_k=2, expert_axis="data")}
    if plan == "cp_ring":
        return text(context=world), {"context_axis": autoshard.ContextParallel("context", attention="ring")}
    if plan == "pipeline":
        return text(pipe=2, data=world // 2), {"pipeline": autoshard.Pipeline(microbatches=4, schedule="1f1b")}
    raise ValueError(f"unknown plan {plan!r}; the plans are {PLANS}")


def _count_every_block(on: bool) -> None:
    """Have c10's CPU memory reporter size every block on every thread (its flag ``caffe2_report_cpu_memory_usage``),
    not only blocks allocated while the profiler runs on the allocating thread. Without it the profiler misses the
    frees of blocks made before it started ("Memory block of unknown size was allocated before the profiling
    started": the pipeline's gradients of the previous step, let go at the next step's start) and frees on other
    threads (a gloo work's buffers, dropped on gloo's thread), so a block freed early seemed alive to the step's
    end. With it, each allocation event's ``total_allocated`` is the bytes of every block made since, all threads.
    Off while steps are timed: the flag costs microseconds per allocation."""
    import ctypes
    import glob

    import torch

    libs = glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.*"))
    if not libs:
        raise RuntimeError("bench/fidelity.py measures memory through c10's flag caffe2_report_cpu_memory_usage, "
                           f"but found no libc10 library under {os.path.dirname(torch.__file__)}/lib.")
    ctypes.c_bool.in_dll(ctypes.CDLL(libs[0]), "FLAGS_caffe2_report_cpu_memory_usage").value = on


def _allocator_peak(prof, live_ptrs=frozenset()) -> int:
    """The most bytes the CPU allocator held during the profiled step above what it held at the start, plus the
    blocks alive at the start that the step frees (not ``live_ptrs``: the parameters' and optimizer state's
    storages, counted by :func:`_live_bytes`) — the runtime's state of the previous step the step lets go of
    (the pipeline's stage gradients): at any moment the step's own blocks and those not yet freed are held.
    From the profiler's allocation events under :func:`_count_every_block`: ``total_allocated`` after each
    event, all threads."""
    from torch._C._profiler import _EventType

    events, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        e = todo.pop()
        todo.extend(e.children)
        if e.tag == _EventType.Allocation:
            f = e.extra_fields
            events.append((e.start_time_ns, f.alloc_size, f.ptr, f.total_allocated))
    if not events:
        return 0
    events.sort(key=lambda x: x[0])
    start = events[0][3] - events[0][1]
    peak, made, freed_old = 0, set(), 0
    for _, size, ptr, total in events:
        if size > 0:
            made.add(ptr)
        elif ptr in made:
            made.discard(ptr)
        elif ptr not in live_ptrs:
            freed_old -= size
        peak = max(peak, total - start)
    return peak + freed_old


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _live_bytes(params, optimizer, buffers, seen: set | None = None) -> int:
    """Bytes of the tensors that live across steps: this rank's parameters, optimizer state and buffers (each
    storage once; their data pointers are added to ``seen``)."""
    seen, total = set() if seen is None else seen, 0
    tensors = [_local(p) for p in params] + [_local(b) for b in buffers]
    tensors += [_local(v) for state in optimizer.state.values() for v in state.values() if hasattr(v, "numel")]
    for t in tensors:
        if t.device.type == "meta":
            continue
        key = t.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


def _stage_buffers(pipelined_module) -> list:
    """The receive buffers ``torch.distributed.pipelining`` keeps across steps for this rank's stages: one per
    microbatch for each activation a stage receives and for the gradient of each activation it sends (made at the
    first step, written in place after)."""
    schedule = pipelined_module.runner().schedule
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    return [info.buffer for st in stages for infos in (*st.args_recv_info.values(), *st.grad_recv_info.values())
            for info in infos if getattr(info, "buffer", None) is not None]


def _step_fn(sharded, pipelined: bool, args, kwargs, optimizer):
    from autoshard.compiler.plan import loss_of

    def step(marks=None):
        optimizer.zero_grad(set_to_none=True)
        if pipelined:
            loss = sharded(*args, **kwargs)
        else:
            loss = loss_of(sharded(*args, **kwargs))
            loss.backward()
        if marks is not None:
            marks.append(time.perf_counter())
        optimizer.step()
        return loss

    return step


def _options(name: str, plan: str, world: int, profile_path: str) -> tuple[str, dict]:
    """:func:`plan_options` with the pipeline's stages split by ``profile_path`` (the profile every plan is priced
    with)."""
    import autoshard

    mesh_text, opts = plan_options(name, plan, world)
    if "pipeline" in opts:
        opts["pipeline"] = autoshard.Pipeline(microbatches=opts["pipeline"].microbatches,
                                              schedule=opts["pipeline"].schedule, profile=profile_path)
    return mesh_text, opts


def _predict(plan, pipelined: bool, rank: int, profile) -> dict:
    """The cost model's prediction for ``rank`` of a plan (a pipeline's :class:`PipelinePlan`): step time and
    memory, and for the pipeline the rank's stage."""
    if pipelined:
        from autoshard.compiler.report import stages_json

        stage = plan.stages_of(rank)[0]
        return {"time": stages_json(plan)["estimated_step_s"], "memory": plan.stage_memory(stage, rank),
                "stage": stage}
    cost = plan.cost(profile)
    return {"time": cost.step_time, "memory": cost.memory_per_rank, "stage": None, "opt": cost.optimizer_time,
            "comm": cost.comm_time}


def _worker(rank: int, world: int, pairs: list, shape: dict, profile_path: str, warmup: int, steps: int) -> dict:
    import torch

    from autoshard.cost_models.profile import load_profile

    torch.set_num_threads(1)
    prof_obj = load_profile(profile_path)
    out = {}
    for name, plan in pairs:
        try:
            out[(name, plan)] = _measure(rank, world, name, plan, shape, profile_path, prof_obj, warmup, steps)
        except Exception as e:  # the same on every rank (a plan refused): a row saying so, the run goes on
            out[(name, plan)] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    return out


def _measure(rank, world, name, plan, shape, profile_path, prof_obj, warmup, steps) -> dict:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    import autoshard

    mesh_text, opts = _options(name, plan, world, profile_path)
    mesh = autoshard.Mesh.parse(mesh_text)
    torch.manual_seed(0)
    model, args, kwargs = build_model(name, shape)
    t0 = time.perf_counter()
    sharded = autoshard.compile(model, mesh, args, kwargs, profile=profile_path, **opts)
    pipelined = plan == "pipeline"
    if pipelined:
        a, k = args, kwargs  # a pipelined module takes the global batch
    else:
        a = tuple(autoshard.data_shard(x, mesh, rank) for x in args)
        k = {key: autoshard.data_shard(v, mesh, rank) if isinstance(v, torch.Tensor) else v
             for key, v in kwargs.items()}
    del model
    optimizer = torch.optim.AdamW(list(sharded.parameters()), lr=1e-4)
    step = _step_fn(sharded, pipelined, a, k, optimizer)
    for _ in range(warmup):
        step()
    compile_s = time.perf_counter() - t0
    times, opt_times = [], []
    for _ in range(steps):
        dist.barrier()
        t = time.perf_counter()
        marks = []
        step(marks)
        times.append(time.perf_counter() - t)
        opt_times.append(times[-1] - (marks[0] - t))
    slowest = torch.tensor(times + opt_times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    slowest, slowest_opt = slowest[:steps], slowest[steps:]
    # memory: one step to size the blocks that live from one step into the next, then the measured one
    _count_every_block(True)
    try:
        step()
        optimizer.zero_grad(set_to_none=True)
        buffers = list(sharded.buffers()) if not pipelined else _stage_buffers(sharded)
        live_ptrs: set = set()
        live = _live_bytes(sharded.parameters(), optimizer, buffers, live_ptrs)
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
    finally:
        _count_every_block(False)
    peak = live + _allocator_peak(prof, live_ptrs)
    pred = _predict(sharded.plan, pipelined, rank, prof_obj)
    return {"time": statistics.median(slowest.tolist()), "memory": peak,
            "opt_time": statistics.median(slowest_opt.tolist()),
            "pred_opt": pred.get("opt", 0.0), "pred_comm": pred.get("comm", 0.0),
            "pred_time": pred["time"], "pred_memory": pred["memory"], "stage": pred["stage"],
            "mesh": mesh_text, "setup_s": compile_s}


def predict(name: str, plan: str, shape: dict, profile_path: str, world: int = WORLD) -> dict:
    """The cost model's prediction of one (model, plan) in this process, no ranks started: the same plan as
    :func:`_measure` compiles (:func:`autoshard.plan`, no process group needed) priced by the same calls as
    :func:`_predict`, as ``{stage: (step seconds, largest memory over the stage's ranks)}`` (stage None: no
    pipeline). ``--repredict`` prices a saved run's plans with another profile: cost models compared on the
    same measurements."""
    import torch

    import autoshard
    from autoshard.cost_models.profile import load_profile

    mesh_text, opts = _options(name, plan, world, profile_path)
    if "context_axis" in opts:
        opts["context_parallel"] = opts.pop("context_axis")
    mesh = autoshard.Mesh.parse(mesh_text)
    torch.manual_seed(0)
    model, args, kwargs = build_model(name, shape)
    planned = autoshard.plan(model, mesh, args, kwargs, **opts)
    profile, out = load_profile(profile_path), {}
    pipelined = "pipeline" in opts
    for rank in range(mesh.size) if pipelined else (0,):  # each stage's largest memory over its ranks, as run() keeps
        p = _predict(planned, pipelined, rank, profile)
        t, m = out.get(p["stage"], (p["time"], 0))
        out[p["stage"]] = (t, max(m, p["memory"]))
    return out


def repredict(rows: list[dict], shape: dict, profile_path: str, world: int) -> list[dict]:
    """``rows`` of a saved run with their predictions made again from ``profile_path`` (:func:`predict`); the
    measurements are kept as they were."""
    cache, out = {}, []
    for r in rows:
        if "error" in r:
            out.append(r)
            continue
        plan = r["plan"].split(" ")[0]
        key = (r["model"], plan)
        if key not in cache:
            cache[key] = predict(r["model"], plan, shape, profile_path, world)
        stage = int(r["plan"].split(" s")[1]) if " s" in r["plan"] else None
        t, m = cache[key][stage]
        out.append({**r, "pred_time": t, "pred_memory": m, "pred_opt": 0.0, "pred_comm": 0.0})
    return out


def alone(models: list[str], shape: dict, profile_path: str, steps: int = 5, warmup: int = 2,
          world: int = WORLD) -> list[dict]:
    """The compute model without ranks: each model planned on one rank (``data=1``) at the per-rank batch of the
    data-parallel plan on ``world`` ranks, in fp32 and under ``MixedPrecision(bf16)``; its rank program's forward +
    backward timed in this process (one thread, a 1-rank gloo group: the median of ``steps``) beside
    ``plan.cost().compute_time``. What the multi-rank rows miss beyond this is the ranks sharing the machine, not
    the ops' prices."""
    import torch
    import torch.distributed as dist

    import autoshard
    from autoshard.cost_models.profile import load_profile
    from autoshard.runtime import DistCommunicator

    if dist.is_initialized():
        raise RuntimeError("bench/fidelity.py --alone makes its own 1-rank process group: run it outside torchrun")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        comm = DistCommunicator(autoshard.Mesh(data=1))
        return _alone_rows(models, dict(shape, batch=shape["batch"] // world), load_profile(profile_path), comm,
                           steps, warmup)
    finally:
        from autoshard.runtime.dist import shutdown

        shutdown()  # this communicator's groups and the default one (their gloo threads joined), as a run ends
        torch.set_num_threads(threads)


def _alone_rows(models, per_rank, profile, comm, steps, warmup) -> list[dict]:
    import torch

    import autoshard
    from autoshard.compiler.plan import loss_of
    from autoshard.runtime import use

    rows = []
    for name in models:
        for precision in ("fp32", "bf16"):
            opts = {} if precision == "fp32" else {"precision": autoshard.MixedPrecision(param_dtype=torch.bfloat16)}
            torch.manual_seed(0)
            model, args, kwargs = build_model(name, per_rank)
            plan = autoshard.plan(model, autoshard.Mesh(data=1), args, kwargs, **opts)
            program = plan.rank_program(0)
            a, k = plan.shard_inputs(0, args, kwargs)
            times = []
            for _ in range(warmup + steps):
                for p in program.parameters():
                    p.grad = None
                with use(comm):
                    t = time.perf_counter()
                    loss_of(program(*a, **k)).backward()
                    times.append(time.perf_counter() - t)
            rows.append({"model": name, "precision": precision, "batch": per_rank["batch"],
                         "time": statistics.median(times[warmup:]), "pred_time": plan.cost(profile).compute_time})
    return rows


def spearman(xs, ys) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(xs, ys).statistic)


def run(pairs, shape, profile_path, warmup, steps, timeout=3600, start_method="spawn", world=WORLD) -> list[dict]:
    """Every (model, plan) pair measured and predicted: one row per (model, plan, stage) with the largest memory
    over the ranks of that stage. ``start_method="forkserver"`` (``--quick``) forks the 4 processes from a server
    that has imported torch, autoshard and transformers once, not 4 fresh interpreters importing them each."""
    from autoshard.runtime import spawn

    results = spawn(_worker, world, list(pairs), shape, profile_path, warmup, steps, timeout=timeout,
                    start_method=start_method)
    rows = []
    for key in results[0]:
        per_rank = [r[key] for r in results]
        if any("error" in r for r in per_rank):
            error = next(r["error"] for r in per_rank if "error" in r)
            rows.append({"model": key[0], "plan": key[1], "mesh": "", "error": error, "timed": False})
            continue
        stages = sorted({r["stage"] for r in per_rank}, key=lambda s: -1 if s is None else s)
        for stage in stages:
            mine = [r for r in per_rank if r["stage"] == stage]
            label = key[1] if stage is None else f"{key[1]} s{stage}"
            rows.append({"model": key[0], "plan": label, "mesh": mine[0]["mesh"], "time": mine[0]["time"],
                         "pred_time": mine[0]["pred_time"], "memory": max(r["memory"] for r in mine),
                         "pred_memory": max(r["pred_memory"] for r in mine),
                         "setup_s": max(r["setup_s"] for r in mine), "timed": stage in (None, 0),
                         "opt_time": mine[0]["opt_time"], "pred_opt": mine[0]["pred_opt"],
                         "pred_comm": mine[0]["pred_comm"]})
    return rows


def summary(rows: list[dict]) -> dict:
    """Rank correlation and errors over the rows that ran (``errors``: how many plans failed)."""
    ran = [r for r in rows if "error" not in r]
    timed = [r for r in ran if r["timed"]]
    t_err = [abs(r["pred_time"] / r["time"] - 1) for r in timed]
    m_err = [abs(r["pred_memory"] / r["memory"] - 1) for r in ran]
    return {"rank_correlation": spearman([r["pred_time"] for r in timed], [r["time"] for r in timed]),
            "time_median_error": statistics.median(t_err), "time_max_error": max(t_err),
            "memory_median_error": statistics.median(m_err), "memory_max_error": max(m_err),
            "plans": len(timed), "errors": len(rows) - len(ran)}


def format_rows(rows: list[dict]) -> str:
    head = (f"{'model':9} {'plan':13} {'mesh':15} {'pred ms':>9} {'meas ms':>9} {'err':>7} {'pred MiB':>9} "
            f"{'meas MiB':>9} {'err':>7} {'opt pred':>9} {'opt meas':>9} {'comm pred':>9}")
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['model']:9} {r['plan']:13} failed: {r['error']}")
            continue
        t = (f"{r['pred_time'] * 1e3:9.1f} {r['time'] * 1e3:9.1f} {r['pred_time'] / r['time'] - 1:+7.1%}"
             if r["timed"] else f"{'':9} {'':9} {'':7}")
        lines.append(f"{r['model']:9} {r['plan']:13} {r['mesh']:15} {t} {r['pred_memory'] / MiB:9.2f} "
                     f"{r['memory'] / MiB:9.2f} {r['pred_memory'] / r['memory'] - 1:+7.1%} "
                     f"{r['pred_opt'] * 1e3:9.1f} {r['opt_time'] * 1e3:9.1f} {r['pred_comm'] * 1e3:9.1f}")
    s = summary(rows)
    lines.append(f"step time over {s['plans']} plans: rank correlation {s['rank_correlation']:.3f}, median error "
                 f"{s['time_median_error']:.1%}, largest {s['time_max_error']:.1%}; peak memory: median error "
                 f"{s['memory_median_error']:.1%}, largest {s['memory_max_error']:.1%}"
                 + (f"; {s['errors']} plan(s) failed" if s["errors"] else ""))
    return "\n".join(lines)


def main(argv=None) -> dict:
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # the profiler's start/stop lines, from every rank
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small shapes and one timed step: a smoke run")
    ap.add_argument("--models", default=None, help=f"comma-separated, of {', '.join(MODELS)} (default all)")
    ap.add_argument("--plans", default=None, help=f"comma-separated, of {', '.join(PLANS)} (default all)")
    ap.add_argument("--profile", default=None, help="a profile TOML (default: calibrate now on 4 gloo ranks)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per plan (default 5; 1 with --quick)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 2; 1 with --quick)")
    ap.add_argument("--json", default=None, help="also write the rows and the summary to this file")
    ap.add_argument("--world", type=int, default=WORLD, help=f"gloo ranks (default {WORLD}; a power of 2)")
    ap.add_argument("--alone", action="store_true",
                    help="start no ranks: each model's forward + backward on one rank in fp32 and bf16, measured "
                         "beside the compute the cost model prices (needs --profile)")
    ap.add_argument("--repredict", default=None, metavar="RUN.json",
                    help="start no ranks: price the plans of a run saved by --json again with --profile, beside "
                         "that run's measurements")
    opts = ap.parse_args(argv)
    if opts.world < 2 or opts.world & (opts.world - 1):
        ap.error(f"--world {opts.world}: the plans need a power of 2, at least 2")
    if opts.repredict:
        if opts.profile is None:
            ap.error("--repredict prices a saved run again: give the --profile to price it with")
        with open(opts.repredict) as f:
            saved = json.load(f)
        shape = saved.get("shape") or SHAPES["full"]
        rows = repredict(saved["rows"], shape, opts.profile, saved.get("world", WORLD))
        print(f"{opts.repredict}'s measurements, predicted again from {opts.profile}")
        print(format_rows(rows))
        result = {"rows": rows, "summary": summary(rows), "shape": shape, "world": saved.get("world", WORLD)}
        if opts.json:
            with open(opts.json, "w") as f:
                json.dump(result, f, indent=1, default=str)
        return result
    models_ = [m for m in (opts.models or ",".join(MODELS)).split(",") if m]
    plans = [p for p in (opts.plans or ",".join(PLANS)).split(",") if p]
    for p in plans:
        if p not in PLANS:
            ap.error(f"unknown plan {p!r}; the plans are {', '.join(PLANS)}")
    for m in models_:
        if m not in MODELS:
            ap.error(f"unknown model {m!r}; the models are {', '.join(MODELS)}")
    if opts.alone:
        if opts.profile is None:
            ap.error("--alone prices the compute with a profile: give --profile")
        rows = alone(models_, SHAPES["quick" if opts.quick else "full"], opts.profile, steps=1 if opts.quick else 5,
                     warmup=1 if opts.quick else 2, world=opts.world)
        for r in rows:
            print(f"{r['model']:9} {r['precision']:5} batch {r['batch']:3}: forward + backward measured "
                  f"{r['time'] * 1e3:8.1f} ms, compute predicted {r['pred_time'] * 1e3:8.1f} ms "
                  f"({r['pred_time'] / r['time'] - 1:+.1%})")
        return {"alone": rows}
    if opts.quick and opts.models is None and opts.plans is None:
        pairs = [(MODELS[i % len(MODELS)], p) for i, p in enumerate(PLANS)]  # every plan once, the models in turn
    else:
        pairs = [(m, p) for m in models_ for p in plans]
    shape = SHAPES["quick" if opts.quick else "full"]
    steps = opts.steps or (1 if opts.quick else 5)
    warmup = opts.warmup if opts.warmup is not None else (1 if opts.quick else 2)
    profile_path = opts.profile
    if profile_path is None:
        import tempfile

        from autoshard.cost_models.calibrate import format_calibration, measure
        from autoshard.cost_models.profile import save_profile

        cal = measure(world_size=opts.world, repeats=3 if opts.quick else 10, timeout=600)
        print(format_calibration(cal))
        profile_path = str(save_profile(cal.profile("fidelity"), os.path.join(tempfile.mkdtemp(), "fidelity.toml")))
    started = time.monotonic()
    rows = run(pairs, shape, profile_path, warmup, steps, start_method="forkserver" if opts.quick else "spawn",
               world=opts.world)
    print(f"{len(pairs)} (model, plan) pairs on {opts.world} gloo ranks, shape {shape}, profile "
          f"{profile_path}, {time.monotonic() - started:.0f} s")
    print(format_rows(rows))
    result = {"rows": rows, "summary": summary(rows), "shape": shape, "world": opts.world}
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return result


if __name__ == "__main__":
    main()
