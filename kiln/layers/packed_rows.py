"""How a step's rows meet a weight on one of kiln's int8-row kernels (Q6_K's, the K-quants'):
the dense copy where one is kept (`--prefill-weights`) and the batch is large enough for it
(from INT8_COPY_MIN_ROWS rows, and DENSE_MIN_ROWS on oneDNN);
from DEQUANT_MIN_ROWS rows the weight dequantized and one dense matmul (with int8 planes only
where AMX multiplies bf16, as int4_matmul chooses); else the kernel, each row alone, the rows as
int8 planes (two unless `--packed-activations int8` asks for one; `float` keeps two, these
kernels having no float path)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kiln.layers.bf16_kernel import has_amx
from kiln.layers.int4_kernel import CAST_DTYPES
from kiln.layers.packed import DEQUANT_MIN_ROWS, INT8_COPY_MIN_ROWS, dense_product


def output_dtype(rows: torch.Tensor, dense: torch.Tensor | None) -> torch.dtype:
    """The dense copy's dtype, else the rows' where the kernels write it (float32, bf16), else
    float32 (fp16 rows: the layer rounds once, to fp16)."""
    if dense is not None:
        return dense.dtype
    return rows.dtype if rows.dtype in CAST_DTYPES else torch.float32


def row_kernel_product(
    rows: torch.Tensor,
    dense: torch.Tensor | None,
    n: int,
    int8_planes: int,
    matmul: Callable[[torch.Tensor, torch.dtype, int], torch.Tensor],
    dequantize_t: Callable[[torch.dtype], torch.Tensor],
) -> torch.Tensor:
    """[R, K] rows times a packed weight -> [R, n] in `output_dtype`. `matmul(rows, dtype,
    planes)` and `dequantize_t(dtype)` are the weight's kernel calls."""
    copy = dense is not None and rows.shape[0] >= INT8_COPY_MIN_ROWS
    if copy and (y := dense_product(rows, dense, n)) is not None:
        return y
    dtype = output_dtype(rows, dense)
    inner = dtype if dtype in CAST_DTYPES else torch.float32  # an fp16 dense copy's rows
    if rows.shape[0] >= DEQUANT_MIN_ROWS and (int8_planes == 0 or has_amx()):
        return (rows.to(inner) @ dequantize_t(inner)).to(dtype)
    rows = (rows if rows.dtype in CAST_DTYPES else rows.float()).contiguous()
    return matmul(rows, inner, int8_planes or 2).to(dtype)
