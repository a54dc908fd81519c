"""Experts kept 4-bit packed: each projection (gate_up, down) of a mixture-of-experts layer as
one stack of packed planes over the expert dimension, the layout of kiln/layers/packed.py per
expert. A Qwen3-30B-A3B in Q4_K keeps about 17 GB of planes where its experts dequantized to
bf16 would take 61 GB.

Checkpoints store experts one at a time (GGUF's stacked tensors are read one expert at a time
too), so `ExpertPacker` packs each expert as soon as its parts (gate and up, or down) have
arrived and stacks the experts once all have: the load never holds more than one expert's
4-bit codes. The stack's first dimension is the expert, so expert parallelism slices it as it
slices the dense stack.

The product is `kiln::moe_experts_int4`: the rows sorted by expert as the dense op sorts them,
one int4 matmul per active expert (PyTorch's CPU kernel through `int4_mm`'s row-count policy).
A projection that could not be packed passes its dense stack instead. Packed experts run on the
CPU only: CUDA has no grouped int4 product here, so there they are dequantized at load and the
weight report says so."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from kiln.layers.packed import QuantizedTensor, cat_rows, cpu_dequantize_t, int4_matmul, pack_plane
from kiln.layers.packed import unpackable_reason as matrix_unpackable_reason


def unpackable_reason(t: QuantizedTensor, device: torch.device) -> str | None:
    """Why an expert's quantized projection is not kept packed on `device`, or None."""
    if device.type != "cpu":
        return f"device {device.type} (kiln's packed experts run on the CPU only)"
    return matrix_unpackable_reason(t, device)


class PackedExperts(nn.Module):
    """One projection of every expert: buffers `packed{i}` [experts, ...] and
    `scales_zeros{i}` [experts, K/G, N padded, 2] per plane i (two for Q8_0)."""

    def __init__(self, stacks: list[tuple[torch.Tensor, torch.Tensor]], kind: str,
                 group_size: int, shape: tuple[int, int]) -> None:  # fmt: skip
        """`stacks[i]`: plane i's (packed, scales and zeros) of every expert."""
        super().__init__()
        self.kind, self.group_size = kind, group_size
        self.out_features, self.in_features = shape
        self.num_planes = len(stacks)
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
        packed, scales_zeros = self.planes()
        w = functools.reduce(torch.add, (
            cpu_dequantize_t(p[expert], sz[expert], self.group_size, torch.float32)
            for p, sz in zip(packed, scales_zeros)
        ))  # fmt: skip
        return w.t()[: self.out_features]

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())


