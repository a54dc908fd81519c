"""GGUF's Q5_K kept packed on the CPU (and Q4_K on the same kernel): the loader's reading of the
blocks against the gguf package's dequantization, kiln's layout read back exactly, the kernel's
vector path against its portable loops (bit for bit) and against float64 by hand, and the packed
layer's paths."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kiln.layers.int4_kernel import quantized_rows
from kiln.layers.kquant_kernel import kquant_matmul_kernel, load_kquant_matmul, random_codes
from kiln.layers.kquant_layout import (
    KQuantCodes,
    KQuantPacked,
    kquant_codes,
    kquant_dequantize,
    kquant_rows,
    pack_kquant,
)
from kiln.layers.linear import Linear
from kiln.layers.packed import DEQUANT_MIN_ROWS, QuantizedTensor
from kiln.layers.packed_kquant import PackedKQuant
from kiln.loader.gguf_quant import gguf_codes
from tests.gguf_files import quantize_q5_k
from tests.helpers import assert_grouped_calls_equal_calls_alone, kernel_builds

CPU = torch.device("cpu")

needs_kernel = pytest.mark.skipif(
    kquant_matmul_kernel() is None,
    reason="kiln's K-quant kernel needs AVX2 with FMA and a C++ compiler",
)


def _q5_k(n: int, k: int, seed: int = 0) -> tuple[np.ndarray, QuantizedTensor]:
    """Random weights quantized to Q5_K blocks: (the gguf package's dequantization, the
    loader's codes)."""
    x = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    blocks = quantize_q5_k(x)
    want = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q5_K).reshape(n, k)
    return want, gguf_codes("Q5_K", blocks, (n, k))


def test_q4_k_is_read_for_either_kernel():
    """A Q4_K matrix read for the K-quant kernel is exact (the gguf package's values bit for
    bit); where that kernel does not run (here: a CUDA device) it becomes the int4 plane the
    loader made before, with the same values up to the int4 kernels' bf16 scales."""
    from kiln.layers.packed import Int4Codes, for_device

    x = np.random.default_rng(2).standard_normal((64, 512)).astype(np.float32)
    blocks = quantize_q5_k(x, bits=4)
    want = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_K).reshape(64, 512)
    exact = gguf_codes("Q4_K", blocks, (64, 512), exact_q4_k=True)
    plane = gguf_codes("Q4_K", blocks, (64, 512))
    assert isinstance(exact.planes[0], KQuantCodes) and exact.planes[0].bits == 4
    assert isinstance(plane.planes[0], Int4Codes)
    assert np.array_equal(exact.dequantize().numpy(), want)
    on_cuda = for_device(exact, torch.device("cuda"))
    assert isinstance(on_cuda.planes[0], Int4Codes) and on_cuda.kind == "Q4_K"
    for field in ("codes", "scale", "zero"):
        assert torch.equal(getattr(on_cuda.planes[0], field), getattr(plane.planes[0], field))
    on_cpu = for_device(exact, CPU)
    if kquant_matmul_kernel() is not None:
        assert on_cpu is exact
    else:
        assert isinstance(on_cpu.planes[0], Int4Codes)


@pytest.mark.parametrize(
    ("kquant_isa", "int4_isa", "stays"),
    [(2, 2, True), (1, 1, True), (1, 2, False), (1, None, True), (None, 2, False)],
)
def test_q4_k_takes_the_k_quant_kernel_where_its_path_is_as_wide(
    monkeypatch, kquant_isa, int4_isa, stays
):
    """AVX512-VNNI (both kernels' widest paths) and AVX2 CPUs keep Q4_K on the K-quant kernel;
    Skylake and Cascade Lake (AVX-512 without VBMI: the K-quant kernel's AVX2 path beside the int4
    kernel's AVX-512 float path) make it an int4 plane, as a CPU without the K-quant kernel does."""
    import kiln.layers.packed as packed
    from kiln.layers.packed import Int4Codes, for_device

    class Built:
        def __init__(self, isa):
            self.isa = isa

    monkeypatch.setattr(packed, "kquant_matmul_kernel", lambda: kquant_isa and Built(kquant_isa))
    monkeypatch.setattr(packed, "int4_matmul_kernel", lambda: int4_isa and Built(int4_isa))
    exact = QuantizedTensor("Q4_K", [_random(64, 256, 4)])
    on_cpu = for_device(exact, CPU)
    assert (on_cpu is exact) if stays else isinstance(on_cpu.planes[0], Int4Codes)


