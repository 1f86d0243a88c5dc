"""autoshard.runtime.moe.routing against the independent eager oracle in tests/moe/reference.py, plus MoE properties.

Covered: outputs, aux losses and gradients (x, router, expert weights) for top-1/top-2 with and without drops;
capacity arithmetic and GShard drop counts; sparse-upcycling identities; index vs one-hot dispatch; uniform
router loss; one-hot range safety; no [T, E, C] tensor in the index path; fake-tensor tracing; error messages;
the dispatch benchmark's quick mode.
"""

from __future__ import annotations

import doctest
import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from autoshard.errors import PlanError
from autoshard.runtime.moe import routing as M


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


_HERE = Path(__file__).resolve().parent
ref = _load("autoshard_tests_moe_reference", _HERE / "reference.py")

RTOL, ATOL = 1e-5, 1e-6
#: gradients of expert weights sum over the tokens routed to the expert, in dispatch-buffer order here and in token
#: order in the reference: float32 rounds each order differently, up to ~n·eps·Σ|terms| (20 tokens of unit-size terms:
#: ~2.4e-6). Hypothesis found 1.9e-6 on an entry of 0.042 (13 tokens, d/dw2), so gradients allow 1e-5 absolute.
GRAD_ATOL = 1e-5

# (activation, gated, with_bias)
VARIANTS = [("gelu", False, True), ("silu", True, False), ("relu", False, True), ("gelu_tanh", True, True)]


def make_params(num_experts, hidden, ffn, *, gated, bias, seed):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).requires_grad_()

    return {
        "router": r(num_experts, hidden),
        "w1": r(num_experts, hidden, ffn, scale=hidden**-0.5),
        "b1": r(num_experts, ffn, scale=0.1) if bias else None,
        "w2": r(num_experts, ffn, hidden, scale=ffn**-0.5),
        "b2": r(num_experts, hidden, scale=0.1) if bias else None,
        "w_gate": r(num_experts, hidden, ffn, scale=hidden**-0.5) if gated else None,
    }


def clone_params(params):
    return {k: None if v is None else v.detach().clone().requires_grad_() for k, v in params.items()}


def ops_moe(x, p, *, top_k, capacity_factor, activation):
    """The MoE layer composed from autoshard.runtime.moe.routing, as the expert rewrite will emit it."""
    num_tokens, num_experts = x.shape[0], p["router"].shape[0]
    logits = x.float() @ p["router"].t()
    cap = M.capacity(num_tokens, num_experts, top_k, capacity_factor)
    r = M.route(logits, top_k, cap)
    buf = M.dispatch(x, r, num_experts, cap)
    y = M.expert_ffn(buf, p["w1"], p["b1"], p["w2"], p["b2"], activation, w_gate=p["w_gate"])
    out = M.combine(y, r)
    return out, M.load_balancing_loss(r, num_experts), M.z_loss(logits), r, cap


def ref_moe(x, p, *, top_k, capacity_factor, activation):
    return ref.reference_moe(
        x, p["router"], p["w1"], p["b1"], p["w2"], p["b2"],
        top_k=top_k, capacity_factor=capacity_factor, activation=activation, w_gate=p["w_gate"],
    )  # fmt: skip


def grads(loss, x, p):
    leaves = [x] + [v for v in p.values() if v is not None]
    names = ["x"] + [k for k, v in p.items() if v is not None]
    return dict(zip(names, torch.autograd.grad(loss, leaves, retain_graph=True, allow_unused=True)))


def assert_grads_close(got, want, what):
    for name in want:
        g, w = got[name], want[name]
        if w is None:
            assert g is None or torch.count_nonzero(g) == 0, f"{what}: d/d{name} should be zero"
            continue
        torch.testing.assert_close(g, w, rtol=RTOL, atol=GRAD_ATOL, msg=lambda m, name=name: f"{what}: d/d{name}: {m}")


