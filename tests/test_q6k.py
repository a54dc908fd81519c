"""GGUF's Q6_K kept packed on the CPU: the loader's reading of the blocks against the gguf
package's dequantization, kiln's layout read back exactly, the kernel's vector path against its
portable loops (bit for bit) and against float64 by hand, and the packed layer's paths."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kiln.layers.int4_kernel import quantized_rows
from kiln.layers.linear import Linear, onednn_runs
from kiln.layers.packed import DEQUANT_MIN_ROWS, QuantizedTensor
from kiln.layers.packed_q6k import PackedQ6K
from kiln.layers.q6k_kernel import load_q6k_matmul, q6k_matmul_kernel
from kiln.layers.q6k_layout import Q6KCodes, Q6KPacked, pack_q6k, q6k_dequantize, q6k_rows
from kiln.loader.gguf_quant import gguf_codes
from tests.gguf_files import quantize_q6_k
from tests.helpers import assert_grouped_calls_equal_calls_alone, kernel_builds

CPU = torch.device("cpu")
needs_kernel = pytest.mark.skipif(
    q6k_matmul_kernel() is None, reason="kiln's Q6_K kernel needs AVX2 with FMA and a C++ compiler"
)


def _q6_k(n: int, k: int, seed: int = 0) -> tuple[np.ndarray, QuantizedTensor]:
    """Random weights quantized to Q6_K blocks: (the gguf package's dequantization, the
    loader's codes)."""
    x = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    blocks = quantize_q6_k(x)
    want = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q6_K).reshape(n, k)
    return want, gguf_codes("Q6_K", blocks, (n, k))


