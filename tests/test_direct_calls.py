"""Inductor's generated code calls kiln's ops' Python implementations directly
(kiln/compiler/direct_calls.py): the generated line names the direct call, the compiled result
equals eager, and the profiler still sees the op by its name."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch.profiler import profile

import kiln.layers.packed  # noqa: F401  (defines kiln::int4_or_dense_mm)
from kiln.compiler.direct_calls import _ops, direct_call, extern_name, register_direct_calls
from kiln.layers.cpu_int4_layout import cpu_pack


def _packed_linear_inputs():
    g = torch.Generator().manual_seed(0)
    n, k = 64, 128
    packed = cpu_pack(torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g), 64)
    scales_zeros = torch.rand(k // 32, n, 2, generator=g).to(torch.bfloat16)
    x = torch.randn(3, k, generator=g)
    return x, packed, scales_zeros, torch.empty(0)


def _linear_then_add(x, packed, scales_zeros, dense):
    y = torch.ops.kiln.int4_or_dense_mm(x * 2, packed, scales_zeros, None, None, dense, 32)
    return y + 1


def test_each_implementation_takes_its_ops_arguments_by_name():
    """The generated code passes defaulted arguments by keyword, under the schema's names."""
    for op, impl in _ops().items():
        schema_names = [a.name for a in op._schema.arguments]
        assert list(inspect.signature(impl).parameters) == schema_names, op
        assert extern_name(op) == "kiln_" + op._schema.name.removeprefix("kiln::")


def test_compiled_code_calls_the_implementation_directly():
    if not register_direct_calls():
        pytest.skip(f"torch {torch.__version__} has no custom extern-kernel codegen")
    from torch._inductor.utils import run_and_get_code

    inputs = _packed_linear_inputs()
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):
        compiled = torch.compile(_linear_then_add, backend="inductor", fullgraph=True)
        got, codes = run_and_get_code(compiled, *inputs)
    code = "\n".join(codes)
    assert "extern_kernels.kiln_int4_or_dense_mm(" in code
    assert "torch.ops.kiln.int4_or_dense_mm.default(" not in code  # no call through it
    torch.testing.assert_close(got, _linear_then_add(*inputs), rtol=0, atol=0)


def test_the_profiler_still_names_the_op():
    op = torch.ops.kiln.int4_or_dense_mm.default
    impl_calls = []

    def impl(*args):
        impl_calls.append(args)
        return op(*args)

    call = direct_call(op, impl)
    inputs = _packed_linear_inputs()
    args = (inputs[0], inputs[1], inputs[2], None, None, inputs[3], 32, 0)
    plain = call(*args)
    assert len(impl_calls) == 1  # called directly
    with profile() as prof:
        profiled = call(*args)
    assert len(impl_calls) == 1  # through the dispatcher, as the profiler needs
    assert "kiln::int4_or_dense_mm" in {e.key for e in prof.key_averages()}
    assert torch.equal(plain, profiled)
