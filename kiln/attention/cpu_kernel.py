"""The CPU attention kernels (`csrc/paged_decode.cpp`: decode rows, with `csrc/decode_bf16.h`
for bf16 over a bf16 cache on AVX-512 and `csrc/decode_int8.h` over an int8 cache on
AVX512-VNNI; `csrc/prefill.h`, in the same library: prefill
chunks), built at first use with the machine's C++ compiler
(kiln/native.py) and loaded with ctypes. Where it cannot be built (no
compiler) the backend keeps its PyTorch path, and says so once."""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.native import FLAGS, build_failure, built_library

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}  # int8: caches only
MAX_HEADS, MAX_HEAD_DIM = 64, 256
ISA_NAMES = {0: "portable loops", 1: "AVX2", 2: "AVX-512", 3: "AVX-512 with BF16 dot products"}


@dataclass(frozen=True)
class PagedDecodeKernel:
    """The loaded library: `run` attends decode rows over the paged cache in place."""

    library: ctypes.CDLL
    isa: int  # 0 portable, 1 AVX2 with FMA, 2 AVX-512, 3 AVX512-BF16

    @property
    def vectorized(self) -> bool:
        return self.isa > 0

    def int8_queries(self, head_dim: int) -> bool:
        """Whether an int8 cache's keys are scored by integer dot products, the query quantized
        per head to int8 as the cache's rows are (AVX512-VNNI builds, head_dim % 32 == 0)."""
        query = getattr(self.library, "kiln_paged_decode_int8_queries", None)
        return bool(query and query(head_dim))  # None: a source from before it (an A/B)

    def int8_values(self, head_dim: int) -> bool:
        """Whether decode rows over an int8 cache add values by integer dot products too, each
        step's softmax weights (times the value rows' scales) quantized to 8 bits per head
        (AVX512-VNNI and AVX512-BW builds, head_dim % 64 == 0)."""
        query = getattr(self.library, "kiln_paged_decode_int8_values", None)
        return bool(query and query(head_dim))  # None: a source from before it (an A/B)

    def prefill_supported(self, head_dim: int) -> bool:
        """Whether prefill chunks of head_dim can go through the prefill kernel (vectorised
        builds, head_dim a multiple of 8 up to 256; float32, bf16 and int8 caches)."""
        query = getattr(self.library, "kiln_paged_prefill_supported", None)
        return bool(query and query(head_dim))  # None: a source from before it (an A/B)

    def pair_scores(self, head_dim: int) -> bool:
        """Whether bf16 decode rows over a bf16 cache score keys by AVX512-BF16 pair products
        (builds without AMX, head_dim % 32 == 0), not by float32 FMAs on widened rows."""
        query = getattr(self.library, "kiln_paged_decode_pair_scores", None)
        return bool(query and query(head_dim))  # None: a source from before it (an A/B)

    def pair_values(self, head_dim: int) -> bool:
        """Whether those rows add values by AVX512-BF16 pair products over two keys at a time,
        the softmax weights rounded to bf16 (with pair scores unless a build says otherwise),
        not by float32 FMAs on widened rows."""
        query = getattr(self.library, "kiln_paged_decode_pair_values", None)
        return bool(query and query(head_dim))  # None: a source from before it (an A/B)

    def prefill_amx(self, head_dim: int) -> bool:
        """Whether bf16 prefill chunks over a bf16 cache take AMX tile products (a build with
        AMX on a CPU that has it, head_dim % 32 == 0)."""
        query = getattr(self.library, "kiln_paged_prefill_amx", None)
        return bool(query and query(head_dim))  # None: a source from before it (an A/B)

    def supports(self, dtype: torch.dtype, heads: int, head_dim: int) -> bool:
        return dtype in DTYPES and heads <= MAX_HEADS and head_dim <= MAX_HEAD_DIM

    def run(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        tables: torch.Tensor, lens: torch.Tensor, out: torch.Tensor, scale: float,
    ) -> None:  # fmt: skip
        """q, out: [rows, heads, head_dim] contiguous; caches [blocks, block_size, kv_heads,
        head_dim], float32 or bf16 whatever q is, or int8 [..., head_dim + 4] (values and
        scale, kiln/attention/kv_int8.py); tables [rows, width] and lens [rows] int32:
        each row's keys are the first lens[r] slots its table maps."""
        rows, heads, dim = q.shape
        _, block_size, kv_heads, _ = k_cache.shape
        threads = torch.get_num_threads()
        splits = decode_splits(rows, int(lens.max()) if rows else 0, threads)
        work = torch.empty(rows * splits * (heads * dim + 2 * heads), dtype=torch.float32)
        self.library.kiln_paged_decode(
            DTYPES[q.dtype], DTYPES[k_cache.dtype], q.data_ptr(), k_cache.data_ptr(),
            v_cache.data_ptr(),
            tables.data_ptr(), lens.data_ptr(), out.data_ptr(), work.data_ptr(), rows, heads,
            kv_heads, dim, block_size, tables.shape[1], splits, scale, threads,
        )  # fmt: skip

    def step(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
        k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
        out: torch.Tensor, scale: float,
    ) -> None:  # fmt: skip
        """A step of decode rows only, in one call: each row's k and v ([rows, kv_heads,
        head_dim] contiguous, q's dtype) written into the caches at `slots` (int64, the first
        rows read), then `run` over them; out is [rows, heads * head_dim] or as `run` takes it."""
        rows, heads, dim = q.shape
        _, block_size, kv_heads, _ = k_cache.shape
        self.library.kiln_paged_decode_step(
            DTYPES[q.dtype], DTYPES[k_cache.dtype], q.data_ptr(), k.data_ptr(), v.data_ptr(),
            slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
            lens.data_ptr(), out.data_ptr(), rows, heads, kv_heads, dim, block_size,
            tables.shape[1], scale, torch.get_num_threads(),
        )  # fmt: skip

    def prefill(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        tables: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, out: torch.Tensor,
        scale: float,
    ) -> None:  # fmt: skip
        """Prefill chunks, causal: request r's query tokens [starts[r], starts[r + 1]) of q and
        out ([tokens, heads, head_dim] contiguous) over the first lens[r] keys of its table row
        (the chunk's own keys written into the caches first); caches as `run` takes them, tables
        [reqs, width], starts [reqs + 1] and lens [reqs] int32."""
        _, heads, dim = q.shape
        _, block_size, kv_heads, _ = k_cache.shape
        self.library.kiln_paged_prefill(
            DTYPES[q.dtype], DTYPES[k_cache.dtype], q.data_ptr(), k_cache.data_ptr(),
            v_cache.data_ptr(), tables.data_ptr(), starts.data_ptr(), lens.data_ptr(),
            out.data_ptr(), lens.shape[0], heads, kv_heads, dim, block_size, tables.shape[1],
            scale, torch.get_num_threads(),
        )  # fmt: skip

    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> None:  # fmt: skip
        """A step's k and v ([n, kv_heads, head_dim] contiguous, float32 or bf16) into the
        caches (flat [slots, kv_heads, width]: float32, bf16, or int8 rows as `write_int8`
        writes them) at `slots` [n] int64, converted as torch's `.to` rounds."""
        n, heads, dim = k.shape
        self.library.kiln_write_kv(
            DTYPES[k.dtype], DTYPES[k_cache.dtype], k.data_ptr(), v.data_ptr(), slots.data_ptr(),
            n, heads, dim, k_cache.data_ptr(), v_cache.data_ptr(),
        )  # fmt: skip

    def write_int8(self, rows: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor) -> None:
        """rows [n, kv_heads, head_dim] (float32 or bf16, contiguous) quantized into the int8
        cache (flat [slots, kv_heads, head_dim + 4]) at `slots` [n] int64, as
        kv_int8.quantize does."""
        n, heads, dim = rows.shape
        self.library.kiln_write_int8(DTYPES[rows.dtype], rows.data_ptr(), slots.data_ptr(), n,
                                     heads, dim, cache.data_ptr())  # fmt: skip


