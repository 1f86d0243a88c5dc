"""Published H100 training runs predicted from the GPU presets: the runs that anchor their efficiency numbers.

Each :class:`Run` is one row of a published table (torchtitan's H100 benchmarks, the Llama 3 paper's 405B table):
its settings, its published throughput, and how autoshard plans the same layout — FSDP as ``zero=3`` over ``data``,
tensor parallelism as the Megatron annotations on ``model`` with sequence parallelism, bf16 compute with fp32
gradient reduction (``MixedPrecision(bfloat16, reduce_dtype=float32)``: torchtitan's defaults), AdamW, and the
activation checkpointing of the run as a ``recompute`` glob. The model is a Llama-3-shaped ``LlamaForCausalLM``
built on the meta device (no weights), traced at the run's global batch and sequence length.

:func:`predict` plans the model with 1 and with 2 decoder layers and extrapolates: the layers are identical, so
every cost the plan prices per layer (its ops, its collectives, its optimizer step) is the same for each layer, and
the step time of ``L`` layers is ``step(1) + (L - 1)·(step(2) - step(1))`` exactly; :func:`linearity` checks it
against a 3-layer plan (``python bench/published_runs.py --check-linear``; the test suite checks it on one run).
The published figure is tokens per second per GPU (torchtitan's ``tps``: the local batch's tokens over the step time
and the tensor/pipeline-parallel degree) or model TFLOP/s per GPU (the Llama 3 paper), and the prediction is the
same quantity from the predicted step time.

The Llama 3 405B rows run a pipeline (TP 8 × PP 16 × DP): the step is that of :meth:`PipelinePlan.cost
<autoshard.compiler.pipeline.plan.PipelinePlan.cost>` — each rank runs ``microbatches × its layers' seconds per
microbatch / (1 − bubble)``, then once per step its data-parallel collectives and optimizer step — with a rank's
layers priced from the same 1- and 2-layer plans of one microbatch (one sequence per data-parallel rank) on
``data × model``: compute and the ``model`` axis's collectives per microbatch, the ``data`` axis's (ZeRO-2: the
parameters gathered once, gradients reduce-scattered once, as the paper's FSDP does not reshard after forward)
once per step.

    python bench/published_runs.py                 # the table: published, predicted, error, per run
    python bench/published_runs.py --markdown      # the same as docs/cost_model.md's table
    python bench/published_runs.py --check-linear  # 3-layer plans against the extrapolation, every run
"""

from __future__ import annotations

import argparse
import functools
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # run as a script: make `examples` and `autoshard` importable from the checkout
    sys.path.insert(0, str(_ROOT))

#: Llama 3 shapes: hidden, FFN, heads, KV heads, decoder layers (the Llama 3 paper's Table 3; vocabulary 128256).
SHAPES = {"8B": (4096, 14336, 32, 8, 32), "70B": (8192, 28672, 64, 8, 80), "405B": (16384, 53248, 128, 8, 126)}
VOCAB = 128256
#: torchtitan's selective (per-op) activation checkpointing recomputes every second matmul of a layer's forward
#: (``_save_list`` and the ``mm_count % 2 == 0`` rule of its ``_custom_policy``): of wq, wk, wv, wo, w1, w3, w2 the
#: 2nd, 4th and 6th — wk, wo, w3, which Hugging Face's Llama names k_proj, o_proj and up_proj. The glob matches
#: exactly those three linears of every layer (``[kop]_proj``: k_proj, o_proj and the "p_proj" of up_proj).
SAC_OP = "model.layers.*[kop]_proj"
FULL_AC = "model.layers.*"

TORCHTITAN_2412 = ("github.com/pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (docs/performance.md "
                   "at the end of 2024): Grand Teton H100 96GB HBM2e at 500 W, 400 Gb/s RDMA per GPU")
TORCHTITAN_2506 = ("github.com/pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (its markdown "
                   "table since commit 8b6770a): same machines")
LLAMA3_PAPER = ("The Llama 3 Herd of Models (arXiv 2407.21783), Table 4: 405B pre-training on H100 SXM 80GB HBM3 "
                "at 700 W, RoCE 400 Gb/s per GPU")


