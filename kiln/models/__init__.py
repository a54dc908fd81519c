"""Model architectures. `build_model` maps an architecture name to its implementation."""

from __future__ import annotations

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


__all__ = ["SUPPORTED_ARCHITECTURES", "CausalModel", "ModelConfig", "build_model"]
