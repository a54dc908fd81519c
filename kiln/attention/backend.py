"""The attention backend interface: metadata every backend reads, and the CUDA-graph support
level each backend declares (the graph plan resolves from it)."""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


class GraphSupport(enum.Enum):
    """How much of a step a backend can run inside one captured CUDA graph."""

    ALWAYS = "always"  # any batch, mixed prefill and decode included
    UNIFORM_BATCH = "uniform_batch"  # batches where every request has the same query length
    UNIFORM_SINGLE_TOKEN_DECODE = "uniform_single_token_decode"  # pure 1-token decode only
    NEVER = "never"  # must run eagerly (a splitting op)


@dataclass(frozen=True)
class AttentionShape:
    """The model's attention heads, which a backend may size its workspaces by."""

    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass
class AttentionMetadata:
    """One step's batch layout. Requests are ordered decodes first (query length 1), then
    prefill chunks. Token rows past `num_actual_tokens` are padding: they write no KV slot."""

    slot_mapping: torch.Tensor  # [T] int64, KV slot of each token (-1 for padding)
    query_start_loc: torch.Tensor  # [B + 1] int32, offsets of each request's tokens
    seq_lens: torch.Tensor  # [B] int32, KV length of each request after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32
    num_actual_tokens: int
    num_decodes: int
    max_seq_len: int
    # Per-token views for backends that must not depend on the number of requests (a FULL
    # CUDA graph replays one token count for any mix of requests): keys each token sees
    # (position + 1; 0 for padding) and where its block-table row starts in the flat buffer.
    token_kv_lens: torch.Tensor | None = None  # [T] int32
    token_table_offsets: torch.Tensor | None = None  # [T] int32
    block_tables_flat: torch.Tensor | None = None  # the whole persistent block-table buffer
    # The whole persistent query-start buffer [max_seqs + 2]: the requests' offsets, then the
    # (padded) token count in every later entry, so padding rows form one last sequence.
    query_start_loc_padded: torch.Tensor | None = None


class AttentionBackend(ABC):
    name: str
    graph_support: GraphSupport
    splitting_ops: tuple[str, ...] = ()  # the registered ops a compiled graph splits at

    def build_metadata(self, meta: AttentionMetadata, block_size: int) -> AttentionMetadata:
        """Once per step: add what this backend precomputes for every layer."""
        return meta

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> None:
        """q: [T, H, D], k/v: [T, Hkv, D], caches: [num_blocks, block_size, Hkv, D].
        Writes k/v into the cache at meta.slot_mapping and the attention output into `out`
        [T, H * D], which the caller allocates: inside a compiled piece, so a PIECEWISE graph
        owns it and the next piece reads it where the op wrote it (nothing to copy)."""
