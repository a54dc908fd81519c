"""Where a model's config, weights and tokenizer come from: a GGUF file or a local HF directory.
Nothing here downloads."""

from __future__ import annotations

import os

from kiln.default_model import default_model_path
from kiln.errors import ModelLoadError
from kiln.loader.gguf import GGUFSource
from kiln.loader.hf import HFDirectorySource
from kiln.loader.source import ModelSource


def open_model(model: str | None) -> ModelSource:
    """Open a model path; None means the embedded default model."""
    path = default_model_path() if model is None else os.path.expanduser(model)
    if os.path.isdir(path):
        return HFDirectorySource(path)
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ModelLoadError(
                f"{path!r} is a file but not a .gguf; pass a GGUF file or an HF directory"
            )
        return GGUFSource(path)
    raise ModelLoadError(
        f"model {model!r} not found: expected a .gguf file or a directory with config.json and "
        "*.safetensors (kiln never downloads weights)"
    )


__all__ = ["ModelSource", "default_model_path", "open_model"]
