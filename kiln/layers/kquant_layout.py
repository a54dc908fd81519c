"""GGUF's Q5_K (and Q4_K) kept at the file's bits on the CPU: the codes as they leave the loader
(`KQuantCodes`), and kiln's packed layout of them (`pack_kquant`), which kiln's K-quant kernel
(kiln/layers/kquant_kernel.py, csrc/kquant_mm.cpp) reads, with the same layout read back in
PyTorch ops (dequantized weights, rows of an embedding).

w[n, k] = d[n, k // 256] * sc[n, k // 32] * q[n, k] - dmin[n, k // 256] * mn[n, k // 32], q
0..31 (Q5_K) or 0..15 (Q4_K), sc and mn 0..63, d and dmin fp16 in the file (float32 here: both
products are exact in float32). The layout, blocks of 64 output rows: low [N, K/2] bytes (q's
low 4 bits in PyTorch's CPU int4 layout of block 64, `cpu_pack`), high [N/64 * K/4, 32] bytes
(Q5_K: q's top bit, a quad of columns of a block in 32 bytes: with p = 4r + i, byte p % 32
holds row 16j + r's at column i in bit 4 (p // 32) + j), scales_mins [N/64, K/32, 2, 64] uint8
(a block's 64 scales, then its 64 mins, per 32 columns) and d_dmin [N/64, K/256, 2, 64]
float32 likewise: each a sequential stream per block. 5.75 bits a weight for Q5_K (the file's
5.5), 4.75 for Q4_K."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kiln.layers.cpu_int4_layout import cpu_pack

BLOCK = 64  # output rows a block of the layout
SUB, SUPER = 32, 256  # columns a scale and min, columns a d and dmin
FIELDS = ("codes", "scale", "min", "d", "dmin")


@dataclass
class KQuantCodes:
    """A Q5_K or Q4_K matrix as it leaves the loader, before packing."""

    codes: torch.Tensor  # uint8 [N, K], values 0 .. 2**bits - 1
    scale: torch.Tensor  # uint8 [N, K // 32], 0..63
    min: torch.Tensor  # uint8 [N, K // 32], 0..63
    d: torch.Tensor  # float32 [N, K // 256]
    dmin: torch.Tensor  # float32 [N, K // 256]
    bits: int  # 5 (Q5_K) or 4 (Q4_K)

    group_size = SUB  # the finest scale's columns, as Int4Codes.group_size

    def scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 (d sc, dmin mn) per 32 columns, [N, K // 32] each: both exact."""
        per_sub = SUPER // SUB
        return (
            self.scale.float() * self.d.repeat_interleave(per_sub, 1),
            self.min.float() * self.dmin.repeat_interleave(per_sub, 1),
        )

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: each product exact, their difference rounded once."""
        scale, minimum = self.scales()
        return torch.addcmul(
            -minimum.repeat_interleave(SUB, 1), self.codes.float(), scale.repeat_interleave(SUB, 1)
        )

    def map_rows(self, rows: Callable[[torch.Tensor], torch.Tensor]) -> KQuantCodes:
        """The same rows of codes and scales (`rows` cuts, permutes or indexes dim 0)."""
        return KQuantCodes(*(rows(getattr(self, f)) for f in FIELDS), self.bits)

    @staticmethod
    def cat(planes: list[KQuantCodes]) -> KQuantCodes:
        """Matrices of one bit width stacked by rows."""
        fields = (torch.cat([getattr(p, f) for p in planes]) for f in FIELDS)
        return KQuantCodes(*fields, planes[0].bits)


@dataclass
class KQuantPacked:
    """`pack_kquant`'s tensors: N padded to a multiple of 64 with zero weights."""

    low: torch.Tensor  # uint8 [N, K / 2]
    high: torch.Tensor  # uint8 [N / 64 * K / 4, 32]; empty for Q4_K
    scales_mins: torch.Tensor  # uint8 [N / 64, K / 32, 2, 64]
    d_dmin: torch.Tensor  # float32 [N / 64, K / 256, 2, 64]

    @property
    def bits(self) -> int:
        return 5 if self.high.numel() else 4

    @property
    def out_features(self) -> int:
        """N padded to the block."""
        return self.scales_mins.shape[0] * BLOCK

    def scales_of(self, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """float32 (d sc, dmin mn) of rows `ids`, [T, K / 32] each: both exact."""
        per_sub = SUPER // SUB
        block, within = ids // BLOCK, ids % BLOCK
        return tuple(
            self.scales_mins[block, :, i, within].float()
            * self.d_dmin[block, :, i, within].repeat_interleave(per_sub, 1)
            for i in (0, 1)
        )


def _top_bits(codes: torch.Tensor) -> torch.Tensor:
    """The high plane of padded codes [N, K] (values 0..31)."""
    n, k = codes.shape
    top = (codes >> 4).view(n // BLOCK, 4, 16, k // 4, 4)  # [block, j, r, quad, i]
    top = top.permute(0, 3, 2, 4, 1).reshape(n // BLOCK, k // 4, 64, 4)  # [.., p = 4r + i, j]
    nibble = (top << torch.arange(4, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)
    return (nibble[..., :32] | nibble[..., 32:] << 4).reshape(-1, 32).contiguous()


def _by_block(pair: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Two [N, G] tables as one [N / 64, G, 2, 64]."""
    n, g = pair[0].shape
    blocks = [t.to(dtype).view(n // BLOCK, BLOCK, g).transpose(1, 2) for t in pair]
    return torch.stack(blocks, 2).contiguous()


def pack_kquant(t: KQuantCodes) -> KQuantPacked:
    """`t` in kiln's CPU layout (K a multiple of 256)."""
    codes = t.codes.to(torch.uint8)
    pad = -codes.shape[0] % BLOCK
    rest = [t.scale, t.min, t.d, t.dmin]
    if pad:  # codes 0, scales 0, mins 0: zero weights
        codes = torch.cat([codes, codes.new_zeros(pad, codes.shape[1])])
        rest = [torch.cat([x, x.new_zeros(pad, x.shape[1])]) for x in rest]
    scale, minimum, d, dmin = rest
    high = _top_bits(codes) if t.bits == 5 else torch.empty(0, 32, dtype=torch.uint8)
    return KQuantPacked(
        cpu_pack(codes & 15, BLOCK),
        high,
        _by_block((scale, minimum), torch.uint8),
        _by_block((d, dmin), torch.float32),
    )


def kquant_codes(p: KQuantPacked, ids: torch.Tensor) -> torch.Tensor:
    """q (uint8 [T, K]) of rows `ids` of the packed layout."""
    k = p.low.shape[1] * 2
    blocks = p.low.view(-1, k, BLOCK // 2)
    within = ids % BLOCK
    raw = blocks[ids // BLOCK, :, within % 32]  # [T, K]
    low4 = torch.bitwise_right_shift(raw, (within // 32 * 4).to(torch.uint8)[:, None]) & 15
    if p.bits == 4:
        return low4
    r, j = within % 16, within // 16
    quads = p.high.view(-1, k // 4, 32)[ids // BLOCK]  # [T, quad, byte]
    pos = 4 * r[:, None] + torch.arange(4)  # [T, i]: the quad's four columns
    bits = torch.gather(quads, 2, (pos % 32)[:, None, :].expand(-1, k // 4, -1))  # [T, quad, i]
    shift = (4 * (pos // 32) + j[:, None]).to(torch.uint8)[:, None, :]
    top = torch.bitwise_right_shift(bits, shift) & 1
    return low4 | top.flatten(1) << 4


def kquant_rows(p: KQuantPacked, ids: torch.Tensor) -> torch.Tensor:
    """float32 [T, K] rows `ids` of the weight (an embedding lookup), as dequantize computes."""
    scale, minimum = p.scales_of(ids)
    codes = kquant_codes(p, ids).float()
    return torch.addcmul(-minimum.repeat_interleave(SUB, 1), codes, scale.repeat_interleave(SUB, 1))


def kquant_dequantize(p: KQuantPacked) -> torch.Tensor:
    """float32 [N padded, K]: the reference for the kernel's own dequantization."""
    return kquant_rows(p, torch.arange(p.out_features))
