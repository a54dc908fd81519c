"""GGUF's Q6_K kept packed on the CPU, 6.56 bits a weight, for kiln's Q6_K kernel
(kiln/layers/q6k_kernel.py): llama.cpp's Q4_K_M files carry their embedding (a Llama 3.2's
tied head) and some down and value projections in Q6_K, which dequantized to bf16 streamed 2.4
times the bytes a decode step reads from the file.

A step's rows meet it as kiln/layers/packed_rows.py says: as int8 planes into the kernel, or
a large batch through a dense copy or the weight dequantized."""

from __future__ import annotations

import torch

from kiln.layers.packed import _LIB, PackedWeight, QuantizedTensor
from kiln.layers.packed_rows import output_dtype, row_kernel_product
from kiln.layers.q6k_kernel import q6k_matmul_kernel
from kiln.layers.q6k_layout import Q6KPacked, pack_q6k, q6k_dequantize, q6k_rows


class PackedQ6K(PackedWeight):
    """One Q6_K matrix in kiln's layout, its matmul and its rows (CPU only)."""

    layout = "q6_k"

    def __init__(self, t: QuantizedTensor) -> None:
        super().__init__(t.kind, *t.shape)
        packed = pack_q6k(t.planes[0])  # type: ignore[arg-type]
        for name in ("low", "high", "sub_scales", "d"):
            self.register_buffer(name, getattr(packed, name))

    @property
    def tensors(self) -> Q6KPacked:
        """The buffers as the kernel and the layout's readers take them."""
        return Q6KPacked(self.low, self.high, self.sub_scales, self.d)

    @property
    def padded_out(self) -> int:
        return self.sub_scales.shape[1]

    def describe(self) -> str:
        return "6-bit packed (Q6_K's layout)"

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        y = torch.ops.kiln.q6k_mm(
            rows, self.low, self.high, self.sub_scales, self.d, self.dense, self.int8_planes
        )
        return self.finish(y, x, bias)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized rows `ids` (an embedding lookup)."""
        return q6k_rows(self.tensors, ids).to(dtype)

    def dequantize(self) -> torch.Tensor:
        kernel = q6k_matmul_kernel()
        if kernel is None:
            return q6k_dequantize(self.tensors)[: self.out_features]
        return kernel.dequantize_t(self.tensors, torch.float32).t()[: self.out_features]


def q6k_matmul(
    rows: torch.Tensor,
    low: torch.Tensor,
    high: torch.Tensor,
    sub_scales: torch.Tensor,
    d: torch.Tensor,
    dense: torch.Tensor | None = None,
    int8_planes: int = 0,
) -> torch.Tensor:
    """CPU, [R, K] rows times a Q6_K weight -> [R, N padded] (kiln/layers/packed_rows.py)."""
    kernel = q6k_matmul_kernel()
    w = Q6KPacked(low, high, sub_scales, d)
    return row_kernel_product(
        rows, dense, sub_scales.shape[1], int8_planes,
        lambda x, dtype, planes: kernel.matmul(x, w, dtype, planes),
        lambda dtype: kernel.dequantize_t(w, dtype),
    )  # fmt: skip


_LIB.define(
    "q6k_mm(Tensor rows, Tensor low, Tensor high, Tensor sub_scales, Tensor d, Tensor? dense, "
    "int int8_planes=0) -> Tensor"
)
_LIB.impl("q6k_mm", q6k_matmul, "CompositeExplicitAutograd")


def _q6k_mm_fake(rows, low, high, sub_scales, d, dense, int8_planes=0) -> torch.Tensor:
    return rows.new_empty(rows.shape[0], sub_scales.shape[1], dtype=output_dtype(rows, dense))


torch.library.register_fake("kiln::q6k_mm", _q6k_mm_fake, lib=_LIB)
