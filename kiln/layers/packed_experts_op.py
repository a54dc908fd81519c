"""`kiln::moe_experts_packed`: a mixture-of-experts layer's experts on stacks kept packed
(kiln/layers/packed_experts.py), the rows sorted by expert as the dense op sorts them.

On the CPU:
- a step of fewer than DEQUANT_MIN_ROWS routed rows (every decode step) where kiln's kernels
  run both stacks goes through the kernel library from end to end: its C code sorts the rows by
  expert and gathers them, each projection is one call of the kernel for every active expert
  (kiln/layers/expert_groups.py; one per plane for int4 planes), its C code takes silu(gate) *
  up between them and the weighted sum after, all in float32 and rounded once at the end;
- a larger step sorts in PyTorch and, per projection, makes that one call where every expert
  has fewer than DEQUANT_MIN_ROWS rows, else a product per expert (`int4_mm`'s row-count policy
  for int4 planes, kiln/layers/packed_rows.py's for the Q6_K and K-quant kernels).

On CUDA, where experts are int4 planes only (a Q4_K stack becomes one; Q6_K and Q5_K stacks are
dequantized), one launch per projection for all experts, kiln's Triton grouped kernel
(kiln/layers/moe_triton.py) reading the planes in a layout of its own (`nibble_plane`: two
codes a byte, bf16 scales and zeros per group), with the group ends on the device, so a CUDA
graph captures it. A projection that could not be packed passes its dense stack instead."""

from __future__ import annotations

import ctypes
import itertools

import torch
import torch.nn.functional as F

from kiln.layers.cpu_int4_layout import CPU_BLOCKS, cpu_block_n
from kiln.layers.expert_groups import (
    ROUTE_DTYPES,
    ExpertGroups,
    RoutedRows,
    combine_rows,
    route_rows,
    silu_mul,
)
from kiln.layers.expert_routing import combine, sorted_by_expert
from kiln.layers.int4_kernel import CAST_DTYPES, int4_matmul_kernel
from kiln.layers.packed import DEQUANT_MIN_ROWS, int4_matmul
from kiln.layers.packed_experts import DENSE_FORM, KERNEL_LAYOUTS


def _expert_product(
    rows: torch.Tensor, weight: list[torch.Tensor], scales_zeros: list[torch.Tensor],
    form: int, expert: int, out_features: int, int8_planes: int,
) -> torch.Tensor:  # fmt: skip
    """rows times expert `expert`'s projection: a dense stack, the packed planes summed, or
    the Q6_K or K-quant kernel's buffers."""
    if form == DENSE_FORM:
        return F.linear(rows, weight[0][expert])
    if form in KERNEL_LAYOUTS:
        y = KERNEL_LAYOUTS[form].matmul(rows, *(w[expert] for w in weight), None, int8_planes)
        return y[:, :out_features].to(rows.dtype)
    second = (weight[1][expert], scales_zeros[1][expert]) if len(weight) == 2 else (None, None)
    y = int4_matmul(rows, weight[0][expert], scales_zeros[0][expert], form, *second,
                    int8_planes)  # fmt: skip
    return y[:, :out_features].to(rows.dtype)


def _projection(
    rows: torch.Tensor, stack: tuple[list[torch.Tensor], list[torch.Tensor]], form: int,
    groups: ExpertGroups, out_features: int, int8_planes: int,
) -> torch.Tensor:  # fmt: skip
    """Every group's rows (sorted by expert) times its expert's matrix -> [R, out_features]:
    one call of kiln's kernel for all of them (one per plane) where every expert has fewer rows
    than the dense switch (decode steps) and a kernel takes the stack, else a product per
    expert."""
    if groups.counts and max(groups.counts) < DEQUANT_MIN_ROWS:
        y = _one_call(rows, stack, form, groups, int8_planes)
        if y is not None:
            return y[:, :out_features].to(rows.dtype)
    weight, scales_zeros = stack
    out = rows.new_empty(rows.shape[0], out_features)
    for expert, start, count in zip(groups.experts, groups.starts, groups.counts, strict=True):
        out[start : start + count] = _expert_product(
            rows[start : start + count], weight, scales_zeros, form, expert, out_features,
            int8_planes,
        )  # fmt: skip
    return out


def _one_call(
    rows: torch.Tensor, stack: tuple[list[torch.Tensor], list[torch.Tensor]], form: int,
    groups: ExpertGroups | RoutedRows, int8_planes: int,
) -> torch.Tensor | None:  # fmt: skip
    """Every group through one kernel call (one per plane), each group's products bit for bit
    what a call on its rows alone makes: [R, N padded] in the rows' dtype or float32; None
    where no kernel takes the stack (a dense one, int4 planes without kiln's kernel)."""
    weight, scales_zeros = stack
    if form in KERNEL_LAYOUTS:
        x = rows if rows.dtype in CAST_DTYPES else rows.float()
        kernel = KERNEL_LAYOUTS[form].kernel()
        stacked = KERNEL_LAYOUTS[form].layout(*weight)
        return kernel.matmul_experts(x.contiguous(), stacked, groups, x.dtype, int8_planes or 2)
    kernel = int4_matmul_kernel() if form > 0 else None
    if kernel is None:
        return None
    x, block, y = rows.float().contiguous(), cpu_block_n() or CPU_BLOCKS[0], None
    for packed, table in zip(weight, scales_zeros, strict=True):  # Q8_0's planes add up
        y = kernel.matmul_experts(x, packed, table, form, block, groups, y, int8_planes)
    return y if rows.dtype in CAST_DTYPES else y.to(torch.bfloat16)  # int4_matmul's rounding