def test_a_hybrid_fused_projection_of_q4_k_and_another_format():
    """The hybrid loader's [qkv; z] of a Q4_K and a Q4_0 half stays quantized as int4 planes; a
    Q4_K and a Q5_K half (no shared form) become dense, each value kept."""
    from kiln.loader.gguf_hybrid import _cat

    x = np.random.default_rng(3).standard_normal((64, 256)).astype(np.float32)
    q4k = gguf_codes("Q4_K", quantize_q5_k(x, bits=4), (64, 256), exact_q4_k=True)
    q40 = gguf_codes("Q4_0", gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q4_0), (64, 256))
    q5k = gguf_codes("Q5_K", quantize_q5_k(x), (64, 256))
    both = _cat(q4k, q40)
    assert isinstance(both, QuantizedTensor) and both.shape == (128, 256)
    want = torch.cat([q4k.dequantize(), q40.dequantize()])
    torch.testing.assert_close(both.dequantize(), want, rtol=1e-6, atol=1e-7)
    mixed = _cat(q4k, q5k)
    assert isinstance(mixed, torch.Tensor)
    assert torch.equal(mixed, torch.cat([q4k.dequantize(), q5k.dequantize()]))


def _random(n: int, k: int, bits: int, seed: int = 0) -> KQuantCodes:
    """Every code, scale and min value reachable (the quantizer's output never uses some)."""
    return random_codes(n, k, bits, torch.Generator().manual_seed(seed))


def test_the_loader_reads_q5_k_blocks_exactly():
    """Codes, scales, mins, d and dmin read from the blocks give the gguf package's values bit
    for bit, and so does the packed layout read back, whole and by rows (an embedding lookup),
    across a padded last block of rows."""
    want, t = _q5_k(70, 512)
    assert t.kind == "Q5_K" and isinstance(t.planes[0], KQuantCodes) and t.planes[0].bits == 5
    assert np.abs(want).max() > 1 and np.array_equal(t.dequantize().numpy(), want)
    packed = pack_kquant(t.planes[0])
    assert packed.out_features == 128 and packed.bits == 5  # rows padded to the block of 64
    back = kquant_dequantize(packed)
    assert np.array_equal(back[:70].numpy(), want) and not back[70:].any()
    ids = torch.tensor([0, 69, 31, 32, 63, 64, 15, 16, 47, 48])
    assert np.array_equal(kquant_rows(packed, ids).numpy(), want[ids.numpy()])


def test_the_layout_keeps_every_code():
    """Random codes of 5 and 4 bits packed and read back: the same codes, every top bit where
    the layout puts it."""
    for bits in (5, 4):
        codes = _random(192, 512, bits)
        packed = pack_kquant(codes)
        assert packed.bits == bits
        assert torch.equal(kquant_codes(packed, torch.arange(192)), codes.codes)


def _builds() -> list:
    return kernel_builds(load_kquant_matmul, kquant_matmul_kernel)


@pytest.mark.parametrize("bits", [5, 4])
@pytest.mark.parametrize("planes", [1, 2])
def test_the_kernel_equals_the_product_by_hand(bits, planes):
    """Rows 1, 2, 3, 5 and 17 (the AVX-512 path's register blocks of rows and their remainder,
    the AVX2 path's tiles of 16) of one or two int8 planes, on each build: within float32 noise
    of float64 on the same quantized rows; each vector path equals the portable loops bit for bit
    (the same sums in the same order); two planes within 1e-4 of the float32 rows' exact
    product, one plane within the 8 bits it keeps."""
    w = pack_kquant(_random(100, 768, bits))
    weight = kquant_dequantize(w).double().t()
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


