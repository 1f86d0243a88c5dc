"""Tracing a repeated layer once and copying it gives the same graph as exporting every layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autoshard.meta import module_path
from autoshard.frontend.trace import REUSED_LAYERS, trace
from examples.models import gpt, hf_gpt2, hf_llama


def _summary(gm):
    rows = []
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        rows.append((n.op, n.name, str(n.target), module_path(n),
                     (tuple(v.shape), v.dtype, v.requires_grad) if isinstance(v, torch.Tensor) else None,
                     n.meta.get("autoshard.param"), n.meta.get("autoshard.aliases")))
    return rows


def _both(model, args, kwargs=None):
    full = trace(model, args, kwargs, reuse_layers=False)
    fast = trace(model, args, kwargs)
    return full, fast


@pytest.mark.parametrize("factory,prefix", [(gpt, "blocks"), (hf_gpt2, "transformer.h"), (hf_llama, "model.layers")])
def test_copied_layers_equal_full_export(factory, prefix):
    model, args, kwargs = factory(layers=4)
    full, fast = _both(model, args, kwargs)
    assert fast.meta[REUSED_LAYERS] == {prefix: ["0", "1", "2", "3"]}  # one layer traced, three copied
    assert REUSED_LAYERS not in full.meta
    assert fast.code == full.code
    assert _summary(fast) == _summary(full)
    torch.testing.assert_close(fast(*args, **kwargs), full(*args, **kwargs), rtol=0, atol=0)


def test_copies_run_their_own_parameters():
    model, args, kwargs = gpt(layers=3)
    fast = trace(model, args, kwargs)
    expected = model(*args)
    with torch.no_grad():
        model.blocks[2].mlp[0].weight.mul_(1.5)  # only the last (copied) layer changes
    assert not torch.allclose(fast(*args), expected)
    torch.testing.assert_close(fast(*args), model(*args))


class _Scaled(nn.Module):
    def __init__(self, scale: float, act=nn.GELU):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = act()
        self.scale = scale

    def forward(self, x):
        return x + self.scale * self.act(self.fc(x))


class _Stack(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.inp = nn.Linear(8, 8)  # every layer's input then requires grad, as in a transformer
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return x.sum()


class _Indexed(nn.Module):
    """Same parameters and attributes-by-type in every layer, but the forward branches on the layer index."""

    def __init__(self, idx: int):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.idx = idx

    def forward(self, x):
        y = self.fc(x)
        return x + (torch.relu(y) if self.idx % 2 else torch.tanh(y))


class _PythonData(nn.Module):
    """A per-layer constant made from Python data: invisible on meta tensors, so never copied."""

    def __init__(self, idx: int):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.idx = idx

    def forward(self, x):
        return self.fc(x) * torch.tensor([1.0 + self.idx])


@pytest.mark.parametrize("layers,reused", [
    ([_Scaled(1.0), _Scaled(1.0), _Scaled(0.5)], ["0", "1"]),  # layer 2 multiplies by another Python constant
    ([_Scaled(1.0), _Scaled(1.0, nn.ReLU), _Scaled(1.0)], ["0", "2"]),  # layer 1 has another structure
    ([_Indexed(i) for i in range(3)], ["0", "2"]),  # layer 1 takes the other branch
    ([_PythonData(i) for i in range(3)], []),  # constants from Python data: nothing is copied
], ids=["scale", "activation", "branch", "python-data"])
def test_layers_that_differ_are_traced_as_they_are(layers, reused):
    torch.manual_seed(0)
    model = _Stack(layers)
    x = torch.randn(2, 8)
    full, fast = _both(model, (x,))
    assert fast.meta.get(REUSED_LAYERS, {}).get("layers", []) == reused
    assert fast.code == full.code
    assert _summary(fast) == _summary(full)
    torch.testing.assert_close(fast(x), model(x))


def test_layer_sharing_a_parameter_is_not_copied():
    torch.manual_seed(0)
    layers = [_Scaled(1.0) for _ in range(4)]
    layers[3].fc.weight = layers[0].fc.weight  # tied across layers
    model = _Stack(layers)
    x = torch.randn(2, 8)
    full, fast = _both(model, (x,))
    assert fast.code == full.code
    assert fast.meta[REUSED_LAYERS] == {"layers": ["1", "2"]}  # 0 and 3 share a weight: both traced
    torch.testing.assert_close(fast(x), model(x))


def test_meta_device_model_reuses_layers():
    from examples.models import GPT

    with torch.device("meta"):
        model = GPT(128, 64, 4, 6, 16)
        ids = torch.zeros(2, 16, dtype=torch.long)
    full, fast = _both(model, (ids, ids))
    assert fast.meta[REUSED_LAYERS] == {"blocks": [str(i) for i in range(6)]}
    assert fast.code == full.code


class _BareStack(nn.Module):
    """The first layer reads the input itself (no gradient), the others a computed value: only they match."""

    def __init__(self, n: int):
        super().__init__()
        self.layers = nn.ModuleList(_Scaled(1.0) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def test_group_restarts_at_the_first_layer_whose_inputs_match():
    torch.manual_seed(0)
    model = _BareStack(4)
    x = torch.randn(2, 8)
    full, fast = _both(model, (x,))
    assert fast.meta[REUSED_LAYERS] == {"layers": ["1", "2", "3"]}  # layer 0 traced as it is
    assert fast.code == full.code
    assert _summary(fast) == _summary(full)
    torch.testing.assert_close(fast(x), model(x))


def _tiny_deepseek_v3(layers=4):
    """A tiny Hugging Face DeepSeek-V3 (MLA, its keys copied into the slices of a ``new_empty``; the first layer
    dense, then MoE layers of routed experts top-2 with group-limited routing and a shared expert)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    cfg = DeepseekV3Config(num_hidden_layers=layers, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                           num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24,
                           qk_rope_head_dim=4, v_head_dim=8, qk_nope_head_dim=8, n_routed_experts=8, n_group=2,
                           topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, vocab_size=64,
                           max_position_embeddings=16, use_cache=False, bos_token_id=0, eos_token_id=0,
                           pad_token_id=0)
    model = DeepseekV3ForCausalLM(cfg)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    return model, (), {"input_ids": ids, "labels": ids}


