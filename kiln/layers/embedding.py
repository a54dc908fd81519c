"""Token embedding that can double as a tied LM head."""

import torch
import torch.nn.functional as F
from torch import nn


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, dim), requires_grad=False)
        self.transposed = False

    def finalize(self, device: torch.device, used_as_lm_head: bool) -> None:
        """On the CPU a tied LM head streams fastest from a [dim, vocab] layout (see Linear);
        lookups then gather columns of it, which costs nothing measurable."""
        if device.type == "cpu" and used_as_lm_head and not self.transposed:
            self.weight = nn.Parameter(self.weight.t().contiguous(), requires_grad=False)
            self.transposed = True

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.transposed:
            return self.weight.t()[input_ids]
        return F.embedding(input_ids, self.weight)

    def as_lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.transposed:
            return torch.matmul(hidden, self.weight)
        return F.linear(hidden, self.weight)