@pytest.mark.parametrize("bits", [5, 4])
def test_each_builds_grouped_call_equals_a_call_per_expert(bits):
    """The grouped entry on every vector build equals a call per expert, bit for bit."""
    weights = [pack_kquant(_random(128, 512, bits, seed=e)) for e in range(3)]
    assert_grouped_calls_equal_calls_alone(_builds(), weights, KQuantPacked)


def test_the_kernels_casts_and_dequantization():
    """bf16 rows widen exactly and a bf16 output rounds once from the float32 sums; the
    large-batch weight is the layout's values in float32 and their one rounding in bf16."""
    f32, bf16 = torch.float32, torch.bfloat16
    x = torch.randn(3, 256)
    for bits in (5, 4):
        w = pack_kquant(_random(64, 256, bits, seed=3))
        for _, kernel in _builds():
            for x_dtype, out_dtype in ((f32, bf16), (bf16, f32), (bf16, bf16)):
                xi = x.to(x_dtype)
                want = kernel.matmul(xi.float().contiguous(), w, f32).to(out_dtype)
                assert torch.equal(kernel.matmul(xi, w, out_dtype), want)
            for dtype in (f32, bf16):
                want_t = kquant_dequantize(w).t().to(dtype)
                assert torch.equal(kernel.dequantize_t(w, dtype), want_t)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_packed_layer_runs_both_paths(dtype):
    """A Q5_K layer of 100 outputs (padded to 128) and a bias: a decode batch through the
    kernel, a large batch through the dequantized weight, each against the dense product."""
    want_w, t = _q5_k(100, 512, seed=5)
    linear = Linear(512, 100, bias=True).to(dtype)
    linear.bias.data.normal_()
    linear.load_weight("w", t)
    assert linear.layout == "q5_k" and linear.weight is None
    assert isinstance(linear.packed, PackedKQuant)
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
def test_a_q4_k_layer_runs_on_the_k_quant_kernel():
    """A Q4_K layer read for the K-quant kernel packs there (layout q4_k, exact) and its decode
    rows and large batches equal the dense product."""
    x = np.random.default_rng(6).standard_normal((100, 512)).astype(np.float32)
    blocks = quantize_q5_k(x, bits=4)
    want_w = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_K).reshape(100, 512)
    linear = Linear(512, 100)
    linear.load_weight("w", gguf_codes("Q4_K", blocks, (100, 512), exact_q4_k=True))
    assert linear.layout == "q4_k" and isinstance(linear.packed, PackedKQuant)
    assert torch.equal(linear.packed.dequantize(), torch.from_numpy(want_w))
    dense = torch.from_numpy(want_w).double()
    for rows in (1, 3, DEQUANT_MIN_ROWS):
        x = torch.randn(rows, 512)
        want = x.double() @ dense.t()
        scale = (x.double().abs() @ dense.abs().t()).max().item()
        torch.testing.assert_close(linear(x).double(), want, rtol=0, atol=1e-4 * scale)


