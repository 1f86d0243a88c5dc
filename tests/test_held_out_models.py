"""Held-out architectures that failed (issue 33, finding 6), each on data=2 x model=2 against one device.

* DeBERTa-v2: ``torch.tensor(mid - 1).type_as(relative_pos)`` (a 0-d self, a 2-d other) made ``aten.type_as``'s
  rule broadcast `other` into the 0-d output (IndexError in propagate); its rule now labels `other`, which gives
  only a dtype, with the output's labels where its dims line up and keeps it whole otherwise.
* ``Mesh(context=1)`` with ``context_axis="context"``: the cut found no strategy sharding dim 1 on a size-1 axis
  (a bare StopIteration); a size-1 context axis now plans as the same mesh without ``context_axis`` does.
* DBRX: its experts' flat 2-D weights (``mlp.w1``/``v1``/``w2`` of ``[E·f, h]``) were not recognised, so the trace
  met the data-dependent expert loop; they are now viewed as the stacked layout of ``hf_experts``.
* Llama-4 text: its experts' forward takes the routed input alone (scores applied before the experts, every expert
  run by a static batched matmul) but was recognised and given the ``(hidden, top_k_index, top_k_weights)``
  replacement; it is now rejected with the reason and traced as ``torch.export`` traces it.

"60%" is :func:`bench.memory_limit_sweep.run_case`'s: ``planner="search"`` with ``memory_limit`` = 60% of the
unconstrained searched plan's ``plan.cost().memory_per_rank`` and nothing else.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import autoshard
from autoshard import meta as M
from autoshard.errors import PlanError
from autoshard.frontend import hf_blocks
from examples import models
from examples.models import _ids
from tests import opcases, rule_sweep
from tests.test_equivalence import assert_simulated_equals_one_device
from tests.test_memory_limit_sweep import SWEEP

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning",
                                        "ignore::UserWarning")

aten = torch.ops.aten
MESH = {"data": 2, "model": 2}


# ---- model factories (tiny configs) ------------------------------------------------------------------------
def hf_deberta_v2(batch: int = 4, seq: int = 8, vocab: int = 64, seed: int = 0):
    """Tiny DeBERTa-v2 masked LM with relative attention and log-bucketed positions (the 0-d ``type_as``)."""
    from transformers import DebertaV2Config, DebertaV2ForMaskedLM

    torch.manual_seed(seed)
    cfg = DebertaV2Config(vocab_size=vocab, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                          intermediate_size=64, max_position_embeddings=seq, relative_attention=True,
                          position_buckets=4, pos_att_type=["p2c", "c2p"], hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0, pad_token_id=0)
    model = DebertaV2ForMaskedLM(cfg)
    ids, labels = _ids(batch, seq, vocab, seed + 1)
    return model, (), {"input_ids": ids, "labels": labels}


def hf_dbrx(batch: int = 4, seq: int = 8, vocab: int = 64, seed: int = 0, layers: int = 1):
    """Tiny DBRX: ``layers`` layers (one by default), 4 experts top-2 with flat ``[E·f, h]`` expert weights.
    (transformers 5's DbrxAttention reads ``attn_config.rope_theta`` and clamps with ``clip_qkv`` unconditionally,
    so both are given.)"""
    from transformers import DbrxConfig, DbrxForCausalLM

    torch.manual_seed(seed)
    cfg = DbrxConfig(d_model=32, n_heads=4, n_layers=layers, max_seq_len=seq, vocab_size=vocab,
                     attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                     ffn_config={"hidden_size": 32, "ffn_hidden_size": 16, "moe_num_experts": 4, "moe_top_k": 2},
                     use_cache=False, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    model = DbrxForCausalLM(cfg)
    ids, labels = _ids(batch, seq, vocab, seed + 1)
    return model, (), {"input_ids": ids, "labels": labels}


def hf_llama4(batch: int = 4, seq: int = 8, vocab: int = 64, seed: int = 0):
    """Tiny Llama-4 text: one MoE layer (4 experts, top-1 sigmoid routing, a shared expert)."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    torch.manual_seed(seed)
    cfg = Llama4TextConfig(vocab_size=vocab, hidden_size=32, intermediate_size=16, intermediate_size_mlp=64,
                           num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                           max_position_embeddings=seq, num_local_experts=4, num_experts_per_tok=1,
                           interleave_moe_layer_step=1, use_cache=False, attention_chunk_size=seq,
                           pad_token_id=0, bos_token_id=0, eos_token_id=0)
    model = Llama4ForCausalLM(cfg)
    ids, labels = _ids(batch, seq, vocab, seed + 1)
    return model, (), {"input_ids": ids, "labels": labels}


