"""The linear layer interface. A quantized implementation (W4A16, later) subclasses `Linear`
and overrides `load_weight`, `finalize` and `forward`; models only ever construct `Linear`.

After loading, `finalize` picks the layout the device runs fastest: on the CPU the weight is
stored transposed ([in, out], contiguous), which lets BLAS stream it at close to memory
bandwidth for the 1-2 row products of decode (measured 31 ms vs 45 ms a token for the
embedded model; see docs/performance.md)."""

import torch
import torch.nn.functional as F
from torch import nn

from kiln.errors import ModelLoadError


class Linear(nn.Module):
    """y = x W^T + b. `weight` is [out_features, in_features] while loading, like nn.Linear."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.transposed = False

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

    def finalize(self, device: torch.device) -> None:
        """Called once after every weight is loaded."""
        if device.type == "cpu" and not self.transposed:
            self.weight = nn.Parameter(self.weight.t().contiguous(), requires_grad=False)
            self.transposed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.transposed:
            y = torch.matmul(x, self.weight)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)
