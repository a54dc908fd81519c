"""The CPU decode-attention kernel (`csrc/paged_decode.cpp`), built at first use with the
machine's C++ compiler and loaded with ctypes.

Built, not shipped: `-march=native` gives it the CPU's AVX-512 and AVX512-BF16, or AVX2 and
FMA, where they exist, and the compiler it needs is the one Inductor already needs for mode 3 on
the CPU. The library is cached under kiln's cache directory, keyed by the source, the flags, the
compiler's version and the CPU's flags, so a boot after the first only loads it. Where it cannot
be built (no compiler) the backend keeps its PyTorch path, and says so once."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.paths import kiln_cache_dir, process_umask

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
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

    def supports(self, dtype: torch.dtype, heads: int, head_dim: int) -> bool:
        return dtype in DTYPES and heads <= MAX_HEADS and head_dim <= MAX_HEAD_DIM

    def run(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        tables: torch.Tensor, lens: torch.Tensor, out: torch.Tensor, scale: float,
    ) -> None:  # fmt: skip
        """q, out: [rows, heads, head_dim] contiguous; caches [blocks, block_size, kv_heads,
        head_dim]; tables [rows, width] and lens [rows] int32: each row's keys are the first
        lens[r] slots its table maps."""
        rows, heads, dim = q.shape
        _, block_size, kv_heads, _ = k_cache.shape
        threads = torch.get_num_threads()
        splits = decode_splits(rows, int(lens.max()) if rows else 0, threads)
        work = torch.empty(rows * splits * (heads * dim + 2 * heads), dtype=torch.float32)
        self.library.kiln_paged_decode(
            DTYPES[q.dtype], q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            tables.data_ptr(), lens.data_ptr(), out.data_ptr(), work.data_ptr(), rows, heads,
            kv_heads, dim, block_size, tables.shape[1], splits, scale, threads,
        )  # fmt: skip


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
            str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else type(exc).__name__,
        )
        return None


def load_paged_decode(flags: tuple[str, ...]) -> PagedDecodeKernel:
    """The kernel built with `flags` (cached on disk by them), loaded; raises where it cannot be
    built or loaded. `paged_decode_kernel` is the engine's; other flags are for tests (the
    portable build: FLAGS without -march=native)."""
    library = ctypes.CDLL(str(_built_library(flags)))
    _declare(library)
    return PagedDecodeKernel(library, library.kiln_paged_decode_isa())


def _declare(library: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.kiln_paged_decode_isa.restype = ctypes.c_int
    library.kiln_paged_decode.restype = None
    library.kiln_paged_decode.argtypes = [ctypes.c_int, *[ptr] * 7, *[i64] * 7, ctypes.c_float,
                                          ctypes.c_int]  # fmt: skip


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    raise RuntimeError("no C++ compiler found (looked for $CXX, g++, c++, clang++)")


def _built_library(flags: tuple[str, ...]) -> Path:
    compiler = _compiler()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60)
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(flags).encode(), version.stdout.encode(),
                 _cpu_flags().encode()):  # fmt: skip
        key.update(part)
    path = Path(kiln_cache_dir()) / "kernels" / f"paged_decode-{key.hexdigest()[:16]}.so"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}", suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run([compiler, *flags, str(SOURCE), "-o", tmp], capture_output=True,
                              text=True, timeout=300)  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.chmod(tmp, 0o777 & ~process_umask())
        os.replace(tmp, path)  # another process building it too renames an equal file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux): a cache shared across machines gets a build per CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""
