"""Paged attention in pure PyTorch: works on CPU and CUDA, mixed prefill and decode in one
batch. It reads the batch layout on the host, so it cannot live inside a CUDA graph: it
declares GraphSupport.NEVER and runs as a splitting op between compiled pieces.

Decode rows are batched: their KV slots and padding mask are computed once per step (not per
layer) and gathered from the paged cache. Each prefill chunk attends on its own."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from kiln.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    BatchLayout,
    GraphSupport,
    MetadataBuilder,
)
from kiln.attention.kv_int8 import dequantize, is_int8, quantize, read_as

_LIB = torch.library.Library("kiln", "FRAGMENT")
_LIB.define(
    "torch_paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
    "Tensor(c!) out, Tensor slot_mapping, Tensor query_start_loc, Tensor seq_lens, "
    "Tensor block_tables, Tensor decode_slots, Tensor decode_bias, float scale) -> ()"
)


def _slots(block_table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """KV slot of positions [0, length) for one or more block-table rows."""
    pos = torch.arange(length, device=block_table.device)
    return block_table[..., pos // block_size].long() * block_size + pos % block_size


def _gather(flat: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[n, L] slots -> [n, L, Hkv, D]; index_select is twice as fast as advanced indexing."""
    return flat.index_select(0, slots.view(-1)).view(*slots.shape, *flat.shape[1:])


def stored_as(
    k: torch.Tensor, v: torch.Tensor, cache_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """This step's keys and values as the cache holds them (rounded to a narrower cache dtype,
    kept in the model's): a chunk attends its own keys as every later step reads them, so a
    prefix hit gives the same output as recomputing the prefix."""
    if cache_dtype == k.dtype:
        return k, v
    if cache_dtype == torch.int8:
        return dequantize(quantize(k), k.dtype), dequantize(quantize(v), v.dtype)
    return k.to(cache_dtype).to(k.dtype), v.to(cache_dtype).to(v.dtype)


def write_kv(
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    slot_mapping: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This step's keys and values into the caches at their slots; returns them as stored, in
    the model's dtype (`stored_as`, converted once)."""
    if k_flat.dtype == k.dtype:
        k_flat.index_copy_(0, slot_mapping, k)
        v_flat.index_copy_(0, slot_mapping, v)
        return k, v
    if is_int8(k_flat):
        k_stored, v_stored = quantize(k), quantize(v)
        k_flat.index_copy_(0, slot_mapping, k_stored)
        v_flat.index_copy_(0, slot_mapping, v_stored)
        return dequantize(k_stored, k.dtype), dequantize(v_stored, v.dtype)
    k_stored, v_stored = k.to(k_flat.dtype), v.to(v_flat.dtype)
    k_flat.index_copy_(0, slot_mapping, k_stored)
    v_flat.index_copy_(0, slot_mapping, v_stored)
    return k_stored.to(k.dtype), v_stored.to(v.dtype)


def gathered_decode(q, k_flat, v_flat, slots, bias, scale):
    """Decode rows over their keys gathered from the cache (`decode_gather_tensors`). The G
    query heads sharing a KV head ride as G query rows of one SDPA call: no KV expansion, and
    SDPA reads the gathered cache through strides (4x faster at 16 rows).
    slots and bias are the per-step tensors, flat [n * L] so their layout never varies; bias
    is in the model's dtype."""
    n, h, d = q.shape
    hkv = k_flat.shape[1]
    slots = slots.view(n, -1)
    keys = read_as(_gather(k_flat, slots), q.dtype).transpose(1, 2)  # [n, Hkv, L, D]
    values = read_as(_gather(v_flat, slots), q.dtype).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q.view(n, hkv, h // hkv, d), keys, values, attn_mask=bias.view(n, 1, 1, -1), scale=scale
    )
    return out.reshape(n, h * d)


def _prefill(q, k, v, k_flat, v_flat, block_table, seq_len, block_size, scale):
    q_len = q.shape[0]
    ctx_len = seq_len - q_len
    mask = None
    if ctx_len > 0:
        slots = _slots(block_table, seq_len, block_size)
        k, v = (read_as(flat.index_select(0, slots), q.dtype) for flat in (k_flat, v_flat))
        rows = torch.arange(q_len, device=q.device)[:, None] + ctx_len
        mask = torch.arange(seq_len, device=q.device)[None, :] <= rows
    # 4-D, with a batch of one: the CPU's flash kernel takes only 4-D inputs; 3-D ones fall back
    # to the math kernel, which materialises every score (3x slower at 512 tokens, 6x at 2048)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1).reshape(q_len, -1)


def torch_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    slot_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    decode_slots: torch.Tensor,
    decode_bias: torch.Tensor,
    scale: float,
) -> None:
    """Writes this step's keys and values into the caches and the attention output into `out`
    [T, H * D] (rows past the batch's tokens, padding, become zeros)."""
    block_size, hkv, d = k_cache.shape[1:]
    k_flat, v_flat = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    starts = query_start_loc.tolist()
    n_tokens = starts[-1]
    if k.shape[0] != n_tokens:  # padding rows (a graph's size) write nothing
        k, v = k[:n_tokens], v[:n_tokens]
    if slot_mapping.shape[0] != n_tokens:
        slot_mapping = slot_mapping[:n_tokens]
    k, v = write_kv(k_flat, v_flat, slot_mapping, k, v)
    q_lens = [b - a for a, b in itertools.pairwise(starts)]
    n_dec = next((i for i, n in enumerate(q_lens) if n != 1), len(q_lens))
    if n_dec == q.shape[0]:
        out.copy_(gathered_decode(q, k_flat, v_flat, decode_slots, decode_bias, scale))
        return
    out[n_tokens:] = 0
    if n_dec:
        out[:n_dec] = gathered_decode(q[:n_dec], k_flat, v_flat, decode_slots, decode_bias, scale)
    lens = seq_lens.tolist()
    for i in range(n_dec, len(q_lens)):
        a, b = starts[i], starts[i + 1]
        out[a:b] = _prefill(
            q[a:b], k[a:b], v[a:b], k_flat, v_flat, block_tables[i], lens[i], block_size, scale
        )


def _fake(
    q,
    k,
    v,
    k_cache,
    v_cache,
    out,
    slot_mapping,
    query_start_loc,
    seq_lens,
    block_tables,
    decode_slots,
    decode_bias,
    scale,
) -> None:
    return None


_LIB.impl("torch_paged_attention", torch_paged_attention, "CompositeExplicitAutograd")
torch.library.register_fake("kiln::torch_paged_attention", _fake, lib=_LIB)


@dataclass
class TorchPagedMetadata(AttentionMetadata):
    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, W] int32
    decode_slots: torch.Tensor  # [num_decodes * max_decode_len] int64
    decode_bias: torch.Tensor  # [num_decodes * max_decode_len] 0 or -inf, in the model's dtype

    dynamic_dims: ClassVar[dict[str, tuple[int, ...]]] = {
        "slot_mapping": (0,),
        "query_start_loc": (0,),
        "seq_lens": (0,),
        "block_tables": (0, 1),
        "decode_slots": (0,),
        "decode_bias": (0,),
    }


