"""Calibration: the fits on synthetic samples, one real run on gloo through the runtime's communicator, the CLI
entry."""

from __future__ import annotations

import math

import pytest
from autoshard.cost_models import calibrate as cal_mod
from autoshard.cost_models.calibrate import (
    Calibration,
    CollectiveFit,
    fit_collective,
    fit_line,
    fit_link,
    measure,
)
from autoshard.cost_models.alpha_beta import collective_time
from autoshard.cost_models.profile import LinkCost, load_profile

from autoshard.errors import AutoshardError, CollectiveTimeoutError

TRUE = LinkCost(alpha=50e-6, beta=1 / 2e9)
SIZES = (1 << 10, 1 << 16, 1 << 20, 1 << 22)


def _samples(kind, world_size, link=TRUE, noise=()):
    return [(s, collective_time(kind, s, world_size, link) * (noise[i] if noise else 1.0))
            for i, s in enumerate(SIZES)]


def test_fit_line_is_exact_on_a_line():
    intercept, slope = fit_line([(0, 1.0), (10, 3.0), (20, 5.0)])
    assert intercept == pytest.approx(1.0) and slope == pytest.approx(0.2)


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "all_to_all"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_fit_collective_divides_out_the_model_coefficients(kind, world_size):
    fit = fit_collective(kind, _samples(kind, world_size), world_size)
    assert fit.alpha == pytest.approx(TRUE.alpha, rel=1e-9)
    assert fit.beta == pytest.approx(TRUE.beta, rel=1e-9)


def test_joint_fit_recovers_the_link_through_noise():
    noise = (1.05, 0.97, 1.02, 0.99)
    samples = {k: _samples(k, 4, noise=noise) for k in ("all_reduce", "all_gather", "all_to_all")}
    link = fit_link(samples, 4)
    assert link.alpha == pytest.approx(TRUE.alpha, rel=0.1)
    assert link.beta == pytest.approx(TRUE.beta, rel=0.1)


def test_times_that_do_not_grow_are_an_error():
    with pytest.raises(AutoshardError, match="beta=.* must be > 0"):
        fit_collective("all_reduce", [(1024, 2e-3), (1 << 20, 1e-3)], 2)
    with pytest.raises(AutoshardError, match="at least 2 distinct sizes"):
        fit_line([(1024, 1e-3), (1024, 2e-3)])


def test_bad_arguments():
    with pytest.raises(AutoshardError, match="world_size=1"):
        measure(world_size=1)
    with pytest.raises(AutoshardError, match="at least 2 distinct positive sizes"):
        measure(sizes=(4096,))


SIZES = (1 << 10, 1 << 22, 1 << 25)


@pytest.mark.gloo
def test_real_run_on_two_gloo_processes(tmp_path, monkeypatch):
    raw = {}
    run_workers = cal_mod._run_workers

    def keep(*args):
        raw.update(run_workers(*args))
        return raw

    monkeypatch.setattr(cal_mod, "_run_workers", keep)
    # sizes up to 32 MiB: under the suite's load (2 cores, 4-6 busy processes) a collective of a few MiB took no
    # longer than one of 1 KiB (all_reduce 3.0, 4.1, 2.7 ms at 1 KiB, 1 MiB, 4 MiB: a peer waiting for a core), and
    # the fit refused a negative beta; at 32 MiB the transfer itself (tens of ms on gloo) outweighs that wait
    cal = measure(world_size=2, sizes=SIZES, repeats=5, timeout=60)
    # measured through the runtime's communicator: every timed call (2 warm-up + 5 per size) is in its log
    assert raw["transport"] == "DistCommunicator"
    kinds = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"]
    assert raw["calls"]["all_reduce"] >= 3 * 7  # (and the overlap probe's)
    assert {k: raw["calls"][k] for k in kinds[1:]} == dict.fromkeys(kinds[1:], 3 * 7)
    assert [f.kind for f in cal.fits] == kinds
    # each collective's own link, the joint one as the default
    assert dict(cal.link.kinds) == {f.kind: LinkCost(f.alpha, f.beta) for f in cal.fits}
    assert 0 <= cal.link.overlap <= 1
    # per-op overheads, efficiency tables per compute kind, the optimizer step: measured and positive
    assert all(math.isfinite(t) and t > 0 for t in cal.op_overhead)
    assert {k for k, _ in cal.efficiency} == {"matmul", "matmul.bfloat16", "matmul.backward",
                                              "matmul.bfloat16.backward", "attention", "attention.bfloat16",
                                              "attention.backward", "attention.bfloat16.backward", "memory",
                                              "memory.bfloat16"}
    for kind, pts in cal.efficiency:
        assert len(pts) == 5 and all(0 < f <= 1 for _, f in pts)
        if kind in ("matmul", "matmul.bfloat16", "memory"):  # their own peaks (attention's fractions are of the
            assert max(f for _, f in pts) == 1  # matmul peak of its dtype, bf16 memory's of the one bandwidth)
    assert {name for name, _, _ in cal.optimizer_step} == {"adam", "adamw"}
    assert all(pt >= 0 and pe >= 0 and pt + pe > 0 for _, pt, pe in cal.optimizer_step)
    for f in cal.fits:
        assert [b for b, _ in f.samples] == list(SIZES)
        assert all(t > 0 for _, t in f.samples)
        assert math.isfinite(f.alpha) and f.alpha > 0
        assert math.isfinite(f.beta) and f.beta > 0
    assert cal.link.alpha > 0 and cal.link.beta > 0
    for rate in (cal.peak_flops, cal.mem_bandwidth):
        assert math.isfinite(rate) and rate > 0
    assert cal.memory_bytes > 0
    assert cal.seconds > 0
    # measured on every rank; at least 1 (how much slower with every rank computing than alone)
    assert cal.contention == raw["contention"] >= 1.0 and math.isfinite(cal.contention)
    profile = cal.profile("here")
    path = tmp_path / "here.toml"
    from autoshard.cost_models.profile import save_profile

    assert load_profile(save_profile(profile, path)) == profile


