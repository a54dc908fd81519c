"""The pure-PyTorch paged-attention backend against attention computed by hand in float64, and
on SDPA's fused kernel: the CPU's math fallback materialises every score (3-6x slower prefill,
hundreds of MB of temporaries at 4k tokens), and a 3-D input is all it takes to fall into it."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import profile

from kiln.attention.torch_backend import TorchPagedAttentionBackend, torch_paged_attention
from kiln.runner.input_buffers import BatchRow, InputBuffers

H, HKV, D, BS = 6, 2, 16, 4
Q_LENS, FIRSTS = [1, 1, 9, 5], [7, 12, 0, 6]  # two decodes, a fresh and a chunked prefill


def _inputs(dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 32, BS, HKV, D, generator=g).to(dtype)
    width = max(-(-(f + n) // BS) for f, n in zip(FIRSTS, Q_LENS))
    perm = torch.randperm(32, generator=g)
    tables = perm[: len(Q_LENS) * width].view(len(Q_LENS), width).to(torch.int32)
    rows = [
        BatchRow([0] * n, first, tables[row].tolist())
        for row, (n, first) in enumerate(zip(Q_LENS, FIRSTS))
    ]
    t = sum(Q_LENS)
    q, k, v = (torch.randn(t, n, D, generator=g).to(dtype) for n in (H, HKV, HKV))
    layout = InputBuffers(64, 8, width, BS, torch.device("cpu")).fill(rows, num_decodes=2)
    builder = TorchPagedAttentionBackend(dtype).metadata_builder(64, torch.device("cpu"))
    return cache, q, k, v, builder.build(layout)


def _run(cache, q, k, v, meta):
    out = torch.full((q.shape[0], H * D), float("nan"), dtype=q.dtype)  # every row is written
    torch_paged_attention(
        q, k, v, cache[0], cache[1], out, meta.slot_mapping, meta.query_start_loc,
        meta.seq_lens, meta.block_tables, meta.decode_slots, meta.decode_bias, D**-0.5,
    )  # fmt: skip
    return out


def _by_hand(cache, q, meta) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v per request and head, causal, in float64 (after the op wrote
    this step's keys and values into `cache`)."""
    out = torch.empty(q.shape[0], H * D, dtype=torch.float64)
    starts = meta.query_start_loc.tolist()
    for row, (first, n) in enumerate(zip(FIRSTS, Q_LENS)):
        pos = torch.arange(first + n)
        slots = meta.block_tables[row, pos // BS].long() * BS + pos % BS
        keys = cache[0].reshape(-1, HKV, D)[slots].double()
        values = cache[1].reshape(-1, HKV, D)[slots].double()
        for i in range(n):
            qi = q[starts[row] + i].double()
            for h in range(H):
                kv = h // (H // HKV)
                seen = first + i + 1
                p = torch.softmax(keys[:seen, kv] @ qi[h] * D**-0.5, 0)
                out[starts[row] + i, h * D : (h + 1) * D] = p @ values[:seen, kv]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mixed_batch_matches_attention_by_hand(dtype):
    cache, q, k, v, meta = _inputs(dtype)
    assert meta.decode_bias.dtype == dtype  # built in the model's dtype once per step
    out = _run(cache, q, k, v, meta)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), _by_hand(cache, q, meta), rtol=tol, atol=tol)


def test_every_attention_runs_on_the_fused_kernel():
    cache, q, k, v, meta = _inputs(torch.float32)
    with profile() as prof:
        _run(cache, q, k, v, meta)
    names = [e.key for e in prof.key_averages()]
    assert not [n for n in names if "attention_math" in n]
    fused = [e for e in prof.key_averages() if e.key.startswith("aten::_scaled_dot_product_flash")]
    assert sum(e.count for e in fused) == 3  # the decodes together, then each prefill


def test_padding_rows_become_zeros():
    """Rows past the batch's tokens (a graph's padding) come out as zeros, whatever the output
    buffer held: it is allocated empty, inside a compiled piece."""
    cache, q, k, v, meta = _inputs(torch.float32)
    pad = 3
    q, k, v = (torch.cat([x, torch.randn(pad, *x.shape[1:])]) for x in (q, k, v))
    padded = _run(cache.clone(), q, k, v, meta)
    torch.testing.assert_close(padded[:-pad], _run(cache, q[:-pad], k[:-pad], v[:-pad], meta))
    assert padded[-pad:].abs().max() == 0
