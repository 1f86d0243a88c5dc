"""Model factories for the examples, the CLI (``autoshard show examples.models:gpt``) and the tests.

Each factory returns ``(model, example_args, example_kwargs)`` with small, deterministic weights and inputs.
Dropout is 0 so sharded and single-device runs can be compared exactly.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


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



def _llama_meta(batch: int, seq: int, layers: int, vocab: int, hidden: int, ffn: int, heads: int, kv_heads: int):
    """A ``LlamaForCausalLM`` of Llama-3's shape built under ``torch.device("meta")``; small CPU example inputs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=ffn, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, vocab_size=vocab, max_position_embeddings=8192,
                      rope_theta=500000.0, use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                      tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    ids, labels = _ids(batch, seq, vocab, 1)
    return model, (), {"input_ids": ids, "labels": labels}


def llama3_8b_meta(batch: int = 2, seq: int = 16, layers: int = 32, vocab: int = 128256):
    """A Llama-3-8B-shaped ``LlamaForCausalLM`` (hidden 4096, 32 heads, 8 KV heads, FFN 14336) built under
    ``torch.device("meta")``: no weight memory, for planning and ``autoshard show`` only (fill real weights with
    ``sharded.init_weights()`` or ``autoshard.load``). The example inputs are small CPU tensors."""
    return _llama_meta(batch, seq, layers, vocab, hidden=4096, ffn=14336, heads=32, kv_heads=8)


def llama3_70b_meta(batch: int = 2, seq: int = 16, layers: int = 80, vocab: int = 128256):
    """A Llama-3-70B-shaped ``LlamaForCausalLM`` (hidden 8192, 64 heads, 8 KV heads, FFN 28672) on the meta
    device, like :func:`llama3_8b_meta`."""
    return _llama_meta(batch, seq, layers, vocab, hidden=8192, ffn=28672, heads=64, kv_heads=8)


def llama31_405b_meta(batch: int = 2, seq: int = 16, layers: int = 126, vocab: int = 128256):
    """A Llama-3.1-405B-shaped ``LlamaForCausalLM`` (hidden 16384, 128 heads, 8 KV heads, FFN 53248, 126 layers) on
    the meta device, like :func:`llama3_8b_meta`."""
    return _llama_meta(batch, seq, layers, vocab, hidden=16384, ffn=53248, heads=128, kv_heads=8)


