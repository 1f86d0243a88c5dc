"""Golden files: the generated per-rank code and the printed plan, compared whole-text with ``tests/golden/``.

A change in codegen, propagation or collective insertion shows up here as a unified diff. When the change is
intended, rewrite the files with ``pytest tests/test_golden.py --update-golden`` and review the diff in git.
Compiling the same case twice must give byte-identical code (no ids, addresses or paths in the output).

Each golden of a feature (sequence parallelism, ZeRO-1/2, the plan search, a Hugging Face sparse-MoE block, the
Ulysses and all-gather context-parallel attentions, the bucketed program a ShardedModule runs) also has a marker
check (``MARKERS``, ``test_bucketed_rank_program``): the collective or op that feature is made of must be in the
program, so rewriting a golden cannot silently drop the feature.
"""

from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

import autoshard
from autoshard.compiler.plan import Plan
from examples import models

GOLDEN = Path(__file__).resolve().parent / "golden"


@dataclass(frozen=True)
class Case:
    """One compiled model: factory name (of ``examples.models.FACTORIES``, else a function of ``examples.models``
    such as ``hf_mixtral``) and arguments, mesh, whether to use the Megatron annotations, and ``compile`` options
    written as the CLI's flags (``zero``, ``recompute``, ``planner``, ``profile``, ``sequence_parallel``; ``moe``
    and ``pipeline`` as ``MoE.parse``/``Pipeline.parse`` text; ``precision`` a torch dtype name;
    ``context_axis`` as ``"AXIS:ATTENTION"``, i.e. ``ContextParallel(AXIS, ATTENTION)``)."""

    factory: str
    mesh: str
    megatron: bool = False
    factory_args: tuple[tuple[str, int], ...] = ()
    options: tuple[tuple[str, int | str | bool], ...] = ()

    def sharded(self, comm=None) -> autoshard.ShardedModule:
        """``autoshard.compile`` of this case (``comm``: the communicator of the rank it runs as)."""
        import torch

        mesh = autoshard.Mesh.parse(self.mesh)
        factory = models.FACTORIES.get(self.factory) or getattr(models, self.factory)
        model, args, kwargs = factory(**dict(self.factory_args))
        plan = models.megatron(mesh, self.factory) if self.megatron else None
        options: dict = dict(self.options)
        if "moe" in options:
            options["moe"] = autoshard.MoE.parse(options["moe"])
        if "pipeline" in options:
            options["pipeline"] = autoshard.Pipeline.parse(options["pipeline"])
        if "precision" in options:
            options["precision"] = autoshard.MixedPrecision(getattr(torch, options["precision"]))
        if "context_axis" in options:
            options["context_axis"] = autoshard.ContextParallel(*options["context_axis"].split(":"))
        return autoshard.compile(model, mesh, args, kwargs, annotations=plan, comm=comm, **options)

    def compile(self) -> Plan:
        return self.sharded().plan

    def inputs(self) -> tuple[tuple, dict]:
        """The factory's example inputs (global)."""
        factory = models.FACTORIES.get(self.factory) or getattr(models, self.factory)
        _, args, kwargs = factory(**dict(self.factory_args))
        return args, kwargs


MLP_DATA = Case("mlp", "data=2")
MLP_MODEL = Case("mlp", "model=2", megatron=True)
GPT_2D = Case("gpt", "data=2,model=2", megatron=True, factory_args=(("layers", 1),))
GPT_MODEL = Case("gpt", "model=2", megatron=True, factory_args=(("layers", 1),))
GPT2_MODEL = Case("hf_gpt2", "model=2", megatron=True, factory_args=(("layers", 1),))
LLAMA_MODEL = Case("hf_llama", "model=2", megatron=True, factory_args=(("layers", 1),))
GPT_ZERO3 = Case("gpt", "data=2", factory_args=(("layers", 1),), options=(("zero", 3),))
GPT_PIPELINE = Case("gpt", "pipe=2", factory_args=(("layers", 2),),
                    options=(("pipeline", "microbatches=2,schedule=1f1b"),))
