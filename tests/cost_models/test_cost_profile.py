"""Hardware profiles: presets, TOML round trip, axis links, error messages."""

from __future__ import annotations

import pytest
import torch
from autoshard.cost_models.profile import (
    PROFILES_DIR,
    HardwareProfile,
    LinkCost,
    format_profile,
    list_profiles,
    load_profile,
    profile_to_toml,
    save_profile,
)

from autoshard.errors import PlanError
from autoshard.mesh import Mesh

PRESETS = ["cpu-gloo", "gpu-8x-nvlink", "multi-node"]


def _profile(**kw) -> HardwareProfile:
    args = {"name": "test", "peak_flops": 1e12, "mem_bandwidth": 1e11, "memory_bytes": 1 << 30,
            "overlap_comm": False, "link": LinkCost(1e-5, 1e-9)}
    return HardwareProfile(**{**args, **kw})


def test_list_profiles_names_the_presets():
    assert list_profiles() == PRESETS


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_loads_with_its_name_and_sane_numbers(name):
    p = load_profile(name)
    assert p.name == name
    assert p.description
    assert p.peak_flops > 1e9 and p.mem_bandwidth > 1e9 and p.memory_bytes >= 1 << 30
    assert 0 < p.link.alpha < 1e-3 and p.link.bandwidth > 1e8
    assert load_profile(PROFILES_DIR / f"{name}.toml") == p  # by path too


def test_preset_numbers_as_documented():
    gpu = load_profile("gpu-8x-nvlink")
    assert gpu.link.bandwidth == pytest.approx(450e9)
    assert gpu.peak_flops == 67e12 and gpu.mem_bandwidth == 3.35e12 and gpu.overlap_comm
    multi = load_profile("multi-node")
    assert multi.link == gpu.link
    assert multi.link_for("#0", 0).bandwidth == pytest.approx(50e9)
    assert not load_profile("cpu-gloo").overlap_comm


def test_round_trip_save_load(tmp_path):
    p = _profile(name='odd "name" ✓', description="line1\nline2", overlap_comm=True, memory_bytes=3 * 2**30 + 7,
                 peak_flops=1.2345678901234567e13, link=LinkCost(3.3e-6, 1 / 7e9),
                 axes={"data": LinkCost(1e-5, 2e-11), "#-1": LinkCost(0.0, 1e-12), "mo*": LinkCost(2e-6, 1e-10)})
    path = save_profile(p, tmp_path / "sub" / "p.toml")
    q = load_profile(path)
    assert q == p
    assert q.axes == p.axes  # order kept: the first matching pattern wins
    assert load_profile(str(path)) == p
    assert profile_to_toml(q) == profile_to_toml(p)


def test_profiles_are_hashable_and_accept_a_dict_of_axes():
    p = _profile(axes={"data": LinkCost(1e-5, 2e-11)})
    assert isinstance(p.axes, tuple)
    assert hash(p) == hash(_profile(axes=(("data", LinkCost(1e-5, 2e-11)),)))


def test_link_for_by_name_glob_and_position():
    slow, mid, fast = LinkCost(1e-5, 1e-10), LinkCost(5e-6, 1e-11), LinkCost(1e-6, 1e-12)
    p = _profile(link=fast, axes={"data": slow, "exp*": mid, "#-1": LinkCost(0.0, 1e-13)})
    mesh = Mesh(data=2, expert=2, model=2)
    assert p.link_for("data", mesh=mesh) is slow
    assert p.link_for("expert", mesh=mesh) is mid
    assert p.link_for("model", mesh=mesh).beta == 1e-13
    assert p.link_for("model") is fast  # no mesh, no index: "#-1" cannot match
    assert p.link_for("other", 1, None) is fast


