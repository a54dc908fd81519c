"""The CPU attention backend (keys read in place from runs of the paged cache, merged by their
log-sum-exp) against the pure-PyTorch reference backend and against attention by hand in
float64: decode rows and chunked prefill, contexts ending mid-block and on block edges, GQA
ratios and head dims, prefix hits, padding rows, and the cache it writes. Every path of the op
(in place, gathered fragments, split decode runs, batched short decodes) is forced by its
tuning on small shapes, and the C++ kernels (decode rows and prefill chunks, every build this
CPU runs) through the same comparisons."""

from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch.profiler import profile

from kiln.attention.backend import AttentionShape
from kiln.attention.cpu_backend import CpuPagedAttentionBackend
from kiln.attention.cpu_metadata import (
    GATHERED,
    IN_PLACE,
    OWN_CAUSAL,
    CpuAttentionTuning,
    block_runs,
)
from kiln.attention.kv_int8 import dequantize, quantize
from kiln.attention.torch_backend import TorchPagedAttentionBackend
from kiln.runner.input_buffers import BatchRow, InputBuffers

BS, NUM_BLOCKS = 4, 96
KEY_BYTES = 128  # one token's keys in float32: 2 x 16, 4 x 8 and 1 x 32 KV heads x head dim
# the flash-kernel paths, decode rows and prefill chunks (both C++ kernels off)
FLASH = {"decode_kernel": "off", "prefill_kernel": "off"}
ALL_IN_PLACE = CpuAttentionTuning(gather_max_bytes=0, min_run=1, part_tokens=1 << 20, **FLASH)
SPLIT = CpuAttentionTuning(gather_max_bytes=0, min_run=1, part_tokens=3, max_parts=4, **FLASH)
FRAGMENTS_GATHERED = CpuAttentionTuning(gather_max_bytes=0, min_run=3 * BS, **FLASH)
SHORT_DECODES_BATCHED = CpuAttentionTuning(
    gather_max_bytes=16 * KEY_BYTES, gather_budget_bytes=40 * KEY_BYTES, min_run=1, **FLASH
)
KERNEL = CpuAttentionTuning(decode_kernel="on")  # decode rows and prefill chunks in C++
PREFILL_KERNEL = CpuAttentionTuning(decode_kernel="off", gather_max_bytes=0, min_run=1)
TUNINGS = {
    "in_place": ALL_IN_PLACE,
    "split": SPLIT,
    "gathered": FRAGMENTS_GATHERED,
    "batched": SHORT_DECODES_BATCHED,
    "kernel": KERNEL,
    "prefill_kernel": PREFILL_KERNEL,  # decode rows on the flash paths, chunks in C++
    "default": CpuAttentionTuning(),
}
# (query length, keys already cached): decodes first, then a fresh prompt, then chunks with a
# prefix: contexts ending mid-block (7, 6, 13) and on block edges (12, 8, 16)
Q_LENS, FIRSTS = [1, 1, 1, 1, 9, 5, 4, 3], [7, 12, 15, 30, 0, 6, 8, 13]
NUM_DECODES = 4


