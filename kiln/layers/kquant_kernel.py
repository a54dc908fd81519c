"""kiln's CPU Q5_K / Q4_K matmul (`csrc/kquant_mm.cpp`): rows times a weight in kiln's K-quant
layout (kiln/layers/kquant_layout.py), the rows as int8 planes, built at first use
(kiln/native.py).

Its vector paths: AVX512-VNNI with VBMI, else AVX2 with FMA (csrc/int8_rows_avx2.h: the same
integer sums by vpmaddubsw); where the build has neither the engine keeps Q5_K tensors
dequantized and Q4_K on the int4 kernel, as before it had this kernel. The portable loops
(`portable=True`) compute the same sums in the same order: the tests' reference, never the
engine's path."""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.layers.expert_groups import (
    ExpertGroups,
    RoutedRows,
    declare_route_entries,
    grouped_product,
)
from kiln.layers.int4_kernel import CAST_DTYPES, quantized_rows
from kiln.layers.kquant_layout import KQuantCodes, KQuantPacked, kquant_dequantize, pack_kquant
from kiln.native import FLAGS, built_library, checked_kernel

SOURCE = Path(__file__).parent / "csrc" / "kquant_mm.cpp"
DTYPES = CAST_DTYPES  # the rows' and the output's, coded as the int4 kernel codes them


def _pointers(w: KQuantPacked) -> list[int]:
    return [t.data_ptr() for t in (w.low, w.high, w.scales_mins, w.d_dmin)]


