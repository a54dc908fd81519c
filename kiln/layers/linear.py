"""The linear layer interface. A quantized implementation (W4A16, later) subclasses `Linear`
and overrides `load_weight` and `forward`; models only ever construct `Linear`."""

import torch
import torch.nn.functional as F
from torch import nn

from kiln.errors import ModelLoadError


class Linear(nn.Module):
    """y = x W^T + b, with W stored [out_features, in_features] like nn.Linear."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    def load_weight(self, name: str, weight: torch.Tensor, rows: slice | None = None) -> None:
        """Copy `weight` into rows `rows` of this layer (fused layers load their parts by rows)."""
        target = self.weight if rows is None else self.weight[rows]
        if tuple(weight.shape) != tuple(target.shape):
            raise ModelLoadError(
                f"tensor {name!r} has shape {tuple(weight.shape)}, expected {tuple(target.shape)}"
            )
        target.copy_(weight)

    def load_bias(self, name: str, bias: torch.Tensor, rows: slice | None = None) -> None:
        if self.bias is None:
            raise ModelLoadError(f"tensor {name!r} is a bias but this layer was built without one")
        target = self.bias if rows is None else self.bias[rows]
        if tuple(bias.shape) != tuple(target.shape):
            raise ModelLoadError(
                f"tensor {name!r} has shape {tuple(bias.shape)}, expected {tuple(target.shape)}"
            )
        target.copy_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)
