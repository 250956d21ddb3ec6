"""A Llama-style decoder: RMSNorm, rotary position embeddings, SwiGLU, an untied LM head.

The shape of Llama 2 (``llama-7b`` in the zoo: 32 blocks of width 4096, 32 heads, an MLP of
11008, a vocabulary of 32000, bf16 parameters), written here from the published architecture.
Rotary angles are computed in the forward from the positions, so the model has no buffers and
builds on the meta device with nothing allocated.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int
    seq: int
    d_model: int
    layers: int
    heads: int
    hidden: int  # the SwiGLU MLP's inner width
    batch_size: int
    dtype: torch.dtype = torch.float32  # the parameters' (bf16 for the published sizes)
    eps: float = 1e-5
    rope_base: float = 10000.0


class RMSNorm(nn.Module):
    """x / rms(x) * weight, the mean of squares taken in float32 (as Llama's reference does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding of ``x`` (batch, heads, seq, head_dim): each half-pair turned by its angle."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.head_dim, self.base = cfg.heads, cfg.d_model // cfg.heads, cfg.rope_base
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.o_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = ((proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2))
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        inv_freq = 1.0 / self.base ** (torch.arange(0, self.head_dim, 2, device=x.device).float() / self.head_dim)
        angles = torch.outer(torch.arange(t, device=x.device).float(), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        y = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, d))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.hidden, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.hidden, bias=False)
        self.down_proj = nn.Linear(cfg.hidden, cfg.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.d_model, cfg.eps)
        self.attn = LlamaAttention(cfg)
        self.post_attn_norm = RMSNorm(cfg.d_model, cfg.eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.input_norm(x))
        return x + self.mlp(self.post_attn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.d_model, cfg.eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


def build_llama(cfg: LlamaConfig, batch: int):
    """The zoo's builder: the model, next-token inputs and a cross-entropy loss."""
    model = Llama(cfg)
    idx = torch.randint(0, cfg.vocab, (batch, cfg.seq))
    targets = torch.roll(idx, -1, dims=1)

    def loss_fn(logits: Tensor) -> Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))

    return model, (idx,), {}, loss_fn, frozenset()
