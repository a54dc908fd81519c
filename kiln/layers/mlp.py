"""The gated MLP of Llama-family models."""

import torch
import torch.nn.functional as F
from torch import nn

from kiln.layers.bf16_kernel import COLUMNS, pairs_silu_mul
from kiln.layers.linear import Linear


class SwiGLU(nn.Module):
    """silu(x W_gate) * (x W_up) W_down, gate and up fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate)
        self.down_proj = Linear(intermediate, hidden)
        # kiln's bf16 kernel combines gate and up a vector of 16 columns at a time
        self.fusable = intermediate % COLUMNS == 0

    def fused(self) -> bool:
        """Whether the activation runs inside the gate/up product (kiln's bf16 kernel, which
        the "pairs" layout means): silu(gate) * up from the float32 sums, rounded to bf16 once,
        where a separate op read and wrote gate and up at bf16 once more."""
        return self.gate_up_proj.layout == "pairs" and self.fusable

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused():
            return self.down_proj(pairs_silu_mul(x, self.gate_up_proj.weight, self.intermediate))
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)