def test_multi_node_prices_the_outer_axis_as_inter_node():
    p = load_profile("multi-node")
    mesh = Mesh(data=2, model=2)
    assert p.link_for("data", mesh=mesh).bandwidth == pytest.approx(50e9)
    # the innermost axis: NVLink inside a node, all 8 NICs of each node when it spans nodes (the lower, 400 GB/s)
    assert p.link_for("model", mesh=mesh).bandwidth == pytest.approx(400e9)
    assert p.link_for("data", mesh=Mesh(data=128)).bandwidth == pytest.approx(400e9)  # one axis: innermost too
    assert p.link_for("model", 0).bandwidth == pytest.approx(50e9)  # whichever axis is outermost


def test_unknown_profile_names_it_and_lists_presets():
    with pytest.raises(PlanError) as e:
        load_profile("tpu-v9")
    msg = str(e.value)
    assert "`tpu-v9` is unknown" in msg
    assert all(name in msg for name in PRESETS)


def test_missing_profile_file(tmp_path):
    with pytest.raises(PlanError, match="does not exist"):
        load_profile(tmp_path / "nope.toml")


@pytest.mark.parametrize("link_text, expected", [
    ("alpha = 1e-5\nbeta = 1e-9\nbandwidth = 1e9", "exactly one of"),
    ("beta = 1e-9", "exactly one of"),
    ("alpha = 1e-5\nbeta = 1e-9\nlatency = 3", "unknown keys"),
    ("alpha = -1.0\nbeta = 1e-9", "alpha=-1.0"),
    ("alpha = 1e-5\nbandwidth = 0", "bandwidth=0"),
])
def test_bad_link_tables(tmp_path, link_text, expected):
    path = tmp_path / "p.toml"
    path.write_text(f'name = "x"\npeak_flops = 1e9\nmem_bandwidth = 1e9\nmemory_bytes = 1000\n[link]\n{link_text}\n')
    with pytest.raises(PlanError, match=expected):
        load_profile(path)


