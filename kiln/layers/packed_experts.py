"""Experts kept packed: each projection (gate_up, down) of a mixture-of-experts layer as one
stack over the expert dimension of a packed matrix's tensors per expert: the 4-bit planes of
kiln/layers/packed.py, or on the CPU the buffers of kiln's Q6_K and K-quant kernels
(kiln/layers/packed_q6k.py, kiln/layers/packed_kquant.py). Qwen3-30B-A3B's experts in Q4_K keep
about 17 GB on the CPU (4.75 bits a weight; 18 GB as int4 planes on CUDA) where, dequantized,
they would take 58 GB in bf16; a Q4_K_M file's Q6_K down experts (about half its layers) keep
6.56 bits a weight, not bf16's 16.

Checkpoints store experts one at a time (GGUF's stacked tensors are read one expert at a time
too), so `ExpertPacker` packs each expert as soon as its parts (gate and up, or down) have
arrived, into its slot of the stack. A GGUF file stores a layer's gate stack before its up
stack, so the load holds one layer's gate codes until the up parts arrive, never more. The
stack's first dimension is the expert, so expert parallelism (not built yet) will slice it as
it will slice the dense stack.

The product, `kiln::moe_experts_packed`, is kiln/layers/packed_experts_op.py."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, fields
from types import MappingProxyType

import torch
from torch import nn

from kiln.layers.cpu_int4_layout import cpu_dequantize_t, pairs_table
from kiln.layers.kquant_kernel import kquant_matmul_kernel
from kiln.layers.kquant_layout import KQuantCodes, KQuantPacked, kquant_dequantize, pack_kquant
from kiln.layers.packed import (
    Int4Codes,
    QuantizedTensor,
    as_int4_plane,
    cat_rows,
    for_device,
    pack_plane,
    quantized_form,
)
from kiln.layers.packed import unpackable_reason as matrix_unpackable_reason
from kiln.layers.packed_kquant import kquant_matmul
from kiln.layers.packed_q6k import q6k_matmul
from kiln.layers.q6k_kernel import q6k_matmul_kernel
from kiln.layers.q6k_layout import Q6KCodes, Q6KPacked, pack_q6k, q6k_dequantize

# A stack's form, as the op takes it per projection: a group size (> 0) for int4 planes, else
# one of these. The kernels' forms are one stack per buffer of their layout, in its order.
DENSE_FORM, Q6K_FORM, KQUANT_FORM = 0, -6, -5


@dataclass(frozen=True)
class KernelForm:
    """What a stack on one of kiln's int8-row kernels is made and multiplied with."""

    layout: type  # the packed buffers' record (Q6KPacked, KQuantPacked)
    pack: Callable  # codes -> layout
    dequantize: Callable  # layout -> float32 [N padded, K]
    matmul: Callable  # one expert's rows, packed_rows.py's policy (dequantized from 256 rows)
    kernel: Callable  # the loaded library, whose matmul_experts takes a step's experts at once


KERNEL_LAYOUTS = MappingProxyType({
    Q6K_FORM: KernelForm(Q6KPacked, pack_q6k, q6k_dequantize, q6k_matmul, q6k_matmul_kernel),
    KQUANT_FORM: KernelForm(
        KQuantPacked, pack_kquant, kquant_dequantize, kquant_matmul, kquant_matmul_kernel
    ),
})  # fmt: skip


def form_of(t: QuantizedTensor) -> int:
    """The op's form of a stack of matrices like `t`."""
    plane = t.planes[0]
    if isinstance(plane, Q6KCodes):
        return Q6K_FORM
    return KQUANT_FORM if isinstance(plane, KQuantCodes) else t.group_size


def unpackable_reason(t: QuantizedTensor, device: torch.device) -> str | None:
    """Why an expert's quantized projection is not kept packed on `device`, or None."""
    if form_of(t) in KERNEL_LAYOUTS:  # as for a matrix: those kernels run on the CPU only
        return matrix_unpackable_reason(t, device)
    if device.type == "cpu":
        return matrix_unpackable_reason(t, device)
    if device.type != "cuda":
        return f"device {device.type} (kiln's packed experts run on the CPU and CUDA)"
    k = t.shape[1]
    if k % 2 or k % t.group_size:
        return f"{k} input features (the Triton kernel needs a multiple of 2 and of the group)"
    return None