#: Megatron plans (vocabulary-parallel embeddings and LM head, column-parallel then row-parallel linears, heads
#: split on the model axis), per model, as
#: {glob: placement on the model axis}; ``megatron(mesh, name)`` expands them to one placement per mesh axis.
MEGATRON = {
    "mlp": {"fc1.weight": "S(0)", "fc1.bias": "S(0)", "fc2.weight": "S(1)"},
    "gpt": {"wte.weight": "S(0)", "wpe.weight": "S(0)", "blocks.*.attn.[qkv].weight": "S(0)",
            "blocks.*.attn.[qkv].bias": "S(0)",
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
MEGATRON["llama3_8b_meta"] = MEGATRON["hf_llama"]
MEGATRON["llama3_70b_meta"] = MEGATRON["hf_llama"]
MEGATRON["llama31_405b_meta"] = MEGATRON["hf_llama"]


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


# ---- tiny models of other families (op coverage: tests/test_op_coverage.py) -------------------------------
class ConvBN(nn.Module):
    """A small CNN: Conv2d + BatchNorm2d + ReLU twice, global average pool, a linear head, cross-entropy."""

    def __init__(self, channels: int = 8, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, 2 * channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(2 * channels)
        self.head = nn.Linear(2 * channels, classes)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return F.cross_entropy(self.head(x.mean((2, 3))), target)


def conv_bn(batch: int = 4, channels: int = 8, size: int = 8, classes: int = 10, seed: int = 0):
    torch.manual_seed(seed)
    model = ConvBN(channels, classes)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, 3, size, size, generator=g)
    return model, (x, torch.randint(0, classes, (batch,), generator=g)), {}


def _hf_seq2seq(cls, cfg, batch, seq, vocab, seed):
    torch.manual_seed(seed)
    model = cls(cfg)
    ids, labels = _ids(batch, seq, vocab, seed + 1)
    return model, (), {"input_ids": ids, "labels": labels}


def hf_t5(batch: int = 4, seq: int = 8, layers: int = 1, hidden: int = 32, heads: int = 4, vocab: int = 64,
          seed: int = 0):
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=vocab, d_model=hidden, d_kv=hidden // heads, d_ff=2 * hidden, num_layers=layers,
                   num_decoder_layers=layers, num_heads=heads, relative_attention_num_buckets=8,
                   relative_attention_max_distance=16, dropout_rate=0.0, use_cache=False, decoder_start_token_id=0,
                   pad_token_id=0, eos_token_id=1)
    return _hf_seq2seq(T5ForConditionalGeneration, cfg, batch, seq, vocab, seed)


def hf_bart(batch: int = 4, seq: int = 8, layers: int = 1, hidden: int = 32, heads: int = 4, vocab: int = 64,
            seed: int = 0):
    from transformers import BartConfig, BartForConditionalGeneration

    cfg = BartConfig(vocab_size=vocab, d_model=hidden, encoder_layers=layers, decoder_layers=layers,
                     encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=2 * hidden,
                     decoder_ffn_dim=2 * hidden, max_position_embeddings=seq + 2, dropout=0.0, attention_dropout=0.0,
                     activation_dropout=0.0, use_cache=False, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                     decoder_start_token_id=2, forced_eos_token_id=None)
    return _hf_seq2seq(BartForConditionalGeneration, cfg, batch, seq, vocab, seed)


def hf_vit(batch: int = 4, image: int = 8, patch: int = 4, layers: int = 1, hidden: int = 32, heads: int = 4,
           classes: int = 10, seed: int = 0):
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(seed)
    cfg = ViTConfig(image_size=image, patch_size=patch, num_channels=3, hidden_size=hidden, num_hidden_layers=layers,
                    num_attention_heads=heads, intermediate_size=2 * hidden, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0, num_labels=classes)
    model = ViTForImageClassification(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, 3, image, image, generator=g)
    return model, (), {"pixel_values": x, "labels": torch.randint(0, classes, (batch,), generator=g)}


def hf_bloom(batch: int = 4, seq: int = 8, layers: int = 1, hidden: int = 32, heads: int = 4, vocab: int = 64,
             seed: int = 0):
    from transformers import BloomConfig, BloomForCausalLM

    torch.manual_seed(seed)
    cfg = BloomConfig(vocab_size=vocab, hidden_size=hidden, n_layer=layers, n_head=heads, hidden_dropout=0.0,
                      attention_dropout=0.0, use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = BloomForCausalLM(cfg)
    ids, labels = _ids(batch, seq, vocab, seed + 1)
    return model, (), {"input_ids": ids, "labels": labels}


def hf_gptj(batch: int = 4, seq: int = 8, layers: int = 1, hidden: int = 32, heads: int = 4, vocab: int = 64,
            seed: int = 0):
    from transformers import GPTJConfig, GPTJForCausalLM

    torch.manual_seed(seed)
    cfg = GPTJConfig(vocab_size=vocab, n_positions=seq, n_embd=hidden, n_layer=layers, n_head=heads,
                     rotary_dim=hidden // heads // 2, n_inner=2 * hidden, resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = GPTJForCausalLM(cfg)
    ids, labels = _ids(batch, seq, vocab, seed + 1)
    return model, (), {"input_ids": ids, "labels": labels}


def hf_mamba(batch: int = 4, seq: int = 16, layers: int = 2, hidden: int = 64, state: int = 16, vocab: int = 128,
             seed: int = 0):
    """Tiny Mamba (selective state-space layers, Hugging Face's sequential scan: no attention, a conv1d per layer)."""
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(seed)
    cfg = MambaConfig(vocab_size=vocab, hidden_size=hidden, state_size=state, num_hidden_layers=layers, expand=2,
                      conv_kernel=4, use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = MambaForCausalLM(cfg)
    ids, labels = _ids(batch, seq, vocab, seed + 1)
    return model, (), {"input_ids": ids, "labels": labels}


# ---- Hugging Face Mixture-of-Experts models (tests/test_hf_moe.py; moe=autoshard.MoE(existing=True)) --------
def hf_mixtral(batch: int = 4, seq: int = 8, layers: int = 1, hidden: int = 32, heads: int = 4, kv_heads: int = 2,
               experts: int = 4, top_k: int = 2, vocab: int = 64, aux_loss: bool = True, seed: int = 0):
    """Tiny Mixtral (every layer a sparse-MoE block, top-2 of 4 experts); ``aux_loss``: the router's
    load-balancing loss (``output_router_logits``) is added to the LM loss, as Hugging Face trains it."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    cfg = MixtralConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=2 * hidden,
                        num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                        num_local_experts=experts, num_experts_per_tok=top_k, max_position_embeddings=seq,
                        output_router_logits=aux_loss, router_aux_loss_coef=0.02, use_cache=False,
                        bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = MixtralForCausalLM(cfg)
    ids, labels = _ids(batch, seq, vocab, seed + 1)
    return model, (), {"input_ids": ids, "labels": labels}


def hf_qwen2_moe(batch: int = 4, seq: int = 8, layers: int = 1, hidden: int = 32, heads: int = 4, kv_heads: int = 2,
                 experts: int = 4, top_k: int = 2, vocab: int = 64, aux_loss: bool = True, seed: int = 0):
    """Tiny Qwen2-MoE: routed experts (top-k weights not renormalised) plus a shared expert behind a sigmoid gate."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2MoeConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=2 * hidden,
                         moe_intermediate_size=hidden, shared_expert_intermediate_size=2 * hidden,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                         num_experts=experts, num_experts_per_tok=top_k, max_position_embeddings=seq,
                         output_router_logits=aux_loss, router_aux_loss_coef=0.02, use_cache=False,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = Qwen2MoeForCausalLM(cfg)
    ids, labels = _ids(batch, seq, vocab, seed + 1)
    return model, (), {"input_ids": ids, "labels": labels}