class ExpertPacker:
    """Collects one projection's quantized parts (`part_names`, stacked by rows in that order)
    expert by expert, packing each complete expert into its slot of the stacks; `stack()` gives
    the PackedExperts once every expert is in. Where an expert cannot be packed (`reason`), the
    experts so far are handed back dense by `dense_experts()` and the rest are dequantized as
    they arrive."""

    def __init__(self, num_experts: int, part_names: tuple[str, ...], device: torch.device):
        self.num_experts, self.part_names, self.device = num_experts, part_names, device
        self.parts: dict[int, dict[str, QuantizedTensor]] = {}  # experts not yet complete
        self.stacks: list[tuple[torch.Tensor, torch.Tensor]] = []  # per plane, made once
        self.filled: set[int] = set()
        self.first: QuantizedTensor | None = None  # the format every expert must share
        self.reason: str | None = None

    def add(self, expert: int, part: str, t: QuantizedTensor) -> torch.Tensor | None:
        """Take one part; returns the expert's dense [rows, K] once it is complete and cannot be
        packed (the caller copies it into the dense stack), else None."""
        parts = self.parts.setdefault(expert, {})
        parts[part] = t
        if len(parts) < len(self.part_names):
            return None
        done = self.parts.pop(expert)
        whole = cat_rows([done[name] for name in self.part_names])
        if self.reason is None:
            self.reason = self._reason(whole)
        if self.reason is not None:
            return whole.dequantize()
        for i, plane in enumerate(whole.planes):
            packed, scales_zeros = pack_plane(plane, self.device)
            if len(self.stacks) == i:  # written in place: the load never copies a stack
                self.stacks.append(tuple(  # type: ignore[arg-type]
                    x.new_empty(self.num_experts, *x.shape) for x in (packed, scales_zeros)
                ))  # fmt: skip
            self.stacks[i][0][expert].copy_(packed)
            self.stacks[i][1][expert].copy_(scales_zeros)
        self.filled.add(expert)
        return None

    def _reason(self, whole: QuantizedTensor) -> str | None:
        if self.first is None:
            self.first = whole
            return unpackable_reason(whole, self.device)
        same = (len(whole.planes), whole.group_size) == (len(self.first.planes),
                                                          self.first.group_size)  # fmt: skip
        return None if same else "its experts arrived in different quantized formats"

    @property
    def complete(self) -> bool:
        return self.reason is None and len(self.filled) == self.num_experts

    def stack(self) -> PackedExperts:
        t = self.first
        return PackedExperts(self.stacks, t.kind, t.group_size, t.shape)  # type: ignore[union-attr]

    def dense_experts(self) -> dict[int, torch.Tensor]:
        """Every expert packed so far, dequantized (float32 [rows, K], with the bf16 scales it
        was packed with), and forgotten."""
        out = {}
        for expert in self.filled:
            w = functools.reduce(torch.add, (
                cpu_dequantize_t(p[expert], sz[expert], self.first.group_size, torch.float32)  # type: ignore[union-attr]
                for p, sz in self.stacks
            ))  # fmt: skip
            out[expert] = w.t()[: self.first.shape[0]]  # type: ignore[union-attr]
        self.stacks, self.filled = [], set()
        return out


def _expert_product(
    rows: torch.Tensor, weight: list[torch.Tensor], scales_zeros: list[torch.Tensor],
    group_size: int, expert: int, out_features: int,
) -> torch.Tensor:  # fmt: skip
    """rows times expert `expert`'s projection: a dense stack (`scales_zeros` empty) or the
    packed planes, summed."""
    if not scales_zeros:
        return F.linear(rows, weight[0][expert])
    y = functools.reduce(torch.add, (
        int4_matmul(rows, p[expert], sz[expert], group_size)
        for p, sz in zip(weight, scales_zeros)
    ))  # fmt: skip
    return y[:, :out_features].to(rows.dtype)


def _moe_experts_int4(
    x: torch.Tensor, gate_up: list[torch.Tensor], gate_up_sz: list[torch.Tensor],
    down: list[torch.Tensor], down_sz: list[torch.Tensor], group_sizes: list[int],
    intermediate: int, ids: torch.Tensor, weights: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    from kiln.layers.moe import experts_loop

    def project(rows: torch.Tensor, expert: int) -> torch.Tensor:
        hidden = _expert_product(rows, gate_up, gate_up_sz, group_sizes[0], expert,
                                 2 * intermediate)  # fmt: skip
        gate, up = hidden.chunk(2, dim=-1)
        return _expert_product(F.silu(gate) * up, down, down_sz, group_sizes[1], expert,
                               x.shape[-1])  # fmt: skip

    return experts_loop(x, ids, weights, gate_up[0].shape[0], project)


_LIB = torch.library.Library("kiln", "FRAGMENT")
_LIB.define(
    "moe_experts_int4(Tensor x, Tensor[] gate_up, Tensor[] gate_up_sz, Tensor[] down, "
    "Tensor[] down_sz, int[] group_sizes, int intermediate, Tensor ids, Tensor weights) -> Tensor"
)
_LIB.impl("moe_experts_int4", _moe_experts_int4, "CompositeExplicitAutograd")
torch.library.register_fake(
    "kiln::moe_experts_int4",
    lambda x, gate_up, gate_up_sz, down, down_sz, group_sizes, intermediate, ids, weights: (
        torch.empty_like(x)
    ),
    lib=_LIB,
)
