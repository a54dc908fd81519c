from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator

import torch

from kiln.layers.packed import QuantizedTensor
from kiln.loader.tokenizer import Tokenizer
from kiln.models.config import ModelConfig


class ModelSource(ABC):
    path: str
    config: ModelConfig

    @abstractmethod
    def tensors(
        self, dtype: torch.dtype, keep_packed: bool = False
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        """Checkpoint tensors under HF names, in `dtype`; with `keep_packed`, matrices stored
        in a packable format (4-bit planes, Q6_K) come as QuantizedTensor instead."""

    @abstractmethod
    def load_tokenizer(self) -> Tokenizer: ...