@dataclass(frozen=True)
class Run:
    """One published run and the autoshard layout that plans the same thing."""

    key: str
    source: str  # where the figure is published
    table: str  # which table, in short
    row: str  # the row as published
    settings: str  # GPUs, parallelism, batch, sequence, precision, compile, activation checkpointing
    published: float
    unit: str  # "tokens/s/GPU" or "TFLOP/s/GPU"
    profile: str
    model: str  # a key of SHAPES
    mesh: tuple[tuple[str, int], ...]
    local_batch: int  # sequences per data-parallel rank per step
    seq: int
    recompute: str | None
    pipe: int = 1  # pipeline ranks (the rows with a pipeline: Llama 3 405B)
    virtual: int = 1  # stages per pipeline rank (interleaved 1F1B)
    #: an anchor is predicted within 15% by the preset (tests/cost_models/test_published_runs.py); a row that is not
    #: says why in ``note``
    anchor: bool = True
    note: str = ""

    @property
    def tp(self) -> int:
        return dict(self.mesh).get("model", 1)

    @property
    def gpus(self) -> int:
        n = self.pipe
        for _, size in self.mesh:
            n *= size
        return n


EAGER = ("eager (no torch.compile): the cost model has no notion of kernel fusion; the presets are anchored on "
         "torchtitan's torch.compile rows, and this row gets the same prediction as its compile row")
_8B_SAC = "seq 8192, bf16 (fp32 reduce), selective per-op AC"

RUNS: tuple[Run, ...] = (
    Run("8b-fsdp8-compile", TORCHTITAN_2412, "torchtitan H100 2024-12, Table 1", "FSDP + torch.compile: 6,667",
        f"8B, 8 GPUs, FSDP 8, local batch 2, {_8B_SAC}, torch.compile",
        6667, "tokens/s/GPU", "gpu-8x-nvlink", "8B", (("data", 8),), 2, 8192, SAC_OP),
    Run("8b-fsdp128-compile", TORCHTITAN_2412, "torchtitan H100 2024-12, Table 3", "FSDP + torch.compile: 6,514",
        f"8B, 128 GPUs (16 nodes), FSDP 128, local batch 2, {_8B_SAC}, torch.compile",
        6514, "tokens/s/GPU", "multi-node", "8B", (("data", 128),), 2, 8192, SAC_OP),
    Run("8b-fsdp8-tp8", TORCHTITAN_2506, "torchtitan async-TP H100 2025-06, Llama3 8b on 64 H100s",
        "Vanilla TP, None (bfloat16): 4378",
        f"8B, 64 GPUs, FSDP 8 x TP 8 (sequence parallel), local batch 12, {_8B_SAC}, torch.compile",
        4378, "tokens/s/GPU", "multi-node", "8B", (("data", 8), ("model", 8)), 12, 8192, SAC_OP),
    Run("70b-fsdp32-tp8", TORCHTITAN_2506, "torchtitan async-TP H100 2025-06, Llama3 70b on 256 H100s",
        "Vanilla TP, None (bfloat16): 597.3",
        "70B, 256 GPUs, FSDP 32 x TP 8 (sequence parallel), local batch 16, seq 8192, bf16 (fp32 reduce), full AC, "
        "torch.compile",
        597.3, "tokens/s/GPU", "multi-node", "70B", (("data", 32), ("model", 8)), 16, 8192, FULL_AC),
    Run("405b-8k", LLAMA3_PAPER, "Llama 3 paper, Table 4",
        "8,192 GPUs, TP 8, CP 1, PP 16, DP 64, seq 8,192, batch size/DP 32, 16M tokens/batch: 430 TFLOPs/GPU, "
        "43% BF16 MFU",
        "405B, 8192 GPUs, TP 8 x PP 16 x DP 64 (FSDP, no resharding after forward), 32 microbatches of one "
        "sequence per DP rank, interleaved 1F1B with one layer per stage (8 stages per rank), bf16, no AC",
        430, "TFLOP/s/GPU", "multi-node", "405B", (("data", 64), ("model", 8)), 32, 8192, None, pipe=16, virtual=8),
    Run("405b-16k", LLAMA3_PAPER, "Llama 3 paper, Table 4",
        "16,384 GPUs, TP 8, CP 1, PP 16, DP 128, seq 8,192, batch size/DP 16, 16M tokens/batch: 400 TFLOPs/GPU, "
        "41% BF16 MFU",
        "as 405b-8k on 16384 GPUs: DP 128, 16 microbatches per DP rank",
        400, "TFLOP/s/GPU", "multi-node", "405B", (("data", 128), ("model", 8)), 16, 8192, None, pipe=16, virtual=8),
    Run("8b-fsdp8", TORCHTITAN_2412, "torchtitan H100 2024-12, Table 1", "FSDP: 5,762",
        "as 8b-fsdp8-compile, eager", 5762, "tokens/s/GPU", "gpu-8x-nvlink", "8B", (("data", 8),), 2, 8192,
        SAC_OP, anchor=False, note=EAGER),
    Run("8b-fsdp128", TORCHTITAN_2412, "torchtitan H100 2024-12, Table 3", "FSDP: 5,605",
        "as 8b-fsdp128-compile, eager", 5605, "tokens/s/GPU", "multi-node", "8B", (("data", 128),), 2, 8192,
        SAC_OP, anchor=False, note=EAGER),
)


