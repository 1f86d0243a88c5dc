"""GPU check of the cost model's numbers on one CUDA GPU: measured against the preset (not part of the test suite).

    python tests/gpu/calibrate_check.py                    # on a CUDA machine (tests/gpu/check.sh runs it)
    python tests/gpu/calibrate_check.py --json out.json    # also write every measurement
    python tests/gpu/calibrate_check.py --device cpu --quick  # a dry run of the script on the CPU

Without CUDA (and no ``--device cpu``) it prints that it is skipped and exits 0.

1. What ``autoshard calibrate`` measures (:mod:`autoshard.cost_models.calibrate`), on the GPU: efficiency tables at
   several sizes — bf16 and fp32 matmuls (square n x n, and a Llama-like [tokens, 4096] x [4096, 14336]), causal
   bf16 attention (``scaled_dot_product_attention``, 32 heads of 128; forward, and forward + backward for the
   backward's own table point), elementwise adds (fp32 and bf16) from 64 KB to 1 GB — each op's work as the cost
   model counts it (:func:`autoshard.cost_models.compute` formulas: ``2·m·n·k``, ``4·b·h·s²·d`` and 2.5x that for
   attention's backward, bytes read + written), its measured rate, its fraction of the preset's peak, and the
   preset's table value at that work; the per-op overhead (a chain of tiny ops in an FX program, forward and
   backward, as ``calibrate`` runs it); ``torch.optim.AdamW`` steps over many small and a few large tensors, fitted
   to seconds per tensor and per element (``calibrate.fit_optimizer``).
2. Predicted against measured: a small Llama (HF ``LlamaForCausalLM``, hidden 1024, 4 layers, batch 8 x 1024 tokens)
   compiled for a mesh of one rank on the GPU, in three plans (fp32; bf16 mixed precision; bf16 with every layer
   recomputed): ``plan.cost(profile)``'s step time and ``memory_per_rank`` by the preset and by the preset with the
   measured tables (step 1) in place, against the median step time (``zero_grad``, forward, backward,
   ``AdamW.step``, synchronised) and ``torch.cuda.max_memory_allocated`` of a step.

Everything printed is measured or computed here; nothing is asserted but that the runs complete.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
import warnings
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

PRESET = "gpu-8x-nvlink"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds(fn, device: torch.device, budget: float = 0.2, warmup: int = 2) -> float:
    """Seconds of one call of ``fn``: the fastest of 3 rounds of back-to-back calls (synchronised around each round)
    over the calls in the round, as many as fill about ``budget`` seconds (1 to 200)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    reps = max(1, min(200, int(budget / max(time.perf_counter() - t0, 1e-7))))
    best = math.inf
    for _ in range(3):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        _sync(device)
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


# ---- 1. the calibration tables -------------------------------------------------------------------------------
def matmul_table(device, dtype, sizes, profile, quick):
    rows = []
    for m, k, n in sizes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        out = torch.empty(m, n, device=device, dtype=dtype)
        work = 2 * m * n * k
        t = seconds(lambda: torch.mm(a, b, out=out), device, 0.05 if quick else 0.2)
        rows.append(("matmul", str(dtype).removeprefix("torch."), f"{m}x{k}x{n}", work, t))
    return rows