GPT_MOE_EP = Case("gpt", "data=2", factory_args=(("layers", 1),),
                  options=(("moe", "layers=blocks.*.mlp,num_experts=4,top_k=2"),))
GPT_RECOMPUTE = Case("gpt", "model=2", megatron=True, factory_args=(("layers", 1),),
                     options=(("recompute", "blocks.*"),))
MLP_BF16 = Case("mlp", "data=2,model=2", megatron=True, options=(("precision", "bfloat16"),))
GPT_SP = Case("gpt", "model=2", megatron=True, factory_args=(("layers", 1),), options=(("sequence_parallel", True),))
MLP_ZERO1 = Case("mlp", "data=2", options=(("zero", 1),))
MLP_ZERO2 = Case("mlp", "data=2", options=(("zero", 2),))
# large enough that splitting pays on the GPU profile; 9 decisions: the exact search proves its optimum in well
# under a second (report: optimal, gap 0, not timed out) and finds Megatron's column/row split by itself
MLP_SEARCH = Case("mlp", "model=2", factory_args=(("batch", 64), ("hidden", 256)),
                  options=(("planner", "search"), ("profile", "gpu-8x-nvlink")))
MIXTRAL_EP = Case("hf_mixtral", "data=2", factory_args=(("layers", 1),),
                  options=(("moe", "existing=true,expert_axis=data,capacity_factor=none"),))
LLAMA_ULYSSES = Case("hf_llama", "context=2", factory_args=(("layers", 1),),
                     options=(("context_axis", "context:ulysses"),))
LLAMA_CP_ALL_GATHER = Case("hf_llama", "context=2", factory_args=(("layers", 1),),
                           options=(("context_axis", "context:all_gather"),))

#: golden file name -> (case, rank whose code is kept)
CODE_CASES: dict[str, tuple[Case, int]] = {
    "mlp_data2_rank0": (MLP_DATA, 0),
    "mlp_model2_megatron_rank1": (MLP_MODEL, 1),
    "gpt_l1_data2_model2_megatron_rank3": (GPT_2D, 3),
    "hf_gpt2_l1_model2_megatron_rank0": (GPT2_MODEL, 0),
    "hf_llama_l1_model2_megatron_rank1": (LLAMA_MODEL, 1),
    "gpt_l1_data2_zero3_rank0": (GPT_ZERO3, 0),
    "gpt_l2_pipe2_1f1b_rank1": (GPT_PIPELINE, 1),  # rank 1 runs stage 1 (the loss)
    "gpt_l1_data2_moe4_top2_rank1": (GPT_MOE_EP, 1),  # experts 2-3 on rank 1, all-to-all over data
    "gpt_l1_model2_megatron_recompute_rank0": (GPT_RECOMPUTE, 0),
    "mlp_data2_model2_megatron_bf16_rank3": (MLP_BF16, 3),
    "gpt_l1_model2_megatron_sp_rank0": (GPT_SP, 0),
    "mlp_data2_zero1_rank0": (MLP_ZERO1, 0),
    "mlp_data2_zero2_rank1": (MLP_ZERO2, 1),
    "mlp_b64_h256_model2_search_rank1": (MLP_SEARCH, 1),
    "hf_mixtral_l1_data2_experts_rank1": (MIXTRAL_EP, 1),  # HF's own sparse-MoE block, experts 2-3 on rank 1
    "hf_llama_l1_context2_ulysses_rank1": (LLAMA_ULYSSES, 1),
    "hf_llama_l1_context2_all_gather_rank0": (LLAMA_CP_ALL_GATHER, 0),
}
#: golden file name -> case whose plain-text plan (``Plan.format()``) is kept
FORMAT_CASES: dict[str, Case] = {
    "gpt_l1_model2_megatron_plan": GPT_MODEL,
}


