"""A step's experts as the grouped entry points of kiln's CPU kernels take them
(`kiln_q6k_mm_experts`, `kiln_kquant_mm_experts`, `kiln_int4_mm_experts`): one call for every
active expert of a projection, where a call per expert costs its own ctypes call, row
quantization and OpenMP fork and join (about 9 us on two threads before any weight is read)."""

from __future__ import annotations

import ctypes
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
