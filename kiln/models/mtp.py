"""The multi-token-prediction head of Qwen3-Next and Qwen3.5 checkpoints (`mtp.*`), as a model
the runner can run: the token embedding and the target's hidden state of the token before it,
each normalised, concatenated ([embedding, hidden]) and projected back to the hidden size
(`fc`), one gated-attention decoder layer with its own KV cache, and a final norm. It shares
the target's embedding, LM head and RoPE table (they are not its parameters).

Position p of the head reads token p + 1 and the hidden state the target computed at p, and
predicts token p + 2. The hidden state comes in through the step's metadata
(`meta.mtp_hidden`, a view of a persistent buffer of the runner), so a captured graph reads it
where it was written."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from kiln.attention import Attention, AttentionBackend, AttentionMetadata
from kiln.errors import ConfigError
from kiln.layers.gated_deltanet import GatedDeltaNet
from kiln.layers.linear import Linear
from kiln.layers.moe import FusedExperts
from kiln.layers.norm import ZeroCentredRMSNorm
from kiln.models.config import ModelConfig
from kiln.models.decoder import DecoderLM
from kiln.models.qwen3_next import HybridLayer


def mtp_config(target: ModelConfig, tensor_names: set[str]) -> ModelConfig:
    """The head's own config: one full-attention layer, with experts where the checkpoint's
    MTP layer has a router."""
    layers = {n.split(".")[2] for n in tensor_names if n.startswith("mtp.layers.")}
    if layers != {"0"}:
        raise ConfigError(
            f"the checkpoint's MTP head has {len(layers)} decoder layers (mtp.layers.*); "
            'kiln runs heads of one layer, as Qwen3-Next and Qwen3.5 ship them. Use "ngram" '
            'or "draft_model"'
        )
    sparse = "mtp.layers.0.mlp.gate.weight" in tensor_names
    if sparse and target.moe is None:
        raise ConfigError("the checkpoint's MTP layer has experts, but the model has no MoE config")
    return replace(target, num_layers=1, layer_types=("full_attention",),
                   sparse_layers=(0,) if sparse else ())  # fmt: skip


class MTPHead(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, target: DecoderLM) -> None:
        """`cfg`: from `mtp_config`; `target`: the model whose embedding, LM head and RoPE
        table the head uses."""
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.config = cfg
        self.fc = Linear(2 * h, h)
        self.pre_fc_norm_embedding = ZeroCentredRMSNorm(h, eps)
        self.pre_fc_norm_hidden = ZeroCentredRMSNorm(h, eps)
        self.layers = nn.ModuleList([HybridLayer(cfg, backend, 0)])
        self.norm = ZeroCentredRMSNorm(h, eps)
        # a tuple, not a submodule: the target's weights are loaded, finalized and counted once
        self._target = (target,)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The head's final (normalised) hidden state of every token: what its logits come
        from, and the hidden state its next chained step reads."""
        target = self._target[0]
        embedded = self.pre_fc_norm_embedding(target.embed_tokens(input_ids))
        hidden = self.pre_fc_norm_hidden(meta.mtp_hidden)
        x = self.fc(torch.cat([embedded, hidden], dim=-1))
        rope = target.rotary.cos_sin(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, rope, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._target[0].compute_logits(hidden)

    def finalize(self, device: torch.device) -> None:
        for module in self.modules():
            if isinstance(module, (Linear, FusedExperts)):
                module.finalize(device)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers]

    def linear_layers(self) -> list[GatedDeltaNet]:
        return []

    @property
    def hidden_input_size(self) -> int:
        """The width of `meta.mtp_hidden`: the runner allocates its buffer."""
        return self.config.hidden_size
