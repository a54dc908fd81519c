"""Model architectures. `build_model` maps an architecture name to its implementation."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from kiln.attention import AttentionBackend
from kiln.errors import ModelLoadError
from kiln.models.config import HYBRID_ARCHITECTURES, SUPPORTED_ARCHITECTURES, ModelConfig
from kiln.models.interface import CausalModel
from kiln.models.llama import CausalLM
from kiln.models.qwen3_next import HybridCausalLM

_MODEL_CLASSES = {arch: CausalLM for arch in SUPPORTED_ARCHITECTURES}
_MODEL_CLASSES.update(dict.fromkeys(HYBRID_ARCHITECTURES, HybridCausalLM))


def build_model(cfg: ModelConfig, backend: AttentionBackend) -> CausalModel:
    if cfg.architecture not in _MODEL_CLASSES:
        raise ModelLoadError(
            f"unsupported architecture {cfg.architecture!r}; kiln supports "
            + ", ".join(SUPPORTED_ARCHITECTURES)
        )
    return _MODEL_CLASSES[cfg.architecture](cfg, backend)


T = TypeVar("T")


def build_on(device: torch.device, dtype: torch.dtype, factory: Callable[[], T]) -> T:
    """`factory()` with its parameters created on `device` in `dtype`."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return factory()
    finally:
        torch.set_default_dtype(default_dtype)


__all__ = ["SUPPORTED_ARCHITECTURES", "CausalModel", "ModelConfig", "build_model", "build_on"]