@needs_kernel
def test_fused_q5_k_parts_stay_one_matrix_and_other_formats_make_runs():
    """Fused gate and up both in Q5_K are one packed matrix; a Q5_K part beside a Q6_K one
    makes two packed runs whose outputs concatenate."""
    from kiln.layers.packed_parts import PackedParts
    from kiln.loader.gguf import take_rows
    from tests.gguf_files import quantize_q6_k

    want, t = _q5_k(128, 256, seed=7)
    fused = Linear(256, 128)
    fused.load_weight("gate", take_rows(t, (0, 64)), slice(0, 64))
    fused.load_weight("up", take_rows(t, (64, 64)), slice(64, 128))
    assert fused.layout == "q5_k"
    assert torch.equal(fused.packed.dequantize(), torch.from_numpy(want))
    q6 = gguf_codes("Q6_K", quantize_q6_k(want[:64]), (64, 256))
    mixed = Linear(256, 128)
    mixed.load_weight("q", q6, slice(0, 64))
    mixed.load_weight("v", take_rows(t, (64, 64)), slice(64, 128))
    assert mixed.layout == "parts" and isinstance(mixed.packed, PackedParts)
    assert [p.layout for p in mixed.packed.products()] == ["q6_k", "q5_k"]
    dense = torch.cat([q6.dequantize(), torch.from_numpy(want[64:])])
    assert torch.equal(mixed.packed.dequantize(), dense)
    for rows in (1, DEQUANT_MIN_ROWS):
        x = torch.randn(rows, 256)
        want_y = x.double() @ dense.double().t()
        scale = (x.double().abs() @ dense.abs().double().t()).max().item()
        torch.testing.assert_close(mixed(x).double(), want_y, rtol=0, atol=1e-4 * scale)


@needs_kernel
def test_the_op_and_its_fake_agree():
    """torch.compile traces the op through its fake: dtype and shape on both paths, for each
    rows dtype (fp16 rows come back float32, rounded once by the layer), and the kernel refuses
    rows of the wrong width instead of reading past them."""
    w = pack_kquant(_random(64, 256, 5, seed=4))
    tensors = (w.low, w.high, w.scales_mins, w.d_dmin)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for rows in (1, DEQUANT_MIN_ROWS):
            x = torch.randn(rows, 256).to(dtype)
            torch.library.opcheck(torch.ops.kiln.kquant_mm.default, (x, *tensors, None, 2))
            y = torch.ops.kiln.kquant_mm(x, *tensors, None, 2)
            assert y.dtype == (torch.float32 if dtype == torch.float16 else dtype)
            assert y.shape == (rows, 64)
    with pytest.raises(ValueError, match="256 columns"):
        kquant_matmul_kernel().matmul(torch.randn(1, 100), w, torch.float32)


@needs_kernel
def test_steps_of_few_rows_stream_the_packed_weight_beside_a_dense_copy():
    """A bf16 Q5_K layer with its dense copy (--prefill-weights dense): a step of fewer rows
    than the copy's switch (INT8_COPY_MIN_ROWS on kiln's bf16 kernel, DENSE_MIN_ROWS on oneDNN)
    still goes through the K-quant kernel (the same values as without the copy, bit for bit), a
    step of the switch's rows through the copy (the dense product within bf16 rounding)."""
    from kiln.boot.prefill_weights import keep_dense_copies
    from kiln.layers.packed import DENSE_MIN_ROWS, INT8_COPY_MIN_ROWS

    _, t = _q5_k(64, 256, seed=11)
    layer = Linear(256, 64).to(torch.bfloat16)
    layer.load_weight("w", t)
    x = torch.randn(DENSE_MIN_ROWS, 256).bfloat16()
    before = {rows: layer(x[:rows]) for rows in range(1, DENSE_MIN_ROWS + 1)}
    keep_dense_copies(torch.nn.Sequential(layer), torch.bfloat16, CPU, "dense")
    dense = layer.packed.dense
    assert dense is not None
    switch = INT8_COPY_MIN_ROWS if dense.dim() == 4 else DENSE_MIN_ROWS  # bf16 pairs or oneDNN
    assert torch.equal(layer(x[: switch - 1]), before[switch - 1])
    after = layer(x[:switch])
    ref = x[:switch].float() @ layer.packed.dequantize().t()
    torch.testing.assert_close(after.float(), ref, rtol=0, atol=2**-7 * ref.abs().max().item())
    assert not torch.equal(after, before[switch])  # the copy's bf16 products, not the kernel's
