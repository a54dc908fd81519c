"""Paged attention in pure PyTorch: works on CPU and CUDA, mixed prefill and decode in one
batch. It reads batch layout on the host, so it cannot live inside a CUDA graph: it declares
GraphSupport.NEVER and runs as a splitting op between compiled pieces."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.attention.backend import AttentionBackend, AttentionMetadata, GraphSupport


def _slots(block_table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """KV slot of positions [0, length) for one or more block-table rows."""
    pos = torch.arange(length, device=block_table.device)
    return block_table[..., pos // block_size].long() * block_size + pos % block_size


def _decode(q, k_flat, v_flat, block_tables, seq_lens, max_len, block_size, scale):
    n, h, d = q.shape
    hkv = k_flat.shape[1]
    slots = _slots(block_tables, max_len, block_size)  # [n, L]
    keys = k_flat[slots].permute(0, 2, 3, 1)  # [n, Hkv, D, L]
    values = v_flat[slots].transpose(1, 2)  # [n, Hkv, L, D]
    qg = q.view(n, hkv, h // hkv, d)
    scores = torch.matmul(qg, keys).float() * scale  # [n, Hkv, G, L]
    valid = torch.arange(max_len, device=q.device)[None, :] < seq_lens[:, None]
    scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
    probs = scores.softmax(-1).to(q.dtype)
    return torch.matmul(probs, values).reshape(n, h * d)


def _prefill(q, k, v, k_flat, v_flat, block_table, seq_len, block_size, scale):
    q_len = q.shape[0]
    ctx_len = seq_len - q_len
    if ctx_len > 0:
        slots = _slots(block_table, seq_len, block_size)
        k, v = k_flat[slots], v_flat[slots]
        rows = torch.arange(q_len, device=q.device)[:, None] + ctx_len
        mask = torch.arange(seq_len, device=q.device)[None, :] <= rows
    else:
        mask = None
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True,
    )
    return out.transpose(0, 1).reshape(q_len, -1)


@torch.library.custom_op("kiln::torch_paged_attention", mutates_args=("k_cache", "v_cache"))
def torch_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    block_size, hkv, d = k_cache.shape[1:]
    k_flat, v_flat = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    starts = query_start_loc.tolist()
    n_tokens = starts[-1]
    k_flat.index_copy_(0, slot_mapping[:n_tokens], k[:n_tokens])
    v_flat.index_copy_(0, slot_mapping[:n_tokens], v[:n_tokens])
    out = q.new_zeros(q.shape[0], q.shape[1] * d)
    lens = seq_lens.tolist()
    q_lens = [b - a for a, b in zip(starts[:-1], starts[1:])]
    n_dec = next((i for i, n in enumerate(q_lens) if n != 1), len(q_lens))
    if n_dec:
        out[:n_dec] = _decode(q[:n_dec], k_flat, v_flat, block_tables[:n_dec], seq_lens[:n_dec],
                              max(lens[:n_dec]), block_size, scale)
    for i in range(n_dec, len(q_lens)):
        a, b = starts[i], starts[i + 1]
        out[a:b] = _prefill(q[a:b], k[a:b], v[a:b], k_flat, v_flat, block_tables[i], lens[i],
                            block_size, scale)
    return out


@torch_paged_attention.register_fake
def _(q, k, v, k_cache, v_cache, slot_mapping, query_start_loc, seq_lens, block_tables, scale):
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


class TorchPagedAttentionBackend(AttentionBackend):
    name = "torch_paged"
    graph_support = GraphSupport.NEVER

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        return torch.ops.kiln.torch_paged_attention(
            q, k.contiguous(), v.contiguous(), k_cache, v_cache, meta.slot_mapping,
            meta.query_start_loc, meta.seq_lens, meta.block_tables, scale,
        )