def attention_table(device, seqs, profile, quick, heads=32, dim=128):
    rows = []
    for s in seqs:
        q, k, v = (torch.randn(1, heads, s, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        fwd_work = 4 * heads * s * s * dim  # the cost model's count: the full score matrix

        def forward():
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

        def both():
            forward().sum().backward()

        t_fwd = seconds(forward, device, 0.05 if quick else 0.2)
        t_both = seconds(both, device, 0.05 if quick else 0.2)
        rows.append(("attention", "bfloat16", f"s={s} forward", fwd_work, t_fwd))
        rows.append(("attention", "bfloat16", f"s={s} backward", 2.5 * fwd_work, max(t_both - t_fwd, 1e-9)))
    return rows


def memory_table(device, sizes, profile, quick):
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for nbytes in sizes:
            numel = max(1, nbytes // dtype.itemsize)
            x, y = torch.randn(numel, device=device).to(dtype), torch.randn(numel, device=device).to(dtype)
            out = torch.empty_like(x)
            work = 3 * numel * dtype.itemsize  # two inputs read, the output written
            t = seconds(lambda: torch.add(x, y, out=out), device, 0.05 if quick else 0.2)
            rows.append(("memory", str(dtype).removeprefix("torch."), f"{nbytes / 2**20:.3g} MiB", work, t))
    return rows


def op_overheads(device, budget: float = 0.2, chain: int = 100) -> tuple[float, float]:
    """Seconds per op of an FX program's forward and of its backward: a chain of ``chain`` muls of 8 elements (no
    work), as ``autoshard calibrate`` times it, on ``device``."""
    import torch.fx

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    y = x
    for _ in range(chain):
        y = graph.call_function(torch.ops.aten.mul.Tensor, (y, x))
    graph.output(graph.call_function(torch.ops.aten.sum.default, (y,)))
    program = torch.fx.GraphModule(torch.nn.Module(), graph)
    leaf = torch.ones(8, device=device, requires_grad=True)
    forward = seconds(lambda: program(leaf.detach()), device, budget)
    both = seconds(lambda: program(leaf).backward(), device, budget)
    return forward / (chain + 1), max(0.0, both - forward) / (chain + 1)


def optimizer_samples(device, quick):
    """``[(tensors, elements, seconds)]`` of ``torch.optim.AdamW.step`` (fp32, foreach on CUDA)."""
    out = []
    configs = ((256, 1024), (16, 1 << 22), (4, 1 << 24)) if not quick else ((64, 1024), (8, 1 << 18))
    for tensors, numel in configs:
        params = [torch.nn.Parameter(torch.randn(numel, device=device)) for _ in range(tensors)]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(params, lr=1e-6)
        out.append((tensors, tensors * numel, seconds(opt.step, device, 0.05 if quick else 0.3)))
    return out


def table_report(rows, profile) -> list[dict]:
    out = []
    for kind, dtype, what, work, t in rows:
        peak = profile.mem_bandwidth if kind == "memory" else profile.flops_for(dtype)
        rate = work / t
        out.append({"kind": kind, "dtype": dtype, "case": what, "work": work, "seconds": t, "rate": rate,
                    "fraction": rate / peak, "preset": profile.efficiency_for(kind, dtype, work)})
    return out


def calibrated_profile(preset, report: list[dict], overheads, optimizer):
    """The preset with the measured tables (fraction of the preset's peaks per kind, at each measured work; bf16
    and fp32 matmuls apart), per-op overheads and AdamW step in place."""
    from autoshard.cost_models.calibrate import fit_optimizer

    tables: dict[str, dict[float, float]] = {}
    for r in report:
        key = {"matmul": f"matmul.{r['dtype']}", "attention": "attention", "memory": "memory"}[r["kind"]]
        if r["kind"] == "memory" and r["dtype"] != "bfloat16":
            continue  # one memory table: the bf16 adds (mixed-precision programs' elementwise ops)
        best = tables.setdefault(key, {})
        best[r["work"]] = max(best.get(r["work"], 0.0), r["fraction"])
    efficiency = tuple((k, tuple(sorted(v.items()))) for k, v in tables.items())
    per_tensor, per_element = fit_optimizer(optimizer)
    return dataclasses.replace(preset, name=f"{preset.name}-measured", efficiency=efficiency,
                               op_overhead=overheads[0], backward_op_overhead=overheads[1],
                               optimizer_step=(("adamw", per_tensor, per_element),))


# ---- 2. a small Llama: predicted against measured ---------------------------------------------------------
def llama_case(device, quick):
    from transformers import LlamaConfig, LlamaForCausalLM

    layers, hidden, batch, seq = (2, 256, 2, 128) if quick else (4, 1024, 8, 1024)
    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=hidden * 7 // 2,
                      num_attention_heads=hidden // 128 if hidden >= 1024 else 4, num_key_value_heads=2,
                      vocab_size=32000, max_position_embeddings=seq, use_cache=False, tie_word_embeddings=False,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(device)
    return model, {"input_ids": ids, "labels": ids}, f"Llama {layers} layers, hidden {hidden}, {batch} x {seq} tokens"


def run_plan(model, kwargs, device, options, steps: int):
    """(measured median step seconds, measured peak bytes of a step, the plan) of ``model`` compiled for one rank
    with ``options`` on ``device``."""
    import autoshard

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sharded = autoshard.compile(model, autoshard.Mesh(data=1), (), kwargs, device=device, optimizer="adamw",
                                    profile=PRESET, **options)
    torch.manual_seed(0)
    sharded.init_weights()
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-5)

    def step():
        opt.zero_grad(set_to_none=True)
        out = sharded(**kwargs)
        (out.loss if hasattr(out, "loss") else out).backward()
        opt.step()

    for _ in range(3):  # warm up: the optimizer state exists from here on
        step()
    times = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    peak = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        step()
        _sync(device)
        peak = torch.cuda.max_memory_allocated(device)
    plan = sharded.plan
    sharded = opt = None  # released (step's closure too) before empty_cache; not `del`, which F821 flags in step
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(times), peak, plan


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu (a dry run)")
    ap.add_argument("--quick", action="store_true", help="fewer and smaller cases")
    ap.add_argument("--json", default=None, help="write every measurement to this file")
    args = ap.parse_args(argv)
    if args.device is None and not torch.cuda.is_available():
        print("calibrate_check: no CUDA GPU here; skipped (pass --device cpu for a dry run on the CPU)")
        return 0
    device = torch.device(args.device or "cuda", 0) if (args.device or "cuda") == "cuda" else torch.device("cpu")

    import autoshard
    from autoshard.cost_models.profile import load_profile

    preset = load_profile(PRESET)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (dry run)"
    print(f"calibrate_check on {name}, preset {PRESET}\n")

    q = args.quick
    square = [(n, n, n) for n in ((128, 512) if q else (256, 512, 1024, 2048, 4096, 8192))]
    llama = [] if q else [(8192, 4096, 14336), (8192, 4096, 1024)]
    rows = matmul_table(device, torch.bfloat16, square + llama, preset, q)
    rows += matmul_table(device, torch.float32, square[: 3 if q else 5], preset, q)
    rows += attention_table(device, (128, 256) if q else (512, 1024, 2048, 4096, 8192), preset, q)
    rows += memory_table(device, [1 << s for s in ((16, 20) if q else (16, 20, 24, 27, 30))], preset, q)
    report = table_report(rows, preset)
    print(f"{'kind':<10}{'dtype':<10}{'case':<22}{'work':>10}{'us':>12} {'rate':>12}{'of peak':>9}{'preset':>8}")
    for r in report:
        unit = "GB/s" if r["kind"] == "memory" else "TF/s"
        rate = r["rate"] / 1e9 if r["kind"] == "memory" else r["rate"] / 1e12
        print(f"{r['kind']:<10}{r['dtype']:<10}{r['case']:<22}{r['work']:>10.3g}{r['seconds'] * 1e6:>12.1f} "
              f"{rate:>8.4g} {unit}{r['fraction']:>9.3f}{r['preset']:>8.3f}")

    overheads = op_overheads(device, 0.05 if q else 0.2)
    print(f"\nper-op overhead: forward {overheads[0] * 1e6:.2f} us, backward {overheads[1] * 1e6:.2f} us "
          f"(preset {preset.op_overhead * 1e6:.2f} / {preset.backward_op_overhead * 1e6:.2f} us)")
    optimizer = optimizer_samples(device, q)
    measured = calibrated_profile(preset, report, overheads, optimizer)
    (_, per_tensor, per_element), = measured.optimizer_step
    (_, pre_tensor, pre_element), = [o for o in preset.optimizer_step if o[0] == "adamw"]
    print(f"AdamW step: {per_tensor * 1e6:.2f} us per tensor, {per_element * 1e12:.3f} ps per element "
          f"(preset {pre_tensor * 1e6:.2f} us, {pre_element * 1e12:.3f} ps); samples "
          + ", ".join(f"{nt} x {ne // nt} elements: {t * 1e3:.3f} ms" for nt, ne, t in optimizer))

    model, kwargs, what = llama_case(device, q)
    plans = {"fp32": {}, "bf16": {"precision": autoshard.MixedPrecision(torch.bfloat16)},
             "bf16+AC": {"precision": autoshard.MixedPrecision(torch.bfloat16), "recompute": "model.layers.*"}}
    print(f"\n{what}, mesh of one rank on {name}: step time and peak memory, predicted / measured")
    print(f"{'plan':<10}{'preset ms':>11}{'measured-tables ms':>20}{'measured ms':>13}{'preset/meas':>13}"
          f"{'tables/meas':>13}{'pred MiB':>10}{'peak MiB':>10}{'pred/peak':>11}")
    results = []
    for label, options in plans.items():
        step_s, peak, plan = run_plan(model, kwargs, device, options, 3 if q else 10)
        by_preset, by_tables = plan.cost(preset), plan.cost(measured)
        mem = by_preset.memory_per_rank
        results.append({"plan": label, "measured_s": step_s, "preset_s": by_preset.step_time,
                        "tables_s": by_tables.step_time, "predicted_bytes": mem, "peak_bytes": peak})
        peak_text = f"{peak / 2**20:>10.0f}{mem / peak:>11.3f}" if peak else f"{'-':>10}{'-':>11}"
        print(f"{label:<10}{by_preset.step_time * 1e3:>11.2f}{by_tables.step_time * 1e3:>20.2f}{step_s * 1e3:>13.2f}"
              f"{by_preset.step_time / step_s:>13.3f}{by_tables.step_time / step_s:>13.3f}{mem / 2**20:>10.0f}"
              + peak_text)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "tables": report, "op_overhead": overheads,
                                               "optimizer": optimizer, "plans": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
