"""The experts' grouped product in Triton, for CUDA steps whose dtype `torch._grouped_mm` has no
capturable kernel for: its float32 and float16 path (and every dtype before Hopper) brings the
group ends to the host, which a CUDA graph cannot capture, so a float32 MoE model failed its
capture in every graph mode. Runs under TRITON_INTERPRET=1 on the CPU, which is how the tests
check it against the per-expert loop.

The routed rows, sorted by expert, are cut into tiles of BLOCK_M rows that never straddle two
experts. The tile table (each tile's expert and row range) is computed on the device from the
per-expert counts and sized for the worst case (ceil(rows / BLOCK_M) + experts tiles), so the
grid depends on the row count only and no value comes to the host; idle tiles have an empty
row range and store nothing. A program multiplies one tile by BLOCK_N output columns of its
expert's weight, accumulating in float32 (float32 operands in full precision, not tf32).

Experts kept 4-bit packed on CUDA take the same tiles through `_grouped_int4_kernel`: each
plane's codes two to a byte ([experts, N, K / 2], the even column in the low nibble) and its
bf16 scales and zeros per group ([experts, K / G, N, 2], the packed linears' layout), turned
into the rows' dtype tile by tile, (code - 8) * scale + zero summed over the planes (two for
Q8_0), as the CPU's kernel and tinygemm read them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 32, 64, 32


@triton.jit
def _tile(tile_expert, tile_start, tile_end, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (tile, block of columns)'s expert, row range and its rows r and columns n."""
    tile = tl.program_id(0)
    expert = tl.load(tile_expert + tile).to(tl.int64)
    start, end = tl.load(tile_start + tile), tl.load(tile_end + tile)
    r = start + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return expert, start, end, r, n


