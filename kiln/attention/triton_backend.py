"""The Triton attention backend: the `kiln::triton_paged_attention` op, its launch shape (the
grid and the split-KV segments, from the token count only) and the segment workspace, which
the backend allocates once per device before any graph is captured. The kernel is in
triton_kernel.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from kiln.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    AttentionShape,
    BatchLayout,
    GraphSupport,
    MetadataBuilder,
)
from kiln.attention.torch_backend import stored_as
from kiln.attention.triton_kernel import paged_attention_kernel
from kiln.layers import gdn_triton  # noqa: F401 - registers the Gated DeltaNet core beside it

_LIB = torch.library.Library("kiln", "FRAGMENT")
_LIB.define(
    "triton_paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, "
    "Tensor(b!) v_cache, Tensor(c!) out, Tensor slot_mapping, Tensor token_kv_lens, "
    "Tensor token_table_offsets, Tensor block_tables_flat, Tensor query_start_loc, "
    "Tensor(d!) segment_scratch, Tensor(e!) segment_tickets, int split_programs, float scale"
    ") -> ()"
)
KEY_TILE = 32  # keys per step of the online softmax
# Split-KV: a launch of few programs (small batches) splits each program's keys into up to
# MAX_SEGMENTS segments, for about two programs per SM in all (`split_programs`): a b=1 decode
# of Qwen3-0.6B would otherwise run 8 programs (one per KV head) on an H200's 132 SMs.
MAX_SEGMENTS = 16
# ... cut every MIN_SEGMENT_KEYS keys or more: a context of up to that many stays in one
# segment, which writes the output without a merge (vLLM's PagedAttention v2 splits by 512
# tokens, its Triton kernel by a tile; the merge's round trip through L2 decides, on the GPU)
MIN_SEGMENT_KEYS = 128
_TRITON_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


# The CPU interpreter multiplies bfloat16 dot operands' raw bits (triton-lang/triton#11584, "not
# supported yet"): it gets them in float32, the GPU in their own type. Fixed when triton is
# imported, so decided once, not per call.
INTERPRETED = isinstance(paged_attention_kernel, InterpretedFunction)


@dataclass(frozen=True)
class LaunchShape:
    """BLOCK_M rows per program: BLOCK_Q tokens of one sequence times the query heads of one KV
    head. `programs` (query blocks, KV heads) depends on the token count and the number of
    sequence slots only, never on the batch; each program's keys split into `segments`."""

    block_m: int
    block_q: int
    programs: tuple[int, int]
    segments: int

    @property
    def grid(self) -> tuple[int, int, int]:
        return (*self.programs, self.segments)


