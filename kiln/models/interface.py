"""What the engine needs of a model, whatever its architecture: the runner, the boot, the KV
cache sizing and the compile-cache key see this protocol, never a model class."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, Self

import torch

from kiln.attention import Attention, AttentionMetadata
from kiln.layers.gated_deltanet import GatedDeltaNet
from kiln.models.config import ModelConfig


class CausalModel(Protocol):
    config: ModelConfig

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The final hidden state of every token of the flat batch ([tokens, hidden]); the
        token dimension is dynamic (compiled once for every batch size)."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of the rows the sampler needs."""
        ...

    def finalize(self, device: torch.device) -> None:
        """Called once after every weight is loaded: the device's fastest weight layout."""
        ...

    def attention_layers(self) -> list[Attention]:
        """The layers that own a paged KV cache, in order: one cache per entry is bound."""
        ...

    def linear_layers(self) -> list[GatedDeltaNet]:
        """The layers with a fixed-size state per sequence (hybrid models), in order; the runner
        binds each its state tensors, indexed by state slot. Empty for attention-only models."""
        ...

    # what an nn.Module has: the compile cache keys on the tensors' names, shapes and dtypes
    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]: ...

    def named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]: ...

    def eval(self) -> Self: ...