def test_contention_is_recorded_and_not_applied():
    """The contention a run measured is kept and printed; the profile's compute times are the probes' as measured
    (scaling them alone ranked plans worse: see calibrate._contention)."""
    from autoshard.cost_models.calibrate import calibration_from_raw, format_calibration

    tables = {k: [[2.0 * n**3, 1e-6 * n] for n in (32, 64, 128)] for k in ("matmul", "matmul.bfloat16", "memory")}
    raw = {"samples": {k: _samples(k, 2) for k in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")},
           "op_overhead": [1e-6, 2e-6], "tables": tables, "overlap": 0.5,
           "optimizer": [[32, 32 * 64, 1e-3], [4, 4 << 18, 2e-3], [8, 8 << 18, 4e-3]]}
    old = calibration_from_raw(raw, 2, "gloo", 1.0)  # a run from before the probe
    shared = calibration_from_raw({**raw, "contention": 1.8}, 2, "gloo", 1.0)
    assert (old.contention, shared.contention) == (1.0, 1.8)
    assert shared.profile("p") == old.profile("p")
    assert "compute 1.80x slower with every rank computing than alone (not applied)" in format_calibration(shared)


@pytest.mark.gloo
def test_timeout_kills_the_processes():
    import multiprocessing

    with pytest.raises(CollectiveTimeoutError, match="did not finish within 0.5 s; its processes were killed"):
        measure(world_size=2, timeout=0.5)
    assert multiprocessing.active_children() == []


def test_main_writes_the_profile_and_prints_the_fit(tmp_path, monkeypatch, capsys):
    fits = tuple(CollectiveFit(k, tuple(_samples(k, 2)), TRUE.alpha, TRUE.beta)
                 for k in ("all_reduce", "all_gather", "all_to_all"))
    fake = Calibration(world_size=2, backend="gloo", fits=fits, link=TRUE, peak_flops=5e10, mem_bandwidth=1e10,
                       memory_bytes=1 << 33, seconds=1.0)
    seen = {}

    def fake_measure(world_size, sizes, backend, repeats, timeout):
        seen.update(world_size=world_size, sizes=sizes, repeats=repeats)
        return fake

    monkeypatch.setattr(cal_mod, "measure", fake_measure)
    out = tmp_path / "p.toml"
    assert cal_mod.main(["-o", str(out), "--name", "box", "--sizes", "1K,64KiB,4M", "--repeats", "3"]) == 0
    assert seen == {"world_size": 2, "sizes": (1024, 65536, 4 << 20), "repeats": 3}
    profile = load_profile(out)
    assert profile.name == "box" and profile.link == TRUE and profile.peak_flops == 5e10
    printed = capsys.readouterr().out
    assert "all_to_all" in printed and "link (joint fit)" in printed and str(out) in printed


def test_main_reports_errors(monkeypatch, capsys):
    def failing(*args):
        raise AutoshardError("no peers")

    monkeypatch.setattr(cal_mod, "measure", failing)
    assert cal_mod.main(["-o", "/nonexistent/never.toml"]) == 1
    assert "no peers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cal_mod.main(["--sizes", "lots"])