def check_against_reference(tokens, experts, hidden, ffn, top_k, capacity_factor, variant, seed):
    activation, gated, bias = variant
    p_ops = make_params(experts, hidden, ffn, gated=gated, bias=bias, seed=seed)
    p_ref = clone_params(p_ops)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed + 1))
    x_ops, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    kw = {"top_k": top_k, "capacity_factor": capacity_factor, "activation": activation}

    out, lb, z, r, cap = ops_moe(x_ops, p_ops, **kw)
    want = ref_moe(x_ref, p_ref, **kw)

    assert cap == want.capacity
    assert r.expert_index.tolist() == want.choices
    assert r.keep.tolist() == want.keep
    kept = r.keep
    torch.testing.assert_close(r.position[kept], torch.tensor(want.positions)[kept], rtol=0, atol=0)
    torch.testing.assert_close(out, want.out, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(lb, want.lb_loss, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(z, want.z_loss, rtol=RTOL, atol=ATOL)

    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 2))
    for what, got_loss, want_loss in [
        ("output", (out * cot).sum(), (want.out * cot).sum()),
        ("load-balancing loss", lb, want.lb_loss),
        ("z-loss", z, want.z_loss),
    ]:
        assert_grads_close(grads(got_loss, x_ops, p_ops), grads(want_loss, x_ref, p_ref), what)
    return want


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"{v[0]}{'-gated' if v[1] else ''}")
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("drops", [True, False], ids=["drops", "no-drops"])
def test_matches_reference(variant, top_k, drops):
    experts = 4
    # 0.5 leaves room for half the choices; `experts` gives every expert room for every token
    capacity_factor = 0.5 if drops else float(experts)
    want = check_against_reference(24, experts, 6, 10, top_k, capacity_factor, variant, seed=top_k)
    dropped = sum(not k for row in want.keep for k in row)
    assert (dropped > 0) == drops


@settings(max_examples=15, deadline=None)
@given(
    tokens=st.integers(1, 20),
    experts=st.integers(1, 6),
    hidden=st.integers(1, 6),
    ffn=st.integers(1, 8),
    two=st.booleans(),
    capacity_factor=st.sampled_from([0.25, 0.5, 1.0, 1.25, 2.0]),
    variant=st.sampled_from(VARIANTS),
    seed=st.integers(0, 2**16),
)
def test_matches_reference_random(tokens, experts, hidden, ffn, two, capacity_factor, variant, seed):
    top_k = 2 if two and experts >= 2 else 1
    check_against_reference(tokens, experts, hidden, ffn, top_k, capacity_factor, variant, seed)


@pytest.mark.parametrize(
    "tokens,experts,top_k,factor,expected",
    [
        (8192, 8, 2, 1.25, 2560),
        (8192, 128, 2, 1.25, 160),
        (50, 1, 1, 1.1, 55),  # 50 * 1.1 is 55.00000000000001 in floats
        (100, 3, 1, 1.0, 34),
        (1, 64, 1, 1.0, 1),  # at least one slot
        (0, 4, 1, 1.0, 1),
        (7, 2, 2, 0.3, 3),  # 2*7/2*0.3 = 2.1
    ],
)
def test_capacity(tokens, experts, top_k, factor, expected):
    assert M.capacity(tokens, experts, top_k, factor) == expected
    assert ref.reference_capacity(tokens, experts, top_k, factor) == expected


def _dropped_from_choices(expert_index, cap, num_experts):
    """GShard drop count from the choices alone: first choices fill each expert, second choices get the rest."""
    dropped = 0
    room = [cap] * num_experts
    for c in range(expert_index.shape[1]):
        wanted = torch.bincount(expert_index[:, c], minlength=num_experts).tolist()
        for e in range(num_experts):
            taken = min(wanted[e], room[e])
            dropped += wanted[e] - taken
            room[e] -= taken
    return dropped