@dataclass(frozen=True)
class KQuantMatmulKernel:
    """The loaded library: `matmul` multiplies rows by a K-quant weight, `dequantize_t` reads it."""

    library: ctypes.CDLL
    isa: int  # the vector path built: 2 AVX512-VNNI with VBMI, 1 AVX2 with FMA, 0 none

    @property
    def vectorized(self) -> bool:
        """Whether the build has a vector path: the engine's."""
        return self.isa > 0

    def matmul(
        self, rows: torch.Tensor, w: KQuantPacked, dtype: torch.dtype, int8_planes: int = 2,
        portable: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        """float32 or bf16 rows [R, K] (contiguous) times the weight -> [R, N padded] in `dtype`
        (float32 or bf16, rounded once from float32 sums); the rows as `int8_planes` int8 planes
        per 32 columns (1: 8 bits of each value, 2: 16)."""
        r, k = rows.shape
        n = w.out_features
        if k != w.low.shape[1] * 2 or not rows.is_contiguous() or rows.dtype not in DTYPES:
            raise ValueError(
                f"contiguous float32 or bf16 rows of {w.low.shape[1] * 2} columns, not "
                f"{rows.dtype} {tuple(rows.shape)}"
            )
        out = torch.empty(r, n, dtype=dtype)
        self.library.kiln_kquant_mm(
            DTYPES[rows.dtype], rows.data_ptr(), r, k, w.bits, *_pointers(w), n, DTYPES[dtype],
            out.data_ptr(), int8_planes, torch.get_num_threads(), int(portable),
        )  # fmt: skip
        return out

    def matmul_experts(
        self, rows: torch.Tensor, stack: KQuantPacked, groups: ExpertGroups | RoutedRows,
        dtype: torch.dtype, int8_planes: int = 2,
    ) -> torch.Tensor:  # fmt: skip
        """`matmul` for a step's experts in one call: rows [R, K] sorted by expert, `stack` the
        experts' weights (each buffer with a leading expert dimension) -> [R, N padded] in
        `dtype`, group g's rows times expert experts[g] (rows of no group: zeros)."""
        n = stack.scales_mins.shape[1] * stack.scales_mins.shape[4]
        buffers = [stack.low, stack.high, stack.scales_mins, stack.d_dmin]
        return grouped_product(
            self.library.kiln_kquant_mm_experts, rows, stack.low.shape[2] * 2, (stack.bits,),
            buffers, n, groups, dtype, int8_planes,
        )  # fmt: skip

    def dequantize_t(self, w: KQuantPacked, dtype: torch.dtype) -> torch.Tensor:
        """W^T [K, N padded] in `dtype` (float32 or bf16), as `KQuantCodes.dequantize` computes
        it, rounded once more to bf16; the weight of the large-batch path's dense matmul."""
        k, n = w.low.shape[1] * 2, w.out_features
        out = torch.empty(k, n, dtype=dtype)
        self.library.kiln_kquant_dequantize_t(
            w.bits, *_pointers(w), n, k, DTYPES[dtype], out.data_ptr(), torch.get_num_threads()
        )
        return out


@functools.cache
def kquant_matmul_kernel() -> KQuantMatmulKernel | None:
    """The engine's kernel: built once per machine and cache directory; None where it cannot be
    built or has no vector path (Q5_K is dequantized then)."""
    return checked_kernel(
        "K-quant matmul",
        lambda: load_kquant_matmul(FLAGS),
        self_check_error,
        SELF_CHECK_TOLERANCE,
        "Q5_K tensors are dequantized and Q4_K ones run as int4 planes",
    )


SELF_CHECK_TOLERANCE = 1e-4  # float32 sums over 512 columns: ~1e-6; a misread code: ~1e-2


def self_check_error(kernel: KQuantMatmulKernel) -> float:
    """The vector path's largest error on small random weights (5 and 4 bits), relative to the
    largest float64 product of the quantized rows, one and two planes."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 512, generator=g)
    worst = 0.0
    for bits in (5, 4):
        w = random_kquant(96, 512, bits, g)
        want_w = kquant_dequantize(w).double().t()
        for planes in (1, 2):
            want = quantized_rows(x, planes) @ want_w
            got = kernel.matmul(x, w, torch.float32, planes)
            worst = max(worst, ((got.double() - want).abs().max() / want.abs().max()).item())
    return worst


def random_codes(n: int, k: int, bits: int, generator: torch.Generator) -> KQuantCodes:
    """Random codes, scales, mins and d (mins large enough that the min term matters); d and
    dmin fp16 values, as a file's are, so every product is exact in float32."""
    codes = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, generator=generator)
    scale, minimum = (
        torch.randint(0, 64, (n, k // 32), generator=generator).to(torch.uint8) for _ in range(2)
    )
    d, dmin = (
        (torch.rand(n, k // 256, generator=generator) / 1000).half().float() for _ in range(2)
    )
    return KQuantCodes(codes, scale, minimum, d, dmin, bits)


def random_kquant(n: int, k: int, bits: int, generator: torch.Generator) -> KQuantPacked:
    """A random weight in the packed layout."""
    return pack_kquant(random_codes(n, k, bits, generator))


def load_kquant_matmul(flags: tuple[str, ...]) -> KQuantMatmulKernel:
    """The kernel built with `flags`, loaded; raises where it cannot be built or loaded."""
    library = ctypes.CDLL(str(built_library(SOURCE, flags)))
    i64, ptr, flag = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    library.kiln_kquant_isa.restype = flag
    library.kiln_kquant_mm.restype = None
    library.kiln_kquant_mm.argtypes = [flag, ptr, i64, i64, flag, *[ptr] * 4, i64, flag, ptr, flag,
                                       flag, flag]  # fmt: skip
    library.kiln_kquant_mm_experts.restype = None
    library.kiln_kquant_mm_experts.argtypes = [flag, ptr, i64, i64, flag, *[ptr] * 5, i64, i64,
                                               ptr, ptr, ptr, flag, ptr, flag, flag]  # fmt: skip
    library.kiln_kquant_dequantize_t.restype = None
    library.kiln_kquant_dequantize_t.argtypes = [flag, *[ptr] * 4, i64, i64, flag, ptr, flag]
    declare_route_entries(library)
    return KQuantMatmulKernel(library, library.kiln_kquant_isa())
