"""A step's experts as the grouped entry points of kiln's CPU kernels take them
(`kiln_q6k_mm_experts`, `kiln_kquant_mm_experts`, `kiln_int4_mm_experts`): one call for every
active expert of a projection, where a call per expert costs its own ctypes call, row
quantization and OpenMP fork and join (about 9 us on two threads before any weight is read)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch

Int64Array = ctypes.Array[ctypes.c_int64]


def _int64s(values: list[int]) -> Int64Array:
    return (ctypes.c_int64 * len(values))(*values)


@dataclass(frozen=True)
class ExpertGroups:
    """Group g: rows [starts[g], starts[g] + counts[g]) of a step's rows, sorted by expert,
    go to expert experts[g]."""

    experts: list[int]
    starts: list[int]
    counts: list[int]

    def arrays(self, rows: int, experts: int) -> tuple[int, Int64Array, Int64Array, Int64Array]:
        """(groups, experts, starts, counts) as the C entry points take them, checked against a
        step of `rows` rows and a stack of `experts` experts (the C code trusts them)."""
        spans = sorted(zip(self.starts, self.counts, strict=True))
        ends = [start + count for start, count in spans]
        if any(not 0 <= e < experts for e in self.experts) or any(
            start < 0 or count < 0 for start, count in spans
        ) or (ends and ends[-1] > rows) or any(
            spans[i + 1][0] < ends[i] for i in range(len(spans) - 1)
        ):  # fmt: skip
            raise ValueError(f"expert groups {self} do not fit {rows} rows and {experts} experts")
        return len(self.experts), *(_int64s(v) for v in (self.experts, self.starts, self.counts))


def expert_strides(buffers: list[torch.Tensor]) -> Int64Array:
    """Bytes from one expert's part of each stacked buffer [experts, ...] to the next's."""
    return _int64s([b.stride(0) * b.element_size() for b in buffers])


def check_rows(rows: torch.Tensor, k: int, dtypes) -> None:
    """Rows a kernel takes: contiguous [R, k], float32 or bf16."""
    if rows.shape[-1] != k or not rows.is_contiguous() or rows.dtype not in dtypes:
        raise ValueError(f"contiguous float32 or bf16 rows of {k} columns, not "
                         f"{rows.dtype} {tuple(rows.shape)}")  # fmt: skip


ROUTE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the rows', weights' and output's codes


def declare_route_entries(library: ctypes.CDLL) -> None:
    """The argument types of `csrc/moe_route.h`'s entries, which every packed-weight kernel's
    library exports."""
    i64, ptr, flag = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    library.kiln_moe_route.restype = i64
    library.kiln_moe_route.argtypes = [ptr, i64, i64, i64, flag, ptr, i64, ptr, ptr, ptr]
    library.kiln_moe_silu_mul.restype = None
    library.kiln_moe_silu_mul.argtypes = [ptr, i64, i64, i64, ptr]
    library.kiln_moe_combine.restype = None
    library.kiln_moe_combine.argtypes = [ptr, i64, i64, i64, ptr, i64, flag, ptr, flag, ptr]


@dataclass(frozen=True)
class RoutedRows:
    """A step's routed rows as a kernel library sorted them (`kiln_moe_route`): `rows` float32
    [R, K], sorted row r being token order[r] // top_k's; the groups, in the form the grouped
    entry points take (`arrays`), lie in `groups` [3 * active] (experts, starts, counts)."""

    rows: torch.Tensor
    order: torch.Tensor
    groups: torch.Tensor
    active: int
    num_experts: int
    top_k: int

    def arrays(self, rows: int, experts: int) -> tuple[int, int, int, int]:
        """ExpertGroups.arrays for these groups (checked by the C routing as it made them)."""
        if rows != self.rows.shape[0] or experts != self.num_experts:
            raise ValueError(f"{self.rows.shape[0]} rows routed over {self.num_experts} experts, "
                             f"not {rows} over {experts}")  # fmt: skip
        start = self.groups.data_ptr()
        return self.active, start, start + 8 * self.active, start + 16 * self.active


def route_rows(
    library: ctypes.CDLL, x: torch.Tensor, ids: torch.Tensor, num_experts: int
) -> RoutedRows:
    """x [tokens, K] (float32 or bf16) routed by ids [tokens, top_k]: the rows sorted by expert
    (stable) and gathered as float32."""
    if ids.dim() != 2 or ids.shape[0] != x.shape[0] or x.dim() != 2 or num_experts <= 0:
        raise ValueError(
            f"ids [tokens, top_k] for x [tokens, K] over some experts, not ids "
            f"{tuple(ids.shape)}, x {tuple(x.shape)}, {num_experts} experts"
        )
    ids = ids.to(torch.int64).contiguous()
    x = x.contiguous()
    count, k = ids.numel(), x.shape[-1]
    order = torch.empty(count, dtype=torch.int64)
    groups = torch.empty(3 * count, dtype=torch.int64)
    rows = torch.empty(count, k, dtype=torch.float32)
    active = library.kiln_moe_route(
        ids.data_ptr(), count, ids.shape[-1], num_experts, ROUTE_DTYPES[x.dtype], x.data_ptr(),
        k, order.data_ptr(), groups.data_ptr(), rows.data_ptr(),
    )  # fmt: skip
    if active < 0:
        raise ValueError(f"an expert id outside [0, {num_experts}) in {ids.tolist()}")
    return RoutedRows(rows, order, groups, active, num_experts, ids.shape[-1])


def silu_mul(library: ctypes.CDLL, h: torch.Tensor, width: int) -> torch.Tensor:
    """float32 [R, width]: silu(gate) * up of h [R, >= 2 width] (float32, contiguous), gate its
    first `width` columns, up the next."""
    if h.dtype != torch.float32 or not h.is_contiguous() or h.shape[-1] < 2 * width:
        raise ValueError(f"contiguous float32 [R, >= {2 * width}] sums, not {h.dtype} "
                         f"{tuple(h.shape)}")  # fmt: skip
    act = torch.empty(h.shape[0], width, dtype=torch.float32)
    library.kiln_moe_silu_mul(h.data_ptr(), h.shape[0], h.shape[-1], width, act.data_ptr())
    return act


def combine_rows(
    library: ctypes.CDLL, y: torch.Tensor, routed: RoutedRows, weights: torch.Tensor, width: int,
    dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """[tokens, width] in `dtype` (float32 or bf16): each token's routed rows of y [R, >= width]
    (float32, sorted as `routed`) times their weights [tokens, top_k], summed in float32."""
    if y.dtype != torch.float32 or not y.is_contiguous() or y.shape[0] != routed.rows.shape[0]:
        raise ValueError(f"contiguous float32 [{routed.rows.shape[0]}, N] products, not "
                         f"{y.dtype} {tuple(y.shape)}")  # fmt: skip
    if weights.numel() != y.shape[0] or width > y.shape[-1]:
        raise ValueError(f"{weights.numel()} routing weights for {y.shape[0]} routed rows, "
                         f"{width} of {y.shape[-1]} columns")  # fmt: skip
    if weights.dtype not in ROUTE_DTYPES:
        weights = weights.float()
    weights = weights.contiguous()
    out = torch.empty(y.shape[0] // routed.top_k, width, dtype=dtype)
    library.kiln_moe_combine(
        y.data_ptr(), y.shape[0], y.shape[-1], width, routed.order.data_ptr(), routed.top_k,
        ROUTE_DTYPES[weights.dtype], weights.data_ptr(), ROUTE_DTYPES[dtype], out.data_ptr(),
    )  # fmt: skip
    return out


def grouped_product(
    entry: Callable[..., None], rows: torch.Tensor, k: int, settings: tuple[int, ...],
    buffers: list[torch.Tensor], n: int, groups: ExpertGroups | RoutedRows, dtype: torch.dtype,
    int8_planes: int,
) -> torch.Tensor:  # fmt: skip
    """A call of a kernel's grouped entry point (`kiln_q6k_mm_experts`, `kiln_kquant_mm_experts`):
    rows [R, k] (float32 or bf16, sorted by expert) times the experts of `buffers` (the layout's,
    each with a leading expert dimension) -> [R, n] in `dtype`, group g's rows times expert
    experts[g] (rows of no group: zeros). `settings` are the entry's arguments between k and
    the buffers (the K-quant kernel's bits)."""
    check_rows(rows, k, ROUTE_DTYPES)
    out = torch.empty(rows.shape[0], n, dtype=dtype)
    arrays = groups.arrays(rows.shape[0], buffers[0].shape[0])
    entry(
        ROUTE_DTYPES[rows.dtype], rows.data_ptr(), rows.shape[0], k, *settings,
        *(b.data_ptr() for b in buffers), expert_strides(buffers), n, *arrays,
        ROUTE_DTYPES[dtype], out.data_ptr(), int8_planes, torch.get_num_threads(),
    )  # fmt: skip
    return out
