"""Paged attention in Triton: one kernel, one launch per layer, for prefill chunks, decodes and
mixed batches, that a FULL CUDA graph can capture.

A program takes up to BLOCK_Q consecutive tokens of one sequence and the GROUP query heads
that share one KV head: BLOCK_M = BLOCK_Q * GROUP rows of tensor-core dots against tiles of
KEY_TILE keys, so a prefill chunk reads its keys once per query block, not once per token and
head, and a decode reads its keys once per KV head. Keys before this step's chunk come from
the paged cache; the chunk's own come straight from k and v, which the same program then
writes into the cache. No program reads a slot this launch writes (the prefix cache shares
only blocks computed in earlier steps), so the write needs no second kernel to order it, and
PIECEWISE graphs run one eager launch between pieces instead of two.

Programs find their sequence by a binary search of the persistent query-start buffer, whose
entries past the last request hold the padded token count: the launch grid depends on the
token count only, no host value is read, and the padding rows form one last sequence that
sees no key, writes no slot and outputs zeros.
Runs under TRITON_INTERPRET=1 on the CPU, which is how the tests check it without a GPU."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from kiln.attention.backend import AttentionBackend, AttentionMetadata, GraphSupport

_LIB = torch.library.Library("kiln", "FRAGMENT")
_LIB.define(
    "triton_paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, "
    "Tensor(b!) v_cache, Tensor(c!) out, Tensor slot_mapping, Tensor token_kv_lens, "
    "Tensor token_table_offsets, Tensor block_tables_flat, Tensor query_start_loc, "
    "float scale) -> ()"
)
KEY_TILE = 32  # keys per step of the online softmax
_TRITON_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _find_sequence(qsl_ptr, q_block, n_slots, BLOCK_Q: tl.constexpr):
    """The last sequence whose first query block is at or before `q_block` (sequence i's
    blocks start at qsl[i] // BLOCK_Q + i, so each sequence's blocks are its own)."""
    lo = q_block * 0  # a tensor, not the constant 0 Triton makes of an int argument of 1
    hi = lo + n_slots
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(start <= q_block, mid + 1, lo)
        hi = tl.where(start <= q_block, hi, mid)
    return lo - 1


@triton.jit
def _attend_tile(
    q, k_ptr, v_ptr, key_offsets, kmask, pos, n_keys, d, dmask, scale, m_i, l_i, acc,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One tile of keys (at k_ptr / v_ptr + key_offsets, at positions `pos`) into the query
    rows' online softmax; a row sees the keys before its own n_keys."""
    tmask = kmask[:, None] & dmask[None, :]
    tile = key_offsets[:, None] + d[None, :]
    keys = tl.load(k_ptr + tile, mask=tmask, other=0.0).to(DOT_DTYPE)
    scores = tl.dot(q, tl.trans(keys), input_precision=PRECISION) * scale
    visible = kmask[None, :] & (pos[None, :] < n_keys[:, None])
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    # rows that have seen no key yet keep m = -inf; shifting by 0 keeps their p at 0, not NaN
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(scores - shift[:, None])
    alpha = tl.exp(m_i - shift)
    values = tl.load(v_ptr + tile, mask=tmask, other=0.0).to(DOT_DTYPE)
    pv = tl.dot(p.to(DOT_DTYPE), values, input_precision=PRECISION)
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + pv


@triton.jit
def _write_kv(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, rows, row_ok, first_head, hkv, d, dmask,
    stride_kt, stride_kh, stride_slot, stride_ch,
):  # fmt: skip
    """The block's tokens into the cache at their slots, once each (the rows of the group's
    first head); padding rows (slot -1) write nothing."""
    slots = tl.load(slot_ptr + rows, mask=row_ok, other=-1)
    mask = (row_ok & first_head & (slots >= 0))[:, None] & dmask[None, :]
    src = rows[:, None] * stride_kt + hkv * stride_kh + d[None, :]
    dst = slots[:, None] * stride_slot + hkv * stride_ch + d[None, :]
    tl.store(k_cache_ptr + dst, tl.load(k_ptr + src, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(v_ptr + src, mask=mask), mask=mask)


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    slot_ptr,
    kv_len_ptr,
    table_offset_ptr,
    tables_ptr,
    qsl_ptr,
    n_slots,
    scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_ot,
    stride_block,
    stride_slot,
    stride_ch,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    q_block = tl.program_id(0)
    hkv = tl.program_id(1)
    seq = _find_sequence(qsl_ptr, q_block, n_slots, BLOCK_Q)
    seq_start = tl.load(qsl_ptr + seq)
    seq_end = tl.load(qsl_ptr + seq + 1)
    row0 = seq_start + (q_block - seq_start // BLOCK_Q - seq) * BLOCK_Q
    # BLOCK_M rows: BLOCK_Q tokens times the GROUP query heads that share this KV head
    m = tl.arange(0, BLOCK_M)
    rows = row0 + m // GROUP
    heads = hkv * GROUP + m % GROUP
    row_ok = (m < BLOCK_Q * GROUP) & (rows < seq_end)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q_tile = rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_tile, mask=row_ok[:, None] & dmask[None, :], other=0.0).to(DOT_DTYPE)
    n_keys = tl.load(kv_len_ptr + rows, mask=row_ok, other=0)  # 0 for padding rows
    # keys before this step's chunk are in the cache; the chunk's own come from k and v, so
    # nothing here reads a slot this launch writes (and the write below needs no ordering)
    # a sequence's last query block can lie past its end (its blocks are counted from block
    # boundaries): that program has no rows and must not walk the keys for nothing
    has_rows = row0 < seq_end
    first_kv_len = tl.load(kv_len_ptr + seq_start, mask=has_rows, other=0)
    context = tl.maximum(first_kv_len - 1, 0)
    table = tl.load(table_offset_ptr + seq_start, mask=has_rows, other=0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    # while loops: the trip counts are data (scf.while on the GPU; the CPU interpreter cannot
    # take a loaded scalar as a range bound)
    j = context * 0
    while j < context:
        pos = j + n
        kmask = pos < context
        block = tl.load(tables_ptr + table + pos // BLOCK_SIZE, mask=kmask, other=0).to(tl.int64)
        slot = block * stride_block + (pos % BLOCK_SIZE) * stride_slot + hkv * stride_ch
        m_i, l_i, acc = _attend_tile(
            q, k_cache_ptr, v_cache_ptr, slot, kmask, pos, n_keys, d, dmask, scale, m_i, l_i,
            acc, DOT_DTYPE, PRECISION,
        )  # fmt: skip
        j += BLOCK_N
    # causal: the block's last row sees the chunk up to itself
    # (the padding rows' sequence sees no key: it reads none of their k and v)
    chunk_end = tl.where(first_kv_len > 0, tl.minimum(seq_end, row0 + BLOCK_Q), seq_start)
    j = seq_start
    while j < chunk_end:
        key_rows = j + n
        m_i, l_i, acc = _attend_tile(
            q, k_ptr, v_ptr, key_rows * stride_kt + hkv * stride_kh, key_rows < chunk_end,
            context + key_rows - seq_start, n_keys, d, dmask, scale, m_i, l_i, acc, DOT_DTYPE,
            PRECISION,
        )  # fmt: skip
        j += BLOCK_N
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # padding rows (0 keys) write zeros
    dst = out_ptr + rows[:, None] * stride_ot + heads[:, None] * D + d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dmask[None, :])
    _write_kv(
        k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, rows, row_ok, m % GROUP == 0, hkv, d,
        dmask, stride_kt, stride_kh, stride_slot, stride_ch,
    )  # fmt: skip


# The CPU interpreter multiplies bfloat16 dot operands' raw bits (triton-lang/triton#11584, "not
# supported yet"): it gets them in float32, the GPU in their own type. Fixed when triton is
# imported, so decided once, not per call.
_INTERPRETED = isinstance(_paged_attention_kernel, InterpretedFunction)


def launch_shape(
    num_tokens: int, num_heads: int, num_kv_heads: int, num_seq_slots: int
) -> tuple[int, int, tuple[int, int]]:
    """(BLOCK_M, BLOCK_Q, grid): BLOCK_M rows per program, BLOCK_Q tokens of one sequence times
    the query heads of one KV head (at least 16 rows, what a tensor-core dot needs). The grid
    depends on the token count and the number of sequence slots only, never on the batch."""
    group = num_heads // num_kv_heads
    block_m = 16 if group <= 16 else triton.next_power_of_2(group)
    block_q = block_m // group
    # sequence i's query blocks start at qsl[i] // block_q + i, the end of them all at this
    return block_m, block_q, (num_tokens // block_q + num_seq_slots, num_kv_heads)


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
    scale: float,
) -> None:
    """q: [T, H, D], k/v: [T, Hkv, D] contiguous; caches [num_blocks, block_size, Hkv, D].
    Writes k/v into the cache at `slot_mapping` and the attention output into `out`
    [T, H * D] (zeros for padding rows). `query_start_loc` is the whole persistent buffer
    (max_seqs + 2 entries): the requests' offsets, then T in every entry past the last one,
    so that rows past the requests' tokens form one more sequence, of padding."""
    t, h, d = q.shape
    if t == 0:
        return
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    num_seq_slots = min(t, query_start_loc.numel() - 2) + 1  # the requests, then padding
    block_m, block_q, grid = launch_shape(t, h, hkv, num_seq_slots)
    dot_dtype = tl.float32 if _INTERPRETED else _TRITON_DTYPES[q.dtype]
    _paged_attention_kernel[grid](
        q, k, v, k_cache, v_cache, out, slot_mapping, token_kv_lens, token_table_offsets,
        block_tables_flat, query_start_loc, num_seq_slots, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), out.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=h // hkv, D=d, BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_SIZE=block_size,
        BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=KEY_TILE,
        DOT_DTYPE=dot_dtype, PRECISION="ieee" if dot_dtype == tl.float32 else "tf32",
    )  # fmt: skip


def _fake(q, k, v, k_cache, v_cache, out, slots, lens, offsets, tables, starts, scale) -> None:
    return None


_LIB.impl("triton_paged_attention", triton_paged_attention, "CompositeExplicitAutograd")
torch.library.register_fake("kiln::triton_paged_attention", _fake, lib=_LIB)


class TritonPagedAttentionBackend(AttentionBackend):
    """Capturable in FULL graphs for any batch: its launch depends on the token count only."""

    name = "triton_paged"
    graph_support = GraphSupport.ALWAYS
    splitting_ops = ("kiln::triton_paged_attention",)

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
            meta.block_tables_flat,
            meta.query_start_loc_padded,
            scale,
        )
