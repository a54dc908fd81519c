"""GGUF's Q5_K and Q4_K kept packed on the CPU, 5.75 and 4.75 bits a weight, for kiln's
K-quant kernel (kiln/layers/kquant_kernel.py): llama.cpp's Q5_K_M and Q5_K_S files hold most
of their matrices in Q5_K, which dequantized to bf16 streamed 2.9 times the bytes a decode step
reads from the file (a 1B Q5_K_M-like file decoded 1.73x faster packed, mode 3).

Q4_K ran on the int4 kernel before, as an int4 plane whose bf16 scale and zero per 32 columns
round d·sc (5 bits a weight); here its values are exact and it streams 5% fewer bytes, as fast
or faster (a 1B Q4_K_M-like file decoded 1.15x, 1.02x and 1.12x as fast in three in-process
A/Bs; docs/performance.md, "Q5_K and Q4_K on the K-quant kernel"). Where this kernel does not
run, `kiln.layers.packed.for_device` makes it the int4 plane again.

A step's rows meet it as kiln/layers/packed_rows.py says: as int8 planes into the kernel, or
a large batch through a dense copy or the weight dequantized."""

from __future__ import annotations

import torch

from kiln.layers.kquant_kernel import kquant_matmul_kernel
from kiln.layers.kquant_layout import KQuantPacked, kquant_dequantize, kquant_rows, pack_kquant
from kiln.layers.packed import _LIB, PackedWeight, QuantizedTensor
from kiln.layers.packed_rows import output_dtype, row_kernel_product

BUFFERS = ("low", "high", "scales_mins", "d_dmin")


class PackedKQuant(PackedWeight):
    """One Q5_K or Q4_K matrix in kiln's K-quant layout, its matmul and its rows (CPU only)."""

    layout = "q5_k"  # "q4_k" for a Q4_K matrix

    def __init__(self, t: QuantizedTensor) -> None:
        super().__init__(t.kind, *t.shape)
        packed = pack_kquant(t.planes[0])  # type: ignore[arg-type]
        for name in BUFFERS:
            self.register_buffer(name, getattr(packed, name))
        self.layout = f"q{packed.bits}_k"

    @property
    def tensors(self) -> KQuantPacked:
        """The buffers as the kernel and the layout's readers take them."""
        return KQuantPacked(self.low, self.high, self.scales_mins, self.d_dmin)

    @property
    def padded_out(self) -> int:
        return self.tensors.out_features

    def describe(self) -> str:
        return f"{self.tensors.bits}-bit packed (Q{self.tensors.bits}_K's layout)"

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        y = torch.ops.kiln.kquant_mm(
            rows, self.low, self.high, self.scales_mins, self.d_dmin, self.dense, self.int8_planes
        )
        return self.finish(y, x, bias)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized rows `ids` (an embedding lookup)."""
        return kquant_rows(self.tensors, ids).to(dtype)

    def dequantize(self) -> torch.Tensor:
        kernel = kquant_matmul_kernel()
        if kernel is None:
            return kquant_dequantize(self.tensors)[: self.out_features]
        return kernel.dequantize_t(self.tensors, torch.float32).t()[: self.out_features]


def kquant_matmul(
    rows: torch.Tensor,
    low: torch.Tensor,
    high: torch.Tensor,
    scales_mins: torch.Tensor,
    d_dmin: torch.Tensor,
    dense: torch.Tensor | None = None,
    int8_planes: int = 0,
) -> torch.Tensor:
    """CPU, [R, K] rows times a K-quant weight -> [R, N padded] (kiln/layers/packed_rows.py)."""
    kernel = kquant_matmul_kernel()
    w = KQuantPacked(low, high, scales_mins, d_dmin)
    return row_kernel_product(
        rows, dense, w.out_features, int8_planes,
        lambda x, dtype, planes: kernel.matmul(x, w, dtype, planes),
        lambda dtype: kernel.dequantize_t(w, dtype),
    )  # fmt: skip


_LIB.define(
    "kquant_mm(Tensor rows, Tensor low, Tensor high, Tensor scales_mins, Tensor d_dmin, "
    "Tensor? dense, int int8_planes=0) -> Tensor"
)
_LIB.impl("kquant_mm", kquant_matmul, "CompositeExplicitAutograd")


def _kquant_mm_fake(rows, low, high, scales_mins, d_dmin, dense, int8_planes=0) -> torch.Tensor:
    n = scales_mins.shape[0] * scales_mins.shape[3]
    return rows.new_empty(rows.shape[0], n, dtype=output_dtype(rows, dense))


torch.library.register_fake("kiln::kquant_mm", _kquant_mm_fake, lib=_LIB)
