"""The attention backend interface: the batch layout every backend builds its metadata from,
the metadata builder, and the CUDA-graph support level each backend declares (the graph plan
resolves from it)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from kiln.config.graph_plan import GraphSupport


@dataclass(frozen=True)
class AttentionShape:
    """The model's attention heads, which a backend may size its workspaces by."""

    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass
class StateBuffers:
    """The state metadata's whole persistent buffers: query starts (max_seqs + 2 entries, the
    padded token count past the requests), then max_seqs entries each, whose state slots past the
    batch are -1. What a launch reads whose grid depends on the token count only (the Triton
    Gated DeltaNet core), so that a graph captured once serves any batch of its size."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    state_slots: torch.Tensor
    checkpoint_at: torch.Tensor
    checkpoint_entries: torch.Tensor
    position_states: torch.Tensor


@dataclass
class BatchLayout:
    """One step's batch as the model runner lays it out: the one description every backend
    builds its own metadata from. Requests are ordered decodes first (query length 1), then
    prefill chunks. Token rows in [num_actual_tokens, num_tokens) are padding up to a graph's
    size: they write no KV slot and see no key. Each tensor is the head of a persistent,
    contiguous buffer, or (the `_buffer` fields) the whole buffer, which a graph reads at a
    fixed address whatever the batch."""

    positions: torch.Tensor  # [T] int64 (0 for padding)
    slot_mapping: torch.Tensor  # [T] int64, KV slot of each token (-1 for padding)
    query_start_loc: torch.Tensor  # [B + 1] int32, offsets of each request's tokens
    seq_lens: torch.Tensor  # [B] int32, KV length of each request after this step
    block_tables: torch.Tensor  # [B, W] int32, a view of block_tables_buffer
    state_slots: torch.Tensor  # [B] int32, each request's state slot (hybrid models; else -1)
    # [B] int32: after how many of its tokens a request's state is saved, and into which
    # checkpoint (hybrid prefix caching; -1: not this step)
    checkpoint_at: torch.Tensor
    checkpoint_entries: torch.Tensor
    # [B] int32: where a request keeps its state after each of its tokens but the last (the
    # first of those state rows; -1: it does not): a hybrid verifying drafts, whose state
    # after the last accepted one is taken back
    position_states: torch.Tensor
    num_actual_tokens: int
    num_decodes: int
    max_seq_len: int
    block_size: int
    # [max_seqs + 2]: the requests' offsets, then T in every later entry, so that padding rows
    # form one last sequence
    query_start_loc_buffer: torch.Tensor
    block_tables_buffer: torch.Tensor  # [max_seqs * max_blocks_per_seq], rows of width W
    state_buffers: StateBuffers | None = None

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]


@dataclass
class StateMetadata:
    """What layers with a state per sequence (Gated DeltaNet) read of a step: each request's
    rows of the flat batch, its KV length after the step (equal to its row count: its first
    chunk, from an empty state), its state slot and where its state is checkpointed. Views of
    the runner's persistent buffers."""

    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    state_slots: torch.Tensor  # [B] int32
    checkpoint_at: torch.Tensor  # [B] int32, see BatchLayout
    checkpoint_entries: torch.Tensor  # [B] int32
    position_states: torch.Tensor  # [B] int32, see BatchLayout
    buffers: StateBuffers | None = None  # the same, whole (fixed sizes)

    @classmethod
    def of(cls, layout: BatchLayout) -> StateMetadata:
        return cls(layout.query_start_loc, layout.seq_lens, layout.state_slots,
                   layout.checkpoint_at, layout.checkpoint_entries, layout.position_states,
                   layout.state_buffers)  # fmt: skip

    def dynamic_tensors(self) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
        return [(t, (0,)) for t in vars(self).values() if isinstance(t, torch.Tensor)]


class AttentionMetadata:
    """A backend's metadata for one step, built once and read by every attention layer. The
    model passes it through untouched; Dynamo traces it as an input of the compiled forward.
    For a hybrid model the runner adds `state`, which its Gated DeltaNet layers read; for an
    MTP head, `mtp_hidden`."""

    state: StateMetadata | None = None
    # an MTP head's input beside each token: the hidden state of the token before it
    mtp_hidden: torch.Tensor | None = None

    # field name -> the dimensions that change from step to step (marked dynamic for Dynamo,
    # so one compilation serves every batch)
    dynamic_dims: ClassVar[dict[str, tuple[int, ...]]] = {}

    def dynamic_tensors(self) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
        own = [(getattr(self, name), dims) for name, dims in self.dynamic_dims.items()]
        if self.mtp_hidden is not None:
            own.append((self.mtp_hidden, (0,)))
        return own + (self.state.dynamic_tensors() if self.state is not None else [])


class MetadataBuilder(ABC):
    """Turns a BatchLayout into a backend's metadata, once per step. Whatever a captured graph
    reads lives in persistent buffers the builder allocates once, before any capture."""

    @abstractmethod
    def build(self, layout: BatchLayout) -> AttentionMetadata: ...


class AttentionBackend(ABC):
    name: str
    graph_support: GraphSupport
    splitting_ops: tuple[str, ...] = ()  # the registered ops a compiled graph splits at
    # The Gated DeltaNet core that runs beside it in a hybrid model: "torch" (a loop over the
    # requests on the host, never inside a graph) or "triton" (two launches whose grid depends
    # on the token count only, so any graph captures them)
    state_core: str = "torch"
    # Speculative verification lays each position out as a decode row of its own, where the
    # backend writes a step's keys before it reads any: the kernels of a decode step, so a
    # verified position gets the logits a decode step would (the CPU backends). False: one
    # row of 1 + k tokens per sequence, for a kernel that writes and reads in one launch.
    drafts_as_decode_rows: bool = False

    def describe(self) -> str:
        """The backend as `kiln info` and /v1/engine show it: its name, and which kernels it
        took where that depends on the machine."""
        return self.name

    @abstractmethod
    def metadata_builder(self, max_num_tokens: int, device: torch.device) -> MetadataBuilder:
        """The builder for a runner whose steps hold at most `max_num_tokens` tokens."""

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
        Writes k/v into the cache at the metadata's slot mapping and the attention output into
        `out` [T, H * D], which the caller allocates: inside a compiled piece, so a PIECEWISE
        graph owns it and the next piece reads it where the op wrote it (nothing to copy)."""
