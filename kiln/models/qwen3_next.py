"""Qwen3-Next (`Qwen3NextForCausalLM`) and the Qwen3.5 text models (`Qwen3_5ForCausalLM`,
`Qwen3_5MoeForCausalLM`): hybrids of Gated DeltaNet layers and gated attention layers, as the
config's `layer_types` lays them out, with dense MLPs or experts behind a shared expert. Their
norms are zero-centred (x * (1 + w)); their attention has a sigmoid output gate (q_proj twice as
wide, a gate beside each query head) and rotates only the first `partial_rotary_factor` of each
head. Qwen3.5's mRoPE is RoPE for text: its three rows of positions are equal then."""

from __future__ import annotations

import torch
from torch import nn

from kiln.attention import Attention, AttentionBackend, AttentionMetadata
from kiln.layers.gated_deltanet import GatedDeltaNet
from kiln.layers.linear import Linear
from kiln.layers.norm import ZeroCentredRMSNorm
from kiln.layers.packed import QuantizedTensor
from kiln.layers.rotary import apply_partial_rotary
from kiln.models.config import ModelConfig
from kiln.models.decoder import DecoderLM, mlp_for

Rope = tuple[torch.Tensor, torch.Tensor]


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.sizes = [2 * h * d, hkv * d, hkv * d]  # the loader fills q_proj, k_proj, v_proj
        self.qkv_proj = Linear(cfg.hidden_size, sum(self.sizes), bias=cfg.attention_bias)
        self.o_proj = Linear(h * d, cfg.hidden_size)
        self.q_norm = ZeroCentredRMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(d, cfg.rms_norm_eps)
        self.attn = Attention(h, hkv, d, backend)

    def forward(self, x: torch.Tensor, rope: Rope, meta: AttentionMetadata) -> torch.Tensor:
        a, tokens = self.attn, x.shape[0]
        q_gate, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q, gate = q_gate.view(tokens, a.num_heads, 2 * a.head_dim).chunk(2, dim=-1)
        q = apply_partial_rotary(self.q_norm(q), *rope)
        k = apply_partial_rotary(self.k_norm(k.view(tokens, a.num_kv_heads, a.head_dim)), *rope)
        out = a(q, k, v.reshape(tokens, a.num_kv_heads, a.head_dim), meta)
        # explicit sizes, never -1 beside the token count: Dynamo traces it as an unbacked size
        return self.o_proj(out * torch.sigmoid(gate.reshape(tokens, a.num_heads * a.head_dim)))


class HybridLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, index: int) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, eps)
        if cfg.layer_types[index] == "linear_attention":
            la = cfg.linear_attention
            self.linear_attn = GatedDeltaNet(cfg.hidden_size, la.num_key_heads,
                                             la.num_value_heads, la.key_head_dim,
                                             la.value_head_dim, la.conv_kernel, eps,
                                             la.grouped_projections,
                                             backend.state_core)  # fmt: skip
        else:
            self.self_attn = GatedAttention(cfg, backend)
        self.mlp = mlp_for(cfg, index)

    def forward(self, x: torch.Tensor, rope: Rope, meta: AttentionMetadata) -> torch.Tensor:
        h = self.input_layernorm(x)
        if hasattr(self, "linear_attn"):
            h = self.linear_attn(h, meta.state)
        else:
            h = self.self_attn(h, rope, meta)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class HybridCausalLM(DecoderLM):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        norm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        rotary_dim = int(cfg.head_dim * cfg.partial_rotary_factor)
        super().__init__(cfg, lambda i: HybridLayer(cfg, backend, i), norm, rotary_dim)
        # the checkpoint's multi-token-prediction head (mtp.*), kept as loaded: its proposer
        # is speculative decoding's; transformers drops these tensors
        self.mtp_weights: dict[str, torch.Tensor | QuantizedTensor] = {}