def llama_meta(model: str, layers: int, batch: int, seq: int):
    """``(module, kwargs)``: a ``LlamaForCausalLM`` of Llama 3 ``model``'s shape with ``layers`` decoder layers on
    the meta device, and ``input_ids``/``labels`` of ``batch`` sequences of ``seq`` tokens (CPU)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, ffn, heads, kv_heads, _ = SHAPES[model]
    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=ffn, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, vocab_size=VOCAB, max_position_embeddings=max(8192, seq),
                      rope_theta=500000.0, use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                      tie_word_embeddings=False)
    with torch.device("meta"):
        module = LlamaForCausalLM(cfg)
    ids = torch.zeros(batch, seq, dtype=torch.long)
    return module, {"input_ids": ids, "labels": ids}


@functools.lru_cache(maxsize=32)
def plan_run(model: str, mesh: tuple, batch: int, seq: int, recompute: str | None, layers: int, zero: int):
    """The plan of the layout (greedy planner; Megatron annotations with sequence parallelism when the mesh has a
    ``model`` axis; ``zero`` over ``data``; bf16 compute, fp32 reduction; AdamW) at ``layers`` decoder layers.
    Plans depend on the layout only, not on the profile: :func:`predict` prices one plan with any profile."""
    import torch

    from autoshard.api.sharded_module import make_options
    from autoshard.mesh import Mesh
    from autoshard.compiler.plan import build_plan
    from autoshard.frontend.precision import MixedPrecision
    from examples import models

    module, kwargs = llama_meta(model, layers, batch, seq)
    m = Mesh(**dict(mesh))
    tp = "model" in m.names
    annotations = models.megatron(m, "hf_llama") if tp else None
    options = make_options(annotations, "data", "replicate", m, profile="gpu-8x-nvlink", optimizer="adamw",
                           sequence_parallel=tp, zero=zero, recompute=recompute or False,
                           precision=MixedPrecision(torch.bfloat16, reduce_dtype=torch.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_plan(module, m, (), kwargs, options)


def _plans(run: Run, layers: int):
    if run.pipe > 1:  # one microbatch of one sequence per data-parallel rank, parameters gathered once (ZeRO-2)
        return plan_run(run.model, run.mesh, dict(run.mesh)["data"], run.seq, run.recompute, layers, 2)
    return plan_run(run.model, run.mesh, run.local_batch * dict(run.mesh)["data"], run.seq, run.recompute, layers, 3)


@dataclass(frozen=True)
class Parts:
    """A plan's step split the way a pipeline runs it: ``microbatch`` seconds (compute and the collectives of every
    axis but ``data``), ``once`` seconds (the ``data`` axis's collectives, the optimizer step, the profile's step
    overhead); ``step`` = their sum = ``PlanCost.step_time``."""

    microbatch: float
    once: float

    @property
    def step(self) -> float:
        return self.microbatch + self.once

    def __sub__(self, other):
        return Parts(self.microbatch - other.microbatch, self.once - other.once)

    def scaled(self, k: float, plus):
        return Parts(plus.microbatch + k * self.microbatch, plus.once + k * self.once)


def _collective_seconds(plan, profile):
    """``node -> seconds`` of an inserted collective of ``plan`` as ``plan.cost(profile)`` prices it
    (:func:`autoshard.cost_models.plan_cost.node_time`, with the nodes backward runs again where the cost model
    knows them)."""
    from autoshard.cost_models import plan_cost as pc

    gm, mesh = plan.graph_module, plan.mesh
    if hasattr(pc, "rerun_nodes"):
        rerun = pc.rerun_nodes(gm)
        return lambda n: pc.node_time(n, mesh, profile, rerun)[1]
    backward = pc.trains(gm)
    return lambda n: pc.node_time(n, mesh, profile, backward)[1]


def parts(plan, profile) -> Parts:
    """:class:`Parts` of ``plan`` priced by ``profile`` (the same node times as ``plan.cost(profile)``)."""
    from autoshard import meta as M

    cost = plan.cost(profile)
    seconds = _collective_seconds(plan, profile)
    data = sum(seconds(n) for n in plan.graph_module.graph.nodes
               if M.COLLECTIVE in n.meta and tuple(n.meta[M.COLLECTIVE].axes) == ("data",))
    once = data + cost.optimizer_time + cost.overhead_time
    return Parts(cost.step_time - once, once)


def layer_parts(run: Run, profile, layers: int | None = None) -> Parts:
    """The run's plan extrapolated to ``layers`` decoder layers (default: the model's) from its 1- and 2-layer
    plans: ``p(1) + (layers - 1)·(p(2) - p(1))``."""
    layers = SHAPES[run.model][4] if layers is None else layers
    one, two = (parts(_plans(run, n), profile) for n in (1, 2))
    return (two - one).scaled(layers - 1, one)


def bubble_fraction(stages: int, microbatches: int, virtual: int = 1) -> float:
    from autoshard.compiler.pipeline.options import bubble_fraction as bubble

    return bubble(stages, microbatches, virtual)


def step_time(run: Run, profile=None) -> float:
    """Predicted seconds of one training step of ``run`` on ``profile`` (default: the run's preset)."""
    from autoshard.cost_models.profile import load_profile

    profile = load_profile(run.profile) if profile is None else profile
    if run.pipe == 1:
        return layer_parts(run, profile).step
    # A pipeline rank holds (layers + 2) / pipe layers: the paper gives the first and the last rank one layer fewer,
    # their embedding and output projection taking a layer's place. Each microbatch runs its layers (compute and
    # the model axis's collectives) and sends each of its `virtual` stages' boundary activation forward and its
    # gradient back (one sequence, sharded over the model axis as sequence parallelism leaves it, on the inter-node
    # link: the pipe axis strides over nodes); m microbatches in the bubbled schedule; then its layers' share of
    # what runs once per step (the data axis's collectives, the optimizer step) and the profile's step overhead.
    from autoshard.cost_models.alpha_beta import collective_time

    one, two = (parts(_plans(run, n), profile) for n in (1, 2))
    layer = two - one
    per_rank = (SHAPES[run.model][4] + 2) / run.pipe
    boundary = run.seq * SHAPES[run.model][0] * 2 / run.tp  # bf16 activation of one sequence, per model rank
    transfers = 2 * run.virtual * collective_time("send_recv", boundary, 2, profile.link_for("pipe", 0))
    microbatches = run.local_batch  # one sequence per microbatch
    bubble = bubble_fraction(run.pipe, microbatches, run.virtual)
    return (microbatches * (per_rank * layer.microbatch + transfers) / (1 - bubble) + per_rank * layer.once
            + profile.step_overhead)


def model_flops_per_token(model: str, seq: int) -> float:
    """Training FLOPs per token by torchtitan's (and PaLM's) count: 6 x the parameters but the input embedding, plus
    12 x layers x hidden x seq for attention (the full, non-causal score matrix)."""
    hidden, ffn, heads, kv_heads, layers = SHAPES[model]
    head_dim = hidden // heads
    per_layer = hidden * (hidden + 2 * kv_heads * head_dim) + hidden * hidden + 3 * hidden * ffn + 2 * hidden
    params = layers * per_layer + hidden + hidden * VOCAB  # + final norm + output projection
    return 6 * params + 12 * layers * hidden * seq


def tokens_per_gpu(run: Run) -> float:
    """Tokens one GPU's step accounts for: the data-parallel rank's batch over the GPUs that share it."""
    return run.local_batch * run.seq / (run.tp * run.pipe)


def predict(run: Run, profile=None) -> float:
    """The run's published quantity (tokens/s/GPU or model TFLOP/s/GPU) as ``profile`` (default: its preset)
    predicts it."""
    tps = tokens_per_gpu(run) / step_time(run, profile)
    return tps if run.unit == "tokens/s/GPU" else tps * model_flops_per_token(run.model, run.seq) / 1e12


def linearity(run: Run, profile=None) -> tuple[float, float]:
    """(3-layer plan's step, its extrapolation from the 1- and 2-layer plans): equal when the per-layer costs are."""
    from autoshard.cost_models.profile import load_profile

    profile = load_profile(run.profile) if profile is None else profile
    return parts(_plans(run, 3), profile).step, layer_parts(run, profile, 3).step


def rows(profiles: dict | None = None, runs=RUNS) -> list[dict]:
    """Per run: the prediction from ``profiles`` (preset name -> HardwareProfile; default: the presets), its error
    ``predicted / published - 1`` and the predicted step in seconds."""
    out = []
    for run in runs:
        profile = (profiles or {}).get(run.profile)
        pred = predict(run, profile)
        out.append({"run": run, "predicted": pred, "error": pred / run.published - 1,
                    "step": step_time(run, profile)})
    return out


def format_rows(table: list[dict], markdown: bool = False) -> str:
    if markdown:
        lines = ["| run | source: row | settings (as planned) | preset | published | predicted | error |",
                 "|---|---|---|---|---:|---:|---:|"]
        for r in table:
            run = r["run"]
            lines.append(f"| `{run.key}` | {run.table}: {run.row} | {run.settings} | `{run.profile}` | "
                         f"{run.published:,.1f} {run.unit} | {r['predicted']:,.1f} | {r['error']:+.1%} |")
        return "\n".join(lines)
    lines = [f"{'run':<20}{'preset':<15}{'published':>12}{'predicted':>12}{'error':>9}{'step s':>9}  unit"]
    for r in table:
        run = r["run"]
        lines.append(f"{run.key:<20}{run.profile:<15}{run.published:>12.1f}{r['predicted']:>12.1f}"
                     f"{r['error']:>+9.1%}{r['step']:>9.3f}  {run.unit}{'' if run.anchor else '  (not an anchor)'}")
    worst = max(abs(r["error"]) for r in table if r["run"].anchor)
    lines.append(f"largest |error| of the anchors {worst:.1%} (acceptance: 15%)")
    return "\n".join(lines)


def sensitivity() -> list[tuple[str, str, float, float]]:
    """``(what, run, predicted, error)`` of the presets with one choice changed: the NVLink links' ``overlap`` at 0
    and 0.9; multi-node without its innermost-axis link (a one-axis mesh over nodes at one NIC's 50 GB/s); the 405B
    pipeline with 1, 2 or 4 stages per rank instead of 8."""
    import dataclasses

    from autoshard.cost_models.profile import load_profile

    presets = {name: load_profile(name) for name in ("gpu-8x-nvlink", "multi-node")}
    out = []

    def nvlink_overlap(p, overlap):
        link = dataclasses.replace(p.link, overlap=overlap)
        axes = tuple((k, dataclasses.replace(v, overlap=overlap) if k == "#-1" else v) for k, v in p.axes)
        return dataclasses.replace(p, link=link, axes=axes)

    for overlap in (0.0, 0.9):
        profiles = {k: nvlink_overlap(p, overlap) for k, p in presets.items()}
        out += [(f"NVLink overlap {overlap}", r["run"].key, r["predicted"], r["error"])
                for r in rows(profiles) if r["run"].anchor]
    one_nic = {"multi-node": dataclasses.replace(presets["multi-node"],
                                                 axes=tuple(a for a in presets["multi-node"].axes if a[0] != "#-1"))}
    out += [("one axis over nodes at one NIC (no '#-1' link)", r["run"].key, r["predicted"], r["error"])
            for r in rows(one_nic, [run for run in RUNS if run.mesh == (("data", 128),)])]
    for virtual in (1, 2, 4):
        runs = [dataclasses.replace(run, virtual=virtual) for run in RUNS if run.pipe > 1]
        out += [(f"405B with {virtual} stage(s) per pipeline rank", r["run"].key, r["predicted"], r["error"])
                for r in rows(None, runs)]
    return out


def data_axis_gathers(run: Run, profile=None) -> float:
    """Seconds of the run's ``data``-axis all-gathers (forward, and again in backward at ZeRO-3) in the predicted
    step: what FSDP's prefetch hides behind compute and the cost model does not."""
    from autoshard import meta as M
    from autoshard.cost_models.profile import load_profile

    profile = load_profile(run.profile) if profile is None else profile

    def gathers(plan):
        seconds = _collective_seconds(plan, profile)
        return sum(seconds(n) for n in plan.graph_module.graph.nodes
                   if M.COLLECTIVE in n.meta and n.meta[M.COLLECTIVE].kind.startswith("all_gather")
                   and tuple(n.meta[M.COLLECTIVE].axes) == ("data",))

    one, two = (gathers(_plans(run, n)) for n in (1, 2))
    return one + (SHAPES[run.model][4] - 1) * (two - one)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true", help="print docs/cost_model.md's tables")
    ap.add_argument("--check-linear", action="store_true", help="3-layer plans against the extrapolation")
    ap.add_argument("--full", action="store_true", help="the whole 32-layer 8B plans against the extrapolation")
    ap.add_argument("--sensitivity", action="store_true", help="the predictions with one preset choice changed")
    args = ap.parse_args(argv)
    table = rows()
    if args.markdown:
        print(format_rows([r for r in table if r["run"].anchor], markdown=True))
        print()
        print(format_rows([r for r in table if not r["run"].anchor], markdown=True))
    else:
        print(format_rows(table))
    if args.check_linear:
        for run in RUNS:
            three, line = linearity(run)
            print(f"{run.key:<20} 3 layers {three:.9f} s, extrapolated {line:.9f} s, "
                  f"relative difference {three / line - 1:+.2e}")
    if args.full:
        from autoshard.cost_models.profile import load_profile

        for run in RUNS:
            if run.model != "8B" or run.mesh == (("data", 128),) or not run.anchor:
                continue
            profile = load_profile(run.profile)
            whole = parts(_plans(run, SHAPES[run.model][4]), profile).step
            line = layer_parts(run, profile).step
            print(f"{run.key:<20} {SHAPES[run.model][4]} layers planned {whole:.9f} s, extrapolated {line:.9f} s, "
                  f"relative difference {whole / line - 1:+.2e}")
    if args.sensitivity:
        for what, key, pred, err in sensitivity():
            print(f"{what:<48}{key:<20}{pred:>10.1f}{err:>+9.1%}")
        for run in RUNS:
            if run.mesh == (("data", 128),):
                import dataclasses

                from autoshard.cost_models.profile import load_profile

                p = load_profile(run.profile)
                one_nic = dataclasses.replace(p, axes=tuple(a for a in p.axes if a[0] != "#-1"))
                print(f"{run.key}: data-axis all-gathers {data_axis_gathers(run):.3f} s of a {step_time(run):.3f} s "
                      f"step; at one NIC's 50 GB/s {data_axis_gathers(run, one_nic):.3f} s of "
                      f"{step_time(run, one_nic):.3f} s")
    return 0 if max(abs(r["error"]) for r in table if r["run"].anchor) <= 0.15 else 1


if __name__ == "__main__":
    sys.exit(main())
