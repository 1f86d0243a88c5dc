"""Issue 36's correctness acceptance: tiny Hugging Face Mixtral, Qwen3-MoE, DeepSeek-V3 (MLA, a shared expert,
group-limited sigmoid routing) and DBRX (flat ``[E·f, h]`` experts), two layers each, every layer a sparse-MoE block
recognised by :mod:`autoshard.frontend.hf_blocks` and run with ``MoE(existing=True)`` (all-to-all dispatch).

Meshes: data=2 x model=2 with the experts over ``model`` (tokens split over ``data``) and data=4 with the experts over
``data``. Experts over a product of axes (data x model as one expert group of 4) cannot be asked for: ``MoE`` takes one
``expert_axis`` and a placement shards a tensor dim over one axis, so data=4 with the experts over all 4 ranks is the
nearest expressible form of "EP over both axes".

* dropless (``capacity_factor=None``): loss and every gradient equal the unmodified Hugging Face model on one device
  (:func:`tests.test_hf_moe.check`, 1e-5 relative: within the acceptance's 1e-4);
* capacity (``capacity_factor=1.0``): equal to the capacity reference, the Hugging Face model whose experts get, per
  routing group (group ``g``: the ``g``-th contiguous chunk of the flattened tokens; one group per expert-axis rank),
  the routing weight of every choice past its expert's capacity ``min(T_g, ceil(k·T_g/E·cf))`` set to 0, choices
  counted in GShard order (every token's first choice in token order, then the second choices); dropped choices then
  add nothing and get no gradient, the router's and the experts' gradients included;
* bf16 (``MixedPrecision(torch.bfloat16)``): loss and gradients within 2e-2 (relative per gradient tensor) of the
  same reference run on one device under the same policy (tests/test_mixed_precision.py's reference).

4 real gloo processes: one test, all four models in one ``spawn``, data=2 x model=2 dropless in float32.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import autoshard
from autoshard.compiler.plan import loss_of
from autoshard.frontend import hf_blocks
from autoshard.placements import assemble
from autoshard.runtime import DistCommunicator, spawn, use
from autoshard.runtime.collective_ops import collective_counts
from examples import models
from examples.models import _ids
from tests.moe.reference import reference_capacity
from tests.test_hf_moe import ATOL, RTOL, check, hf_reference
from tests.test_mixed_precision import _check_grads, _under_policy

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning",
                                        "ignore::UserWarning")

BF16 = autoshard.MixedPrecision(torch.bfloat16)
CAPACITY_FACTOR = 1.0
BF16_TOL = 2e-2


# ---- tiny models: 2 layers, hidden 32, 4-8 experts top-2, 32 tokens ------------------------------------------
def mixtral():
    return models.hf_mixtral(layers=2)  # 4 experts


def qwen3_moe(batch=4, seq=8, vocab=64, seed=0):
    """8 experts top-2 (softmax over all experts, top-k renormalised), its router loss added."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=vocab, num_experts=8,
                         num_experts_per_tok=2, max_position_embeddings=seq, output_router_logits=True,
                         router_aux_loss_coef=0.02, use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = Qwen3MoeForCausalLM(cfg)
    ids, labels = _ids(batch, seq, vocab, seed + 1)
    return model, (), {"input_ids": ids, "labels": labels}


def deepseek_v3(batch=4, seq=8, vocab=64, seed=0):
    """MLA attention; both layers MoE (``first_k_dense_replace=0``): 8 routed experts top-2 chosen within the best
    of 2 groups of 4 (sigmoid scores, ``topk(sorted=False)``), plus a shared expert."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV3Config(num_hidden_layers=2, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                           num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24,
                           qk_rope_head_dim=4, v_head_dim=8, qk_nope_head_dim=8, n_routed_experts=8, n_group=2,
                           topk_group=1, num_experts_per_tok=2, first_k_dense_replace=0, vocab_size=vocab,
                           max_position_embeddings=seq, use_cache=False, bos_token_id=0, eos_token_id=0,
                           pad_token_id=0)
    model = DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():  # a correction bias that moves the choices (zeros at init)
        for layer in model.model.layers:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.linspace(-0.05, 0.05, 8))
    ids, labels = _ids(batch, seq, vocab, seed + 1)
    return model, (), {"input_ids": ids, "labels": labels}


def dbrx(batch=4, seq=8, vocab=64, seed=0):
    """Flat experts ``experts.mlp.{w1, v1, w2}`` of ``[E·f, h]`` (4 experts top-2), router ``router.layer``: the
    held-out models' tiny DBRX with 2 layers."""
    from tests.test_held_out_models import hf_dbrx

    return hf_dbrx(batch, seq, vocab, seed, layers=2)


