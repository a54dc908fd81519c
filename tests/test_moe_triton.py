"""kiln's Triton grouped expert product (kiln/layers/moe_triton.py, in Triton's CPU interpreter
here; compiled on a GPU, where tests/test_cuda.py captures it in graphs) against the per-expert
loop: experts with no rows, with rows that fill several tiles and end mid-tile, and the tile
table's idle tiles storing nothing."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

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


def _packed_stack(kind: str, experts: int, n: int, k: int, seed: int):
    """Every expert's planes of a random [n, k] matrix in `kind`, stacked in the Triton
    kernel's layout, and the float32 [experts, n, k] they stand for (bf16 scales, as packed)."""
    import numpy as np

    from kiln.layers.packed import for_device
    from kiln.layers.packed_experts import nibble_dequantize, nibble_plane
    from tests.test_packed_experts import _quantized

    rng = np.random.default_rng(seed)
    cuda = torch.device("cuda")  # the form ExpertPacker gives it there (Q4_K: int4 planes)
    per_expert = [[nibble_plane(p, DEVICE) for p in for_device(_quantized(kind, n, k, rng)[1],
                                                               cuda).planes]
                  for _ in range(experts)]  # fmt: skip
    planes = [tuple(torch.stack([e[i][j] for e in per_expert]) for j in (0, 1))
              for i in range(len(per_expert[0]))]  # fmt: skip
    dense = torch.stack([sum(nibble_dequantize(*plane, 32) for plane in e) for e in per_expert])
    return planes, dense.cpu()


# Triton's interpreter computes bf16 products wrongly (a dense bf16 grouped_linear there is off
# by 1e10); float16 stands in for the half-precision path on the CPU, bf16 runs on a GPU
HALF = [torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_K", "Q8_0"])  # Q8_0: two planes a weight
@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
def test_packed_int4_experts_equal_the_loop_on_their_dequantized_weights(kind, dtype):
    """Experts kept 4-bit on CUDA (two codes a byte, bf16 scales per group of 32) through the
    grouped int4 kernel against the per-expert loop over the same weights dequantized; the
    down stack dense in one case (a stack that could not be packed)."""
    from kiln.layers.moe_triton import experts_triton

    g = torch.Generator().manual_seed(2)
    tokens, hidden, inter, experts, top_k = 21, 256, 256, 5, 2
    gate_up, gate_up_w = _packed_stack(kind, experts, 2 * inter, hidden, 3)
    down, down_w = _packed_stack(kind, experts, hidden, inter, 4)
    x = torch.randn(tokens, hidden, generator=g) * 0.01  # float16 holds the random Q4_K's sums
    ids = torch.randint(0, experts - 1, (tokens, top_k), generator=g)  # the last expert idle
    weights = torch.rand(tokens, top_k, generator=g)
    ref = experts_by_loop(x.to(dtype).float(), gate_up_w, down_w, ids, weights)
    dense_down = experts_by_loop(x.to(dtype).float(), gate_up_w, down_w.to(dtype).float(), ids,
                                 weights)  # fmt: skip
    order = ids.reshape(-1).argsort(stable=True)
    counts = torch.bincount(ids.reshape(-1), minlength=experts).to(torch.int32)
    routed = x[order // top_k].to(dtype).to(DEVICE)
    for down_stack, groups in ((down, (32, 32)), (down_w.to(DEVICE, dtype), (32, 0))):
        out = experts_triton(routed, gate_up, down_stack, counts.to(DEVICE), groups).cpu()
        weighted = out.float() * weights.reshape(-1)[order, None]
        ours = torch.zeros_like(x).index_add_(0, order // top_k, weighted)
        # half-precision rows and weights in the products (and outputs): a few bf16 ulps of
        # the output; float32 in full precision: sums in another order
        tol = 1e-5 if dtype == torch.float32 else 16 * 2**-8
        want = ref if groups[1] else dense_down  # the dense stack in the model's dtype
        torch.testing.assert_close(ours, want, rtol=0, atol=tol * want.abs().max().item())


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_int4_experts_kernel_compiles_for_cuda(dtype, tmp_path):
    """The interpreter runs the kernel's Python semantics (and gets bf16 products wrong); this
    lowers it for real, to a Hopper cubin with Triton's bundled ptxas (no GPU needed), with
    two planes and the tensor-core (bf16) or full-precision (float32) product."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    cmd = [sys.executable, "-m", "tests.triton_cuda_compile", "int4-experts", dtype]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["_grouped_int4_kernel", "ok"]
