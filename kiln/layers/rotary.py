"""Rotary position embedding (rotate-half layout, as HF Llama/Qwen) with the scaling
variants their configs use: default, linear, llama3 and yarn."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kiln.errors import ModelLoadError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(
    dim: int, base: float, s: dict[str, Any], max_pos: int
) -> tuple[torch.Tensor, float]:
    factor = s["factor"]
    orig = s.get("original_max_position_embeddings") or max_pos
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation_weight = 1 - ramp
    inv = (1 / (factor * pos_freqs)) * ramp + (1 / pos_freqs) * extrapolation_weight
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return inv, float(attention_factor)


def rope_inv_freq(
    head_dim: int, base: float, scaling: dict[str, Any] | None, max_pos: int
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin magnitude for a rope config."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv, 1.0
    if rope_type == "linear":
        return inv / scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv, scaling), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, base, scaling, max_pos)
    raise ModelLoadError(
        f"rope_scaling type {rope_type!r} is not supported; kiln supports {SUPPORTED_ROPE_TYPES}"
    )


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, max_pos: int, base: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        inv_freq, magnitude = rope_inv_freq(head_dim, base, scaling, max_pos)
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * magnitude
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        self.head_dim = head_dim

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Once per step: [T, 1, D/2] cos and sin, shared by every layer."""
        cos, sin = self.cos_sin_cache[positions].to(dtype).unsqueeze(1).chunk(2, dim=-1)
        return cos.contiguous(), sin.contiguous()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D] -> a new contiguous tensor."""
    return _rotate(x, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary on the first 2 * cos.shape[-1] dims of each head, the rest passed through (a
    `partial_rotary_factor` below one)."""
    rotated = 2 * cos.shape[-1]
    if rotated == x.shape[-1]:
        return _rotate(x, cos, sin)
    return torch.cat([_rotate(x[..., :rotated], cos, sin), x[..., rotated:]], dim=-1)
