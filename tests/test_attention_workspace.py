"""Attention's workspace: the float copy of a boolean mask that sdpa keeps for backward, made once per mask in the
rank program (``autoshard/compiler/ops/attention.py`` ``_share_additive_mask``, ``autoshard/runtime/ops.py``
``additive_mask``), and the ``workspace`` facet that tells the memory model about it and about the score blocks
of context-parallel attention (``sdpa_workspace``)."""

from __future__ import annotations

import math

import torch

import autoshard
from autoshard import meta as M
from autoshard.compiler.ops import Workspace, entry, op, unregister
from autoshard.compiler.plan import loss_of
from autoshard.runtime import SimWorld
from autoshard.runtime.ops import additive_mask
from examples import models
from tests.test_equivalence import assert_simulated_equals_one_device

aten = torch.ops.aten
SEQ, BATCH = 64, 4


def _llama(layers: int):
    return models.hf_llama(batch=BATCH, seq=SEQ, layers=layers, hidden=64, heads=4, kv_heads=2, vocab=128)


def _attentions(gm):
    return [n for n in gm.graph.nodes if n.target == aten.scaled_dot_product_attention.default]


def _saved_masks(loss) -> dict[int, int]:
    """Measured: storage -> bytes of the float masks the attention backward nodes keep."""
    out, seen, stack = {}, set(), [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if "ScaledDotProduct" in type(fn).__name__:
            mask = getattr(fn, "_saved_attn_mask", None)
            if isinstance(mask, torch.Tensor) and mask.is_floating_point():
                out[mask.untyped_storage().data_ptr()] = mask.untyped_storage().nbytes()
        stack.extend(f for f, _ in fn.next_functions)
    return out


def _run_rank0(plan, args, kwargs):
    def body(rank):
        module = plan.rank_program(rank)
        a, k = plan.shard_inputs(rank, args, kwargs)
        return module, _saved_masks(loss_of(module(*a, **k)))

    return SimWorld(plan.mesh).run(body)[0]


def test_the_layers_share_one_float_mask_and_equal_one_device():
    model, args, kwargs = _llama(layers=2)
    plan = autoshard.compile(model, autoshard.Mesh(data=2), args, kwargs).plan
    module, saved = _run_rank0(plan, args, kwargs)
    made = [n for n in module.graph.nodes if n.target is additive_mask]
    assert len(made) == 1
    assert all(n.args[3] is made[0] for n in _attentions(module)) and len(_attentions(module)) == 2
    # one float mask kept for both backwards: [b/2, 1, s, s] fp32
    assert list(saved.values()) == [BATCH // 2 * SEQ * SEQ * 4]
    assert_simulated_equals_one_device(model, args, kwargs, plan)


def test_sdpa_keeps_a_float_copy_of_a_boolean_mask_per_call():
    """Why the rank program shares one: two attentions on one boolean mask keep two float masks, on one float mask
    (what ``additive_mask`` makes) one."""
    q = torch.randn(2, 4, 32, 8, requires_grad=True)
    mask = torch.ones(32, 32, dtype=torch.bool).tril().expand(2, 1, 32, 32)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def two_layers(m):
        return _saved_masks(sdpa(sdpa(q, q, q, m), q, q, m).sum())

    assert list(two_layers(mask).values()) == [2 * 32 * 32 * 4] * 2
    assert list(two_layers(additive_mask(mask, torch.float32)).values()) == [2 * 32 * 32 * 4]


def test_one_attention_keeps_the_mask_as_traced():
    model, args, kwargs = _llama(layers=1)
    plan = autoshard.compile(model, autoshard.Mesh(data=2), args, kwargs).plan
    module, saved = _run_rank0(plan, args, kwargs)
    assert not [n for n in module.graph.nodes if n.target is additive_mask]
    assert list(saved.values()) == [BATCH // 2 * SEQ * SEQ * 4]  # sdpa's own conversion


def test_additive_mask_is_what_sdpa_makes_of_a_boolean_mask():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    mask = torch.rand(2, 1, 16, 16) > 0.3
    mask[..., 0] = True  # no row without a key
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, mask)
    got = torch.nn.functional.scaled_dot_product_attention(q, k, v, additive_mask(mask, torch.float32))
    assert torch.equal(got, want)
    assert additive_mask(mask, torch.bfloat16).dtype == torch.bfloat16


def _workspaces(plan):
    return [entry(n.target).workspace(n, n.meta[M.STRATEGY], plan.mesh) for n in _attentions(plan.graph_module)]


def test_workspace_of_whole_attention_is_the_float_mask_at_local_size():
    model, args, kwargs = _llama(layers=2)
    one = _workspaces(autoshard.compile(model, autoshard.Mesh(context=1), args, kwargs).plan)
    two = _workspaces(autoshard.compile(model, autoshard.Mesh(data=2), args, kwargs).plan)
    assert [w.kept for w in one] == [BATCH * SEQ * SEQ * 4] * 2 and all(w.transient == 0 for w in one)
    assert [w.kept for w in two] == [BATCH // 2 * SEQ * SEQ * 4] * 2
    assert one[0].kept_key == one[1].kept_key is not None  # one copy between the layers


def test_workspace_of_ring_attention_is_its_score_blocks_and_kv_in_flight():
    from autoshard.compiler.ops.attention import SCORE_BLOCKS

    batch, n = 8, 4
    model, args, kwargs = models.hf_llama(batch=batch, seq=SEQ, layers=1, hidden=64, heads=4, kv_heads=2,
                                          vocab=128)
    plan = autoshard.compile(model, autoshard.Mesh(context=n), args, kwargs, context_axis="context").plan
    (w,) = _workspaces(plan)
    c = SEQ // n // 2  # head-tail: two chunks of s/2n per rank
    kv = 2 * batch * 4 * (SEQ // n) * 16 * 4  # local K and V: [b, heads, s/n, d] fp32 (HF repeats the KV heads)
    assert w == Workspace(kept=0, transient=SCORE_BLOCKS * batch * 4 * c * c * 4 + 2 * kv)


def test_an_op_without_workspace_states_none():
    assert entry(aten.mm.default).workspace is None

    def target(x):
        return x

    op(target, workspace=lambda node, strategy, mesh: Workspace(transient=math.prod((2, 3))))
    try:
        assert entry(target).workspace(None, None, None).transient == 6
    finally:
        unregister(target)
