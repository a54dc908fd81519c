"""Experts kept 4-bit packed: each projection (gate_up, down) of a mixture-of-experts layer as
one stack of packed planes over the expert dimension, the layout of kiln/layers/packed.py per
expert. Qwen3-30B-A3B's experts in Q4_K keep about 18 GB of planes (codes and bf16 scales)
where, dequantized, they would take 58 GB in bf16.

Checkpoints store experts one at a time (GGUF's stacked tensors are read one expert at a time
too), so `ExpertPacker` packs each expert as soon as its parts (gate and up, or down) have
arrived, into its slot of the stack. A GGUF file stores a layer's gate stack before its up
stack, so the load holds one layer's gate codes until the up parts arrive, never more. The
stack's first dimension is the expert, so expert parallelism (not built yet) will slice it as
it will slice the dense stack.

The product is `kiln::moe_experts_int4`: the rows sorted by expert as the dense op sorts them.
On the CPU, one int4 matmul per active expert (PyTorch's CPU kernel through `int4_mm`'s
row-count policy). On CUDA, one launch per projection for all experts, kiln's Triton grouped
kernel (kiln/layers/moe_triton.py) reading the planes in a layout of its own (`nibble_plane`:
two codes a byte, bf16 scales and zeros per group), with the group ends on the device, so a
CUDA graph captures it. A projection that could not be packed passes its dense stack
instead."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from kiln.layers.cpu_int4_layout import cpu_dequantize_t, pairs_table
from kiln.layers.expert_routing import combine, experts_loop, sorted_by_expert
from kiln.layers.packed import (
    Int4Codes,
    QuantizedTensor,
    as_int4_plane,
    cat_rows,
    int4_matmul,
    pack_plane,
    quantized_form,
)
from kiln.layers.packed import unpackable_reason as matrix_unpackable_reason


def unpackable_reason(t: QuantizedTensor, device: torch.device) -> str | None:
    """Why an expert's quantized projection is not kept packed on `device`, or None."""
    if not isinstance(t.planes[0], Int4Codes):
        kernels = "kiln's Q6_K and K-quant kernels run whole matrices"
        return f"{t.kind} experts have no packed kernel ({kernels})"
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


