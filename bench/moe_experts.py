"""Hugging Face MoE experts: the sparse ``autoshard::hf_experts`` op (each token through its top-k experts: sort by
expert, one grouped GEMM where the device has it, weighted index_add) against the dense form it replaced (every
expert on every token, then weighted: ``experts_dense_reference``), forward + backward, in one process; then a tiny
Mixtral trained by autoshard on 4 gloo ranks with the experts split over ``model`` (data=2 x model=2: each rank runs
its tokens through its half of the experts and the output is summed over ``model``) against the same model in one
process (Hugging Face's own experts loop), same global batch.

Both parts report ratios measured side by side in one run (interleaved repeats, medians), never absolute claims:

    python bench/moe_experts.py            # T=4096 tokens, h=256, f=512, top-2 of E in 8/32; Mixtral h=128, E=8
    python bench/moe_experts.py --quick    # seconds: a smoke run

On 2 CPU cores the 4-rank part shares the cores with 4 processes: its ratio says what the sharded block costs here,
not what it gains on 4 devices.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # run as a script (and in spawned workers): make `examples` importable
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from autoshard.frontend import hf_blocks  # noqa: E402


def _op_case(tokens: int, hidden: int, ffn: int, experts: int, top_k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    logits = torch.randn(tokens, experts, generator=g)
    weights, index = torch.softmax(logits, -1).topk(top_k, -1)
    up = torch.randn(experts, 2 * ffn, hidden, generator=g) / hidden ** 0.5
    down = torch.randn(experts, hidden, ffn, generator=g) / ffn ** 0.5
    return x, index, weights, up, down


def _step(fn, x, index, weights, up, down):
    leaves = [t.detach().requires_grad_(True) for t in (x, weights, up, down)]
    out = fn(leaves[0], index, leaves[1], leaves[2], leaves[3], None, None, "silu", True, False, True)
    out.square().sum().backward()
    return out.detach(), [t.grad for t in leaves]


def _sparse(*a):
    return torch.ops.autoshard.hf_experts(*a)


def _dense(*a):
    return hf_blocks.experts_dense_reference(*a)


def op_rows(tokens: int, hidden: int, ffn: int, experts_list, top_k: int, repeats: int) -> list[dict]:
    rows = []
    for experts in experts_list:
        case = _op_case(tokens, hidden, ffn, experts, top_k)
        got, got_g = _step(_sparse, *case)  # warm-up, and the comparison
        want, want_g = _step(_dense, *case)
        diff = max([float((got - want).abs().max())] + [float((a - b).abs().max()) for a, b in zip(got_g, want_g)])
        times = {"sparse": [], "dense": []}
        for _ in range(repeats):  # interleaved: the same machine state for both
            for name, fn in (("sparse", _sparse), ("dense", _dense)):
                t = time.perf_counter()
                _step(fn, *case)
                times[name].append(time.perf_counter() - t)
        sparse, dense = statistics.median(times["sparse"]), statistics.median(times["dense"])
        rows.append({"experts": experts, "top_k": top_k, "tokens": tokens, "sparse_over_dense": sparse / dense,
                     "rows_sparse": tokens * top_k, "rows_dense": tokens * experts, "max_abs_diff": diff})
    return rows


def _mixtral(hidden: int, experts: int, seq: int, batch: int):
    from examples import models

    return models.hf_mixtral(batch=batch, seq=seq, layers=1, hidden=hidden, heads=4, kv_heads=2, experts=experts,
                             top_k=2, vocab=128, aux_loss=True)


def _timed_steps(loss_fn, model, repeats: int) -> tuple[list[float], torch.Tensor]:
    """Seconds of ``repeats`` forward + backward steps after one warm-up step, and the last loss."""
    times = []
    for i in range(repeats + 1):
        t = time.perf_counter()
        loss = loss_fn()
        loss.backward()
        model.zero_grad()
        if i:  # the first step is the warm-up
            times.append(time.perf_counter() - t)
    return times, loss


def _gloo_worker(rank: int, world_size: int, hidden: int, experts: int, seq: int, batch: int, repeats: int):
    import autoshard
    from autoshard.compiler.plan import loss_of

    torch.manual_seed(0)
    model, args, kwargs = _mixtral(hidden, experts, seq, batch)
    mesh = autoshard.Mesh(data=2, model=2)
    split = (autoshard.Replicate(), autoshard.Shard(0))
    annotations = {f"model.layers.0.mlp.experts.{p}": split for p in ("gate_up_proj", "down_proj")}
    shapes = {k: v.chunk(2)[0] for k, v in kwargs.items()}  # examples: this rank's shapes (any values)
    sharded = autoshard.shard(model, mesh, args, shapes, annotations=annotations)
    local = {k: v.chunk(2)[sharded.data_parallel_rank] for k, v in kwargs.items()}  # its half of the global batch
    times, loss = _timed_steps(lambda: loss_of(sharded(*args, **local)), model, repeats)
    experts_local = sharded.get_parameter("model.layers.0.mlp.experts.gate_up_proj").to_local().shape[0]
    return {"step": statistics.median(times), "loss": loss.item(), "experts_local": experts_local}


def _one_process(hidden: int, experts: int, seq: int, batch: int, repeats: int) -> dict:
    from autoshard.compiler.plan import loss_of

    torch.manual_seed(0)
    model, args, kwargs = _mixtral(hidden, experts, seq, batch)
    times, loss = _timed_steps(lambda: loss_of(model(*args, **kwargs)), model, repeats)
    return {"step": statistics.median(times), "loss": loss.item()}


def gloo_row(hidden: int, experts: int, seq: int, batch: int, repeats: int, start_method: str) -> dict:
    from autoshard.runtime import spawn

    one = _one_process(hidden, experts, seq, batch, repeats)
    ranks = spawn(_gloo_worker, 4, hidden, experts, seq, batch, repeats, timeout=600, start_method=start_method)
    one_after = _one_process(hidden, experts, seq, batch, repeats)  # before and after: the machine's drift
    reference = statistics.mean([one["step"], one_after["step"]])
    slowest = max(r["step"] for r in ranks)
    return {"hidden": hidden, "experts": experts, "tokens": seq * batch, "experts_per_rank": ranks[0]["experts_local"],
            "sharded_step_over_one_process": slowest / reference, "loss_one_process": one["loss"],
            "loss_ranks": [r["loss"] for r in ranks]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a seconds-long smoke run")
    a = p.parse_args(argv)
    torch.set_num_threads(1)  # one thread, as each gloo rank runs: like with like
    if a.quick:
        ops = op_rows(256, 32, 64, (4, 8), 2, repeats=2)
        gloo = gloo_row(32, 4, 8, 4, repeats=1, start_method="forkserver")
    else:
        ops = op_rows(4096, 256, 512, (8, 32), 2, repeats=5)
        gloo = gloo_row(128, 8, 128, 8, repeats=5, start_method="spawn")
    print("experts op, forward + backward, one process (median of interleaved repeats)")
    print(f"{'E':>4} {'k':>2} {'tokens':>7} {'rows sparse/dense':>18} {'time sparse/dense':>18} {'max |diff|':>11}")
    for r in ops:
        print(f"{r['experts']:>4} {r['top_k']:>2} {r['tokens']:>7} {r['rows_sparse']:>8}/{r['rows_dense']:<9} "
              f"{r['sparse_over_dense']:>18.3f} {r['max_abs_diff']:>11.2e}")
    print()
    print("tiny Mixtral (1 layer), train step: autoshard on 4 gloo ranks (data=2 x model=2, experts split over model)"
          " / one process (Hugging Face's experts loop), same global batch")
    print(f"  hidden {gloo['hidden']}, {gloo['experts']} experts ({gloo['experts_per_rank']} per rank), "
          f"{gloo['tokens']} tokens: step ratio {gloo['sharded_step_over_one_process']:.3f}; loss one process "
          f"{gloo['loss_one_process']:.6f}, ranks {', '.join(f'{v:.6f}' for v in gloo['loss_ranks'])}")
    return {"ops": ops, "gloo": gloo}


if __name__ == "__main__":
    main()
