"""A decode step's packed experts routed in the kernels' C code (csrc/moe_route.h, through
kiln/layers/expert_groups.py): the sort and gather against PyTorch's stable argsort and
indexing, SwiGLU and the weighted sum against float64, and the whole step against the
per-token reference and the PyTorch-routed path it replaces."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kiln.layers.packed_experts_op as op
from kiln.layers.expert_groups import combine_rows, route_rows, silu_mul
from kiln.layers.expert_routing import sorted_by_expert
from kiln.layers.int4_kernel import int4_matmul_kernel
from kiln.layers.kquant_kernel import kquant_matmul_kernel
from kiln.layers.q6k_kernel import q6k_matmul_kernel
from tests.test_packed_experts import (
    BF16_ULP,
    E,
    _experts,
    _kernel_form,
    _kernel_runs,
    _per_token,
    _routing,
)

KERNELS = {"int4": int4_matmul_kernel, "kquant": kquant_matmul_kernel, "q6k": q6k_matmul_kernel}


@pytest.fixture(params=list(KERNELS))
def library(request):
    """Each kernel library that this CPU builds: every one exports the routing entries."""
    kernel = KERNELS[request.param]()
    if kernel is None:
        pytest.skip(f"kiln's {request.param} kernel does not run on this CPU")
    return kernel.library


def _ids(tokens: int, top_k: int, experts: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(tokens, experts, generator=g).topk(top_k, dim=-1).indices


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("tokens", "top_k", "experts"), [(1, 8, 128), (7, 2, 3), (31, 4, 9), (5, 1, 4)]
)
def test_route_sorts_as_a_stable_argsort_and_gathers_exactly(library, dtype, tokens, top_k,
                                                             experts):  # fmt: skip
    ids = _ids(tokens, top_k, experts, seed=tokens)
    x = torch.randn(tokens, 40).to(dtype)
    routed = route_rows(library, x, ids.int(), experts)  # int32 ids taken as int64
    token_of_row, order, counts = sorted_by_expert(ids, experts)
    assert torch.equal(routed.order, order)
    assert torch.equal(routed.rows, x[token_of_row].float())
    active = [e for e in range(experts) if counts[e]]
    starts = torch.cumsum(counts, 0)[active] - counts[active]
    n, *_ = routed.arrays(tokens * top_k, experts)
    assert n == routed.active == len(active)
    g = routed.groups[: 3 * n].view(3, n)
    assert g[0].tolist() == active
    assert g[1].tolist() == starts.tolist()
    assert g[2].tolist() == counts[active].tolist()
    with pytest.raises(ValueError, match="routed over"):
        routed.arrays(tokens * top_k, experts + 1)


@pytest.mark.parametrize("bad", [-1, 16])
def test_route_refuses_an_expert_id_outside_the_stack(library, bad):
    ids = _ids(3, 2, 16, seed=0)
    ids[1, 1] = bad
    with pytest.raises(ValueError, match=r"outside \[0, 16\)"):
        route_rows(library, torch.randn(3, 32), ids, 16)
    with pytest.raises(ValueError, match=r"ids \[tokens, top_k\] for x"):
        route_rows(library, torch.randn(2, 32), ids, 16)  # fewer rows of x than of ids


@pytest.mark.parametrize("width", [100, 768])  # 100: a tail past the 16-lane vectors
def test_silu_mul_matches_float64(library, width):
    h = torch.randn(5, 2 * width + 24) * 6  # the products' padded columns after gate and up
    act = silu_mul(library, h, width)
    g, u = h[:, :width].double(), h[:, width : 2 * width].double()
    # exp within ~2 float32 ulps, the reciprocal after one Newton step within 2^-28
    torch.testing.assert_close(act.double(), F.silu(g) * u, rtol=4e-6, atol=1e-30)
    with pytest.raises(ValueError, match="float32"):
        silu_mul(library, h.bfloat16(), width)


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_combine_sums_each_tokens_rows_with_their_weights(library, w_dtype, out_dtype):
    tokens, top_k, experts, width = 6, 3, 5, 64
    ids = _ids(tokens, top_k, experts, seed=2)
    routed = route_rows(library, torch.randn(tokens, 32), ids, experts)
    y = torch.randn(tokens * top_k, width + 16)  # padded columns past `width`
    weights = torch.rand(tokens, top_k).to(w_dtype)
    out = combine_rows(library, y, routed, weights, width, out_dtype)
    assert out.dtype == out_dtype and out.shape == (tokens, width)
    want = torch.zeros(tokens, width, dtype=torch.float64)
    for r, flat in enumerate(routed.order.tolist()):
        want[flat // top_k] += weights.reshape(-1)[flat].double() * y[r, :width].double()
    ulp = 2**-23 if out_dtype == torch.float32 else BF16_ULP
    torch.testing.assert_close(out.double(), want, rtol=0, atol=4 * ulp * want.abs().max().item())
    with pytest.raises(ValueError, match="routing weights"):
        combine_rows(library, y, routed, weights[:-1], width, out_dtype)


@pytest.fixture
def routed_steps(monkeypatch) -> list[int]:
    """The row counts of the steps that went through the C routing."""
    seen, real = [], op.route_rows

    def spy(library, x, ids, num_experts):
        seen.append(ids.numel())
        return real(library, x, ids, num_experts)

    monkeypatch.setattr(op, "route_rows", spy)
    return seen


@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", ("Q4_K", "Q4_K", "Q6_K")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 127, 128])  # top-2: 127 tokens route 254 rows, 128 256
def test_a_few_rows_step_is_routed_in_c_and_matches_the_pytorch_routing(
    kind, dtype, tokens, routed_steps, monkeypatch
):
    forms = {_kernel_form(k) for k in (kind if isinstance(kind, tuple) else (kind,))}
    if not all(f is None or _kernel_runs(f) for f in forms) or int4_matmul_kernel() is None:
        pytest.skip("a stack's kernel does not run on this CPU")
    experts, gate_up, down = _experts([kind] * E)
    x, ids, weights = _routing(tokens)
    y = experts(x.to(dtype), ids, weights.to(dtype))
    assert routed_steps == ([2 * tokens] if 2 * tokens < 256 else [])
    ref = _per_token(x, gate_up, down, ids, weights)
    tol = (8 if dtype == torch.float32 else 16) * BF16_ULP * ref.abs().max().item()
    torch.testing.assert_close(y.float(), ref, rtol=0, atol=tol)
    monkeypatch.setattr(op, "_few_rows_step", lambda *args: None)
    pytorch_routed = experts(x.to(dtype), ids, weights.to(dtype))
    # the same products; float32 between them here, where the PyTorch path rounds the sums, the
    # activation and each weighted row to bf16 in a bf16 model
    # (the activation's int8 planes may round a remainder the other way: 2^-15 of a chunk)
    same = (2**-12 if dtype == torch.float32 else 4 * BF16_ULP) * ref.abs().max().item()
    torch.testing.assert_close(y.float(), pytorch_routed.float(), rtol=0, atol=same)


@pytest.mark.parametrize(("kind", "dtype"), [
    ("Q4_0", torch.float16),  # fp16 rows: the C code reads float32 and bf16
    (("Q4_0", "Q4_0", None), torch.float32),  # a dense down stack (float32, as the model's)
])  # fmt: skip
def test_steps_the_c_routing_does_not_take_keep_the_pytorch_routing(kind, dtype, routed_steps):
    if int4_matmul_kernel() is None:
        pytest.skip("kiln's int4 kernel does not run on this CPU")
    experts, gate_up, down = _experts([kind] * E)
    x, ids, weights = _routing(3)
    y = experts(x.to(dtype), ids, weights.to(dtype))
    assert routed_steps == [] and y.dtype == dtype
    ref = _per_token(x, gate_up, down, ids, weights)
    torch.testing.assert_close(y.float(), ref, rtol=0, atol=16 * BF16_ULP * ref.abs().max())
