"""Weights kept 4-bit packed: PyTorch's own int4 kernels, no extension built at install; and
`PackedWeight`, what every packed matrix shares (GGUF's Q6_K and Q5_K keep codes of their
own: kiln/layers/packed_q6k.py, kiln/layers/packed_kquant.py).

Every 4-bit format here is one or two planes of 4-bit codes with an affine map per group of
`group_size` input columns: w[n, k] = (code[n, k] - 8) * scale[n, g] + zero[n, g], g = k // G.
That is the map of PyTorch's int4 kernels (`_weight_int4pack_mm_for_cpu`, tinygemm's
`_weight_int4pack_mm` on CUDA), which take bf16 activations and a [K/G, N, 2] bf16 table of
(scale, zero); on the CPU a plane whose zeros are all 0 keeps the scales alone ([K/G, N, 1]),
which kiln's kernel reads in 10% fewer bytes a weight (kiln/layers/cpu_int4_layout.py). GGUF's
Q4_0, Q4_1 and Q4_K and GPTQ/AutoRound's 4-bit formats are one plane
exactly (only their fp16 scales round to bf16); Q8_0 is two: its int8 q = 16 * hi + lo splits
into a high plane (hi + 8, scale 16d) and a low one (lo, scale d, zero 8d), whose products add.

On the CPU the rows of a step go to kiln's own int4 kernel (kiln/layers/int4_kernel.py, built
at first use where a C++ compiler exists), which reads the same packed bytes as aten's and takes
float32 rows as they are: 2.4-4.3x aten's float32 path and 1.3-2.5x its bf16 kernel on an
AVX2 CPU (docs/performance.md, "kiln's int4 kernel"). Without it, aten's kernel takes bf16
rows, so a float32 model's rows go in split in two (the bf16 value and the bf16 of the
remainder, products added in float32): 16 bits of each activation. Either is a matrix-vector
kernel whose time grows with the rows: from 256 rows on (prefill chunks), dequantizing the
weight (to float32 for a float32 model, bf16 for a bf16 one) and running one dense matmul is
faster. Both compute each row on its own, so a step of fewer rows (every decode step of up to
255 streams) gives a row the same result whatever else is in the batch; a step with a long
prefill chunk does not. The op picks by the row count at run time: the row count is dynamic in
compiled graphs, so the choice cannot be made while tracing.

Dequantizing every weight for every prefill chunk costs about as much as the chunk's matmuls.
A half-precision model on the CPU can instead keep a dense copy of each packed weight beside it
(`dense`, set by kiln/boot/prefill_weights.py): a bf16 copy packed in pairs for kiln's bf16
kernel where it runs, which takes batches from PAIRS_MIN_ROWS rows (INT8_COPY_MIN_ROWS where
one plane's rows go in as int8 planes), else a oneDNN copy, from DENSE_MIN_ROWS rows; smaller
batches (decode steps) stream the 4-bit planes."""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from kiln.layers.bf16_kernel import bf16_matmul_kernel, has_amx
from kiln.layers.cpu_int4_layout import (
    CPU_BLOCKS,
    cpu_block_n,
    cpu_dequantize_t,
    cpu_pack,
    cpu_rows,
    pairs_table,
    scale_only_table,
)
from kiln.layers.int4_kernel import CAST_DTYPES, int4_matmul_kernel
from kiln.layers.kquant_kernel import kquant_matmul_kernel
from kiln.layers.kquant_layout import KQuantCodes
from kiln.layers.q6k_kernel import q6k_matmul_kernel
from kiln.layers.q6k_layout import Q6KCodes