def _batch(heads: int, kv_heads: int, dim: int, dtype: torch.dtype, contiguous: bool, seed=0):
    g = torch.Generator().manual_seed(seed)
    caches = torch.randn(2, NUM_BLOCKS, BS, kv_heads, dim, generator=g).to(dtype)
    need = [-(-(f + n) // BS) for f, n in zip(FIRSTS, Q_LENS)]
    order = torch.arange(NUM_BLOCKS) if contiguous else torch.randperm(NUM_BLOCKS, generator=g)
    ids, tables = order.tolist(), []
    for n in need:  # a contiguous cache hands each request consecutive blocks
        tables.append(ids[:n])
        ids = ids[n:]
    rows = [BatchRow([0] * n, f, t) for n, f, t in zip(Q_LENS, FIRSTS, tables)]
    t = sum(Q_LENS)
    q, k, v = (torch.randn(t, n, dim, generator=g).to(dtype) for n in (heads, kv_heads, kv_heads))
    layout = InputBuffers(64, 16, max(need), BS, torch.device("cpu")).fill(rows, NUM_DECODES)
    return caches, q, k, v, layout


def _backend(dtype: torch.dtype, tuning: CpuAttentionTuning, heads=6, kv_heads=2, dim=16):
    return CpuPagedAttentionBackend(dtype, AttentionShape(heads, kv_heads, dim), tuning)


def _run(backend, caches, q, k, v, layout, pad: int = 0):
    meta = backend.metadata_builder(64, torch.device("cpu")).build(layout)
    if pad:
        q, k, v = (torch.cat([x, torch.randn(pad, *x.shape[1:], dtype=x.dtype)]) for x in (q, k, v))
    out = torch.full((q.shape[0], q.shape[1] * q.shape[2]), float("nan"), dtype=q.dtype)
    backend.forward(q, k, v, caches[0], caches[1], out, meta, q.shape[-1] ** -0.5)
    return out


def _by_hand(caches, q, layout, firsts=FIRSTS, q_lens=Q_LENS) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v per request and head, causal, in float64, from the cache the
    op wrote this step's keys into."""
    heads, dim = q.shape[1:]
    kv_heads = caches.shape[3]
    out = torch.empty(q.shape[0], heads * dim, dtype=torch.float64)
    starts = layout.query_start_loc.tolist()
    for row, (first, n) in enumerate(zip(firsts, q_lens)):
        pos = torch.arange(first + n)
        slots = layout.block_tables[row, pos // BS].long() * BS + pos % BS
        keys, values = (c.reshape(-1, kv_heads, dim)[slots].double() for c in caches)
        for i in range(n):
            qi = q[starts[row] + i].double()
            for h in range(heads):
                kv = h // (heads // kv_heads)
                seen = first + i + 1
                p = torch.softmax(keys[:seen, kv] @ qi[h] * dim**-0.5, 0)
                out[starts[row] + i, h * dim : (h + 1) * dim] = p @ values[:seen, kv]
    return out


@pytest.mark.parametrize("tuning", TUNINGS, ids=str)
@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "fragmented"])
@pytest.mark.parametrize("shape", [(6, 2, 16), (4, 4, 8), (8, 1, 32)], ids=str)
def test_matches_attention_by_hand(tuning, contiguous, shape):
    heads, kv_heads, dim = shape
    caches, q, k, v, layout = _batch(heads, kv_heads, dim, torch.float32, contiguous)
    backend = _backend(torch.float32, TUNINGS[tuning], heads, kv_heads, dim)
    out = _run(backend, caches, q, k, v, layout)
    torch.testing.assert_close(out.double(), _by_hand(caches, q, layout), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tuning", ["in_place", "split", "gathered", "kernel", "prefill_kernel"])
def test_bfloat16_matches_the_reference_backend(tuning):
    caches, q, k, v, layout = _batch(6, 2, 16, torch.bfloat16, contiguous=False)
    ref_caches = caches.clone()
    ours = _run(_backend(torch.bfloat16, TUNINGS[tuning]),
                caches, q, k, v, layout)  # fmt: skip
    ref = _run(TorchPagedAttentionBackend(torch.bfloat16), ref_caches, q, k, v, layout)
    torch.testing.assert_close(ours.float(), ref.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(caches, ref_caches)  # the same keys and values in the same slots


def _narrow_cache(caches: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    """Float caches as a cache of `kv_dtype` holds them (int8: values and scale per head row)."""
    return quantize(caches) if kv_dtype == torch.int8 else caches.to(kv_dtype)


def _cache_values(caches: torch.Tensor) -> torch.Tensor:
    """What a cache holds, as float64 values (attention by hand reads these)."""
    return dequantize(caches, torch.float64) if caches.dtype == torch.int8 else caches.double()


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8], ids=str)
@pytest.mark.parametrize("tuning", [*TUNINGS, "torch backend"], ids=str)
def test_a_narrower_cache_under_a_float32_model_matches_attention_by_hand(tuning, kv_dtype):
    """--kv-cache-dtype bfloat16 or int8 with a float32 model: the step's keys and values are
    written rounded to bf16 (or quantized to int8 with a scale per token and head), and every
    path (the kernel's mixed builds, the flash paths, the gathered ones, the torch backend)
    attends float32 queries over exactly those values, the chunk's own keys included, so it
    equals attention by hand over the cache within float32 rounding."""
    caches, q, k, v, layout = _batch(6, 2, 16, torch.float32, contiguous=False)
    caches = _narrow_cache(caches, kv_dtype)
    if tuning == "torch backend":
        backend = TorchPagedAttentionBackend(torch.float32)
    else:
        shape = AttentionShape(6, 2, 16)
        backend = CpuPagedAttentionBackend(torch.float32, shape, TUNINGS[tuning], kv_dtype)
        # the gather thresholds count the cache's bytes: bf16 values, or int8 ones and a scale
        assert backend.key_bytes == 2 * (16 * 2 if kv_dtype == torch.bfloat16 else 16 + 4)
    out = _run(backend, caches, q, k, v, layout)
    assert out.dtype == torch.float32
    written = caches[0].view(-1, 2, caches.shape[-1])[layout.slot_mapping[: len(k)]]
    assert torch.equal(written, _narrow_cache(k, kv_dtype))
    want = _by_hand(_cache_values(caches), q, layout)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def test_cache_writes_equal_the_reference_backend():
    caches, q, k, v, layout = _batch(6, 2, 16, torch.float32, contiguous=False)
    ref_caches = caches.clone()
    _run(_backend(torch.float32, ALL_IN_PLACE), caches, q, k, v, layout)
    _run(TorchPagedAttentionBackend(torch.float32), ref_caches, q, k, v, layout)
    assert torch.equal(caches, ref_caches)
    assert not torch.equal(caches, _batch(6, 2, 16, torch.float32, contiguous=False)[0])


@pytest.mark.parametrize("tuning", ["in_place", "batched", "kernel", "prefill_kernel"])
def test_padding_rows_become_zeros_and_change_nothing(tuning):
    backend = _backend(torch.float32, TUNINGS[tuning])
    caches, q, k, v, layout = _batch(6, 2, 16, torch.float32, contiguous=True)
    unpadded = _run(backend, caches.clone(), q, k, v, layout)
    padded = _run(backend, caches, q, k, v, layout, pad=3)
    torch.testing.assert_close(padded[:-3], unpadded)
    assert padded[-3:].abs().max() == 0


def test_a_long_decode_is_read_in_place_not_copied():
    """One decode row over 30 cached keys in consecutive blocks: one flash call on a view of the
    cache, and no gather (index_select) of keys."""
    caches, q, k, v, layout = _batch(6, 2, 16, torch.float32, contiguous=True)
    backend = _backend(torch.float32, ALL_IN_PLACE)
    meta = backend.metadata_builder(64, torch.device("cpu")).build(layout)
    assert meta.pieces[3].tolist() == [3, IN_PLACE, layout.block_tables[3, 0].item() * BS, 31, 1]
    with profile() as prof:
        _run(backend, caches, q[3:4], k[3:4], v[3:4], _decode_only(layout, row=3))
    names = {e.key: e.count for e in prof.key_averages()}
    assert names.get("aten::index_select", 0) == 0
    assert names["aten::_scaled_dot_product_flash_attention_for_cpu"] == 1


def _decode_only(layout, row: int):
    table = layout.block_tables[row].tolist()
    first = FIRSTS[row]
    return InputBuffers(8, 4, len(table), BS, torch.device("cpu")).fill(
        [BatchRow([0], first, table)], num_decodes=1
    )


def test_short_decodes_are_gathered_together_within_the_budget():
    """Decode rows of 8, 13, 16 and 31 keys: the three of at most 16 keys' bytes, shortest
    first, until rows x the longest would pass the budget (3 x 16 > 40), the rest in place."""
    layout = _batch(6, 2, 16, torch.float32, contiguous=True)[-1]
    backend = _backend(torch.float32, SHORT_DECODES_BATCHED)
    meta = backend.metadata_builder(64, torch.device("cpu")).build(layout)
    assert meta.gathered_rows.tolist() == [0, 1]
    assert meta.decode_slots.shape == (2 * 13,)
    assert [p[0] for p in meta.pieces.tolist()][:2] == [2, 3]


def test_pieces_of_each_kind():
    """Runs of at least min_run keys in place, shorter ones gathered, and each prefill chunk's
    own keys."""
    layout = _batch(6, 2, 16, torch.float32, contiguous=True)[-1]
    meta = (
        _backend(torch.float32, FRAGMENTS_GATHERED)
        .metadata_builder(64, torch.device("cpu"))
        .build(layout)
    )
    by_row = [(row, kind, length) for row, kind, _, length, _ in meta.pieces.tolist()]
    assert by_row[:4] == [(0, GATHERED, 8), (1, IN_PLACE, 13), (2, IN_PLACE, 16), (3, IN_PLACE, 31)]
    own = [p for p in meta.pieces.tolist() if p[1] == OWN_CAUSAL]
    assert [(row, length) for row, _, _, length, _ in own] == [
        (4, 9), (5, 5), (6, 4), (7, 3),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("table", "num_keys", "runs"),
    [
        ([3, 4, 5], 12, [(12, 12)]),  # consecutive, full
        ([5, 4, 3], 10, [(12, 2), (16, 8)]),  # reversed: sorted, cut after the partial tail
        ([3, 4, 5], 10, [(12, 10)]),  # the partial tail ends the run
        ([7, 2, 3], 9, [(8, 5), (28, 4)]),
        ([2, 9, 3], 12, [(8, 8), (36, 4)]),
        ([2, 9, 3], 11, [(8, 7), (36, 4)]),  # tail 3 partial: cut after it
    ],
)
def test_block_runs(table, num_keys, runs):
    assert block_runs(np.array(table, dtype=np.int32), num_keys, BS) == runs


def test_a_long_decode_run_is_split_into_parts_and_its_leftover_gathered():
    """31 keys in one run, parts of at least 3 keys, at most 4 (neither 4 nor 3 divides 31): 4
    parts of 7 keys ride as the kernel's batch, the 3 keys left over are a piece of their own."""
    layout = _batch(6, 2, 16, torch.float32, contiguous=True)[-1]
    meta = _backend(torch.float32, SPLIT).metadata_builder(64, torch.device("cpu")).build(layout)
    row3 = [p for p in meta.pieces.tolist() if p[0] == 3]
    first = layout.block_tables[3, 0].item() * BS
    assert row3 == [[3, IN_PLACE, first, 28, 4], [3, IN_PLACE, first + 28, 3, 1]]
    row2 = [p for p in meta.pieces.tolist() if p[0] == 2]  # 16 keys: 4 parts of 4, none over
    assert row2 == [[2, IN_PLACE, layout.block_tables[2, 0].item() * BS, 16, 4]]


# ---- the C++ decode kernel --------------------------------------------------------------------


def test_decode_rows_and_chunks_go_to_the_kernels_whole():
    """With the kernels, every decode row is its row (table and length) and every prefill chunk
    its request (table, query tokens, keys with its own), none a piece or a gathered row; with
    the prefill kernel off, the chunks keep their pieces."""
    layout = _batch(6, 2, 16, torch.float32, contiguous=False)[-1]
    backend = _backend(torch.float32, KERNEL)
    if not backend.prefill_kernel:
        pytest.skip("the C++ kernels have no vector build on this CPU (no AVX2 or AVX-512)")
    meta = backend.metadata_builder(64, torch.device("cpu")).build(layout)
    assert meta.kernel_lens.tolist() == [f + 1 for f in FIRSTS[:NUM_DECODES]]
    assert torch.equal(meta.kernel_tables, layout.block_tables[:NUM_DECODES].int())
    assert meta.gathered_rows.numel() == 0
    assert meta.pieces.numel() == 0
    chunks = slice(NUM_DECODES, len(Q_LENS))
    assert meta.prefill_lens.tolist() == [f + n for f, n in zip(FIRSTS[chunks], Q_LENS[chunks])]
    assert meta.prefill_starts.tolist() == layout.query_start_loc[NUM_DECODES:9].tolist()
    assert torch.equal(meta.prefill_tables, layout.block_tables[chunks].int())
    decodes_only = replace(KERNEL, prefill_kernel="off")
    meta = _backend(torch.float32, decodes_only).metadata_builder(64, torch.device("cpu"))
    meta = meta.build(layout)
    assert meta.prefill_lens.numel() == 0
    assert {p[0] for p in meta.pieces.tolist()} == set(range(NUM_DECODES, len(Q_LENS)))


@pytest.mark.parametrize("decode_only", [True, False], ids=["decodes", "decodes and chunks"])
def test_a_step_through_the_kernels_copies_no_keys(decode_only):
    caches, q, k, v, layout = _batch(6, 2, 16, torch.float32, contiguous=False)
    if decode_only:
        q, k, v, layout = q[:4], k[:4], v[:4], _decodes(layout)
    backend = _backend(torch.float32, KERNEL)
    if not (decode_only or backend.prefill_kernel):
        pytest.skip("the C++ kernels have no vector build on this CPU (no AVX2 or AVX-512)")
    with profile() as prof:
        _run(backend, caches, q, k, v, layout)
    names = {e.key: e.count for e in prof.key_averages()}
    assert names.get("aten::index_select", 0) == 0
    assert names.get("aten::_scaled_dot_product_flash_attention_for_cpu", 0) == 0


def _decodes(layout):
    tables = [layout.block_tables[row].tolist() for row in range(NUM_DECODES)]
    rows = [BatchRow([0], FIRSTS[row], tables[row]) for row in range(NUM_DECODES)]
    return InputBuffers(8, 4, len(tables[0]), BS, torch.device("cpu")).fill(rows, NUM_DECODES)


# bf16 decode rows scored and their values added by AVX512-BF16 pair products, by float32 FMAs
# on widened rows, or scored by pairs and added by FMAs: the native build takes the first or
# the second by the CPU (pairs without AMX), these force each
SCORES = ["pair-scores", "fma-scores", "pair-scores-fma-values"]
# an int8 cache's values added by integer products with 8-bit weights (the native build on a CPU
# with AVX512-VNNI and BW), or by float32 FMAs on widened rows (this build forces the latter)
INT8_FMA_VALUES = "int8-fma-values"
BUILDS = ["native", *SCORES, INT8_FMA_VALUES, "avx512", "avx512-vnni", "avx2", "portable"]
KERNEL_DTYPES = [torch.float32, torch.bfloat16, "float32 over bf16", "float32 over int8",
                 "bf16 over int8"]  # fmt: skip


def _kernel_types(dtype) -> tuple[torch.dtype, torch.dtype]:
    """(queries' dtype, cache's dtype) of a kernel test's `dtype`."""
    if isinstance(dtype, torch.dtype):
        return dtype, dtype
    q, cache = dtype.split(" over ")
    return getattr(torch, q.replace("bf16", "bfloat16")), getattr(
        torch, cache.replace("bf16", "bfloat16")
    )


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_a_decode_only_step_writes_and_attends_in_one_kernel_call(dtype):
    """A step of decode rows only takes the kernel's one-call path (the cache writes and the
    attention in C++): the caches hold exactly what the reference backend writes (converted or
    quantized the same way), the output is attention by hand over them, and no tensor
    operation runs on the way."""
    q_dtype, kv_dtype = _kernel_types(dtype)
    caches, q, k, v, layout = _batch(6, 2, 16, q_dtype, contiguous=False)
    q, k, v, layout = q[:4], k[:4], v[:4], _decodes(layout)
    caches = _narrow_cache(caches.float(), kv_dtype)
    ref_caches = caches.clone()
    backend = CpuPagedAttentionBackend(q_dtype, AttentionShape(6, 2, 16), KERNEL, kv_dtype)
    if not backend.decode_kernel:
        pytest.skip("the C++ decode kernel is not built here")
    meta = backend.metadata_builder(64, torch.device("cpu")).build(layout)
    out = torch.full((4, 6 * 16), float("nan"), dtype=q_dtype)
    k_cache, v_cache = caches
    with profile() as prof:
        backend.forward(q, k, v, k_cache, v_cache, out, meta, 16**-0.5)
    assert {e.key for e in prof.key_averages()} == {"kiln::cpu_paged_attention"}
    reference = CpuPagedAttentionBackend(q_dtype, AttentionShape(6, 2, 16), FRAGMENTS_GATHERED,
                                         kv_dtype)  # fmt: skip
    _run(reference, ref_caches, q, k, v, layout)
    assert torch.equal(caches, ref_caches)
    want = _by_hand(_cache_values(caches), q.double(), layout, FIRSTS[:4], Q_LENS[:4])
    tol = 1e-5 if q_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)


def test_a_padded_decode_only_step_zeroes_its_padding_and_changes_nothing():
    backend = _backend(torch.float32, KERNEL)
    if not backend.decode_kernel:
        pytest.skip("the C++ decode kernel is not built here")
    caches, q, k, v, layout = _batch(6, 2, 16, torch.float32, contiguous=False)
    q, k, v, layout = q[:4], k[:4], v[:4], _decodes(layout)
    unpadded_caches = caches.clone()
    unpadded = _run(backend, unpadded_caches, q, k, v, layout)
    padded = _run(backend, caches, q, k, v, layout, pad=3)
    assert torch.equal(padded[:4], unpadded)
    assert padded[4:].abs().max() == 0
    assert torch.equal(caches, unpadded_caches)  # padding rows write nothing


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(9, 3, 64), (16, 8, 128), (8, 1, 32), (4, 4, 8)], ids=str)
@pytest.mark.parametrize("build", BUILDS)
def test_the_kernel_matches_attention_by_hand(dtype, shape, build):
    """Decode rows of 8, 13, 16 and 31 keys (mid-block and block edges, fragmented blocks) at
    real models' head dims (SmolLM2's 9/3 x 64, Qwen3's 16/8 x 128) and odd ones that take the
    kernel's scalar loops, against float64 by hand; every build of the kernel this CPU runs:
    its own, bf16 rows scored by pair products and by FMAs (forced either way), AVX-512
    without BF16 dot products, AVX-512 with VNNI (an int8 cache's keys scored
    by integer dot products: the reference's queries quantized alike), AVX2 with FMA, and the
    portable loops; float32,
    bf16, queries over a bf16 cache (--kv-cache-dtype bfloat16) and over an int8 one (values
    and a scale per head row)."""
    heads, kv_heads, dim = shape
    kernel = _kernel_build(build)
    dtype, kv_dtype = _kernel_types(dtype)
    caches, q, k, v, layout = _batch(heads, kv_heads, dim, dtype, contiguous=False, seed=1)
    caches = _narrow_cache(caches, kv_dtype)
    layout = _decodes(layout)  # this step's keys and values written as the op writes them:
    written = _narrow_cache(torch.stack([k[:4], v[:4]]), kv_dtype)
    caches.view(2, -1, kv_heads, caches.shape[-1]).index_copy_(1, layout.slot_mapping[:4], written)
    out = torch.full((4, heads, dim), float("nan"), dtype=dtype)
    tables, lens = layout.block_tables[:4].int().contiguous(), layout.seq_lens[:4].int()
    kernel.run(q[:4].contiguous(), caches[0], caches[1], tables, lens, out, dim**-0.5)
    queries = _queries_as_scored(kernel, q[:4], kv_dtype)
    want = _by_hand(_cache_values(caches), queries, layout, FIRSTS[:4], [1] * 4)
    for row in range(4):
        bound = functools.partial(_decode_row_rounding, caches, queries, layout, row)
        _assert_attention(kernel, out[row], want[row].view(heads, dim), kv_dtype, 1e-5, bound)