def decode_gather_tensors(
    block_tables: torch.Tensor, lens: torch.Tensor, block_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The KV slots and padding bias of decode rows with these block tables and KV lengths,
    flat [n * max_len]; the bias in the model's dtype, not converted to it in every layer."""
    n = lens.shape[0]
    width = int(lens.max()) if n else 0
    slots = _slots(block_tables, width, block_size)
    beyond = torch.arange(width, device=lens.device)[None, :] >= lens[:, None]
    bias = torch.zeros(n, width, dtype=dtype, device=lens.device)
    bias.masked_fill_(beyond, float("-inf"))
    # Positions past a sequence's end read its own first slot instead: never-written cache
    # memory may hold NaN, and NaN * 0 would leak through the softmax.
    slots = torch.where(beyond, slots[:, :1], slots)
    return slots.reshape(-1), bias.reshape(-1)


class TorchPagedMetadataBuilder(MetadataBuilder):
    """The decode rows' KV slots and padding mask, computed once per step rather than in every
    layer; the bias in the model's dtype, not converted to it in every layer."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def build(self, layout: BatchLayout) -> TorchPagedMetadata:
        n = layout.num_decodes
        slots, bias = decode_gather_tensors(
            layout.block_tables[:n], layout.seq_lens[:n], layout.block_size, self.dtype
        )
        return TorchPagedMetadata(
            slot_mapping=layout.slot_mapping,
            query_start_loc=layout.query_start_loc,
            seq_lens=layout.seq_lens,
            block_tables=layout.block_tables,
            decode_slots=slots,
            decode_bias=bias,
        )


class TorchPagedAttentionBackend(AttentionBackend):
    name = "torch_paged"
    graph_support = GraphSupport.NEVER
    drafts_as_decode_rows = True
    splitting_ops = ("kiln::torch_paged_attention",)

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype  # the model's

    def metadata_builder(self, max_num_tokens: int, device: torch.device) -> MetadataBuilder:
        return TorchPagedMetadataBuilder(self.dtype)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        meta: TorchPagedMetadata,
        scale: float,
    ) -> None:
        torch.ops.kiln.torch_paged_attention(
            q,
            k,
            v,
            k_cache,
            v_cache,
            out,
            meta.slot_mapping,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            meta.decode_slots,
            meta.decode_bias,
            scale,
        )
