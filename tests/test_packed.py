"""Packed 4-bit weights: GGUF blocks read exactly (against the `gguf` package's own
dequantizer), the packed matmul against the dequantized one on both of its paths, the row
lookup of a packed embedding, when a layer packs and when it falls back, and a packed GGUF
model against HF transformers on the same dequantized weights."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from kiln.layers.kquant_kernel import kquant_matmul_kernel
from kiln.layers.linear import Linear
from kiln.layers.packed import (
    DEQUANT_MIN_ROWS,
    Int4Codes,
    PackedInt4,
    PackedWeight,
    QuantizedTensor,
)
from kiln.layers.q6k_kernel import q6k_matmul_kernel
from kiln.loader.gguf_quant import gguf_codes
from tests.conftest import packed_kind

T = gguf.GGMLQuantizationType
CPU = torch.device("cpu")
BF16_ULP = 2**-8  # bf16 keeps 8 significant bits


@pytest.fixture(autouse=True)
def _seeded():
    """Fixed inputs: a tolerance in bf16 ulps is checked on the same values every run."""
    torch.manual_seed(0)


def _weights(n: int, k: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)


def _q4_k_blocks(n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random Q4_K rows (the gguf package has no Q4_K quantizer): random scale and code bytes,
    d and dmin small positive fp16."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n, k // 256, 144), dtype=np.uint8)
    for at in (0, 2):
        d = rng.uniform(1e-3, 1e-2, (n, k // 256)).astype(np.float16)
        blocks[..., at : at + 2] = d.view(np.uint8).reshape(n, k // 256, 2)
    return blocks.reshape(n, -1)


def _gguf_tensor(kind: str, n: int, k: int) -> tuple[np.ndarray, QuantizedTensor]:
    """(the gguf package's dequantized values, kiln's planes) of one random matrix."""
    data = _q4_k_blocks(n, k) if kind == "Q4_K" else gguf.quants.quantize(_weights(n, k), T[kind])
    return gguf.quants.dequantize(data, T[kind]), gguf_codes(kind, data, (n, k))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K", "Q8_0"])
def test_gguf_blocks_read_exactly(kind):
    ref, planes = _gguf_tensor(kind, 64, 512)
    assert len(planes.planes) == (2 if kind == "Q8_0" else 1)
    assert all(int(p.codes.max()) <= 15 for p in planes.planes)
    np.testing.assert_array_equal(planes.dequantize().numpy(), ref)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 5, DEQUANT_MIN_ROWS + 44])  # bf16: the kernel, then dequant
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [192, 100])  # 100: rows padded to the kernel's block of 64
def test_packed_matmul_matches_dequantized(kind, rows, dtype, n):
    k = 512
    ref_w, planes = _gguf_tensor(kind, n, k)
    packed = PackedInt4(planes, CPU)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    bias = torch.randn(n).to(dtype)
    y = packed(x, bias)
    assert y.shape == (rows, n) and y.dtype == dtype
    # bf16 scales and bf16 outputs (and bf16 activations in a bf16 model): a few bf16 ulps of
    # the output's magnitude; a wrong code order or scale is off by the magnitude itself
    ref = x.float() @ torch.from_numpy(ref_w).t() + bias.float()
    tol = (4 if dtype == torch.float32 else 8) * BF16_ULP * ref.abs().max().item()
    torch.testing.assert_close(y.float(), ref, rtol=0, atol=tol)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_planes_without_zeros_keep_their_scales_alone(kind, monkeypatch):
    """A plane whose zeros are all 0 (Q4_0, Q8_0's high plane) keeps a [K/G, N, 1]
    table on the CPU where kiln's kernel runs it, 10% fewer bytes a weight for a decode step to
    read; one with zeros (Q4_1, Q8_0's low plane) keeps the pairs. The product is bit for bit
    the one over the same planes packed with pairs, on kiln's kernel at 1 and 5 rows,
    dequantized at 300, and on aten's kernel where kiln's was not built."""
    from kiln.layers import packed as packed_module
    from kiln.layers.int4_kernel import int4_matmul_kernel

    _, planes = _gguf_tensor(kind, 192, 512)
    packed = PackedInt4(planes, CPU)
    widths = [sz.shape[-1] for sz in packed.planes()[1]]
    expected = {"Q4_0": [1], "Q4_1": [2], "Q8_0": [1, 2]}[kind]
    assert widths == (expected if int4_matmul_kernel() is not None else [2] * len(expected))
    with monkeypatch.context() as patch:  # the same planes packed with pairs, as before
        patch.setattr(packed_module, "scale_only_table", lambda table: table)
        pairs = PackedInt4(planes, CPU)
    assert all(sz.shape[-1] == 2 for sz in pairs.planes()[1])
    x = torch.randn(300, 512, generator=torch.Generator().manual_seed(2))
    for rows in (1, 5, 300):
        assert torch.equal(packed(x[:rows]), pairs(x[:rows]))
    monkeypatch.setattr(packed_module, "int4_matmul_kernel", lambda: None)
    for rows in (1, 300):
        assert torch.equal(packed(x[:rows]), pairs(x[:rows]))


@pytest.mark.parametrize("n", [64, 192])
def test_direct_packing_is_atens_converter(n):
    """kiln writes the CPU layout itself in uint8 (10x faster at load): byte for byte what aten's
    converter makes from int32 codes on this machine."""
    from kiln.layers.cpu_int4_layout import cpu_block_n, cpu_pack

    codes = torch.randint(0, 16, (n, 512), dtype=torch.uint8)
    expected = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 2)
    assert torch.equal(cpu_pack(codes, cpu_block_n()), expected)


def test_a_float32_row_does_not_depend_on_its_batch_below_the_dequant_switch():
    """The CPU kernel computes each row alone: the same row alone, among 7, or among 255. From
    256 rows the weight is dequantized to float32 for one matmul: the same row within the
    kernel's bf16 rounding."""
    _, planes = _gguf_tensor("Q4_1", 192, 512)
    packed = PackedInt4(planes, CPU)
    x = torch.randn(300, 512, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([packed(x[i : i + 1]) for i in range(0, 300, 37)])
    for batch in (x[:7], x[: DEQUANT_MIN_ROWS - 1]):
        rows = packed(batch)[: len(batch)][::37]
        assert torch.equal(rows, alone[: len(rows)])
    exact = x[::37] @ packed.dequantize().t()  # float32 throughout
    tol = 2 * BF16_ULP * exact.abs().max().item()
    torch.testing.assert_close(packed(x)[::37], exact, rtol=0, atol=1e-4 * tol)
    torch.testing.assert_close(alone, exact, rtol=0, atol=tol)


@pytest.mark.parametrize("planes", [1, 2])
def test_int8_rows_take_the_kernel_below_the_dequant_switch(planes):
    """With the rows as int8 planes the kernel takes every row count below the dequantize
    switch, so there a row's result never depends on its batch (alone and among 7). From the
    switch (300 rows) it takes them too on CPUs without AMX (at 512 rows two planes were
    1.4-1.7x dequantize + matmul on an AVX-512 EPYC); with AMX the weight is dequantized and
    multiplied densely, 5.7-9x faster there: the product then equals that, bit for bit."""
    from kiln.layers.bf16_kernel import has_amx
    from kiln.layers.cpu_int4_layout import cpu_block_n, cpu_dequantize_t
    from kiln.layers.int4_kernel import int4_matmul_kernel

    kernel = int4_matmul_kernel()
    if kernel is None or not kernel.int8_rows_for(cpu_block_n()):
        pytest.skip("kiln's int4 kernel has no int8 path here (AVX512-VNNI with VBMI, or AVX2)")
    _, weights = _gguf_tensor("Q4_1", 192, 512)
    packed = PackedInt4(weights, CPU)
    packed.int8_planes = planes
    x = torch.randn(300, 512, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([packed(x[i : i + 1]) for i in range(0, 300, 37)])
    assert torch.equal(packed(x[:7])[::37], alone[:1])
    if not has_amx():
        assert torch.equal(packed(x)[::37], alone)
        return
    dense = x @ cpu_dequantize_t(packed.packed0, packed.scales_zeros0, packed.group_size,
                                 torch.float32)  # fmt: skip
    out = packed(x)
    assert torch.equal(out, dense[:, : out.shape[1]])


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_packed_rows_are_the_dequantized_rows(kind):
    ref_w, planes = _gguf_tensor(kind, 200, 256)
    packed = PackedInt4(planes, CPU)
    ids = torch.tensor([0, 199, 63, 64, 95, 96, 127, 5, 5])
    rows = packed.rows(ids, torch.float32)
    ref = torch.from_numpy(ref_w)[ids]
    torch.testing.assert_close(rows, ref, rtol=0, atol=2 * BF16_ULP * ref.abs().max().item())
    torch.testing.assert_close(packed.dequantize(), torch.from_numpy(ref_w), rtol=0,
                               atol=2 * BF16_ULP * np.abs(ref_w).max())  # fmt: skip


def _linear_with_parts(parts: list[QuantizedTensor | torch.Tensor]) -> Linear:
    k = parts[0].shape[1]
    linear = Linear(k, sum(p.shape[0] for p in parts))
    start = 0
    for i, part in enumerate(parts):
        linear.load_weight(f"part{i}", part, slice(start, start + part.shape[0]))
        start += part.shape[0]
    linear.finalize(CPU)
    return linear


def test_fused_layer_packs_its_quantized_parts():
    (wq, q), (wk, kk) = _gguf_tensor("Q4_0", 128, 256), _gguf_tensor("Q4_1", 64, 256)
    linear = _linear_with_parts([q, kk])
    assert linear.layout == "int4" and linear.weight is None
    x = torch.randn(3, 256)
    ref = x.bfloat16().float() @ torch.from_numpy(np.concatenate([wq, wk])).t()
    torch.testing.assert_close(linear(x), ref, rtol=0, atol=4 * BF16_ULP * ref.abs().max().item())


def test_layer_of_mixed_formats_is_dequantized_with_its_reason():
    (wq, q), dense = _gguf_tensor("Q4_0", 64, 256), torch.randn(32, 256)
    linear = _linear_with_parts([q, dense])
    assert linear.layout != "int4" and "mix" in linear.fallback_reason
    x = torch.randn(2, 256)
    ref = x @ torch.cat([torch.from_numpy(wq), dense]).t()
    torch.testing.assert_close(linear(x), ref, rtol=1e-5, atol=1e-5)


def test_group_size_without_a_kernel_is_dequantized():
    codes = torch.randint(0, 16, (64, 96), dtype=torch.uint8)
    plane = Int4Codes(codes, torch.rand(64, 4) + 0.1, torch.zeros(64, 4), group_size=24)
    linear = _linear_with_parts([QuantizedTensor("test", [plane])])
    assert linear.layout != "int4" and "group size 24" in linear.fallback_reason
    x = torch.randn(2, 96)
    torch.testing.assert_close(linear(x), x @ plane.dequantize().t(), rtol=1e-5, atol=1e-5)


def test_packed_gguf_model_matches_hf_on_the_dequantized_weights(tiny_models, packed_gguf):
    """The tiny Llama as Q4_0 (attention), Q4_1 (MLP) and Q8_0 (embedding, head) GGUF; HF
    transformers runs the same values dequantized by the gguf package, in float32. kiln's
    packed linears take bf16 activations and round their outputs to bf16, two layers deep:
    logits agree to a few bf16 ulps of their magnitude (1.8 measured, 8 allowed), and the
    greedy picks agree."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_models["llama"]).eval()
    with torch.no_grad():  # the reference: the same quantized values, dequantized
        for name, p in hf.named_parameters():
            if p.ndim == 2:
                q = gguf.quants.quantize(p.numpy(), packed_kind(name))
                p.copy_(torch.from_numpy(gguf.quants.dequantize(q, packed_kind(name))))
    path = packed_gguf
    prompt = [5, 17, 300, 4000, 12, 9, 77, 1024]
    tokenizer = tiny_models["llama"]
    ours, tokens = _greedy_logits(str(path), "auto", prompt, tokenizer)
    with torch.no_grad():  # HF on the sequence kiln produced: the logits of each step
        ref = hf(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :]
    torch.testing.assert_close(ours, ref, rtol=0, atol=8 * BF16_ULP * ref.abs().max().item())
    assert tokens == ref.argmax(-1).tolist()
    dense, _ = _greedy_logits(str(path), "none", prompt, tokenizer)  # float32 throughout
    torch.testing.assert_close(dense, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_a_gguf_with_q6_k_and_q5_k_tensors_matches_hf(
    k_quant_mix_gguf, tokenizer_dir, kernel_build
):
    """As llama.cpp's Q4_K_M and Q5_K_M files carry them, Q6_K tensors (here the MLP's down
    projection, v, the embedding and the head of a Llama with 256 hidden units) beside Q4_K (q,
    k, o) and Q5_K (gate and up) ones: all stay packed on kiln's Q6_K and K-quant kernels where
    this CPU runs them (else Q4_K becomes int4 planes and the rest is dequantized at load), on
    this CPU's build and on the AVX2 one; kiln's logits against HF transformers on the same
    values dequantized by the gguf package, within a few bf16 ulps, and the same greedy picks."""
    from tests.conftest import k_quant_mix_kind, k_quant_mix_llama
    from tests.gguf_files import quantize

    hf = k_quant_mix_llama()
    with torch.no_grad():  # the reference: the same quantized values, dequantized
        for name, p in hf.named_parameters():
            if p.ndim == 2:
                q = quantize(p.numpy(), k_quant_mix_kind(name))
                p.copy_(torch.from_numpy(gguf.quants.dequantize(q, k_quant_mix_kind(name))))
    prompt = [5, 17, 300, 4000, 12, 9, 77, 1024]
    # with the kernels: per layer a qkv of two packed runs (3 modules), o, gate_up and down;
    # without (both need the same CPU), the qkv, gate_up and down dequantized
    kernels = q6k_matmul_kernel() is not None
    assert (kquant_matmul_kernel() is not None) == kernels
    assert kernel_build == "native" or q6k_matmul_kernel().isa == kquant_matmul_kernel().isa == 1
    ours, tokens = _greedy_logits(k_quant_mix_gguf, "auto", prompt, tokenizer_dir,
                                  packed_layers=2 * 6 + 2 if kernels else 2 * 1)  # fmt: skip
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :]
    torch.testing.assert_close(ours, ref, rtol=0, atol=8 * BF16_ULP * ref.abs().max().item())
    assert tokens == ref.argmax(-1).tolist()


def _greedy_logits(
    path: str, quantization: str, prompt: list[int], tokenizer: str, packed_layers: int = 2 * 4 + 2
):
    """kiln's logits of 4 greedy steps (a prefill, three decodes) and its tokens; `packed_layers`:
    the packed modules expected with --quantization auto (default: 2 layers x 4, embedding and
    head)."""
    from kiln import SamplingParams
    from tests.helpers import make_engine, run_schedule

    engine = make_engine(path, quantization=quantization, tokenizer=tokenizer)
    packed = sum(isinstance(m, PackedWeight) for m in engine.runner.model.modules())
    assert packed == (packed_layers if quantization == "auto" else 0)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out, logits = run_schedule(engine, [(0, prompt, params)], record_logits=True)
    return torch.stack(logits["0"]).float(), out["0"].outputs[0].token_ids


@pytest.mark.parametrize("build", ["native", "avx512", "avx2", "portable"])
@pytest.mark.parametrize("block", [32, 64])  # AVX2's layout and AVX-512's: any build reads both
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("terms", [2, 1])  # (scale, zero) pairs, or the scales alone
def test_kilns_int4_kernel_matches_the_dequantized_weight(build, block, group, terms):
    """kiln's C++ int4 matmul on aten's CPU layout, every build this CPU runs, against float64
    by hand: rows 1, 2, 3 and 5 (its register blocks of rows and their remainder), and the
    second plane of Q8_0 (always with pairs: its low plane has zeros) added into the first's
    output."""
    from kiln import native
    from kiln.layers.cpu_int4_layout import cpu_dequantize_t
    from kiln.layers.int4_kernel import int4_matmul_kernel, load_int4_matmul

    cpu_flags = native.cpu_flags().split()
    needs = {"avx512": ("avx512f",), "avx2": ("avx2", "fma")}.get(build, ())
    if any(flag not in cpu_flags for flag in needs):
        pytest.skip(f"this CPU has no {' and '.join(needs)}")
    generic = tuple(f for f in native.FLAGS if f != "-march=native")
    extra = {"avx512": ("-mavx512f",), "avx2": ("-mavx2", "-mfma"), "portable": ()}
    if build == "native":
        kernel = int4_matmul_kernel()
    else:
        kernel = load_int4_matmul((*generic, *extra[build]))
    if build == "native" and ("avx2" in cpu_flags or "avx512f" in cpu_flags):
        assert kernel is not None and kernel.vectorized  # the engine's path, not aten's
    isa = {"avx512": 2, "avx2": 1, "portable": 0}.get(build, kernel and kernel.isa)
    assert kernel is not None and kernel.isa == isa
    n, k = 128, 512
    planes = [_random_plane(n, k, group, block, terms), _random_plane(n, k, group, block)]
    w = [cpu_dequantize_t(p, sz, group, torch.float64, block) for p, sz in planes]  # [K, N]
    for rows in (1, 2, 3, 5):
        x = torch.randn(rows, k)
        y = kernel.matmul(x, *planes[0], group, block)
        kernel.matmul(x, *planes[1], group, block, out=y)
        want = x.double() @ (w[0] + w[1])
        scale_of_sums = (x.double().abs() @ (w[0].abs() + w[1].abs())).max().item()
        torch.testing.assert_close(y.double(), want, rtol=0, atol=1e-6 * scale_of_sums)
        # one plane with the rows' and output's casts inside the call: the same bits as the
        # float32 product cast by torch (bf16 rows widen exactly, the output rounds once)
        f32, bf16 = torch.float32, torch.bfloat16
        for x_dtype, out_dtype in ((f32, f32), (bf16, bf16), (f32, bf16), (bf16, f32)):
            xi = x.to(x_dtype)
            cast = kernel.matmul(xi.float(), *planes[0], group, block).to(out_dtype)
            assert torch.equal(kernel.matmul_as(xi, *planes[0], group, block, out_dtype), cast)
    # the large-batch path's weight: bit for bit what PyTorch's ops make (each op rounded to
    # the dtype), in both dtypes
    for dtype in (torch.float32, torch.bfloat16):
        want = cpu_dequantize_t(*planes[0], group, dtype, block)
        assert torch.equal(kernel.dequantize_t(*planes[0], group, block, dtype), want)


def _random_plane(
    n: int, k: int, group: int, block: int, terms: int = 2
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random codes packed in blocks of `block` rows, and random (scale, zero) per group: a
    [K/G, N, 2] table, or (`terms` 1) the scales alone, [K/G, N, 1] (every zero 0)."""
    from kiln.layers.cpu_int4_layout import cpu_pack

    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scale, zero = torch.rand(n, k // group) * 0.1, torch.randn(n, k // group) * 0.1
    sz = torch.stack([scale.t(), zero.t()], -1).to(torch.bfloat16).contiguous()
    return cpu_pack(codes, block), sz[..., :terms].contiguous()


def _int8_builds() -> list:
    """(kernel, block): each build of kiln's int4 kernel with an int8 path on this CPU (the
    engine's; the AVX2 one where the CPU has AVX2 and FMA) and each layout it reads that way."""
    from kiln import native
    from kiln.layers.int4_kernel import int4_matmul_kernel, load_int4_matmul

    kernels = [int4_matmul_kernel()]
    if native.runs_avx2():
        kernels.append(load_int4_matmul(native.AVX2_FLAGS))
    builds = [
        (kernel, block) for kernel in kernels if kernel is not None for block in kernel.int8_blocks
    ]
    if not builds:
        pytest.skip("kiln's int4 kernel has no int8 path here (AVX512-VNNI with VBMI, or AVX2)")
    return builds


@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("planes", [1, 2])
@pytest.mark.parametrize("terms", [2, 1])
def test_int8_rows_are_the_rows_quantized_by_hand(group, planes, terms):
    """The int8 path (--packed-activations int8 / int16) of each build and layout it reads
    (AVX512-VNNI: blocks of 64; AVX2: 32 and 64) against the same quantization done by hand in
    float64 (int8_rows_product): rows 1, 2, 3, 5 and 17 (AVX-512's blocks of two rows and the
    remainder, AVX2's tiles of 16), the second plane of Q8_0 added into the first's output,
    rows of very different sizes per chunk of 32 and an all-zero chunk, and the casts inside
    matmul_as."""
    from kiln.layers.cpu_int4_layout import cpu_dequantize_t
    from kiln.layers.int4_kernel import int8_rows_product

    n, k = 128, 512
    for kernel, block in _int8_builds():
        weights = []
        for table_terms in (terms, 2):
            packed, sz = _random_plane(n, k, group, block, table_terms)
            weights.append((packed, sz, cpu_dequantize_t(packed, sz, group, torch.float64, block)))
        for rows in (1, 2, 3, 5, 17):
            x = torch.randn(rows, k) * torch.logspace(-3, 2, k)
            x[:, 64:96] = 0
            y = kernel.matmul(x, *weights[0][:2], group, block, int8_planes=planes)
            kernel.matmul(x, *weights[1][:2], group, block, out=y, int8_planes=planes)
            want = sum(int8_rows_product(x, planes, w, sz, group) for _, sz, w in weights)
            scale_of_sums = (x.double().abs() @ (weights[0][2].abs() + weights[1][2].abs())).max()
            torch.testing.assert_close(y.double(), want, rtol=0, atol=1e-6 * scale_of_sums.item())
            for dtype in (torch.float32, torch.bfloat16):
                xi = x.to(dtype)
                cast = kernel.matmul(xi.float(), *weights[0][:2], group, block, int8_planes=planes)
                got = kernel.matmul_as(xi, *weights[0][:2], group, block, dtype, int8_planes=planes)
                assert torch.equal(got, cast.to(dtype))


def test_two_int8_planes_keep_16_bits_of_each_value():
    """int16 (two planes, the default where the CPU has the path): each value within 1/512 of
    its step of 1/127 of its chunk's largest magnitude, so a product is within that much of
    the float32 one; one plane (int8) is 256 times coarser, and the bound shows it."""
    from kiln.layers.cpu_int4_layout import cpu_dequantize_t

    n, k, group = 256, 1024, 32
    for kernel, block in _int8_builds():
        packed, sz = _random_plane(n, k, group, block)
        w = cpu_dequantize_t(packed, sz, group, torch.float64, block)
        x = torch.randn(3, k)
        exact = x.double() @ w
        amax = x.view(3, -1, 32).abs().amax(-1).repeat_interleave(32, 1).double()  # [R, K]
        codes_times_scale = (
            w - (sz[..., 1].double() - 8 * sz[..., 0].double()).repeat_interleave(group, 0)
        ).abs()  # |(code) * scale|: the part of w the quantized rows multiply
        step = amax / 127
        for planes, half_step in ((2, step / 512), (1, step / 2)):
            got = kernel.matmul(x, packed, sz, group, block, int8_planes=planes).double()
            bound = half_step @ codes_times_scale + 1e-6 * (x.double().abs() @ w.abs())
            assert ((got - exact).abs() <= bound).all()
        error16 = (kernel.matmul(x, packed, sz, group, block, int8_planes=2).double() - exact).abs()
        error8 = (kernel.matmul(x, packed, sz, group, block, int8_planes=1).double() - exact).abs()
        assert error8.mean() > 50 * error16.mean()


def test_each_int8_builds_grouped_call_equals_a_call_per_expert():
    """A step's experts in one call on each int8 build and layout (AVX2: blocks of 32 and 64):
    each group's rows get exactly what that expert's own product gives, with one or two
    planes; rows of no group are zeros."""
    from kiln.layers.expert_groups import ExpertGroups

    groups = ExpertGroups(experts=[2, 0], starts=[0, 5], counts=[5, 18])  # 18: past a tile
    x = torch.randn(24, 512)
    for kernel, block in _int8_builds():
        planes = [_random_plane(128, 512, 32, block, terms=1) for _ in range(3)]
        packed = torch.stack([p for p, _ in planes])
        table = torch.stack([sz for _, sz in planes])
        for int8_planes in (1, 2):
            got = kernel.matmul_experts(x, packed, table, 32, block, groups, None, int8_planes)
            for e, start, count in zip(groups.experts, groups.starts, groups.counts):
                alone = kernel.matmul(x[start : start + count], *planes[e], 32, block,
                                      int8_planes=int8_planes)  # fmt: skip
                assert torch.equal(got[start : start + count], alone)
            assert not got[23].any()


def test_a_kernel_that_misreads_the_layout_is_not_taken(caplog):
    """The engine's kernel is checked at first use against the dequantized weight by hand; a
    build whose vector path misreads the packing (here: told the wrong block of rows) shows an
    error of the values' own size and would be refused with a warning, not used."""
    from kiln.layers.int4_kernel import SELF_CHECK_TOLERANCE, int4_matmul_kernel, self_check_error

    kernel = int4_matmul_kernel()
    if kernel is None:
        pytest.skip("kiln's int4 kernel has no vector build on this CPU")
    assert self_check_error(kernel) < SELF_CHECK_TOLERANCE

    class SwappedBlocks:  # reads blocks of 64 as 32 and 32 as 64
        def int8_rows_for(self, block):
            return kernel.int8_rows_for(96 - block)

        def matmul(self, x, packed, sz, group, block, int8_planes=0):
            return kernel.matmul(x, packed, sz, group, 96 - block, int8_planes=int8_planes)

    assert self_check_error(SwappedBlocks()) > 0.1


def _packed_module() -> torch.nn.Module:
    plane = Int4Codes(
        torch.randint(0, 16, (64, 64), dtype=torch.uint8), torch.rand(64, 2), torch.rand(64, 2), 32
    )
    return torch.nn.Sequential(PackedInt4(QuantizedTensor("test", [plane]), CPU))


def test_packed_activations_choose_the_rows_planes(monkeypatch, caplog):
    """--packed-activations: auto takes two int8 planes where the kernel has the AVX512-VNNI
    int8 path and float32 rows elsewhere (the AVX2 path too: its two planes are no faster),
    silently; int8 or int16 take that many planes on either path; asked of a kernel without
    one, a warning naming the remedy, and an error under --strict-graphs."""
    from kiln import native
    from kiln.boot import cpu_linears
    from kiln.errors import ConfigError
    from kiln.layers.int4_kernel import load_int4_matmul

    model = _packed_module()
    native_kernel = cpu_linears.int4_matmul_kernel()
    kernels = [native_kernel]
    if native.runs_avx2():
        kernels.append(load_int4_matmul(native.AVX2_FLAGS))
    for kernel in kernels:
        if kernel is None or not kernel.int8_rows_for(cpu_linears.cpu_block_n()):
            continue
        monkeypatch.setattr(cpu_linears, "int4_matmul_kernel", lambda kernel=kernel: kernel)
        auto = 2 if kernel.isa == 2 else 0
        for policy, planes in (("auto", auto), ("int16", 2), ("int8", 1), ("float", 0)):
            assert "--packed-activations" in cpu_linears.choose_packed_activations(
                model, policy, strict=True
            )
            assert model[0].int8_planes == planes
    monkeypatch.setattr(cpu_linears, "int4_matmul_kernel", lambda: None)  # not built here
    with caplog.at_level("WARNING"):
        assert "float32" in cpu_linears.choose_packed_activations(model, "auto", strict=True)
    assert model[0].int8_planes == 0 and not caplog.records
    with caplog.at_level("WARNING"):
        cpu_linears.choose_packed_activations(model, "int16", strict=False)
    assert model[0].int8_planes == 0
    assert "Remedy: --packed-activations float" in caplog.text
    with pytest.raises(ConfigError, match="no int8 path"):
        cpu_linears.choose_packed_activations(model, "int8", strict=True)
    assert cpu_linears.choose_packed_activations(torch.nn.Linear(2, 2), "int8", True) is None
