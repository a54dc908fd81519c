"""kiln's CPU bf16 matmul (`csrc/bf16_mm.cpp`): bf16 rows times a bf16 weight packed in pairs
along its input dimension, the layout AVX512-BF16's pair products read, built at first use
(kiln/native.py).

On CPUs with AVX512-BF16 it runs every bf16 linear of a model in place of oneDNN's: 1.2-2x
oneDNN's speed up to 64 rows (the rows of decode steps) and level with it at 528 (a prefill
chunk), measured on an AMD EPYC (docs/performance.md, "A bf16 kernel for the linears"). On a
CPU with AMX its batches of 2 rows and more run on AMX tiles, from the same packed weight:
1.4-1.5x oneDNN's own AMX path at 1 to 64 rows and 1.05x at 512 on a 2-core Xeon
(docs/performance.md, "On a CPU with AMX tiles"). Where the kernel cannot use the tiles
(Linux refused them) on an AMX CPU, oneDNN keeps the linears. The portable build is the
reference the tests hold the vector build to, never the engine's path."""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.native import FLAGS, built_library, checked_kernel, cpu_flags

SOURCE = Path(__file__).parent / "csrc" / "bf16_mm.cpp"
COLUMNS = 16  # output columns in one packed vector


@dataclass(frozen=True)
class Bf16MatmulKernel:
    """The loaded library: `matmul` multiplies bf16 rows by a weight from `pack_pairs`."""

    library: ctypes.CDLL
    vectorized: bool  # AVX512-BF16; else the portable loops
    amx: bool = False  # batches of 2+ rows on AMX tiles

    def matmul(
        self, rows: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """bf16 [R, K] rows (contiguous, K even) times the packed [N, K] weight, plus `bias`
        (bf16 [N]) -> bf16 [R, N]."""
        m, k = rows.shape
        if (
            k != 2 * packed.shape[1]
            or packed.shape[0] * COLUMNS < n
            or (bias is not None and (bias.dtype != torch.bfloat16 or bias.numel() < n))
        ):  # the C++ side trusts every size it is given
            raise ValueError(
                f"bf16_mm: rows {tuple(rows.shape)}, packed {tuple(packed.shape)}, n {n}, "
                f"bias {None if bias is None else (tuple(bias.shape), bias.dtype)} do not fit"
            )
        out = torch.empty(m, n, dtype=torch.bfloat16)
        self.library.kiln_bf16_mm(
            rows.data_ptr(), m, k, packed.data_ptr(), n,
            None if bias is None else bias.data_ptr(), out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return out

    def silu_mul(self, rows: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
        """A gated MLP's activation fused into its product: bf16 [R, K] rows times the packed
        [2n, K] weight of its gate (first n columns) and up projection (last n), then
        silu(gate) * up from the float32 sums, rounded once -> bf16 [R, n]; n % 16 == 0."""
        m, k = rows.shape
        if k != 2 * packed.shape[1] or n % COLUMNS or packed.shape[0] * COLUMNS != 2 * n:
            raise ValueError(
                f"bf16_mm_silu_mul: rows {tuple(rows.shape)}, packed {tuple(packed.shape)}, "
                f"n {n} do not fit (the weight holds 2n columns, n a multiple of {COLUMNS})"
            )
        out = torch.empty(m, n, dtype=torch.bfloat16)
        self.library.kiln_bf16_mm_silu_mul(
            rows.data_ptr(), m, k, packed.data_ptr(), n, out.data_ptr(), torch.get_num_threads()
        )
        return out


def pack_pairs(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 [N, K] weight (K even) as [ceil(N/16), K/2, 16, 2]: for every 16 output columns
    and pair of input columns, the 32 values one vdpbf16ps reads; columns past N are zeros."""
    n, k = weight.shape
    vectors = -(-n // COLUMNS)
    padded = torch.zeros(vectors * COLUMNS, k, dtype=torch.bfloat16)
    padded[:n] = weight
    return padded.view(vectors, COLUMNS, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def unpack_pairs(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The [N, K] weight `pack_pairs` packed."""
    vectors, pairs = packed.shape[:2]
    return packed.permute(0, 2, 1, 3).reshape(vectors * COLUMNS, pairs * 2)[:n].contiguous()


def pairs_runs(weight: torch.Tensor) -> bool:
    """Whether the engine runs `weight` ([N, K] on the CPU) on kiln's kernel: bf16, K even, a
    kernel built with AVX512-BF16 on this machine, which on a CPU with AMX uses its tiles
    (else oneDNN's AMX path is faster)."""
    if not (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.shape[1] % 2 == 0
        and kernel_runs_here()
    ):
        return False
    # the tiles take k in chunks of 32; other widths would take the vector path at every batch
    # size, where oneDNN's AMX path is faster from a few rows
    return not has_amx() or weight.shape[1] % 32 == 0


def kernel_runs_here() -> bool:
    """Whether kiln's kernel takes this CPU's bf16 linears (AVX512-BF16, and AMX tiles where
    the CPU has them)."""
    kernel = bf16_matmul_kernel()
    return kernel is not None and (kernel.amx or not has_amx())


@functools.cache
def has_amx() -> bool:
    """Whether this CPU has AMX's bf16 tiles (Intel Sapphire Rapids and later)."""
    return "amx_bf16" in cpu_flags().split()


@functools.cache
def bf16_matmul_kernel() -> Bf16MatmulKernel | None:
    """The engine's kernel: built once per machine and cache directory, None where it cannot be
    built or this CPU lacks AVX512-BF16 (oneDNN runs the bf16 linears then)."""
    return checked_kernel(
        "bf16 matmul",
        lambda: load_bf16_matmul(FLAGS),
        self_check_error,
        SELF_CHECK_TOLERANCE,
        "bf16 linears run on oneDNN, slower for decode steps",
    )


SELF_CHECK_TOLERANCE = 1e-2  # the output's own bf16 rounding is 2^-9 of a value; a misread: ~1


def self_check_error(kernel: Bf16MatmulKernel) -> float:
    """The kernel's largest error on a small random product (ragged rows, columns and a bias),
    relative to the largest float64 value by hand: a vector path that misreads the layout on
    some CPU is found at boot, not in a model's output."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(37, 64, generator=g).to(torch.bfloat16)
    bias = torch.randn(37, generator=g).to(torch.bfloat16)
    rows = torch.randn(11, 64, generator=g).to(torch.bfloat16)
    want = rows.double() @ weight.double().t() + bias.double()
    got = kernel.matmul(rows, pack_pairs(weight), 37, bias).double()
    return ((got - want).abs().max() / want.abs().max()).item()


def load_bf16_matmul(flags: tuple[str, ...]) -> Bf16MatmulKernel:
    """The kernel built with `flags`, loaded; raises where it cannot be built or loaded."""
    library = ctypes.CDLL(str(built_library(SOURCE, flags)))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.kiln_bf16_mm_isa.restype = ctypes.c_int
    library.kiln_bf16_mm.restype = None
    library.kiln_bf16_mm.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, ctypes.c_int]
    if hasattr(library, "kiln_bf16_mm_silu_mul"):  # absent from a source before it (an A/B)
        library.kiln_bf16_mm_silu_mul.restype = None
        library.kiln_bf16_mm_silu_mul.argtypes = [ptr, i64, i64, ptr, i64, ptr, ctypes.c_int]
    amx = getattr(library, "kiln_bf16_mm_amx", None)  # None: a source from before it (an A/B)
    if amx is not None:
        amx.restype = ctypes.c_int
    return Bf16MatmulKernel(library, library.kiln_bf16_mm_isa() == 1, bool(amx and amx()))


def describe_bf16_kernel(fallback: str = "oneDNN") -> str:
    """What multiplies the bf16 linears on this CPU under `--cpu-linears auto`, for the boot
    log; `fallback` names what runs them where kiln's kernel does not."""
    kernel = bf16_matmul_kernel()
    if kernel is None:
        return f"{fallback} (kiln's bf16 kernel needs AVX512-BF16 and a C++ compiler)"
    if kernel.amx:
        return "kiln's C++ kernel: AMX tiles from 2 rows, AVX512-BF16 for one"
    if has_amx():
        return f"{fallback} (this CPU has AMX, and kiln's kernel cannot use its tiles here)"
    return "kiln's C++ kernel built with AVX512-BF16"


def _kernel_and_rows(x: torch.Tensor, op: str) -> tuple[Bf16MatmulKernel, torch.Tensor]:
    kernel = bf16_matmul_kernel()
    if kernel is None:  # a graph traced where the kernel ran, called where it does not
        raise RuntimeError(f"kiln::{op} needs kiln's bf16 kernel, which is not built here")
    # a decode step makes ~120 of these calls: no reshape, cast or copy that is not needed
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if rows.dtype != torch.bfloat16 or not rows.is_contiguous():
        rows = rows.to(torch.bfloat16).contiguous()
    return kernel, rows


def _pairs_linear(
    x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None
) -> torch.Tensor:
    kernel, rows = _kernel_and_rows(x, "bf16_mm")
    y = kernel.matmul(rows, packed, n, bias)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], n)


def _pairs_silu_mul(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    kernel, rows = _kernel_and_rows(x, "bf16_mm_silu_mul")
    y = kernel.silu_mul(rows, packed, n)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], n)


# Opaque in compiled graphs, like kiln::onednn_linear: Inductor's code calls it through the
# dispatcher; eager calls skip the dispatcher (a decode step makes ~120 of these calls).
_LIB = torch.library.Library("kiln", "FRAGMENT")
_LIB.define("bf16_mm(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor")
_LIB.impl("bf16_mm", _pairs_linear, "CompositeExplicitAutograd")
torch.library.register_fake(
    "kiln::bf16_mm",
    lambda x, packed, n, bias: x.new_empty(*x.shape[:-1], n, dtype=torch.bfloat16),
    lib=_LIB,
)
_LIB.define("bf16_mm_silu_mul(Tensor x, Tensor packed, int n) -> Tensor")
_LIB.impl("bf16_mm_silu_mul", _pairs_silu_mul, "CompositeExplicitAutograd")
torch.library.register_fake(
    "kiln::bf16_mm_silu_mul",
    lambda x, packed, n: x.new_empty(*x.shape[:-1], n, dtype=torch.bfloat16),
    lib=_LIB,
)


def pairs_linear(
    x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] times a `pack_pairs` weight of `n` output columns, plus `bias`: bf16 [..., n]."""
    if torch.compiler.is_compiling():
        return torch.ops.kiln.bf16_mm(x, packed, n, bias)
    return _pairs_linear(x, packed, n, bias)


def pairs_silu_mul(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """silu(x W_gate) * (x W_up) for a `pack_pairs` weight of 2n columns (gate, then up):
    bf16 [..., n], the activation applied to the product's float32 sums (`silu_mul`)."""
    if torch.compiler.is_compiling():
        return torch.ops.kiln.bf16_mm_silu_mul(x, packed, n)
    return _pairs_silu_mul(x, packed, n)
