"""Which kernel multiplies a bf16 model's linears on the CPU (`--cpu-linears`).

`finalize` gives every bf16 weight to kiln's own kernel where the CPU has AVX512-BF16
(kiln/layers/bf16_kernel.py): faster than oneDNN at every batch size measured, 1.5x at a
16-stream decode step's rows (docs/performance.md, "A bf16 kernel for the linears"). `onednn`
lays them out for oneDNN again, to compare the two or to step around the kernel."""

from __future__ import annotations

import logging

import torch
from torch import nn

from kiln.layers.bf16_kernel import describe_bf16_kernel
from kiln.layers.embedding import VocabEmbedding
from kiln.layers.linear import Linear

logger = logging.getLogger(__name__)

POLICIES = ("auto", "onednn")


def lay_out_cpu_linears(model: nn.Module, dtype: torch.dtype, policy: str) -> None:
    """After `model.finalize` on the CPU: keep what it chose (auto), or oneDNN everywhere."""
    if policy == "onednn":
        for module in model.modules():
            if isinstance(module, (Linear, VocabEmbedding)):
                module.use_onednn()
    if dtype == torch.bfloat16:
        kernel = "oneDNN (--cpu-linears onednn)" if policy == "onednn" else describe_bf16_kernel()
        logger.info("bf16 linears: %s", kernel)
