"""Inductor's generated code calls kiln's ops' Python implementations directly.

Inductor leaves a custom op it cannot see into as a fallback kernel, and its Python wrapper
calls it as `torch.ops.kiln.<op>.default(...)`: through the dispatcher, which boxes every
argument, finds the op's one kernel (each kiln op has a single Python implementation,
registered as CompositeExplicitAutograd) and converts the arguments back to Python objects.
That round trip cost 3-6 us a call more than the direct call on the AMD EPYC dev machine
(benchmarks/op_call_cost.py), and a decode step of the embedded model makes 151 such calls (four
linears and attention in each of 30 layers, and the LM head). Registered here, the generated
line becomes `extern_kernels.kiln_<op>(...)`: the same implementation with the same arguments,
called as a Python function.

While torch's profiler runs, the call still goes through the dispatcher, so the profile names
the op (benchmarks/decode_step.py attributes time by those names). Where the installed torch
has no custom codegen registry for fallback kernels, nothing changes."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

EXTERN_PREFIX = "kiln_"


def _ops() -> dict[torch._ops.OpOverload, Callable]:
    """kiln's ops that Inductor may leave in a compiled piece, with their implementations."""
    from kiln.attention.cpu_backend import cpu_paged_attention
    from kiln.attention.torch_backend import torch_paged_attention
    from kiln.layers.bf16_kernel import _pairs_linear, _pairs_silu_mul
    from kiln.layers.gated_deltanet import _gdn_core
    from kiln.layers.moe import _moe_experts
    from kiln.layers.packed import _int4_or_dense_mm, int4_matmul
    from kiln.layers.packed_experts_op import _moe_experts_packed
    from kiln.layers.packed_kquant import kquant_matmul
    from kiln.layers.packed_q6k import q6k_matmul

    kiln = torch.ops.kiln
    return {
        kiln.cpu_paged_attention.default: cpu_paged_attention,
        kiln.torch_paged_attention.default: torch_paged_attention,
        kiln.bf16_mm.default: _pairs_linear,
        kiln.bf16_mm_silu_mul.default: _pairs_silu_mul,
        kiln.gdn_core.default: _gdn_core,
        kiln.moe_experts.default: _moe_experts,
        kiln.int4_mm.default: int4_matmul,
        kiln.int4_or_dense_mm.default: _int4_or_dense_mm,
        kiln.moe_experts_packed.default: _moe_experts_packed,
        kiln.q6k_mm.default: q6k_matmul,
        kiln.kquant_mm.default: kquant_matmul,
    }


def direct_call(op: torch._ops.OpOverload, impl: Callable) -> Callable:
    """`impl`, or the op through the dispatcher while the profiler records."""
    profiling = torch.autograd._profiler_enabled

    def call(*args, **kwargs):
        return op(*args, **kwargs) if profiling() else impl(*args, **kwargs)

    call.__name__ = extern_name(op)
    return call


def extern_name(op: torch._ops.OpOverload) -> str:
    return f"{EXTERN_PREFIX}{op._schema.name.partition('::')[2]}"


@functools.cache
def register_direct_calls() -> bool:
    """Idempotent; returns whether the generated code now calls the implementations directly."""
    try:
        from torch._inductor.codegen.custom_extern_kernel_codegen import (
            CUSTOM_EXTERN_KERNEL_CODEGEN,
            CustomCodegen,
        )
        from torch._inductor.select_algorithm import extern_kernels
    except ImportError:  # an older torch: the dispatcher stays
        logger.debug("no custom extern-kernel codegen in torch %s", torch.__version__)
        return False
    for op, impl in _ops().items():
        name = extern_name(op)
        setattr(extern_kernels, name, direct_call(op, impl))
        emit = functools.partial(_emit_call, f"extern_kernels.{name}")
        CUSTOM_EXTERN_KERNEL_CODEGEN[_python_kernel_name(op)] = CustomCodegen(python=emit)
    return True


def _python_kernel_name(op: torch._ops.OpOverload) -> str:
    """How Inductor names the op in its generated code: torch.ops.kiln.int4_mm.default."""
    return f"{op.__module__.replace('._ops.', '.ops.')}.{op.__name__}"


def _emit_call(callee: str, node, writeline: Callable[[str], None]) -> None:
    """The fallback kernel's line, as Inductor's Python wrapper writes it, with `callee`."""
    from torch._inductor import ir

    args = ", ".join([*node.codegen_args(), *node.codegen_kwargs()])
    if isinstance(node.layout, ir.NoneLayout):  # an op that returns nothing (it writes `out`)
        writeline(f"{callee}({args})")
    else:
        writeline(f"{node.get_name()} = {callee}({args})")
