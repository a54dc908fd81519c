"""kiln's CPU bf16 matmul (kiln/layers/bf16_kernel.py): the kernel against float64 by hand in
every build this CPU runs, its packing, the linear layer and tied head that use it, and the
`--cpu-linears` choice in a running engine."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from kiln import native
from kiln.layers import bf16_kernel
from kiln.layers.bf16_kernel import pack_pairs, unpack_pairs
from kiln.layers.linear import Linear, onednn_runs

HAS_BF16 = "avx512_bf16" in native.cpu_flags().split()
HAS_AMX = "amx_bf16" in native.cpu_flags().split()
# what a bf16 linear gets where the kernel does not run (oneDNN, or BLAS without native bf16)
FALLBACK = "onednn" if onednn_runs(torch.bfloat16) else "transposed"


# AVX512-BF16 without AMX: the vector path for every batch, as on CPUs without tiles (AMD Zen 4)
VECTOR_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma")


def _build(build: str):
    """The kernel as `build` names it: the engine's (native), the AVX512-BF16 vector path
    alone (vector), or the portable loops."""
    if build == "vector":
        if not HAS_BF16:
            pytest.skip("this CPU has no AVX512-BF16")
        generic = tuple(f for f in native.FLAGS if f != "-march=native")
        kernel = bf16_kernel.load_bf16_matmul((*generic, *VECTOR_FLAGS))
        assert kernel.vectorized and not kernel.amx
        return kernel
    if build == "native":
        kernel = bf16_kernel.bf16_matmul_kernel()
        if not HAS_BF16:
            assert kernel is None  # oneDNN keeps the linears on CPUs without AVX512-BF16
            pytest.skip("this CPU has no AVX512-BF16")
        assert kernel is not None and kernel.vectorized
        assert kernel.amx <= HAS_AMX  # tiles only where the CPU has them (and Linux grants them)
        return kernel
    generic = tuple(f for f in native.FLAGS if f != "-march=native")
    kernel = bf16_kernel.load_bf16_matmul(generic)
    assert not kernel.vectorized
    return kernel


def _each_thread_count(product):
    """product() run with 1 and 3 threads (more than this CPU's 2: items left without a
    thread's share), torch's thread count restored after each."""
    before = torch.get_num_threads()
    for threads in (1, 3):
        torch.set_num_threads(threads)
        try:
            yield product()
        finally:
            torch.set_num_threads(before)


def _by_hand(x, w, bias):
    want = x.double() @ w.double().t() + (0 if bias is None else bias.double())
    # float32 sums of exact products, then one bf16 rounding of the result
    scale = x.double().abs() @ w.double().abs().t()
    return want, want.abs() * 2.0**-8 + scale * 1e-6


@pytest.mark.parametrize("build", ["native", "vector", "portable"])
def test_the_kernel_matches_a_product_by_hand(build):
    """Rows 1 to 33 (tiles of 8 and their remainders; on AMX, one or two blocks of 16 rows and
    short ones) and 64 to 130 (the vector path's wide tiles of 4 rows by 6 vectors, and theirs),
    columns that fill 3 vectors and ragged ones (1, 37, 200: the last vector masked, 200 two
    wide tiles and one vector), k from one pair to 578 (multiples of 32 on AMX tiles, the rest
    on vectors), with and without a bias, 1 and 3 threads."""
    kernel = _build(build)
    g = torch.Generator().manual_seed(0)
    for n, k in [(48, 64), (1, 2), (37, 578), (200, 96), (16, 130), (33, 576)]:
        w = torch.randn(n, k, generator=g).to(torch.bfloat16)
        packed = pack_pairs(w)
        for rows in (1, 2, 5, 8, 9, 16, 17, 32, 33, 64, 67, 130):
            for bias in (None, torch.randn(n, generator=g).to(torch.bfloat16)):
                x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
                want, tolerance = _by_hand(x, w, bias)
                for got in _each_thread_count(partial(kernel.matmul, x, packed, n, bias)):
                    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
                    err = (got.double() - want).abs()
                    assert (err <= tolerance).all(), (n, k, rows, err.max().item())


def _silu_mul_by_hand(x, w, n):
    """silu(x W_gate) * (x W_up) in float64, and a tolerance: one bf16 rounding of the result
    plus the float32 sums' error carried through silu (|silu'| < 1.1) and the product."""
    full = x.double() @ w.double().t()
    scale = x.double().abs() @ w.double().abs().t()
    gate, up = full[:, :n], full[:, n:]
    want = torch.nn.functional.silu(gate) * up
    carried = 1.1 * up.abs() * scale[:, :n] + (gate.abs() + 1) * scale[:, n:]
    return want, want.abs() * 2.0**-8 + carried * 1e-6 + 1e-30


@pytest.mark.parametrize("build", ["native", "vector", "portable"])
def test_the_gated_kernel_matches_silu_of_the_gate_times_up_by_hand(build):
    """SwiGLU's activation fused into the gate/up product: rows 1 to 33 (the vector path's
    tiles of 8, one and two blocks of 16 on AMX tiles), 1 to 6 output vectors, k from 32 to
    576, gates large enough (x 4) that silu meets both its tails, 1 and 3 threads."""
    kernel = _build(build)
    g = torch.Generator().manual_seed(2)
    for n, k in [(16, 64), (48, 576), (96, 32), (32, 130)]:
        w = torch.randn(2 * n, k, generator=g) * torch.tensor([4.0] * n + [1.0] * n)[:, None]
        w = w.to(torch.bfloat16)
        packed = pack_pairs(w)
        for rows in (1, 2, 7, 8, 9, 16, 17, 33):
            x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
            want, tolerance = _silu_mul_by_hand(x, w, n)
            for got in _each_thread_count(partial(kernel.silu_mul, x, packed, n)):
                assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
                err = (got.double() - want).abs()
                assert (err <= tolerance).all(), (n, k, rows, err.max().item())


def test_a_gated_product_that_does_not_fit_is_refused():
    """The gate and up halves must fill the packed vectors exactly, n a multiple of 16."""
    kernel = _build("portable")
    x = torch.randn(3, 8).bfloat16()
    assert kernel.silu_mul(x, pack_pairs(torch.randn(32, 8).bfloat16()), 16).shape == (3, 16)
    for w, n in [(torch.randn(40, 8), 20), (torch.randn(64, 8), 16), (torch.randn(32, 6), 16)]:
        with pytest.raises(ValueError, match="do not fit"):
            kernel.silu_mul(x, pack_pairs(w.bfloat16()), n)


def test_a_bf16_swiglu_takes_the_fused_activation_where_its_linears_run_on_the_kernel():
    """A bf16 SwiGLU whose gate/up layer took kiln's kernel fuses the activation into it; on
    oneDNN (or with an intermediate size that is not whole vectors) it is a separate op; both
    give silu(x W_gate) * (x W_up) W_down within bf16's roundings."""
    from kiln.layers.mlp import SwiGLU

    g = torch.Generator().manual_seed(3)
    for intermediate in (48, 40):
        mlp = SwiGLU(64, intermediate).to(torch.bfloat16)
        gate_up = torch.randn(2 * intermediate, 64, generator=g).bfloat16()
        down = torch.randn(64, intermediate, generator=g).bfloat16() * 0.1
        mlp.gate_up_proj.load_weight("gate_up", gate_up)
        mlp.down_proj.load_weight("down", down)
        mlp.gate_up_proj.finalize(torch.device("cpu"))
        mlp.down_proj.finalize(torch.device("cpu"))
        kernel_runs = bf16_kernel.kernel_runs_here()
        assert mlp.fused() == (kernel_runs and intermediate % 16 == 0)
        x = torch.randn(5, 64, generator=g).bfloat16()
        hidden, _ = _silu_mul_by_hand(x, gate_up, intermediate)
        want = hidden @ down.double().t()
        tolerance = 0.02 * want.abs().max().item()
        for layout in ("fused or not", "onednn"):
            if layout == "onednn":
                mlp.gate_up_proj.use_onednn()
                assert not mlp.fused()
            got = mlp(x)
            assert got.dtype == torch.bfloat16 and got.shape == (5, 64)
            assert (got.double() - want).abs().max().item() <= tolerance, layout


