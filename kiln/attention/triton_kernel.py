"""The paged-attention kernel in Triton: one kernel, one launch per layer, for prefill chunks,
decodes and mixed batches, that a FULL CUDA graph can capture (launched by triton_backend).

A program takes up to BLOCK_Q consecutive tokens of one sequence and the GROUP query heads that
share one KV head: BLOCK_M = BLOCK_Q * GROUP rows of tensor-core dots against tiles of BLOCK_N
keys (the backend's KEY_TILE, 32), so a prefill chunk reads its keys once per query block, not
once per token and head, and a decode reads its keys once per KV head. Keys before this step's
chunk come from the paged cache; the chunk's own come straight from k and v, which the same
program then writes into the cache. No program reads a slot this launch writes (the prefix cache
shares only blocks computed in earlier steps), so the write needs no second kernel to order it,
and PIECEWISE graphs run one eager launch between pieces instead of two.

Programs find their sequence by a binary search of the persistent query-start buffer, whose
entries past the last request hold the padded token count: the launch grid depends on the
token count only, no host value is read, and the padding rows form one last sequence that
sees no key, writes no slot and outputs zeros.

Split-KV: a launch of few programs (small batches, where a b=1 decode would run one program per
KV head) splits each program's keys into segments, up to about two programs per SM. Each segment
leaves its softmax state in a scratch buffer and takes a ticket; the one that takes the last
ticket merges them all, in the same launch. The split depends on the token count only, like the
grid, so FULL graphs capture it.

Runs under TRITON_INTERPRET=1 on the CPU (triton >= 3.9), which is how the tests check it
without a GPU."""

from __future__ import annotations

import triton
import triton.language as tl


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
def _segment_keys(
    context, segment, NUM_SEGMENTS: tl.constexpr, SEGMENT_TILES: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The cached keys [lo, hi) of this program's segment (whole key tiles, split evenly, cut
    every SEGMENT_TILES tiles or more) and how many segments have any: at least 1, as segment 0
    also takes the chunk's own keys. The minimum keeps short contexts in one segment, where a
    merge would cost more than the tiles it parallelizes."""
    tiles = tl.cdiv(context, BLOCK_N)
    per = tl.maximum(tl.cdiv(tiles, NUM_SEGMENTS), SEGMENT_TILES)
    lo = segment * per * BLOCK_N
    return lo, tl.minimum(lo + per * BLOCK_N, context), tl.maximum(tl.cdiv(tiles, per), 1)


@triton.jit
def _store_normalized(dst, acc, l_i, mask):
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # rows that saw no key (padding): zeros
    tl.store(dst, out.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _merge_segments(
    scratch_ptr, ticket_ptr, prog, segment, active, m_i, l_i, acc, dst, mask,
    NUM_SEGMENTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Split-KV: this segment's softmax state (acc, then m, then l, per row) into the scratch;
    the segment that takes the last ticket merges every segment's into the output and resets
    the ticket. In the same launch, not a second kernel: the batches that split are the small
    ones, where PIECEWISE graphs pay for every eager launch in host time."""
    r = tl.arange(0, BLOCK_M)
    tile = r[:, None] * BLOCK_D + tl.arange(0, BLOCK_D)[None, :]
    stride = BLOCK_M * (BLOCK_D + 2)
    at = scratch_ptr + (prog * NUM_SEGMENTS + segment) * stride
    tl.store(at + tile, acc)
    tl.store(at + BLOCK_M * BLOCK_D + r, m_i)
    tl.store(at + BLOCK_M * BLOCK_D + BLOCK_M + r, l_i)
    # all of the program's stores before its ticket; acquire-release at GPU scope publishes
    # them to the program that takes the last one (which reads them through L2: .cg)
    tl.debug_barrier()
    ticket = tl.atomic_add(ticket_ptr + prog, 1, sem="acq_rel", scope="gpu")
    if ticket == active - 1:
        m_all = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_all = tl.zeros([BLOCK_M], tl.float32)
        acc_all = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for s in tl.range(0, active, num_stages=1):  # plain loads after the acquire, no prefetch
            at = scratch_ptr + (prog * NUM_SEGMENTS + s) * stride
            m_s = tl.load(at + BLOCK_M * BLOCK_D + r, cache_modifier=".cg")
            m_new = tl.maximum(m_all, m_s)
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows no segment reached
            alpha, beta = tl.exp(m_all - shift), tl.exp(m_s - shift)
            l_s = tl.load(at + BLOCK_M * BLOCK_D + BLOCK_M + r, cache_modifier=".cg")
            l_all = l_all * alpha + l_s * beta
            acc_s = tl.load(at + tile, cache_modifier=".cg")
            acc_all = acc_all * alpha[:, None] + acc_s * beta[:, None]
            m_all = m_new
        _store_normalized(dst, acc_all, l_all, mask)
        tl.store(ticket_ptr + prog, 0)  # for the next launch


