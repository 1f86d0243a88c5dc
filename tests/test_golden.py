"""Golden files: the generated per-rank code and the printed plan, compared whole-text with ``tests/golden/``.

A change in codegen, propagation or collective insertion shows up here as a unified diff. When the change is
intended, rewrite the files with ``pytest tests/test_golden.py --update-golden`` and review the diff in git.
Compiling the same case twice must give byte-identical code (no ids, addresses or paths in the output).
"""

from __future__ import annotations

import difflib
import functools
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

import autoshard
from autoshard.compiler.plan import Plan
from examples import models

GOLDEN = Path(__file__).resolve().parent / "golden"


@dataclass(frozen=True)
class Case:
    """One compiled model: factory name and arguments, mesh, whether to use the Megatron annotations, and
    ``compile`` options written as the CLI's flags (``zero``, ``recompute``; ``moe`` and ``pipeline`` as
    ``MoE.parse``/``Pipeline.parse`` text; ``precision`` a torch dtype name)."""

    factory: str
    mesh: str
    megatron: bool = False
    factory_args: tuple[tuple[str, int], ...] = ()
    options: tuple[tuple[str, int | str], ...] = ()

    def compile(self) -> Plan:
        import torch

        mesh = autoshard.Mesh.parse(self.mesh)
        model, args, kwargs = models.FACTORIES[self.factory](**dict(self.factory_args))
        plan = models.megatron(mesh, self.factory) if self.megatron else None
        options: dict = dict(self.options)
        if "moe" in options:
            options["moe"] = autoshard.MoE.parse(options["moe"])
        if "pipeline" in options:
            options["pipeline"] = autoshard.Pipeline.parse(options["pipeline"])
        if "precision" in options:
            options["precision"] = autoshard.MixedPrecision(getattr(torch, options["precision"]))
        return autoshard.compile(model, mesh, args, kwargs, plan=plan, **options).plan


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
                                  "gpt_l1_data2_moe4_top2_rank1"])
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