KERNEL_GROUP_SIZES = (32, 64, 128, 256)
DEQUANT_MIN_ROWS = 256  # on the CPU, from here on dequantize + dense matmul is faster
# with a dense copy, from here on its oneDNN matmul beats the int4 kernel streaming 4x fewer
# bytes (docs/performance.md, "Packed weights under concurrency")
DENSE_MIN_ROWS = 16
# with a copy on kiln's bf16 kernel, from here on: 6.1 against 9.3 ms at 2 rows, 9.6 against 31
# at 16, for the embedded model's 30 layers (docs/performance.md, "A bf16 kernel for the linears")
PAIRS_MIN_ROWS = 2
# rows that go into a kernel as int8 planes take the bf16 copy from here: a decode step of up to
# 3 rows streams the packed weight. In the engine (a 1B Q4_K_M-like file, bf16) three streams
# decoded 1.18x faster so, six streams 0.82x (the copy faster there); 4 and 5 were not measured
# apart (docs/performance.md, "Q5_K and Q4_K on the K-quant kernel")
INT8_COPY_MIN_ROWS = 4


@dataclass
class Int4Codes:
    """One plane of a checkpoint tensor as it leaves the loader, before packing."""

    codes: torch.Tensor  # uint8 [N, K], values 0..15
    scale: torch.Tensor  # float32 [N, K // group_size]
    zero: torch.Tensor  # float32 [N, K // group_size]
    group_size: int

    def dequantize(self) -> torch.Tensor:
        g = self.group_size
        s, z = self.scale.repeat_interleave(g, 1), self.zero.repeat_interleave(g, 1)
        return (self.codes.float() - 8) * s + z

    def map_rows(self, rows: Callable[[torch.Tensor], torch.Tensor]) -> Int4Codes:
        """The same rows of codes, scales and zeros (`rows` cuts, permutes or indexes dim 0)."""
        return Int4Codes(rows(self.codes), rows(self.scale), rows(self.zero), self.group_size)

    @staticmethod
    def cat(planes: list[Int4Codes]) -> Int4Codes:
        """Planes of one group size stacked by rows."""
        fields = (torch.cat([getattr(p, f) for p in planes]) for f in ("codes", "scale", "zero"))
        return Int4Codes(*fields, planes[0].group_size)


