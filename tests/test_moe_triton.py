"""kiln's Triton grouped expert product (kiln/layers/moe_triton.py, in Triton's CPU interpreter
here; compiled on a GPU, where tests/test_cuda.py captures it in graphs) against the per-expert
loop: experts with no rows, with rows that fill several tiles and end mid-tile, and the tile
table's idle tiles storing nothing."""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("triton")

from kiln.layers.moe import experts_by_loop, experts_by_triton
from kiln.layers.moe_triton import BLOCK_M, grouped_linear, tile_table

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_the_tile_table_covers_each_experts_rows_once():
    counts = torch.tensor([0, 70, 3, 0, 32, 1], dtype=torch.int32)
    expert, start, end = tile_table(counts, int(counts.sum()))
    covered = [(e, r) for e, s, t in zip(expert.tolist(), start.tolist(), end.tolist())
               for r in range(s, t)]  # fmt: skip
    ends = counts.cumsum(0).tolist()
    owner = [next(e for e, last in enumerate(ends) if r < last) for r in range(ends[-1])]
    assert covered == [(e, r) for r, e in enumerate(owner)]  # every row once, by its expert
    assert ((end - start) <= BLOCK_M).all() and len(expert) == -(-106 // BLOCK_M) + 6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_grouped_linear_equals_a_matmul_per_expert(dtype):
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([33, 0, 5, 64, 1], dtype=torch.int32)
    rows = torch.randn(int(counts.sum()), 40, generator=g).to(dtype)
    weight = torch.randn(5, 72, 40, generator=g).to(dtype)
    table = tile_table(counts.to(DEVICE), rows.shape[0])
    ours = grouped_linear(rows.to(DEVICE), weight.to(DEVICE), table).cpu()
    starts = [0, *counts.cumsum(0).tolist()]
    ref = torch.cat([rows[a:b].double() @ weight[e].double().T
                     for e, (a, b) in enumerate(itertools.pairwise(starts))])  # fmt: skip
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(ours.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


def test_the_experts_equal_the_loop():
    """The whole routed product (sorted, both projections, SwiGLU, combined by the router's
    weights), float32 in full precision."""
    g = torch.Generator().manual_seed(1)
    tokens, hidden, inter, experts, top_k = 19, 48, 40, 6, 2
    x = torch.randn(tokens, hidden, generator=g)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    ids = torch.randint(0, experts - 1, (tokens, top_k), generator=g)  # the last expert idle
    weights = torch.rand(tokens, top_k, generator=g)
    ref = experts_by_loop(x, gate_up, down, ids, weights)
    args = [t.to(DEVICE) for t in (x, gate_up, down, ids, weights)]
    torch.testing.assert_close(experts_by_triton(*args).cpu(), ref, rtol=1e-5, atol=1e-5)
