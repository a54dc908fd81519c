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
from kiln.layers.embedding import VocabEmbedding
from kiln.layers.gated_deltanet import GatedDeltaNet
from kiln.layers.linear import Linear
from kiln.layers.mlp import SwiGLU
from kiln.layers.moe import SparseMoE
from kiln.layers.norm import ZeroCentredRMSNorm
from kiln.layers.rotary import RotaryEmbedding, apply_partial_rotary
from kiln.models.config import ModelConfig

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
                                             la.grouped_projections)  # fmt: skip
        else:
            self.self_attn = GatedAttention(cfg, backend)
        if index in cfg.sparse_layers:
            m = cfg.moe
            self.mlp: nn.Module = SparseMoE(cfg.hidden_size, m.num_experts, m.top_k,
                                            m.intermediate_size, m.norm_topk_prob,
                                            m.shared_intermediate_size)  # fmt: skip
        else:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, rope: Rope, meta: AttentionMetadata) -> torch.Tensor:
        h = self.input_layernorm(x)
        if hasattr(self, "linear_attn"):
            h = self.linear_attn(h, meta.state)
        else:
            h = self.self_attn(h, rope, meta)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class HybridCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = cfg
        rotary_dim = int(cfg.head_dim * cfg.partial_rotary_factor)
        self.rotary = RotaryEmbedding(
            rotary_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(HybridLayer(cfg, backend, i) for i in range(cfg.num_layers))
        self.norm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size)
        # the checkpoint's multi-token-prediction head (mtp.*), kept as loaded: its proposer
        # is speculative decoding's; transformers drops these tensors
        self.mtp_weights: dict[str, torch.Tensor] = {}

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
        for module in self.modules():
            if isinstance(module, Linear):
                module.finalize(device)
        self.embed_tokens.finalize(device, used_as_lm_head=self.lm_head is None)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers if hasattr(layer, "self_attn")]

    def linear_layers(self) -> list[GatedDeltaNet]:
        """The layers with a state per sequence, in order: one pair of state tensors each."""
        return [layer.linear_attn for layer in self.layers if hasattr(layer, "linear_attn")]
