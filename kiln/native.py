"""kiln's C++ CPU kernels, built at first use with the machine's C++ compiler and loaded with
ctypes (the decode-attention kernel, the int4 matmul).

Built, not shipped: `-march=native` gives a kernel the CPU's AVX-512 and AVX512-BF16, or AVX2
and FMA, where they exist, and the compiler it needs is the one Inductor already needs for mode
3 on the CPU. A library is cached under kiln's cache directory, keyed by its source, the headers
beside it, the flags, the compiler's version and the CPU's flags, so a boot after the first only
loads it."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from kiln.paths import kiln_cache_dir, process_umask

logger = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
# Builds for a lesser CPU than this one, as tests and benchmarks make them: the portable loops,
# and AVX2 with FMA (the vector paths of x86 CPUs without AVX-512)
PORTABLE_FLAGS = tuple(f for f in FLAGS if f != "-march=native")
AVX2_FLAGS = (*PORTABLE_FLAGS, "-mavx2", "-mfma")
Kernel = TypeVar("Kernel")


def built_library(source: Path, flags: tuple[str, ...]) -> Path:
    """The shared library of `source` built with `flags`, from the cache or built now; raises
    RuntimeError (no compiler, a failed build) or OSError/SubprocessError where it cannot."""
    compiler = _compiler()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60)
    key = hashlib.sha256()
    parts = [*(f.read_bytes() for f in [source, *included_headers(source)]),
             " ".join(flags).encode()]  # fmt: skip
    for part in (*parts, version.stdout.encode(), cpu_flags().encode()):
        key.update(part)
    path = Path(kiln_cache_dir()) / "kernels" / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}", suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run([compiler, *flags, str(source), "-o", tmp], capture_output=True,
                              text=True, timeout=300)  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.chmod(tmp, 0o777 & ~process_umask())
        os.replace(tmp, path)  # another process building it too renames an equal file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def included_headers(source: Path) -> list[Path]:
    """The headers `source` includes by quoted name (`#include "x.h"`), found beside the file
    that includes them, and theirs in turn: what a build of it depends on besides itself."""
    found: list[Path] = []
    pending = [source]
    while pending:
        including = pending.pop()
        text = including.read_text(errors="replace")
        for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', text, re.MULTILINE):
            header = (including.parent / name).resolve()
            if header.is_file() and header not in found:
                found.append(header)
                pending.append(header)
    return found


def checked_kernel(
    name: str,
    load: Callable[[], Kernel],
    error: Callable[[Kernel], float],
    tolerance: float,
    instead: str,
) -> Kernel | None:
    """The engine's build of a matmul kernel (`load()`), or None with a warning: where it cannot
    be built, where it has no vector path (`.vectorized`), or where its self-check `error`
    exceeds `tolerance` (a vector path that misreads its layout on some CPU is found at boot,
    not in a model's output). `instead` says what runs then."""
    try:
        kernel = load()
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        logger.warning(
            "kiln's CPU %s could not be built (%s): %s. Remedy: install a C++ compiler with "
            "OpenMP (g++), or set CXX",
            name,
            build_failure(exc),
            instead,
        )
        return None
    if not kernel.vectorized:  # type: ignore[attr-defined]
        return None
    measured = error(kernel)
    if not measured <= tolerance:  # NaN too: garbage read as NaN must not pass
        logger.warning(
            "kiln's CPU %s disagrees with a product by hand on a known matrix (relative error "
            "%.2e): %s. Remedy: none needed to serve; report the CPU's flags (grep flags "
            "/proc/cpuinfo)",
            name,
            measured,
            instead,
        )
        return None
    return kernel


def build_failure(exc: BaseException) -> str:
    """The last line of a failed build's message, short enough for a warning."""
    text = str(exc).strip()
    return text.splitlines()[-1][:300] if text else type(exc).__name__


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    raise RuntimeError("no C++ compiler found (looked for $CXX, g++, c++, clang++)")


def runs_avx2() -> bool:
    """Whether this CPU runs an AVX2_FLAGS build (AVX2 and FMA)."""
    return {"avx2", "fma"} <= set(cpu_flags().split())


def cpu_flags() -> str:
    """The CPU's feature flags (Linux): a cache shared across machines gets a build per CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""