def decode_splits(rows: int, longest: int, threads: int) -> int:
    """Ranges each row's keys are cut into: enough work items for every thread (a few each, as
    rows differ in length), none shorter than about 512 keys."""
    if rows == 0:
        return 1
    return max(1, min(-(-longest // 512), -(-4 * threads // rows)))


@functools.cache
def paged_decode_kernel() -> PagedDecodeKernel | None:
    """The kernel, built once per machine and cache directory; None where it cannot be."""
    try:
        return load_paged_decode(FLAGS)
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        logger.warning(
            "the CPU decode-attention kernel could not be built (%s): decode attention takes the "
            "slower PyTorch path. Remedy: install a C++ compiler with OpenMP (g++), or set CXX",
            build_failure(exc),
        )
        return None


def load_paged_decode(flags: tuple[str, ...], source: Path = SOURCE) -> PagedDecodeKernel:
    """The kernel built from `source` with `flags` (cached on disk by both), loaded; raises where
    it cannot be built or loaded. `paged_decode_kernel` is the engine's; other flags are for
    tests (the portable build: FLAGS without -march=native), other sources for
    benchmarks/decode_kernel_ab.py (a version before a change)."""
    library = ctypes.CDLL(str(built_library(source, flags)))
    _declare(library)
    return PagedDecodeKernel(library, library.kiln_paged_decode_isa())


def _declare(library: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.kiln_paged_decode_isa.restype = ctypes.c_int
    if hasattr(library, "kiln_paged_decode_int8_queries"):
        library.kiln_paged_decode_int8_queries.restype = ctypes.c_int
        library.kiln_paged_decode_int8_queries.argtypes = [i64]
    library.kiln_write_int8.restype = None
    library.kiln_write_int8.argtypes = [ctypes.c_int, ptr, ptr, i64, i64, i64, ptr]
    if hasattr(library, "kiln_write_kv"):  # absent from a source before it (an A/B)
        library.kiln_write_kv.restype = None
        library.kiln_write_kv.argtypes = [ctypes.c_int, ctypes.c_int, *[ptr] * 3, *[i64] * 3,
                                          ptr, ptr]  # fmt: skip
    if hasattr(library, "kiln_paged_prefill"):
        library.kiln_paged_prefill_supported.restype = ctypes.c_int
        library.kiln_paged_prefill_supported.argtypes = [i64]
        library.kiln_paged_prefill.restype = None
        prefill_args = [ctypes.c_int, ctypes.c_int, *[ptr] * 7, *[i64] * 6, ctypes.c_float]
        library.kiln_paged_prefill.argtypes = [*prefill_args, ctypes.c_int]
    for query in ("kiln_paged_decode_pair_scores", "kiln_paged_decode_pair_values",
                  "kiln_paged_decode_int8_values"):  # fmt: skip
        if hasattr(library, query):
            getattr(library, query).restype = ctypes.c_int
            getattr(library, query).argtypes = [i64]
    if hasattr(library, "kiln_paged_prefill_amx"):
        library.kiln_paged_prefill_amx.restype = ctypes.c_int
        library.kiln_paged_prefill_amx.argtypes = [i64]
    if hasattr(library, "kiln_paged_decode_step"):
        library.kiln_paged_decode_step.restype = None
        step_args = [ctypes.c_int, ctypes.c_int, *[ptr] * 9, *[i64] * 6, ctypes.c_float]
        library.kiln_paged_decode_step.argtypes = [*step_args, ctypes.c_int]
    library.kiln_paged_decode.restype = None
    library.kiln_paged_decode.argtypes = [ctypes.c_int, ctypes.c_int, *[ptr] * 7, *[i64] * 7,
                                          ctypes.c_float, ctypes.c_int]  # fmt: skip
