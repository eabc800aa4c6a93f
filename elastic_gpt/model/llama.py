"""The Llama 3 decoder: RMSNorm, rotary position embeddings with Llama 3.1's frequency scaling,
grouped-query attention through SDPA, a SwiGLU MLP, no biases, an untied output layer (tied as
an option).

The blocks' leaf names and layouts are Hugging Face's `LlamaForCausalLM`'s (`self_attn.q_proj`,
`mlp.gate_proj`, `input_layernorm`, ...; rotary embeddings on the two halves of each head, its
"rotate_half" layout), so its weights load with no permutation and the logits are its logits;
the trunk is named as every family's (`wte`, `h`, `ln_f`, `lm_head`: model/gpt.py `Decoder`),
and model/hf_layouts.py maps the rest. Nothing here knows about Ray or FSDP.

The rotary tables are not buffers: each attention computes them from its input's length on
its input's device, in fp32, as Hugging Face does. A model built on "meta", materialised with
`to_empty` and filled from shards (the trainer's path) or from a checkpoint therefore has the
tables an eager build has, and no checkpoint holds them.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from elastic_gpt.model.config import LlamaConfig
from elastic_gpt.model.gpt import Decoder, TiedLMHead


class RMSNorm(nn.Module):
    """x / rms(x) * gain, the mean square taken in fp32 whatever the input's dtype (as Llama's
    reference code and Hugging Face's do), the result rounded back before the gain."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_frequencies(cfg: LlamaConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """The (head_dim / 2,) inverse frequencies theta^(-2i/d), with Llama 3.1's scaling when
    `cfg.rope_factor` is set: wavelengths longer than original_seq_len / low_freq_factor are
    slowed by the factor, shorter than original_seq_len / high_freq_factor kept, and the band
    between blended smoothly. The same fp32 operations as Hugging Face's, in its order."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (
        torch.arange(0, dim, 2, dtype=torch.int64, device=device).to(torch.float) / dim))
    if cfg.rope_factor is None:
        return inv_freq
    factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old = cfg.rope_original_seq_len
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


def rope_tables(cfg: LlamaConfig, seq_len: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (seq_len, head_dim) in fp32: positions 0..seq_len-1 times the inverse
    frequencies, the angle of frequency i at columns i and i + head_dim / 2. Elementwise fp32
    products (autocast leaves them in fp32), so it runs on any device, "meta" included."""
    freqs = (torch.arange(seq_len, device=device).float()[:, None]
             * rope_frequencies(cfg, device)[None, :])
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.size(-1) // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, T, head_dim) rotated by position: each pair (i, i + head_dim / 2) of a head
    turned by its angle."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    """Grouped-query attention: n_kv_head key/value heads, each shared by n_head / n_kv_head
    query heads (SDPA's enable_gqa: no copies of k and v)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.head_dim, self.dropout = cfg.head_dim, cfg.dropout
        kv = cfg.n_kv_head * cfg.head_dim
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.k_proj = nn.Linear(cfg.n_embd, kv, bias=False)
        self.v_proj = nn.Linear(cfg.n_embd, kv, bias=False)
        self.o_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # Under tensor parallelism the projections hold this rank's heads of each (whole ones:
        # tp divides n_kv_head), so the head counts are read from the widths.
        q, k, v = (proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = rope_tables(self.cfg, T, q.device)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=k.size(1) != q.size(1))
        y = y.transpose(1, 2).contiguous().view(B, T, -1)
        return self.resid_dropout(self.o_proj(y))


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.n_embd, cfg.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(cfg.n_embd, cfg.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_hidden, cfg.n_embd, bias=False)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(Decoder):
    residual_projections = ("self_attn.o_proj.weight", "mlp.down_proj.weight")

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)  # model.dropout's "on the embeddings", as GPT-2's
        self.h = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layer))
        self.ln_f = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.lm_head = (TiedLMHead(self.wte) if cfg.tie_embeddings
                        else nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False))
        if not self.wte.weight.is_meta:  # on "meta" the trainer inits after sharding instead
            self.init_weights()

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        return self.drop(self.wte(idx))