def nibble_plane(plane: Int4Codes, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A plane in the Triton grouped kernel's layout: codes two to a byte [N, K / 2] (the even
    column in the low nibble), scales and zeros [K / G, N, 2] bf16 (as the packed linears)."""
    codes = plane.codes.to(torch.uint8)
    pairs = codes[:, 0::2] | codes[:, 1::2] << 4
    scales_zeros = torch.stack([plane.scale.t(), plane.zero.t()], -1).to(torch.bfloat16)
    return pairs.contiguous().to(device), scales_zeros.contiguous().to(device)


def nibble_dequantize(pairs: torch.Tensor, scales_zeros: torch.Tensor, group_size: int):
    """float32 [N, K] of a plane in `nibble_plane`'s layout."""
    codes = torch.stack([pairs & 15, pairs >> 4], -1).flatten(-2).float()
    scale, zero = (scales_zeros[..., i].t().float().repeat_interleave(group_size, 1)
                   for i in (0, 1))  # fmt: skip
    return (codes - 8) * scale + zero


def _pack(
    plane: Int4Codes | Q6KCodes | KQuantCodes, form: int, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """One expert's plane as the tensors its stacks hold (a kernel form's: its layout's fields,
    in their order)."""
    if form in KERNEL_LAYOUTS:
        packed = KERNEL_LAYOUTS[form].pack(plane)
        return tuple(getattr(packed, f.name) for f in fields(packed))
    return pack_plane(plane, device) if device.type == "cpu" else nibble_plane(plane, device)


class PackedExperts(nn.Module):
    """One projection of every expert. int4 planes (`form` > 0, the group size): buffers
    `packed{i}` [experts, ...] and `scales_zeros{i}` [experts, K/G, N (padded on the CPU), 2]
    per plane i (two for Q8_0), in the CPU kernel's layout or, on CUDA, `nibble_plane`'s; on
    the CPU [..., 1], the scales alone, where every expert's zeros are 0. Q6_K or K-quant
    (`form` Q6K_FORM or KQUANT_FORM): one buffer [experts, ...] per field of the kernel's
    layout (Q6KPacked, KQuantPacked), under the field's name."""

    def __init__(self, stacks: list[tuple[torch.Tensor, ...]], kind: str, form: int,
                 shape: tuple[int, int]) -> None:  # fmt: skip
        """`stacks[i]`: plane i's tensors (packed, scales and zeros; or the kernel's buffers)
        of every expert."""
        super().__init__()
        self.kind, self.form = kind, form
        self.out_features, self.in_features = shape
        self.num_planes = len(stacks)
        self.int8_planes = 0  # rows into kiln's CPU kernel as int8 planes (--packed-activations)
        self.buffer_names: tuple[str, ...] = ()  # a kernel form's, in its layout's order
        if form in KERNEL_LAYOUTS:
            self.buffer_names = tuple(f.name for f in fields(KERNEL_LAYOUTS[form].layout))
            for name, buffer in zip(self.buffer_names, stacks[0], strict=True):
                self.register_buffer(name, buffer)
            return
        for i, (packed, scales_zeros) in enumerate(stacks):
            self.register_buffer(f"packed{i}", packed)
            self.register_buffer(f"scales_zeros{i}", scales_zeros)

    @property
    def group_size(self) -> int:
        """The int4 planes' group size; 0 for a kernel form (its scales are the layout's)."""
        return max(self.form, 0)

    def describe(self) -> str:
        """The weight report's words for the stack."""
        if self.form == Q6K_FORM:
            return "6-bit packed (Q6_K's layout)"
        if self.form == KQUANT_FORM:
            bits = KQuantPacked(*self.planes()[0]).bits
            return f"{bits}-bit packed (Q{bits}_K's layout)"
        planes = " (two planes)" if self.num_planes == 2 else ""
        return f"int4 packed, group {self.group_size}{planes}"

    def planes(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The op's operands: the stacks of packed codes and of scale tables (int4 planes), or
        the kernel's buffers and no tables."""
        if self.form in KERNEL_LAYOUTS:
            return [getattr(self, name) for name in self.buffer_names], []
        n = range(self.num_planes)
        return [getattr(self, f"packed{i}") for i in n], [
            getattr(self, f"scales_zeros{i}") for i in n
        ]

    def dequantize(self, expert: int) -> torch.Tensor:
        """float32 [N, K] of one expert, as the kernel sees it (bf16 scales for int4 planes)."""
        weights, tables = self.planes()
        stacks = [tuple(weights)] if not tables else list(zip(weights, tables))
        return _dequantize_expert(stacks, expert, self.form, self.out_features)


def _dequantize_expert(
    stacks: list[tuple[torch.Tensor, ...]], expert: int, form: int, rows: int
) -> torch.Tensor:
    """float32 [rows, K] of one expert of `stacks` (PackedExperts' tensors, per plane)."""
    if form in KERNEL_LAYOUTS:
        kernel_form = KERNEL_LAYOUTS[form]
        w = kernel_form.layout(*(t[expert] for t in stacks[0]))
        kernel = kernel_form.kernel()  # exact either way; the kernel's is the faster
        if kernel is None:
            return kernel_form.dequantize(w)[:rows]
        return kernel.dequantize_t(w, torch.float32).t()[:rows]
    if stacks[0][0].device.type != "cpu":
        return functools.reduce(torch.add, (
            nibble_dequantize(p[expert], sz[expert], form) for p, sz in stacks
        ))  # fmt: skip
    w = functools.reduce(torch.add, (
        cpu_dequantize_t(p[expert], sz[expert], form, torch.float32) for p, sz in stacks
    ))  # fmt: skip
    return w.t()[:rows]


def _one_form(parts: list[QuantizedTensor]) -> list[QuantizedTensor]:
    """Parts of one expert in one form where they can share one: a Q4_K part read for the
    K-quant kernel beside another type's int4 plane becomes an int4 plane too."""
    if len({quantized_form(p) for p in parts}) == 1:
        return parts
    return [as_int4_plane(p) for p in parts]


class ExpertPacker:
    """Collects one projection's quantized parts (`part_names`, stacked by rows in that order)
    expert by expert, packing each complete expert into its slot of the stacks; `stack()` gives
    the PackedExperts once every expert is in. Where the experts cannot be packed (`reason`,
    checked as each expert completes), the owner takes back what it holds, dequantized, through
    `dense_experts()` and the pending `parts`."""

    def __init__(self, num_experts: int, part_names: tuple[str, ...], device: torch.device):
        self.num_experts, self.part_names, self.device = num_experts, part_names, device
        self.parts: dict[int, dict[str, QuantizedTensor]] = {}  # experts not yet packed
        self.stacks: list[tuple[torch.Tensor, ...]] = []  # per plane, made once
        self.filled: set[int] = set()
        # (kind, quantized form, op form, shape) every expert must share, from the first one
        self.format: tuple[str, tuple, int, tuple[int, int]] | None = None
        self.reason: str | None = None
        if device.type not in ("cpu", "cuda"):
            self.reason = f"device {device.type} (kiln's packed experts run on the CPU and CUDA)"

    def add(self, expert: int, part: str, t: QuantizedTensor) -> None:
        """Take one part; an expert whose parts are all in is packed, or sets `reason` (its
        parts then stay in `parts` for the owner's fallback)."""
        parts = self.parts.setdefault(expert, {})
        parts[part] = for_device(t, self.device)
        if len(parts) < len(self.part_names):
            return
        ordered = _one_form([parts[name] for name in self.part_names])
        if len({quantized_form(p) for p in ordered}) > 1:
            names = " and ".join(self.part_names)
            self.reason = f"its {names} parts are in different quantized formats"
            return
        whole = cat_rows(ordered)
        self.reason = self._reason(whole)
        if self.reason is not None:
            return
        del self.parts[expert]
        form = self.format[2]  # type: ignore[index]
        for i, plane in enumerate(whole.planes):
            tensors = _pack(plane, form, self.device)
            if len(self.stacks) == i:  # written in place: the load never copies a stack
                self.stacks.append(tuple(x.new_empty(self.num_experts, *x.shape) for x in tensors))
            if form not in KERNEL_LAYOUTS:
                tensors = (tensors[0], self._table_for_stack(i, tensors[1]))
            for stack, x in zip(self.stacks[i], tensors, strict=True):
                stack[expert].copy_(x)
        self.filled.add(expert)

    def _table_for_stack(self, i: int, table: torch.Tensor) -> torch.Tensor:
        """`table` as wide as stack i's: a stack of scales alone (every expert so far without
        zeros) is widened to pairs, once, when an expert with zeros arrives (copy_ would
        broadcast a scale into the zeros' place)."""
        stack = self.stacks[i][1]
        if stack.shape[-1] == table.shape[-1]:
            return table
        if stack.shape[-1] == 1:
            self.stacks[i] = (self.stacks[i][0], pairs_table(stack))
            return table
        return pairs_table(table)

    def _reason(self, whole: QuantizedTensor) -> str | None:
        """Why an expert whose parts make `whole` cannot join the stacks, or None."""
        form = (whole.kind, quantized_form(whole), form_of(whole), whole.shape)
        if self.format is None:
            self.format = form  # type: ignore[assignment]
            return unpackable_reason(whole, self.device)
        same = form[1:] == self.format[1:]
        return None if same else "its experts arrived in different quantized formats"

    @property
    def complete(self) -> bool:
        return self.reason is None and len(self.filled) == self.num_experts

    def stack(self) -> PackedExperts:
        kind, _, form, shape = self.format  # type: ignore[misc]
        return PackedExperts(self.stacks, kind, form, shape)

    def dense_experts(self) -> dict[int, torch.Tensor]:
        """Every expert packed so far, dequantized (float32 [rows, K]; int4 planes with the
        bf16 scales they were packed with), and forgotten."""
        if self.format is None:
            return {}
        _, _, form, (rows, _) = self.format
        out = {e: _dequantize_expert(self.stacks, e, form, rows) for e in self.filled}
        self.stacks, self.filled = [], set()
        return out