def _pack(plane: Int4Codes, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return pack_plane(plane, device) if device.type == "cpu" else nibble_plane(plane, device)


class PackedExperts(nn.Module):
    """One projection of every expert: buffers `packed{i}` [experts, ...] and
    `scales_zeros{i}` [experts, K/G, N (padded on the CPU), 2] per plane i (two for Q8_0), in
    the CPU kernel's layout or, on CUDA, `nibble_plane`'s; on the CPU [..., 1], the scales
    alone, where every expert's zeros are 0."""

    def __init__(self, stacks: list[tuple[torch.Tensor, torch.Tensor]], kind: str,
                 group_size: int, shape: tuple[int, int]) -> None:  # fmt: skip
        """`stacks[i]`: plane i's (packed, scales and zeros) of every expert."""
        super().__init__()
        self.kind, self.group_size = kind, group_size
        self.out_features, self.in_features = shape
        self.num_planes = len(stacks)
        self.int8_planes = 0  # rows into kiln's CPU kernel as int8 planes (--packed-activations)
        for i, (packed, scales_zeros) in enumerate(stacks):
            self.register_buffer(f"packed{i}", packed)
            self.register_buffer(f"scales_zeros{i}", scales_zeros)

    def planes(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        n = range(self.num_planes)
        return [getattr(self, f"packed{i}") for i in n], [
            getattr(self, f"scales_zeros{i}") for i in n
        ]

    def dequantize(self, expert: int) -> torch.Tensor:
        """float32 [N, K] of one expert, as the kernel sees it (bf16 scales)."""
        stacks = list(zip(*self.planes()))
        return _dequantize_expert(stacks, expert, self.group_size, self.out_features)


def _dequantize_expert(stacks, expert: int, group_size: int, rows: int) -> torch.Tensor:
    if stacks[0][0].device.type != "cpu":
        return functools.reduce(torch.add, (
            nibble_dequantize(p[expert], sz[expert], group_size) for p, sz in stacks
        ))  # fmt: skip
    w = functools.reduce(torch.add, (
        cpu_dequantize_t(p[expert], sz[expert], group_size, torch.float32) for p, sz in stacks
    ))  # fmt: skip
    return w.t()[:rows]


class ExpertPacker:
    """Collects one projection's quantized parts (`part_names`, stacked by rows in that order)
    expert by expert, packing each complete expert into its slot of the stacks; `stack()` gives
    the PackedExperts once every expert is in. Where the experts cannot be packed (`reason`,
    checked as each expert completes), the owner takes back what it holds, dequantized, through
    `dense_experts()` and the pending `parts`."""

    def __init__(self, num_experts: int, part_names: tuple[str, ...], device: torch.device):
        self.num_experts, self.part_names, self.device = num_experts, part_names, device
        self.parts: dict[int, dict[str, QuantizedTensor]] = {}  # experts not yet packed
        self.stacks: list[tuple[torch.Tensor, torch.Tensor]] = []  # per plane, made once
        self.filled: set[int] = set()
        # (kind, planes, group size, shape) every expert must share, from the first one
        self.format: tuple[str, int, int, tuple[int, int]] | None = None
        self.reason: str | None = None
        if device.type not in ("cpu", "cuda"):
            self.reason = f"device {device.type} (kiln's packed experts run on the CPU and CUDA)"

    def add(self, expert: int, part: str, t: QuantizedTensor) -> None:
        """Take one part; an expert whose parts are all in is packed, or sets `reason` (its
        parts then stay in `parts` for the owner's fallback)."""
        parts = self.parts.setdefault(expert, {})
        parts[part] = as_int4_plane(t)
        if len(parts) < len(self.part_names):
            return
        ordered = [parts[name] for name in self.part_names]
        self.reason = self._reason(ordered)
        if self.reason is not None:
            return
        del self.parts[expert]
        for i, plane in enumerate(cat_rows(ordered).planes):
            packed, scales_zeros = _pack(plane, self.device)
            if len(self.stacks) == i:  # written in place: the load never copies a stack
                self.stacks.append(tuple(  # type: ignore[arg-type]
                    x.new_empty(self.num_experts, *x.shape) for x in (packed, scales_zeros)
                ))  # fmt: skip
            scales_zeros = self._table_for_stack(i, scales_zeros)
            self.stacks[i][0][expert].copy_(packed)
            self.stacks[i][1][expert].copy_(scales_zeros)
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

    def _reason(self, parts: list[QuantizedTensor]) -> str | None:
        if len({quantized_form(p) for p in parts}) > 1:
            return f"its {' and '.join(self.part_names)} parts are in different quantized formats"
        rows = sum(p.shape[0] for p in parts)
        first = parts[0]
        form = (first.kind, len(first.planes), first.group_size, (rows, first.shape[1]))
        if self.format is None:
            self.format = form  # type: ignore[assignment]
            return unpackable_reason(cat_rows(parts), self.device)
        same = form[1:] == self.format[1:]
        return None if same else "its experts arrived in different quantized formats"

    @property
    def complete(self) -> bool:
        return self.reason is None and len(self.filled) == self.num_experts

    def stack(self) -> PackedExperts:
        kind, _, group_size, shape = self.format  # type: ignore[misc]
        return PackedExperts(self.stacks, kind, group_size, shape)

    def dense_experts(self) -> dict[int, torch.Tensor]:
        """Every expert packed so far, dequantized (float32 [rows, K], with the bf16 scales it
        was packed with), and forgotten."""
        if self.format is None:
            return {}
        _, _, group_size, (rows, _) = self.format
        out = {e: _dequantize_expert(self.stacks, e, group_size, rows) for e in self.filled}
        self.stacks, self.filled = [], set()
        return out


def _expert_product(
    rows: torch.Tensor, weight: list[torch.Tensor], scales_zeros: list[torch.Tensor],
    group_size: int, expert: int, out_features: int, int8_planes: int,
) -> torch.Tensor:  # fmt: skip
    """rows times expert `expert`'s projection: a dense stack (`scales_zeros` empty) or the
    packed planes, summed."""
    if not scales_zeros:
        return F.linear(rows, weight[0][expert])
    second = (weight[1][expert], scales_zeros[1][expert]) if len(weight) == 2 else (None, None)
    y = int4_matmul(rows, weight[0][expert], scales_zeros[0][expert], group_size, *second,
                    int8_planes)  # fmt: skip
    return y[:, :out_features].to(rows.dtype)


def _moe_experts_int4(
    x: torch.Tensor, gate_up: list[torch.Tensor], gate_up_sz: list[torch.Tensor],
    down: list[torch.Tensor], down_sz: list[torch.Tensor], group_sizes: list[int],
    intermediate: int, ids: torch.Tensor, weights: torch.Tensor, int8_planes: int = 0,
) -> torch.Tensor:  # fmt: skip
    if x.device.type != "cpu":
        return _experts_on_triton(x, (gate_up, gate_up_sz), (down, down_sz), group_sizes, ids,
                                  weights)  # fmt: skip

    def project(rows: torch.Tensor, expert: int) -> torch.Tensor:
        hidden = _expert_product(rows, gate_up, gate_up_sz, group_sizes[0], expert,
                                 2 * intermediate, int8_planes)  # fmt: skip
        gate, up = hidden.chunk(2, dim=-1)
        return _expert_product(F.silu(gate) * up, down, down_sz, group_sizes[1], expert,
                               x.shape[-1], int8_planes)  # fmt: skip

    return experts_loop(x, ids, weights, gate_up[0].shape[0], project)


def _experts_on_triton(x, gate_up, down, group_sizes, ids, weights) -> torch.Tensor:
    """The CUDA path: every stack in one grouped launch; (planes, scales) pairs whose scales
    list is empty are a dense stack."""
    from kiln.layers.moe_triton import experts_triton  # triton: a CUDA dependency

    def stack(planes: list[torch.Tensor], scales_zeros: list[torch.Tensor]):
        return list(zip(planes, scales_zeros, strict=True)) if scales_zeros else planes[0]

    tokens, order, counts = sorted_by_expert(ids, gate_up[0][0].shape[0])
    out = experts_triton(x[tokens], stack(*gate_up), stack(*down), counts, tuple(group_sizes))
    return combine(x, out, tokens, order, weights)


_LIB = torch.library.Library("kiln", "FRAGMENT")
_LIB.define(
    "moe_experts_int4(Tensor x, Tensor[] gate_up, Tensor[] gate_up_sz, Tensor[] down, "
    "Tensor[] down_sz, int[] group_sizes, int intermediate, Tensor ids, Tensor weights, "
    "int int8_planes=0) -> Tensor"
)
_LIB.impl("moe_experts_int4", _moe_experts_int4, "CompositeExplicitAutograd")


def _moe_experts_int4_fake(
    x, gate_up, gate_up_sz, down, down_sz, group_sizes, intermediate, ids, weights,
    int8_planes=0,
) -> torch.Tensor:  # fmt: skip
    return torch.empty_like(x)


torch.library.register_fake("kiln::moe_experts_int4", _moe_experts_int4_fake, lib=_LIB)
