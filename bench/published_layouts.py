"""Published parallel layouts planned by the same search that ``autoshard plan --devices`` runs on each candidate.

Each row is one configuration a team published for a model on N H100s, planned exactly as ``plan_cluster`` plans
that configuration when it is one of its candidates (:func:`autoshard.api.cluster._plan_mesh` /
``_plan_pipeline``: ``Search(profile, memory_limit=80GiB, zero="auto", recompute="auto", time_limit=30)``, bf16
``MixedPrecision``, HF ``LlamaForCausalLM`` shapes on meta, seq 8192): the estimated step (``plan.cost()``,
``PipelinePlan.cost()``) and the largest rank's memory. Layouts:

* torchtitan (its published Llama 3 runs): 8B on 8 GPUs FSDP 8; 70B on 64 GPUs FSDP 64;
* NeMo (Megatron-Bridge performance recipes, bf16 on H100): ``llama3_8b_pretrain_8gpu_h100_bf16_config`` TP1 PP1
  CP2 (so DP4); ``llama3_70b_pretrain_64gpu_h100_bf16_config`` TP4 PP4 CP2 (DP2);
  ``llama31_405b_pretrain_1024gpu_h100_bf16_config`` TP8 PP8 CP2 (DP8);
* the Llama 3 paper's 405B layout: TP8 PP16 DP8, 1F1B, 16 microbatches.

The batch is the one ``bench/README.md``'s ``--devices`` runs used (8B 16, 70B 64, 405B 128 sequences), so each
row compares with the configuration ``autoshard plan --devices`` chose there; NeMo's and torchtitan's own global
batches differ, and so does their virtual-stage count (NeMo's interleaving is priced here with this search's 2
stages per rank). These are the cost model's estimates on meta models, not GPU measurements.

    python bench/published_layouts.py             # every row (minutes: 405B's two layouts are the slowest)
    python bench/published_layouts.py --only 8b   # the rows of one model (8b, 70b, 405b)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

#: (key, factory, devices, batch, profile)
MODELS = {"8b": ("llama3_8b_meta", 8, 16, "gpu-8x-nvlink"),
          "70b": ("llama3_70b_meta", 64, 64, "multi-node"),
          "405b": ("llama31_405b_meta", 1024, 128, "multi-node")}

#: (model key, source, mesh, pipeline (microbatches, schedule, stages per rank) or None); the mesh's `context`
#: axis, where there is one, is planned with context parallelism on it (head-tail balanced)
LAYOUTS = (
    ("8b", "torchtitan FSDP 8", "data=8", None),
    ("8b", "NeMo TP1 PP1 CP2", "data=4,context=2", None),
    ("70b", "torchtitan FSDP 64", "data=64", None),
    ("70b", "NeMo TP4 PP4 CP2, 1F1B", "pipe=4,data=2,context=2,model=4", (16, "1f1b", 1)),
    ("70b", "NeMo TP4 PP4 CP2, interleaved", "pipe=4,data=2,context=2,model=4", (16, "interleaved", 2)),
    ("405b", "Llama 3 paper TP8 PP16 DP8, 1F1B", "pipe=16,data=8,model=8", (16, "1f1b", 1)),
    ("405b", "NeMo TP8 PP8 CP2, 1F1B", "pipe=8,data=8,context=2,model=8", (16, "1f1b", 1)),
)


def plan_layout(key: str, mesh_text: str, pipeline, limit: str = "80GiB"):
    """The candidate ``plan_cluster`` makes of this configuration: (Candidate, planning seconds)."""
    import torch

    import autoshard
    from autoshard.api.cluster import CANDIDATE_TIME_LIMIT, _batch, _plan_mesh, _plan_pipeline
    from autoshard.api.planning import examples_of, parse_bytes
    from autoshard.compiler.pipeline import Pipeline
    from examples import models

    factory, _, batch, profile = MODELS[key]
    model, args, kwargs = getattr(models, factory)(batch=batch, seq=8192)
    mesh = autoshard.Mesh.parse(mesh_text)
    search = autoshard.Search(profile=profile, memory_limit=limit, zero="auto", recompute="auto",
                              time_limit=CANDIDATE_TIME_LIMIT)
    options = {"precision": autoshard.MixedPrecision(param_dtype=torch.bfloat16)}
    if "context" in mesh.names:
        options["context_parallel"] = "context"
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if pipeline is None:
            got = _plan_mesh(model, args, kwargs, mesh, search, parse_bytes(limit), True, "data",
                             _batch(*examples_of(args, kwargs)), options)
        else:
            m, schedule, v = pipeline
            (got,) = _plan_pipeline(model, args, kwargs, mesh, [Pipeline(m, schedule, stages_per_rank=v)], search,
                                    parse_bytes(limit), True, "data", options)
    return got, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=sorted(MODELS), default=None)
    parser.add_argument("--limit", default="80GiB")
    a = parser.parse_args()
    print("| model, devices, batch | layout | configuration | step est. s | GiB/rank | note | planning s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for key, source, mesh, pipeline in LAYOUTS:
        if a.only is not None and key != a.only:
            continue
        got, seconds = plan_layout(key, mesh, pipeline, a.limit)
        factory, devices, batch, _ = MODELS[key]
        config = mesh + ("" if pipeline is None else f" {pipeline[1]} m={pipeline[0]}"
                         + (f" v={pipeline[2]}" if pipeline[2] > 1 else ""))
        step = "-" if got.step_time_s is None else f"{got.step_time_s:.4g}"
        memory = "-" if got.memory_per_rank_bytes is None else f"{got.memory_per_rank_bytes / 2**30:.2f}"
        note = got.pruned or got.failed or ("" if got.plan is not None else "refused")
        print(f"| {factory}, {devices}, {batch} | {source} | {config} | {step} | {memory} | {note[:160]} | "
              f"{seconds:.1f} |", flush=True)


if __name__ == "__main__":
    main()