@dataclass
class QuantizedTensor:
    """A checkpoint matrix in a packable format: `kind` names it ("Q4_1", "gptq", ...)."""

    kind: str
    planes: list[Int4Codes] | list[Q6KCodes] | list[KQuantCodes]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.planes[0].codes.shape)  # type: ignore[return-value]

    @property
    def group_size(self) -> int:
        return self.planes[0].group_size

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: the reference, and the dense fallback."""
        return functools.reduce(torch.add, (p.dequantize() for p in self.planes))


def quantized_form(t: QuantizedTensor) -> tuple:
    """What parts must share to be stacked into one packed matrix."""
    first = t.planes[0]
    return type(first), len(t.planes), t.group_size, getattr(first, "bits", None)


def as_int4_plane(t: QuantizedTensor) -> QuantizedTensor:
    """A Q4_K matrix read for kiln's K-quant kernel (`KQuantCodes` of 4 bits) as the int4 plane
    the other kernels take: scale d sc, zero 8 d sc - dmin mn per 32 columns (scales that round
    to bf16 when packed). Any other tensor as it is."""
    plane = t.planes[0]
    if not isinstance(plane, KQuantCodes) or plane.bits != 4:
        return t
    scale, minimum = plane.scales()
    zero = 8 * scale - minimum
    return QuantizedTensor(t.kind, [Int4Codes(plane.codes, scale, zero, plane.group_size)])


def for_device(t: QuantizedTensor, device: torch.device) -> QuantizedTensor:
    """`t` in the form `device`'s kernels take: a Q4_K matrix stays on the K-quant kernel (exact,
    4.75 bits a weight) where that runs with a vector path as wide as the int4 kernel's, else
    becomes an int4 plane (on Skylake and Cascade Lake, AVX-512 without VBMI, the int4 kernel's
    AVX-512 float path ran Q4_K 1.3-1.5x faster than the K-quant kernel's AVX2 one)."""
    plane = t.planes[0]
    if not isinstance(plane, KQuantCodes) or plane.bits != 4:
        return t
    kquant, int4 = kquant_matmul_kernel(), int4_matmul_kernel()
    if device.type == "cpu" and kquant is not None and (int4 is None or kquant.isa >= int4.isa):
        return t
    return as_int4_plane(t)


def cat_rows(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """Parts of a fused layer (q, k, v) stacked by rows into one tensor."""
    first = parts[0].planes
    planes = [type(first[i]).cat([p.planes[i] for p in parts]) for i in range(len(first))]
    return QuantizedTensor("+".join(sorted({p.kind for p in parts})), planes)


def unpackable_reason(t: QuantizedTensor, device: torch.device) -> str | None:
    """Why no kernel runs `t` on `device` (an int4 kernel, or kiln's Q6_K or K-quant kernel), or
    None."""
    k = t.shape[1]
    if isinstance(t.planes[0], (Q6KCodes, KQuantCodes)):
        name = "Q6_K" if isinstance(t.planes[0], Q6KCodes) else "K-quant"
        if device.type != "cpu":
            return f"{t.kind} stays packed on the CPU only (device {device.type})"
        if (q6k_matmul_kernel() if name == "Q6_K" else kquant_matmul_kernel()) is None:
            return f"kiln's {name} kernel needs AVX2 with FMA and a C++ compiler"
        return None
    if t.group_size not in KERNEL_GROUP_SIZES:
        return f"group size {t.group_size} (the int4 kernels take {KERNEL_GROUP_SIZES})"
    if k % t.group_size:
        return f"{k} input features are not a multiple of the group size {t.group_size}"
    if device.type == "cuda" and k % 32:
        return f"{k} input features (tinygemm needs a multiple of 32)"
    if device.type not in ("cpu", "cuda"):
        return f"device {device.type}"
    if device.type == "cpu" and cpu_block_n() is None:
        return "this PyTorch build packs int4 weights in a layout kiln does not know"
    return None


class PackedWeight(nn.Module, abc.ABC):
    """What every packed matrix shares: its shape, how a step's rows go into its kernel, and the
    dense copy a half-precision model may keep beside it for large batches."""

    layout = "packed"  # Linear's and the embedding's name for it

    def __init__(self, kind: str, out_features: int, in_features: int) -> None:
        super().__init__()
        self.kind, self.out_features, self.in_features = kind, out_features, in_features
        self.int8_planes = 0  # rows into kiln's CPU kernels as int8 planes (--packed-activations)
        # oneDNN copy for large batches (CPU only); a parameter, as Linear's oneDNN weight is:
        # the compile cache's trace cannot save an oneDNN tensor held as a buffer
        self.register_parameter("dense", None)

    @property
    @abc.abstractmethod
    def padded_out(self) -> int:
        """The output width of the kernels: out_features padded to their block."""

    @abc.abstractmethod
    def dequantize(self) -> torch.Tensor:
        """float32 [N, K] as the kernels see the weight."""

    @abc.abstractmethod
    def describe(self) -> str:
        """What the weight became, for `kiln info`."""

    def products(self) -> list[PackedWeight]:
        """The packed matrices that multiply rows, each of which may keep a dense copy."""
        return [self]

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """This weight dequantized to `dtype`, [N padded, in]: padded with zero rows as the
        packed form is, so the op's two paths return the same width."""
        w = self.dequantize().to(dtype)
        pad = self.padded_out - w.shape[0]
        return torch.cat([w, w.new_zeros(pad, w.shape[1])]) if pad else w

    def keep_dense_copy(self, dense: torch.Tensor) -> None:
        """`dense`: `dense_weight` packed in pairs for kiln's bf16 kernel (4-D) or prepacked for
        oneDNN (2-D)."""
        self.dense = nn.Parameter(dense, requires_grad=False)

    def finish(self, y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The op's [R, N padded] product as the layer's output: cut, cast, biased, reshaped."""
        y = y[:, : self.out_features].to(x.dtype)
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], self.out_features)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())


class PackedInt4(PackedWeight):
    """The packed planes of one weight matrix, its matmul and its rows."""

    layout = "int4"

    def __init__(self, t: QuantizedTensor, device: torch.device) -> None:
        super().__init__(t.kind, *t.shape)
        self.group_size, self.num_planes = t.group_size, len(t.planes)
        self.block_n = cpu_block_n() if device.type == "cpu" else 0  # a constant when traced
        for i, plane in enumerate(t.planes):
            packed, scales_zeros = pack_plane(plane, device)
            self.register_buffer(f"packed{i}", packed)
            self.register_buffer(f"scales_zeros{i}", scales_zeros)

    @property
    def padded_out(self) -> int:
        return self.scales_zeros0.shape[1]

    def describe(self) -> str:
        planes = " (two planes)" if self.num_planes == 2 else ""
        return f"int4 packed, group {self.group_size}{planes}"

    def planes(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        n = range(self.num_planes)
        return [getattr(self, f"packed{i}") for i in n], [
            getattr(self, f"scales_zeros{i}") for i in n
        ]

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        packed, scales_zeros = self.planes()
        if rows.device.type == "cpu" and self.dense is not None:
            second = len(packed) == 2
            y = torch.ops.kiln.int4_or_dense_mm(
                rows, packed[0], scales_zeros[0], packed[1] if second else None,
                scales_zeros[1] if second else None, self.dense, self.group_size, self.int8_planes,
            )  # fmt: skip
        elif rows.device.type == "cpu":
            second = len(packed) == 2
            y = torch.ops.kiln.int4_mm(
                rows, packed[0], scales_zeros[0], self.group_size,
                packed[1] if second else None, scales_zeros[1] if second else None,
                self.int8_planes,
            )  # fmt: skip
        else:
            y = _tinygemm(rows, packed, scales_zeros, self.group_size)
        return self.finish(y, x, bias)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized rows `ids` (an embedding lookup), CPU layout only."""
        packed, scales_zeros = self.planes()
        out = [cpu_rows(p, sz, ids, self.group_size, self.block_n)
               for p, sz in zip(packed, scales_zeros)]  # fmt: skip
        return functools.reduce(torch.add, out).to(dtype)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K] of the packed planes, as the kernels see them (bf16 scales; on CUDA
        read back through tinygemm itself, one identity row per column, so rounded to bf16)."""
        packed, scales_zeros = self.planes()
        if packed[0].device.type == "cpu":
            out = [
                cpu_dequantize_t(p, sz, self.group_size, torch.float32, self.block_n)
                for p, sz in zip(packed, scales_zeros)
            ]
        else:
            eye = torch.eye(self.in_features, dtype=torch.bfloat16, device=packed[0].device)
            out = [
                torch.ops.aten._weight_int4pack_mm(eye, p, self.group_size, sz).float()
                for p, sz in zip(packed, scales_zeros)
            ]
        w = functools.reduce(torch.add, out)
        return w.t()[: self.out_features]


def pack_plane(plane: Int4Codes, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes, [K/G, N, 2] bf16 scales and zeros) in the layout of `device`'s kernel;
    [K/G, N, 1] (the scales) where every zero is 0 and kiln's CPU kernel runs it (aten's takes
    pairs only). Rows are padded to the kernel's block (64 or 32 on the CPU, 8 on CUDA) with
    zero weights."""
    block = (cpu_block_n() or CPU_BLOCKS[0]) if device.type == "cpu" else 8
    codes, scale, zero = plane.codes, plane.scale, plane.zero
    pad = -codes.shape[0] % block
    if pad:
        codes = torch.cat([codes, codes.new_full((pad, codes.shape[1]), 8)])
        scale, zero = (torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in (scale, zero))
    scales_zeros = torch.stack([scale.t(), zero.t()], -1).to(torch.bfloat16).contiguous()
    if device.type == "cpu":
        packed = cpu_pack(codes.to(torch.uint8), block)
        if int4_matmul_kernel() is not None:
            scales_zeros = scale_only_table(scales_zeros)
    else:  # tinygemm takes two codes per byte, the even column in the high nibble
        pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8).to(device)
        k = codes.shape[1]
        inner_k_tiles = 8 if k % 256 == 0 else 4 if k % 128 == 0 else 2
        packed = torch.ops.aten._convert_weight_to_int4pack(pairs.contiguous(), inner_k_tiles)
    return packed, scales_zeros.to(device)


def split_float32(rows: torch.Tensor) -> torch.Tensor:
    """float32 [R, K] -> bf16 [2R, K]: the top 16 bits of each value (exact in bf16), then
    the rest rounded to bf16; their sum holds 16 significant bits. Cut with a bit mask, not
    by rounding to bf16 and back: Inductor keeps bf16 intermediates in float32, and would
    make that round trip a no-op and the rest zero."""
    high = (rows.view(torch.int32) & -65536).view(torch.float32)
    return torch.stack([high, rows - high]).to(torch.bfloat16).flatten(0, 1)


def _tinygemm(rows, packed, scales_zeros, group_size: int) -> torch.Tensor:
    """CUDA: tinygemm on bf16 rows (float32 rows split in two), summed in float32; plain
    tensor ops around aten's kernel, which Inductor calls and CUDA graphs capture."""
    split = rows.dtype == torch.float32
    high = split_float32(rows) if split else rows.to(torch.bfloat16)
    y = functools.reduce(torch.add, (
        torch.ops.aten._weight_int4pack_mm(high, p, group_size, sz).float()
        for p, sz in zip(packed, scales_zeros)
    ))  # fmt: skip
    # a view and a sum, not two slices: Inductor (torch 2.11) fails to lower a slice whose end
    # is the step's unbacked row count (KeyError 'unbacked_bindings')
    return y.unflatten(0, (2, -1)).sum(0) if split else y


def int4_matmul(
    rows: torch.Tensor,
    packed: torch.Tensor,
    scales_zeros: torch.Tensor,
    group_size: int,
    packed1: torch.Tensor | None = None,
    scales_zeros1: torch.Tensor | None = None,
    int8_planes: int = 0,
) -> torch.Tensor:
    """CPU, [R, K] rows times one packed plane (and a second one, Q8_0's, added in float32
    before the result is rounded) -> [R, N padded] in float32 (float32 rows) or bf16. Below
    DEQUANT_MIN_ROWS rows kiln's kernel (aten's where it was not built: float32 rows split in
    two), each row computed alone; from there the weight dequantized to the rows' dtype and
    one dense matmul (2.7-4x aten's kernel at 256-512 rows, level with kiln's). `int8_planes`:
    kiln's kernel takes the rows as that many int8 planes (`--packed-activations`), and takes
    them at every row count: at 512 rows two planes are 1.4-1.7x dequantize + matmul."""
    dtype = torch.float32 if rows.dtype == torch.float32 else torch.bfloat16
    large = rows.shape[0] >= DEQUANT_MIN_ROWS
    if large and (int8_planes == 0 or has_amx()) and (kernel := int4_matmul_kernel()):
        return _dequantized_product(kernel, rows.to(dtype), packed, scales_zeros, group_size,
                                    packed1, scales_zeros1)  # fmt: skip
    kernel = int4_matmul_kernel() if not large or int8_planes > 0 else None
    if kernel is not None and packed1 is None and _castable(rows, dtype):
        block = cpu_block_n() or CPU_BLOCKS[0]
        return kernel.matmul_as(rows, packed, scales_zeros, group_size, block, dtype, int8_planes)
    planes = _planes(packed, scales_zeros, packed1, scales_zeros1)
    if kernel is not None:
        y = _kernel_product(kernel, rows, planes, group_size, int8_planes)
        return y if rows.dtype == torch.float32 else y.to(torch.bfloat16)
    if packed1 is not None:  # the planes' float32 sum, rounded once, as the kernel's
        y = _int4_matmul_plane(rows, packed, scales_zeros, group_size).float()
        y += _int4_matmul_plane(rows, packed1, scales_zeros1, group_size).float()
        return y if rows.dtype == torch.float32 else y.to(torch.bfloat16)
    return _int4_matmul_plane(rows, packed, scales_zeros, group_size)


def _dequantized_product(kernel, rows, packed, scales_zeros, group_size, packed1, scales_zeros1):
    """A large batch: each plane dequantized by kiln's kernel (bit for bit cpu_dequantize_t,
    about 8x faster) and one dense matmul; two planes summed in float32 and rounded once. Taken
    with int8 planes too where the CPU multiplies bf16 on AMX tiles: a 512-row chunk of a 1B
    model's linears 5.7-9x faster there than through the int4 kernel on int8 planes
    (docs/performance.md, "A packed prefill without dense copies")."""
    block = cpu_block_n() or CPU_BLOCKS[0]
    planes = _planes(packed, scales_zeros, packed1, scales_zeros1)
    products = [
        rows @ kernel.dequantize_t(codes, sz, group_size, block, rows.dtype) for codes, sz in planes
    ]
    if len(products) == 1:
        return products[0]
    return (products[0].float() + products[1].float()).to(rows.dtype)


def _planes(packed, scales_zeros, packed1, scales_zeros1) -> list:
    """[(codes, scales and zeros)] of one plane, or two (Q8_0)."""
    return [(packed, scales_zeros)] + ([(packed1, scales_zeros1)] if packed1 is not None else [])


def _kernel_product(
    kernel, rows: torch.Tensor, planes, group_size: int, int8_planes: int
) -> torch.Tensor:
    """float32 rows times the planes through kiln's kernel, each added into the first's
    float32 output (rounded by the caller once)."""
    x, block, y = rows.float().contiguous(), cpu_block_n() or CPU_BLOCKS[0], None
    for packed, scales_zeros in planes:
        y = kernel.matmul(
            x, packed, scales_zeros, group_size, block, out=y, int8_planes=int8_planes
        )
    return y


def _castable(rows: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether kiln's kernel takes `rows` and returns `dtype` itself (one plane)."""
    return rows.dtype in CAST_DTYPES and dtype in CAST_DTYPES and rows.is_contiguous()


def _int4_matmul_plane(rows, packed, scales_zeros, group_size: int) -> torch.Tensor:
    """int4_matmul's paths without kiln's kernel, one plane."""
    mm = torch.ops.aten._weight_int4pack_mm_for_cpu
    scales_zeros = pairs_table(scales_zeros)
    if rows.dtype == torch.float32:
        if rows.shape[0] >= DEQUANT_MIN_ROWS:
            return rows @ cpu_dequantize_t(packed, scales_zeros, group_size, torch.float32)
        y = mm(split_float32(rows), packed, group_size, scales_zeros).float()
        return y[: rows.shape[0]].add_(y[rows.shape[0] :])
    rows = rows.to(torch.bfloat16)
    if rows.shape[0] < DEQUANT_MIN_ROWS:
        return mm(rows, packed, group_size, scales_zeros)
    return rows @ cpu_dequantize_t(packed, scales_zeros, group_size)


# Opaque in compiled graphs (the row count is dynamic there, so the choice is made at run
# time): Inductor's generated code calls it through the dispatcher, about 3 us a call. With
# the split and the sums as tensor ops in the graph instead, mode 3 decode of the embedded
# model took 65 ms a step against 13 eager: the time sat in the attention op's own (Python)
# time, not in any kernel; left for the decode-step work (docs/performance.md).
_LIB = torch.library.Library("kiln", "FRAGMENT")
_LIB.define(
    "int4_mm(Tensor rows, Tensor packed, Tensor scales_zeros, int group_size, "
    "Tensor? packed1=None, Tensor? scales_zeros1=None, int int8_planes=0) -> Tensor"
)
_LIB.impl("int4_mm", int4_matmul, "CompositeExplicitAutograd")


def _int4_mm_fake(
    rows, packed, scales_zeros, group_size, packed1=None, scales_zeros1=None, int8_planes=0
) -> torch.Tensor:
    dtype = torch.float32 if rows.dtype == torch.float32 else torch.bfloat16
    return rows.new_empty(rows.shape[0], scales_zeros.shape[1], dtype=dtype)


torch.library.register_fake("kiln::int4_mm", _int4_mm_fake, lib=_LIB)


def _int4_or_dense_mm(
    rows: torch.Tensor,
    packed: torch.Tensor,
    scales_zeros: torch.Tensor,
    packed1: torch.Tensor | None,
    scales_zeros1: torch.Tensor | None,
    dense: torch.Tensor,
    group_size: int,
    int8_planes: int = 0,
) -> torch.Tensor:
    """CPU, [R, K] rows -> [R, N padded] in the dense copy's dtype: the int4 planes (a second
    one for Q8_0, added in float32 by kiln's kernel) below the copy's switch, the dense copy
    (padded like the planes) from there: PAIRS_MIN_ROWS on kiln's bf16 kernel, DENSE_MIN_ROWS
    on oneDNN (INT8_COPY_MIN_ROWS where one plane's rows go in as int8 planes). A decode step
    calls it for every linear, so it does no more than it must."""
    pairs_from = INT8_COPY_MIN_ROWS if int8_planes and packed1 is None else PAIRS_MIN_ROWS
    if dense.dim() == 4 and rows.shape[0] >= pairs_from:
        half = rows.to(torch.bfloat16).contiguous()
        return bf16_matmul_kernel().matmul(half, dense, scales_zeros.shape[1])  # type: ignore[union-attr]
    if dense.dim() == 2 and rows.shape[0] >= DENSE_MIN_ROWS:
        return torch.ops.mkldnn._linear_pointwise(rows.to(dense.dtype), dense, None, "none", [], "")
    kernel = int4_matmul_kernel()
    if kernel is not None and packed1 is None and _castable(rows, dense.dtype):
        block = cpu_block_n() or CPU_BLOCKS[0]
        return kernel.matmul_as(
            rows, packed, scales_zeros, group_size, block, dense.dtype, int8_planes
        )
    planes = _planes(packed, scales_zeros, packed1, scales_zeros1)
    if kernel is not None:
        return _kernel_product(kernel, rows, planes, group_size, int8_planes).to(dense.dtype)
    mm = torch.ops.aten._weight_int4pack_mm_for_cpu
    half = rows.to(torch.bfloat16)  # the planes' products summed in float32, rounded once
    y = functools.reduce(
        torch.add, (mm(half, p, group_size, pairs_table(sz)).float() for p, sz in planes)
    )
    return y.to(dense.dtype)


def dense_product(rows: torch.Tensor, dense: torch.Tensor, n: int) -> torch.Tensor | None:
    """[R, n] from a packed weight's dense copy where the batch is large enough for it (from
    PAIRS_MIN_ROWS on kiln's bf16 kernel, DENSE_MIN_ROWS on oneDNN), else None."""
    if dense.dim() == 4 and rows.shape[0] >= PAIRS_MIN_ROWS:
        half = rows.to(torch.bfloat16).contiguous()
        return bf16_matmul_kernel().matmul(half, dense, n)  # type: ignore[union-attr]
    if dense.dim() == 2 and rows.shape[0] >= DENSE_MIN_ROWS:
        return torch.ops.mkldnn._linear_pointwise(rows.to(dense.dtype), dense, None, "none", [], "")
    return None


_LIB.define(
    "int4_or_dense_mm(Tensor rows, Tensor packed, Tensor scales_zeros, Tensor? packed1, "
    "Tensor? scales_zeros1, Tensor dense, int group_size, int int8_planes=0) -> Tensor"
)
_LIB.impl("int4_or_dense_mm", _int4_or_dense_mm, "CompositeExplicitAutograd")


def _int4_or_dense_mm_fake(
    rows, packed, scales_zeros, packed1, scales_zeros1, dense, group_size, int8_planes=0
) -> torch.Tensor:
    return rows.new_empty(rows.shape[0], scales_zeros.shape[1], dtype=dense.dtype)


torch.library.register_fake("kiln::int4_or_dense_mm", _int4_or_dense_mm_fake, lib=_LIB)
