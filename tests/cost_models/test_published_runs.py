"""The GPU presets predict the published H100 runs that anchor their efficiency numbers within 15%.

The runs, their sources and the layouts that plan them are :data:`bench/published_runs.py <RUNS>`; each prediction
is recomputed here from the preset files (``load_profile("gpu-8x-nvlink")`` / ``("multi-node")``), by pricing the
Llama-3-shaped meta-device model planned with 1 and 2 decoder layers and extrapolating to the model's depth (exact:
checked against a 3-layer plan). The table in docs/cost_model.md must show the same numbers.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 0.15


def _load_bench():
    path = _ROOT / "bench" / "published_runs.py"
    spec = importlib.util.spec_from_file_location("autoshard_bench_published_runs", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


bench = _load_bench()
ANCHORS = [run for run in bench.RUNS if run.anchor]


def _run(key: str):
    return next(run for run in bench.RUNS if run.key == key)


@pytest.mark.parametrize("run", ANCHORS, ids=lambda run: run.key)
def test_preset_predicts_the_published_run(run):
    predicted = bench.predict(run)  # from the preset file named by the run, nothing passed in
    error = predicted / run.published - 1
    assert abs(error) <= TOLERANCE, (f"{run.key}: preset {run.profile} predicts {predicted:.1f} {run.unit}, "
                                     f"published {run.published} ({run.row}): error {error:+.1%}")


def test_anchors_cover_the_sources():
    """Both presets, torchtitan's 8B and 70B tables and the Llama 3 paper are anchors."""
    assert {run.profile for run in ANCHORS} == {"gpu-8x-nvlink", "multi-node"}
    assert {run.model for run in ANCHORS} == {"8B", "70B", "405B"}
    assert any(run.tp > 1 for run in ANCHORS) and any(run.pipe > 1 for run in ANCHORS)


def test_eager_rows_are_not_anchors_and_predicted_as_their_compile_rows():
    """The cost model does not price kernel fusion: an eager row's prediction is its torch.compile row's, which
    is faster than the eager run measured."""
    for eager_key, compile_key in (("8b-fsdp8", "8b-fsdp8-compile"), ("8b-fsdp128", "8b-fsdp128-compile")):
        eager, compiled = _run(eager_key), _run(compile_key)
        assert not eager.anchor and eager.note
        assert eager.published < compiled.published
        assert bench.predict(eager) == pytest.approx(bench.predict(compiled), rel=1e-12)
        assert bench.predict(eager) > eager.published


def test_layer_extrapolation_is_exact():
    """Identical layers cost the same: the 3-layer plan's step is the 1- and 2-layer plans' line at 3."""
    three, line = bench.linearity(_run("8b-fsdp8-compile"))
    assert three == pytest.approx(line, rel=1e-9)


def test_docs_table_shows_the_predictions():
    """docs/cost_model.md's published-run table: every run's row, its published figure and the prediction the
    presets give now (to the printed digits)."""
    text = (_ROOT / "docs" / "cost_model.md").read_text()
    for run in bench.RUNS:
        match = re.search(rf"^\| `{re.escape(run.key)}` \|.*\| ([\d,.]+) {re.escape(run.unit)} \| ([\d,.]+) \| "
                          r"([+-][\d.]+)% \|$", text, re.MULTILINE)
        assert match, f"docs/cost_model.md has no table row for `{run.key}`"
        published, predicted = (float(match.group(i).replace(",", "")) for i in (1, 2))
        assert published == pytest.approx(run.published)
        assert predicted == pytest.approx(round(bench.predict(run), 1), abs=0.051), (
            f"docs/cost_model.md shows {predicted} for `{run.key}`; the presets predict {bench.predict(run):.1f}: "
            "rerun `python bench/published_runs.py --markdown`")
