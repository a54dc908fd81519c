"""Llama, Qwen2, Qwen3 and Qwen3-MoE decoder-only models, written with kiln's own layers.

They differ only in details: Qwen2 has q/k/v biases, Qwen3 normalizes q and k per head before
RoPE, Qwen3-MoE replaces the MLP of its sparse layers by a mixture of experts. q/k/v and gate/up
are fused into one matmul each, which the loader fills by rows.
"""

from __future__ import annotations

import torch
from torch import nn

from kiln.attention import Attention, AttentionBackend, AttentionMetadata
from kiln.layers.embedding import VocabEmbedding
from kiln.layers.linear import Linear
from kiln.layers.mlp import SwiGLU
from kiln.layers.moe import SparseMoE
from kiln.layers.norm import RMSNorm
from kiln.layers.rotary import RotaryEmbedding, apply_rotary
from kiln.models.config import ModelConfig

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
        if index in cfg.sparse_layers:
            m = cfg.moe
            self.mlp: nn.Module = SparseMoE(cfg.hidden_size, m.num_experts, m.top_k,
                                            m.intermediate_size, m.norm_topk_prob,
                                            m.shared_intermediate_size)  # fmt: skip
        else:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, rope: Rope, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    """`forward` returns the final hidden states of every token; `compute_logits` projects only
    the rows the sampler needs, which saves most of the LM-head cost during prefill."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = cfg
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.rotary.cos_sin(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, rope, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return self.embed_tokens.as_lm_head(hidden).float()
        return self.lm_head(hidden).float()

    def finalize(self, device: torch.device) -> None:
        """Post-load weight layout (see Linear.finalize)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.finalize(device)
        self.embed_tokens.finalize(device, used_as_lm_head=self.lm_head is None)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers]

    def linear_layers(self) -> list[nn.Module]:
        return []  # no layer with a state per sequence