MODELS = {"mixtral": mixtral, "qwen3_moe": qwen3_moe, "deepseek_v3": deepseek_v3, "dbrx": dbrx}
#: (mesh, expert axis)
MESHES = {"data2_model2": ({"data": 2, "model": 2}, "model"), "data4": ({"data": 4}, "data")}
BLOCKS = {"mixtral": "model.layers.{}.mlp", "qwen3_moe": "model.layers.{}.mlp", "deepseek_v3": "model.layers.{}.mlp",
          "dbrx": "transformer.blocks.{}.ffn"}


def _build(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return MODELS[name]()


# ---- the capacity reference ------------------------------------------------------------------------------------
def _keep(top_k_index: torch.Tensor, experts: int, groups: int, capacity_factor: float) -> torch.Tensor:
    """``[T, k]``: whether choice ``(t, c)`` fits its expert's capacity in its routing group (module docstring)."""
    tokens, k = top_k_index.shape
    per = tokens // groups
    cap = min(per, reference_capacity(per, experts, k, capacity_factor))
    keep = torch.zeros(tokens, k, dtype=torch.bool)
    for g in range(groups):
        used = [0] * experts
        for c in range(k):
            for t in range(g * per, (g + 1) * per):
                x = int(top_k_index[t, c])
                keep[t, c] = used[x] < cap
                used[x] += 1
    return keep


def _dropping(experts: int, groups: int, capacity_factor: float):
    """A forward pre-hook of an experts module: the routing weights of the dropped choices set to 0. (It reads no
    module, so a deep copy of the hooked model drops the same way.)"""
    def hook(module, args, kwargs):
        hidden, index, weights = args
        return (hidden, index, weights * _keep(index, experts, groups, capacity_factor).to(weights.dtype)), kwargs

    return hook


def capacity_reference(model, args, kwargs, groups, capacity_factor, policy=None):
    """(loss, gradients) of ``model`` on one device with every block's experts dropping over capacity (float32, or
    under ``policy``), and the number of choices dropped."""
    model = copy.deepcopy(model)
    dropped = []
    for block in hf_blocks.find_blocks(model).blocks:
        experts = model.get_submodule(block.path).experts
        experts.register_forward_pre_hook(_dropping(block.experts, groups, capacity_factor), with_kwargs=True)
        experts.register_forward_pre_hook(
            lambda m, a, kw, e=block.experts: dropped.append(int((~_keep(a[1], e, groups, capacity_factor)).sum())),
            with_kwargs=True)
    result = hf_reference(model, args, kwargs) if policy is None else _under_policy(model, args, kwargs, policy)
    return result, sum(dropped)


# ---- simulator ---------------------------------------------------------------------------------------------------
def _cases():
    """float32: every model x mesh x mode (16). bf16: every model in both modes, on one mesh per mode, the meshes
    swapped between the first two models and the last two, so each mesh x mode meets bf16 twice (8; all 16 pass,
    half of them are left out to keep the suite's time). ``sparse`` (no ``moe=``): every model once, float32, the
    meshes alternating (4)."""
    for i, model in enumerate(MODELS):
        for mesh in MESHES:
            for mode in ("dropless", "capacity"):
                yield pytest.param(model, mesh, mode, "fp32", id=f"{model}-{mesh}-{mode}-fp32")
        for mode, mesh in zip(("dropless", "capacity"), list(MESHES) if i < 2 else list(MESHES)[::-1]):
            yield pytest.param(model, mesh, mode, "bf16", id=f"{model}-{mesh}-{mode}-bf16")
        mesh = list(MESHES)[i % 2]
        yield pytest.param(model, mesh, "sparse", "fp32", id=f"{model}-{mesh}-sparse-fp32")


CASES = list(_cases())


def _check_sparse(model, args, kwargs, mesh, axis):
    """Without ``moe=``: the experts stay one ``autoshard::hf_experts`` op (sparse, dropless), their stacked (or
    flat) weights annotated ``Shard(0)`` on ``axis``, replicated elsewhere: each rank runs its experts' share of the
    choices (a Partial output), with no all-to-all; loss and every gradient equal Hugging Face on one device."""
    main, grads = hf_reference(model, args, kwargs)
    spec = tuple(autoshard.Shard(0) if a == axis else autoshard.Replicate() for a in mesh)
    plan = autoshard.compile(copy.deepcopy(model), autoshard.Mesh(**mesh), args, kwargs,
                             annotations={"*.experts.*": spec}).plan
    assert sum(n.target == torch.ops.autoshard.hf_experts.default for n in plan.graph_module.graph.nodes) == 2
    experts = [p for p in plan.param_specs() if ".experts." in p]
    assert len(experts) >= 4 and all(plan.param_specs()[p] == spec for p in experts)
    sim = plan.simulate(args, kwargs)
    assert not any(kind == "all_to_all" for kind, _ in collective_counts(sim.logs[0]))
    for out in sim.outputs:
        torch.testing.assert_close(loss_of(out).detach(), main, rtol=RTOL, atol=ATOL)
    assert set(sim.grads) == set(grads)
    for name, g in sim.grads.items():
        torch.testing.assert_close(g, grads[name], rtol=RTOL, atol=ATOL, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("name, mesh_name, mode, dtype", CASES)
def test_sharded_moe_equals_one_device(name, mesh_name, mode, dtype):
    model, args, kwargs = _build(name)
    mesh, axis = MESHES[mesh_name]
    groups = mesh[axis]
    cf = None if mode != "capacity" else CAPACITY_FACTOR
    opts = autoshard.MoE(existing=True, expert_axis=axis, capacity_factor=cf)
    policy = BF16 if dtype == "bf16" else None
    if mode == "sparse":
        _check_sparse(model, args, kwargs, mesh, axis)
        return
    if mode == "dropless":
        reference = hf_reference(model, args, kwargs) if policy is None else _under_policy(model, args, kwargs, policy)
    else:
        reference, dropped = capacity_reference(model, args, kwargs, groups, cf, policy)
        assert dropped > 0  # the capacity binds: a reference without drops would not tell the modes apart
    if policy is None:
        plan, _ = check(copy.deepcopy(model), args, kwargs, mesh, opts, reference)
    else:
        plan = autoshard.compile(copy.deepcopy(model), autoshard.Mesh(**mesh), args, kwargs, moe=opts,
                                 precision=policy).plan
        sim = plan.simulate(args, kwargs)
        ref_loss, ref_grads = reference
        for out in sim.outputs:
            loss = loss_of(out).detach()
            torch.testing.assert_close(loss, loss_of(sim.outputs[0]).detach(), rtol=0, atol=0)
            torch.testing.assert_close(loss.float(), ref_loss.float(), rtol=BF16_TOL, atol=0)
        _check_grads(sim.grads, ref_grads, tol=BF16_TOL)
        bmms = [n for n in plan.graph_module.graph.nodes if n.target == torch.ops.aten.bmm.default]
        assert bmms and all(n.meta["val"].dtype == torch.bfloat16 for n in bmms)  # the experts compute in bf16
    report = plan.context.report["expert_rewrite"]
    assert [layer["path"] for layer in report["layers"]] == [BLOCKS[name].format(i) for i in range(2)]
    assert report["groups"] == groups and report["expert_axis"] == axis
    tokens = kwargs["input_ids"].numel()
    for layer in report["layers"]:
        assert layer["tokens_per_group"] == tokens // groups
        assert layer["capacity"] == (tokens // groups if cf is None else min(
            tokens // groups, reference_capacity(tokens // groups, layer["experts"], layer["top_k"], cf)))
    # the experts sharded over the expert axis, Shard(0) of the stacked (or flat) weights
    specs = plan.param_specs()
    where = plan.mesh.names.index(axis)
    for layer in report["layers"]:
        for p in layer["expert_params"]:
            assert specs[p][where] == autoshard.Shard(0), (p, specs[p])


# ---- 4 gloo processes ------------------------------------------------------------------------------------------
GLOO_MESH = {"data": 2, "model": 2}


def _gloo_worker(rank, world_size):
    """Every model, data=2 x model=2, experts over `model`, dropless: this rank's loss and gradient shards."""
    mesh = autoshard.Mesh(**GLOO_MESH)
    comm = DistCommunicator(mesh, timeout=60)
    out = {}
    for name in MODELS:
        model, args, kwargs = _build(name)
        opts = autoshard.MoE(existing=True, expert_axis="model", capacity_factor=None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = autoshard.compile(model, mesh, args, kwargs, moe=opts).plan
        module = plan.rank_program(rank)
        a, kw = plan.shard_inputs(rank, args, kwargs)
        with use(comm):
            loss = loss_of(module(*a, **kw))
            loss.backward()
        out[name] = (loss.detach(), {n: p.grad for n, p in module.named_parameters()}, plan.param_specs())
    return out


@pytest.mark.gloo
def test_every_model_dropless_on_four_gloo_processes_equals_one_device():
    results = spawn(_gloo_worker, 4, timeout=240, start_method="forkserver")
    mesh = autoshard.Mesh(**GLOO_MESH)
    for name in MODELS:
        main, grads = hf_reference(*_build(name))
        specs = results[0][name][2]
        assert set(results[0][name][1]) == set(grads), name
        for rank in range(4):
            torch.testing.assert_close(results[rank][name][0], main, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name, rank=rank: f"{name} rank {rank} loss: {m}")
        experts = [p for p in specs if ".experts." in p]  # (not DeepSeek-V3's shared_experts: replicated)
        assert len(experts) >= 4 and all(specs[p][mesh.names.index("model")] == autoshard.Shard(0)
                                         for p in experts), (name, specs)  # two layers' experts, split on `model`
        for fqn, g in grads.items():
            real = assemble([results[r][name][1][fqn] for r in range(4)], specs[fqn], mesh)
            torch.testing.assert_close(real, g, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, fqn=fqn, name=name: f"{name} {fqn}: {m}")
