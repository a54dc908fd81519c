"""Which kernel multiplies a bf16 model's linears on the CPU (`--cpu-linears`), and how the
rows of a decode step meet packed weights there (`--packed-activations`).

`finalize` gives every bf16 weight to kiln's own kernel where the CPU has AVX512-BF16
(kiln/layers/bf16_kernel.py): 1.4x oneDNN at a 16-stream decode step's rows, 2x at one row,
level at a prefill chunk's 528 (docs/performance.md, "A bf16 kernel for the linears"); on a CPU
with AMX it multiplies on the tiles, 1.4-1.5x oneDNN's AMX path up to 64 rows. `onednn`
lays them out for oneDNN again, to compare the two or to step around the kernel."""

from __future__ import annotations

import logging

import torch
from torch import nn

from kiln.errors import ConfigError
from kiln.layers.bf16_kernel import describe_bf16_kernel
from kiln.layers.cpu_int4_layout import cpu_block_n
from kiln.layers.embedding import VocabEmbedding
from kiln.layers.int4_kernel import int4_matmul_kernel
from kiln.layers.linear import Linear, onednn_runs
from kiln.layers.packed import PackedWeight
from kiln.layers.packed_experts import KERNEL_LAYOUTS, PackedExperts
from kiln.layers.packed_kquant import PackedKQuant
from kiln.layers.packed_q6k import PackedQ6K

logger = logging.getLogger(__name__)


def lay_out_cpu_linears(model: nn.Module, dtype: torch.dtype, policy: str) -> None:
    """After `model.finalize` on the CPU: keep what it chose (auto), or oneDNN everywhere."""
    if policy == "onednn":
        for module in model.modules():
            if isinstance(module, (Linear, VocabEmbedding)):
                module.use_onednn()
    if dtype == torch.bfloat16:
        logger.info("bf16 linears: %s", _describe(policy))


def _describe(policy: str) -> str:
    library = "oneDNN" if onednn_runs(torch.bfloat16) else "BLAS (no native oneDNN bf16 here)"
    if policy == "onednn":
        return f"{library} (--cpu-linears onednn)"
    return describe_bf16_kernel(library)


# --packed-activations: int8 planes per 32 columns of a row (16 bits of each value in two planes)
INT8_PLANES = {"float": 0, "int16": 2, "int8": 1, "auto": 2}


def choose_packed_activations(model: nn.Module, policy: str, strict: bool) -> str | None:
    """How every packed weight's decode rows go into kiln's int4 kernel: as float32 (`float`),
    as two int8 planes (`int16`, and `auto` where the kernel has the AVX512-VNNI int8 path) or
    one (`int8`); a description for the boot log, None when the model has no packed weight. int8
    or int16 on a CPU without the path is a warning (an error with `strict`): rows stay float."""
    packed = [m for m in model.modules() if isinstance(m, (PackedWeight, PackedExperts))]
    if not packed:
        return None
    kernel = int4_matmul_kernel()
    available = kernel is not None and kernel.int8_rows_for(cpu_block_n())
    if policy in ("int8", "int16") and not available:
        message = (
            f"--packed-activations {policy}: kiln's int4 kernel has no int8 path on this CPU "
            "(it needs AVX512-VNNI with AVX512-VBMI, or AVX2 without AVX-512), so decode rows "
            "stay float32. Remedy: --packed-activations float (or auto)"
        )
        if strict:
            raise ConfigError(message)
        logger.warning(message)
    planes = INT8_PLANES[policy] if available else 0
    if policy == "auto" and kernel is not None and kernel.isa < 2:
        planes = 0  # AVX2's two planes are no faster than float32 rows (docs/performance.md)
    for module in packed:
        module.int8_planes = planes
    described = {0: "float32", 1: "one int8 plane (8 bits)", 2: "two int8 planes (16 bits)"}
    own = " (Q6_K, Q5_K, Q4_K: two int8 planes)" if planes == 0 and any(
        isinstance(m, (PackedQ6K, PackedKQuant)) or getattr(m, "form", 0) in KERNEL_LAYOUTS
        for m in packed) else ""  # fmt: skip
    return f"as {described[planes]} per 32 columns{own} (--packed-activations {policy})"
