"""Model factories for the examples, the CLI (``autoshard show examples.models:gpt``) and the tests.

Each factory returns ``(model, example_args, example_kwargs)`` with small, deterministic weights and inputs.
Dropout is 0 so sharded and single-device runs can be compared exactly.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    """Two linears with a GELU between; returns the mean squared output (a scalar loss)."""

    def __init__(self, hidden: int = 32, ffn: int = 64):
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.fc2(F.gelu(self.fc1(x))), target)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = (p(x).view(b, s, self.heads, h // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, h))


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A plain GPT: token + position embeddings, pre-norm blocks, tied LM head, mean cross-entropy loss."""

    def __init__(self, vocab: int = 128, hidden: int = 64, heads: int = 4, layers: int = 2, seq: int = 16):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.wte.weight
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.5 / math.sqrt(p.shape[1]))

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.wte(ids) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


def _ids(batch: int, seq: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    return ids, labels


def mlp(batch: int = 8, hidden: int = 32, seed: int = 0):
    torch.manual_seed(seed)
    model = MLP(hidden, 2 * hidden)
    g = torch.Generator().manual_seed(seed + 1)
    return model, (torch.randn(batch, hidden, generator=g), torch.randn(batch, hidden, generator=g)), {}


def gpt(batch: int = 4, seq: int = 16, layers: int = 2, hidden: int = 64, heads: int = 4, vocab: int = 128,
        seed: int = 0):
    torch.manual_seed(seed)
    model = GPT(vocab, hidden, heads, layers, seq)
    return model, _ids(batch, seq, vocab, seed + 1), {}


def hf_gpt2(batch: int = 4, seq: int = 16, layers: int = 2, hidden: int = 64, heads: int = 4, vocab: int = 128,
            seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab, n_positions=seq,
                     use_cache=False, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0,
                     eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    ids, labels = _ids(batch, seq, vocab, seed + 1)
    return model, (), {"input_ids": ids, "labels": labels}


def hf_llama(batch: int = 4, seq: int = 16, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
             vocab: int = 128, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                      max_position_embeddings=seq, use_cache=False, bos_token_id=0, eos_token_id=0,
                      pad_token_id=0)
    model = LlamaForCausalLM(cfg)
    ids, labels = _ids(batch, seq, vocab, seed + 1)
    return model, (), {"input_ids": ids, "labels": labels}


#: Megatron plans (vocabulary-parallel embeddings and LM head, column-parallel then row-parallel linears, heads
#: split on the model axis), per model, as
#: {glob: placement on the model axis}; ``megatron(mesh, name)`` expands them to one placement per mesh axis.
MEGATRON = {
    "mlp": {"fc1.weight": "S(0)", "fc1.bias": "S(0)", "fc2.weight": "S(1)"},
    "gpt": {"wte.weight": "S(0)", "wpe.weight": "S(0)", "blocks.*.attn.[qkv].weight": "S(0)", "blocks.*.attn.[qkv].bias": "S(0)",
            "blocks.*.attn.out.weight": "S(1)", "blocks.*.mlp.0.weight": "S(0)", "blocks.*.mlp.0.bias": "S(0)",
            "blocks.*.mlp.2.weight": "S(1)"},
    # GPT-2's Conv1D stores weights as [in, out]: column-parallel is Shard(1), row-parallel Shard(0).
    "hf_gpt2": {"lm_head.weight": "S(0)", "transformer.wpe.weight": "S(0)",
                "transformer.h.*.attn.c_attn.weight": "S(1)", "transformer.h.*.attn.c_attn.bias": "S(0)",
                "transformer.h.*.attn.c_proj.weight": "S(0)", "transformer.h.*.mlp.c_fc.weight": "S(1)",
                "transformer.h.*.mlp.c_fc.bias": "S(0)", "transformer.h.*.mlp.c_proj.weight": "S(0)"},
    "hf_llama": {"model.embed_tokens.weight": "S(0)", "lm_head.weight": "S(0)",
                 "model.layers.*.self_attn.[qkv]_proj.weight": "S(0)", "model.layers.*.self_attn.o_proj.weight": "S(1)",
                 "model.layers.*.mlp.gate_proj.weight": "S(0)", "model.layers.*.mlp.up_proj.weight": "S(0)",
                 "model.layers.*.mlp.down_proj.weight": "S(1)"},
}


class BlockLoss(nn.Module):
    """One GPT block whose output's mean square is the loss: the unit the Megatron communication counts are about."""

    def __init__(self, hidden: int = 32, heads: int = 4):
        super().__init__()
        self.block = Block(hidden, heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x).pow(2).mean()


def gpt_block(batch: int = 2, seq: int = 8, hidden: int = 32, heads: int = 4, seed: int = 0):
    """``(model, (x,), {}, megatron_plan_on_model_axis)`` for a single GPT block."""
    torch.manual_seed(seed)
    model = BlockLoss(hidden, heads)
    plan = {k.replace("blocks.*.", "block."): (v,) for k, v in MEGATRON["gpt"].items() if k.startswith("blocks")}
    return model, (torch.randn(batch, seq, hidden, requires_grad=True),), {}, plan


def megatron(mesh, name: str, model_axis: str = "model") -> dict:
    """The Megatron plan of factory ``name`` on ``mesh``: the placements above on ``model_axis``, R elsewhere."""
    if model_axis not in mesh.names:
        return {}
    return {glob: tuple(p if axis == model_axis else "R" for axis in mesh.names)
            for glob, p in MEGATRON[name].items()}


FACTORIES = {"mlp": mlp, "gpt": gpt, "hf_gpt2": hf_gpt2, "hf_llama": hf_llama}
