"""kiln's CPU int4 matmul (`csrc/int4_mm.cpp`): rows times a weight packed in PyTorch's own CPU
int4 layout, float32 rows as they are, built at first use (kiln/native.py).

It replaces aten's `_weight_int4pack_mm_for_cpu` for the rows of decode steps where it was built
with AVX2 or AVX-512 (docs/performance.md, "kiln's int4 kernel"); the portable build is the
reference the tests hold the vector builds to, never the engine's path."""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.layers.cpu_int4_layout import CPU_BLOCKS, cpu_dequantize_t, cpu_pack, table_terms
from kiln.layers.expert_groups import (
    ExpertGroups,
    RoutedRows,
    declare_route_entries,
    expert_strides,
)
from kiln.native import FLAGS, built_library, checked_kernel

SOURCE = Path(__file__).parent / "csrc" / "int4_mm.cpp"
ISA_NAMES = {0: "portable loops", 1: "AVX2", 2: "AVX-512"}


@dataclass(frozen=True)
class Int4MatmulKernel:
    """The loaded library: `matmul` multiplies float32 rows by one packed plane."""

    library: ctypes.CDLL
    isa: int  # 0 portable, 1 AVX2 with FMA, 2 AVX-512
    # the layouts (blocks of rows) whose rows may go in as int8 planes: 64 with AVX512-VNNI and
    # VBMI, 32 and 64 on AVX2, none elsewhere
    int8_blocks: tuple[int, ...]

    @property
    def vectorized(self) -> bool:
        return self.isa > 0

    @property
    def has_int8_rows(self) -> bool:
        """Whether rows may go in as int8 planes for any layout."""
        return bool(self.int8_blocks)

    def int8_rows_for(self, block_n: int | None) -> bool:
        """Whether rows may go in as int8 planes for PyTorch's layout of `block_n` rows."""
        return block_n in self.int8_blocks

    def matmul(
        self, rows: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor,
        group_size: int, block_n: int, out: torch.Tensor | None = None, int8_planes: int = 0,
    ) -> torch.Tensor:  # fmt: skip
        """float32 [R, K] rows (contiguous) times the plane (`packed` [N, K/2] uint8 in blocks
        of `block_n` rows, `scales_zeros` [K/G, N, 2] bf16, or [K/G, N, 1]: the scales alone,
        every zero 0) -> float32 [R, N]; added into `out` where it is given. `int8_planes` 1 or
        2: the rows go in as that many int8 planes per 32 columns (8 or 16 bits of each value)
        where this build has that path for `block_n` (`int8_rows_for`; else, and with 0, as
        float32)."""
        r, k = rows.shape
        terms = _table_width(scales_zeros)
        n = scales_zeros.shape[1]
        accumulate = out is not None
        if out is None:
            out = torch.empty(r, n, dtype=torch.float32)
        self.library.kiln_int4_mm(
            rows.data_ptr(), r, k, packed.data_ptr(), scales_zeros.data_ptr(), terms, n, block_n,
            group_size, out.data_ptr(), int(accumulate), torch.get_num_threads(), int8_planes,
        )  # fmt: skip
        return out

    def matmul_experts(
        self, rows: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor,
        group_size: int, block_n: int, groups: ExpertGroups | RoutedRows,
        out: torch.Tensor | None = None, int8_planes: int = 0,
    ) -> torch.Tensor:  # fmt: skip
        """`matmul` for a step's experts in one call: float32 rows [R, K] sorted by expert,
        `packed` and `scales_zeros` one plane of every expert (a leading expert dimension) ->
        float32 [R, N], group g's rows times expert experts[g] (rows of no group: zeros), each
        group's bit for bit a `matmul` of its rows alone; added into `out` where it is given."""
        r, k = rows.shape
        n = scales_zeros.shape[2]
        if rows.dtype != torch.float32 or not rows.is_contiguous():
            raise ValueError(f"contiguous float32 rows, not {rows.dtype} {tuple(rows.shape)}")
        accumulate = out is not None
        if out is None:
            out = torch.empty(r, n, dtype=torch.float32)
        arrays = groups.arrays(rows.shape[0], packed.shape[0])
        self.library.kiln_int4_mm_experts(
            rows.data_ptr(), r, k, packed.data_ptr(), scales_zeros.data_ptr(),
            _table_width(scales_zeros[0]), expert_strides([packed, scales_zeros]), n, block_n,
            group_size, *arrays, out.data_ptr(), int(accumulate),
            torch.get_num_threads(), int8_planes,
        )  # fmt: skip
        return out

    def matmul_as(
        self, rows: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor,
        group_size: int, block_n: int, dtype: torch.dtype, int8_planes: int = 0,
    ) -> torch.Tensor:  # fmt: skip
        """`matmul` of float32 or bf16 rows (contiguous), the float32 product returned as
        `dtype` (float32 or bf16, rounded once): one call where a decode step's linear made
        three (the rows widened, the product, its rounding)."""
        r, k = rows.shape
        terms = _table_width(scales_zeros)
        out = torch.empty(r, scales_zeros.shape[1], dtype=dtype)
        self.library.kiln_int4_mm_cast(
            CAST_DTYPES[rows.dtype], rows.data_ptr(), r, k, packed.data_ptr(),
            scales_zeros.data_ptr(), terms, scales_zeros.shape[1], block_n, group_size,
            CAST_DTYPES[dtype], out.data_ptr(), torch.get_num_threads(), int8_planes,
        )  # fmt: skip
        return out

    def dequantize_t(
        self, packed: torch.Tensor, scales_zeros: torch.Tensor, group_size: int, block_n: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:  # fmt: skip
        """W^T [K, N] in `dtype` (float32 or bf16), bit for bit what `cpu_dequantize_t` makes
        with PyTorch's ops, about 8x faster: the weight of the large-batch path's dense matmul."""
        terms = _table_width(scales_zeros)
        k, n = packed.shape[1] * 2, scales_zeros.shape[1]
        out = torch.empty(k, n, dtype=dtype)
        self.library.kiln_int4_dequantize_t(
            packed.data_ptr(), scales_zeros.data_ptr(), terms, n, k, block_n, group_size,
            CAST_DTYPES[dtype], out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return out


CAST_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # matmul_as's rows and outputs


def _table_width(table: torch.Tensor) -> int:
    """The table's values an output and group, 1 or 2 (checked: the kernel strides by it). The
    kernel reads a contiguous bf16 table, as pack_plane makes it; this runs on every linear of
    every step, so it checks only what picks the path."""
    if table.dim() != 3 or table.shape[2] not in (1, 2):
        raise ValueError(f"a [K/G, N, 1 or 2] table, not {tuple(table.shape)}")
    return table.shape[2]


@functools.cache
def int4_matmul_kernel() -> Int4MatmulKernel | None:
    """The engine's kernel: built once per machine and cache directory, None where it cannot be
    built or has no vector path (aten's kernel stays then)."""
    return checked_kernel(
        "int4 matmul",
        lambda: load_int4_matmul(FLAGS),
        self_check_error,
        SELF_CHECK_TOLERANCE,
        "packed weights run on PyTorch's int4 kernel, slower on AVX2 CPUs",
    )


SELF_CHECK_TOLERANCE = 1e-4  # float32 sums over 256 columns: ~1e-6; a wrong code or scale: ~1


def self_check_error(kernel: Int4MatmulKernel) -> float:
    """The kernel's largest error on a small random matrix in both CPU layouts (blocks of 32
    and 64) and both table widths, relative to the largest float64 product by hand, with
    float32 rows and (where it has that path) int8 planes of them: a vector path that misreads
    the layout on some CPU is found at boot, not in a model's output."""
    g = torch.Generator().manual_seed(0)
    n, k, group = 128, 256, 32
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scale, zero = torch.rand(n, k // group, generator=g), torch.randn(n, k // group, generator=g)
    pairs = torch.stack([scale.t(), zero.t()], -1).to(torch.bfloat16).contiguous()
    x = torch.randn(5, k, generator=g)
    worst = 0.0
    for block in (32, 64):
        packed = cpu_pack(codes, block)
        for table in (pairs, pairs[..., :1].contiguous()):
            w = cpu_dequantize_t(packed, table, group, torch.float64, block)
            for planes in (0, 1, 2) if kernel.int8_rows_for(block) else (0,):
                want = int8_rows_product(x, planes, w, table, group)
                got = kernel.matmul(x, packed, table, group, block, int8_planes=planes)
                worst = max(worst, ((got.double() - want).abs().max() / want.abs().max()).item())
    return worst


def int8_rows_product(
    x: torch.Tensor, planes: int, w: torch.Tensor, scales_zeros: torch.Tensor, group: int
) -> torch.Tensor:
    """float64 product of float32 rows `x` [R, K] and the dequantized weight `w` [K, N] as the
    kernel forms it with `planes` int8 planes (0: the rows as they are): the rows quantized
    per 32 columns exactly as the kernel quantizes them, each group's zero term taken on the
    rows' own float32 sum (sum_k w x = scale sum_k code x^ + (zero - 8 scale) sum_k x)."""
    if planes == 0:
        return x.double() @ w
    approx = quantized_rows(x, planes)
    scale, zero = table_terms(scales_zeros.double())  # [K/G, N]
    bias = (zero - 8 * scale).repeat_interleave(group, 0)  # [K, N]
    return approx @ w + (x.double() - approx) @ bias


def quantized_rows(x: torch.Tensor, planes: int) -> torch.Tensor:
    """float64 [R, K]: float32 rows `x` as the kernels' int8 paths take them, quantized per 32
    columns into `planes` (1 or 2) int8 planes, rounded as their C++ rounds (int8_rows.h)."""
    chunks = x.view(x.shape[0], -1, 32)
    amax = chunks.abs().amax(-1, keepdim=True)
    # 127 / amax divided as C++ does (a Python number over a tensor is 127 * (1 / amax))
    inverse = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(chunks * inverse)
    if planes == 2:  # the remainder of the exact product (float64 holds it), rounded once
        rest = (chunks.double() * inverse.double() - q.double()).float()
        q = q + torch.round(rest * 256).clamp(-127, 127) / 256
    return (q.double() * (amax.double() / 127)).view_as(x)  # float32 scale, as the kernel's


def load_int4_matmul(flags: tuple[str, ...]) -> Int4MatmulKernel:
    """The kernel built with `flags`, loaded; raises where it cannot be built or loaded."""
    library = ctypes.CDLL(str(built_library(SOURCE, flags)))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.kiln_int4_mm_isa.restype = ctypes.c_int
    library.kiln_int4_mm.restype = None
    flag = ctypes.c_int
    library.kiln_int4_mm.argtypes = [ptr, i64, i64, ptr, ptr, flag, i64, i64, i64, ptr, flag, flag,
                                     flag]  # fmt: skip
    library.kiln_int4_mm_cast.argtypes = [flag, ptr, i64, i64, ptr, ptr, flag, i64, i64, i64, flag,
                                          ptr, flag, flag]  # fmt: skip
    library.kiln_int4_mm_experts.restype = None
    library.kiln_int4_mm_experts.argtypes = [ptr, i64, i64, ptr, ptr, flag, ptr, i64, i64, i64,
                                             i64, ptr, ptr, ptr, ptr, flag, flag, flag]  # fmt: skip
    library.kiln_int4_mm_int8_block.restype = flag
    library.kiln_int4_mm_int8_block.argtypes = [i64]
    library.kiln_int4_dequantize_t.restype = None
    library.kiln_int4_dequantize_t.argtypes = [ptr, ptr, flag, i64, i64, i64, i64, flag, ptr, flag]
    int8_blocks = tuple(b for b in CPU_BLOCKS if library.kiln_int4_mm_int8_block(b) == 1)
    declare_route_entries(library)
    return Int4MatmulKernel(library, library.kiln_int4_mm_isa(), int8_blocks)


def describe_int4_kernel() -> str:
    """Which kernel multiplies packed weights below the dequantize switch, for the boot log."""
    kernel = int4_matmul_kernel()
    if kernel is None:
        return "PyTorch's _weight_int4pack_mm_for_cpu (kiln's kernel was not built)"
    return f"kiln's C++ kernel built with {ISA_NAMES[kernel.isa]}"