def _random_codes(n: int, k: int, seed: int = 0) -> Q6KCodes:
    """Every code and scale value reachable (the quantizer's output never uses some)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 64, (n, k), dtype=torch.uint8, generator=g)
    sub_scale = torch.randint(-128, 128, (n, k // 16), generator=g).to(torch.int8)
    return Q6KCodes(codes, sub_scale, torch.rand(n, k // 256, generator=g) / 100)


def test_the_loader_reads_q6_k_blocks_exactly():
    """Codes, sub-scales and d read from the blocks give the gguf package's values bit for bit,
    and so does the packed layout read back, whole and by rows (an embedding lookup),
    across a padded last block of rows."""
    want, t = _q6_k(70, 512)
    assert t.kind == "Q6_K" and isinstance(t.planes[0], Q6KCodes)
    assert np.array_equal(t.dequantize().numpy(), want)
    packed = pack_q6k(t.planes[0])
    assert packed.sub_scales.shape == (512 // 16, 128)  # rows padded to the block of 64
    back = q6k_dequantize(packed)
    assert np.array_equal(back[:70].numpy(), want) and not back[70:].any()
    ids = torch.tensor([0, 69, 31, 32, 63, 64, 15, 16])
    assert np.array_equal(q6k_rows(packed, ids).numpy(), want[ids.numpy()])


def _builds() -> list:
    return kernel_builds(load_q6k_matmul, q6k_matmul_kernel)


@pytest.mark.parametrize("planes", [1, 2])
def test_the_kernel_equals_the_product_by_hand(planes):
    """Rows 1, 2, 3, 5 and 17 (the AVX-512 path's register blocks of rows and their remainder,
    the AVX2 path's tiles of 16) of one or two int8 planes, on each build: within float32 noise
    of float64 on the same quantized rows; each vector path equals the portable loops bit for bit
    (the same sums in the same order); two planes within 1e-4 of the float32 rows' exact
    product, one plane within the 8 bits it keeps."""
    w = pack_q6k(_random_codes(100, 768))
    weight = q6k_dequantize(w).double().t()
    for name, kernel in _builds():
        assert kernel.vectorized == (name != "portable")
        assert name != "avx2" or kernel.isa == 1
        for rows in (1, 2, 3, 5, 17):  # 17: past the AVX2 path's tile of 16 rows
            x = torch.randn(rows, 768)
            y = kernel.matmul(x, w, torch.float32, planes, portable=name == "portable")
            want = quantized_rows(x, planes) @ weight
            scale = (x.double().abs() @ weight.abs()).max().item()
            torch.testing.assert_close(y.double(), want, rtol=0, atol=1e-6 * scale)
            exact = x.double() @ weight
            bound = 1e-4 if planes == 2 else 2e-2
            torch.testing.assert_close(y.double(), exact, rtol=0, atol=bound * scale)
            if name != "portable":
                assert torch.equal(y, kernel.matmul(x, w, torch.float32, planes, portable=True))


def test_each_builds_grouped_call_equals_a_call_per_expert():
    """The grouped entry on every vector build equals a call per expert, bit for bit."""
    weights = [pack_q6k(_random_codes(128, 512, seed=e)) for e in range(3)]
    assert_grouped_calls_equal_calls_alone(_builds(), weights, Q6KPacked)


def test_the_kernels_casts_and_dequantization():
    """bf16 rows widen exactly and a bf16 output rounds once from the float32 sums; the
    large-batch weight is the exact product in float32 and its one rounding in bf16."""
    w = pack_q6k(_random_codes(64, 256, seed=3))
    x = torch.randn(3, 256)
    f32, bf16 = torch.float32, torch.bfloat16
    for _, kernel in _builds():
        for x_dtype, out_dtype in ((f32, bf16), (bf16, f32), (bf16, bf16)):
            xi = x.to(x_dtype)
            want = kernel.matmul(xi.float().contiguous(), w, f32).to(out_dtype)
            assert torch.equal(kernel.matmul(xi, w, out_dtype), want)
        for dtype in (f32, bf16):
            assert torch.equal(kernel.dequantize_t(w, dtype), q6k_dequantize(w).t().to(dtype))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_packed_layer_runs_both_paths(dtype):
    """A Q6_K layer of 100 outputs (padded to 128) and a bias: a decode batch through the
    kernel, a large batch through the dequantized weight, each against the dense product."""
    want_w, t = _q6_k(100, 512, seed=5)
    linear = Linear(512, 100, bias=True).to(dtype)
    linear.bias.data.normal_()
    linear.load_weight("w", t)
    assert (
        linear.layout == "q6_k" and linear.weight is None and isinstance(linear.packed, PackedQ6K)
    )
    dense = torch.from_numpy(want_w).double()
    for rows in (1, 7, DEQUANT_MIN_ROWS + 3):
        x = torch.randn(rows, 512).to(dtype)
        y = linear(x)
        assert y.dtype == dtype and y.shape == (rows, 100)
        want = x.double() @ dense.t() + linear.bias.double()
        scale = (x.double().abs() @ dense.abs().t()).max().item()
        bound = 1e-4 if dtype == torch.float32 else 2**-7  # two int8 planes; a half output
        torch.testing.assert_close(y.double(), want, rtol=0, atol=bound * scale)
    assert torch.equal(linear.packed.dequantize(), torch.from_numpy(want_w))


@needs_kernel
def test_a_fused_layer_of_q6_k_and_int4_parts_stays_packed():
    """Fused q, k, v all in Q6_K are one packed matrix; Q4_0 q and k beside a Q6_K v (as in
    llama.cpp's Q4_K_M files) are two packed runs whose outputs concatenate, on both paths of
    each."""
    from kiln.layers.packed_parts import PackedParts
    from kiln.loader.gguf import take_rows

    want, t = _q6_k(192, 256, seed=7)
    fused = Linear(256, 192)
    for first in (0, 64, 128):
        fused.load_weight(f"part{first}", take_rows(t, (first, 64)), slice(first, first + 64))
    assert fused.layout == "q6_k"
    assert torch.equal(fused.packed.dequantize(), torch.from_numpy(want))
    blocks = gguf.quants.quantize(want[:128], gguf.GGMLQuantizationType.Q4_0)
    qk = gguf_codes("Q4_0", blocks, (128, 256))
    mixed = Linear(256, 192)
    mixed.load_weight("v", take_rows(t, (128, 64)), slice(128, 192))
    mixed.load_weight("q", take_rows(qk, (0, 64)), slice(0, 64))
    mixed.load_weight("k", take_rows(qk, (64, 64)), slice(64, 128))
    assert mixed.layout == "parts" and isinstance(mixed.packed, PackedParts)
    assert [p.layout for p in mixed.packed.products()] == ["int4", "q6_k"]
    dense = torch.cat([qk.dequantize(), torch.from_numpy(want[128:])])
    torch.testing.assert_close(
        mixed.packed.dequantize(), dense, rtol=0, atol=2**-8 * dense.abs().max().item()
    )
    for rows in (1, DEQUANT_MIN_ROWS):
        x = torch.randn(rows, 256)
        want_y = x.double() @ mixed.packed.dequantize().double().t()
        scale = (x.double().abs() @ dense.abs().double().t()).max().item()
        torch.testing.assert_close(mixed(x).double(), want_y, rtol=0, atol=1e-4 * scale)


@needs_kernel
@pytest.mark.skipif(not onednn_runs(torch.bfloat16), reason="no native oneDNN bf16 kernels")
def test_dense_copies_for_prefill_are_kept_per_packed_run():
    """--prefill-weights dense on a bf16 layer of Q4_0 and Q6_K runs: each run keeps its own
    copy; a batch from the copies' switch on equals the dense product within bf16 rounding,
    a decode row still goes through the packed kernels (the same values as without copies)."""
    from kiln.boot.prefill_weights import keep_dense_copies

    want, t = _q6_k(64, 256, seed=9)
    blocks = gguf.quants.quantize(want, gguf.GGMLQuantizationType.Q4_0)
    q = gguf_codes("Q4_0", blocks, (64, 256))
    layer = Linear(256, 128).to(torch.bfloat16)
    layer.load_weight("q", q, slice(0, 64))
    layer.load_weight("v", t, slice(64, 128))
    one_row = torch.randn(1, 256).bfloat16()
    before = layer(one_row)
    keep_dense_copies(torch.nn.Sequential(layer), torch.bfloat16, CPU, "dense")
    assert all(p.dense is not None for p in layer.packed.products())
    assert torch.equal(layer(one_row), before)
    x = torch.randn(16, 256).bfloat16()
    dense = layer.packed.dequantize()
    ref = x.float() @ dense.t()
    torch.testing.assert_close(layer(x).float(), ref, rtol=0, atol=2**-7 * ref.abs().max().item())


@needs_kernel
def test_the_op_and_its_fake_agree():
    """torch.compile traces the op through its fake: dtype and shape on both paths, for each
    rows dtype (fp16 rows come back float32, rounded once by the layer), and the kernel refuses
    rows of the wrong width instead of reading past them."""
    w = pack_q6k(_random_codes(64, 256, seed=4))
    tensors = (w.low, w.high, w.sub_scales, w.d)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for rows in (1, DEQUANT_MIN_ROWS):
            x = torch.randn(rows, 256).to(dtype)
            torch.library.opcheck(torch.ops.kiln.q6k_mm.default, (x, *tensors, None, 2))
            y = torch.ops.kiln.q6k_mm(x, *tensors, None, 2)
            assert y.dtype == (torch.float32 if dtype == torch.float16 else dtype)
    with pytest.raises(ValueError, match="256 columns"):
        q6k_matmul_kernel().matmul(torch.randn(1, 100), w, torch.float32)
