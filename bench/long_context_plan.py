"""Long sequences planned within a memory limit: Hugging Face ``LlamaForCausalLM`` at Llama-3-8B shape on the meta
device, bf16 (``MixedPrecision(param_dtype=bfloat16)``), planned by the plan search with context parallelism on the
context axis (head-tail balanced; the search chooses each attention's form, ZeRO and recomputation under the limit):

* sequence 32768, batch 1, ``Mesh(context=8)``, profile ``gpu-8x-nvlink`` (one node);
* sequence 131072, batch 1, ``Mesh(context=64)``, profile ``multi-node`` (8 nodes).

Printed per case: planning seconds (trace + search + passes), the plan's estimated peak memory per rank
(``plan.cost().memory_per_rank``) against the limit, its estimated step, how each attention runs (a context form, or
the sequence all-to-all'd onto heads), the ZeRO stages and axis the search stored parameters at, and the layers it
recomputes. These are the cost model's figures on meta, not measurements on GPUs.

    python bench/long_context_plan.py [--limit 80GiB]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

CASES = ((32768, "context=8", "gpu-8x-nvlink"), (131072, "context=64", "multi-node"))


def plan_case(seq: int, mesh: str, profile: str, limit: str):
    """(seconds, plan) of Llama-3-8B at ``seq`` on ``mesh`` under ``limit`` with context parallelism."""
    import torch

    import autoshard
    from examples import models

    model, args, kwargs = models.llama3_8b_meta(batch=1, seq=seq)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autoshard.plan(model, autoshard.Mesh.parse(mesh), args, kwargs, context_parallel="context",
                              precision=autoshard.MixedPrecision(param_dtype=torch.bfloat16),
                              search=autoshard.Search(profile=profile, memory_limit=limit))
    return time.perf_counter() - t0, plan


def main() -> None:
    from autoshard import meta as M
    from autoshard.api.planning import parse_bytes

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", default="80GiB")
    args = parser.parse_args()
    limit = parse_bytes(args.limit)
    print("| sequence | mesh | profile | planning s | memory GiB (limit) | step estimate s | attention | ZeRO | "
          "recomputed layers |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for seq, mesh, profile in CASES:
        seconds, plan = plan_case(seq, mesh, profile, args.limit)
        cost = plan.cost()
        report = plan.context.report["context_attention"]
        attention = collections.Counter(list(report["attention"].values())
                                        + [f"{v} split" for v in report["split"].values()]
                                        + ["gathered"] * len(report["gathered"]))
        zero = collections.Counter(f"{s.stage} over {s.axis}" for s in plan.param_storage().values())
        recomputed = M.plan_report(plan.graph_module).get("plan_search", {}).get("recomputed") or []
        print(f"| {seq} | {mesh} | {profile} | {seconds:.1f} | {cost.memory_per_rank / 2**30:.2f} "
              f"({limit / 2**30:.0f}) | {cost.step_time:.3f} | "
              f"{', '.join(f'{k} x{n}' for k, n in attention.items())} | "
              f"{', '.join(f'{k}: {n}' for k, n in sorted(zero.items())) or 'none'} | {len(recomputed)} |")


if __name__ == "__main__":
    main()