@pytest.mark.parametrize("top_k", [1, 2])
def test_capacity_drops(top_k):
    tokens, experts = 200, 8
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(5)) * 2
    cap = M.capacity(tokens, experts, top_k, 0.5)
    r = M.route(logits, top_k, cap)
    expected = _dropped_from_choices(r.expert_index, cap, experts)
    assert expected > 0
    assert int((~r.keep).sum()) == expected
    s = M.stats(r, experts)
    assert s["dropped"] == expected and sum(s["tokens_per_expert"]) == tokens * top_k - expected
    assert s["dropped_fraction"] == pytest.approx(expected / (tokens * top_k))
    assert all(n <= cap for n in s["tokens_per_expert"])
    # kept slots are distinct per expert and lie in [0, cap)
    slots = (r.expert_index * cap + r.position)[r.keep]
    assert slots.unique().numel() == slots.numel() and int(r.position[r.keep].max()) < cap
    if top_k == 2:  # GShard priority: an expert that dropped a first choice keeps no second choice
        full = set(r.expert_index[:, 0][~r.keep[:, 0]].tolist())
        assert full and not any(e in full for e in r.expert_index[:, 1][r.keep[:, 1]].tolist())

    big = M.capacity(tokens, experts, top_k, float(experts))
    r = M.route(logits, top_k, big)
    assert bool(r.keep.all()) and M.stats(r, experts)["dropped"] == 0


def _dense_ffn(x, w1, b1, w2, b2):
    return F.gelu(x @ w1 + b1) @ w2 + b2


@pytest.mark.parametrize("top_k", [1, 2])
def test_upcycled_experts(top_k):
    """Every expert a copy of one dense FFN: top-1 gives gate*dense(x), top-2 gives dense(x) where both kept."""
    tokens, experts, hidden, ffn = 64, 4, 8, 16
    g = torch.Generator().manual_seed(11)
    w1, b1 = torch.randn(hidden, ffn, generator=g) * 0.3, torch.randn(ffn, generator=g) * 0.1
    w2, b2 = torch.randn(ffn, hidden, generator=g) * 0.3, torch.randn(hidden, generator=g) * 0.1
    x = torch.randn(tokens, hidden, generator=g)
    logits = torch.randn(tokens, experts, generator=g) * 2
    cap = M.capacity(tokens, experts, top_k, 0.9 if top_k == 1 else 0.5)
    r = M.route(logits, top_k, cap)

    def stack(t):
        return t.expand(experts, *t.shape).clone()

    y = M.expert_ffn(M.dispatch(x, r, experts, cap), stack(w1), stack(b1), stack(w2), stack(b2), "gelu")
    out = M.combine(y, r)
    dense = _dense_ffn(x, w1, b1, w2, b2)

    kept = r.keep.sum(dim=1)
    none, all_kept, some = kept == 0, kept == top_k, (kept > 0) & (kept < top_k)
    assert none.any() and all_kept.any() and (top_k == 1 or some.any())
    assert torch.equal(out[none], torch.zeros_like(out[none]))
    kept_gate = (r.gate * r.keep).sum(dim=1, keepdim=True)
    if top_k == 1:
        torch.testing.assert_close(r.gate[:, 0], r.probs.gather(1, r.expert_index)[:, 0], rtol=0, atol=0)
        torch.testing.assert_close(out[all_kept], (kept_gate * dense)[all_kept], rtol=RTOL, atol=ATOL)
    else:
        torch.testing.assert_close(out[all_kept], dense[all_kept], rtol=RTOL, atol=ATOL)
        # one choice lost: the surviving renormalised gate (computed before dropping) scales dense(x)
        torch.testing.assert_close(out[some], (kept_gate * dense)[some], rtol=RTOL, atol=ATOL)
        assert bool((kept_gate[some] < 1).all())


