"""Token embedding that can double as a tied LM head."""

import torch
import torch.nn.functional as F
from torch import nn

from kiln.layers.linear import onednn_linear, prepack_for_cpu


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, dim), requires_grad=False)
        self.packed_head: torch.Tensor | None = None

    def finalize(self, device: torch.device, used_as_lm_head: bool) -> None:
        """On the CPU a tied LM head runs fastest from oneDNN's packed layout (see Linear); the
        lookup table stays as it is, so this costs one more copy of the embedding."""
        if device.type == "cpu" and used_as_lm_head and self.packed_head is None:
            self.packed_head = prepack_for_cpu(self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    def as_lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed_head is not None:
            return onednn_linear(hidden, self.packed_head)
        return F.linear(hidden, self.weight)
