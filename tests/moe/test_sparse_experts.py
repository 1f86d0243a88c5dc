"""``autoshard::hf_experts`` (:mod:`autoshard.frontend.hf_blocks`) computes each token's top-k experts only.

Against the dense oracle :func:`~autoshard.frontend.hf_blocks.experts_dense_reference` (every expert on every token,
then weighted by the routing): the forward and every gradient in float32 for each experts layout (gated
concatenated / interleaved, ungated, biases, transposed weights, each activation), for slices of the experts with
their offset (a rank's expert shard), and for routings with repeated and unused experts and experts without tokens;
in bfloat16 and under autocast within bfloat16's error. Both kernels are covered: the grouped GEMM (rows a multiple
of 16 bytes) and the per-expert loop (hidden 6, ffn 5). Then the cost model's FLOPs of the op in a tiny HF Mixtral
(``k/E`` of the dense count) and the rows the experts process in that model's forward (``T·k``, not ``E·T``).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autoshard.cost_models.compute import backward_flops, flops
from autoshard.frontend import hf_blocks
from autoshard.frontend.hf_blocks import experts_dense_reference, experts_reference
from autoshard.frontend.trace import trace
from examples import models

TOL = dict(rtol=1e-5, atol=1e-5)
HF_EXPERTS = torch.ops.autoshard.hf_experts.default


def _case(tokens=10, hidden=8, ffn=16, experts=4, k=2, gated=True, bias=False, transposed=False, seed=0,
          index=None):
    """Inputs of the op: ``(hidden, top_k_index, top_k_weights, up, down, up_bias, down_bias)``."""
    g = torch.Generator().manual_seed(seed)
    out = (2 if gated else 1) * ffn
    x = torch.randn(tokens, hidden, generator=g)
    if index is None:
        index = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(index.shape, generator=g)
    up = torch.randn(experts, out, hidden, generator=g) * 0.3
    down = torch.randn(experts, hidden, ffn, generator=g) * 0.3
    if transposed:
        up, down = up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
    up_bias = torch.randn(experts, out, generator=g) if bias else None
    down_bias = torch.randn(experts, hidden, generator=g) if bias else None
    return [x, index, weights, up, down, up_bias, down_bias]


def _run(fn, inputs, static, offset=0, experts=None, dtype=None):
    """``fn``'s output and the gradients of its floating inputs for a fixed random output gradient; ``experts``:
    the slice of the experts passed (with ``offset``); ``dtype``: the floating inputs cast to it first."""
    leaves = [None if t is None else (t.to(dtype) if dtype and t.is_floating_point() else t).clone()
              for t in inputs]
    for t in leaves:
        if t is not None and t.is_floating_point():
            t.requires_grad_()
    args = list(leaves)
    if experts is not None:
        args[3:7] = [None if t is None else t[experts] for t in args[3:7]]
    out = fn(*args, *static, offset)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(out.dtype))
    return [out.detach()] + [t.grad for t in leaves if t is not None and t.is_floating_point()]


def _assert_all_close(got, want, **tol):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype, i
        torch.testing.assert_close(a, b, **tol, msg=lambda m, i=i: f"output/gradient {i}: {m}")


LAYOUTS = {  # name: (gated, concatenated, bias, transposed, activation)
    "gated_concatenated": (True, True, False, False, "silu"),
    "gated_interleaved": (True, False, False, False, "silu"),
    "ungated": (False, True, False, False, "gelu"),
    "ungated_bias": (False, True, True, False, "relu"),
    "gated_interleaved_bias_transposed": (True, False, True, True, "gelu_tanh"),
    "gated_transposed": (True, True, False, True, "gelu"),
}


@pytest.mark.parametrize("sizes", [(8, 16), (6, 5)], ids=["grouped_mm", "loop"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_sparse_equals_the_dense_oracle_forward_and_gradients(layout, sizes):
    gated, concatenated, bias, transposed, act = LAYOUTS[layout]
    hidden, ffn = sizes
    inputs = _case(hidden=hidden, ffn=ffn, gated=gated, bias=bias, transposed=transposed)
    static = (act, gated, transposed, concatenated)
    want = _run(experts_dense_reference, inputs, static)
    _assert_all_close(_run(torch.ops.autoshard.hf_experts, inputs, static), want, **TOL)
    _assert_all_close(_run(experts_reference, inputs, static), want, **TOL)


#: token 0 picks expert 1 twice, token 1 expert 3 twice; expert 2 is never picked; expert 0 only by tokens 2 and 5
ROUTING = torch.tensor([[1, 1], [3, 3], [0, 1], [1, 3], [3, 1], [0, 3], [1, 3], [3, 1]])


@pytest.mark.parametrize("sizes", [(8, 16), (6, 5)], ids=["grouped_mm", "loop"])
@pytest.mark.parametrize("offset,count", [(0, 4), (0, 2), (2, 2), (1, 2), (2, 1), (3, 1)])
def test_a_slice_of_the_experts_equals_the_dense_oracles_share(offset, count, sizes):
    """Experts ``[offset, offset + count)`` with their offset (a rank's expert shard): the dense oracle's share,
    output and gradients; with repeated choices, an expert nobody picked (2: the slice ``(2, 1)`` has no rows at
    all) and the weights' gradient zero where the choice is not in the slice."""
    hidden, ffn = sizes
    inputs = _case(tokens=len(ROUTING), hidden=hidden, ffn=ffn, bias=True, index=ROUTING)
    static = ("silu", True, False, True)
    held = slice(offset, offset + count)
    want = _run(experts_dense_reference, inputs, static, offset, held)
    got = _run(torch.ops.autoshard.hf_experts, inputs, static, offset, held)
    _assert_all_close(got, want, **TOL)
    outside = (ROUTING < offset) | (ROUTING >= offset + count)
    assert (got[2][outside] == 0).all()
    if (offset, count) == (2, 1):
        assert (got[0] == 0).all() and (got[1] == 0).all()


def test_the_slices_of_the_experts_sum_to_the_whole():
    inputs = _case(tokens=len(ROUTING), index=ROUTING)
    static = ("silu", True, False, True)
    whole = _run(torch.ops.autoshard.hf_experts, inputs, static)[0]
    shares = [_run(torch.ops.autoshard.hf_experts, inputs, static, o, slice(o, o + 1))[0] for o in range(4)]
    torch.testing.assert_close(sum(shares), whole, **TOL)


@pytest.mark.parametrize("sizes", [(16, 32), (6, 5)], ids=["grouped_mm", "loop"])
@pytest.mark.parametrize("layout", ["gated_concatenated", "ungated_bias"])
def test_bfloat16_is_within_bfloat16_error_of_the_float32_oracle(layout, sizes):
    """bf16 inputs: the output in bf16 (the dense form's dtype) and within 2e-2 of the dense oracle in float32,
    the gradients too (relative to their size). GELU, not ReLU: a first projection that rounds to the other side of
    0 in bf16 flips ReLU's gradient there (the dense form's up_proj gradient is then 8% off too)."""
    gated, concatenated, bias, transposed, _ = LAYOUTS[layout]
    act = "silu" if gated else "gelu"
    inputs = _case(hidden=sizes[0], ffn=sizes[1], gated=gated, bias=bias, transposed=transposed)
    static = (act, gated, transposed, concatenated)
    want = _run(experts_dense_reference, inputs, static)
    got = _run(torch.ops.autoshard.hf_experts, inputs, static, dtype=torch.bfloat16)
    dense = _run(experts_dense_reference, inputs, static, dtype=torch.bfloat16)
    for i, (a, b, d) in enumerate(zip(got, want, dense)):
        assert a.dtype == d.dtype == torch.bfloat16, i
        scale = b.abs().max().item()
        assert (a.float() - b).abs().max().item() <= 2e-2 * max(1.0, scale), i


def test_under_autocast_the_matmuls_run_in_bfloat16_and_match_the_dense_form():
    """Under CPU autocast the experts' matmuls run in bf16 (as eager's per-expert linears and the dense form's
    batched ones), the output float32 as the dense form's, within 2e-2 of it and of float32; the backward
    (called outside the region) recomputes in bf16 too."""
    inputs = _case(hidden=16, ffn=32)
    static = ("silu", True, False, True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _run(torch.ops.autoshard.hf_experts, inputs, static)
        dense = _run(experts_dense_reference, inputs, static)
    fp32 = _run(experts_dense_reference, inputs, static)
    for i, (a, d, f) in enumerate(zip(got, dense, fp32)):
        assert a.dtype == d.dtype == torch.float32, i
        scale = max(1.0, f.abs().max().item())
        assert (a - d).abs().max().item() <= 2e-2 * scale, i
        assert (a - f).abs().max().item() <= 2e-2 * scale, i
    assert (got[0] - fp32[0]).abs().max() > 1e-4  # it did run in bf16


# ---- in a tiny Hugging Face Mixtral -------------------------------------------------------------------------------
class _ExpertsCalls(TorchDispatchMode):
    """The arguments of every ``hf_experts`` call run under it."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is HF_EXPERTS:
            self.calls.append(args)
        return func(*args, **(kwargs or {}))


_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default,
            torch.ops.aten.baddbmm.default, torch.ops.aten._grouped_mm.default}


class _MatmulRows(TorchDispatchMode):
    """Rows and multiply-adds of the matmuls run under it (a batched matmul's rows over its batch)."""

    def __init__(self):
        super().__init__()
        self.rows, self.macs = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _MATMULS:
            a, b = (args[1], args[2]) if func in (torch.ops.aten.addmm.default, torch.ops.aten.baddbmm.default) \
                else args[:2]
            rows = a.shape[0] * a.shape[1] if a.dim() == 3 else a.shape[0]
            self.rows += rows
            self.macs += rows * a.shape[-1] * b.shape[-1]
        return func(*args, **(kwargs or {}))


def _mixtral(**kw):
    return models.hf_mixtral(batch=2, seq=8, hidden=32, experts=8, top_k=2, **kw)


def test_in_a_mixtral_the_experts_process_t_k_rows_not_e_t():
    """The tiny Mixtral (8 experts, top-2, 16 tokens) with its experts as the op: the loss is Hugging Face's own,
    and the op's experts process ``T·k`` = 32 rows per projection, the dense oracle ``E·T`` = 128: 4x less work,
    ``E/k``, counted in rows and multiply-adds of the matmuls that run."""
    model, args, kwargs = _mixtral()
    with torch.no_grad():
        want = model(*args, **kwargs).loss
        with hf_blocks.swapped(model), _ExpertsCalls() as seen:
            got = model(*args, **kwargs).loss
    torch.testing.assert_close(got, want, **TOL)
    (call,) = seen.calls
    tokens, k = call[1].shape
    experts, out, h = call[3].shape
    f = call[4].shape[2]
    assert (tokens, k, experts) == (16, 2, 8)
    work = {}
    for fn in (experts_reference, experts_dense_reference):
        fn(*call)  # the first call on a device and dtype tries torch._grouped_mm once (not the experts' work)
        with torch.no_grad(), _MatmulRows() as count:
            fn(*call)
        work[fn] = (count.rows, count.macs)
    assert work[experts_reference] == (2 * tokens * k, tokens * k * (h * out + f * h))
    assert work[experts_dense_reference] == (2 * experts * tokens, experts * tokens * (h * out + f * h))


def _traced_experts():
    """The ``hf_experts`` node of a traced tiny Mixtral and its sizes ``(T, k, E, out, h, f)``."""
    model, args, kwargs = _mixtral()
    gm = trace(model, args, kwargs)
    (node,) = [n for n in gm.graph.nodes if n.op == "call_function" and n.target == HF_EXPERTS]
    tokens, k = node.args[1].meta["val"].shape
    experts, out, h = node.args[3].meta["val"].shape
    return node, (tokens, k, experts, out, h, node.args[4].meta["val"].shape[2])


def test_the_cost_model_counts_k_over_e_of_the_dense_flops():
    """FLOPs the cost model gives the ``hf_experts`` node of a traced Mixtral: ``2·T·k·(h·2f + f·h)``, ``k/E`` of
    every expert on every token (8 experts, top-2: a quarter); its backward 3x (recomputed forward, then the
    gradients of the rows and the weights)."""
    node, (tokens, k, experts, out, h, f) = _traced_experts()
    dense = 2 * experts * tokens * (h * out + f * h)
    assert flops(node) == 2 * tokens * k * (h * out + f * h) == dense * k // experts
    assert flops(node) / dense == 0.25
    assert backward_flops(node) == 3 * flops(node)


def test_the_workspace_is_t_k_rows_not_e_t():
    """The op's transient workspace on one rank, replicated: ``T·k`` routed rows of ``3·h + out + 2·f`` features
    (twice with backward: the recomputed rows and their gradients), four int64 indices per row and the float32
    ``[T, h]`` sum; ``E·T`` rows of the dense form would be 4x the rows."""
    import autoshard
    from autoshard import meta as M
    from autoshard.compiler.ops import entry

    node, (tokens, k, experts, out, h, f) = _traced_experts()
    mesh = autoshard.Mesh(data=2)
    whole = (autoshard.Replicate(),)
    strategy = M.Strategy(input_specs=(whole,) * 5, output_spec=whole)
    node.meta[M.REQUIRES_GRAD] = True
    got = entry(HF_EXPERTS).workspace(node, strategy, mesh).transient
    assert got == tokens * k * (2 * (3 * h + out + 2 * f) * 4 + 4 * 8) + tokens * h * 4
    rows = (autoshard.Shard(0),)
    tokens_split = M.Strategy(input_specs=(rows,) * 3 + (whole,) * 2, output_spec=rows)
    assert entry(HF_EXPERTS).workspace(node, tokens_split, mesh).transient * 2 == got


@pytest.mark.parametrize("factory", ["hf_mixtral", "hf_qwen2_moe"])
def test_a_moe_model_built_on_the_meta_device_plans_as_the_real_one(factory):
    """A large MoE run builds its model on the meta device (no memory) and plans it: the experts op's autograd
    records the forward's autocast state, which the meta device has none of (it raised "unknown device type for
    autocast" inside torch.export). The meta model's parameters are laid out as the real model's. (Its graph is not
    node for node the real one's, for dense HF models too: a meta trace keeps a ``contiguous`` or two the real trace
    drops, so the plans' digests differ.)"""
    import autoshard
    from examples import models

    model, args, kwargs = getattr(models, factory)()
    with torch.device("meta"):
        meta_model, meta_args, meta_kwargs = getattr(models, factory)()
    mesh = autoshard.Mesh(data=2, model=2)
    real = autoshard.compile(model, mesh, args, kwargs, planner="search").plan
    meta = autoshard.compile(meta_model, mesh, meta_args, meta_kwargs, planner="search").plan
    assert meta.param_specs() == real.param_specs()


def test_tokens_split_on_one_axis_and_experts_on_another_split_the_work_both_ways():
    """data=2 x model=2, the tokens split over ``data`` and the experts over ``model``: each rank runs a quarter of
    the work (half the tokens, their choices of half the experts). No operand is split 4 ways (hidden by ``data``,
    the weights by ``model``, the output by ``data`` and Partial over ``model``), so the largest operand ratio said
    2; the op's ``split`` facet says 4, and the op's seconds are the unsplit seconds over 4."""
    import autoshard
    from autoshard import meta as M
    from autoshard.cost_models.plan_cost import op_time, shard_factor
    from autoshard.cost_models.profile import load_profile

    node, _ = _traced_experts()
    mesh = autoshard.Mesh(data=2, model=2)
    R, S, P = autoshard.Replicate(), autoshard.Shard(0), autoshard.Partial()
    tokens, experts, whole = (S, R), (R, S), (R, R)
    both = M.Strategy(input_specs=(tokens,) * 3 + (experts,) * 2, output_spec=(S, P))
    one = M.Strategy(input_specs=(tokens,) * 3 + (whole,) * 2, output_spec=(S, R))
    alone = M.Strategy(input_specs=(whole,) * 5, output_spec=whole)
    assert shard_factor(node, alone, mesh) == 1
    assert shard_factor(node, one, mesh) == 2
    assert shard_factor(node, both, mesh) == 4
    profile = load_profile("cpu-gloo")
    assert op_time(node, both, mesh, profile) == pytest.approx(op_time(node, alone, mesh, profile) / 4, rel=1e-12)
