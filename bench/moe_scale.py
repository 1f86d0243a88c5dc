"""Frontier-scale Mixture-of-Experts plans: DeepSeek-V3 on 256 ranks and Mixtral-8x7B on 64, searched.

Each model is Hugging Face's own class built from its real config on the meta device (no weights allocated), its
MoE blocks traced as the sparse, dropless ``autoshard::hf_experts`` op (each token through its top-k experts only).
Planned as a user preparing the run would: ``planner="search"``, ``zero="auto"``, ``recompute="auto"``, profile
``multi-node``, ``MixedPrecision(torch.bfloat16)`` (fp32 masters, Adam), ``memory_limit="80GiB"``, no annotations.

* DeepSeek-V3: ``DeepseekV3Config()`` (61 layers, hidden 7168, MLA, 3 dense layers then 58 MoE layers of 256
  routed experts top-8 with group-limited routing and 1 shared expert, vocab 129280), seq 4096, global batch 256.
* Mixtral-8x7B: ``MixtralConfig()`` (32 layers, hidden 4096, 8 experts top-2, FFN 14336, vocab 32000), seq 4096,
  global batch 64: one sequence per rank of the 64 — the batch per rank of DeepSeek-V3's row (256 sequences on
  256 ranks), so the two rows ask each rank for the same 4096 tokens.

Printed per (model, mesh): the planning wall time (trace + every pass, the model built before the clock starts),
memory per rank (``Plan.cost``: the step's peak) against the limit, the estimated step (compute + communication,
forward + backward, no overlap), how the experts are laid out (per mesh axis: what shards the stacked experts'
expert dim in compute — the op's strategy — and in storage — ZeRO), and the dense estimate: the same plan priced
by the same cost model with the experts op counted dense (every expert on every token, ``2·T·E·(h·out + f·h)``
FLOPs, the count of :func:`autoshard.frontend.hf_blocks.experts_dense_reference`, divided by the same split), the
compute the search priced before the op was sparse. Only the FLOP count changes in that estimate: memory and
communication are the sparse plan's.

    python bench/moe_scale.py                   # DeepSeek-V3 on data=32 x model=8, Mixtral on data=8 x model=8
    python bench/moe_scale.py --quick           # 2-layer narrowed cuts of both at seq 256 on data=4 x model=4
    python bench/moe_scale.py --model deepseek-v3 --mesh data=16,model=16   # another mesh
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
import warnings
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

GiB = 2**30
PROFILE = "multi-node"
LIMIT = "80GiB"

#: model: (seq, global batch, meshes tried)
FULL = {
    "deepseek-v3": (4096, 256, ({"data": 32, "model": 8},)),
    "mixtral-8x7b": (4096, 64, ({"data": 8, "model": 8},)),
}


def build(name: str, batch: int, seq: int, layers: int | None = None, small: bool = False):
    """(model on meta, args, kwargs) of ``name`` at its real config (``layers``: the first that many only;
    ``small``: narrowed for the smoke test)."""
    import torch

    if name == "deepseek-v3":
        from transformers import DeepseekV3Config as Config, DeepseekV3ForCausalLM as Model

        kw = dict(max_position_embeddings=seq)
        if small:
            kw.update(hidden_size=256, intermediate_size=512, moe_intermediate_size=64, num_attention_heads=4,
                      num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=64, qk_rope_head_dim=16, v_head_dim=32,
                      qk_nope_head_dim=32, n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4,
                      first_k_dense_replace=1, vocab_size=1024)
    else:
        from transformers import MixtralConfig as Config, MixtralForCausalLM as Model

        kw = dict(max_position_embeddings=seq)
        if small:
            kw.update(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=1024)
    if layers is not None:
        kw["num_hidden_layers"] = layers
    cfg = Config(use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False, **kw)
    with torch.device("meta"):
        model = Model(cfg)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    return model, cfg, (), {"input_ids": ids, "labels": ids}


def plan_of(model, args, kwargs, mesh_axes: dict, limit=LIMIT):
    """(plan, planning wall seconds): the search under bf16 mixed precision, multi-node, ``limit``."""
    import torch

    from autoshard.api.planning import make_options
    from autoshard.compiler.plan import build_plan
    from autoshard.frontend.precision import MixedPrecision
    from autoshard.mesh import Mesh

    mesh = Mesh(**mesh_axes)
    opts = make_options({}, "data", "replicate", mesh, planner="search", profile=PROFILE, memory_limit=limit,
                        zero="auto", recompute="auto", precision=MixedPrecision(torch.bfloat16))
    t0, c0 = time.perf_counter(), time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = build_plan(model, mesh, args, kwargs, opts)
    return plan, time.perf_counter() - t0, time.process_time() - c0


def _dense_flops(op):
    """Every expert on every token: ``2·T·E·(h·out + f·h)`` (the dense reference's count)."""
    tokens, _ = op.shape(op.arg(1))
    up, down = op.shape(op.arg(3)), op.shape(op.arg(4))
    return 2 * tokens * up[0] * (up[1] * up[2] + down[1] * down[2])


@contextlib.contextmanager
def dense_experts():
    """The experts op's registry entry with the dense FLOP count for the duration (every other facet kept)."""
    import dataclasses

    import torch

    from autoshard.compiler.ops import registry

    target = torch.ops.autoshard.hf_experts.default
    sparse = registry.registered()[target]
    facets = {f.name: getattr(sparse, f.name) for f in dataclasses.fields(sparse)}
    registry.unregister(target)
    registry.op(target, **{**facets, "flops": _dense_flops})
    try:
        yield
    finally:
        registry.unregister(target)
        registry.op(target, **facets)


def expert_layout(plan) -> dict:
    """How the stacked experts are laid out: per mesh axis, the placement of the first experts node's in-projection
    in compute (the op's strategy) and in storage (the parameter's stored spec, ZeRO), and how many experts a rank
    computes and stores."""
    import math

    import torch

    from autoshard import meta as M
    from autoshard.placements import Shard

    target = torch.ops.autoshard.hf_experts.default
    gm = plan.graph_module
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target == target]
    if not nodes:
        return {}
    node = nodes[0]
    up = node.args[3]
    compute = node.meta[M.STRATEGY].input_specs[3]
    tokens = node.meta[M.STRATEGY].input_specs[0]
    stored = _stored_spec(plan, up) or compute
    experts = up.meta["val"].shape[0]
    names, shape = plan.mesh.names, plan.mesh.shape

    def per_rank(spec):
        split = math.prod(s for p, s in zip(spec, shape) if isinstance(p, Shard) and p.dim == 0)
        return experts // split

    def fmt(spec):
        return " ".join(f"{a}:{p}" for a, p in zip(names, spec))

    return {"nodes": len(nodes), "experts": experts, "compute": fmt(compute), "tokens": fmt(tokens),
            "stored": fmt(stored), "computed_per_rank": per_rank(compute),
            "stored_whole_per_rank": per_rank(stored)}