def _moe_experts_packed(
    x: torch.Tensor, gate_up: list[torch.Tensor], gate_up_sz: list[torch.Tensor],
    down: list[torch.Tensor], down_sz: list[torch.Tensor], forms: list[int],
    intermediate: int, ids: torch.Tensor, weights: torch.Tensor, int8_planes: int = 0,
) -> torch.Tensor:  # fmt: skip
    if x.device.type != "cpu":
        return _experts_on_triton(x, (gate_up, gate_up_sz), (down, down_sz), forms, ids,
                                  weights)  # fmt: skip
    y = _few_rows_step(x, (gate_up, gate_up_sz), (down, down_sz), forms, intermediate, ids,
                       weights, int8_planes)  # fmt: skip
    if y is not None:
        return y
    tokens, order, counts = sorted_by_expert(ids, gate_up[0].shape[0])
    groups = _groups(counts.tolist())
    hidden = _projection(x[tokens], (gate_up, gate_up_sz), forms[0], groups, 2 * intermediate,
                         int8_planes)  # fmt: skip
    gate, up = hidden.chunk(2, dim=-1)
    out = _projection(F.silu(gate) * up, (down, down_sz), forms[1], groups, x.shape[-1],
                      int8_planes)  # fmt: skip
    return combine(x, out, tokens, order, weights)


def _groups(counts: list[int]) -> ExpertGroups:
    """The active experts of a step whose rows are sorted by expert, `counts` rows each."""
    experts = [e for e, count in enumerate(counts) if count]
    starts = list(itertools.accumulate((counts[e] for e in experts), initial=0))[:-1]
    return ExpertGroups(experts, starts, [counts[e] for e in experts])


def _experts_on_triton(
    x: torch.Tensor, gate_up: tuple[list[torch.Tensor], list[torch.Tensor]],
    down: tuple[list[torch.Tensor], list[torch.Tensor]], forms: list[int], ids: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """The CUDA path: every stack in one grouped launch; (planes, scales) pairs whose scales
    list is empty are a dense stack."""
    from kiln.layers.moe_triton import experts_triton  # triton: a CUDA dependency

    if any(form in KERNEL_LAYOUTS for form in forms):
        raise ValueError("kiln's Q6_K and K-quant experts run on the CPU only")

    def stack(planes: list[torch.Tensor], scales_zeros: list[torch.Tensor]):
        return list(zip(planes, scales_zeros, strict=True)) if scales_zeros else planes[0]

    tokens, order, counts = sorted_by_expert(ids, gate_up[0][0].shape[0])
    out = experts_triton(x[tokens], stack(*gate_up), stack(*down), counts, tuple(forms))
    return combine(x, out, tokens, order, weights)


def _route_library(forms: list[int]) -> ctypes.CDLL | None:
    """The library of the kernel that runs the first stack, where kiln's kernels run every
    stack of `forms` (None: a dense stack, or int4 planes without kiln's kernel)."""
    libraries = []
    for form in forms:
        kernel = KERNEL_LAYOUTS[form].kernel() if form in KERNEL_LAYOUTS else None
        if form > 0:
            kernel = int4_matmul_kernel()
        if kernel is None:
            return None
        libraries.append(kernel.library)
    return libraries[0]


def _few_rows_step(
    x: torch.Tensor, gate_up: tuple[list[torch.Tensor], list[torch.Tensor]],
    down: tuple[list[torch.Tensor], list[torch.Tensor]], forms: list[int], intermediate: int,
    ids: torch.Tensor, weights: torch.Tensor, int8_planes: int,
) -> torch.Tensor | None:  # fmt: skip
    """The step through the kernel library alone (see the module's docstring), or None where
    it does not take it: many rows, a row dtype it does not read, a stack no kernel runs."""
    if not 0 < ids.numel() < DEQUANT_MIN_ROWS or x.dtype not in ROUTE_DTYPES:
        return None
    library = _route_library(forms)
    if library is None:
        return None
    routed = route_rows(library, x, ids, gate_up[0][0].shape[0])
    h = _one_call(routed.rows, gate_up, forms[0], routed, int8_planes)
    act = silu_mul(library, h, intermediate)
    y = _one_call(act, down, forms[1], routed, int8_planes)
    return combine_rows(library, y, routed, weights, x.shape[-1], x.dtype)


_LIB = torch.library.Library("kiln", "FRAGMENT")
_LIB.define(
    "moe_experts_packed(Tensor x, Tensor[] gate_up, Tensor[] gate_up_sz, Tensor[] down, "
    "Tensor[] down_sz, int[] forms, int intermediate, Tensor ids, Tensor weights, "
    "int int8_planes=0) -> Tensor"
)
_LIB.impl("moe_experts_packed", _moe_experts_packed, "CompositeExplicitAutograd")


def _moe_experts_packed_fake(
    x, gate_up, gate_up_sz, down, down_sz, forms, intermediate, ids, weights, int8_planes=0,
) -> torch.Tensor:  # fmt: skip
    return torch.empty_like(x)


torch.library.register_fake("kiln::moe_experts_packed", _moe_experts_packed_fake, lib=_LIB)