@triton.jit
def _grouped_linear_kernel(rows_ptr, weight_ptr, out_ptr, tile_expert, tile_start, tile_end,
                           N, K, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """out[r, n] = sum_k rows[r, k] * weight[e, n, k] for the rows r of one tile of expert e."""
    expert, start, end, r, n = _tile(tile_expert, tile_start, tile_end, BLOCK_M, BLOCK_N)
    r_ok, n_ok = r < end, n < N
    w_base = weight_ptr + expert * N * K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # an idle tile runs no iteration: masking its rows alone still read expert 0's weight
    # whole, once per idle tile (most of the grid at decode, 5.4 ms for 1 token on an H200)
    k_stop = tl.where(end > start, K, 0)
    for k0 in range(0, k_stop, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        a = tl.load(rows_ptr + r[:, None] * K + k[None, :], r_ok[:, None] & k_ok[None, :], 0.0)
        w = tl.load(w_base + n[None, :] * K + k[:, None], n_ok[None, :] & k_ok[:, None], 0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    out = out_ptr + r[:, None] * N + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), r_ok[:, None] & n_ok[None, :])


@triton.jit
def _plane_tile(codes_ptr, sz_ptr, expert, n, k, mask, N, K, GROUP):
    """[BLOCK_K, BLOCK_N] float32: one plane of expert e's weight at columns k, rows n,
    transposed."""
    pairs = codes_ptr + expert * N * (K // 2) + n[None, :] * (K // 2) + (k // 2)[:, None]
    code = (tl.load(pairs, mask=mask, other=0).to(tl.int32) >> ((k % 2) * 4)[:, None]) & 15
    at = sz_ptr + ((expert * (K // GROUP) + (k // GROUP)[:, None]) * N + n[None, :]) * 2
    scale = tl.load(at, mask=mask, other=0.0).to(tl.float32)
    zero = tl.load(at + 1, mask=mask, other=0.0).to(tl.float32)
    return (code.to(tl.float32) - 8.0) * scale + zero


@triton.jit
def _grouped_int4_kernel(rows_ptr, codes_ptr, sz_ptr, codes2_ptr, sz2_ptr, out_ptr, tile_expert,
                         tile_start, tile_end, N, K, GROUP, PLANES: tl.constexpr,
                         PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):  # fmt: skip
    """_grouped_linear_kernel over PLANES packed int4 planes (codes2/sz2: the second's)."""
    expert, start, end, r, n = _tile(tile_expert, tile_start, tile_end, BLOCK_M, BLOCK_N)
    r_ok, n_ok = r < end, n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_stop = tl.where(end > start, K, 0)  # idle tiles read nothing
    for k0 in range(0, k_stop, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        a = tl.load(rows_ptr + r[:, None] * K + k[None, :], r_ok[:, None] & k_ok[None, :], 0.0)
        mask = k_ok[:, None] & n_ok[None, :]
        w = _plane_tile(codes_ptr, sz_ptr, expert, n, k, mask, N, K, GROUP)
        if PLANES == 2:
            w += _plane_tile(codes2_ptr, sz2_ptr, expert, n, k, mask, N, K, GROUP)
        acc = tl.dot(a, w.to(a.dtype), acc, input_precision=PRECISION)
    out = out_ptr + r[:, None] * N + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), r_ok[:, None] & n_ok[None, :])


def tile_table(counts: torch.Tensor, rows: int, block_m: int = BLOCK_M):
    """(expert, first row, end row) of each tile, int32 on the counts' device; idle tiles past
    the last expert's have expert 0 and an empty range."""
    num_experts = counts.shape[0]
    tiles = (counts.long() + block_m - 1) // block_m
    tile_ends, row_ends = tiles.cumsum(0), counts.long().cumsum(0)
    t = torch.arange(-(-rows // block_m) + num_experts, device=counts.device)
    expert = torch.searchsorted(tile_ends, t, right=True)
    valid = expert < num_experts
    e = expert.clamp(max=num_experts - 1)
    start = row_ends[e] - counts[e] + (t - (tile_ends[e] - tiles[e])) * block_m
    end = torch.minimum(row_ends[e], start + block_m)
    zero = torch.zeros_like(start)
    return (
        torch.where(valid, e, zero).to(torch.int32),
        torch.where(valid, start, zero).to(torch.int32),
        torch.where(valid, end, zero).to(torch.int32),
    )


def grouped_linear(rows: torch.Tensor, weight: torch.Tensor, table) -> torch.Tensor:
    """rows [R, K] sorted by expert, weight [E, N, K] -> [R, N]: each row times its expert's
    weight transposed (F.linear per expert), in one launch."""
    rows, weight = rows.contiguous(), weight.contiguous()
    n, k = weight.shape[1], weight.shape[2]
    out = torch.empty(rows.shape[0], n, dtype=rows.dtype, device=rows.device)
    precision = "ieee" if rows.dtype == torch.float32 else "tf32"
    grid = (table[0].shape[0], triton.cdiv(n, BLOCK_N))
    _grouped_linear_kernel[grid](rows, weight, out, *table, n, k, precision,
                                 BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
    return out


def grouped_int4_linear(rows: torch.Tensor, planes: list[tuple[torch.Tensor, torch.Tensor]],
                        group_size: int, table) -> torch.Tensor:  # fmt: skip
    """grouped_linear with the weight as one or two packed planes (codes [E, N, K / 2], scales
    and zeros [E, K / G, N, 2])."""
    rows = rows.contiguous()
    n, k = planes[0][0].shape[1], rows.shape[1]
    out = torch.empty(rows.shape[0], n, dtype=rows.dtype, device=rows.device)
    precision = "ieee" if rows.dtype == torch.float32 else "tf32"
    (codes, sz), (codes2, sz2) = planes[0], planes[-1]  # one plane: its own, unread
    grid = (table[0].shape[0], triton.cdiv(n, BLOCK_N))
    _grouped_int4_kernel[grid](rows, codes, sz, codes2, sz2, out, *table, n, k, group_size,
                               len(planes), precision, BLOCK_M, BLOCK_N, BLOCK_K)  # fmt: skip
    return out


def experts_triton(routed: torch.Tensor, gate_up, down, counts: torch.Tensor,
                   group_sizes: tuple[int, int] = (0, 0)) -> torch.Tensor:  # fmt: skip
    """SwiGLU experts over routed rows sorted by expert ([R, hidden] -> [R, hidden]). A stack
    is a dense [E, N, K] tensor, or (with its group size) a list of packed planes."""
    table = tile_table(counts, routed.shape[0])

    def project(rows: torch.Tensor, stack, group_size: int) -> torch.Tensor:
        if isinstance(stack, torch.Tensor):
            return grouped_linear(rows, stack, table)
        return grouped_int4_linear(rows, stack, group_size, table)

    gate, up = project(routed, gate_up, group_sizes[0]).chunk(2, dim=-1)
    return project(F.silu(gate) * up, down, group_sizes[1])