def _stored_spec(plan, node):
    from autoshard import meta as M

    while node is not None and node.op != "get_attr":
        node = node.args[0] if node.args and hasattr(node.args[0], "op") else None
    if node is None:
        return None
    storage = node.meta.get(M.STORAGE)
    return storage.stored if storage is not None else node.meta[M.SPEC]


def run(name: str, mesh_axes: dict, seq: int, batch: int, layers=None, small=False, limit=LIMIT) -> dict:
    model, cfg, args, kwargs = build(name, batch, seq, layers, small)
    plan, wall, cpu = plan_of(model, args, kwargs, mesh_axes, limit)
    cost = plan.cost()
    with dense_experts():
        dense = plan.cost()
    report = plan.context.report.get("plan_search", {})
    return {"model": name, "mesh": "x".join(f"{k}={v}" for k, v in mesh_axes.items()), "seq": seq, "batch": batch,
            "layers": cfg.num_hidden_layers, "wall": wall, "cpu": cpu, "memory": cost.memory_per_rank,
            "step": cost.step_time,
            "compute": cost.compute_time, "comm": cost.comm_time, "dense_step": dense.step_time,
            "dense_compute": dense.compute_time,
            "limit": plan.context.options.memory_limit, "layout": expert_layout(plan),
            "search": {k: report.get(k) for k in ("build_seconds", "solve_seconds", "optimal", "gap", "method")},
            "zero": report.get("zero_stages"), "recomputed": len(report.get("recomputed") or ())}


def _seconds(x: float) -> str:
    return f"{x:.2f} s" if x >= 1 else f"{x * 1e3:.1f} ms"


def format_row(r: dict) -> str:
    lay = r["layout"]
    fits = "yes" if r["memory"] <= r["limit"] * (1 + 1e-9) else "NO"
    lines = [f"{r['model']}  {r['layers']} layers  seq {r['seq']} x batch {r['batch']}  mesh {r['mesh']}  "
             f"{PROFILE} bf16  limit {r['limit'] / GiB:.0f} GiB",
             f"  planned in {r['wall']:.1f} s ({r['cpu']:.1f} s CPU)  memory {r['memory'] / GiB:.2f} GiB/rank "
             f"(fits: {fits})  "
             f"step {_seconds(r['step'])}  dense-experts estimate {_seconds(r['dense_step'])} "
             f"({r['dense_step'] / r['step']:.2f}x)"]
    lines.append(f"  compute {_seconds(r['compute'])} sparse, {_seconds(r['dense_compute'])} dense; "
                 f"communication {_seconds(r['comm'])}")
    if lay:
        lines.append(f"  experts ({lay['nodes']} MoE layers, {lay['experts']} experts): compute {lay['compute']} "
                     f"({lay['computed_per_rank']} per rank), tokens {lay['tokens']}, stored {lay['stored']} "
                     f"({lay['stored_whole_per_rank']} whole per rank before ZeRO)")
    s = r["search"]
    lines.append(f"  search: build {s['build_seconds'] or 0:.1f} s, solve {s['solve_seconds'] or 0:.1f} s, "
                 f"{'optimal' if s['optimal'] else 'gap ' + str(s['gap'])}; ZeRO {r['zero']}; "
                 f"recomputed layers {r['recomputed']}")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2-layer narrowed cuts at seq 256 on data=4 x model=4")
    ap.add_argument("--model", choices=sorted(FULL), action="append", help="only this model (repeatable)")
    ap.add_argument("--mesh", help="only this mesh, e.g. data=32,model=8")
    ap.add_argument("--layers", type=int, help="only the first N layers (exploration)")
    args = ap.parse_args(argv)
    rows = []
    for name in args.model or sorted(FULL):
        seq, batch, meshes = FULL[name]
        if args.quick:
            seq, batch, meshes = 256, 16, ({"data": 4, "model": 4},)
        if args.mesh:
            meshes = ({k: int(v) for k, v in (p.split("=") for p in args.mesh.split(","))},)
        for mesh in meshes:
            r = run(name, mesh, seq, batch, layers=2 if args.quick else args.layers, small=args.quick,
                    limit="2GiB" if args.quick else LIMIT)
            print(format_row(r), flush=True)
            rows.append(r)
    return rows


if __name__ == "__main__":
    main()