def launch_shape(
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    num_seq_slots: int,
    split_programs: int = 1,
    segments: int | None = None,
) -> LaunchShape:
    """At least 16 rows per program (what a tensor-core dot needs). `segments`: by default as
    many (a power of two, at most MAX_SEGMENTS) as keep the launch within `split_programs`."""
    group = num_heads // num_kv_heads
    block_m = 16 if group <= 16 else _next_power_of_2(group)
    block_q = block_m // group
    # sequence i's query blocks start at qsl[i] // block_q + i, the end of them all at this
    programs = (num_tokens // block_q + num_seq_slots, num_kv_heads)
    if segments is None:
        segments = 1
        while (
            segments < MAX_SEGMENTS and 2 * segments * programs[0] * programs[1] <= split_programs
        ):
            segments *= 2
    return LaunchShape(block_m, block_q, programs, segments)


def seq_slots(num_tokens: int, query_start_loc: torch.Tensor) -> int:
    """Sequence slots a launch searches: the requests (at most one per token), then padding."""
    return min(num_tokens, query_start_loc.numel() - 2) + 1


def _block_d(head_dim: int) -> int:
    return max(16, _next_power_of_2(head_dim))


def _next_power_of_2(n: int) -> int:
    # triton.next_power_of_2 takes 2.4 us here, on every eager attention call of a PIECEWISE step
    return 1 << (n - 1).bit_length()


def split_programs_for(device: torch.device) -> int:
    """How many programs a split launch aims at: two per SM on a GPU. 1 (never split) in
    Triton's CPU interpreter, which runs the programs one after another: a split would only
    add work there (the tests force splits explicitly)."""
    if device.type != "cuda":
        return 1
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def segment_workspace(
    num_heads: int, num_kv_heads: int, head_dim: int, split_programs: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scratch, tickets) for every launch of these heads within `split_programs`: the
    segments' softmax states (float32) and one ticket per program, zeros (each merge resets
    its own)."""
    block_m = launch_shape(1, num_heads, num_kv_heads, 1).block_m
    per_segment = block_m * (_block_d(head_dim) + 2)
    size = max(split_programs, 2)
    scratch = torch.empty(size * per_segment, dtype=torch.float32, device=device)
    return scratch, torch.zeros(size // 2, dtype=torch.int32, device=device)


def triton_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    slot_mapping: torch.Tensor,
    token_kv_lens: torch.Tensor,
    token_table_offsets: torch.Tensor,
    block_tables_flat: torch.Tensor,
    query_start_loc: torch.Tensor,
    segment_scratch: torch.Tensor,
    segment_tickets: torch.Tensor,
    split_programs: int,
    scale: float,
    segments: int | None = None,
) -> None:
    """q: [T, H, D], k/v: [T, Hkv, D] contiguous; caches [num_blocks, block_size, Hkv, D].
    Writes k/v into the cache at `slot_mapping` and the attention output into `out`
    [T, H * D] (zeros for padding rows). `query_start_loc` is the whole persistent buffer
    (max_seqs + 2 entries): the requests' offsets, then T in every entry past the last one,
    so that rows past the requests' tokens form one more sequence, of padding. Small launches
    split the keys into segments, up to `split_programs` programs, in `segment_workspace`'s
    scratch; `segments` overrides the split (tests)."""
    t, h, d = q.shape
    if t == 0:
        return
    k, v = stored_as(k, v, k_cache.dtype)  # the chunk's own keys as the cache keeps them
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    num_seq_slots = seq_slots(t, query_start_loc)
    shape = launch_shape(t, h, hkv, num_seq_slots, split_programs, segments)
    block_d = _block_d(d)
    if shape.segments > 1:
        _check_workspace(shape, block_d, segment_scratch, segment_tickets)
    dot_dtype = tl.float32 if INTERPRETED else _TRITON_DTYPES[q.dtype]
    paged_attention_kernel[shape.grid](
        q, k, v, k_cache, v_cache, out, slot_mapping, token_kv_lens, token_table_offsets,
        block_tables_flat, query_start_loc, segment_scratch, segment_tickets, num_seq_slots,
        scale, q.stride(0), q.stride(1), k.stride(0), k.stride(1), out.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=h // hkv, D=d, BLOCK_D=block_d, BLOCK_SIZE=block_size, BLOCK_Q=shape.block_q,
        BLOCK_M=shape.block_m, BLOCK_N=KEY_TILE, NUM_SEGMENTS=shape.segments,
        SEGMENT_TILES=MIN_SEGMENT_KEYS // KEY_TILE,
        DOT_DTYPE=dot_dtype, PRECISION="ieee" if dot_dtype == tl.float32 else "tf32",
    )  # fmt: skip


def _check_workspace(
    shape: LaunchShape, block_d: int, scratch: torch.Tensor, tickets: torch.Tensor
) -> None:
    programs = shape.programs[0] * shape.programs[1]
    need = programs * shape.segments * shape.block_m * (block_d + 2)
    if scratch.numel() < need or tickets.numel() < programs:
        raise ValueError(
            f"split-KV launch of {programs} programs x {shape.segments} segments needs "
            f"{need} scratch floats and {programs} tickets, got {scratch.numel()} and "
            f"{tickets.numel()}: build them with segment_workspace for these heads"
        )


def _fake(*args) -> None:
    return None


_LIB.impl("triton_paged_attention", triton_paged_attention, "CompositeExplicitAutograd")
torch.library.register_fake("kiln::triton_paged_attention", _fake, lib=_LIB)


@dataclass
class TritonPagedMetadata(AttentionMetadata):
    """Per-token views, so that a launch depends on the token count only and a FULL graph
    replays one token count for any mix of requests: the keys each token sees (position + 1;
    0 for padding) and where its block-table row starts in the flat buffer."""

    slot_mapping: torch.Tensor  # [T] int64
    token_kv_lens: torch.Tensor  # [T] int32
    token_table_offsets: torch.Tensor  # [T] int32
    block_tables_buffer: torch.Tensor  # the runner's whole flat block-table buffer
    query_start_loc_buffer: torch.Tensor  # the runner's whole query-start buffer
    segment_scratch: torch.Tensor  # split-KV softmax states, float32
    segment_tickets: torch.Tensor  # int32, zeros between launches
    split_programs: int  # how many programs a split launch aims at on this device

    dynamic_dims: ClassVar[dict[str, tuple[int, ...]]] = {
        "slot_mapping": (0,),
        "token_kv_lens": (0,),
        "token_table_offsets": (0,),
    }


class TritonPagedMetadataBuilder(MetadataBuilder):
    """Owns the per-token buffers and the split-KV workspace: allocated once, before any graph
    is captured (a graph reads them at fixed addresses), the workspace shared by every layer
    (one launch at a time)."""

    def __init__(
        self, shape: AttentionShape, max_num_tokens: int, device: torch.device, split: int
    ) -> None:
        self.token_kv_lens = torch.zeros(max_num_tokens, dtype=torch.int32, device=device)
        self.token_table_offsets = torch.zeros(max_num_tokens, dtype=torch.int32, device=device)
        s = shape
        self.split_programs = split
        self.workspace = segment_workspace(s.num_heads, s.num_kv_heads, s.head_dim, split, device)

    def build(self, layout: BatchLayout) -> TritonPagedMetadata:
        t, n = layout.num_tokens, layout.num_actual_tokens
        kv_lens, offsets = self.token_kv_lens[:t], self.token_table_offsets[:t]
        torch.add(layout.positions[:n], 1, out=kv_lens[:n])
        kv_lens[n:] = 0
        rows = torch.arange(layout.num_reqs, dtype=torch.int32, device=kv_lens.device)
        width = layout.block_tables.shape[1] if layout.num_reqs else 0
        query_lens = layout.query_start_loc.diff()
        offsets[:n] = torch.repeat_interleave(rows * width, query_lens, output_size=n)
        offsets[n:] = 0
        return TritonPagedMetadata(
            slot_mapping=layout.slot_mapping,
            token_kv_lens=kv_lens,
            token_table_offsets=offsets,
            block_tables_buffer=layout.block_tables_buffer,
            query_start_loc_buffer=layout.query_start_loc_buffer,
            segment_scratch=self.workspace[0],
            segment_tickets=self.workspace[1],
            split_programs=self.split_programs,
        )


class TritonPagedAttentionBackend(AttentionBackend):
    """Capturable in FULL graphs for any batch: its launch depends on the token count only."""

    name = "triton_paged"
    graph_support = GraphSupport.ALWAYS
    state_core = "triton"
    splitting_ops = ("kiln::triton_paged_attention",)

    def __init__(self, shape: AttentionShape, split_programs: int | None = None) -> None:
        """`split_programs`: the split-KV launch target; by default the device's
        (`split_programs_for`), which benchmarks and tests override."""
        self.shape = shape
        self.split_programs = split_programs

    def metadata_builder(self, max_num_tokens: int, device: torch.device) -> MetadataBuilder:
        split = self.split_programs or split_programs_for(device)
        return TritonPagedMetadataBuilder(self.shape, max_num_tokens, device, split)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        meta: TritonPagedMetadata,
        scale: float,
    ) -> None:
        torch.ops.kiln.triton_paged_attention(
            q,
            k,
            v,
            k_cache,
            v_cache,
            out,
            meta.slot_mapping,
            meta.token_kv_lens,
            meta.token_table_offsets,
            meta.block_tables_buffer,
            meta.query_start_loc_buffer,
            meta.segment_scratch,
            meta.segment_tickets,
            meta.split_programs,
            scale,
        )
