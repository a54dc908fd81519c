from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator

import torch

from kiln.loader.tokenizer import Tokenizer
from kiln.models.config import ModelConfig


class ModelSource(ABC):
    path: str
    config: ModelConfig

    @abstractmethod
    def tensors(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint tensors under HF names, in `dtype`."""

    @abstractmethod
    def load_tokenizer(self) -> Tokenizer: ...
