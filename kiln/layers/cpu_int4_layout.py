"""PyTorch's CPU int4 packing: how `_convert_weight_to_int4pack_for_cpu` lays out 4-bit codes,
which block of rows this machine's build uses, and the layout read back (dequantized weights,
rows of an embedding). Both CPU int4 kernels (aten's and kiln's, kiln/layers/int4_kernel.py)
read this layout, so there is one copy of each packed weight.

The table beside the codes is [K/G, N, 2] bf16 (scale, zero) per group, as aten's kernel takes
it, or [K/G, N, 1] (the scales alone) where every zero is 0: kiln's kernel reads either, and a
one-row step then streams 4.5 bits a weight instead of 5 (`scale_only_table`)."""

from __future__ import annotations

import functools

import torch

# The CPU kernel's layouts: [N / B, K, B / 2] bytes, a block's code n in the low nibble of byte
# n and code n + B / 2 in its high one; PyTorch packs B = 64 on CPUs with AVX-512, 32 with AVX2
CPU_BLOCKS = (64, 32)


def cpu_pack(codes: torch.Tensor, block_n: int) -> torch.Tensor:
    """uint8 codes [N, K] (N a multiple of `block_n`) in the CPU kernel's layout, as aten's
    `_convert_weight_to_int4pack_for_cpu` makes it ([N, K/2] bytes, blocks of `block_n` rows:
    row n's code in the low nibble, row n + block_n/2's in the high one). Written directly in
    uint8: aten's converter takes int32 codes, 4 bytes each, and is 10x slower (a load packs
    every weight, a 30B MoE's 18,000 experts)."""
    n, k = codes.shape
    pairs = codes.view(n // block_n, 2, block_n // 2, k)
    packed = torch.bitwise_or(pairs[:, 0], torch.bitwise_left_shift(pairs[:, 1], 4))
    return packed.transpose(1, 2).contiguous().view(n, k // 2)


@functools.cache
def cpu_block_n() -> int | None:
    """The block B of this machine's CPU packing (checked once on a small matrix of known
    codes), None where it is none of CPU_BLOCKS' layouts (a build without AVX2: code pairs)."""
    n, k = 128, 64
    codes = (torch.arange(n)[:, None] * 7 + torch.arange(k)[None, :] * 3) % 16
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 2)
    scales_zeros = torch.zeros(k // 32, n, 2, dtype=torch.bfloat16)
    scales_zeros[..., 0] = 1
    for block in CPU_BLOCKS:
        back = cpu_dequantize_t(packed, scales_zeros, 32, block_n=block).t().float() + 8
        if torch.equal(back, codes.float()):
            return block
    return None


def cpu_dequantize_t(
    packed: torch.Tensor,
    scales_zeros: torch.Tensor,
    group_size: int,
    dtype: torch.dtype = torch.bfloat16,
    block_n: int | None = None,
) -> torch.Tensor:
    """W^T [K, N] in `dtype` from the CPU layout of block `block_n` (default: this machine's):
    the large-batch path."""
    k, half = packed.shape[1] * 2, (block_n or cpu_block_n() or CPU_BLOCKS[0]) // 2
    blocks = packed.view(-1, k, half)
    out = torch.empty(k, blocks.shape[0], 2, half, dtype=dtype)
    out[:, :, 0].copy_(torch.bitwise_and(blocks, 15).transpose(0, 1))
    out[:, :, 1].copy_(torch.bitwise_right_shift(blocks, 4).transpose(0, 1))
    scale, zero = table_terms(scales_zeros.to(dtype))
    w = out.view(k // group_size, group_size, -1)
    w.mul_(scale.unsqueeze(1)).add_((zero - 8 * scale).unsqueeze(1))
    return out.view(k, -1)


def cpu_rows(
    packed: torch.Tensor, scales_zeros: torch.Tensor, ids: torch.Tensor, group_size: int,
    block_n: int,
) -> torch.Tensor:  # fmt: skip
    """Rows `ids` of the weight, dequantized (float32 [T, K]) from the CPU layout of block
    `block_n`."""
    k, half = packed.shape[1] * 2, block_n // 2
    blocks = packed.view(-1, k, half)
    within = ids % block_n
    raw = blocks[ids // block_n, :, within % half]  # [T, K]
    shift = (within // half * 4).to(torch.uint8).unsqueeze(1)
    codes = torch.bitwise_and(torch.bitwise_right_shift(raw, shift), 15).float()
    scale, zero = table_terms(scales_zeros[:, ids].float().repeat_interleave(group_size, 0))
    return (codes - 8) * scale.t() + zero.t()  # the terms [K, T]


def table_terms(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) [..., K/G, N] of a table of either width (the zeros of a scales-only one
    are 0)."""
    if table.shape[-1] == 2:
        return table[..., 0], table[..., 1]
    return table[..., 0], torch.zeros_like(table[..., 0])


def scale_only_table(table: torch.Tensor) -> torch.Tensor:
    """[..., 1] (the scales) where every zero of the [..., 2] `table` is 0, else `table`."""
    return table[..., :1].contiguous() if not table[..., 1].any() else table


def pairs_table(table: torch.Tensor) -> torch.Tensor:
    """The [..., 2] (scale, zero) table aten's kernels take, from a table of either width."""
    if table.shape[-1] == 2:
        return table
    return torch.cat([table, torch.zeros_like(table)], -1)