FACTORIES = {"hf_deberta_v2": hf_deberta_v2, "hf_dbrx": hf_dbrx, "hf_llama4": hf_llama4}


def _compile(model, args, kwargs, mesh=None, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autoshard.compile(copy.deepcopy(model), mesh or autoshard.Mesh(**MESH), args, kwargs,
                                 **options).plan


# ---- aten.type_as with a 0-d tensor --------------------------------------------------------------------------
class _ScaledSum(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x).sum() * torch.tensor(2.0).type_as(x)


def test_type_as_of_a_0d_tensor_matches_one_device():
    torch.manual_seed(0)
    model, x = _ScaledSum(), torch.randn(4, 8)
    plan = _compile(model, (x,), {})
    assert any(n.target == aten.type_as.default and n.args[0].meta["val"].dim() == 0
               for n in plan.graph_module.graph.nodes)
    assert_simulated_equals_one_device(copy.deepcopy(model), (x,), {}, plan)


#: type_as of a 0-d self and a 2-d other: every strategy of the rule, forced, against the unsharded op
#: (tests/rule_sweep.py's checker)
TYPE_AS_CASES = [
    opcases.case("type_as_0d_self", aten.type_as.default, lambda m, a, b: a.type_as(b) * b.sum(),
                 opcases.f(), opcases.f(4, 8)),
]


def _type_as_entries():
    for c in TYPE_AS_CASES:
        for mesh_name in rule_sweep.MESHES:
            yield pytest.param(c, mesh_name, id=f"{c.name}-{mesh_name}")


@pytest.mark.parametrize("case, mesh_name", list(_type_as_entries()))
def test_type_as_rule_every_strategy_matches_the_unsharded_op(case, mesh_name, monkeypatch):
    monkeypatch.setitem(opcases.BY_NAME, case.name, case)
    strats = rule_sweep.candidates(case.name, mesh_name)
    assert len(strats) > 1  # something besides all-replicated (the output or self sharded, or Partial)
    for strat in strats:
        for variant in rule_sweep.variants(case.name, strat):
            what = f"{case.name} on {mesh_name}, strategy {','.join(rule_sweep.tokens(strat))} ({variant})"
            plan = rule_sweep.build(case.name, mesh_name, strat, variant)
            rule_sweep.check(case.name, plan, what)


# ---- Mesh(context=1) ----------------------------------------------------------------------------------------
def test_a_size_1_context_axis_plans_as_the_mesh_without_it():
    model, args, kwargs = models.gpt(layers=1)
    plan = _compile(model, args, kwargs, autoshard.Mesh(context=1), context_axis="context")
    bare = _compile(model, args, kwargs, autoshard.Mesh(context=1))  # the same mesh, no context parallelism
    ops = lambda p: [str(n.target) for n in p.graph_module.graph.nodes if n.op == "call_function"]
    assert ops(plan) == ops(bare)  # no sequence cut, no collective
    assert M.CONTEXT not in plan.graph_module.meta
    assert_simulated_equals_one_device(copy.deepcopy(model), args, kwargs, plan)


def test_a_sequence_that_does_not_divide_by_the_context_axis_is_a_plan_error():
    model, args, kwargs = models.gpt(layers=1)  # sequence 16
    with pytest.raises(PlanError, match=r"cuts input `ids`.*the length 16 must divide by the axis size 3"):
        _compile(model, args, kwargs, autoshard.Mesh(context=3), context_axis="context")


# ---- whole models: defaults and 60% ------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(FACTORIES))
def test_held_out_model_with_defaults_matches_one_device(name):
    model, args, kwargs = FACTORIES[name]()
    plan = _compile(model, args, kwargs)
    assert_simulated_equals_one_device(copy.deepcopy(model), args, kwargs, plan, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", list(FACTORIES))
def test_held_out_model_under_60_percent_fits_and_matches_one_device(name):
    row = SWEEP.run_case(name, FACTORIES[name])
    assert row["memory"] <= row["limit"] * (1 + 1e-9), (row["memory"], row["limit"])
    assert row["sharded"], row["plan"].param_specs()
    assert_simulated_equals_one_device(copy.deepcopy(row["model"]), row["args"], row["kwargs"], row["plan"],
                                       rtol=1e-4, atol=1e-4)


# ---- what hf_blocks recognises ---------------------------------------------------------------------------------
def test_dbrx_flat_experts_are_recognised_and_split_by_the_expert_rewrite():
    model, args, kwargs = hf_dbrx()
    found = hf_blocks.find_blocks(model)
    assert [(b.path, b.router, b.experts, b.top_k, b.flat) for b in found.blocks] == [
        ("transformer.blocks.0.ffn", "router.layer", 4, 2, True)]
    plan = _compile(model, args, kwargs, moe=autoshard.MoE(existing=True, expert_axis="model",
                                                           capacity_factor=None))
    layer = plan.context.report["expert_rewrite"]["layers"][0]
    experts = [f"transformer.blocks.0.ffn.experts.mlp.{w}" for w in ("w1", "v1", "w2")]
    assert layer["path"] == "transformer.blocks.0.ffn" and layer["expert_params"] == experts
    assert layer["router"] == "transformer.blocks.0.ffn.router.layer.weight"
    model_axis = plan.mesh.names.index("model")
    assert all(plan.param_specs()[p][model_axis] == autoshard.Shard(0) for p in experts)  # experts [0, 2), [2, 4)
    assert_simulated_equals_one_device(copy.deepcopy(model), args, kwargs, plan, rtol=1e-4, atol=1e-4)


def test_llama4_experts_are_not_replaced_and_say_why():
    model, args, kwargs = hf_llama4()
    found = hf_blocks.find_blocks(model)
    assert not found.blocks
    assert [p for p, _ in found.rejected] == ["model.layers.0.feed_forward"]
    assert "takes no (hidden_states, top_k_index, top_k_weights)" in found.rejected[0][1]
    plan = _compile(model, args, kwargs)
    # traced as torch.export traces it: every expert a batched matmul over the routed input, no hf_experts op
    nodes = list(plan.graph_module.graph.nodes)
    assert not any(n.target == torch.ops.autoshard.hf_experts.default for n in nodes)
    assert any(n.op == "get_attr" and n.target == "model.layers.0.feed_forward.experts.gate_up_proj" for n in nodes)


def test_an_unrecognised_experts_block_that_does_not_trace_is_named_with_the_cause_and_the_fix():
    """DBRX with `num_experts` that does not match its weights: not recognised, its own forward's per-expert loop
    does not trace; the error names the block, why it was not taken and the fix (autoshard's own error, not wrapped
    in torch.export's)."""
    from autoshard.errors import TraceError

    model, args, kwargs = hf_dbrx()
    model.transformer.blocks[0].ffn.experts.num_experts = 3
    with pytest.raises(TraceError, match=r"sparse-MoE block `transformer\.blocks\.0\.ffn` could not be traced: "
                                         r"autoshard did not recognise it \(its `experts` child has neither") as info:
        _compile(model, args, kwargs)
    assert "Store the experts as transformers' experts interface does" in str(info.value)  # the fix, in the message
    assert "forward" not in model.transformer.blocks[0].ffn.experts.__dict__  # the model is left as it was