@triton.jit
def paged_attention_kernel(
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
    scratch_ptr,
    ticket_ptr,
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
    NUM_SEGMENTS: tl.constexpr,
    SEGMENT_TILES: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    q_block = tl.program_id(0)
    hkv = tl.program_id(1)
    segment = tl.program_id(2)  # of the keys (split-KV); segment 0 also writes the KV
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
    # a sequence's last query block can lie past its end (its blocks are counted from block
    # boundaries): that program has no rows and must not walk the keys for nothing
    has_rows = row0 < seq_end
    first_kv_len = tl.load(kv_len_ptr + seq_start, mask=has_rows, other=0)
    # keys before this step's chunk are in the cache; the chunk's own come from k and v, so
    # nothing here reads a slot this launch writes (and the write below needs no ordering)
    context = tl.maximum(first_kv_len - 1, 0)
    table = tl.load(table_offset_ptr + seq_start, mask=has_rows, other=0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    # for loops with loaded bounds, not while loops: Triton software-pipelines only for loops
    # (cp.async prefetch of the next tiles; sm_90 PTX: 94 registers instead of 128). Triton's
    # CPU interpreter takes loaded bounds from 3.9 on.
    lo, hi, active = _segment_keys(context, segment, NUM_SEGMENTS, SEGMENT_TILES, BLOCK_N)
    for j in tl.range(lo, hi, BLOCK_N):
        pos = j + n
        kmask = pos < hi
        block = tl.load(tables_ptr + table + pos // BLOCK_SIZE, mask=kmask, other=0).to(tl.int64)
        slot = block * stride_block + (pos % BLOCK_SIZE) * stride_slot + hkv * stride_ch
        m_i, l_i, acc = _attend_tile(
            q, k_cache_ptr, v_cache_ptr, slot, kmask, pos, n_keys, d, dmask, scale, m_i, l_i,
            acc, DOT_DTYPE, PRECISION,
        )  # fmt: skip
    # causal: the block's last row sees the chunk up to itself
    # (the padding rows' sequence sees no key: it reads none of their k and v)
    chunk_end = tl.minimum(seq_end, row0 + BLOCK_Q)
    chunk_end = tl.where((first_kv_len > 0) & (segment == 0), chunk_end, seq_start)
    for j in tl.range(seq_start, chunk_end, BLOCK_N):
        key_rows = j + n
        m_i, l_i, acc = _attend_tile(
            q, k_ptr, v_ptr, key_rows * stride_kt + hkv * stride_kh, key_rows < chunk_end,
            context + key_rows - seq_start, n_keys, d, dmask, scale, m_i, l_i, acc, DOT_DTYPE,
            PRECISION,
        )  # fmt: skip
    dst = out_ptr + rows[:, None] * stride_ot + heads[:, None] * D + d[None, :]
    out_mask = row_ok[:, None] & dmask[None, :]
    if NUM_SEGMENTS == 1:
        _store_normalized(dst, acc, l_i, out_mask)
    else:
        # keys in segment 0 alone (a short context): it writes the output, nothing to merge.
        # (tl.where, not &: the CPU interpreter makes a block & a scalar an int32 mask)
        alone = (active == 1) & (segment == 0)
        _store_normalized(dst, acc, l_i, tl.where(alone, out_mask, False))
        if (active > 1) & (segment < active):
            _merge_segments(
                scratch_ptr, ticket_ptr, q_block * tl.num_programs(1) + hkv, segment, active,
                m_i, l_i, acc, dst, out_mask, NUM_SEGMENTS, BLOCK_M, BLOCK_D,
            )  # fmt: skip
    _write_kv(
        k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, rows, row_ok,
        tl.where(segment == 0, m % GROUP == 0, False), hkv, d, dmask, stride_kt, stride_kh,
        stride_slot, stride_ch,
    )  # fmt: skip
