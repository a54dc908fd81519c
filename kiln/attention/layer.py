"""The attention layer models use. The KV cache tensors are bound by the model runner after
the cache is allocated; the backend comes in with the model's construction."""

from __future__ import annotations

import torch
from torch import nn

from kiln.attention.backend import AttentionBackend, AttentionMetadata


class Attention(nn.Module):
    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, backend: AttentionBackend
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.backend = backend
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def bind_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        if self.k_cache is None:
            raise RuntimeError(
                "the KV cache was not bound to this attention layer before a forward"
            )
        # The output is allocated here, before the op: in the compiled piece ahead of the split,
        # so under PIECEWISE graphs it sits in the graph pool at a fixed address that the eager
        # op fills and the next piece's graph reads (a fresh output from the op would have to
        # be copied to the captured address in every layer of every replay).
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        # Contiguous by construction: these cross the split boundary of the compiled mode, where
        # Inductor specializes on the strides it traced, and a strided view fails capture.
        self.backend.forward(
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
            self.k_cache,
            self.v_cache,
            out,
            meta,
            self.scale,
        )
        return out