def test_packing_is_pairs_of_columns_and_comes_back():
    """Column c of vector v holds (w[16v + c, 2q], w[16v + c, 2q + 1]) at pair q; the padding
    is zeros; unpacking gives the weight back exactly."""
    w = torch.arange(37 * 6, dtype=torch.float32).view(37, 6).to(torch.bfloat16)
    packed = pack_pairs(w)
    assert packed.shape == (3, 3, 16, 2)
    assert packed[1, 2, 5].tolist() == [w[21, 4].item(), w[21, 5].item()]
    assert (packed[2, :, 5:] == 0).all()  # columns 37..47
    assert torch.equal(unpack_pairs(packed, 37), w)


def test_a_kernel_that_misreads_the_layout_is_not_taken():
    """The engine's kernel is checked at first use against float64 by hand; one that misreads
    the packing (here: the pairs' two halves swapped) errs by the values' own size."""
    kernel = _build("native")
    assert bf16_kernel.self_check_error(kernel) < bf16_kernel.SELF_CHECK_TOLERANCE

    class SwappedPairs:
        def matmul(self, x, packed, n, bias=None):
            return kernel.matmul(x, packed.flip(-1).contiguous(), n, bias)

    assert bf16_kernel.self_check_error(SwappedPairs()) > 0.1