def test_a_layer_writing_into_a_tensor_it_made_is_copied():
    """DeepSeek-V3's attention writes its keys into the slices of ``kv.new_empty(...)`` (``copy_``): a write into a
    tensor the layer made itself is the copy's own, so its MoE layers are traced once and copied (the experts
    fingerprinted as exported, as the static experts op) — the same graph as exporting every layer."""
    model, args, kwargs = _tiny_deepseek_v3()
    full, fast = _both(model, args, kwargs)
    assert fast.meta[REUSED_LAYERS] == {"model.layers": ["1", "2", "3"]}  # layer 0 is dense
    assert any(n.target == torch.ops.aten.copy_.default for n in fast.graph.nodes)
    assert fast.code == full.code
    assert _summary(fast) == _summary(full)
    torch.testing.assert_close(fast(*args, **kwargs), full(*args, **kwargs), rtol=0, atol=0)


class _WritesItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        x[:, :2].copy_(y[:, :2])  # a view of the layer's input, through a slice: not the layer's own tensor
        return x + y


def test_a_layer_writing_into_its_input_is_not_copied():
    """(Nothing requires grad, so the copies run on meta tensors to be fingerprinted: the write is what refuses.)"""
    model = _Stack([_WritesItsInput() for _ in range(3)]).requires_grad_(False)
    x = torch.randn(4, 8)
    full, fast = _both(model, (x,))
    assert REUSED_LAYERS not in fast.meta
    assert fast.code == full.code
