"""Peak memory per rank of a model that never exists whole: a ~0.5B-parameter Llama on 4 gloo ranks (model=4).

Two paths, side by side in one run, same model shape, same mesh, same plan (Megatron annotations), same data, one
forward + backward step each, every rank in a fresh process (``spawn(..., start_method="spawn")``):

* **meta**: the model built under ``torch.device("meta")``, compiled, this rank's shards materialised and filled by
  ``init_weights()`` (the model's own init, one module at a time);
* **full**: the model built normally on every rank (the whole fp32 model in memory) and compiled: each rank takes its
  slices, and the ShardedModule releases the plan's copy — but the rank built the whole model first.

Reported per rank: peak RSS over the process's whole life (``ru_maxrss``), the peak's growth over the process's RSS
after importing torch and autoshard (the baseline), the full model's fp32 parameter bytes, and the ratio of the
meta path's peak to the full path's. The acceptance bound of the meta path: peak RSS < 0.7 × the full fp32
parameter bytes + 0.6 GiB on every rank.

    python bench/memory.py             # the ~0.5B model (a few minutes on 2 cores)
    python bench/memory.py --quick     # a ~30M model: a smoke run
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

GiB = 2**30
SIZES = {
    # hidden 1024, 32 layers, MLP 2816, 32k vocab, untied head: 0.48B parameters (1.8 GiB in fp32)
    "full": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=32, num_attention_heads=16,
                 num_key_value_heads=16, vocab_size=32000, max_position_embeddings=256, batch=4, seq=64),
    "quick": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=8, vocab_size=32000, max_position_embeddings=256, batch=4, seq=32),
}


def _rss() -> int:
    """Current resident set size in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _worker(rank: int, world: int, size: str, path: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import autoshard
    from examples import models

    baseline = _rss()
    shape = dict(SIZES[size])
    batch, seq = shape.pop("batch"), shape.pop("seq")
    config = LlamaConfig(**shape, tie_word_embeddings=False, use_cache=False)
    config._attn_implementation = "sdpa"
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=g)
    mesh = autoshard.Mesh(model=world)
    plan = models.megatron(mesh, "hf_llama")
    t0 = time.perf_counter()
    torch.manual_seed(0)
    if path == "meta":
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
    else:
        model = LlamaForCausalLM(config)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    sharded = autoshard.compile(model, mesh, example_kwargs={"input_ids": ids, "labels": ids}, annotations=plan,
                                timeout=600, device="cpu")
    del model
    if path == "meta":
        sharded.init_weights()
    local_bytes = sum(p.numel() * p.element_size() for p in sharded.parameters())
    out = sharded(input_ids=ids, labels=ids)
    loss = out.loss if hasattr(out, "loss") else out
    loss.backward()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return dict(rank=rank, path=path, peak=peak, baseline=baseline, full=full_bytes, local=local_bytes,
                loss=float(loss.detach()), seconds=seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a ~30M-parameter model")
    parser.add_argument("--ranks", type=int, default=4)
    args = parser.parse_args()
    from autoshard.runtime import spawn

    size = "quick" if args.quick else "full"
    rows = {}
    for path in ("meta", "full"):
        rows[path] = spawn(_worker, args.ranks, size, path, timeout=1200, start_method="spawn")
    full = rows["meta"][0]["full"]
    print(f"Llama ({size}): {full / 2**30:.2f} GiB of fp32 parameters; model={args.ranks}, {args.ranks} gloo "
          f"processes, one forward+backward")
    print("| path | rank | peak RSS | over baseline | local params | peak / (0.7 x full + 0.6 GiB) | loss |")
    print("| ---- | ---- | -------- | ------------- | ------------ | ----------------------------- | ---- |")
    for path, results in rows.items():
        for r in results:
            bound = 0.7 * r["full"] + 0.6 * GiB
            print(f"| {path} | {r['rank']} | {r['peak'] / GiB:.2f} GiB | {(r['peak'] - r['baseline']) / GiB:.2f} GiB | "
                  f"{r['local'] / GiB:.2f} GiB | {r['peak'] / bound:.2f} | {r['loss']:.4f} |")
    worst_meta = max(r["peak"] for r in rows["meta"])
    worst_full = max(r["peak"] for r in rows["full"])
    print(f"worst rank: meta path {worst_meta / GiB:.2f} GiB, full path {worst_full / GiB:.2f} GiB; "
          f"ratio meta/full {worst_meta / worst_full:.2f}; meta peak / full fp32 bytes {worst_meta / full:.2f}")


if __name__ == "__main__":
    main()
