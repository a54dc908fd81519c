"""GGUF's Q6_K kept 6 bits a weight on the CPU: the codes as they leave the loader
(`Q6KCodes`), and kiln's packed layout of them (`pack_q6k`), which kiln's Q6_K kernel
(kiln/layers/q6k_kernel.py, csrc/q6k_mm.cpp) reads, with the same layout read back in PyTorch
ops (dequantized weights, rows of an embedding).

w[n, k] = d[n, k // 256] * sc[n, k // 16] * (q[n, k] - 32), q 0..63, sc int8, d fp16 in the
file (float32 here: every product is exact in float32). The layout, blocks of 64 output rows:
low [N, K/2] bytes (q's low 4 bits in PyTorch's CPU int4 layout of block 64, `cpu_pack`), high
[N/64 * K/4, 64] bytes (q's top 2 bits, a quad of columns of a block in one 64-byte row: byte
4r + i holds row 16j + r's at column i in bits 2j, 2j + 1), sub_scales [K/16, N] int8 and
d [K/256, N] float32: 6.56 bits a weight, Q6_K's own size."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kiln.layers.cpu_int4_layout import cpu_pack

BLOCK = 64  # output rows a block of the layout
SUB, SUPER = 16, 256  # columns a sub-scale, columns a d


@dataclass
class Q6KCodes:
    """A Q6_K matrix as it leaves the loader, before packing."""

    codes: torch.Tensor  # uint8 [N, K], values 0..63
    sub_scale: torch.Tensor  # int8 [N, K // 16]
    d: torch.Tensor  # float32 [N, K // 256]

    # the finest scale's columns, as Int4Codes.group_size: what fused layers and experts
    # compare (with the plane's type) to tell formats apart
    group_size = SUB

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], exact."""
        scale = self.sub_scale.float() * self.d.repeat_interleave(SUPER // SUB, 1)
        return (self.codes.float() - 32) * scale.repeat_interleave(SUB, 1)

    def map_rows(self, rows: Callable[[torch.Tensor], torch.Tensor]) -> Q6KCodes:
        """The same rows of codes and scales (`rows` cuts, permutes or indexes dim 0)."""
        return Q6KCodes(rows(self.codes), rows(self.sub_scale), rows(self.d))

    @staticmethod
    def cat(planes: list[Q6KCodes]) -> Q6KCodes:
        """Matrices stacked by rows."""
        return Q6KCodes(
            *(torch.cat([getattr(p, f) for p in planes]) for f in ("codes", "sub_scale", "d"))
        )


@dataclass
class Q6KPacked:
    """`pack_q6k`'s tensors: N padded to a multiple of 64 with zero weights."""

    low: torch.Tensor  # uint8 [N, K / 2]
    high: torch.Tensor  # uint8 [N / 64 * K / 4, 64]
    sub_scales: torch.Tensor  # int8 [K / 16, N]
    d: torch.Tensor  # float32 [K / 256, N]


def pack_q6k(t: Q6KCodes) -> Q6KPacked:
    """`t` in kiln's CPU layout (K a multiple of 256)."""
    codes, sub_scale, d = t.codes.to(torch.uint8), t.sub_scale, t.d
    pad = -codes.shape[0] % BLOCK
    if pad:  # q 32 at scale 0: zero weights
        codes = torch.cat([codes, codes.new_full((pad, codes.shape[1]), 32)])
        sub_scale = torch.cat([sub_scale, sub_scale.new_zeros(pad, sub_scale.shape[1])])
        d = torch.cat([d, d.new_zeros(pad, d.shape[1])])
    n, k = codes.shape
    top = (codes >> 4).view(n // BLOCK, 4, 16, k // 4, 4)  # [block, j, r, quad, i]
    top = top.permute(0, 3, 2, 4, 1)  # [block, quad, r, i, j]
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8)
    high = (top << shifts).sum(-1, dtype=torch.uint8)  # the four j's bits never overlap
    return Q6KPacked(
        cpu_pack(codes & 15, BLOCK),
        high.reshape(-1, 64).contiguous(),
        sub_scale.to(torch.int8).t().contiguous(),
        d.float().t().contiguous(),
    )


def q6k_codes(p: Q6KPacked, ids: torch.Tensor) -> torch.Tensor:
    """q (uint8 [T, K]) of rows `ids` of the packed layout."""
    k = p.low.shape[1] * 2
    blocks = p.low.view(-1, k, BLOCK // 2)
    within = ids % BLOCK
    raw = blocks[ids // BLOCK, :, within % 32]  # [T, K]
    low4 = torch.bitwise_right_shift(raw, (within // 32 * 4).to(torch.uint8)[:, None]) & 15
    quads = p.high.view(-1, k // 4, 16, 4)  # [block, quad, r, i]
    bits = quads[ids // BLOCK, :, within % 16].flatten(1)  # [T, K]: quad-major, then i
    top = torch.bitwise_right_shift(bits, (within // 16 * 2).to(torch.uint8)[:, None]) & 3
    return low4 | top << 4


def q6k_rows(p: Q6KPacked, ids: torch.Tensor) -> torch.Tensor:
    """float32 [T, K] rows `ids` of the weight (an embedding lookup), exact."""
    scale = p.sub_scales[:, ids].t().float() * p.d[:, ids].t().repeat_interleave(SUPER // SUB, 1)
    return (q6k_codes(p, ids).float() - 32) * scale.repeat_interleave(SUB, 1)


def q6k_dequantize(p: Q6KPacked) -> torch.Tensor:
    """float32 [N padded, K], exact: the reference for the kernel's own dequantization."""
    return q6k_rows(p, torch.arange(p.sub_scales.shape[1]))
