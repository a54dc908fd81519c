"""Llama, Qwen2, Qwen3 and Qwen3-MoE decoder-only models, written with kiln's own layers.

They differ only in details: Qwen2 has q/k/v biases, Qwen3 normalizes q and k per head before
RoPE, Qwen3-MoE replaces the MLP of its sparse layers by a mixture of experts. q/k/v and gate/up
are fused into one matmul each, which the loader fills by rows.
"""

from __future__ import annotations

import torch
from torch import nn

from kiln.attention import Attention, AttentionBackend, AttentionMetadata
from kiln.layers.linear import Linear
from kiln.layers.norm import RMSNorm
from kiln.layers.rotary import apply_rotary
from kiln.models.config import ModelConfig
from kiln.models.decoder import DecoderLM, mlp_for

Rope = tuple[torch.Tensor, torch.Tensor]


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend):
        super().__init__()
        h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.sizes = [h * d, hkv * d, hkv * d]
        self.qkv_proj = Linear(cfg.hidden_size, sum(self.sizes), bias=cfg.attention_bias)
        self.o_proj = Linear(h * d, cfg.hidden_size)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.attn = Attention(h, hkv, d, backend)

    def forward(self, x: torch.Tensor, rope: Rope, meta: AttentionMetadata) -> torch.Tensor:
        a = self.attn
        qkv = self.qkv_proj(x)
        qk_size = self.sizes[0] + self.sizes[1]
        qk = qkv[:, :qk_size].view(-1, a.num_heads + a.num_kv_heads, a.head_dim)
        if self.q_norm is not None:
            qk = torch.cat(
                [self.q_norm(qk[:, : a.num_heads]), self.k_norm(qk[:, a.num_heads :])], 1
            )
        # q and k rotate together: one set of ops instead of two
        q, k = apply_rotary(qk, *rope).split([a.num_heads, a.num_kv_heads], dim=1)
        v = qkv[:, qk_size:].reshape(-1, a.num_kv_heads, a.head_dim)
        return self.o_proj(a(q, k, v, meta))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp_for(cfg, index)

    def forward(self, x: torch.Tensor, rope: Rope, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(DecoderLM):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        super().__init__(cfg, lambda i: DecoderLayer(cfg, backend, i), norm, cfg.head_dim)