#: The MoE layers' record key (``autoshard.runtime.moe.records.new_key``: "moe0", "moe1", ...) is unique per expert
#: rewrite in the process, so two models compiled in one process never share records. It is the one value of
#: generated code that depends on what the process compiled before; the comparisons read it as ``'moe<key>'``.
_MOE_KEY = re.compile(r"'moe\d+'")


def code_of(plan: Plan, rank: int) -> str:
    """``plan.code(rank)`` with the MoE record key written as ``'moe<key>'``."""
    return _MOE_KEY.sub("'moe<key>'", plan.code(rank))


@functools.cache
def compiled(case: Case) -> Plan:
    return case.compile()


def check_golden(path: Path, actual: str, update: bool) -> None:
    """Compare ``actual`` with the file at ``path``; with ``update`` rewrite the file instead."""
    if update:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(actual, newline="\n")
        return
    if not path.exists():
        pytest.fail(f"golden file {path.name} does not exist. Create it with `pytest {Path(__file__).name} "
                    "--update-golden` and commit it.")
    expected = path.read_text()
    if actual == expected:
        return
    diff = "".join(difflib.unified_diff(expected.splitlines(keepends=True), actual.splitlines(keepends=True),
                                        fromfile=f"golden/{path.name}", tofile="generated"))
    pytest.fail(f"generated output differs from golden/{path.name}. If the change is intended, run "
                f"`pytest tests/test_golden.py --update-golden` and review the diff.\n{diff}", pytrace=False)


@pytest.mark.parametrize("name", sorted(CODE_CASES))
def test_rank_code(name: str, update_golden: bool) -> None:
    case, rank = CODE_CASES[name]
    check_golden(GOLDEN / f"{name}.py", code_of(compiled(case), rank), update_golden)


@pytest.mark.parametrize("name", sorted(FORMAT_CASES))
def test_plan_format(name: str, update_golden: bool) -> None:
    check_golden(GOLDEN / f"{name}.txt", compiled(FORMAT_CASES[name]).format(), update_golden)


@pytest.mark.parametrize("name", ["gpt_l1_data2_model2_megatron_rank3", "hf_llama_l1_model2_megatron_rank1",
                                  "gpt_l1_data2_moe4_top2_rank1", "mlp_b64_h256_model2_search_rank1",
                                  "hf_mixtral_l1_data2_experts_rank1"])
def test_compiling_twice_gives_identical_code(name: str) -> None:
    case, rank = CODE_CASES[name]
    first, second = compiled(case), case.compile()
    assert code_of(first, rank) == code_of(second, rank)
    assert first.format() == second.format()


@pytest.mark.parametrize("name", sorted(CODE_CASES))
def test_rank_programs_name_no_device(name):
    """A plan traced on CPU (or meta) runs on any device: factories read the device of the rank's weights."""
    case, rank = CODE_CASES[name]
    code = compiled(case).code(rank)
    assert "device(type=" not in code and "device = rank_device" in code or "device" not in code


# ---- feature markers: what each feature's golden must show --------------------------------------------------
def _collectives(code: str, kind: str) -> int:
    """How many calls of ``torch.ops.autoshard.<kind>`` the program makes."""
    return code.count(f"torch.ops.autoshard.{kind}.default(")


def _params(plan: Plan, rank: int) -> dict:
    """Parameter name -> (local numel on ``rank``, global numel)."""
    global_ = dict(plan.graph_module.named_parameters())
    return {n: (p.numel(), global_[n].numel()) for n, p in plan.rank_program(rank).named_parameters()}


def _attention_collectives(case: Case, plan: Plan, rank: int):
    """The forward collectives of ``rank`` when the simulator runs ``plan``: the context-parallel attention's own
    collectives run inside the runtime's ``context_attention``, not as nodes of the program text."""
    from autoshard.runtime import collective_counts

    args, kwargs = case.inputs()
    return collective_counts(plan.simulate(args, kwargs).logs[rank], "forward")


