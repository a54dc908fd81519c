"""Paged attention in Triton: one kernel for prefill chunks, decodes and mixed batches, that a
FULL CUDA graph can capture.

Everything the kernels read is indexed per token, from the runner's persistent buffers: the
token's KV slot, how many keys it sees (its position + 1) and where its block-table row starts
in the flat block-table buffer. So the launch grid depends only on the (padded) token count, no
host value is read, and padding rows (slot -1, 0 keys) write nothing and output zeros.

One program per (token, query head) walks its sequence's KV blocks with an online softmax.
Prefill programs re-read their sequence's keys per query token; correct at any batch shape,
and the decode path (the one CUDA graphs matter most for) is the classic paged-decode kernel.
Runs under TRITON_INTERPRET=1 on the CPU, which is how the tests check it without a GPU."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.attention.backend import AttentionBackend, AttentionMetadata, GraphSupport

_LIB = torch.library.Library("kiln", "FRAGMENT")
_LIB.define(
    "triton_paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, "
    "Tensor(b!) v_cache, Tensor(c!) out, Tensor slot_mapping, Tensor token_kv_lens, "
    "Tensor token_table_offsets, Tensor block_tables_flat, float scale) -> ()"
)


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_t,
    stride_h,
    stride_slot,
    stride_ch,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t)
    d = tl.arange(0, BLOCK_D)
    # One comparison, not (d < D) & (slot >= 0): Triton 3.9's CPU interpreter turns a block
    # mask and-ed with a scalar into int32 and rejects it ("mask has unsupported dtype").
    mask = d < tl.where(slot >= 0, D, 0)
    src = t * stride_t + h * stride_h + d
    dst = slot * stride_slot + h * stride_ch + d
    tl.store(k_cache_ptr + dst, tl.load(k_ptr + src, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(v_ptr + src, mask=mask), mask=mask)


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    kv_len_ptr,
    table_offset_ptr,
    tables_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_block,
    stride_slot,
    stride_ch,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    hkv = h // GROUP
    n_keys = tl.load(kv_len_ptr + t)
    table = tl.load(table_offset_ptr + t)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    offs = tl.arange(0, BLOCK_SIZE)
    q = tl.load(q_ptr + t * stride_qt + h * stride_qh + d, mask=dmask, other=0.0).to(tl.float32)
    m_i = tl.max(tl.full([BLOCK_SIZE], float("-inf"), tl.float32), 0)
    l_i = tl.sum(tl.zeros([BLOCK_SIZE], tl.float32), 0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    # a while loop: the trip count is data (Triton compiles it to scf.while on the GPU, and
    # the CPU interpreter cannot take a loaded scalar as a range bound)
    j = n_keys * 0
    while j * BLOCK_SIZE < n_keys:
        block = tl.load(tables_ptr + table + j).to(tl.int64)
        kmask = (j * BLOCK_SIZE + offs) < n_keys
        tile = block * stride_block + offs[:, None] * stride_slot + hkv * stride_ch + d[None, :]
        tmask = kmask[:, None] & dmask[None, :]
        keys = tl.load(k_cache_ptr + tile, mask=tmask, other=0.0).to(tl.float32)
        scores = tl.where(kmask, tl.sum(keys * q[None, :], 1) * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 0))
        p = tl.exp(scores - m_new)
        alpha = tl.exp(m_i - m_new)
        values = tl.load(v_cache_ptr + tile, mask=tmask, other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * values, 0)
        l_i = l_i * alpha + tl.sum(p, 0)
        m_i = m_new
        j += 1
    out = acc / tl.where(l_i > 0, l_i, 1.0)  # padding rows (0 keys) write zeros
    dst = out_ptr + t * stride_ot + h * D + d
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=dmask)


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
    scale: float,
) -> None:
    """q: [T, H, D], k/v: [T, Hkv, D] contiguous; caches [num_blocks, block_size, Hkv, D];
    writes the attention output into `out` [T, H * D] (zeros for padding rows)."""
    t, h, d = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    block_d = triton.next_power_of_2(d)
    if t == 0:
        return
    _write_kv_kernel[(t, hkv)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), k_cache.stride(1), k_cache.stride(2),
        D=d, BLOCK_D=block_d,
    )  # fmt: skip
    _paged_attention_kernel[(t, h)](
        q, k_cache, v_cache, out, token_kv_lens, token_table_offsets, block_tables_flat, scale,
        q.stride(0), q.stride(1), out.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=h // hkv, D=d, BLOCK_D=block_d, BLOCK_SIZE=block_size,
    )  # fmt: skip


def _fake(q, k, v, k_cache, v_cache, out, slot_mapping, lens, offsets, tables, scale) -> None:
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
            scale,
        )