@pytest.mark.parametrize("top_k", [1, 2])
def test_index_dispatch_equals_onehot(top_k):
    tokens, experts, hidden = 40, 5, 7
    g = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, hidden, generator=g)
    logits = torch.randn(tokens, experts, generator=g)
    cap = M.capacity(tokens, experts, top_k, 0.7)
    results = []
    for disp, comb in [
        (M.dispatch, lambda y, r: M.combine(y, r)),
        (M.dispatch_dense_onehot, lambda y, r: M.combine_dense_onehot(y, r, experts, cap)),
    ]:
        xi, li = x.clone().requires_grad_(), logits.clone().requires_grad_()
        r = M.route(li, top_k, cap)
        buf = disp(xi, r, experts, cap)
        out = comb(buf * 2.0 + 1.0, r)  # an affine "expert" so empty slots would show up if combined
        out.pow(2).sum().backward()
        results.append((buf, out, xi.grad, li.grad))
    assert not M.route(logits, top_k, cap).keep.all()
    (buf_i, out_i, gx_i, gl_i), (buf_d, out_d, gx_d, gl_d) = results
    assert torch.equal(buf_i, buf_d)  # a copy vs a sum of x·1 and exact zeros
    torch.testing.assert_close(out_i, out_d, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(gx_i, gx_d, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(gl_i, gl_d, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("experts,top_k", [(1, 1), (2, 1), (2, 2), (3, 2), (8, 1), (8, 2), (128, 2)])
def test_uniform_router_load_balancing_loss_is_one(experts, top_k):
    logits = torch.zeros(64, experts, requires_grad=True)
    r = M.route(logits, top_k, M.capacity(64, experts, top_k, 1.0))
    loss = M.load_balancing_loss(r, experts)
    torch.testing.assert_close(loss, torch.tensor(1.0), rtol=1e-6, atol=1e-6)
    loss.backward()
    assert logits.grad is not None  # P_i carries the gradient


def test_load_balancing_loss_collapsed_router():
    """All tokens on expert 0 with probability ~1: f_0 = P_0 = 1, so the loss is E."""
    logits = torch.zeros(16, 4)
    logits[:, 0] = 50.0
    r = M.route(logits, 1, 4)
    torch.testing.assert_close(M.load_balancing_loss(r, 4), torch.tensor(4.0))


def test_one_hot_never_sees_out_of_range(monkeypatch):
    calls = []
    real = F.one_hot

    def checked(t, num_classes=-1):
        assert num_classes > 0
        assert int(t.min()) >= 0 and int(t.max()) < num_classes, f"one_hot got {t.tolist()} for {num_classes}"
        calls.append(num_classes)
        return real(t, num_classes)

    monkeypatch.setattr(F, "one_hot", checked)
    tokens, experts, hidden = 50, 4, 3
    g = torch.Generator().manual_seed(9)
    x = torch.randn(tokens, hidden, generator=g, requires_grad=True)
    logits = torch.randn(tokens, experts, generator=g, requires_grad=True)
    cap = M.capacity(tokens, experts, 2, 0.25)
    r = M.route(logits, 2, cap)
    assert int(r.position.max()) >= cap  # positions that would make an unmasked one_hot raise

    out = M.combine(M.dispatch(x, r, experts, cap), r)
    (out.sum() + M.load_balancing_loss(r, experts) + M.z_loss(logits)).backward(retain_graph=True)
    M.stats(r, experts)
    assert calls == []  # the index path builds no one-hot at all

    dense = M.combine_dense_onehot(M.dispatch_dense_onehot(x, r, experts, cap), r, experts, cap)
    dense.sum().backward()
    assert cap in calls and experts in calls


class _LargestOutput(TorchDispatchMode):
    """Records the element count of the largest tensor any aten op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_index_path_builds_no_token_expert_capacity_tensor():
    tokens, experts, hidden, ffn, top_k = 128, 4, 8, 16, 2
    cap = M.capacity(tokens, experts, top_k, 1.0)
    p = make_params(experts, hidden, ffn, gated=True, bias=True, seed=0)
    x = torch.randn(tokens, hidden, requires_grad=True)
    tec = tokens * experts * cap

    def run(disp, comb):
        with _LargestOutput() as mode:
            logits = x @ p["router"].t()
            r = M.route(logits, top_k, cap)
            y = M.expert_ffn(disp(x, r, experts, cap), p["w1"], p["b1"], p["w2"], p["b2"], "silu", p["w_gate"])
            out = comb(y, r)
            (out.sum() + M.load_balancing_loss(r, experts)).backward()
        return mode.largest

    assert run(M.dispatch, lambda y, r: M.combine(y, r)) < tec // 4
    assert run(M.dispatch_dense_onehot, lambda y, r: M.combine_dense_onehot(y, r, experts, cap)) >= tec


def test_traces_with_fake_tensors():
    """No value-dependent shapes: the chain traces with make_fx's fake mode, as generated FX code needs."""
    from torch.fx.experimental.proxy_tensor import make_fx

    experts, top_k = 4, 2
    p = make_params(experts, 6, 8, gated=False, bias=True, seed=1)
    weights = [p[k].detach() for k in ("router", "w1", "b1", "w2", "b2")]

    def layer(x, router, w1, b1, w2, b2):
        logits = x @ router.t()
        cap = M.capacity(x.shape[0], experts, top_k, 0.5)
        r = M.route(logits, top_k, cap)
        out = M.combine(M.expert_ffn(M.dispatch(x, r, experts, cap), w1, b1, w2, b2, "gelu"), r)
        return out, M.load_balancing_loss(r, experts), M.z_loss(logits)

    x = torch.randn(20, 6)
    traced = make_fx(layer, tracing_mode="fake")(x, *weights)
    for got, want in zip(traced(x, *weights), layer(x, *weights)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_docstring_examples():
    assert doctest.testmod(M).failed == 0


def test_z_loss_value():
    logits = torch.tensor([[0.0, 0.0], [1.0, 2.0], [-3.0, 4.0]])
    lse = [math.log(2.0), math.log(math.exp(1) + math.exp(2)), math.log(math.exp(-3) + math.exp(4))]
    want = sum(v * v for v in lse) / 3
    torch.testing.assert_close(M.z_loss(logits), torch.tensor(want, dtype=torch.float32))
    assert M.z_loss(logits.to(torch.bfloat16)).dtype == torch.float32


def test_route_gates_and_dtypes():
    logits = torch.randn(10, 5, dtype=torch.bfloat16, requires_grad=True)
    r1 = M.route(logits, 1, 3)
    r2 = M.route(logits, 2, 3)
    assert r1.probs.dtype == r1.gate.dtype == torch.float32
    assert r1.expert_index.dtype == r1.position.dtype == torch.int64 and r1.keep.dtype == torch.bool
    torch.testing.assert_close(r1.gate[:, 0], r1.probs.max(dim=1).values, rtol=0, atol=0)
    torch.testing.assert_close(r2.gate.sum(dim=1), torch.ones(10), rtol=1e-6, atol=1e-6)
    assert not r2.expert_index.requires_grad and r2.gate.requires_grad
    # ties go to the lower expert index
    assert M.route(torch.zeros(3, 4), 2, 8).expert_index.tolist() == [[0, 1]] * 3


def test_stats_keys():
    r = M.route(torch.tensor([[5.0, 0.0], [5.0, 0.0], [0.0, 5.0]]), 1, 1)
    assert M.stats(r, 2) == {
        "tokens_per_expert": [1, 1],
        "routed_per_expert": [2, 1],
        "dropped": 1,
        "dropped_fraction": 1 / 3,
        "tokens_fully_dropped_fraction": 1 / 3,
    }


# --- error messages, one test per message -------------------------------------------------------------------


def _routing(tokens=6, experts=4, top_k=2):
    return M.route(torch.randn(tokens, experts), top_k, M.capacity(tokens, experts, top_k, 1.0))


def test_error_num_experts():
    with pytest.raises(PlanError, match=r"num_experts has 0, but at least 1 expert"):
        M.capacity(8, 0, 1, 1.0)


@pytest.mark.parametrize("top_k", [0, 5])
def test_error_top_k(top_k):
    with pytest.raises(PlanError, match=rf"top_k has {top_k}, but it must lie in \[1, num_experts=4\]"):
        M.capacity(8, 4, top_k, 1.0)
    with pytest.raises(PlanError, match=rf"top_k has {top_k}"):
        M.route(torch.zeros(8, 4), top_k, 4)


def test_error_num_tokens():
    with pytest.raises(PlanError, match=r"num_tokens has -1, but it must be >= 0"):
        M.capacity(-1, 4, 1, 1.0)


@pytest.mark.parametrize("factor", [0.0, -1.0, float("nan"), float("inf")])
def test_error_capacity_factor(factor):
    with pytest.raises(PlanError, match=r"capacity_factor has .*, but it must be a finite number > 0"):
        M.capacity(8, 4, 1, factor)


def test_error_logits_rank():
    with pytest.raises(PlanError, match=r"logits have shape \(2, 3, 4\), but route\(\) expects \[tokens, experts\]"):
        M.route(torch.zeros(2, 3, 4), 1, 4)


def test_error_route_capacity():
    with pytest.raises(PlanError, match=r"capacity has 0, but it must be >= 1"):
        M.route(torch.zeros(8, 4), 1, 0)


def test_error_dispatch_shape():
    with pytest.raises(PlanError, match=r"dispatch input has shape \(5, 3\), but the routing covers 6 tokens"):
        M.dispatch(torch.zeros(5, 3), _routing(), 4, 3)


def test_error_expert_count_mismatch():
    r = _routing()
    with pytest.raises(PlanError, match=r"dispatch has num_experts=8, but the routing was made for 4 experts"):
        M.dispatch(torch.zeros(6, 3), r, 8, 3)
    with pytest.raises(PlanError, match=r"combine has num_experts=8, but the routing was made for 4"):
        M.combine(torch.zeros(8, 3, 2), r)


def test_error_combine_rank():
    with pytest.raises(PlanError, match=r"combine input has shape \(12, 2\), but it expects the expert buffer"):
        M.combine(torch.zeros(12, 2), _routing())


def test_error_activation():
    with pytest.raises(PlanError, match=r"activation has 'tanh', but it must be one of \['gelu', 'gelu_tanh'"):
        M.expert_ffn(torch.zeros(2, 3, 4), torch.zeros(2, 4, 5), None, torch.zeros(2, 5, 4), None, "tanh")


def test_error_expert_weight_shape():
    with pytest.raises(PlanError, match=r"weight w2 has shape \(2, 4, 5\), but .* need \(2, 5, 4\)"):
        M.expert_ffn(torch.zeros(2, 3, 4), torch.zeros(2, 4, 5), None, torch.zeros(2, 4, 5), None, "relu")
    with pytest.raises(PlanError, match=r"weight b1 has shape \(5,\)"):
        M.expert_ffn(torch.zeros(2, 3, 4), torch.zeros(2, 4, 5), torch.zeros(5), torch.zeros(2, 5, 4), None, "relu")


# --- benchmark smoke run ------------------------------------------------------------------------------------


def test_bench_quick(capsys):
    bench = _load("autoshard_bench_moe_dispatch", _HERE.parents[1] / "bench" / "moe_dispatch.py")
    rows = bench.main(["--quick"])
    assert rows and all(math.isfinite(row["ratio"]) and row["ratio"] > 0 for row in rows)
    for row in rows:
        assert row["dense_mask_bytes"] > row["index_buffer_bytes"] > 0
    assert "dense/index" in capsys.readouterr().out
    plain = bench.format_table(bench.QUICK, rows).splitlines()
    assert len(plain) == 3 + len(rows) and "dense/index" in plain[1]
