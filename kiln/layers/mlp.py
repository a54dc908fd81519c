"""The gated MLP of Llama-family models."""

import torch
import torch.nn.functional as F
from torch import nn

from kiln.layers.linear import Linear


class SwiGLU(nn.Module):
    """silu(x W_gate) * (x W_up) W_down, gate and up fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate)
        self.down_proj = Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)