def _sequence_parallel(code: str, plan: Plan, rank: int) -> None:
    # the residual is reduce-scattered along the sequence, every norm runs on its sequence shard, and the norm's
    # output is all-gathered for the column-parallel linears (backward: a reduce-scatter); no activation all-reduce
    norms = re.findall(r"layer_norm\.default\((\w+),", code)
    assert len(norms) == 3 and all(n.startswith("reduce_scatter") for n in norms), norms
    assert _collectives(code, "reduce_scatter") == 3 and _collectives(code, "all_gather_sync") == 3
    assert _collectives(code, "all_reduce") == 1  # the loss only


def _zero(stage: int):
    def check(code: str, plan: Plan, rank: int) -> None:
        storage = plan.param_storage()
        assert storage and all(s.stage == stage for s in storage.values())
        # each rank stores (and its optimizer steps, keeping Adam's state for) half of every parameter
        params = _params(plan, rank)
        assert set(params) == set(storage) and all(2 * local == whole for local, whole in params.values()), params
        gathers = re.findall(r"(all_gather\w*)\.default\((\w+), 'data'", code)
        assert sorted(p for _, p in gathers) == sorted(n.replace(".", "_") for n in storage), gathers
        if stage == 1:  # gathered for use; the whole gradient all-reduced, this rank's slice kept (the gather's
            # backward)
            assert {k for k, _ in gathers} == {"all_gather"} and "all_gather_sync" not in code
            assert _collectives(code, "grad_all_reduce") == len(storage)
            assert all(f"grad_all_reduce.default(all_gather{s}, ['data'])" in code
                       for s in ["", *(f"_{i}" for i in range(1, len(storage)))])
        else:  # the gather's backward reduce-scatters the gradient: only this rank's slice is ever reduced
            assert {k for k, _ in gathers} == {"all_gather_sync"} and "grad_all_reduce" not in code
    return check


def _search(code: str, plan: Plan, rank: int) -> None:
    report = plan.context.report["plan_search"]
    assert report["optimal"] and report["gap"] == 0 and not report["timed_out"], report  # proven, not time-limited
    # the search split the MLP Megatron-style by itself (no annotations): fc2 row-parallel, its output all-reduced
    assert plan.context.options.planner == "search" and not plan.context.options.annotations
    assert "bias_once(fc2_bias" in code and "all_reduce.default(linear_1, 'model')" in code
    assert {n: 2 * local == whole for n, (local, whole) in _params(plan, rank).items()} == {
        "fc1.weight": True, "fc1.bias": True, "fc2.weight": True, "fc2.bias": False}


def _hf_moe(code: str, plan: Plan, rank: int) -> None:
    # Hugging Face's MixtralSparseMoeBlock kept (existing=True): its stacked experts split over `data`, tokens sent
    # to their experts' rank and back by two all-to-alls
    assert code.count("slot_groups(") == 1 and code.count("dispatch_groups(") == 1
    assert _collectives(code, "all_to_all") == len(re.findall(r"all_to_all\.default\(\w+, 'data',", code)) == 2
    params = _params(plan, rank)
    for p in ("gate_up_proj", "down_proj"):
        local, whole = params[f"model.layers.0.mlp.experts.{p}"]
        assert 2 * local == whole


def _context(form: str, kind: str, least: int):
    def check(code: str, plan: Plan, rank: int) -> None:
        assert code.count("context_attention(") == 1 and f"'context', 2, '{form}'" in code
        counts = _attention_collectives(CODE_CASES[_CONTEXT_NAMES[form]][0], plan, rank)
        own = _collectives(code, kind)
        assert counts[(kind, "context")] - own >= least, (counts, own)
        assert not {k for k, _ in counts} & {"send", "recv"} - {kind}
    return check


