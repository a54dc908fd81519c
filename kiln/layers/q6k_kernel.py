"""kiln's CPU Q6_K matmul (`csrc/q6k_mm.cpp`): rows times a weight in kiln's Q6_K layout
(kiln/layers/q6k_layout.py), the rows as int8 planes, built at first use (kiln/native.py).

Its vector paths: AVX512-VNNI with VBMI, else AVX2 with FMA (csrc/int8_rows_avx2.h: the same
integer sums by vpmaddubsw); where the build has neither the engine keeps Q6_K tensors
dequantized, as before it had this kernel. The portable loops (`portable=True`) compute
the same sums in the same order: the tests' reference, never the engine's path."""

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
from kiln.layers.q6k_layout import Q6KCodes, Q6KPacked, pack_q6k, q6k_dequantize
from kiln.native import FLAGS, built_library, checked_kernel

SOURCE = Path(__file__).parent / "csrc" / "q6k_mm.cpp"
DTYPES = CAST_DTYPES  # the rows' and the output's, coded as the int4 kernel codes them


@dataclass(frozen=True)
class Q6KMatmulKernel:
    """The loaded library: `matmul` multiplies rows by a Q6_K weight, `dequantize_t` reads it."""

    library: ctypes.CDLL
    isa: int  # the vector path built: 2 AVX512-VNNI with VBMI, 1 AVX2 with FMA, 0 none

    @property
    def vectorized(self) -> bool:
        """Whether the build has a vector path: the engine's."""
        return self.isa > 0

    def matmul(
        self, rows: torch.Tensor, w: Q6KPacked, dtype: torch.dtype, int8_planes: int = 2,
        portable: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        """float32 or bf16 rows [R, K] (contiguous) times the weight -> [R, N padded] in `dtype`
        (float32 or bf16, rounded once from float32 sums); the rows as `int8_planes` int8 planes
        per 32 columns (1: 8 bits of each value, 2: 16)."""
        r, k = rows.shape
        n = w.sub_scales.shape[1]
        if k != w.low.shape[1] * 2 or not rows.is_contiguous() or rows.dtype not in DTYPES:
            raise ValueError(
                f"contiguous float32 or bf16 rows of {w.low.shape[1] * 2} columns, not "
                f"{rows.dtype} {tuple(rows.shape)}"
            )
        out = torch.empty(r, n, dtype=dtype)
        self.library.kiln_q6k_mm(
            DTYPES[rows.dtype], rows.data_ptr(), r, k, w.low.data_ptr(), w.high.data_ptr(),
            w.sub_scales.data_ptr(), w.d.data_ptr(), n, DTYPES[dtype], out.data_ptr(),
            int8_planes, torch.get_num_threads(), int(portable),
        )  # fmt: skip
        return out

    def matmul_experts(
        self, rows: torch.Tensor, stack: Q6KPacked, groups: ExpertGroups | RoutedRows,
        dtype: torch.dtype, int8_planes: int = 2,
    ) -> torch.Tensor:  # fmt: skip
        """`matmul` for a step's experts in one call: rows [R, K] sorted by expert, `stack` the
        experts' weights (each buffer with a leading expert dimension) -> [R, N padded] in
        `dtype`, group g's rows times expert experts[g] (rows of no group: zeros)."""
        buffers = [stack.low, stack.high, stack.sub_scales, stack.d]
        return grouped_product(
            self.library.kiln_q6k_mm_experts, rows, stack.low.shape[2] * 2, (), buffers,
            stack.sub_scales.shape[2], groups, dtype, int8_planes,
        )  # fmt: skip

    def dequantize_t(self, w: Q6KPacked, dtype: torch.dtype) -> torch.Tensor:
        """W^T [K, N padded] in `dtype` (float32 or bf16): exact in float32, rounded once to
        bf16; the weight of the large-batch path's dense matmul."""
        k, n = w.low.shape[1] * 2, w.sub_scales.shape[1]
        out = torch.empty(k, n, dtype=dtype)
        self.library.kiln_q6k_dequantize_t(
            w.low.data_ptr(), w.high.data_ptr(), w.sub_scales.data_ptr(), w.d.data_ptr(), n, k,
            DTYPES[dtype], out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return out


@functools.cache
def q6k_matmul_kernel() -> Q6KMatmulKernel | None:
    """The engine's kernel: built once per machine and cache directory; None where it cannot be
    built or has no vector path (Q6_K is dequantized then)."""
    return checked_kernel(
        "Q6_K matmul",
        lambda: load_q6k_matmul(FLAGS),
        self_check_error,
        SELF_CHECK_TOLERANCE,
        "Q6_K tensors are dequantized",
    )


SELF_CHECK_TOLERANCE = 1e-4  # float32 sums over 512 columns: ~1e-6; a misread code: ~1e-2


def self_check_error(kernel: Q6KMatmulKernel) -> float:
    """The vector path's largest error on a small random weight, relative to the largest
    float64 product of the quantized rows, one and two planes."""
    g = torch.Generator().manual_seed(0)
    w = random_q6k(96, 512, g)
    x = torch.randn(3, 512, generator=g)
    want_w = q6k_dequantize(w).double().t()
    worst = 0.0
    for planes in (1, 2):
        want = quantized_rows(x, planes) @ want_w
        got = kernel.matmul(x, w, torch.float32, planes)
        worst = max(worst, ((got.double() - want).abs().max() / want.abs().max()).item())
    return worst


def random_q6k(n: int, k: int, generator: torch.Generator) -> Q6KPacked:
    """A random weight in the packed layout (codes, scales and d drawn at random)."""
    codes = torch.randint(0, 64, (n, k), dtype=torch.uint8, generator=generator)
    sub_scale = torch.randint(-128, 128, (n, k // 16), generator=generator).to(torch.int8)
    d = torch.rand(n, k // 256, generator=generator) / 1000
    return pack_q6k(Q6KCodes(codes, sub_scale, d))


def load_q6k_matmul(flags: tuple[str, ...]) -> Q6KMatmulKernel:
    """The kernel built with `flags`, loaded; raises where it cannot be built or loaded."""
    library = ctypes.CDLL(str(built_library(SOURCE, flags)))
    i64, ptr, flag = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    library.kiln_q6k_isa.restype = flag
    library.kiln_q6k_mm.restype = None
    library.kiln_q6k_mm.argtypes = [flag, ptr, i64, i64, ptr, ptr, ptr, ptr, i64, flag, ptr, flag,
                                    flag, flag]  # fmt: skip
    library.kiln_q6k_mm_experts.restype = None
    library.kiln_q6k_mm_experts.argtypes = [flag, ptr, i64, i64, *[ptr] * 5, i64, i64, ptr, ptr,
                                            ptr, flag, ptr, flag, flag]  # fmt: skip
    library.kiln_q6k_dequantize_t.restype = None
    library.kiln_q6k_dequantize_t.argtypes = [ptr, ptr, ptr, ptr, i64, i64, flag, ptr, flag]
    declare_route_entries(library)
    return Q6KMatmulKernel(library, library.kiln_q6k_isa())
