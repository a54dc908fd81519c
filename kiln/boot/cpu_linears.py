"""Which kernel multiplies a bf16 model's linears on the CPU (`--cpu-linears`).

`finalize` gives every bf16 weight to kiln's own kernel where the CPU has AVX512-BF16 and no AMX
(kiln/layers/bf16_kernel.py): 1.4x oneDNN at a 16-stream decode step's rows, 2x at one row,
level at a prefill chunk's 528 (docs/performance.md, "A bf16 kernel for the linears"). `onednn`
lays them out for oneDNN again, to compare the two or to step around the kernel."""

from __future__ import annotations

import logging

import torch
from torch import nn

from kiln.layers.bf16_kernel import describe_bf16_kernel
from kiln.layers.embedding import VocabEmbedding
from kiln.layers.linear import Linear, onednn_runs

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