def test_bad_profile_fields(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text('name = "x"\npeak_flops = 0\nmem_bandwidth = 1e9\nmemory_bytes = 1000\n'
                    "[link]\nalpha = 0\nbeta = 0\n")
    with pytest.raises(PlanError, match="peak_flops=0"):
        load_profile(path)
    path.write_text('name = "x"\nmem_bandwidth = 1e9\n')
    with pytest.raises(PlanError, match=r"has no \['peak_flops', 'memory_bytes', 'link'\]"):
        load_profile(path)
    path.write_text("name = [")
    with pytest.raises(PlanError, match="not valid TOML"):
        load_profile(path)


def test_bad_position_pattern():
    p = _profile(axes={"#outer": LinkCost(1e-5, 1e-9)})
    with pytest.raises(PlanError, match="'#outer'"):
        p.link_for("data", 0)


def test_format_profile():
    text = format_profile(load_profile("multi-node"))
    assert "67 TFLOP/s" in text and "450 GB/s" in text and "'#0': alpha=10 us, bandwidth=50 GB/s" in text


def test_round_trip_of_the_calibrated_fields(tmp_path):
    p = _profile(op_overhead=4e-6, backward_op_overhead=9e-6, step_overhead=1e-3,
                 efficiency={"matmul": [(1e6, 0.2), (1e9, 0.9)], "matmul.bfloat16": [(1e6, 0.5)],
                             "memory": [(1e4, 0.1), (1e7, 1.0)]},
                 optimizer_step=[("adamw", 1e-4, 2e-9)],
                 link=LinkCost(5e-4, 3e-9, {"all_to_all": LinkCost(4e-4, 3.2e-9)}, overlap=0.25),
                 axes={"#0": LinkCost(1e-5, 2e-11, {"all_reduce": LinkCost(2e-5, 1e-11)}, overlap=0.5)})
    q = load_profile(save_profile(p, tmp_path / "p.toml"))
    assert q == p
    assert q.link.for_kind("all_to_all") == LinkCost(4e-4, 3.2e-9)
    assert q.link.for_kind("all_reduce") is q.link  # not measured apart: the link's own
    assert q.link_for("data", 0).for_kind("grad_all_reduce") == LinkCost(2e-5, 1e-11)  # as all_reduce's
    assert q.efficiency_for("matmul", "float32", 1e3) == 0.2  # constant beyond the ends
    assert q.efficiency_for("matmul", "float32", 1e12) == 0.9
    assert q.efficiency_for("matmul", "float32", 10**7.5) == pytest.approx(0.55)  # halfway in log(work)
    assert q.efficiency_for("matmul", "bfloat16", 1e9) == 0.5  # the dtype's own table
    assert q.efficiency_for("attention", "float32", 1e9) == 1.0  # no table: the peak
    assert q.optimizer_seconds("adamw", 10, 1e6) == pytest.approx(10 * 1e-4 + 1e6 * 2e-9)
    # an optimizer not timed: its bytes at the memory bandwidth
    assert q.optimizer_seconds("sgd", 10, 1e6) == pytest.approx(1e6 * 12 / q.mem_bandwidth)


@pytest.mark.parametrize("kw, expected", [
    ({"efficiency": {"tensor": [(1, 1)]}}, "efficiency for 'tensor'"),
    ({"efficiency": {"matmul": [(0, 1)]}}, "efficiency point"),
    ({"optimizer_step": [("lion", 1, 1)]}, "optimizer step"),
    ({"op_overhead": -1.0}, "op_overhead=-1.0"),
    ({"link": "overlap"}, "overlap=1.5"),
])
def test_bad_calibrated_fields_name_the_field(kw, expected):
    with pytest.raises(PlanError, match=expected):
        if kw == {"link": "overlap"}:
            LinkCost(1e-5, 1e-9, overlap=1.5)
        _profile(**kw)


def test_link_overlap_hides_gradient_reductions_only():
    from autoshard.compiler.collective_kinds import time as kind_time

    plain, hidden = LinkCost(1e-4, 1e-9), LinkCost(1e-4, 1e-9, overlap=0.75)
    b, n = 1 << 20, 4
    assert kind_time("grad_all_reduce", b, n, hidden)[1] == pytest.approx(0.25 * kind_time("grad_all_reduce", b, n,
                                                                                             plain)[1])
    assert kind_time("all_gather_reshard", b, n, hidden)[0] == kind_time("all_gather_reshard", b, n, plain)[0]
    assert kind_time("all_reduce", b, n, hidden) == kind_time("all_reduce", b, n, plain)  # forward: not hidden
    assert kind_time("all_to_all", b, n, hidden) == kind_time("all_to_all", b, n, plain)


def test_backward_efficiency_tables_price_an_ops_backward_and_fall_back_to_the_forwards():
    eff = {"matmul": [(1e6, 0.5)], "matmul.bfloat16": [(1e6, 0.4)], "matmul.bfloat16.backward": [(1e6, 0.1)],
           "matmul.backward": [(1e6, 0.3)]}
    p = HardwareProfile("x", 1e10, 1e10, 1 << 30, False, LinkCost(1e-5, 1e-9), efficiency=eff)
    assert p.efficiency_for("matmul", torch.bfloat16, 1e6) == 0.4
    assert p.efficiency_for("matmul", torch.bfloat16, 1e6, backward=True) == 0.1
    assert p.efficiency_for("matmul", torch.float32, 1e6, backward=True) == 0.3
    assert p.efficiency_for("attention", torch.float32, 1e6, backward=True) == 1.0  # no table: the peak
    forward_only = HardwareProfile("y", 1e10, 1e10, 1 << 30, False, LinkCost(1e-5, 1e-9),
                                   efficiency={"matmul": [(1e6, 0.5)]})
    assert forward_only.efficiency_for("matmul", torch.float32, 1e6, backward=True) == 0.5
    with pytest.raises(PlanError, match="optionally with a dtype"):
        HardwareProfile("z", 1e10, 1e10, 1 << 30, False, LinkCost(1e-5, 1e-9),
                        efficiency={"matmul.forward": [(1e6, 1)]})
