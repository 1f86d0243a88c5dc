"""A memory limit on any model (issue 23): every architecture of the op-coverage sweep under 60% of its own
unconstrained searched plan's memory, with no option but ``planner="search"`` and ``memory_limit``.

Per model, on data=2 x model=2 (profile cpu-gloo, fp32, Adam):

1. ``planner="search"`` without a limit; ``free`` = that plan's ``plan.cost().memory_per_rank``;
2. ``planner="search", memory_limit=0.6 * free`` and nothing else (``zero`` and ``recompute`` default to "auto"
   under a limit; Hugging Face MoE experts may shard on their expert dim);
3. the limited plan's ``plan.cost()`` (memory per rank against the limit, step time) next to the search's own
   count of both, the search's own seconds (building and solving its program, from
   ``plan.context.report["plan_search"]``), what it stored sharded, and whether loss and every gradient in the
   simulator equal one device (rtol = atol = 1e-4).

    python bench/memory_limit_sweep.py                 # every model
    python bench/memory_limit_sweep.py hf_mixtral      # some of them

``tests/test_memory_limit_sweep.py`` runs the same cases (:func:`run_case`) and asserts what this prints.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # run as a script: make `examples` and `tests` importable
    sys.path.insert(0, str(_ROOT))

FRACTION = 0.6
MESH_AXES = {"data": 2, "model": 2}
KiB = 1024.0


def hf_mamba(batch: int = 4, seq: int = 8, layers: int = 1, hidden: int = 32, vocab: int = 64, seed: int = 0):
    """Tiny Hugging Face Mamba (selective state space; its slow path: a sequential scan over the sequence)."""
    import torch
    from transformers import MambaConfig, MambaForCausalLM

    from examples.models import _ids

    torch.manual_seed(seed)
    cfg = MambaConfig(vocab_size=vocab, hidden_size=hidden, state_size=4, num_hidden_layers=layers, expand=2,
                      conv_kernel=4, time_step_rank=4, use_cache=False, bos_token_id=0, eos_token_id=0,
                      pad_token_id=0)
    model = MambaForCausalLM(cfg)
    ids, labels = _ids(batch, seq, vocab, seed + 1)
    return model, (), {"input_ids": ids, "labels": labels}


def factories() -> dict:
    """name -> factory of ``(model, args, kwargs)``: the op-coverage sweep's architectures."""
    from examples import models

    names = ("hf_gpt2", "hf_llama", "hf_bloom", "hf_gptj", "hf_t5", "hf_bart", "hf_vit", "hf_mixtral",
             "hf_qwen2_moe", "conv_bn")
    table = {name: getattr(models, name) for name in names}
    table["hf_mamba"] = hf_mamba
    return table


def stored_sharded(plan) -> list[str]:
    """Parameters sharded on the `model` axis, or stored sharded (ZeRO) on the `data` axis."""
    from autoshard.placements import Shard

    model_axis = plan.mesh.names.index("model")
    storage = plan.param_storage()
    out = []
    for name, spec in plan.param_specs().items():
        if spec is not None and isinstance(spec[model_axis], Shard) or name in storage:
            out.append(name)
    return out


def run_case(name: str, factory=None) -> dict:
    """The row of model ``name``: limit, the limited plan (and its memory, search seconds, what it shards) and the
    reference (model, args, kwargs) for the equivalence check."""
    import autoshard

    factory = factory or factories()[name]
    model, args, kwargs = factory()
    model.train()
    mesh = autoshard.Mesh(**MESH_AXES)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        free = autoshard.compile(copy.deepcopy(model), mesh, args, kwargs, planner="search").plan
        unconstrained = free.cost().memory_per_rank
        limit = FRACTION * unconstrained
        t0 = time.perf_counter()
        plan = autoshard.compile(copy.deepcopy(model), mesh, args, kwargs, planner="search",
                                 memory_limit=limit).plan
        wall = time.perf_counter() - t0
    report = plan.context.report["plan_search"]
    cost = plan.cost()
    return {"name": name, "model": model, "args": args, "kwargs": kwargs, "plan": plan, "free": unconstrained,
            "limit": limit, "memory": cost.memory_per_rank, "search_memory": report["memory_per_rank"],
            "step": cost.step_time, "search_step": report["step_time"], "timed_out": report["timed_out"],
            "search_s": report["build_seconds"] + report["solve_seconds"], "compile_s": wall,
            "optimal": report["optimal"], "zero_stages": report["zero_stages"], "recomputed": report["recomputed"],
            "sharded": stored_sharded(plan)}


def matches_one_device(row: dict, tol: float = 1e-4) -> str:
    """"yes", or the first mismatch (loss or gradient) of the simulated ranks against one device."""
    from tests.test_equivalence import assert_simulated_equals_one_device

    try:
        assert_simulated_equals_one_device(copy.deepcopy(row["model"]), row["args"], row["kwargs"], row["plan"],
                                           rtol=tol, atol=tol)
    except AssertionError as e:
        return "NO: " + str(e).splitlines()[0][:60]
    return "yes"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help="factory names (default: all)")
    ns = parser.parse_args(argv)
    table = factories()
    names = ns.models or list(table)
    header = (f"{'model':<14}{'free KiB':>10}{'limit KiB':>11}{'plan KiB':>10}{'search KiB':>12}{'step ms':>9}"
              f"{'search ms':>11}{'search s':>10}{'fits':>6}  {'ZeRO stages':<14}{'sharded':>8}  match")
    print(header)
    print("-" * len(header))
    rows = []
    for name in names:
        try:
            row = run_case(name, table[name])
        except Exception as e:  # a model that does not plan is a row of the table, not the end of the sweep
            print(f"{name:<14}FAILED: {type(e).__name__}: {str(e)[:160]}")
            rows.append({"name": name, "error": f"{type(e).__name__}: {e}"})
            continue
        row["match"] = matches_one_device(row)
        fits = row["memory"] <= row["limit"] * (1 + 1e-9)
        stages = ",".join(f"{k}:{v}" for k, v in sorted(row["zero_stages"].items()))
        print(f"{name:<14}{row['free'] / KiB:>10.1f}{row['limit'] / KiB:>11.1f}{row['memory'] / KiB:>10.1f}"
              f"{row['search_memory'] / KiB:>12.1f}{row['step'] * 1e3:>9.3f}{row['search_step'] * 1e3:>11.3f}"
              f"{row['search_s']:>10.2f}{'yes' if fits else 'NO':>6}  "
              f"{stages:<14}{len(row['sharded']):>8}  {row['match']}", flush=True)
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