def _linear(out_features: int, in_features: int, bias: bool) -> Linear:
    layer = Linear(in_features, out_features, bias=bias).to(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    layer.load_weight("w", torch.randn(out_features, in_features, generator=g).bfloat16())
    if bias:
        layer.load_bias("b", torch.randn(out_features, generator=g).bfloat16())
    return layer


@pytest.mark.parametrize("bias", [False, True])
def test_a_bf16_linear_runs_on_the_kernel_and_on_onednn_alike(bias):
    """A bf16 Linear finalized on the CPU takes the kernel where it runs (oneDNN, or BLAS,
    elsewhere); use_onednn lays it out as where the kernel does not run; both layouts give the
    product by hand, for 3-D inputs too."""
    layer = _linear(40, 64, bias)
    w, b = layer.weight.detach().clone(), None if layer.bias is None else layer.bias.clone()
    layer.finalize(torch.device("cpu"))
    kernel = bf16_kernel.bf16_matmul_kernel()
    kernel_runs = kernel is not None and (kernel.amx or not HAS_AMX)
    assert layer.layout == ("pairs" if kernel_runs else FALLBACK)
    x = torch.randn(2, 3, 64).bfloat16()
    want, tolerance = _by_hand(x.view(6, 64), w, b)
    for expected_layout in (layer.layout, FALLBACK):
        if expected_layout == FALLBACK:
            layer.use_onednn()
        assert layer.layout == expected_layout
        got = layer(x)
        assert got.shape == (2, 3, 40) and got.dtype == torch.bfloat16
        assert ((got.view(6, 40).double() - want).abs() <= 2 * tolerance).all()


def test_sizes_that_do_not_fit_are_refused_before_the_kernel_reads_them():
    """The C++ side trusts its sizes: a mismatch is a ValueError in Python, not a wild read."""
    kernel = _build("portable")
    w = pack_pairs(torch.randn(20, 8).bfloat16())
    x = torch.randn(3, 8).bfloat16()
    assert kernel.matmul(x, w, 20).shape == (3, 20)
    for rows, n, bias in [
        (torch.randn(3, 10).bfloat16(), 20, None),  # k is not the weight's
        (x, 33, None),  # more columns than the packed vectors hold
        (x, 20, torch.randn(20)),  # a float32 bias
        (x, 20, torch.randn(5).bfloat16()),  # a short bias
    ]:
        with pytest.raises(ValueError, match="do not fit"):
            kernel.matmul(rows, w, n, bias)


def test_a_cpu_with_amx_takes_the_kernel_only_with_its_tiles(monkeypatch):
    """On a CPU with AMX the kernel takes the linears where it multiplies on the tiles; where
    Linux refused them, oneDNN's AMX path (faster than the vector path from a few rows) keeps
    them, and the boot log says why."""
    import dataclasses

    real = bf16_kernel.bf16_matmul_kernel()
    if real is None:
        pytest.skip("this CPU has no AVX512-BF16")
    monkeypatch.setattr(bf16_kernel, "has_amx", lambda: True)
    for amx, in_features, layout in [(True, 64, "pairs"), (False, 64, FALLBACK),
                                     (True, 48, FALLBACK)]:  # fmt: skip
        # 48: not a whole number of the tiles' 32-wide chunks of k
        kernel = dataclasses.replace(real, amx=amx)
        monkeypatch.setattr(bf16_kernel, "bf16_matmul_kernel", lambda k=kernel: k)
        layer = _linear(32, in_features, bias=False)
        layer.finalize(torch.device("cpu"))
        assert layer.layout == layout
        assert "AMX" in bf16_kernel.describe_bf16_kernel()


def test_a_float32_linear_stays_on_onednn():
    layer = Linear(64, 32).to(torch.float32)
    layer.load_weight("w", torch.randn(32, 64))
    layer.finalize(torch.device("cpu"))
    assert layer.layout == "onednn"


def test_the_engine_runs_its_bf16_linears_on_the_kernel_or_on_onednn(tiny_models):
    """A bf16 engine on a tiny model: every linear and the tied head on the kernel by default,
    none with --cpu-linears onednn, and the two engines' logits agree within bf16's rounding
    of the hidden states (the same greedy tokens)."""
    from kiln import SamplingParams
    from tests.helpers import make_engine, run_schedule

    if not bf16_kernel.kernel_runs_here():
        pytest.skip("kiln's bf16 kernel does not run on this CPU")

    results = {}
    for policy in ("auto", "onednn"):
        engine = make_engine(tiny_models["llama"], dtype="bfloat16", cpu_linears=policy)
        model = engine.runner.model
        layouts = {m.layout for m in model.modules() if isinstance(m, Linear)}
        assert layouts == ({"pairs"} if policy == "auto" else {"onednn"})
        head = model.embed_tokens if model.lm_head is None else model.lm_head
        assert getattr(head, "head_layout", getattr(head, "layout", None)) in (
            {"pairs"} if policy == "auto" else {"onednn"}
        )
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        out, logits = run_schedule(engine, [(0, [5, 9, 11, 40, 2], params)], record_logits=True)
        results[policy] = torch.stack(logits["0"]).float(), out["0"].outputs[0].token_ids
    (a, tokens_a), (b, tokens_b) = results["auto"], results["onednn"]
    assert tokens_a == tokens_b
    torch.testing.assert_close(a, b, rtol=0, atol=0.05 * b.abs().max().item())