_CONTEXT_NAMES = {"ulysses": "hf_llama_l1_context2_ulysses_rank1",
                  "all_gather": "hf_llama_l1_context2_all_gather_rank0"}

#: golden file name -> check of the feature it is the golden of: ``check(code, plan, rank)``
MARKERS: dict[str, Callable[[str, Plan, int], None]] = {
    "gpt_l1_model2_megatron_sp_rank0": _sequence_parallel,
    "mlp_data2_zero1_rank0": _zero(1),
    "mlp_data2_zero2_rank1": _zero(2),
    "mlp_b64_h256_model2_search_rank1": _search,
    "hf_mixtral_l1_data2_experts_rank1": _hf_moe,
    # Ulysses: all-to-alls of q, k, v (sequence -> heads) and of the output back; all-gather: of k and v
    "hf_llama_l1_context2_ulysses_rank1": _context("ulysses", "all_to_all", 4),
    "hf_llama_l1_context2_all_gather_rank0": _context("all_gather", "all_gather", 2),
}


@pytest.mark.parametrize("name", sorted(MARKERS))
def test_golden_shows_its_feature(name: str) -> None:
    case, rank = CODE_CASES[name]
    plan = compiled(case)
    MARKERS[name](code_of(plan, rank), plan, rank)


# ---- the bucketed program: what ShardedModule runs with bucket_cap_mb left at its default ----------------------
#: the program of rank 1 of a data-parallel GPT whose gradients fill two buckets (DDP's 1 MiB first one, then 25 MiB)
BUCKETED = (Case("gpt", "data=2", factory_args=(("layers", 1), ("hidden", 256))), 1)
BUCKETED_NAME = "gpt_l1_h256_data2_bucketed_rank1"


def bucketed_program(case: Case, rank: int) -> tuple[str, object]:
    """The rank program ``ShardedModule`` builds and runs on ``rank`` (``bucket_cap_mb`` left at its default), then
    the buckets its GradBucketer all-reduces the gradients in, as comment lines; and the bucketer."""
    from autoshard.runtime import SimWorld

    sharded = case.sharded(comm=SimWorld(autoshard.Mesh.parse(case.mesh)).communicator(rank))
    assert sharded.bucket_cap_mb is None and sharded.bucketing
    code = sharded.materialize().code.strip() + "\n"
    bucketer = sharded.bucketer
    head = "# gradient all-reduces run outside the program, by GradBucketer (bucket_cap_mb=None), bucket by bucket"
    lines = ["", f"{head} in this order:"]
    for i, b in enumerate(bucketer.buckets):
        lines.append(f"# bucket {i}: over {list(b.axes)}, {b.dtype}, closes at {b.limit} bytes, {b.numel} elements")
        lines += [f"#   {offset:>7} {name}" for name, offset in zip(b.names, b.offsets)]
    return _MOE_KEY.sub("'moe<key>'", code) + "\n".join(lines) + "\n", bucketer


@pytest.mark.filterwarnings("ignore:no torch.distributed process group")
def test_bucketed_rank_program(update_golden: bool) -> None:
    case, rank = BUCKETED
    text, bucketer = bucketed_program(case, rank)
    check_golden(GOLDEN / f"{BUCKETED_NAME}.py", text, update_golden)
    # marker: no per-parameter gradient sync left in the program; every parameter's gradient is in a bucket,
    # the first one DDP's 1 MiB, the rest 25 MiB
    program = text.split("\n\n# gradient all-reduces")[0]
    assert "grad_all_reduce" not in program and _collectives(program, "all_reduce") == 1  # the loss
    names = [n for b in bucketer.buckets for n in b.names]
    assert sorted(names) == sorted(n for n, _ in compiled(case).graph_module.named_parameters())
    assert [b.limit for b in bucketer.buckets] == [2**20, 25 * 2**20]
    assert text == bucketed_program(case, rank)[0]