def _queries_as_scored(kernel, q: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    """The queries the kernel scores keys with: over an int8 cache, where its build has integer
    dot products (AVX512-VNNI), each head's query quantized as the cache's rows are."""
    if kv_dtype == torch.int8 and kernel.int8_queries(q.shape[-1]):
        return dequantize(quantize(q), torch.float64)
    return q


def _weight_rounding(scores: torch.Tensor, v_rows: torch.Tensor) -> torch.Tensor:
    """The most each output [heads, dim] of one decode row may move when an int8 cache's values
    take 8-bit weights (decode_int8.h): a weight w_j = p_j * s_j (s_j key j's value-row scale)
    moves by at most half a unit, a unit being its step's largest weight over 255. A step is 32
    keys wherever the row's ranges start, so key j's step lies within keys j - 31 .. j + 31 and
    its unit is at most their largest w over 255: output d moves by at most
    sum_j max(w_{j-31..j+31}) / 510 * |q_jd| (p summing to 1, q the int8 values).
    scores [heads, n]; v_rows [n, heads, dim + 4], the value rows each query head reads."""
    p = torch.softmax(scores.double(), -1)
    scale = v_rows[..., -4:].contiguous().view(torch.float32)[..., 0].double().T  # [heads, n]
    near = torch.nn.functional.max_pool1d((p * scale)[:, None], 63, stride=1, padding=31)[:, 0]
    return torch.einsum("hn,nhd->hd", near / 510, v_rows[..., :-4].double().abs())


def _decode_row_rounding(caches, queries, layout, row: int) -> torch.Tensor:
    """_weight_rounding for decode row `row` of _decodes' layout (its FIRSTS[row] + 1 keys)."""
    heads, dim, kv_heads = queries.shape[1], queries.shape[2], caches.shape[3]
    pos = torch.arange(FIRSTS[row] + 1)
    slots = layout.block_tables[row, pos // BS].long() * BS + pos % BS
    keys, v_rows = (c.reshape(-1, kv_heads, c.shape[-1])[slots] for c in caches)
    keys, v_rows = (x.repeat_interleave(heads // kv_heads, 1) for x in (keys, v_rows))
    scores = torch.einsum("hd,khd->hk", queries[row].double(), dequantize(keys, torch.float64))
    return _weight_rounding(scores * dim**-0.5, v_rows)


def _assert_attention(kernel, out, want, kv_dtype, exact: float, bound=None) -> None:
    """out against attention by hand: within `exact` (relative and absolute) for float32
    queries, 1e-2 for bf16 (the output's own rounding); where the kernel gives an int8 cache's
    values 8-bit weights, within that plus `bound()` (_weight_rounding), element by element."""
    tol = exact if out.dtype == torch.float32 else 1e-2
    if kv_dtype != torch.int8 or not kernel.int8_values(out.shape[-1]):
        torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
        return
    slack = bound() + tol * (1 + want.abs())
    excess = (out.double() - want).abs() - slack
    assert excess.max() <= 0, f"{excess.max():.3g} past the bound ({slack.max():.3g} at most)"


def _fragmented_caches(lens, block_size, kv_heads, dim, kv_dtype, g, in_order=False, swaps=False):
    """Block tables of requests with `lens` keys over a random permutation of the blocks (or
    the blocks in order; or in order with every 2nd and 3rd of each 4 swapped), and random
    caches of `kv_dtype` (K and V stacked) that hold them."""
    need = [-(-n // block_size) for n in lens]
    order = torch.randperm(sum(need), generator=g).int()
    if in_order or swaps:
        order = torch.arange(sum(need), dtype=torch.int32)
    if swaps:
        order = order.view(-1, 4)[:, [0, 2, 1, 3]].flatten() if len(order) % 4 == 0 else order
        assert not torch.equal(order, torch.arange(sum(need), dtype=torch.int32))
    tables = torch.zeros(len(lens), max(need), dtype=torch.int32)
    for row, table in enumerate(order.split(need)):
        tables[row, : len(table)] = table
    caches = torch.randn(2, sum(need), block_size, kv_heads, dim, generator=g)
    return tables, _narrow_cache(caches, kv_dtype)


def _kernel_build(build: str):
    """The decode kernel built as `build` names (skipped where this CPU cannot run it), checked
    to report the ISA it was built for."""
    from kiln import native
    from kiln.attention import cpu_kernel

    cpu_flags = native.cpu_flags().split()
    needs = {"avx512": ("avx512f",), "avx512-vnni": ("avx512f", "avx512vl", "avx512_vnni"),
             "avx2": ("avx2", "fma"), **dict.fromkeys(SCORES, ("avx512_bf16",)),
             INT8_FMA_VALUES: ("avx512bw", "avx512_vnni"),
             }.get(build, ())  # fmt: skip
    if any(flag not in cpu_flags for flag in needs):
        pytest.skip(f"this CPU has no {' and '.join(needs)}")
    generic = tuple(f for f in native.FLAGS if f != "-march=native")
    native_isa = (3 if "avx512_bf16" in cpu_flags else 2 if "avx512f" in cpu_flags else
                  1 if {"avx2", "fma"} <= set(cpu_flags) else 0)  # fmt: skip
    builds = {"avx512": (("-mavx512f",), 2), "avx2": (("-mavx2", "-mfma"), 1), "portable": ((), 0),
              "avx512-vnni": (("-mavx512f", "-mavx512vl", "-mavx512vnni"), 2)}  # fmt: skip
    if build == "native":
        kernel, isa = cpu_kernel.paged_decode_kernel(), native_isa
    elif build in SCORES:
        pairs, values = int(build != "fma-scores"), int(build == "pair-scores")
        kernel = cpu_kernel.load_paged_decode((*native.FLAGS, f"-DKILN_DECODE_PAIR_SCORES={pairs}",
                                               f"-DKILN_DECODE_PAIR_VALUES={values}"))  # fmt: skip
        isa = native_isa
    elif build == INT8_FMA_VALUES:
        kernel = cpu_kernel.load_paged_decode((*native.FLAGS, "-DKILN_DECODE_INT8_VALUES=0"))
        isa = native_isa
    else:
        extra, isa = builds[build]
        kernel = cpu_kernel.load_paged_decode((*generic, *extra))
    assert kernel is not None and kernel.isa == isa
    # integer dot products for int8 keys exactly where the build has AVX512-VNNI
    native_like = build in ("native", *SCORES, INT8_FMA_VALUES)
    vnni = build == "avx512-vnni" or (native_like and "avx512_vnni" in cpu_flags)
    assert kernel.int8_queries(64) == vnni and not kernel.int8_queries(48)
    # and their values with 8-bit weights where the build also has AVX512-BW, head dims % 64
    int8_values = vnni and native_like and build != INT8_FMA_VALUES and "avx512bw" in cpu_flags
    assert kernel.int8_values(64) == int8_values == kernel.int8_values(256)
    assert not kernel.int8_values(32) and not kernel.int8_values(96)
    # prefill chunks where the build has vectors and the head dim is a multiple of 8
    assert kernel.prefill_supported(64) == (isa > 0) and not kernel.prefill_supported(12)
    # bf16 chunks by AMX tile products in a native build on a CPU with AMX, head dims % 32
    amx = native_like and "amx_bf16" in cpu_flags  # where Linux grants tiles
    assert kernel.prefill_amx(64) <= amx and not kernel.prefill_amx(48)
    # bf16 decode scores by pair products where forced, or natively on AVX512-BF16 without AMX
    native_pairs = (build in ("native", INT8_FMA_VALUES) and "avx512_bf16" in cpu_flags
                    and "amx_bf16" not in cpu_flags)  # fmt: skip
    pairs = build in ("pair-scores", "pair-scores-fma-values") or native_pairs
    assert kernel.pair_scores(64) == pairs and not kernel.pair_scores(48)
    # and their values added by pair products alike, unless the build says otherwise
    values = build == "pair-scores" or native_pairs
    assert kernel.pair_values(64) == values and not kernel.pair_values(48)
    return kernel


LONG_ROW_SHAPES = [(9, 3, 64), (16, 2, 64), (12, 2, 32), (6, 2, 96), (4, 1, 256), (6, 6, 16),
                   (16, 8, 128), (8, 8, 192)]  # fmt: skip


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("shape", LONG_ROW_SHAPES, ids=str)
@pytest.mark.parametrize("build", BUILDS)
def test_the_kernel_on_long_rows_matches_attention_by_hand(dtype, shape, build):
    """Rows of 1,100, 257, 64 and 9 keys over fragmented blocks of 16: many tiles (the online
    softmax's rescaling), rows split into ranges and merged, keys scored 8 at a time with their
    remainder, and query-head groups of 3, 8 (two register groups of 4), 6 (4 + 2) and 1,
    against float64 by hand. Over an int8 cache, rows of up to 512 bytes (every KV head of a
    key) take the transposed scores and longer ones (8 KV heads of 128 or 192) the row scorer."""
    heads, kv_heads, dim = shape
    kernel = _kernel_build(build)
    dtype, kv_dtype = _kernel_types(dtype)
    g = torch.Generator().manual_seed(3)
    lens, block_size = [1100, 257, 64, 9], 16
    tables, caches = _fragmented_caches(lens, block_size, kv_heads, dim, kv_dtype, g)
    q = torch.randn(len(lens), heads, dim, generator=g).to(dtype)
    out = torch.full_like(q, float("nan"))
    kernel.run(q, caches[0], caches[1], tables, torch.tensor(lens, dtype=torch.int32), out,
               dim**-0.5)  # fmt: skip
    queries = _queries_as_scored(kernel, q, kv_dtype)
    for row, n in enumerate(lens):
        pos = torch.arange(n)
        slots = tables[row, pos // block_size].long() * block_size + pos % block_size
        keys, values = (c.reshape(-1, kv_heads, dim)[slots] for c in _cache_values(caches))
        keys, values = (x.repeat_interleave(heads // kv_heads, 1) for x in (keys, values))
        scores = torch.einsum("hd,khd->hk", queries[row].double(), keys) * dim**-0.5
        want = torch.einsum("hk,khd->hd", torch.softmax(scores, -1), values)
        v_rows = caches[1].reshape(-1, kv_heads, caches.shape[-1])[slots]
        v_rows = v_rows.repeat_interleave(heads // kv_heads, 1)
        bound = functools.partial(_weight_rounding, scores, v_rows)
        _assert_attention(kernel, out[row], want, kv_dtype, 1e-5, bound)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("nan_key", [3, 19, 23, 31, 51])
def test_a_nan_key_gets_no_weight(dtype, build, nan_key):
    """A key with a NaN element in one KV head scores NaN for that head's query heads: it takes
    no weight there, and their output is the attention over the other keys (the vector paths'
    max passes NaN on in some lanes, which once turned a whole row into NaN)."""
    kernel = _kernel_build(build)
    heads, kv_heads, dim, n = 9, 3, 64, 60
    g = torch.Generator().manual_seed(5)
    caches = torch.randn(2, 4, 16, kv_heads, dim, generator=g).to(dtype)
    caches[0].view(-1, kv_heads, dim)[nan_key, 1, 7] = float("nan")
    q = torch.randn(1, heads, dim, generator=g).to(dtype)
    out = torch.full_like(q, float("nan"))
    tables, lens = (
        torch.arange(4, dtype=torch.int32).view(1, 4),
        torch.tensor([n], dtype=torch.int32),
    )
    kernel.run(q, caches[0], caches[1], tables, lens, out, dim**-0.5)
    keys, values = (c.reshape(-1, kv_heads, dim)[:n].double() for c in caches)
    keys, values = (x.repeat_interleave(heads // kv_heads, 1) for x in (keys, values))
    scores = torch.einsum("hd,khd->hk", q[0].double(), keys) * dim**-0.5
    assert scores.isnan().sum() == heads // kv_heads  # the key's scores for KV head 1's heads
    p = torch.softmax(scores.nan_to_num(nan=float("-inf")), -1)
    want = torch.einsum("hk,khd->hd", p, values)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out[0].double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("threads", [1, 16])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize(
    "shape", [(9, 3, 64), (16, 8, 128), (12, 2, 32), (6, 6, 16), (4, 1, 24)], ids=str
)
@pytest.mark.parametrize("build", ["native", "avx512", "avx2"])
@pytest.mark.parametrize("blocks", ["fragmented", "in order", "blocks of 2, swapped"])
def test_the_prefill_kernel_matches_attention_by_hand(dtype, shape, build, threads, blocks):
    """Prefill chunks of 70, 33, 1, 16 and 40 tokens after 0, 45, 300, 16 and 14 cached keys,
    in one call, over fragmented blocks of 16: groups of 16 rows (8 on AVX2) of (token, query
    head) that end mid-chunk, key tiles across the causal diagonal and ending mid-tile, a group
    whose first row sits at the second-last key of a tile (14: masked only for the tile's last
    key), a lone token, query-head groups of 3, 8, 6, 1 and 4, real models' head dims (SmolLM2's
    9/3 x 64, Qwen3's 16/8 x 128) and one not a multiple of 16 (24: the widening loops' tails);
    one thread (work items of several groups sharing each tile) and 16 (one group each);
    float32, bf16, and queries over a bf16 or an int8 cache, against float64 by hand over what
    the cache holds. Blocks in order too: on a CPU with AMX, bf16 over bf16 takes tile products
    over steps of 32 keys that read each half's 16 keys in place where they lie evenly apart,
    and a copy of them where not (fragmented blocks, a context's last keys); and blocks of 2
    keys in order but for swapped neighbours, where a half's 8 blocks can end 15 rows apart
    with the ones between out of order."""
    heads, kv_heads, dim = shape
    kernel = _kernel_build(build)
    dtype, kv_dtype = _kernel_types(dtype)
    g = torch.Generator().manual_seed(5)
    tokens, cached = [70, 33, 1, 16, 40], [0, 45, 300, 16, 14]
    block_size = 2 if blocks.endswith("swapped") else 16
    lens = [c + n for c, n in zip(cached, tokens)]
    tables, caches = _fragmented_caches(
        lens, block_size, kv_heads, dim, kv_dtype, g, blocks == "in order", block_size == 2
    )
    q = torch.randn(sum(tokens), heads, dim, generator=g).to(dtype)
    starts = torch.tensor([0, *np.cumsum(tokens)], dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kernel.prefill(q, caches[0], caches[1], tables, starts,
                       torch.tensor(lens, dtype=torch.int32), out, dim**-0.5)  # fmt: skip
    finally:
        torch.set_num_threads(before)
    for row, (first, n) in enumerate(zip(cached, tokens)):
        pos = torch.arange(first + n)
        slots = tables[row, pos // block_size].long() * block_size + pos % block_size
        keys, values = (c.reshape(-1, kv_heads, dim)[slots] for c in _cache_values(caches))
        keys, values = (x.repeat_interleave(heads // kv_heads, 1) for x in (keys, values))
        chunk = q[starts[row] : starts[row + 1]].double()
        scores = torch.einsum("thd,khd->htk", chunk, keys) * dim**-0.5
        hidden = pos[None, :] > first + torch.arange(n)[:, None]  # keys past a token's position
        p = torch.softmax(scores.masked_fill(hidden, float("-inf")), -1)
        want = torch.einsum("htk,khd->thd", p, values)
        tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding
        torch.testing.assert_close(out[starts[row] : starts[row + 1]].double(), want, rtol=tol,
                                   atol=tol)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("build", ["native", "avx512"])
def test_the_prefill_kernel_follows_scores_that_climb_tile_by_tile(dtype, build):
    """Scores that rise by 10 a tile of 16 keys (KV head 0's queries), by 5 (head 1's) and fall
    by 3 (head 2's): on AMX tiles the running max moves only when a score passes it by more than
    8, so head 0's sums are rescaled at every tile, head 1's every other tile and head 2's never
    after the first. The output must be the softmax's either way: mostly the last tile's values
    for head 0, a spread for head 1, the first tile's for head 2."""
    kernel = _kernel_build(build)
    heads, kv_heads, dim, cached, tokens = 9, 3, 64, 20, 100
    n = cached + tokens
    g = torch.Generator().manual_seed(7)
    direction = torch.nn.functional.normalize(torch.randn(dim, generator=g), dim=0)
    steps = torch.tensor([10.0, 5.0, -3.0])
    slots = 128  # 8 blocks of 16, the last one partly used
    ramp = steps[None, :] * (torch.arange(slots) // 16)[:, None].float()  # [keys, KV heads]
    noise = 0.1 * torch.randn(slots, kv_heads, dim, generator=g)
    keys = ramp[..., None] * direction * dim**0.5 + noise
    caches = torch.stack([keys, torch.randn(slots, kv_heads, dim, generator=g)])
    caches = caches.view(2, -1, 16, kv_heads, dim).to(dtype)
    q = (direction + 0.1 * torch.randn(tokens, heads, dim, generator=g)).to(dtype)
    tables = torch.arange(caches.shape[1], dtype=torch.int32)[None]
    starts = torch.tensor([0, tokens], dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    kernel.prefill(q, caches[0], caches[1], tables, starts, torch.tensor([n], dtype=torch.int32),
                   out, dim**-0.5)  # fmt: skip
    k, v = (c.reshape(-1, kv_heads, dim)[:n].double().repeat_interleave(3, 1) for c in caches)
    scores = torch.einsum("thd,khd->htk", q.double(), k) * dim**-0.5
    hidden = torch.arange(n)[None, :] > cached + torch.arange(tokens)[:, None]
    p = torch.softmax(scores.masked_fill(hidden, float("-inf")), -1)
    want = torch.einsum("htk,khd->thd", p, v)
    tol = 1e-4 if dtype == torch.float32 else 1e-2  # float32: scores up to 70 round by 4e-6
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "float32 over int8"], ids=str)
@pytest.mark.parametrize("build", ["native", *SCORES, INT8_FMA_VALUES, "avx512"])
def test_the_decode_kernel_follows_scores_that_climb_step_by_step(dtype, build):
    """Decode rows over keys whose scores rise by 10 every 16 keys (KV head 0's queries), by 3
    (head 1's) and fall by 3 (head 2's): the bf16 path moves a head's running max only when a
    score passes it by more than 8, so head 0's sums are rescaled at every step of 32 keys, head
    1's every other step, head 2's never after the first. Rows of 600 keys (split into ranges
    and merged) and 37 must still get the softmax: mostly the last keys' values for head 0, a
    spread for head 1, the first keys' for head 2. Over an int8 cache the same holds for the
    path with 8-bit weights (each step's weights quantized against that step's largest)."""
    kernel = _kernel_build(build)
    dtype, kv_dtype = _kernel_types(dtype)
    heads, kv_heads, dim, lens = 9, 3, 64, [600, 37]
    g = torch.Generator().manual_seed(11)
    direction = torch.nn.functional.normalize(torch.randn(dim, generator=g), dim=0)
    slots = 640  # 10 blocks of 64
    ramp = torch.tensor([10.0, 3.0, -3.0])[None, :] * (torch.arange(slots) // 16)[:, None]
    keys = ramp[..., None] * direction * dim**0.5 / 8 + 0.1 * torch.randn(
        slots, kv_heads, dim, generator=g
    )
    caches = torch.stack([keys, torch.randn(slots, kv_heads, dim, generator=g)])
    caches = _narrow_cache(caches.view(2, -1, 64, kv_heads, dim), kv_dtype)
    q = (8 * direction + 0.1 * torch.randn(len(lens), heads, dim, generator=g)).to(dtype)
    tables = torch.arange(10, dtype=torch.int32).expand(len(lens), -1).contiguous()
    out = torch.full_like(q, float("nan"))
    kernel.run(q, caches[0], caches[1], tables, torch.tensor(lens, dtype=torch.int32), out,
               dim**-0.5)  # fmt: skip
    k, v = (c.reshape(-1, kv_heads, dim).repeat_interleave(3, 1) for c in _cache_values(caches))
    v_rows = caches[1].reshape(-1, kv_heads, caches.shape[-1]).repeat_interleave(3, 1)
    queries = _queries_as_scored(kernel, q, kv_dtype)
    for row, n in enumerate(lens):
        scores = torch.einsum("hd,khd->hk", queries[row].double(), k[:n]) * dim**-0.5
        want = torch.einsum("hk,khd->hd", torch.softmax(scores, -1), v[:n])
        bound = functools.partial(_weight_rounding, scores, v_rows[:n])
        _assert_attention(kernel, out[row], want, kv_dtype, 1e-4, bound)


def test_an_unknown_decode_kernel_choice_is_refused():
    with pytest.raises(ValueError, match='"auto", "on" or "off"'):
        _backend(torch.float32, CpuAttentionTuning(decode_kernel="yes"))
    with pytest.raises(ValueError, match='"auto" or "off"'):
        _backend(torch.float32, CpuAttentionTuning(prefill_kernel="on"))


def test_cpu_flash_is_the_cpu_backend_without_the_kernel():
    """`--attention-backend cpu-flash` keeps every row on the flash-kernel paths (the way back
    if the kernel misbehaves, and the A/B of the benchmarks); `cpu` takes the kernel where it
    was built with AVX2 or AVX-512."""
    from kiln import native
    from kiln.attention import cpu_kernel
    from kiln.attention.selector import select_backend

    shape, cpu = AttentionShape(9, 3, 64), torch.device("cpu")
    flash = select_backend("cpu-flash", cpu, BS, shape, torch.bfloat16)
    assert (flash.name, flash.decode_kernel) == ("cpu-flash", False)
    with_kernel = select_backend("cpu", cpu, BS, shape, torch.bfloat16)
    assert with_kernel.name == "cpu"
    assert with_kernel.decode_kernel == cpu_kernel.paged_decode_kernel().vectorized
    # `kiln info` and /v1/engine say which kernels were taken, and why not
    assert flash.describe() == "cpu-flash (flash kernel throughout; the C++ decode kernel: off)"
    assert not flash.prefill_kernel
    if with_kernel.decode_kernel:
        assert with_kernel.describe().startswith("cpu (decode rows: C++ kernel built with AVX")
        # bf16 chunks over a bf16 cache by AMX tile products where the CPU has them
        tiles = cpu_kernel.paged_decode_kernel().prefill_amx(64)
        assert tiles <= ("amx_bf16" in native.cpu_flags().split())
        suffix = "; prefill: C++ kernel on AMX tiles)" if tiles else "; prefill: C++ kernel)"
        assert with_kernel.describe().endswith(suffix)
        assert with_kernel.prefill_kernel
    fp16 = select_backend("cpu", cpu, BS, shape, torch.float16)
    assert "not for this dtype or head shape" in fp16.describe()
    # an int8 cache says when its keys are scored with quantized queries (VNNI builds)
    int8 = select_backend("cpu", cpu, BS, shape, torch.float32, torch.int8)
    vnni = int8.decode_kernel and cpu_kernel.paged_decode_kernel().int8_queries(64)
    assert ("int8 queries" in int8.describe()) == vnni
    # the prefill kernel reads an int8 cache too (its rows dequantized 16 keys at a time)
    assert int8.prefill_kernel == with_kernel.prefill_kernel


def test_the_kernel_a_b_benchmark_times_two_builds_on_the_same_inputs():
    """benchmarks/decode_kernel_ab.py loads a kernel per source and runs both on one batch: two
    builds of one source give the same output bit for bit, rows on their own blocks or (--hot)
    all on the same ones."""
    from kiln.attention import cpu_kernel
    from tests.helpers import load_benchmark

    ab = load_benchmark("decode_kernel_ab")
    kernels = [ab.load(cpu_kernel.SOURCE) for _ in range(2)]
    for dtypes, hot in [(ab.DTYPES["f32/bf16"], False), (ab.DTYPES["bf16"], True)]:
        ms, diff = ab.compare(kernels, (9, 3, 64), dtypes, 2, 40, repeats=1, hot=hot)
        assert diff == 0.0 and len(ms) == 2 and all(t > 0 for t in ms)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("build", ["native", "portable"])
def test_the_kernels_int8_writes_equal_the_reference_quantizer(dtype, build):
    """The C++ writer the CPU backend quantizes an int8 cache with is bit for bit
    kv_int8.quantize (the torch backend's): rows of random values, a zero row (scale 0), and
    values on rounding ties (x / scale = k + 0.5 exactly), at scattered slots."""
    kernel = _kernel_build(build)
    g = torch.Generator().manual_seed(5)
    rows = torch.randn(6, 3, 64, generator=g) * torch.tensor([0.01, 1.0, 40.0])[:, None]
    rows[1, 2] = 0
    rows[2, 0] = torch.arange(64) - 31.5  # max 32.5: scale 32.5 / 127, ties after division
    rows = rows.to(dtype)
    slots = torch.tensor([7, 0, 3, 11, 5, 9])
    cache = torch.zeros(12, 3, 68, dtype=torch.int8)
    kernel.write_int8(rows, slots, cache)
    assert torch.equal(cache[slots], quantize(rows))
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[slots] = False
    assert not cache[untouched].any()


def test_int8_query_products_add_little_to_the_int8_caches_own_error():
    """Over an int8 cache an AVX512-VNNI build scores keys with the query quantized per head
    (as llama.cpp's q8_0 cache does). Against exact attention over the float keys and values
    (an outlier channel, as real keys have), that adds little to what quantizing the cache
    already costs: the error stays within 1.5x of the same kernel's with float32 queries (a
    wrong offset or scale in the integer path is off by the output's whole size)."""
    from kiln.attention import cpu_kernel

    vnni = _kernel_build("avx512-vnni")
    plain = _kernel_build("avx512")
    g = torch.Generator().manual_seed(5)
    errors = _errors_against_exact_attention((plain, vnni), 1024, g, query_outlier=4.0)
    assert isinstance(vnni, cpu_kernel.PagedDecodeKernel) and vnni.int8_queries(64)
    assert 0 < errors[1] <= 1.5 * errors[0], errors


def _errors_against_exact_attention(kernels, n: int, g, query_outlier=1.0, sharpness=1.0):
    """Each kernel's largest error, relative to the largest output, over one decode row of n
    keys of an int8 cache (9/3 heads of 64, an outlier channel in the keys and values) against
    exact attention over the float keys and values."""
    heads, kv_heads, dim = 9, 3, 64
    values = torch.randn(2, n // BS + 1, BS, kv_heads, dim, generator=g)
    values[..., 5] *= 8
    q = sharpness * torch.randn(1, heads, dim, generator=g)
    q[..., 5] *= query_outlier
    cache = quantize(values)
    tables = torch.arange(1, n // BS + 1, dtype=torch.int32)[None].contiguous()
    lens = torch.tensor([n], dtype=torch.int32)
    keys, vals = (x.reshape(-1, kv_heads, dim)[BS : BS + n].double().repeat_interleave(3, 1)
                  for x in values)  # fmt: skip
    p = torch.softmax(torch.einsum("hd,khd->hk", q[0].double(), keys) * dim**-0.5, -1)
    exact = torch.einsum("hk,khd->hd", p, vals)
    errors = []
    for kernel in kernels:
        out = torch.empty(1, heads, dim)
        kernel.run(q, cache[0], cache[1], tables, lens, out, dim**-0.5)
        errors.append((out[0].double() - exact).abs().max().item() / exact.abs().max().item())
    return errors


@pytest.mark.parametrize("sharpness", [1.0, 4.0], ids=["spread", "peaked"])
def test_8_bit_weights_add_little_to_the_int8_caches_own_error(sharpness):
    """Over an int8 cache a build with AVX512-VNNI and BW adds values by integer products, each
    step's weights (times their rows' scales) quantized to 8 bits against the step's largest.
    Against exact attention over the float keys and values (an outlier channel, softmax spread
    or peaked, 1,000 and 7,000 keys), that adds little to what quantizing the cache already
    costs: the error stays within 1.25x of the same build's with float32 FMAs for values."""
    quantized = _kernel_build("native")
    if not quantized.int8_values(64):
        pytest.skip("this CPU has no AVX512-VNNI with AVX512-BW: values take float32 FMAs")
    fma = _kernel_build(INT8_FMA_VALUES)
    for n in (1000, 7000):
        g = torch.Generator().manual_seed(n)
        errors = _errors_against_exact_attention((fma, quantized), n, g, sharpness=sharpness)
        assert 0 < errors[1] <= 1.25 * errors[0], (n, errors)
