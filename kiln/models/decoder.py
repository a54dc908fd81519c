"""What every decoder-only model here shares: the token embedding, a stack of layers run over
the flat batch with one RoPE table, the final norm, the LM head (or the tied embedding), the
post-load weight layout, and which layers own a KV cache or a state. An architecture gives its
layers and its norm."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kiln.attention import Attention, AttentionMetadata
from kiln.layers.embedding import VocabEmbedding
from kiln.layers.gated_deltanet import GatedDeltaNet
from kiln.layers.linear import Linear
from kiln.layers.mlp import SwiGLU
from kiln.layers.moe import FusedExperts, SparseMoE
from kiln.layers.rotary import RotaryEmbedding
from kiln.models.config import ModelConfig


def mlp_for(cfg: ModelConfig, index: int) -> nn.Module:
    """Layer `index`'s MLP: the experts in a sparse layer, the dense SwiGLU elsewhere."""
    if index not in cfg.sparse_layers:
        return SwiGLU(cfg.hidden_size, cfg.intermediate_size)
    m = cfg.moe
    return SparseMoE(cfg.hidden_size, m.num_experts, m.top_k, m.intermediate_size,
                     m.norm_topk_prob, m.shared_intermediate_size)  # fmt: skip


class DecoderLM(nn.Module):
    """`forward` returns the final hidden states of every token; `compute_logits` projects only
    the rows the sampler needs, which saves most of the LM-head cost during prefill."""

    def __init__(
        self, cfg: ModelConfig, layer: Callable[[int], nn.Module], norm: nn.Module,
        rotary_dim: int,
    ) -> None:  # fmt: skip
        super().__init__()
        self.config = cfg
        self.rotary = RotaryEmbedding(
            rotary_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer(i) for i in range(cfg.num_layers))
        self.norm = norm
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
            if isinstance(module, (Linear, FusedExperts)):
                module.finalize(device)
        self.embed_tokens.finalize(device, used_as_lm_head=self.lm_head is None)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers if hasattr(layer, "self_attn")]

    def linear_layers(self) -> list[GatedDeltaNet]:
        """The layers with a state per sequence (Gated DeltaNet), in order."""
        return [layer.linear_attn for layer in self.layers if hasattr(layer, "linear_attn")]
