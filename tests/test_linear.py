"""The CPU weight layouts of `Linear`: bf16 gets kiln's own kernel where this CPU has AVX512-BF16,
each dtype oneDNN's prepacked weight where this CPU runs it natively, the transposed BLAS layout
otherwise, and every layout computes x W^T + b as well as `F.linear` in the same dtype does
(against a float64 reference)."""

import logging

import pytest
import torch
import torch.nn.functional as F

from kiln.layers.bf16_kernel import bf16_matmul_kernel, has_amx
from kiln.layers.linear import Linear, onednn_runs, slow_cpu_dtype
from tests.helpers import make_engine

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _layer(dtype: torch.dtype, bias: bool) -> Linear:
    g = torch.Generator().manual_seed(0)
    layer = Linear(96, 160, bias=bias)
    layer.load_weight("w", torch.randn(160, 96, generator=g))
    if bias:
        layer.load_bias("b", torch.randn(160, generator=g))
    return layer.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_finalize_picks_the_bf16_kernel_or_onednn_where_they_run_natively(dtype):
    layer = _layer(dtype, bias=False)
    layer.finalize(torch.device("cpu"))
    kernel = bf16_matmul_kernel()
    if dtype == torch.bfloat16 and kernel is not None and (kernel.amx or not has_amx()):
        assert layer.layout == "pairs"
        return
    assert layer.layout == ("onednn" if onednn_runs(dtype) else "transposed")
    assert layer.weight.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 96), (7, 96), (2, 3, 96)])
def test_every_layout_matches_f_linear(dtype, bias, shape):
    layer = _layer(dtype, bias)
    w = layer.weight.detach().clone()
    b = None if layer.bias is None else layer.bias.detach().clone()
    layer.finalize(torch.device("cpu"))
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    # F.linear in the same dtype is the yardstick: its rounding is what the dtype allows
    allowed = (F.linear(x, w, b).double() - ref).abs().max().item()
    got = layer(x)
    assert got.shape == (*shape[:-1], 160) and got.dtype == dtype
    assert (got.double() - ref).abs().max().item() <= 2 * allowed + 1e-5


def test_a_half_dtype_without_native_kernels_is_warned_about(tiny_models, monkeypatch, caplog):
    assert slow_cpu_dtype(torch.float32) is None
    monkeypatch.setattr("kiln.layers.linear.onednn_runs", lambda dtype: dtype == torch.float32)
    # no AVX512-BF16: linears, tied heads and dense copies all decide through linear.pairs_runs
    monkeypatch.setattr("kiln.layers.linear.pairs_runs", lambda weight: False)
    message = slow_cpu_dtype(torch.bfloat16)
    assert "AVX512-BF16" in message and "Remedy: compare with --dtype float32" in message
    with caplog.at_level(logging.WARNING, logger="kiln.boot"):
        engine = make_engine(tiny_models["llama"], dtype="bfloat16")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings.count(message) == 1
    layouts = {m.layout for m in engine.runner.model.modules() if isinstance(m, Linear)}
    assert layouts == {"transposed"}


def test_no_warning_where_oneDNN_runs_the_dtype(tiny_models, caplog):
    dtype = next((d for d in (torch.bfloat16, torch.float16) if onednn_runs(d)), None)
    if dtype is None:
        pytest.skip("this CPU has no native half-precision oneDNN kernels")
    with caplog.at_level(logging.WARNING, logger="kiln.boot"):
        make_engine(tiny_models["llama"], dtype=str(dtype).removeprefix("torch."))
    assert not [r for r in caplog.records if "oneDNN" in r.getMessage()]
