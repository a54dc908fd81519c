"""The int8 KV cache (`--kv-cache-dtype int8`, CPU backends): each token's key (and value) of
each KV head is stored as head_dim int8 values and, after them, its float32 scale, so a head
row is head_dim + 4 bytes where float32 takes 4 * head_dim and bf16 2 * head_dim: a decode step
reads a quarter of float32's bytes (a bit over half of bf16's), and a budget holds 3.8x the
tokens of float32.

Symmetric, one scale per token and head: x = scale * q, scale = max|x| / 127, q rounded to
nearest, |q| <= 127 (llama.cpp's q8_0 keeps one scale per 32 values; a head row of 64-128 is
one or a few of those). The error of a value is at most scale / 2, 0.4% of the row's largest.

The scale rides in the row itself, not in a tensor beside the cache, so the cache stays one
tensor per layer and per K/V, and everything that hands caches around (graphs, the runner, the
ops' schemas) is unchanged; only what reads or writes values knows the layout."""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # one float32 after each head row's values
LEVELS = 127.0


def is_int8(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.int8


def cache_row_width(head_dim: int, kv_dtype: torch.dtype) -> int:
    """The cache's last dimension for a head of `head_dim`: the scale's bytes after int8 rows."""
    return head_dim + SCALE_BYTES if kv_dtype == torch.int8 else head_dim


def quantize(x: torch.Tensor) -> torch.Tensor:
    """[..., D] float -> [..., D + 4] int8: the rounded values, then the scale's four bytes."""
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True) / LEVELS
    values = torch.round(x / scale.clamp_min(torch.finfo(torch.float32).tiny))
    values = values.clamp(-LEVELS, LEVELS).to(torch.int8)
    return torch.cat([values, scale.view(torch.int8)], -1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D + 4] int8 -> [..., D] in `dtype`: scale * values, in float32 then rounded."""
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)
    return (rows[..., :-SCALE_BYTES].float() * scale).to(dtype)


def read_as(cache_rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows read from a cache, as values in the model's dtype (any cache dtype)."""
    if is_int8(cache_rows):
        return dequantize(cache_rows, dtype)
    return cache_rows.to(dtype)
